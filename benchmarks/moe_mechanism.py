"""Why token ratios break on Mixture-of-Experts: measured per token after real off-policy updates.

The GSPO paper's argument (section 5.3) is mechanical: after a gradient update some tokens are routed to other
experts, their token ratio r_t = pi_theta(y_t) / pi_old(y_t) jumps, GRPO's per-token clipping and weighting then
act on routing noise, the sequence ratio s_i = exp(mean_t log r_t) (GSPO, eq. 7) averages it out, and routing
replay removes it. This script measures each step of that argument on a small MoE whose experts have specialised:

1. A Qwen3-MoE (4 layers, 32 experts top-4 or 64 experts top-8, routers initialised wider than transformers'
   default) is trained as a language model on addition strings ("12+34 5+67 80+9=46 72 89") so that experts
   specialise. Trained weights are cached under outputs/moe_mechanism/cache/ (gitignored), so re-runs skip this.
2. RL in the paper's off-policy setup: each rollout batch (16 prompts x 8 samples, reward = digits right per sum,
   group-normalised advantages) is scored once by the old policy (routes recorded), then split into 4
   mini-batches trained one after the other with token-level GRPO (eps 0.2 / 0.27), Adam. Before mini-batch j is
   trained, it is scored by the current weights twice: with natural routing (routes recorded) and with the old
   policy's routes replayed (`routing_replay="old"`). Mini-batches 1-3 are off-policy by 1-3 updates.
3. Per completion token y_t: did its route change, i.e. the expert set of the position whose output scores y_t,
   in any MoE layer (`trl_gspo.routing.route_changes`); |log r_t| with natural routing and under replay; its
   sequence's |log s_i|; and whether GRPO clips it (r_t outside [0.8, 1.27] on the side its advantage pushes).
4. The second source, with no weight change at all: the same weights scored on two numeric paths (float32 vs
   bfloat16, and a different batch composition and padding), as an inference engine and a trainer differ.

    python benchmarks/moe_mechanism.py           # full sweep, ~10 min on 2 cores the first time (cache: faster)
    python benchmarks/moe_mechanism.py --quick   # seconds, a smoke test

Prints markdown tables (for docs/results.md and docs/moe_evidence.md) and, last, the headline
`moe_mechanism: <mean |log r_t| of route-changed / unchanged tokens>` for the headline configuration.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402  (the MoE task, the pretrained models, the header line)

from _setup import (GRPO_HIGH, GRPO_LOW, GSPO_HIGH, GSPO_LOW, MODELS, N_SUMS, QUICK_MODEL,  # noqa: E402,F401
                    _positions, make_problem, pretrain, reward, rollout, token_logps)

@dataclass(frozen=True)
class Setting:
    experts: int
    top_k: int
    lr: float

    @property
    def name(self) -> str:
        return f"{self.experts} experts top-{self.top_k}, lr {self.lr:g}"


# The headline setting first; then the drift sweep.
FULL_SWEEP = [Setting(64, 8, 3e-4), Setting(64, 8, 1e-4), Setting(64, 8, 1e-3),
              Setting(32, 4, 1e-4), Setting(32, 4, 3e-4), Setting(32, 4, 1e-3), Setting(8, 2, 3e-4)]


def scoring_routes(indices: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The routes of the positions whose outputs score the completion tokens (position t-1 for token t)."""
    return indices[:, prompt_len - 1:-1]


