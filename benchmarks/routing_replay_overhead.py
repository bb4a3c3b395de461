"""Forward+backward time with routing replay vs without, on a stack of Qwen3-MoE layers, measured interleaved.

    python benchmarks/routing_replay_overhead.py                      # CPU-sized default
    python benchmarks/routing_replay_overhead.py --size gpu           # Qwen3-30B-A3B-shaped layers, bf16, CUDA:
        # the same as --hidden 2048 --experts 128 --top-k 8 --expert-width 768 --layers 4 --tokens 8192
        #             --dtype bfloat16 --device cuda

Prints the median times, the operators each arm dispatches per step (each one a kernel launch on a GPU, views
aside) and its host reads (each a device sync on a GPU) - both counted on any device, so a CPU run shows what replay
adds to a GPU step's launch count - and what replay adds per MoE layer and per forward call (the slope and intercept
of the added count over the layer count, from a second model of the same widths with fewer layers, counted once and
not timed), the recording's bytes per token, and last
`routing_replay_overhead: <ratio> (target <= 1.02)`.
"""

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from trl_gspo.routing import RoutingReplay

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402  (the header, and the GPU size's layer widths)

_GPU = _setup.SIZES["gpu"]  # Qwen3-30B-A3B layer widths, 4 layers
GPU_SIZE = dict(hidden=_GPU["hidden_size"], experts=_GPU["num_experts"], top_k=_GPU["num_experts_per_tok"],
                expert_width=_GPU["moe_intermediate_size"], layers=_GPU["num_hidden_layers"], tokens=8192,
                dtype="bfloat16", device="cuda")
# Operators that only make a new view of a tensor: no kernel runs for them on a GPU.
VIEWS = {"view", "_unsafe_view", "select", "slice", "permute", "expand", "detach", "t", "transpose", "unsqueeze",
         "squeeze", "alias", "as_strided", "reshape", "unbind", "split", "split_with_sizes", "unfold", "view_as"}


class CountOps(TorchDispatchMode):
    """Counts the operators dispatched inside the block, views apart from the rest."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts["views" if name in VIEWS else "kernels"] += 1
        return func(*args, **(kwargs or {}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="batch x sequence length")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: Qwen3-30B-A3B layer widths in bf16 on CUDA (overrides the width options)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile STEPS steps per arm with torch.profiler and print where the time goes")
    args = parser.parse_args()
    if args.size == "gpu":
        vars(args).update(GPU_SIZE)

    dtype = getattr(torch, args.dtype)

    def build(layers):
        config = Qwen3MoeConfig(
            vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=layers, num_attention_heads=8,
            num_key_value_heads=4, head_dim=args.hidden // 8, num_experts=args.experts, num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.expert_width, norm_topk_prob=True, max_position_embeddings=args.seq_len,
        )
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(config).to(args.device, dtype).train()  # transformers' default experts kernel

    model = build(args.layers)
    config = model.config
    _setup.header("routing_replay_overhead", args.device, dtype, _setup.experts_kernel(model))
    batch = args.tokens // args.seq_len
    ids = torch.randint(0, config.vocab_size, (batch, args.seq_len), device=args.device)
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record() as recording:
        model(input_ids=ids)

    def step(with_replay: bool) -> float:
        model.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if with_replay:
            with replay.replay(recording.indices):
                model(input_ids=ids, labels=ids).loss.backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step(False), step(True)  # warm-up
    launches, host_reads = {}, {}
    for with_replay in (False, True):  # one counted step per arm
        with _setup.count_host_reads() as reads, CountOps() as ops:
            step(with_replay)
        launches[with_replay], host_reads[with_replay] = ops.counts, reads["count"]
    # The same count on a model with fewer layers: the difference is what each MoE layer adds.
    fewer = 1 if args.layers > 1 else 2
    small = build(fewer)
    small_replay = RoutingReplay(small)
    with torch.no_grad(), small_replay.record() as small_recording:
        small(input_ids=ids)

    def small_step(with_replay: bool) -> None:
        small.zero_grad(set_to_none=True)
        with small_replay.replay(small_recording.indices) if with_replay else contextlib.nullcontext():
            small(input_ids=ids, labels=ids).loss.backward()

    small_step(False), small_step(True)  # warm-up: the gate formula is checked in the first replay
    small_kernels = {}
    for with_replay in (False, True):
        with CountOps() as ops:
            small_step(with_replay)
        small_kernels[with_replay] = ops.counts["kernels"]
    del small, small_replay, small_recording
    plain, replayed = [], []
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
        plain.append(step(False))
        replayed.append(step(True))
    plain_median, replay_median = statistics.median(plain), statistics.median(replayed)
    print(f"device={args.device} dtype={args.dtype} hidden={args.hidden} experts={args.experts} top_k={args.top_k} "
          f"expert_width={args.expert_width} layers={args.layers} tokens={batch * args.seq_len}")
    print(f"forward+backward median: plain {plain_median * 1e3:.1f} ms, replay {replay_median * 1e3:.1f} ms")
    added = launches[True]["kernels"] - launches[False]["kernels"]
    per_layer = (added - (small_kernels[True] - small_kernels[False])) / (args.layers - fewer)
    print(f"operators per step (kernel launches on a GPU; views apart): plain {launches[False]['kernels']} "
          f"(+{launches[False]['views']} views), replay {launches[True]['kernels']} (+{launches[True]['views']} "
          f"views): replay adds {added}")
    print(f"added operators per MoE layer: {per_layer:g}, plus {added - per_layer * args.layers:g} per forward call "
          f"(slope and intercept over {fewer} and {args.layers} layers)")
    print(f"host reads per step (device syncs on a GPU): plain {host_reads[False]}, replay {host_reads[True]}")
    print(f"recording: {recording.bytes_per_token} bytes per token ({recording.indices.dtype}, "
          f"{recording.bytes_per_token / (args.layers * args.top_k):.0f} byte per (token, layer, k))")
    if args.profile:
        profile(step, args.profile, args.device)
    print(f"routing_replay_overhead: {replay_median / plain_median:.3f} (target <= 1.02)")


def profile(step, steps: int, device: str) -> None:
    """The operators each arm spends its time in (GPU kernel time on a GPU, host time on a CPU), top 20."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    for with_replay in (False, True):
        with torch_profile(activities=activities) as prof:
            for _ in range(steps):
                step(with_replay)
        print(f"\nprofile, {'replay' if with_replay else 'plain'}, {steps} steps, sorted by {sort}:")
        print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
