"""Stress search: does GRPO without routing replay fail on a MoE where GSPO and GRPO + replay do not?

Three arms train the same pretrained MoE (from benchmarks/moe_mechanism.py: a 4-layer Qwen3-MoE language model on
addition strings, ~10-token completions of three sums) with the same rollouts machinery:

    gspo     trl_gspo.losses.gspo_loss, eps 3e-4 / 4e-4 (sequence ratio, eq. 5 and 7 of the GSPO paper)
    grpo     token-level GRPO, eps 0.2 / 0.27 (eq. 2), natural routing
    grpo_rr  grpo with the old policy's routes replayed in every training pass (trl_gspo.routing.RoutingReplay)

It is a minimal off-policy RL loop, not the TRL trainer: per rollout batch, the old policy scores it (routes
recorded), then it is split into `minibatches` Adam steps, repeated `iterations` times. That keeps one run to
about a minute on one core so that many seeds and configurations fit in the budget. The loss functions and the
routing replay are the project's own; the trainer integration is tested in tests/test_trainer_routing.py.

Per run it logs, per rollout batch: mean reward, routing drift (share of (token, layer) routes in the training
passes that differ from the old policy's, measured by RoutingReplay in every arm), clipped share, gradient norm
(before clipping) and non-finite losses. A run *collapses* if its last-5-rollout mean reward is more than 0.1
below its first rollout's (sampled before any update), or a loss or gradient is non-finite.

    python benchmarks/moe_stress.py                  # the chosen configuration, 3 arms x 6 seeds (17 min, 2 shared cores)
    python benchmarks/moe_stress.py --search         # the search grid, 2 seeds per arm (appends to the search log)
    python benchmarks/moe_stress.py --quick --jobs 1 # a smoke run in well under 2 minutes
    python benchmarks/moe_stress.py --report benchmarks/moe_stress_results/search.jsonl   # the search log's table

Writes OUT/runs.jsonl (raw, one line per run), OUT/results.md (the table) and OUT/curves.png.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402  (the MoE task, the pretrained models, the scoring, the header)
from reproduce.run import _run_jobs  # noqa: E402  (one worker process per run, `--jobs` at a time)

ARMS = ("gspo", "grpo", "grpo_rr")
BASE = dict(experts=64, top_k=8, lr=3e-3, minibatches=4, iterations=1, rollouts=40, prompts=8, group=8,
            grad_clip=1.0)
# Every configuration the search tried, in order. The docs' search log is made from the runs these produce.
SEARCH = {
    "lr3e-4": dict(BASE, lr=3e-4),
    "lr3e-3": dict(BASE),
    "lr1e-2": dict(BASE, lr=1e-2),
    "lr5e-3": dict(BASE, lr=5e-3),
    "lr3e-3_mb8_it2": dict(BASE, minibatches=8, iterations=2),
    "32x4_lr5e-3": dict(BASE, experts=32, top_k=4, lr=5e-3),
}
CHOSEN = "lr5e-3"  # the search's only configuration where the arms parted (seeds 0-1); re-run on fresh seeds
QUICK = dict(BASE, experts=8, top_k=2, lr=1e-2, rollouts=3, prompts=4, group=4, quick=True)


def _loss(arm: str, logps, old_logps, advantages, mask):
    """(loss, clipped token share) for one mini-batch."""
    from trl_gspo.losses import gspo_loss

    if arm == "gspo":
        out = gspo_loss(logps, old_logps, advantages, mask)
        clipped = (out.low_clipped | out.high_clipped).float().sum() / mask.sum()
        return out.per_sequence_loss.mean(), float(clipped)
    ratio = (logps - old_logps).exp()
    a = advantages[:, None]
    objective = torch.minimum(ratio * a, ratio.clamp(1 - _setup.GRPO_LOW, 1 + _setup.GRPO_HIGH) * a)
    clipped = ((a > 0) & (ratio > 1 + _setup.GRPO_HIGH)) | ((a < 0) & (ratio < 1 - _setup.GRPO_LOW))
    return -(objective * mask).sum() / mask.sum(), float((clipped & mask.bool()).float().sum() / mask.sum())


def run(config: dict, arm: str, seed: int, cache: Path) -> dict:
    from trl_gspo.quickstart.tokenizer import build_tokenizer
    from trl_gspo.routing import RoutingReplay

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    overrides = _setup.QUICK_MODEL if config.get("quick") else _setup.MODELS[(config["experts"], config["top_k"])]
    model = _setup.pretrain(overrides, 20 if config.get("quick") else 300, cache, print)
    rr = RoutingReplay(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    rng = random.Random(seed)
    torch.manual_seed(seed)
    history = []
    started = time.perf_counter()
    for _ in range(config["rollouts"]):
        batch = _setup.rollout(model, tokenizer, rng, config["prompts"], config["group"])
        model.eval()
        with torch.no_grad(), rr.record() as old:
            old_logps = _setup.token_logps(model, batch)
        rows_per_mb = batch["input_ids"].shape[0] // config["minibatches"]
        entry = dict(reward=float(batch["rewards"].mean()), drift=[], clipped=[], grad_norm=[], non_finite=0)
        model.train()
        for _ in range(config["iterations"]):
            for j in range(config["minibatches"]):
                rows = slice(j * rows_per_mb, (j + 1) * rows_per_mb)
                mask = batch["completion_mask"][rows].float()
                # the attention mask counts prompt and completion tokens; all-False `mask` = measure drift only
                force = None if arm == "grpo_rr" else torch.zeros_like(batch["attention_mask"][rows], dtype=torch.bool)
                with rr.replay(old.indices[rows], mask=force, stats_mask=batch["attention_mask"][rows]):
                    logps = _setup.token_logps(model, batch, rows)
                    loss, clipped = _loss(arm, logps, old_logps[rows], batch["advantages"][rows], mask)
                    loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                      config["grad_clip"] if config["grad_clip"] > 0 else math.inf)
                if not (torch.isfinite(loss) and torch.isfinite(norm)):
                    entry["non_finite"] += 1
                    optimizer.zero_grad()
                    continue
                optimizer.step()
                optimizer.zero_grad()
                entry["drift"].append(float(rr.drift.mean()))
                entry["clipped"].append(clipped)
                entry["grad_norm"].append(float(norm))
        history.append(entry)
    return dict(arm=arm, seed=seed, config=config, history=history, wall_s=time.perf_counter() - started,
                **outcome(history))


def outcome(history: list[dict]) -> dict:
    """Summary of one run. `start` is the first rollout batch's reward, sampled before any update (the same for
    the three arms of a seed); a run collapsed if its last 5 rollouts average more than 0.1 below it, or any step
    was non-finite."""
    rewards = [h["reward"] for h in history]
    window = lambda i: statistics.mean(rewards[i:i + 5])  # noqa: E731
    non_finite = sum(h["non_finite"] for h in history)
    drifts = [d for h in history for d in h["drift"]]
    last = window(len(rewards) - 5) if len(rewards) >= 5 else statistics.mean(rewards)
    return dict(start=rewards[0], best=max(window(i) for i in range(max(1, len(rewards) - 4))), last=last,
                non_finite=non_finite, collapsed=bool(non_finite or last < rewards[0] - 0.1),
                drift=statistics.mean(drifts) if drifts else None,
                peak_drift=max((statistics.mean(h["drift"]) for h in history if h["drift"]), default=None),
                max_grad_norm=max((g for h in history for g in h["grad_norm"]), default=None))


# ---------------------------------------------------------------------------------------------------- driver
def _mean_sd(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.2g}"


def table(runs: list[dict]) -> str:
    lines = ["| config | arm | seeds | reward start -> last 5 rollouts | best 5 | collapsed | non-finite steps "
             "| drift per update (mean / peak rollout) | clipped share | max grad norm (median over seeds) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["name"] for r in runs):
        for arm in ARMS:
            rs = [dict(r, **outcome(r["history"])) for r in runs if r["name"] == name and r["arm"] == arm]
            if not rs:
                continue
            clipped = [statistics.mean(c for h in r["history"] for c in h["clipped"]) for r in rs
                       if any(h["clipped"] for h in r["history"])]
            lines.append(
                f"| {name} | {arm} | {len(rs)} | {_mean_sd([r['start'] for r in rs])} -> "
                f"{_mean_sd([r['last'] for r in rs])} | {_mean_sd([r['best'] for r in rs])} "
                f"| **{sum(r['collapsed'] for r in rs)}/{len(rs)}** | {sum(r['non_finite'] for r in rs)} "
                f"| {_mean_sd([r['drift'] for r in rs])} / {_mean_sd([r['peak_drift'] for r in rs])} "
                f"| {_mean_sd(clipped)} | {statistics.median(r['max_grad_norm'] or 0 for r in rs):.3g} |")
    return "\n".join(lines)


def curves(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, axes = plt.subplots(len(names), 3, figsize=(16, 3.6 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        for color, arm in zip(("C0", "C1", "C2"), ARMS):
            for i, r in enumerate(r for r in runs if r["name"] == name and r["arm"] == arm):
                x = range(1, len(r["history"]) + 1)
                label = arm if i == 0 else None
                row[0].plot(x, [h["reward"] for h in r["history"]], color=color, alpha=0.6, label=label)
                row[1].plot(x, [statistics.mean(h["drift"]) if h["drift"] else float("nan") for h in r["history"]],
                            color=color, alpha=0.6, label=label)
                row[2].plot(x, [max(h["grad_norm"]) if h["grad_norm"] else float("nan") for h in r["history"]],
                            color=color, alpha=0.6, label=label)
        for ax, title in zip(row, ("reward", "routing drift per update (token-layer share)",
                                   "max grad norm (before clipping, log)")):
            ax.set_title(f"{name}: {title}")
            ax.set_xlabel("rollout batch")
            ax.legend()
        row[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--search", action="store_true", help="run the search grid (SEARCH) instead of CHOSEN")
    parser.add_argument("--configs", nargs="+", choices=SEARCH, help="with --search: only these")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/moe_stress_results"))
    parser.add_argument("--cache", type=Path, default=Path("outputs/moe_mechanism/cache"))
    parser.add_argument("--figure", type=Path, help="also save the curves here (e.g. docs/img/moe_stress.png)")
    parser.add_argument("--report", type=Path, help="only print the table of the runs in this .jsonl")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "ARM", "SEED"), help=argparse.SUPPRESS)
    cli = parser.parse_args()

    if cli.report:
        print(table([json.loads(line) for line in cli.report.read_text().splitlines()]))
        return
    if cli.quick:
        configs = {"quick": QUICK}
        seeds = cli.seeds or [0]
    elif cli.search:
        configs = {k: SEARCH[k] for k in (cli.configs or SEARCH)}
        seeds = cli.seeds or [0, 1]
    else:
        configs = {CHOSEN: SEARCH[CHOSEN]}
        seeds = cli.seeds or list(range(10, 16))  # not the search's seeds 0-1: an independent replication

    if cli.worker:
        name, arm, seed = cli.worker
        result = run(configs[name], arm, int(seed), cli.cache)
        result["name"] = name
        (cli.out / "parts").mkdir(parents=True, exist_ok=True)
        (cli.out / "parts" / f"{name}-{arm}-{seed}.json").write_text(json.dumps(result))
        return

    started = time.perf_counter()
    _setup.header("moe_stress", "cpu", torch.float32, "grouped_mm")
    cli.out.mkdir(parents=True, exist_ok=True)
    for config in configs.values():  # pretrain (or load) once, before the workers start
        overrides = _setup.QUICK_MODEL if config.get("quick") else _setup.MODELS[(config["experts"], config["top_k"])]
        _setup.pretrain(overrides, 20 if config.get("quick") else 300, cli.cache, print)
    me = [sys.executable, __file__, "--out", str(cli.out), "--cache", str(cli.cache)]
    me += ["--quick"] if cli.quick else ["--search"] if cli.search else []
    jobs = [(n, a, s) for n in configs for s in seeds for a in ARMS]
    if cli.jobs == 1:  # in this process: no start-up cost per run
        runs = [dict(run(configs[n], a, s, cli.cache), name=n) for n, a, s in jobs]
    else:
        _run_jobs([me + ["--worker", n, a, str(s)] for n, a, s in jobs], cli.jobs)
        runs = [json.loads((cli.out / "parts" / f"{n}-{a}-{s}.json").read_text()) for n, a, s in jobs]
        for n, a, s in jobs:
            (cli.out / "parts" / f"{n}-{a}-{s}.json").unlink()
    log_name = "search.jsonl" if cli.search else "runs.jsonl"
    with open(cli.out / log_name, "a" if cli.search else "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
    text = table(runs)
    (cli.out / ("search.md" if cli.search else "results.md")).write_text(text + "\n")
    if not cli.search:
        curves(runs, cli.out / "curves.png")
        if cli.figure:
            curves(runs, cli.figure)
    print(text)
    collapsed = {a: sum(outcome(r["history"])["collapsed"] for r in runs if r["arm"] == a) for a in ARMS}
    per_arm = len(runs) // len(ARMS)
    print(f"moe_stress: collapsed gspo {collapsed['gspo']}/{per_arm}, grpo {collapsed['grpo']}/{per_arm}, "
          f"grpo_rr {collapsed['grpo_rr']}/{per_arm} ({len(runs)} runs, {time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
