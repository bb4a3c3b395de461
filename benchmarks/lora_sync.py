"""A LoRA weight sync's memory and time: `exact_sync_stream` (each adapted tensor sent as `W + delta`, built out of
place; trl_gspo/lora_merge.py) beside TRL's own stream (PEFT's in-place merge_adapter / unmerge_adapter), measured
side by side in one run, arms interleaved.

    python benchmarks/lora_sync.py                  # CPU size (benchmarks/_setup.py "cpu"), bf16 base
    python benchmarks/lora_sync.py --size gpu       # Qwen3-30B-A3B layer widths, 4 layers, bf16, CUDA

The model: LoRA r `--rank` on q/k/v/o and the fused experts, PEFT's default fp32 adapters over a bf16 base. The
stream is TRL's `VLLMGeneration._iter_named_params` of one process; the consumer drops each tensor before it asks
for the next (what the sync itself holds) or keeps it until the next arrives (TRL's colocate loop,
`for name, param in ...: load_weights(...)`).

Memory is the peak above what was allocated before the sync: CUDA's allocator peak, or on a CPU the bytes of the
tensors the sync's operations create that are alive together (a kernel's internal buffers are not seen). Printed
over the largest adapted tensor's bytes; the result of a build is one such tensor, so 1.0 is the floor of an
out-of-place sync. Arms:
- `exact`: exact_sync_stream, consumer drops each tensor;
- `exact_kept`: the same, consumer keeps the previous tensor (TRL's colocate loop);
- `whole_delta`: what the sync built before slicing: `(W + delta).to(W.dtype)` with PEFT's full-size delta;
- `metadata`: exact_sync_stream with `build=False` (the server's metadata walk, non-main ranks): nothing built;
- `trl_merge`: TRL's stream, PEFT's merge_adapter / unmerge_adapter in place (the base drifts in bf16).

Then, per kind of adapted tensor (attention, experts), one build's peak over that tensor's own bytes. Last line: `lora_sync_memory: <exact peak / largest adapted tensor> (target <= 1.5)`.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trl_gspo.lora_merge import _active, adapter_targets, exact_sync_stream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402
from lora_rollout import lora_model  # noqa: E402


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the block (by storage) that are alive together, checked after every
    operation. Storages that existed before the block (the weights, the adapters) are not counted."""

    def __init__(self, existing):
        super().__init__()
        self.existing, self.live, self.peak = existing, {}, 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in self.existing:
                    self.live.setdefault(key, [storage.nbytes(), []])[1].append(weakref.ref(tensor))
        total = 0
        for key in list(self.live):
            nbytes, refs = self.live[key]
            refs[:] = [ref for ref in refs if ref() is not None]
            if refs:
                total += nbytes
            else:
                del self.live[key]
        self.peak = max(self.peak, total)
        return out


def peak_extra_bytes(run, model, device) -> int:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    existing = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    with _LiveBytes(existing) as tracker:
        run()
    return tracker.peak


def trl_stream(model):
    """TRL's weight-sync stream (`VLLMGeneration._iter_named_params`) of one process, without a vLLM engine."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model = model
    generation._dist = types.SimpleNamespace(gather_params=lambda params: contextlib.nullcontext(), is_fsdp=False)
    return generation._iter_named_params


def drop_each(stream):
    iterator = iter(stream)
    while True:
        item = next(iterator, None)
        if item is None:
            return
        del item  # nothing of this tensor is held while the next is built


def keep_previous(stream):
    for _name, _tensor in stream:  # the loop variable holds the previous tensor while the next is built
        pass


def whole_delta(target):
    """PEFT's merge arithmetic with its full-size delta in the adapters' dtype, then `(W + delta)` cast: what the sync
    built for an attention weight before slicing."""
    with torch.no_grad():
        weight = target.parameter
        for adapter in _active(target.layer):
            weight = (weight + target.layer.get_delta_weight(adapter)).to(target.parameter.dtype)
        return weight


def whole_delta_stream(model, stream):
    """The sync as it was before slicing: attention weights by `whole_delta`, experts as today."""
    from trl_gspo.lora_merge import effective_weight, merge_calls_skipped

    targets = {t.parameter.data_ptr(): t for t in adapter_targets(model)}
    with merge_calls_skipped(model):
        for name, tensor in stream():
            target = targets.get(tensor.data_ptr())
            if target is not None:
                tensor = effective_weight(target) if target.expert_stack else whole_delta(target)
            yield name, tensor


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(_setup.SIZES), default="cpu")
    parser.add_argument("--device", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = args.device or ("cuda" if args.size == "gpu" else "cpu")
    dtype = torch.bfloat16
    _setup.header("lora_sync", device, dtype, _setup.size_kernel(args.size))
    torch.manual_seed(0)
    model, _ = lora_model(args.size, device, dtype, args.rank)
    targets = adapter_targets(model)
    largest = max(targets, key=lambda t: t.parameter.nbytes)
    adapter_dtype = next(p.dtype for n, p in model.named_parameters() if "lora_A" in n)
    print(f"model: {args.size} size, LoRA r {args.rank} on q/k/v/o and the fused experts, {len(targets)} adapted "
          f"tensors, adapters {str(adapter_dtype).removeprefix('torch.')}; largest adapted tensor "
          f"{tuple(largest.parameter.shape)} {largest.parameter.nbytes / 2**20:.1f} MiB", flush=True)
    stream = trl_stream(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}

    def trl_merge():
        with torch.no_grad():
            keep_previous(stream())

    arms = {
        "exact": lambda: drop_each(exact_sync_stream(model, stream)),
        "exact_kept": lambda: keep_previous(exact_sync_stream(model, stream)),
        "whole_delta": lambda: drop_each(whole_delta_stream(model, stream)),
        "metadata": lambda: drop_each(exact_sync_stream(model, stream, build=False)),
        "trl_merge": trl_merge,
    }
    times = {name: [] for name in arms}
    peaks = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and measures memory; later rounds time
        for name, run in arms.items():
            if not repeat:
                peaks[name] = peak_extra_bytes(run, model, device)
                continue
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    drifted = sum(not torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    for name in arms:
        print(f"{name:12s} peak extra {peaks[name] / 2**20:9.1f} MiB = {peaks[name] / largest.parameter.nbytes:5.2f}"
              f" x largest; one sync {median[name] * 1e3:8.1f} ms", flush=True)
    from trl_gspo.lora_merge import effective_weight

    for kind, expert_stack in (("attention", False), ("experts", True)):
        kind_targets = [t for t in targets if t.expert_stack == expert_stack]
        if not kind_targets:
            continue
        ratio = {name: max(peak_extra_bytes(lambda: build(t), model, device) / t.parameter.nbytes
                           for t in kind_targets) for name, build in (("exact", effective_weight), ("whole", whole_delta))}
        same = sum(torch.equal(effective_weight(t), whole_delta(t)) for t in kind_targets)
        print(f"one {kind} tensor's build, peak extra over that tensor (worst of {len(kind_targets)}): "
              f"{ratio['exact']:.2f} as the sync builds it, {ratio['whole']:.2f} with PEFT's full-size delta; "
              f"bit for bit PEFT's merge arithmetic: {same} of {len(kind_targets)}", flush=True)
    print(f"exact sync / TRL's merge + unmerge, time: {median['exact'] / median['trl_merge']:.2f}; base tensors "
          f"TRL's in-place merge moved over {args.repeats + 1} syncs: {drifted} of {len(base)}", flush=True)
    print(f"lora_sync_memory: {peaks['exact'] / largest.parameter.nbytes:.3f} (target <= 1.5)")


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
