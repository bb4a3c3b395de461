"""Where a training step's time goes, for gspo, grpo and grpo + routing replay: generation, old-policy scoring
(TRL's no-grad log-prob pass over the rollout batch, where replay records), training forward+backward, optimizer,
and the rest (rewards, advantages, logging), over a real short training run in the paper's off-policy setup
(4 mini-batches per rollout batch).

    python benchmarks/step_breakdown.py                                   # tiny MoE on CPU
    python benchmarks/step_breakdown.py --size gpu --device cuda --dtype bfloat16

Each arm runs `--repeats` times, interleaved (the order rotates), and the run with the median total is reported. Last line: `step_breakdown: <grpo + replay / grpo end-to-end time> (target <= 1.05)`.
"""

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402

PHASES = ("generation", "old-policy scoring", "forward+backward", "optimizer", "other")


def _timed(owner, name, totals, key, sync):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        sync()
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            totals[key] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def breakdown(arm, model, tokenizer, cli, dtype, tmp):
    sync = torch.cuda.synchronize if cli.device == "cuda" else (lambda: None)
    trainer = _setup.trainer(arm, model, tokenizer, f"{tmp}/{arm}", cli.device, dtype, cli.completion_length,
                             cli.batch, max_steps=cli.steps)
    totals = defaultdict(float)
    _timed(trainer, "_generate", totals, "generation", sync)
    _timed(trainer, "_generate_and_score_completions", totals, "_rollout", sync)
    _timed(trainer, "_prepare_inputs", totals, "_prepare", sync)
    _timed(trainer, "training_step", totals, "_training_step", sync)
    logps = trainer._get_per_token_logps_and_entropies
    in_rollout = {"on": False}
    rollout = trainer._generate_and_score_completions

    def rollout_marked(*args, **kwargs):
        in_rollout["on"] = True
        try:
            return rollout(*args, **kwargs)
        finally:
            in_rollout["on"] = False

    def logps_timed(*args, **kwargs):
        sync()
        started = time.perf_counter()
        try:
            return logps(*args, **kwargs)
        finally:
            sync()
            if in_rollout["on"]:
                totals["old-policy scoring"] += time.perf_counter() - started

    trainer._generate_and_score_completions = rollout_marked
    trainer._get_per_token_logps_and_entropies = logps_timed

    class Clock(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            sync()
            self.started = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            sync()
            totals["optimizer"] += time.perf_counter() - self.started

    trainer.add_callback(Clock())
    sync()
    started = time.perf_counter()
    trainer.train()
    sync()
    total = time.perf_counter() - started
    shares = {
        "generation": totals["generation"],
        "old-policy scoring": totals["old-policy scoring"],
        "forward+backward": totals["_training_step"] - totals["_prepare"],
        "optimizer": totals["optimizer"],
    }
    shares["other"] = total - sum(shares.values())
    return total, shares


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=_setup.SIZES, default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per arm (4 per rollout batch)")
    parser.add_argument("--repeats", type=int, default=5)
    cli = parser.parse_args()
    dtype = getattr(torch, cli.dtype)
    model, tokenizer = _setup.build(cli.size, cli.device, dtype)
    _setup.header("step_breakdown", cli.device, dtype, _setup.experts_kernel(model))
    arms = ["gspo", "grpo", "grpo_routing_replay"]
    runs = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        breakdown("gspo", model, tokenizer, cli, dtype, tmp)  # warm-up (allocator, kernels)
        for repeat in range(cli.repeats):
            for arm in arms[repeat % 3:] + arms[:repeat % 3]:
                runs[arm].append(breakdown(arm, model, tokenizer, cli, dtype, tmp))
    results = {arm: sorted(r, key=lambda run: run[0])[len(r) // 2] for arm, r in runs.items()}
    print(f"device {cli.device}, {cli.dtype}, size {cli.size}: {cli.steps} optimizer steps, {cli.batch} "
          f"completions per step, up to {cli.completion_length} tokens; median of {cli.repeats} interleaved runs")
    print(f"  {'arm':22s}{'total s':>9s}" + "".join(f"{p:>21s}" for p in PHASES))
    for arm, (total, shares) in results.items():
        cells = "".join(f"{shares[p]:9.2f}s ({shares[p] / total:5.1%})" for p in PHASES)
        print(f"  {arm:22s}{total:9.2f}{cells}")
    ratio = results["grpo_routing_replay"][0] / results["grpo"][0]
    print(f"step_breakdown: {ratio:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
