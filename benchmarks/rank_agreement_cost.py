"""What the ranks' agreement (trl_gspo/ranks/phases.py) costs when nothing fails: collectives and host reads per
optimizer step, per weight sync and per micro-batch, on two CPU processes under each layout (DDP, and real DeepSpeed
ZeRO-2 and ZeRO-3 over gloo), GSPOTrainer in server mode with TRL's own `VLLMGeneration` and `DistributedBackend`
against fault_run.py's stand-in server (so ZeRO-3's gathers in the weight sync are real). Counted, not timed, so the
numbers are the same on every run.

The claim checked: "on success the agreement costs at most one added collective per weight sync, and none per
micro-batch" (one all-reduced flag per server sync, `trl_gspo.ranks.together`; the phases and the store watch add
no collective).

    python benchmarks/rank_agreement_cost.py [--layouts ddp,zero2,zero3] [--steps 3] [--grad-accum 2] \
        [--repeats 2] [--out DIR] [--json PATH]

Each layout is one `accelerate launch` of tests/scripts/agreement_cost_run.py (its docstring says what is counted and
how), which trains the same trainer in two arms in the same processes, `--repeats` times each, interleaved:
`agreement` (as shipped) and `plain` (TRL's `VLLMGeneration.sync_weights` as is, no server guards, RanksStopTogether
passed through, no watch). A row is one rank of one layout: the counts of each arm per optimizer step and the
differences (agreement minus plain) per step, per weight sync (events inside the sync), per micro-batch (inside
`training_step`, less its rollout) and elsewhere (rollout, checkpoint saves, logging; should be 0). Then the call
sites of every event the agreement adds or removes. The last line: `rank_agreement_cost: ...`, the largest
difference of any row. Exits 1 when the repeats of an arm counted differently."""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(ROOT / "tests"))
import _setup  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "agreement_cost_run.py"
LAYOUTS = {"ddp": "cpu_ddp.yaml", "zero2": "cpu_zero2.yaml", "zero3": "cpu_zero3.yaml",
           "zero3-offload": "cpu_zero3_offload.yaml"}
