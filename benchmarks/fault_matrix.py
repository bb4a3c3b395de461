"""The fault matrix: every place a rank talks to something outside or can fail alone, injected on the main process
and, separately, on a non-main rank, on two CPU processes under each layout (DDP, and real DeepSpeed ZeRO-2, ZeRO-3
and ZeRO-3 with parameter offload over gloo), for GSPOTrainer in server mode (TRL's own `VLLMGeneration` against a
stand-in server), GSPOTrainer with HF generate, and AsyncGSPOTrainer. The runs are tests/scripts/fault_run.py.

Every cell must show: each rank stopped within 60 s of the fault, with the same error class, and a message that names
the phase and what to do; the newest complete checkpoint is complete (a checkpoint the fault cut short is not
complete, so a resume skips it); the launcher exited and no process of the run is left.

    python benchmarks/fault_matrix.py [--layouts ddp,zero3] [--trainers gspo-server,gspo-hf,async] [--out DIR]

prints the table; `--write-docs` puts it in docs/results.md and its summary per fault point in
docs/reliability.md. tests/test_fault_matrix.py runs
every fault point on DDP and ZeRO-3 in CI through `run_launch` and `check_cell`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
sys.path.insert(0, str(ROOT))
from fault_run import ANY_FAULTS, ASYNC_FAULTS, HF_FAULTS, SERVER_FAULTS  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "fault_run.py"
LAYOUTS = {"ddp": "cpu_ddp.yaml", "zero2": "cpu_zero2.yaml", "zero3": "cpu_zero3.yaml",
           "zero3-offload": "cpu_zero3_offload.yaml"}
# Faults a rank meets in its main thread on every rank at once (an agreed section): several run in one launch.
AGREED = set(SERVER_FAULTS) | set(ASYNC_FAULTS) | {"nan"}
STOP_WITHIN_S = 60.0


def cells_of(trainer: str, layout: str) -> list[str]:
    """The trainer's cells: faults only the main process can meet (it alone talks to the server) on rank 0; the
    others on rank 0 and, separately, on rank 1. The asynchronous trainer computes rewards in its rollout worker,
    not on the ranks."""
    if trainer == "gspo-server":
        own, common = SERVER_FAULTS, ANY_FAULTS
    elif trainer == "gspo-hf":
        own, common = (), HF_FAULTS + ANY_FAULTS
    else:
        own, common = ASYNC_FAULTS, tuple(f for f in ANY_FAULTS if not f.startswith("reward"))
    return [f"{fault}@0" for fault in own] + [f"{fault}@{rank}" for fault in common for rank in (0, 1)]


def launches(cells: list[str]) -> list[list[str]]:
    """Agreed cells together in one launch; each other cell alone (the watch ends its processes)."""
    agreed = [c for c in cells if c.split("@")[0] in AGREED]
    return ([agreed] if agreed else []) + [[c] for c in cells if c.split("@")[0] not in AGREED]


def run_launch(out_dir: Path, layout: str, trainer: str, cells: list[str], model_dir: str | None = None,
               timeout: float = 600) -> dict:
    """One `accelerate launch` of fault_run.py; returns the launcher's exit code, seconds and the processes of the
    run still alive afterwards."""
    from support.helpers import cpu_env, free_port

    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes" / "accelerate" / LAYOUTS[layout]), "--num_processes", "2",
               "--main_process_port", str(free_port()), str(SCRIPT), str(out_dir), "--trainer", trainer, *cells]
    if model_dir:
        command += ["--model-dir", str(model_dir)]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=cpu_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1"))
    (out_dir / f"launch-{cells[0]}.log").write_text(result.stdout + result.stderr)
    return {"returncode": result.returncode, "seconds": time.monotonic() - start,
            "left": _left_behind(out_dir), "log": result.stderr[-4000:]}


def _left_behind(out_dir: Path) -> list[int]:
    import psutil

    left = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(out_dir) in " ".join(process.info["cmdline"] or ()):
                left.append(process.info["pid"])
        except psutil.Error:
            continue
    return left


def check_cell(out_dir: Path, cell: str, launch: dict) -> list[str]:
    """What the cell got wrong (empty: it passed)."""
    from trl_gspo.checkpoints import checkpoint_problem, latest_complete_checkpoint

    problems, reports = [], []
    for rank in (0, 1):
        path = out_dir / cell / f"rank{rank}.json"
        if not path.exists():
            problems.append(f"rank {rank} wrote no report")
            continue
        reports.append(json.loads(path.read_text()))
    if len(reports) < 2:
        return problems + [launch["log"][-1500:]]
    classes = {r["error"] for r in reports}
    if None in classes or len(classes) != 1:
        problems.append(f"error classes {[r['error'] for r in reports]}")
    for rank, report in enumerate(reports):
        text = report["text"]
        if " while " not in text or "What to do:" not in text:
            problems.append(f"rank {rank}'s message names no phase or no fix: {text[-300:]!r}")
        seconds = report["seconds_after_fault"]
        if seconds is None or seconds > STOP_WITHIN_S:
            problems.append(f"rank {rank} stopped {seconds} s after the fault")
    watched = any(r["stopped_by_watch"] for r in reports)
    if watched and launch["returncode"] == 0:
        problems.append("the launcher exited 0")
    if launch["left"]:
        problems.append(f"processes left behind: {launch['left']}")
    newest, _ = latest_complete_checkpoint(str(out_dir / cell / "run"))
    if newest is None or checkpoint_problem(newest) is not None:
        problems.append(f"no complete checkpoint left ({newest})")
    return problems


def _phase(reports: list[dict]) -> str:
    text = reports[0]["text"] if reports else ""
    marker = " while "
    if "raised on" in text and marker in text:
        return text.split("raised on", 1)[1].split(marker, 1)[1].split(".")[0].split("]")[0]
    return "?"


def run_matrix(layouts, trainers, out: Path, model_dir: str | None, only: set | None = None) -> list[dict]:
    rows = []
    for layout in layouts:
        for trainer in trainers:
            cells = [cell for cell in cells_of(trainer, layout) if only is None or cell in only]
            for group in launches(cells):
                base = out / layout / trainer
                base.mkdir(parents=True, exist_ok=True)
                launch = run_launch(base, layout, trainer, group, model_dir)
                for cell in group:
                    problems = check_cell(base, cell.replace(":", "-"), launch)
                    reports = [json.loads(p.read_text())
                               for p in sorted((base / cell.replace(":", "-")).glob("rank*.json"))]
                    stop = max((r["seconds_after_fault"] or 0.0) for r in reports) if reports else None
                    rows.append({"layout": layout, "trainer": trainer, "cell": cell,
                                 "error": reports[0]["error"] if reports else None, "phase": _phase(reports),
                                 "how": "watch" if any(r["stopped_by_watch"] for r in reports) else "raised",
                                 "stop_s": stop, "launch_s": launch["seconds"], "problems": problems})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| layout | trainer | fault @ rank | error on every rank | phase named | how the others stopped | "
             "last rank stopped (s after fault) | result |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        result = "pass" if not row["problems"] else "FAIL: " + "; ".join(row["problems"])[:200]
        stop = f"{row['stop_s']:.1f}" if row["stop_s"] is not None else "-"
        how = "agreed raise" if row["how"] == "raised" else "store watch"
        lines.append(f"| {row['layout']} | {row['trainer']} | `{row['cell']}` | `{row['error']}` | {row['phase']} | "
                     f"{how} | {stop} | {result} |")
    return "\n".join(lines)


def fault_table(rows: list[dict]) -> str:
    """docs/results.md's table: one row per fault point over every layout and trainer it ran on (the full table,
    one row per cell, is what the script prints)."""
    lines = ["| fault | error on every rank | phase named | how the others stopped | last rank stopped (s after "
             "fault) | cells passed |", "|---|---|---|---|---|---|"]
    for fault in dict.fromkeys(row["cell"].split("@")[0] for row in rows):
        run = [row for row in rows if row["cell"].split("@")[0] == fault]

        def joined(key, run=run):
            return ", ".join(dict.fromkeys(str(row[key]) for row in run))

        stops = [row["stop_s"] for row in run if row["stop_s"] is not None]
        stop = "-" if not stops else (f"{min(stops):.1f}" if f"{min(stops):.1f}" == f"{max(stops):.1f}"
                                      else f"{min(stops):.1f}-{max(stops):.1f}")
        how = ", ".join(dict.fromkeys("agreed raise" if row["how"] == "raised" else "store watch" for row in run))
        passed = sum(1 for row in run if not row["problems"])
        lines.append(f"| `{fault}` | `{joined('error')}` | {joined('phase')} | {how} | {stop} | "
                     f"{passed} of {len(run)} |")
    return "\n".join(lines)


RESULTS, RELIABILITY = ROOT / "docs" / "results.md", ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- fault matrix: benchmarks/fault_matrix.py --write-docs -->", "<!-- end of the fault matrix -->"


def summary(rows: list[dict]) -> str:
    """One row per fault point: the cells that passed of those run, per layout."""
    layouts = list(dict.fromkeys(row["layout"] for row in rows))
    faults = list(dict.fromkeys(row["cell"].split("@")[0] for row in rows))
    lines = ["| fault | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    for fault in faults:
        cells = []
        for layout in layouts:
            run = [r for r in rows if r["layout"] == layout and r["cell"].split("@")[0] == fault]
            passed = sum(1 for r in run if not r["problems"])
            cells.append(f"{passed}/{len(run)} pass" if run else "-")
        lines.append(f"| `{fault}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _between_markers(path: Path, text: str) -> None:
    page = path.read_text()
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    path.write_text(page[:start] + "\n" + text + "\n" + page[end:])


def write_docs(rows: list[dict], seconds: float, command: str) -> None:
    """This run's table per fault point into docs/results.md and its summary per layout into docs/reliability.md,
    each between the page's markers, with what ran it."""
    import datetime
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    failed = sum(1 for row in rows if row["problems"])
    source = (f"Measured {datetime.date.today().isoformat()} at {commit} on a {os_cpus()}-core CPU machine "
              f"({platform.machine()}, torch {torch.__version__}): `{command}`, {len(rows)} cells, {failed} failed, "
              f"{seconds / 60:.0f} min.")
    _between_markers(RESULTS, source + "\n\n" + fault_table(rows))
    _between_markers(RELIABILITY, summary(rows))


