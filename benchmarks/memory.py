"""Peak memory of one training step (loss forward + backward on one micro-batch) with gspo vs TRL's sequence-level
and token-level GRPO: same model and rollout batch. On CUDA: `max_memory_allocated` above the memory held before
the step. On CPU: the resident-set peak above the resident set before the step, sampled every millisecond, each
arm in fresh processes (the allocator's cache would hide a second step), median of repeats, arms interleaved.

    python benchmarks/memory.py
    python benchmarks/memory.py --size gpu --device cuda --dtype bfloat16

Last line: `memory: <gspo / trl_sequence_grpo peak> (target <= 1.0)`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402

ARMS = ["gspo", "trl_sequence_grpo", "trl_token_grpo"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make_inputs(cli, path):
    dtype = getattr(torch, cli.dtype)
    model, tokenizer = _setup.build(cli.size, cli.device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        reference = _setup.trainer("trl_sequence_grpo", model, tokenizer, tmp, cli.device, dtype,
                                   cli.completion_length, cli.batch)
        data = _setup.dataset()
        raw = [data[i // reference.num_generations] for i in range(cli.batch * reference.args.steps_per_generation)]
        reference.model.train()
        inputs = reference._prepare_inputs(raw)
    torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in inputs.items()}, path)


def _measure(cli, arm, inputs_path) -> float:
    dtype = getattr(torch, cli.dtype)
    model, tokenizer = _setup.build(cli.size, cli.device, dtype)
    inputs = {k: v.to(cli.device) if torch.is_tensor(v) else v
              for k, v in torch.load(inputs_path, weights_only=False).items()}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _setup.trainer(arm, model, tokenizer, tmp, cli.device, dtype, cli.completion_length, cli.batch)
        trainer.model.train()
        if cli.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, inputs))
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - before)
        before, peak, done = _rss_bytes(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss_bytes())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        trainer.accelerator.backward(trainer.compute_loss(trainer.model, inputs))
        done.set()
        sampler.join()
        return float(max(peak[0], _rss_bytes()) - before)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=_setup.SIZES, default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("ARM", "INPUTS"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        print("PEAK " + json.dumps(_measure(cli, *cli.worker)))
        return

    _setup.header("memory", cli.device, cli.dtype, _setup.size_kernel(cli.size))
    with tempfile.TemporaryDirectory() as tmp:
        inputs_path = f"{tmp}/inputs.pt"
        _make_inputs(cli, inputs_path)
        base = [sys.executable, __file__, "--size", cli.size, "--device", cli.device, "--dtype", cli.dtype,
                "--batch", str(cli.batch), "--completion-length", str(cli.completion_length)]
        peaks = {arm: [] for arm in ARMS}
        for repeat in range(cli.repeats):
            for arm in ARMS[repeat % 3:] + ARMS[:repeat % 3]:
                out = subprocess.run(base + ["--worker", arm, inputs_path], capture_output=True, text=True,
                                     check=True).stdout
                peaks[arm].append(json.loads(next(l for l in out.splitlines() if l.startswith("PEAK "))[5:]))
    median = {arm: statistics.median(v) for arm, v in peaks.items()}
    kind = "CUDA max_memory_allocated" if cli.device == "cuda" else "CPU resident-set"
    print(f"{kind} peak above the pre-step level, one micro-batch of {cli.batch} completions x "
          f"{cli.completion_length} tokens, size {cli.size}, {cli.dtype}, median of {cli.repeats} fresh processes")
    for arm in ARMS:
        print(f"  {arm:20s} {median[arm] / 2**20:8.1f} MiB   (runs: "
              + ", ".join(f"{p / 2**20:.1f}" for p in peaks[arm]) + ")")
    print(f"  gspo / trl_token_grpo: {median['gspo'] / median['trl_token_grpo']:.3f}")
    print(f"memory: {median['gspo'] / median['trl_sequence_grpo']:.3f} (target <= 1.0)")


if __name__ == "__main__":
    main()