KINDS = ("collective", "host_read")
INSIDE = {"sync": ("sync",), "micro-batch": ("micro-batch",)}  # the other regions: "elsewhere"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(layout: str, out: Path, options) -> dict:
    from support.helpers import cpu_env

    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes" / "accelerate" / LAYOUTS[layout]), "--num_processes", "2",
               "--main_process_port", str(_port()), str(SCRIPT), str(out), "--steps", str(options.steps),
               "--grad-accum", str(options.grad_accum), "--repeats", str(options.repeats)]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout,
                            env=cpu_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1"))
    seconds = time.monotonic() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{layout}: the launch exited {result.returncode}; its log: {out / 'launch.log'}\n"
                         f"{result.stderr[-3000:]}")
    return {"seconds": seconds, "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]}


def _tally(run: dict, window: str = "steps") -> dict:
    """(kind, region) -> count, (kind, name) -> count, (kind, name, region, site) -> count, over one window."""
    by_region, by_name, by_site = collections.Counter(), collections.Counter(), collections.Counter()
    for win, region, kind, name, site, count in run["events"]:
        if win != window:
            continue
        by_region[kind, region] += count
        by_name[kind, name] += count
        by_site[kind, name, region, site] += count
    return {"region": by_region, "name": by_name, "site": by_site}


def _same(runs: list[dict]) -> bool:
    keys = ("steps", "syncs", "micro_batches", "rollouts", "saves", "events")
    return all({k: r[k] for k in keys} == {k: runs[0][k] for k in keys} for r in runs[1:])


def rows_of(layout: str, result: dict) -> tuple[list[dict], collections.Counter]:
    rows, sites = [], collections.Counter()
    for rank_report in result["ranks"]:
        runs = collections.defaultdict(list)
        for run in rank_report["runs"]:
            runs[run["arm"]].append(run)
        agreement, plain = runs["agreement"][0], runs["plain"][0]
        if (agreement["steps"], agreement["syncs"], agreement["micro_batches"]) != (
                plain["steps"], plain["syncs"], plain["micro_batches"]):
            raise SystemExit(f"{layout}: the arms trained differently: {agreement} / {plain}")
        a, p = _tally(agreement), _tally(plain)
        setup_a, setup_p = _tally(agreement, "setup"), _tally(plain, "setup")
        steps, syncs, micro = plain["steps"], plain["syncs"], plain["micro_batches"]
        row = {"layout": layout, "rank": rank_report["rank"], "steps": steps, "weight_syncs": syncs,
               "micro_batches": micro, "rollouts": plain["rollouts"], "checkpoint_saves": plain["saves"],
               "repeats_identical": all(_same(arm_runs) for arm_runs in runs.values()),
               "repeats": len(runs["plain"])}
        for kind in KINDS:
            total = {arm: sum(v for (k, _), v in t["region"].items() if k == kind) for arm, t in (("a", a), ("p", p))}
            inside = {where: sum(a["region"][kind, r] - p["region"][kind, r] for r in regions)
                      for where, regions in INSIDE.items()}
            key = "collectives" if kind == "collective" else "host_reads"
            row[f"{key}_plain_per_step"] = total["p"] / steps
            row[f"{key}_agreement_per_step"] = total["a"] / steps
            row[f"{key}_added_per_step"] = (total["a"] - total["p"]) / steps
            row[f"{key}_added_per_sync"] = inside["sync"] / syncs if syncs else None
            row[f"{key}_added_per_micro_batch"] = inside["micro-batch"] / micro
            row[f"{key}_added_elsewhere"] = total["a"] - total["p"] - sum(inside.values())
            row[f"{key}_added_in_setup"] = (sum(v for (k, _), v in setup_a["region"].items() if k == kind)
                                            - sum(v for (k, _), v in setup_p["region"].items() if k == kind))
            names = collections.Counter({name: a["name"][k, name] - p["name"][k, name]
                                         for (k, name) in set(a["name"]) | set(p["name"]) if k == kind})
            row[f"{key}_added_by_name"] = {name: n for name, n in sorted(names.items()) if n}
        for key in set(a["site"]) | set(p["site"]):
            diff = a["site"][key] - p["site"][key]
            if diff:
                sites[(layout, rank_report["rank"], *key)] += diff
        rows.append(row)
    return rows, sites


def _signed(value) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if value else "0"


def table(rows: list[dict]) -> str:
    lines = ["| layout | rank | collectives / step (plain → agreement) | added / weight sync | added / micro-batch | "
             "added elsewhere | host reads / step (plain → agreement) | added / weight sync | added / micro-batch | "
             "added elsewhere | added calls over the run | repeats identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["layout"], str(row["rank"])]
        for key in ("collectives", "host_reads"):
            cells += [f"{row[key + '_plain_per_step']:.2f} → {row[key + '_agreement_per_step']:.2f} "
                      f"({_signed(row[key + '_added_per_step'])})",
                      _signed(row[key + "_added_per_sync"]), _signed(row[key + "_added_per_micro_batch"]),
                      _signed(row[key + "_added_elsewhere"])]
        added = {**{f"`{n}`": c for n, c in row["collectives_added_by_name"].items()},
                 **{f"`.{n}`": c for n, c in row["host_reads_added_by_name"].items()}}
        cells.append(", ".join(f"{n} {c:+d}" for n, c in added.items()) or "none")
        cells.append(f"yes ({row['repeats']}x)" if row["repeats_identical"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def site_summary(sites: collections.Counter) -> list[str]:
    """The call sites of what the agreement adds or removes, netted by the innermost frame (a wrapper of the agreed
    arm, such as the server guard's, moves the outer frames of a call both arms make), with the stacks behind the
    net difference; the same site across layouts and ranks on one line."""
    net, stacks = collections.defaultdict(collections.Counter), collections.defaultdict(set)
    for (layout, rank, kind, name, region, site), diff in sites.items():
        key = (kind, name, region, site.split(" < ")[0])
        net[key][f"{layout}/r{rank}"] += diff
        stacks[key, diff > 0].add(site)
    lines = []
    for key in sorted(net):
        where = {run: diff for run, diff in sorted(net[key].items()) if diff}
        if not where:
            continue
        kind, name, region, _ = key
        shown = sorted(stacks[key, next(iter(where.values())) > 0])
        lines.append(f"- {kind} `{name}` in {region}: {' | '.join(shown)} "
                     f"[{', '.join(f'{run} {diff:+d}' for run, diff in where.items())}]")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="ddp,zero2,zero3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--repeats", type=int, default=2, help="trainings per arm in each launch, compared")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--out", type=Path, help="the launches' reports and logs (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    options = parser.parse_args()
    _setup.header("rank_agreement_cost", "cpu", "float32", _setup.size_kernel("tiny"))
    out = options.out or Path(tempfile.mkdtemp(prefix="trl-gspo-agreement-cost-"))
    start = time.monotonic()
    rows, sites, seconds = [], collections.Counter(), {}
    for layout in options.layouts.split(","):
        result = launch(layout, out / layout, options)
        layout_rows, layout_sites = rows_of(layout, result)
        for row in layout_rows:
            row["launch_s"] = round(result["seconds"], 1)
        rows += layout_rows
        sites.update(layout_sites)  # `+=` would drop the negative differences
        seconds[layout] = result["seconds"]
        print(f"{layout}: launch {result['seconds']:.0f} s", file=sys.stderr, flush=True)
    if options.json:
        options.json.write_text(json.dumps({"rows": rows, "added_sites": [
            {"layout": k[0], "rank": k[1], "kind": k[2], "name": k[3], "region": k[4], "site": k[5], "added": v}
            for k, v in sorted(sites.items())]}, indent=1))
    first = rows[0]
    print(f"\n{first['steps']} optimizer steps of {first['micro_batches'] // first['steps']} micro-batches per rank, "
          f"{first['weight_syncs']} weight syncs to the stand-in server (steps 2 on), one rollout and one checkpoint "
          f"per step; two processes; counts over the steps (from on_train_begin to on_train_end); "
          f"\"added\": agreement minus plain.\n")
    print(table(rows))
    print("\nCall sites of what the agreement adds (+) or removes (-), innermost frame first, outside torch:")
    print("\n".join(site_summary(sites)) or "- none")

    def largest(key):
        values = [row[key] for row in rows if row[key] is not None]
        return max(values, key=abs) if values else 0.0
    identical = all(row["repeats_identical"] for row in rows)
    added_names = sorted({n for row in rows for n in row["collectives_added_by_name"]})
    print(f"\nrank_agreement_cost: collectives {_signed(largest('collectives_added_per_sync'))} per weight sync "
          f"({', '.join(added_names) or 'none'}), {_signed(largest('collectives_added_per_micro_batch'))} per "
          f"micro-batch, {_signed(largest('collectives_added_elsewhere'))} elsewhere; host reads "
          f"{_signed(largest('host_reads_added_per_sync'))} per weight sync, "
          f"{_signed(largest('host_reads_added_per_micro_batch'))} per micro-batch "
          f"({','.join(seconds)}; 2 ranks; repeats {'identical' if identical else 'DIFFER'}; "
          f"{time.monotonic() - start:.0f} s)")
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
