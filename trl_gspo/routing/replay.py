"""Record which experts each token used, and force the same experts in a later forward (routing replay).

Works on stock transformers 5.x MoE models whose routers return `(logits, weights, indices)`, by hooks on the
router modules: nothing in the model is patched, and the experts implementation (eager, batched_mm, grouped_mm)
does not matter because the experts only ever see the (forced) indices and weights. While a router runs under
replay, its top-k over the experts returns the forced experts (a `TorchFunctionMode` active for that router call
only), so the router computes their gate weights with its own code; a router that picks its experts another way has
its output replaced with its family's gate formula (trl_gspo/routing/formulas.py). Knows nothing of TRL.

    rr = RoutingReplay(model)
    with rr.record() as rec:              # rec.indices: [batch, seq_len, moe_layers, top_k], uint8
        model(input_ids=ids, attention_mask=mask)
    with rr.replay(rec.indices):          # same experts; gate weights recomputed from the live router logits
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    rr.drift                              # per layer: fraction of tokens whose top-k set replay overrode
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .formulas import CANDIDATES, KNOWN_ROUTERS, TRIPLE, UNSUPPORTED_ROUTERS, GateFormula, OutputLayout, reproduces

__all__ = ["RoutingReplay", "Recording", "RoutingReplayError", "drift_statistics", "find_routers", "route_changes"]


def drift_statistics(token_counts: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`(drift per layer, overridden fraction)` from `[layers, 3]` counts of (drifted, overridden, counted) tokens.
    Counts add up across micro-batches and ranks; fractions do not, so reduce counts first."""
    drifted, overridden, counted = token_counts.double().unbind(-1)
    return (drifted / counted.clamp(min=1)).float(), float(overridden.sum() / counted.sum().clamp(min=1))


def route_changes(indices: torch.Tensor, other: torch.Tensor, per_layer: bool = False) -> torch.Tensor:
    """Which tokens were routed to a different set of experts in two recordings of the same inputs.

    Args:
        indices: `[batch, seq_len, moe_layers, top_k]` expert indices of one pass (e.g. `Recording.indices` of the
            old-policy pass). The order of the k experts within a token is ignored: only the set counts, as it is
            the set that decides which experts run.
        other: the same for the other pass (e.g. the training pass), same shape.
        per_layer: return `[batch, seq_len, moe_layers]` (changed in that layer) instead of `[batch, seq_len]`
            (changed in at least one layer).

    Returns a bool tensor. Its mean over real tokens is the routing drift between the two passes.
    """
    if indices.dim() != 4 or indices.shape != other.shape:
        raise RoutingReplayError(
            f"route_changes needs two recordings of the same inputs, each [batch, seq_len, moe_layers, top_k]; got "
            f"{tuple(indices.shape)} and {tuple(other.shape)}. Fix: record both passes on identical (padded) inputs."
        )
    changed = (indices.long().sort(-1).values != other.to(indices.device).long().sort(-1).values).any(-1)
    return changed if per_layer else changed.any(-1)


def _fold_counts(weight: torch.Tensor, keep: torch.Tensor | None, recorded_sets: torch.Tensor,
                 natural: list) -> torch.Tensor:
    """`[layers, 3]` (drifted, overridden, counted) weighted token counts of one replayed forward call, on the call's
    input device. A token drifted in a layer when the layer's natural top-k set (`natural[layer]`, `[tokens, k]`)
    differs from the recorded one (`recorded_sets`, `[layers, tokens, k]`, sorted); it was overridden when it also
    was forced (`keep` `[tokens, 1]`, None: all). `weight` is the float64 weight of each token."""
    natural = torch.stack([indices.to(weight.device) for indices in natural]).sort(-1).values
    drifted = (recorded_sets.to(weight.device) != natural).any(-1)
    overridden = drifted if keep is None else drifted & keep.reshape(1, -1)
    return torch.stack([drifted.double() @ weight, overridden.double() @ weight,
                        weight.sum().expand(len(drifted))], dim=1)


