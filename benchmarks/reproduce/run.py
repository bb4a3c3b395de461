"""Miniature reproduction of the GSPO paper's MoE claims: GSPO vs GRPO vs GRPO + routing replay.

A tiny Qwen3-MoE (built from trl_gspo/quickstart/tiny_qwen3_moe.json) is cold-started with a deliberately noisy
SFT on single-digit addition (a verifiable answer), then trained with RL in the paper's off-policy setup (each
rollout batch split into 4 mini-batches, beta 0) under three arms:

    gspo     loss_type="gspo", eps 3e-4 / 4e-4 (sequence-level ratio)
    grpo     loss_type="grpo", importance_sampling_level="token", eps 0.2 / 0.27 (the paper's tuned GRPO)
    grpo_rr  grpo + routing_replay="old"

Per run it records the reward curve, exact-match accuracy on 20 held-out problems (never seen in SFT or RL;
greedy decoding), clip fractions (GSPO: tokens in clipped sequences; GRPO: clipped tokens), routing drift,
divergence (non-finite loss or grad norm) and collapse (last-window reward more than 0.1 below the first), and
wall time. One SFT model per seed is shared by the three arms.

    python benchmarks/reproduce/run.py                      # CPU size: 3 arms x 5 seeds, ~10 min on 2 cores
    python benchmarks/reproduce/run.py --size gpu --jobs 1  # larger model and longer runs, on a CUDA device

Writes OUT/results.json, OUT/results.md (tables) and OUT/*.png (curves). The figures in docs/results.md come from
this command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "gspo": dict(loss_type="gspo", clip_band="fixed"),  # the paper's band throughout, as the paper ran it
    "grpo": dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.27),
    "grpo_rr": dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.27,
                    routing_replay="old"),
}
SIZES = {  # model overrides of tiny_qwen3_moe.json, SFT steps, RL steps, batch, evaluation period
    "smoke": dict(model={}, sft_steps=10, rl_steps=8, batch=16, eval_every=4, cpu=True),  # for the tests only
    "cpu": dict(model={}, sft_steps=600, rl_steps=1200, batch=32, eval_every=200, cpu=True),
    "gpu": dict(model=dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                           num_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=32),
                sft_steps=1500, rl_steps=2000, batch=128, eval_every=200, cpu=False),
}
HELD_OUT = [(a, b) for a in range(10) for b in range(10) if (7 * a + 3 * b) % 5 == 0]  # 20 pairs


def _training_pairs(count: int, seed: int) -> list[tuple[int, int]]:
    import random

    rng = random.Random(seed)
    allowed = [(a, b) for a in range(10) for b in range(10) if (a, b) not in HELD_OUT]
    return [rng.choice(allowed) for _ in range(count)]


def _held_out_accuracy(model, tokenizer) -> float:
    import torch

    from trl_gspo.quickstart.addition import make_prompt

    prompts = [make_prompt(a, b) for a, b in HELD_OUT]
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(text.strip() == str(a + b) for text, (a, b) in zip(texts, HELD_OUT)) / len(HELD_OUT)


def sft(seed: int, size: str, out: Path) -> None:
    """The cold start shared by the three arms of one seed: 50% of SFT answers are wrong, so the policy is weak."""
    import random

    from datasets import Dataset

    from trl_gspo.quickstart.addition import make_prompt
    from trl_gspo.quickstart.cold_start import sft_cold_start
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import EOS_TOKEN, build_tokenizer

    cfg = SIZES[size]
    tokenizer = build_tokenizer()
    rng = random.Random(seed + 1)
    pairs = _training_pairs(cfg["sft_steps"] * 64, seed)
    answers = [a + b if rng.random() < 0.5 else rng.randint(0, 18) for a, b in pairs]
    data = Dataset.from_dict({"prompt": [make_prompt(a, b) for a, b in pairs],
                              "completion": [f"{x}{EOS_TOKEN}" for x in answers]})
    model = build_model(tokenizer, config_overrides=cfg["model"], seed=seed)
    model = sft_cold_start(model, tokenizer, str(out / f"sft-{seed}" / "run"), max_steps=cfg["sft_steps"],
                           seed=seed, dataset=data, use_cpu=cfg["cpu"])
    model.save_pretrained(out / f"sft-{seed}")
    tokenizer.save_pretrained(out / f"sft-{seed}")


def rl(arm: str, seed: int, size: str, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.quickstart.addition import exact_match_reward, make_prompt
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    cfg = SIZES[size]
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out / f"sft-{seed}", experts_implementation="eager")
    pairs = _training_pairs(cfg["rl_steps"] * cfg["batch"], seed + 100)
    data = Dataset.from_dict({"prompt": [make_prompt(a, b) for a, b in pairs],
                              "answer": [str(a + b) for a, b in pairs]})
    held_out: list[tuple[int, float]] = []

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            held_out.append((0, _held_out_accuracy(model, tokenizer)))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % cfg["eval_every"] == 0:
                held_out.append((state.global_step, _held_out_accuracy(model, tokenizer)))

    args = GSPOConfig(
        output_dir=str(out / f"{arm}-{seed}"), seed=seed, max_steps=cfg["rl_steps"], learning_rate=5e-4,
        lr_scheduler_type="cosine", per_device_train_batch_size=cfg["batch"], gradient_accumulation_steps=1,
        steps_per_generation=4, num_generations=8, max_completion_length=4, temperature=1.0, beta=0.0,
        logging_steps=max(1, min(20, cfg["rl_steps"] // 4)), save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=cfg["cpu"],
        bf16=not cfg["cpu"], gradient_checkpointing=False, **ARMS[arm])
    trainer = GSPOTrainer(model, exact_match_reward, args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=[HeldOut()])
    trainer.remove_callback(PrinterCallback)  # one line per logging step of 15 parallel runs is noise
    started = time.perf_counter()
    try:
        trainer.train()
        error = None
    except Exception as err:  # a diverged run is a result, not a crash of the whole comparison
        error = f"{type(err).__name__}: {err}"[:300]
    wall = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "loss" in h]
    clip_key = "gspo/clipped_token_fraction" if arm == "gspo" else "clip_ratio/region_mean"
    series = {key: [h.get(key) for h in logs] for key in ("loss", "grad_norm", "reward", "entropy",
                                                          "routing/drift_mean")}
    non_finite = error is not None or any(not math.isfinite(x) for k in ("loss", "grad_norm")
                                          for x in series[k] if x is not None)
    return {
        "arm": arm, "seed": seed, "size": size, "wall_s": wall, "error": error,
        "steps": [h["step"] for h in logs], "clip": [h.get(clip_key) for h in logs], **series,
        "held_out": held_out, "diverged": non_finite,
        "collapsed": _collapsed([x for x in series["reward"] if x is not None]),
        "device": "cuda" if torch.cuda.is_available() and not cfg["cpu"] else "cpu",
    }


def _collapsed(rewards: list[float]) -> bool:
    return bool(rewards) and rewards[-1] < rewards[0] - 0.1


def _run_jobs(commands: list[list[str]], jobs: int) -> None:
    started: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for command in commands:
        while sum(p.poll() is None for p in started) >= jobs:
            time.sleep(0.5)
        started.append(subprocess.Popen(command, env=env))
    for process in started:
        process.wait()
    failed = [p.args for p in started if p.returncode]
    if failed:
        raise SystemExit(f"worker failed: {failed}")


def _rewards(run: dict) -> list[float]:
    return [x for x in run["reward"] if x is not None] or [float("nan")]  # logged in windows with a rollout


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3g} ± {sd:.2g}"


def report(results: list[dict], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if any(r["arm"] == a for r in results)]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for color, arm in zip(("C0", "C1", "C2"), arms):
        for r in (r for r in results if r["arm"] == arm):
            label = arm if r["seed"] == min(x["seed"] for x in results) else None
            nan = float("nan")
            axes[0].plot(r["steps"], [nan if x is None else x for x in r["reward"]], color=color, alpha=0.7,
                         label=label)
            axes[1].plot(*zip(*r["held_out"]), color=color, alpha=0.7, marker="o", label=label)
            axes[2].plot(r["steps"], [max(c or 0, 1e-5) for c in r["clip"]], color=color, alpha=0.7, label=label)
            axes[3].plot(r["steps"], [nan if x is None else x for x in r["routing/drift_mean"]], color=color,
                         alpha=0.7, label=label)
    for ax, title in zip(axes, ("reward (train, per logging window)", "held-out exact match (greedy)",
                                "clipped-token fraction (log)", "routing drift per update")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend()
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)

    lines = ["| arm | runs | reward first -> last window | held-out acc start -> end | clipped-token fraction "
             "(all steps / first 300) | routing drift (mean / peak window) | diverged | collapsed | wall time per run (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = [r for r in results if r["arm"] == arm]
        clip = [statistics.mean(c or 0.0 for c in r["clip"]) for r in runs]
        early_clip = [statistics.mean(c or 0.0 for c, step in zip(r["clip"], r["steps"]) if step <= 300) for r in runs]
        drift = [statistics.mean([d for d in r["routing/drift_mean"] if d is not None] or [0]) for r in runs]
        peak_drift = [max([d for d in r["routing/drift_mean"] if d is not None] or [0]) for r in runs]
        lines.append(
            f"| {arm} | {len(runs)} | {_mean_sd([_rewards(r)[0] for r in runs])} -> "
            f"{_mean_sd([_rewards(r)[-1] for r in runs])} | {_mean_sd([r['held_out'][0][1] for r in runs])} -> "
            f"{_mean_sd([r['held_out'][-1][1] for r in runs])} | {_mean_sd(clip)} / {_mean_sd(early_clip)} | "
            f"{_mean_sd(drift)} / {_mean_sd(peak_drift)} | "
            f"{sum(r['diverged'] for r in runs)} | {sum(r['collapsed'] for r in runs)} | "
            f"{_mean_sd([r['wall_s'] for r in runs])} |")
    lines += ["", "Differences from gspo in the last-window reward, with the standard error over seeds "
              "(a difference within 2 standard errors is not a result):", "",
              "| arm | last-window reward minus gspo's | standard error | beyond 2 standard errors |", "|---|---|---|---|"]
    base = [_rewards(r)[-1] for r in results if r["arm"] == "gspo"]
    for arm in arms[1:] if base else []:
        other = [_rewards(r)[-1] for r in results if r["arm"] == arm]
        diff = statistics.mean(other) - statistics.mean(base)
        se = math.sqrt(sum(statistics.variance(x) / len(x) for x in (base, other) if len(x) > 1))
        lines.append(f"| {arm} | {diff:+.3g} | {se:.2g} | {'yes' if abs(diff) > 2 * se > 0 else 'no'} |")
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs in parallel (one thread each)")
    parser.add_argument("--out", type=Path, default=Path("outputs/reproduce"))
    parser.add_argument("--worker", nargs=3, metavar=("PHASE", "ARM", "SEED"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    cli.out.mkdir(parents=True, exist_ok=True)

    if cli.worker:  # one SFT or RL run in its own process
        import torch

        # Deterministic on one machine: one thread (no reduction-order races), deterministic kernels, and every
        # random draw seeded (model init, SFT data, RL prompts, sampling: the Trainer seeds torch from `seed`).
        # Not bit-identical across machines: CPU kernels (oneDNN/MKL) pick different code paths per instruction
        # set, so float32 results differ in the last bits and sampled completions diverge from there.
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(int(cli.worker[2]))
        phase, arm, seed = cli.worker
        if phase == "sft":
            sft(int(seed), cli.size, cli.out)
        else:
            result = rl(arm, int(seed), cli.size, cli.out)
            (cli.out / f"{arm}-{seed}.json").write_text(json.dumps(result))
        return

    started = time.perf_counter()
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import _setup

    _setup.header("reproduce", "cpu", "float32", "eager (the quickstart model's)")
    me = [sys.executable, __file__, "--size", cli.size, "--out", str(cli.out)]
    _run_jobs([me + ["--worker", "sft", "-", str(s)] for s in cli.seeds
               if not (cli.out / f"sft-{s}" / "config.json").exists()], cli.jobs)
    _run_jobs([me + ["--worker", "rl", a, str(s)] for s in cli.seeds for a in cli.arms], cli.jobs)
    results = [json.loads((cli.out / f"{a}-{s}.json").read_text()) for s in cli.seeds for a in cli.arms]
    (cli.out / "results.json").write_text(json.dumps(results))
    print(report(results, cli.out))
    print(f"reproduce: {len(results)} runs in {time.perf_counter() - started:.0f}s -> {cli.out}")


if __name__ == "__main__":
    main()
