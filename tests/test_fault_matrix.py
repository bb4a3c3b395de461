"""Every fault point of the fault matrix (benchmarks/fault_matrix.py, docs/reliability.md) on two processes under DDP
and under real DeepSpeed ZeRO-3 over gloo (no stubbed collective): each rank stops within 60 s of the fault with the
same error class and a message naming the phase and what to do, the newest complete checkpoint stays complete, and
no process is left. The faults every rank raises together run in one launch per layout; each fault the store watch
handles (its processes end) runs alone, under one layout, the layouts taking turns (rank 1 under DDP, the main
process under ZeRO-3). The full matrix (every layout, both ranks, three trainers) is the benchmark's run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from fault_matrix import check_cell, run_launch  # noqa: E402

pytestmark = pytest.mark.slow

AGREED = ["server-before-stream@0", "server-mid-stream@0", "server-generate@0", "lora-build@0", "nan@{r}",
          "async:async-pause@0", "async:async-send@0", "async:async-resume@0"]
WATCHED = ["reward-raises@{r}", "reward-hangs@{r}", "oom@{r}", "save-fails@{r}"]
LAYOUTS = {"ddp": 1, "zero3": 0}  # the rank that meets the faults any rank can meet, per layout


def _run(out_dir, layout, cells, model_dir):
    launch = run_launch(out_dir, layout, "gspo-server", cells, model_dir=model_dir, timeout=420)
    failures = {cell: problems for cell in cells
                if (problems := check_cell(out_dir, cell.replace(":", "-"), launch))}
    assert not failures, failures


@pytest.mark.parametrize("layout", LAYOUTS)
def test_faults_every_rank_raises_together(tmp_path, tiny_moe_dir, layout):
    """Before, in and after a server-mode weight stream whose ZeRO-3 gathers are real, at a generation request, a
    LoRA W + delta build, a NaN, and the asynchronous trainer's pause / send / resume: every rank raises."""
    _run(tmp_path, layout, [cell.format(r=LAYOUTS[layout]) for cell in AGREED], tiny_moe_dir)


# Each watched fault once, the layouts taking turns (a launch each; the benchmark runs every pairing).
@pytest.mark.parametrize("layout, cell", [(list(LAYOUTS)[index % len(LAYOUTS)], cell)
                                          for index, cell in enumerate(WATCHED)])
def test_faults_on_one_rank_stop_the_others_through_the_watch(tmp_path, layout, cell):
    """A reward function that raises or never returns (the backstop, rank_wait_timeout 8 s), out of memory in one
    rank's backward, a full disk at a checkpoint: the others, waiting in a collective, stop with the same error."""
    _run(tmp_path, layout, [cell.format(r=LAYOUTS[layout])], None)


def test_the_docs_table_has_one_row_per_fault_point():
    """docs/results.md's table (`--write-docs`) folds the cells of a fault point into one row: the page stays within
    its word budget whatever the matrix's size."""
    from fault_matrix import fault_table

    def row(layout, cell, stop, problems=()):
        return {"layout": layout, "trainer": "gspo", "cell": cell, "error": "ValueError", "phase": "running a step",
                "how": "raised", "stop_s": stop, "launch_s": 9.0, "problems": list(problems)}

    rows = [row("ddp", "nan@0", 0.1), row("zero3", "nan@1", 0.2), row("ddp", "oom@1", 3.0, ["rank 0 hung"])]
    lines = fault_table(rows).splitlines()
    assert len(lines) == 4, lines
    assert lines[2] == "| `nan` | `ValueError` | running a step | agreed raise | 0.1-0.2 | 2 of 2 |"
    assert lines[3].endswith("| 3.0 | 0 of 1 |")