class _ForcedTopK(TorchFunctionMode):
    """Active while one router runs under `replay()`: its top-k over the experts (`[tokens, experts]` in,
    `[tokens, k]` out) returns the forced experts instead, with the values of its own input there (one gather). The
    router then computes its gate weights with its own code, so they are bit-identical to the router's wherever the
    forced experts are its natural ones, and replay needs no formula of its own. The natural indices are kept for
    the drift statistics."""

    def __init__(self, forced: torch.Tensor, keep: torch.Tensor | None, num_experts: int):
        super().__init__()
        self.forced, self.keep, self.num_experts = forced, keep, num_experts
        self.natural: torch.Tensor | None = None  # what the top-k chose
        self.returned: torch.Tensor | None = None  # what it returned instead
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.topk or func is torch.Tensor.topk) and args[0].dim() == 2 \
                and args[0].shape[-1] == self.num_experts and out.indices.shape == self.forced.shape:
            self.hits += 1
            self.natural = out.indices
            forced = self.forced if self.keep is None else torch.where(self.keep, self.forced, out.indices)
            self.returned = forced
            return torch.return_types.topk((args[0].gather(-1, forced), forced))
        return out


class RoutingReplayError(RuntimeError):
    """Routing replay cannot be applied safely (the message names the cause and the fix)."""