def grpo_step(model, optimizer, batch: dict, rows: slice, old_logps: torch.Tensor) -> None:
    """One token-level GRPO update (eq. 2 of the GSPO paper, eps 0.2 / 0.27, tokens averaged over the batch)."""
    model.train()
    mask = batch["completion_mask"][rows].float()
    log_ratio = token_logps(model, batch, rows) - old_logps[rows]
    ratio = log_ratio.exp()
    advantage = batch["advantages"][rows, None]
    objective = torch.minimum(ratio * advantage, ratio.clamp(1 - GRPO_LOW, 1 + GRPO_HIGH) * advantage)
    loss = -(objective * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def measure_updates(model, tokenizer, lr: float, rollouts: int, prompts: int, group: int, minibatches: int,
                    seed: int) -> dict:
    """Run the off-policy RL loop and return per-token tensors for the off-policy mini-batches."""
    from trl_gspo.routing import RoutingReplay, route_changes

    model = copy.deepcopy(model)
    rr = RoutingReplay(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows_per_mb = prompts * group // minibatches
    parts: dict[str, list] = {k: [] for k in ("changed", "layers_changed", "log_r", "log_r_replay", "log_s",
                                              "log_s_replay", "advantage", "seq_id", "on_policy_max", "lag")}
    sequences = 0
    for _ in range(rollouts):
        batch = rollout(model, tokenizer, rng, prompts, group)
        start = batch["prompt_len"]
        model.eval()
        with torch.no_grad(), rr.record() as old:
            old_logps = token_logps(model, batch)
        for j in range(minibatches):
            rows = slice(j * rows_per_mb, (j + 1) * rows_per_mb)
            mask = batch["completion_mask"][rows]
            model.eval()
            with torch.no_grad():
                with rr.record() as now:
                    log_r = token_logps(model, batch, rows) - old_logps[rows]
                with rr.replay(old.indices[rows]):
                    log_r_replay = token_logps(model, batch, rows) - old_logps[rows]
            if j == 0:  # on-policy: nothing moved yet, a check that the measurement itself adds no noise
                parts["on_policy_max"].append(float(log_r[mask].abs().max()))
                parts["on_policy_max"].append(float(route_changes(now.indices, old.indices[rows]).any()))
            else:
                per_layer = route_changes(scoring_routes(now.indices, start),
                                          scoring_routes(old.indices[rows], start), per_layer=True)
                counts = mask.sum(-1, keepdim=True)
                log_s = ((log_r * mask).sum(-1, keepdim=True) / counts).expand_as(log_r)
                log_s_replay = ((log_r_replay * mask).sum(-1, keepdim=True) / counts).expand_as(log_r)
                seq_ids = torch.arange(sequences, sequences + mask.shape[0])[:, None].expand_as(log_r)
                for key, value in (("changed", per_layer.any(-1)), ("layers_changed", per_layer.sum(-1)),
                                   ("log_r", log_r), ("log_r_replay", log_r_replay), ("log_s", log_s),
                                   ("log_s_replay", log_s_replay),
                                   ("advantage", batch["advantages"][rows, None].expand_as(log_r)),
                                   ("seq_id", seq_ids), ("lag", torch.full_like(seq_ids, j))):
                    parts[key].append(value[mask])
                sequences += mask.shape[0]
            grpo_step(model, optimizer, batch, rows, old_logps)
    out = {k: torch.cat(v) for k, v in parts.items() if k != "on_policy_max"}
    out["on_policy_max"] = max(parts["on_policy_max"])
    out["layers"] = len(rr.routers)
    return out


# ---------------------------------------------------------------------------------------------------- statistics
def _dist(values: torch.Tensor) -> dict:
    v = values.double()
    if v.numel() == 0:
        return dict(n=0, mean=float("nan"), p50=float("nan"), p99=float("nan"), outside=float("nan"))
    outside = ((v.exp() < 1 - GRPO_LOW) | (v.exp() > 1 + GRPO_HIGH)).double().mean()
    a = v.abs()
    return dict(n=int(v.numel()), mean=float(a.mean()), p50=float(a.quantile(0.5)), p99=float(a.quantile(0.99)),
                outside=float(outside))


def summarize(t: dict) -> dict:
    changed = t["changed"]
    clipped = ((t["advantage"] > 0) & (t["log_r"].exp() > 1 + GRPO_HIGH)) | \
              ((t["advantage"] < 0) & (t["log_r"].exp() < 1 - GRPO_LOW))
    first = torch.ones_like(changed)  # one entry per sequence for the sequence statistics
    first[1:] = t["seq_id"][1:] != t["seq_id"][:-1]
    log_s, log_s_replay = t["log_s"][first], t["log_s_replay"][first]
    seq_outside = ((log_s.exp() < 1 - GSPO_LOW) | (log_s.exp() > 1 + GSPO_HIGH)).double().mean()
    result = dict(
        tokens=int(changed.numel()),
        changed_token_share=float(changed.double().mean()),
        changed_token_layer_share=float(t["layers_changed"].double().sum() / (changed.numel() * t["layers"])),
        natural=dict(changed=_dist(t["log_r"][changed]), unchanged=_dist(t["log_r"][~changed]),
                     all=_dist(t["log_r"])),
        replay=dict(changed=_dist(t["log_r_replay"][changed]), unchanged=_dist(t["log_r_replay"][~changed]),
                    all=_dist(t["log_r_replay"])),
        clipped_share=float(clipped.double().mean()),
        clipped_route_changed=float(changed[clipped].double().mean()) if clipped.any() else float("nan"),
        mean_abs_log_s=float(log_s.abs().mean()), mean_abs_log_s_replay=float(log_s_replay.abs().mean()),
        seq_outside_gspo=float(seq_outside),
        on_policy_max=t["on_policy_max"],  # max |log r_t| (and 1.0 if any route changed) before any update
    )
    for arm in ("natural", "replay"):
        d = result[arm]
        d["ratio"] = d["changed"]["mean"] / d["unchanged"]["mean"] if d["unchanged"]["mean"] > 0 else float("nan")
    return result


@torch.no_grad()
def numeric_paths(model, tokenizer, prompts: int, group: int, seed: int) -> list[dict]:
    """Same weights, two numeric paths: route flips and log-ratio sizes, with no weight change at all."""
    from trl_gspo.routing import RoutingReplay, route_changes

    batch = rollout(model, tokenizer, random.Random(seed + 1000), prompts, group)
    start, mask = batch["prompt_len"], batch["completion_mask"]
    rows = mask.shape[0]

    def score(m, b, replay_indices=None):
        rr = RoutingReplay(m)
        m.eval()
        if replay_indices is not None:
            with rr.replay(replay_indices):
                return token_logps(m, b), None
        with rr.record() as rec:
            logps = token_logps(m, b)
        return logps, rec.indices

    def recomposed(b, extra_pad: int, order: torch.Tensor):
        """Rows in another order, with `extra_pad` more left-padding columns."""
        ids = torch.nn.functional.pad(b["input_ids"][order], (extra_pad, 0), value=tokenizer.pad_token_id)
        am = torch.nn.functional.pad(b["attention_mask"][order], (extra_pad, 0), value=0)
        return dict(input_ids=ids, attention_mask=am, prompt_len=b["prompt_len"] + extra_pad)

    def chunked(m, b, chunk):  # scored `chunk` rows at a time
        logps, indices = [], []
        for i in range(0, b["input_ids"].shape[0], chunk):
            part = dict(b, input_ids=b["input_ids"][i:i + chunk], attention_mask=b["attention_mask"][i:i + chunk])
            lp, ind = score(m, part)
            logps.append(lp)
            indices.append(ind[:, -(b["input_ids"].shape[1] - b["prompt_len"] + 1):])  # completion-scoring span
        return torch.cat(logps), torch.cat(indices)

    def row(name, logps_a, routes_a, logps_b, routes_b, replayed_logps=None):
        flips = route_changes(routes_a, routes_b, per_layer=True)  # routes of the scoring positions
        flipped = flips.any(-1)[mask]
        log_r = (logps_b - logps_a)[mask]
        counts = mask.sum(-1)
        log_s = ((logps_b - logps_a) * mask).sum(-1) / counts
        r = dict(path=name, token_share=float(flipped.double().mean()),
                 token_layer_share=float(flips[mask].double().mean()),
                 flipped=_dist(log_r[flipped]), unflipped=_dist(log_r[~flipped]),
                 mean_abs_log_s=float(log_s.abs().mean()), max_abs_log_s=float(log_s.abs().max()))
        if replayed_logps is not None:
            rep = (replayed_logps - logps_a)[mask]
            r["replayed_flipped"] = _dist(rep[flipped])
            rep_s = ((replayed_logps - logps_a) * mask).sum(-1) / counts
            r["replayed_mean_abs_log_s"] = float(rep_s.abs().mean())
        return r

    fp32 = model.float()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    span = lambda idx: idx[:, start - 1:]  # noqa: E731  routes of the positions scoring the completion (+ last)
    lp32, idx32 = score(fp32, batch)
    lp16, idx16 = score(bf16, batch)
    lp16_replayed, _ = score(bf16, batch, replay_indices=idx32)  # the sampler's (fp32) routes forced in bf16
    rows_out = [row("float32 vs bfloat16, same batch", lp32, span(idx32)[:, :-1], lp16, span(idx16)[:, :-1],
                    lp16_replayed)]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    inverse = order.argsort()
    for dtype_name, m, lp, idx in (("float32", fp32, lp32, idx32), ("bfloat16", bf16, lp16, idx16)):
        other = recomposed(batch, 7, order)
        lp_o, idx_o = chunked(m, other, rows // 4)
        rows_out.append(row(f"{dtype_name}: batch of {rows} vs shuffled rows, +7 left padding, batches of "
                            f"{rows // 4}", lp, span(idx)[:, :-1], lp_o[inverse], idx_o[inverse][:, :-1]))
    return rows_out


# ---------------------------------------------------------------------------------------------------- report
def _f(x: float, digits: int = 3) -> str:
    return "nan" if x != x else f"{x:.{digits}g}"


def tables(results: list[tuple[Setting, dict]], paths: list[dict]) -> str:
    lines = [
        "Per completion token of the off-policy mini-batches (1-3 updates after the old-policy pass). "
        "'changed': the token's expert set changed in at least one MoE layer.",
        "",
        "| setting | tokens | route changed (tokens / token-layers) | mean \\|log r_t\\| changed / unchanged (ratio) "
        "| p50 changed / unchanged | p99 changed / unchanged | outside [0.8, 1.27] changed / unchanged "
        "| GRPO-clipped tokens: share / route-changed among them | mean \\|log s_i\\| / mean \\|log r_t\\| "
        "| sequences outside GSPO's band |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, r in results:
        n = r["natural"]
        lines.append(
            f"| {s.name} | {r['tokens']} | {r['changed_token_share']:.3f} / {r['changed_token_layer_share']:.3f} "
            f"| {_f(n['changed']['mean'])} / {_f(n['unchanged']['mean'])} (**{_f(n['ratio'])}x**) "
            f"| {_f(n['changed']['p50'])} / {_f(n['unchanged']['p50'])} "
            f"| {_f(n['changed']['p99'])} / {_f(n['unchanged']['p99'])} "
            f"| {_f(n['changed']['outside'])} / {_f(n['unchanged']['outside'])} "
            f"| {_f(r['clipped_share'])} / **{_f(r['clipped_route_changed'])}** "
            f"| {_f(r['mean_abs_log_s'])} / {_f(n['all']['mean'])} | {_f(r['seq_outside_gspo'])} |")
    lines += [
        "",
        "The same tokens scored with the old policy's routes replayed (`routing_replay=\"old\"`); 'changed' still "
        "means that natural routing would have changed them.",
        "",
        "| setting | mean \\|log r_t\\| changed / unchanged (ratio) | p99 changed / unchanged "
        "| outside [0.8, 1.27] changed / unchanged | mean \\|log r_t\\| all tokens: natural -> replay "
        "| mean \\|log s_i\\|: natural -> replay |",
        "|---|---|---|---|---|---|",
    ]
    for s, r in results:
        p, n = r["replay"], r["natural"]
        lines.append(
            f"| {s.name} | {_f(p['changed']['mean'])} / {_f(p['unchanged']['mean'])} ({_f(p['ratio'])}x) "
            f"| {_f(p['changed']['p99'])} / {_f(p['unchanged']['p99'])} "
            f"| {_f(p['changed']['outside'])} / {_f(p['unchanged']['outside'])} "
            f"| {_f(n['all']['mean'])} -> {_f(p['all']['mean'])} "
            f"| {_f(r['mean_abs_log_s'])} -> {_f(r['mean_abs_log_s_replay'])} |")
    lines += [
        "",
        "No weight change: the trained weights of the headline model scored on two numeric paths. 'Flipped': the "
        "token's expert set differs between the two paths in at least one layer. GSPO's band is 3e-4.",
        "",
        "| paths | routes flipped (tokens / token-layers) | mean \\|log r_t\\| flipped / unflipped "
        "| p99 flipped / unflipped | flipped, sampler's routes replayed: mean \\|log r_t\\| "
        "| mean \\|log s_i\\| (max) | mean \\|log s_i\\| replayed |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in paths:
        replayed = p.get("replayed_flipped")
        lines.append(
            f"| {p['path']} | {p['token_share']:.4f} / {p['token_layer_share']:.4f} "
            f"| {_f(p['flipped']['mean'])} / {_f(p['unflipped']['mean'])} "
            f"| {_f(p['flipped']['p99'])} / {_f(p['unflipped']['p99'])} "
            f"| {_f(replayed['mean']) if replayed else '-'} "
            f"| {_f(p['mean_abs_log_s'])} ({_f(p['max_abs_log_s'])}) "
            f"| {_f(p['replayed_mean_abs_log_s']) if 'replayed_mean_abs_log_s' in p else '-'} |")
    return "\n".join(lines)


def headline_over_seeds(cli, tokenizer, log) -> None:
    """The headline ratio once per RL seed; last line `moe_mechanism: <median> (...)` with the seeds' spread."""
    setting = Setting(8, 2, 1e-3) if cli.quick else FULL_SWEEP[0]
    overrides = QUICK_MODEL if cli.quick else MODELS[(setting.experts, setting.top_k)]
    model = pretrain(overrides, 20 if cli.quick else cli.pretrain_steps, cli.out / "cache", log)
    prompts, group, rollouts = (4, 4, 1) if cli.quick else (16, 8, cli.rollouts)
    ratios = []
    for seed in cli.seeds:
        torch.manual_seed(seed)
        summary = summarize(measure_updates(model, tokenizer, setting.lr, rollouts, prompts, group, 4, seed))
        ratios.append(summary["natural"]["ratio"])
        log(f"seed {seed}: {setting.name}: routes changed {summary['changed_token_share']:.3f} of tokens, mean "
            f"|log r_t| route-changed / unchanged {ratios[-1]:.2f}x ({summary['replay']['ratio']:.2f}x under replay)")
    finite = sorted(r for r in ratios if math.isfinite(r))
    median = statistics.median(finite) if finite else math.nan
    spread = f"{finite[0]:.2f}-{finite[-1]:.2f}" if finite else "nan"
    print(f"moe_mechanism: {median:.2f} (median of {len(ratios)} seeds {cli.seeds}, range {spread})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model and one rollout: a smoke test")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--rollouts", type=int, default=4, help="rollout batches per setting")
    parser.add_argument("--headline-only", action="store_true",
                        help="only the headline setting (e.g. with --pretrain-steps 0: the untrained control)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="only the headline setting, once per RL seed (rollout sampling and updates; the "
                             "pretrained model is the same): prints each, and last the median and the spread")
    parser.add_argument("--out", type=Path, default=Path("outputs/moe_mechanism"),
                        help="cache of pretrained weights, and summary.json")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(cli.seed)
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    started = time.perf_counter()
    _setup.header("moe_mechanism", "cpu", torch.float32, "grouped_mm")
    if cli.seeds:
        headline_over_seeds(cli, tokenizer, log)
        return
    if cli.quick:
        sweep, steps, rollouts, prompts, group = [Setting(8, 2, 1e-3)], 20, 1, 4, 4
    else:
        sweep, steps, rollouts, prompts, group = FULL_SWEEP, cli.pretrain_steps, cli.rollouts, 16, 8
        sweep = sweep[:1] if cli.headline_only else sweep
    models: dict[tuple[int, int], torch.nn.Module] = {}
    results = []
    for setting in sweep:
        shape = (setting.experts, setting.top_k)
        if shape not in models:
            overrides = QUICK_MODEL if cli.quick else MODELS[shape]
            models[shape] = pretrain(overrides, steps, cli.out / "cache", log)
        tensors = measure_updates(models[shape], tokenizer, setting.lr, rollouts, prompts, group, 4, cli.seed)
        summary = summarize(tensors)
        results.append((setting, summary))
        log(f"{setting.name}: routes changed {summary['changed_token_share']:.3f} of tokens, mean |log r_t| "
            f"ratio {summary['natural']['ratio']:.2f}x natural, {summary['replay']['ratio']:.2f}x under replay "
            f"(on-policy check: max {summary['on_policy_max']:.1e})")
    headline = sweep[0]
    paths = numeric_paths(models[(headline.experts, headline.top_k)], tokenizer, prompts, group, cli.seed)
    cli.out.mkdir(parents=True, exist_ok=True)
    (cli.out / "summary.json").write_text(json.dumps(
        dict(settings=[dict(setting=s.__dict__, **r) for s, r in results], numeric_paths=paths), indent=1))
    print()
    print(tables(results, paths))
    print()
    first = results[0][1]
    log(f"total {time.perf_counter() - started:.0f}s; headline: {headline.name}, {first['tokens']} tokens, "
        f"{first['changed_token_share']:.1%} route-changed")
    ratio = first["natural"]["ratio"]
    print(f"moe_mechanism: {ratio:.2f}" if math.isfinite(ratio) else "moe_mechanism: nan")


if __name__ == "__main__":
    main()
