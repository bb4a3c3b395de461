"""Two processes (DDP over gloo on CPU): GSPO's normalization and gathered metrics match TRL's sequence-level grpo."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
SCRIPT = Path(__file__).parent / "scripts" / "ddp_parity.py"


def _free_port() -> int:
    with socket.socket() as sock:  # a fixed default port can still be held by an earlier run's processes
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_ddp_matches_trl(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--main_process_port", str(_free_port()),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    runs = json.loads(line[len("RESULT "):])
    ours, trl = runs["gspo"], runs["trl"]
    assert ours["world_size"] == 2
    assert len(ours["loss"]) == 4 and any(c > 0 for c in ours["clip"])  # off-policy, something clipped
    assert ours["loss"] == pytest.approx(trl["loss"], rel=1e-5, abs=1e-7)
    assert ours["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-5, abs=1e-7)
    assert ours["clip"] == pytest.approx(trl["clip"])  # clip fractions gathered over both ranks, as TRL's
    assert ours["checksum"] == pytest.approx(trl["checksum"], rel=1e-6)
