"""One rank fails, every rank stops: a failure injected on the main process of a two-process server-mode run (a LoRA
weight sync, a server that refuses the connection) must raise the same error on both ranks within seconds, not
leave the other rank waiting in TRL's next collective until the process group's timeout (1800 s by default), and
must leave only complete checkpoints (tests/scripts/rank_failure_run.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import cpu_env, free_port

from trl_gspo.checkpoints import latest_complete_checkpoint

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "rank_failure_run.py"
DDP = Path(__file__).parents[1] / "recipes" / "accelerate" / "cpu_ddp.yaml"


@pytest.mark.parametrize("fail, error, message", [
    ("lora-sync", "LoraMergeError", "out of memory (stand-in)"),
    ("server-request", "SamplerServerError", "stopped answering during generation (ConnectionError)"),
])
def test_a_failure_on_the_main_process_stops_every_rank_together(tmp_path, fail, error, message):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP), "--num_processes", "2",
               "--main_process_port", str(free_port()), str(SCRIPT), str(tmp_path), "--fail", fail]
    # Far below the process group's timeout: the launcher would end rank 1 once rank 0 exits, but then rank 1 writes
    # no report, and the test fails on its missing file.
    result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                            env=cpu_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1"))
    assert result.returncode != 0
    reports = []
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} did not stop with an error of its own:\n{result.stderr[-3000:]}"
        reports.append(json.loads(path.read_text()))
    assert [r["error"] for r in reports] == [error, error], reports
    assert reports[0]["message"] == reports[1]["message"] and message in reports[0]["message"]
    assert reports[1]["cause"] == "RankFailed"  # rank 1 raised rank 0's error, and says where it came from
    assert all(r["seconds_after_failure"] < 20 for r in reports), reports
    # The step the failure ended was never saved; every checkpoint left is complete and the newest is step 1.
    checkpoints = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1"] and latest_complete_checkpoint(str(tmp_path))[0].endswith("checkpoint-1")
