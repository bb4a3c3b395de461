"""LoRA adapters folded into the weights for sampling and weight syncs, with the frozen base never written.

PEFT's `merge_adapter()` adds the adapters' delta to the base weights in place and `unmerge_adapter()` subtracts it
again. In bf16 the two roundings do not cancel: TRL merges and unmerges around every vLLM weight sync, and the
"frozen" base drifts a little more each time (measured: docs/results.md#lora-on-cpu-the-frozen-base-after-training).
Here nothing is added in place:

- `merged_adapters(model)`: inside the block each targeted base parameter holds a new tensor `W + delta` (its
  original storage is kept aside, untouched) and PEFT's layers take their merged path; on exit the original storage
  goes back. Costs one extra copy of the targeted weights for the duration of the block, no compute on exit.
- `exact_sync_stream(model, stream)`: wraps a `(name, tensor)` stream of a weight sync (TRL's) and swaps each
  targeted base tensor for `W + delta`, one parameter at a time; TRL's own merge and unmerge do nothing meanwhile.
  Costs the tensor being sent plus one slice of its delta (`effective_weight`); a pass whose tensors are not sent
  (`build=False`: a metadata pass, a rank that only joins the gathers) builds nothing.

`W + delta` is exactly the tensor PEFT's active forward builds for a parameter targeted directly (fused MoE experts,
`target_parameters`): PEFT's own code builds it, so a forward with those weights merged equals the active forward
bit for bit (a no-grad pass that reuses them for several micro-batches builds them once). For `nn.Linear` layers
(`target_modules`) the active forward never forms `W + delta` (it adds `B(A(x))` to the output), so merged and
active forwards differ by rounding; merging them follows PEFT's `merge_adapter` arithmetic. Knows nothing of TRL.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["AdapterTarget", "LoraMergeError", "adapter_targets", "effective_weight", "exact_sync_stream",
           "merge_calls_skipped", "merged_adapters", "model_is_whole",
           "unmergeable_layers"]


class LoraMergeError(RuntimeError):
    """Adapters cannot be folded into the weights safely (the message names the cause and the fix)."""


@dataclass(eq=False)
class AdapterTarget:
    """One base parameter with LoRA adapters on it: `getattr(owner, name)`, adapted by the PEFT layer `layer`."""

    layer: torch.nn.Module
    owner: torch.nn.Module
    name: str
    expert_stack: bool  # a parameter targeted directly (`lora.ParamWrapper`, e.g. fused MoE experts)
    token_rows: bool = False  # an embedding with trained rows (`TrainableTokensLayer`)

    @property
    def parameter(self) -> torch.nn.Parameter:
        return self.owner._parameters[self.name]


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every PEFT tuner layer (LoRA, trainable token rows, other tuners): what PEFT's `merge_adapter()` folds."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def _active(layer) -> list[str]:
    adapters = layer.lora_A if hasattr(layer, "lora_A") else getattr(layer, "trainable_tokens_delta", {})
    return [name for name in layer.active_adapters if name in adapters]


def _kind(layer) -> str | None:
    """"experts" (`ParamWrapper`), "linear" (plain `lora.Linear`), "tokens" (`trainable_token_indices`), or None when
    this module cannot fold it."""
    from peft.tuners.lora.layer import Linear, ParamWrapper

    if isinstance(layer, ParamWrapper):
        return "experts"
    if type(layer).__name__ == "TrainableTokensLayer":
        return "tokens"
    plain = not any(getattr(layer, "lora_variant", {}).get(name) for name in _active(layer)) and not any(
        getattr(layer, "lora_bias", {}).get(name) for name in _active(layer))
    return "linear" if type(layer) is Linear and plain else None


def unmergeable_layers(model: torch.nn.Module) -> list[str]:
    """Class names of the model's PEFT tuner layers with active adapters that this module cannot fold (DoRA and other
    LoRA variants, adapter biases, LoRA on embeddings or convolutions, tuners other than LoRA): those keep PEFT's own
    paths."""
    return sorted({type(layer).__name__ for layer in _tuner_layers(model)
                   if layer.active_adapters and not layer.disable_adapters and _kind(layer) is None})


def adapter_targets(model: torch.nn.Module, experts_only: bool = False) -> list[AdapterTarget]:
    """The base parameters whose adapters `merged_adapters` folds: every plain `lora.Linear`, every `lora.ParamWrapper`
    and every embedding with trained token rows (`trainable_token_indices`) with active, enabled, not yet merged
    adapters (`experts_only`: the `ParamWrapper`s alone)."""
    targets = []
    for layer in _tuner_layers(model):
        kind = _kind(layer)
        if kind is None or not _active(layer) or layer.disable_adapters or layer.merged:
            continue
        if experts_only and kind != "experts":
            continue
        if kind == "tokens" and layer.tied_adapter is not None:  # the same weight as the layer it is tied to
            continue
        owner = layer.get_base_layer()
        name = layer.parameter_name if kind == "experts" else "weight"
        targets.append(AdapterTarget(layer, owner, name, kind == "experts", kind == "tokens"))
    return targets


def _forward_time_weight(layer, weight: torch.Tensor) -> torch.Tensor:
    """What PEFT's `ParamWrapper._activate_lora` makes the parameter during an active forward (the same choice of
    PEFT's proxies, applied directly: registering PEFT's parametrization would change the module's parameter dict,
    which a sync may be iterating). `tests/test_lora_merge.py` checks the result against the active forward, bit for
    bit, so a PEFT release that changes its forward fails there."""
    from peft.tuners.lora import layer as lora_layer
    from peft.utils import UPCAST_DTYPES

    adapters = _active(layer)
    low_precision = any(getattr(torch, name, None) == weight.dtype for name in UPCAST_DTYPES)
    if len(adapters) == 1 and layer.num_experts > 1 and not low_precision:
        return lora_layer._LoraFactorsProxy(*layer.get_delta_factors(adapters[0]))(weight)
    delta = functools.reduce(torch.add, [layer.get_delta_weight(name) for name in adapters])
    return lora_layer._LoraParameterProxy(delta)(weight)


def _linear_delta_rows(layer, name: str, rows: slice) -> torch.Tensor:
    """Rows `rows` of PEFT's `Linear.get_delta_weight(name)`, by PEFT's arithmetic: `(B[rows] @ A) * scaling`, in
    float32 when bf16/fp16 adapters sit on a CPU, then in the adapters' dtype."""
    weight_a, weight_b = layer.lora_A[name].weight, layer.lora_B[name].weight[rows]
    dtype = weight_b.dtype
    upcast = weight_b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if upcast:
        weight_a, weight_b = weight_a.float(), weight_b.float()
    delta = (weight_b @ weight_a).mul_(layer.scaling[name])
    return delta.to(dtype) if upcast else delta