def _router_class(model) -> type | None:
    recorders = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    return getattr(recorder, "target_class", None) if recorder is not None else None


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's MoE router modules, in forward order. Uses transformers' own output recorders
    (`_can_record_outputs["router_logits"]`) and falls back to the known router classes."""
    targets = set()
    for module in model.modules():
        cls = _router_class(module)
        if cls is not None:
            targets.add(cls)
    found = []
    for name, module in model.named_modules():
        if type(module) in targets or type(module).__name__ in KNOWN_ROUTERS:
            found.append((name, module))
    return found


@dataclass
class Recording:
    """Expert choices of every token in every MoE layer: `indices[b, s, layer, k]` (uint8 for <= 256 experts)."""

    indices: torch.Tensor
    layer_names: list[str] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> int:
        return self.indices[0, 0].numel() * self.indices.element_size()


class RoutingReplay:
    """Record/replay MoE expert choices on a transformers model. See the module docstring.

    Args:
        model: a transformers MoE model (or a module containing one, e.g. a PEFT wrapper).
        offload_to_cpu: keep recordings of accelerator tensors in pinned host memory instead of on the device
            (one copy per `record()` block, waited for at its end).
    """

    def __init__(self, model: torch.nn.Module, offload_to_cpu: bool = False):
        self.model = model
        self.offload_to_cpu = offload_to_cpu
        routers = find_routers(model)
        if not routers:
            names = {type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()}
            raise RoutingReplayError(
                f"{type(model).__name__} has no MoE router that routing replay can drive"
                + (f" (found {sorted(names)}; PhiMoE-style sparsemixer routers are not supported)" if names else "")
                + ". Fix: use routing replay only with a supported Mixture-of-Experts model (see docs/routing.md)."
            )
        unsupported = sorted({type(m).__name__ for _, m in routers} & UNSUPPORTED_ROUTERS.keys())
        if unsupported:
            raise RoutingReplayError(
                f"{unsupported[0]} cannot be replayed: {UNSUPPORTED_ROUTERS[unsupported[0]]}. Fix: train this model "
                "without routing replay (GSPO does not need it), or use a supported MoE family (docs/routing.md)."
            )
        if getattr(model, "use_kernels", False):
            raise RoutingReplayError(
                "the model was loaded with `use_kernels=True`: hub kernels replace the whole MoE block and never "
                "call the router, so replay would silently do nothing. Fix: load the model without `use_kernels`."
            )
        no_choice = sorted({type(m).__name__ for _, m in routers
                            if not (hasattr(m, "top_k") and hasattr(m, "num_experts"))})
        if no_choice:  # e.g. transformers 5.20's Jamba: the router is a bare Linear and top-k happens in the MoE block
            raise RoutingReplayError(
                f"{type(model).__name__}'s router module ({no_choice[0]}) only computes logits; experts are chosen "
                "elsewhere, so replay cannot force them. The installed transformers may predate the router API that "
                "trl-gspo drives. Fix: install the transformers version pinned in trl-gspo's requirements, or set "
                "routing_replay='none'."
            )
        self.layer_names = [name for name, _ in routers]
        self.routers = [module for _, module in routers]
        shapes = {(int(r.top_k), int(r.num_experts)) for r in self.routers}
        if len(shapes) != 1:
            raise RoutingReplayError(
                f"the MoE layers differ in (top_k, num_experts): {sorted(shapes)}; recordings need one shape for all "
                "layers. Fix: use routing replay with a model whose MoE layers share top_k and num_experts."
            )
        (self.top_k, self.num_experts), = shapes
        self.index_dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        self._formulas: dict[type, GateFormula] = {}
        self.token_counts: torch.Tensor | None = None  # [layers, 3] float64 of the last replay, on the device
        self._handles: list = []
        self._guard_handles: list = []

    @property
    def drift(self) -> torch.Tensor | None:
        """Per layer, the fraction of counted tokens of the last `replay()` whose natural top-k set differed from the
        recorded one (on the host: reading it waits for the device)."""
        return None if self.token_counts is None else drift_statistics(self.token_counts.cpu())[0]

    @property
    def overridden_fraction(self) -> float | None:
        """The fraction of counted (token, layer) pairs the last `replay()` changed (reading it waits for the
        device)."""
        return None if self.token_counts is None else drift_statistics(self.token_counts.cpu())[1]

    def _checkpointing(self) -> bool:
        for attribute in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # new name first
            if hasattr(type(self.model), attribute) or attribute in vars(self.model):
                return bool(getattr(self.model, attribute))
        return False

    @staticmethod
    def _layout(router) -> OutputLayout:
        family = KNOWN_ROUTERS.get(type(router).__name__)
        return family.layout if family is not None else TRIPLE

    def _unpack(self, router) -> Callable:
        """The router's output as `(logits, weights, indices)`, checked for shape and dtype: a transformers release
        that reorders or reshapes router outputs must fail here with a clear error, not deep inside a gather."""
        def unpack(output):
            try:
                logits, weights, indices = self._layout(router).unpack(router, output)
                well_formed = (
                    logits.is_floating_point() and weights.is_floating_point() and not indices.is_floating_point()
                    and weights.shape == indices.shape == (logits.shape[0], self.top_k)
                    and logits.dim() == 2 and logits.shape[-1] == self.num_experts
                )
            except (TypeError, ValueError, AttributeError, IndexError, RuntimeError):
                well_formed = False
            if not well_formed:
                raise RoutingReplayError(
                    f"{type(router).__name__} does not return (router_logits [tokens, {self.num_experts}], "
                    f"weights [tokens, {self.top_k}], expert indices [tokens, {self.top_k}]) as this version of "
                    "trl-gspo expects; the installed transformers may have changed its router. Fix: install the "
                    "transformers version pinned in trl-gspo's requirements, or set routing_replay='none'."
                )
            return logits, weights, indices
        return unpack

    # ------------------------------------------------------------------ formulas
    def _formula(self, router, logits, weights, indices) -> GateFormula:
        cls = type(router)
        if cls not in self._formulas:
            family = KNOWN_ROUTERS.get(cls.__name__)
            known = family.formula if family is not None else None
            candidates = (known,) if known is not None else CANDIDATES
            # Without autograd: the check runs on the first forward only, and ops it recorded there would make a
            # checkpointed layer save more tensors in that forward than in its recomputation (CheckpointError).
            with torch.no_grad():
                match = next((f for f in candidates if reproduces(f, router, logits, weights, indices)), None)
            if match is None:
                raise RoutingReplayError(
                    f"{cls.__name__}: "
                    + (f"the expected gate formula ({known.name}) no longer reproduces the router's own weights; "
                       "transformers may have changed it." if known else
                       "no known gate-weight formula reproduces this router's weights, so replayed weights "
                       "could not be trusted.")
                    + " Fix: pin a tested transformers version or add the router's formula to "
                    "trl_gspo/routing/formulas.py."
                )
            self._formulas[cls] = match
        return self._formulas[cls]

    # ------------------------------------------------------------------ hooks
    def _install(self, router_hook, model_hook, router_pre_hook=None) -> None:
        self._remove()
        self._disarm_guard()
        self._handles.append(self.model.register_forward_pre_hook(model_hook, with_kwargs=True))
        for layer, router in enumerate(self.routers):
            if router_pre_hook is not None:
                self._handles.append(router.register_forward_pre_hook(
                    lambda module, args, layer=layer: router_pre_hook(layer, module, args)))
            self._handles.append(router.register_forward_hook(
                lambda module, args, output, layer=layer: router_hook(layer, module, output),
                always_call=router_pre_hook is not None))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _arm_guard(self) -> None:
        """After a `replay()` block closed with checkpoint recomputations still owed: a router re-run by backward
        would now route naturally and give wrong gradients (or a CheckpointError), so fail with the fix instead.
        Disarmed by the next forward call of the model or the next `record()`/`replay()`."""

        def router_guard(module, args, output):
            if torch._C._current_graph_task_id() != -1:
                self._disarm_guard()
                raise RoutingReplayError(
                    "a `replay()` block was closed before backward() had finished, with gradient checkpointing on: "
                    "backward re-runs the routers and they would no longer see the forced experts. Fix: call "
                    "backward() inside the `replay()` block."
                )

        self._guard_handles = [router.register_forward_hook(router_guard) for router in self.routers]
        self._guard_handles.append(self.model.register_forward_pre_hook(lambda *_: self._disarm_guard()))

    def _disarm_guard(self) -> None:
        for handle in self._guard_handles:
            handle.remove()
        self._guard_handles = []

    @staticmethod
    def _batch_shape(args, kwargs) -> tuple[int, int, torch.device]:
        for key in ("input_ids", "inputs_embeds"):
            tensor = kwargs.get(key)
            if tensor is not None:
                return tensor.shape[0], tensor.shape[1], tensor.device
        if args and torch.is_tensor(args[0]):
            return args[0].shape[0], args[0].shape[1], args[0].device
        raise RoutingReplayError("could not find `input_ids` or `inputs_embeds` in the model call.")

    # ------------------------------------------------------------------ record
    @contextlib.contextmanager
    def record(self):
        """Record the experts chosen in every forward call inside the block; `.indices` is filled on exit."""
        recording = Recording(indices=torch.empty(0), layer_names=list(self.layer_names))
        calls: list[tuple[int, int, list]] = []

        def model_hook(module, args, kwargs):
            batch, length, _ = self._batch_shape(args, kwargs)
            calls.append((batch, length, [None] * len(self.routers)))

        def router_hook(layer, router, output):
            logits, weights, indices = self._unpack(router)(output)
            self._formula(router, logits, weights, indices)  # verify once per router class
            if not calls:
                raise RoutingReplayError("a router ran outside a call of the model given to RoutingReplay.")
            calls[-1][2][layer] = indices.detach().to(self.index_dtype)

        self._install(router_hook, model_hook)
        try:
            yield recording
        finally:
            self._remove()
        recording.indices = self._offload(self._assemble(calls))

    def _offload(self, tensor):
        """The recording in host memory when `offload_to_cpu`: one copy per recorded block, into pinned memory so
        that replay's copy back to the device does not block. The copy is waited for here: the host reads the
        recording next (TRL shuffles and splits the batch on the host), and an asynchronous copy still in flight
        would hand it whatever the buffer held before."""
        if not self.offload_to_cpu or tensor.device.type == "cpu":
            return tensor  # already in host memory: a CPU run, on any machine
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        torch.accelerator.synchronize(tensor.device)
        return host

    def _assemble(self, calls) -> torch.Tensor:
        if not calls:
            raise RoutingReplayError("nothing was recorded: the model was not called inside `record()`.")
        per_call = []
        for batch, length, layers in calls:
            missing = [self.layer_names[i] for i, t in enumerate(layers) if t is None]
            if missing:
                raise RoutingReplayError(f"routers {missing[:3]} never ran during the recorded call.")
            stacked = torch.stack(layers, dim=1)  # [tokens, layers, k]
            if stacked.shape[0] != batch * length:
                raise RoutingReplayError(f"routers saw {stacked.shape[0]} tokens for a batch of {batch}x{length}.")
            per_call.append(stacked.reshape(batch, length, len(layers), -1))
        if len({t.shape[1] for t in per_call}) != 1:
            raise RoutingReplayError("recorded calls have different sequence lengths; record them separately.")
        return torch.cat(per_call, dim=0)

    # ------------------------------------------------------------------ replay
    @contextlib.contextmanager
    def replay(self, indices: torch.Tensor, mask: torch.Tensor | None = None,
               stats_mask: torch.Tensor | None = None):
        """Force the recorded experts in every forward call inside the block (rows consumed in call order).

        Args:
            indices: `[batch, seq_len, moe_layers, top_k]` from `record()`.
            mask: optional `[batch, seq_len]` bool; tokens where it is False keep their natural routing. An
                all-False mask measures drift without changing the forward.
            stats_mask: optional `[batch, seq_len]`; only these tokens count in `drift` and
                `overridden_fraction` (e.g. the attention mask, to leave padding out of the statistics).

        After the block: `drift[layer]` is the fraction of counted tokens whose natural top-k set differs from the
        recorded one, `overridden_fraction` the fraction (over layers and tokens) that replay actually changed, and
        `token_counts[layer]` the underlying (drifted, overridden, counted) token counts.

        Keep the block open until `backward()` has finished when gradient checkpointing is on: the checkpointed
        layers re-run their routers during backward and must see the same forced experts.

        Cost: on a Qwen3-MoE without `mask`, each MoE layer adds one operator (the gather of the forced experts'
        probabilities in place of the top-k's values; forward and backward together, counted by
        benchmarks/routing_replay_overhead.py); the rest (the rows' copy, widening and sort, the drift statistics)
        is paid once per forward call. `mask` adds one `where` per layer. Families whose output is replaced instead
        (Llama4's dense layout) add the gate formula, the casts of indices and weights, and with `mask` two `where`s.
        """
        if indices.dim() != 4 or indices.shape[2] != len(self.routers) or indices.shape[3] != self.top_k:
            raise RoutingReplayError(
                f"indices must have shape [batch, seq_len, {len(self.routers)}, {self.top_k}], got "
                f"{tuple(indices.shape)}."
            )
        state = {"row": 0, "current": None, "calls": 0}
        fired = [False] * len(self.routers)
        pending = [0] * len(self.routers)  # checkpoint recomputations still owed by backward, per layer
        active: list = [None] * len(self.routers)  # the forced top-k mode of a router that is running
        # Per forward call: its token weights for the statistics, the tokens it forces, its recorded sets and, per
        # layer, the natural indices the router chose (its own tensor: keeping it costs no operator). Folded into
        # counts once per call, after the block, on the device, so a layer adds no statistics operator and the
        # block no host read (reading `drift` or `overridden_fraction` later is the one).
        calls: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list]] = []
        checkpointing = self._checkpointing()

        def model_hook(module, args, kwargs):
            batch, length, device = self._batch_shape(args, kwargs)
            if state["calls"] and checkpointing:
                raise RoutingReplayError(
                    "more than one forward call inside one `replay()` block with gradient checkpointing: the "
                    "recomputation in backward could not tell the calls apart. Fix: one forward (and its backward) "
                    "per `replay()` block."
                )
            start = state["row"]
            if start + batch > indices.shape[0] or indices.shape[1] != length:
                raise RoutingReplayError(
                    f"token-count mismatch: the call has batch {batch} x length {length} (rows {start}..{start + batch}) "
                    f"but the recording holds {indices.shape[0]} x {indices.shape[1]}. Fix: replay with exactly the "
                    "inputs (same padding) that were recorded."
                )
            # Once per call, not per layer: the call's rows go to the device in one copy (asynchronous from pinned
            # memory) as [layers, tokens, k], are widened to the int64 that gather and the experts index with (so
            # a layer only takes a view; this costs 8 bytes per (token, layer, k) for the duration of the call and
            # its backward, e.g. 25 MB for 48 layers x 8192 tokens x top-8), and sorted for the drift comparison.
            routes = indices[start:start + batch].to(device, non_blocking=True)
            routes = routes.permute(2, 0, 1, 3).reshape(len(self.routers), batch * length, self.top_k)
            keep = None if mask is None else mask[start:start + batch].reshape(-1, 1).to(device, torch.bool)
            weight = (torch.ones(batch * length, device=device, dtype=torch.float64) if stats_mask is None else
                      stats_mask[start:start + batch].reshape(-1).to(device, torch.float64))
            state["current"] = (routes.to(torch.long, memory_format=torch.contiguous_format), keep)
            calls.append((weight, keep, routes.sort(-1).values, [None] * len(self.routers)))
            state["row"] += batch
            state["calls"] += 1

        def forced_experts(layer, device):
            if state["current"] is None:
                raise RoutingReplayError("a router ran outside a call of the model given to RoutingReplay.")
            routes, keep = state["current"]
            return routes[layer].to(device), None if keep is None else keep.to(device)  # no-ops on one device

        def router_pre_hook(layer, router, args):
            if self._layout(router) is TRIPLE and args and torch.is_tensor(args[0]):
                active[layer] = _ForcedTopK(*forced_experts(layer, args[0].device), self.num_experts)
                active[layer].__enter__()

        def router_hook(layer, router, output):
            mode, active[layer] = active[layer], None
            if mode is not None:
                mode.__exit__(None, None, None)
            if output is None:  # the router raised (this hook always runs): its error goes through
                return None
            layout = self._layout(router)
            logits, weights, indices = self._unpack(router)(output)
            forced, keep = forced_experts(layer, indices.device)
            if forced.shape[0] != indices.shape[0]:
                raise RoutingReplayError(
                    f"token-count mismatch in {self.layer_names[layer]}: router saw {indices.shape[0]} tokens, "
                    f"the recording has {forced.shape[0]}."
                )
            if mode is not None and mode.hits > 1:
                raise RoutingReplayError(
                    f"{type(router).__name__} takes the top-k over its experts more than once, so replay cannot tell "
                    "which one picks the experts. Fix: set routing_replay='none' for this model."
                )
            # The router picked its experts through the forced top-k and returned them: its own weights are the
            # weights of the forced experts, computed by its own code. Otherwise (the dense layout of Llama4, a
            # router that picks experts another way) its output is replaced, with the family's gate formula.
            own = mode is not None and mode.hits == 1 and indices is mode.returned
            natural = mode.natural if own else indices
            formula = self._formula(router, logits, weights, indices)  # checked once per router class
            if torch._C._current_graph_task_id() != -1:  # a checkpoint recomputation must not count twice
                pending[layer] -= 1
            else:
                fired[layer] = True
                if checkpointing and torch.is_grad_enabled() and logits.requires_grad:
                    pending[layer] += 1  # backward will re-run this router and must see the same forced experts
                calls[-1][3][layer] = natural
            if own:
                return None
            index_dtype, natural = natural.dtype, natural.long()
            if keep is not None:
                forced = torch.where(keep, forced, natural)
            new_weights = formula.fn(router, logits, forced).to(weights.dtype)
            if keep is not None:  # unforced tokens keep the router's own output, bit for bit
                new_weights = torch.where(keep, new_weights, weights)
            return layout.pack(router, output, logits, new_weights, forced.to(index_dtype))

        self._install(router_hook, model_hook, router_pre_hook)
        try:
            yield self
        finally:
            self._remove()
            for mode in active:  # a router that raised inside its top-k hook
                if mode is not None:
                    mode.__exit__(None, None, None)
            if any(count > 0 for count in pending):
                self._arm_guard()
        if state["calls"] == 0:
            raise RoutingReplayError("the model was not called inside `replay()`.")
        if not all(fired):
            silent = [self.layer_names[i] for i in range(len(self.routers)) if not fired[i]]
            raise RoutingReplayError(f"routers {silent[:3]} never fired during replay; nothing was replayed there.")
        counts = [_fold_counts(*call) for call in calls]
        self.token_counts = counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)