def os_cpus() -> int:
    import os

    return os.cpu_count() or 1


def _saved_rows(path: Path) -> list[dict]:
    text = path.read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--trainers", default="gspo-server,gspo-hf,async")
    parser.add_argument("--out", type=Path, default=Path("/tmp/trl-gspo-fault-matrix"))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--cells", help="only these cells (comma-separated, e.g. nan@0,oom@1)")
    parser.add_argument("--write-docs", action="store_true", help="put the table in docs/results.md, a summary in docs/reliability.md")
    parser.add_argument("--rows", type=Path, nargs="+",
                        help="no run: the table of rows saved by --json (or the JSON lines a run prints)")
    options = parser.parse_args()
    import _setup  # benchmarks/: the conditions line every benchmark prints first

    _setup.header("fault_matrix", "cpu", "float32", _setup.size_kernel("tiny"))
    if options.rows:
        rows = [row for path in options.rows for row in _saved_rows(path)]
        print(table(rows))
        if options.write_docs:
            seconds = sum(row["launch_s"] for row in {(r["layout"], r["trainer"], r["launch_s"]): r
                                                      for r in rows}.values())
            write_docs(rows, seconds, "python benchmarks/fault_matrix.py --json ROWS, then --rows ROWS --write-docs")
        return
    trainers = options.trainers.split(",")
    model_dir = None
    if "async" in trainers:  # AsyncGSPOTrainer loads its model by path
        sys.path.insert(0, str(ROOT / "tests"))
        from support.helpers import save_tiny_moe

        model_dir = save_tiny_moe(options.out / "model")
    start = time.monotonic()
    only = set(options.cells.split(",")) if options.cells else None
    rows = run_matrix(options.layouts.split(","), trainers, options.out, model_dir, only)
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    failed = sum(1 for row in rows if row["problems"])
    print(f"\n{len(rows)} cells, {failed} failed, {time.monotonic() - start:.0f} s")
    if options.write_docs:
        write_docs(rows, time.monotonic() - start, "python benchmarks/fault_matrix.py " + " ".join(sys.argv[1:]))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