SLICES_PER_WEIGHT = 16  # an attention weight's W + delta is built this many rows at a time: one temporary of 1/16


def _linear_effective_weight(target: AdapterTarget) -> torch.Tensor:
    """`W + delta` of a plain `lora.Linear`, as PEFT's merge computes it (`W += delta`, added in the wider dtype and
    rounded once per adapter), written into one new tensor of W's dtype a slice of rows at a time: the memory it
    takes beyond the result is one slice's delta, not a full-size delta and a full-size sum."""
    layer, weight = target.layer, target.parameter
    if layer.fan_in_fan_out:  # W is stored transposed (GPT-2's Conv1D): PEFT's own arithmetic, whole
        merged = weight
        for name in _active(layer):
            merged = (merged + layer.get_delta_weight(name)).to(weight.dtype)
        return merged.detach()
    result = torch.empty_like(weight)
    step = max(1, -(-weight.shape[0] // SLICES_PER_WEIGHT))
    for start in range(0, weight.shape[0], step):
        rows = slice(start, start + step)
        source = weight[rows]
        for name in _active(layer):
            torch.add(source, _linear_delta_rows(layer, name, rows), out=result[rows])
            source = result[rows]
    return result


def effective_weight(target: AdapterTarget) -> torch.Tensor:
    """`W + delta` of one target, detached, as a new tensor of W's dtype (`W` is not written). Fused experts: the
    tensor PEFT's active forward builds (one `baddbmm` into the result for one adapter). Attention: built a slice of
    rows at a time (`_linear_effective_weight`). Beyond the result, a build holds at most a slice's delta, so a
    sync's extra memory is about one adapted tensor (benchmarks/lora_sync.py measures it)."""
    with torch.no_grad():
        if target.expert_stack:
            return _forward_time_weight(target.layer, target.parameter).detach()
        if target.token_rows:  # PEFT's merge: the trained rows replace the base's, out of place, exact
            weight, layer = target.parameter, target.layer
            for name in _active(layer):
                rows = torch.tensor(layer.token_indices[name], device=weight.device)
                weight = weight.index_copy(0, rows, layer.trainable_tokens_delta[name].to(weight))
            return weight.detach()
        return _linear_effective_weight(target)


def model_is_whole(model: torch.nn.Module) -> bool:
    """True when every parameter is a full local tensor, as folding needs. A shard is told by what the sharding
    leaves on it, never by its shape (PEFT's `target_parameters` may be 2-D or 3-D): an FSDP2 DTensor, a ZeRO-3
    parameter outside a gather, or anything FSDP v1 manages (an FSDP module in the tree, or, with only the root
    wrapped and unwrapped, parameters it marks `_fsdp_flattened`). FSDP v1 counts as sharded even while gathered: its
    parameters are views into flat buffers it rewrites (with `use_orig_params=False`, plain tensors over freed
    storage between forwards), so a folded weight would not stay."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor
    except ImportError:
        DTensor = FullyShardedDataParallel = ()
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return False
    for param in model.parameters():
        if isinstance(param, DTensor) or getattr(param, "_fsdp_flattened", False):
            return False
        if hasattr(param, "ds_id") and (param.numel() == 0 or getattr(param.ds_status, "name", "") != "AVAILABLE"):
            return False
    return True


@contextlib.contextmanager
def merged_adapters(model: torch.nn.Module, experts_only: bool = False,
                    cache: dict | None = None) -> Iterator[list[AdapterTarget]]:
    """Run the block with the adapters folded into the weights (see the module docstring); yields the targets.

    Args:
        model: a PEFT model (or any module containing PEFT LoRA layers), whole on this device (`model_is_whole`).
        experts_only: fold only parameters targeted directly (fused MoE experts): a forward then equals the active
            forward bit for bit, as the attention layers keep PEFT's active path.
        cache: a dict kept by the caller for as long as the adapters do not change (e.g. one rollout): experts'
            `W + delta` are built once into it and reused by later blocks.

    The original storage of every targeted parameter is restored on exit, also when the block raises: the base is
    never written. Adapters must not change inside the block (their gradients would not reach them).
    """
    targets = adapter_targets(model, experts_only)
    kept = []  # (target, original storage, merged adapters before)
    try:
        for target in targets:
            if target.expert_stack and cache is not None:
                key = (target.layer, target.name, tuple(_active(target.layer)))
                if key not in cache:
                    cache[key] = effective_weight(target)
                weight = cache[key]
            else:
                weight = effective_weight(target)
            parameter = target.parameter
            kept.append((target, parameter.data, list(target.layer.merged_adapters)))
            parameter.data = weight
            target.layer.merged_adapters = _active(target.layer)  # PEFT's forward now skips the adapters
        yield targets
    finally:
        for target, original, merged_before in reversed(kept):
            target.parameter.data = original
            target.layer.merged_adapters = merged_before


def _key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype


@contextlib.contextmanager
def merge_calls_skipped(model: torch.nn.Module):
    """PEFT's `merge_adapter`/`unmerge_adapter` do nothing inside the block (instance attributes over the methods)."""
    names = ("merge_adapter", "unmerge_adapter")
    had = {name: name in vars(model) for name in names}
    for name in names:
        setattr(model, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in names:
            if not had[name]:
                delattr(model, name)


def exact_sync_stream(model: torch.nn.Module, stream: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                      build: bool = True, errors: list[BaseException] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of `stream()`, a weight sync that would merge the adapters in place with PEFT's
    `merge_adapter()` (TRL's), with that merge skipped and each targeted base tensor replaced by its `W + delta`,
    built when it is reached. A tensor is recognised by its storage, so the stream must hand out the parameters'
    own tensors (`param.data`, `param.detach()`): a stream that copies them (FSDP2's `full_tensor()`, an offloaded
    parameter moved to the device) would leave adapters out, and raises `LoraMergeError` at its end instead.

    `build=False` is for a pass whose tensors nobody sends (the server's metadata pass reads names, dtypes and shapes;
    a non-main rank only joins the gathers): each adapted base tensor is handed out as it is, which has the dtype and
    shape of its `W + delta`, and the adapters are still matched, so that pass raises where a sending one would.

    `errors`: for a consumer that must receive every announced tensor or wait forever (a vLLM server's packed
    transfer): a failure is appended there instead of raised, the tensor's base weight goes in its place, and the
    stream ends normally; the caller raises once the transfer is complete."""
    with merge_calls_skipped(model):
        targets = None
        sent = set()
        for name, tensor in stream():
            if targets is None:  # built at the first pair: the stream may gather sharded parameters when it starts
                targets = {_key(target.parameter): target for target in adapter_targets(model)}
            target = targets.get(_key(tensor))
            if target is not None:
                sent.add(target)
                if build:
                    try:
                        tensor = effective_weight(target)
                    except Exception as error:
                        if errors is None:
                            raise
                        errors.append(LoraMergeError(f"building `W + delta` of {name} for the weight sync failed "
                                                     f"({type(error).__name__}: {error})"))
                        errors[-1].__cause__ = error
            yield name, tensor
        missing = [target for target in (targets or {}).values() if target not in sent]
        if missing:
            names = sorted({type(t.owner).__name__ + "." + t.name for t in missing})
            error = LoraMergeError(
                f"the weight sync sent {len(missing)} adapted base tensors ({names[:3]}) without their adapters: "
                "the stream copied them instead of handing out the parameters. Fix: set "
                "`exact_lora_merge=False` to fall back to PEFT's in-place merge (the base drifts by rounding).")
            if errors is None:
                raise error
            errors.append(error)
