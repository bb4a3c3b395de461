"""docs/results.md's table of GSPO's successors under staleness is the benchmark's own output over the runs files
committed beside it: every table row in that section is a line that `benchmarks/async_staleness.py --summarize
<the files> --loss-table` prints, and every setting it prints has its table in the section."""

import re
import subprocess
import sys
from pathlib import Path

from support.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### GSPO's successors under staleness"
RUNS = sorted((ROOT / "benchmarks" / "clip_band_results").glob("loss_table_*.json"))


def _section() -> list[str]:
    text = (ROOT / "docs" / "results.md").read_text()
    body = text[text.index(SECTION) + len(SECTION):]
    return body[:re.search(r"(?m)^##", body).start()].splitlines()


def test_the_successors_table_is_the_benchmarks_output_over_its_committed_runs():
    assert RUNS, "no runs file of the loss table is committed"
    section = _section()
    for path in RUNS:  # the section names each file it summarizes
        assert any(path.name in line for line in section), path.name
    output = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_staleness.py"), "--summarize",
                             *map(str, RUNS), "--loss-table"], capture_output=True, text=True, timeout=300,
                            check=True, env=cpu_env()).stdout.splitlines()
    rows = [line for line in section if line.startswith("|")]
    assert rows and [row for row in rows if row not in output] == []
    settings = [line for line in output if re.match(r"the (quickstart's|harder) task", line)]
    assert settings and [line for line in settings if line not in section] == []
