"""Training-step time of GSPOTrainer(loss_type="gspo") vs TRL's own GRPOTrainer with sequence-level importance
sampling (the same objective in TRL) and vs token-level GRPO: same model, same off-policy rollout batch, same seed,
measured interleaved (the order rotates every repeat), median of repeats.

    python benchmarks/loss_overhead.py                                    # CPU-sized MoE
    python benchmarks/loss_overhead.py --size gpu --device cuda --dtype bfloat16

A training step here is one micro-batch's `compute_loss` + backward: the policy forward, the loss, and backward
(generation and the optimizer are identical for all arms and left out; see step_breakdown.py for those).
Last line: `loss_overhead: <gspo / trl_sequence_grpo> (target <= 1.02)`.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=_setup.SIZES, default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16, help="completions per micro-batch")
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    arms = ["gspo", "trl_sequence_grpo", "trl_token_grpo"]

    model, tokenizer = _setup.build(args.size, args.device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {arm: _setup.trainer(arm, model, tokenizer, f"{tmp}/{arm}", args.device, dtype,
                                        args.completion_length, args.batch) for arm in arms}
        # One off-policy rollout batch (generated and scored by TRL), fed to every arm.
        reference = trainers["trl_sequence_grpo"]
        data = _setup.dataset()  # one generation batch: each prompt repeated num_generations times, as TRL samples
        raw = [data[i // reference.num_generations] for i in range(args.batch * reference.args.steps_per_generation)]
        reference.model.train()
        inputs = reference._prepare_inputs(raw)
        # Make the batch off-policy, as after an optimizer step: the old log-probs differ from the current ones.
        if inputs.get("old_per_token_logps") is None:
            raise SystemExit("TRL skipped the old-policy pass; the benchmark needs the off-policy setup")
        generator = torch.Generator().manual_seed(0)
        noise = torch.randn(inputs["old_per_token_logps"].shape, generator=generator) * 1e-3
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + noise.to(inputs["old_per_token_logps"])
        tokens = int(inputs["completion_mask"].sum())

        def step(arm):
            trainer = trainers[arm]
            trainer.model.train()
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            loss = trainer.compute_loss(trainer.model, dict(inputs))  # TRL's training_step minus input buffering
            trainer.accelerator.backward(loss)
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            trainer.model.zero_grad(set_to_none=True)
            return elapsed

        for arm in arms:  # warm-up
            step(arm)
        times = {arm: [] for arm in arms}
        for repeat in range(args.repeats):
            order = arms[repeat % len(arms):] + arms[:repeat % len(arms)]
            for arm in order:
                times[arm].append(step(arm))

    median = {arm: statistics.median(t) for arm, t in times.items()}
    print(f"device {args.device}, {args.dtype}, size {args.size}: {args.batch} completions x "
          f"{args.completion_length} tokens ({tokens} completion tokens), {args.repeats} interleaved repeats")
    for arm in arms:
        spread = statistics.quantiles(times[arm], n=4) if len(times[arm]) > 1 else [median[arm]] * 3
        print(f"  {arm:20s} median {median[arm] * 1e3:8.2f} ms  (IQR {spread[0] * 1e3:.2f}-{spread[2] * 1e3:.2f})")
    print(f"  gspo / trl_token_grpo: {median['gspo'] / median['trl_token_grpo']:.3f}")
    print(f"loss_overhead: {median['gspo'] / median['trl_sequence_grpo']:.3f} (target <= 1.02)")


if __name__ == "__main__":
    main()
