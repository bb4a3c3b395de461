"""Training-step time of GSPOTrainer(loss_type="gspo") vs TRL's own GRPOTrainer with sequence-level importance
sampling (the same objective in TRL) and vs token-level GRPO: same model, same off-policy rollout batch, same seed,
measured interleaved (the order rotates every repeat), median of repeats.

    python benchmarks/loss_overhead.py                                    # CPU-sized MoE
    python benchmarks/loss_overhead.py --size gpu --device cuda --dtype bfloat16

A training step here is one micro-batch's `compute_loss` + backward: the policy forward, the loss, and backward
(generation and the optimizer are identical for all arms and left out; see step_breakdown.py for those).

The arm `gspo_eager_checks` is GSPOTrainer as it was before its NaN/Inf checks and metrics became sync-free: three
checks and every metric each read to the host on its own (the code is kept below). Each host read waits for the
device on a GPU; the run also counts them per step on any device (`host reads`), so a CPU run shows how many
stalls a GPU step would have even where the timing cannot.
The arm `gspo_adaptive_band` is GSPOTrainer with the band set by the run (`clip_band="adaptive"`): against `gspo`
(the default, the paper's band fixed) it shows what the band's update costs a micro-batch, time and host reads.
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

from trl_gspo import GSPOTrainer  # noqa: E402


class EagerChecksGSPOTrainer(GSPOTrainer):
    """GSPOTrainer's NaN/Inf checks and metrics before they were made sync-free (kept for this comparison only):
    each check and each metric is read to the host separately."""

    def _log_gspo_metrics(self, mode, out, mask, entropies, policy_loss, per_token_kl, aux_loss, nonfinite,
                          band_columns=None):  # the default fixed band: no band columns
        for name, count in zip(("logps", "old_logps", "advantages"), nonfinite):
            if bool(count > 0):  # one sync per input, as check_finite did
                raise ValueError(f"`{name}` contains NaN/Inf")
        gather, metrics = self.accelerator.gather, self._metrics[mode]
        if aux_loss is not None:
            metrics["aux_loss"].append(gather(aux_loss).mean().item())

        def global_token_mean(values):
            totals = self.accelerator.reduce(torch.stack([(values * mask).sum().float(), mask.sum().float()]),
                                             reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if per_token_kl is not None:
            metrics["kl"].append(global_token_mean(per_token_kl))
        metrics["entropy"].append(global_token_mean(entropies))
        metrics["policy_loss"].append(gather(policy_loss).mean().item())
        low_seq, high_seq = gather(out.low_clipped.any(-1).float()), gather(out.high_clipped.any(-1).float())
        region_seq = gather((out.low_clipped | out.high_clipped).any(-1).float())
        metrics["clip_ratio/low_mean"].append(low_seq.mean().item())
        metrics["clip_ratio/low_min"].append(low_seq.min().item())
        metrics["clip_ratio/high_mean"].append(high_seq.mean().item())
        metrics["clip_ratio/high_max"].append(high_seq.max().item())
        metrics["clip_ratio/region_mean"].append(region_seq.mean().item())
        metrics["gspo/clipped_token_fraction"].append(global_token_mean((out.low_clipped | out.high_clipped).float()))
        log_ratio, nonempty = gather(out.log_ratio.float()), gather(mask.bool().any(-1))
        log_ratio = log_ratio[nonempty] if bool(nonempty.any()) else log_ratio.new_zeros(1)
        ratio = log_ratio.exp()
        metrics["gspo/ratio_mean"].append(ratio.mean().item())
        metrics["gspo/ratio_std"].append(ratio.std().item() if ratio.numel() > 1 else 0.0)
        metrics["gspo/ratio_min"].append(ratio.min().item())
        metrics["gspo/ratio_max"].append(ratio.max().item())
        metrics["gspo/log_ratio_abs_max"].append(log_ratio.abs().max().item())


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
    arms = ["gspo", "gspo_adaptive_band", "gspo_eager_checks", "trl_sequence_grpo", "trl_token_grpo"]

    model, tokenizer = _setup.build(args.size, args.device, dtype)
    _setup.header("loss_overhead", args.device, dtype, _setup.experts_kernel(model))
    with tempfile.TemporaryDirectory() as tmp:
        # the eager arm reads its metrics one by one, with the default fixed band
        trainers = {arm: _setup.trainer("gspo" if arm == "gspo_eager_checks" else arm, model, tokenizer,
                                        f"{tmp}/{arm}", args.device, dtype, args.completion_length, args.batch,
                                        trainer_cls=EagerChecksGSPOTrainer if arm == "gspo_eager_checks" else None)
                    for arm in arms}
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

        host_reads = {}
        for arm in arms:  # warm-up, and count the host reads of one step
            step(arm)
            with _setup.count_host_reads() as reads:
                step(arm)
            host_reads[arm] = reads["count"]
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
        print(f"  {arm:20s} median {median[arm] * 1e3:8.2f} ms  (IQR {spread[0] * 1e3:.2f}-{spread[2] * 1e3:.2f})"
              f"  host reads per step {host_reads[arm]}")
    print(f"  gspo / trl_token_grpo: {median['gspo'] / median['trl_token_grpo']:.3f}")
    print(f"  gspo / gspo_eager_checks (sync-free checks and metrics vs before): "
          f"{median['gspo'] / median['gspo_eager_checks']:.3f}, host reads {host_reads['gspo']} vs "
          f"{host_reads['gspo_eager_checks']}")
    print(f"  gspo_adaptive_band / gspo (the band set by the run vs the paper's fixed band): "
          f"{median['gspo_adaptive_band'] / median['gspo']:.3f}, host reads {host_reads['gspo_adaptive_band']} vs "
          f"{host_reads['gspo']}")
    print(f"loss_overhead: {median['gspo'] / median['trl_sequence_grpo']:.3f} (target <= 1.02)")


if __name__ == "__main__":
    main()
