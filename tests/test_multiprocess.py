"""Two processes on CPU (gloo): DDP parity with TRL, and routing replay under DDP and DeepSpeed ZeRO-2/3 against one
process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
SCRIPT = Path(__file__).parent / "scripts" / "ddp_parity.py"
RUN_SCRIPT = Path(__file__).parent / "scripts" / "multiprocess_run.py"
ACCELERATE_CONFIGS = Path(__file__).parents[1] / "recipes" / "accelerate"


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


def _launch(script, out_dir, *launch_args):
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_args,
               "--main_process_port", str(_free_port()), str(script), str(out_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def single_process_replay(tmp_path_factory):
    return _launch(RUN_SCRIPT, tmp_path_factory.mktemp("one"), "--num_processes", "1", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no")


@pytest.mark.parametrize("backend", ["ddp", "zero2", "zero3"])
def test_routing_replay_on_two_processes_matches_one(backend, single_process_replay, tmp_path):
    """GRPO + routing replay: two ranks (each recording and replaying its own tokens) give the single-process losses,
    grad norms and routing metrics; the global batch and the sampled completions are the same by construction."""
    if backend != "ddp":
        pytest.importorskip("deepspeed")  # in the test extra; skipped only in a hand-made environment without it
    launch = (["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no"] if backend == "ddp" else
              ["--config_file", str(ACCELERATE_CONFIGS / f"cpu_{backend}.yaml"), "--num_processes", "2"])
    two, one = _launch(RUN_SCRIPT, tmp_path, *launch), single_process_replay
    assert (two["world_size"], two["deepspeed"], one["world_size"]) == (2, backend != "ddp", 1)
    assert max(one["replayed"]) > 0 and any(abs(x) > 1e-3 for x in one["loss"])  # off-policy steps, real signal
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4, abs=1e-6)
    assert two["drift"] == pytest.approx(one["drift"], abs=1e-6)  # token counts summed over ranks
    assert two["replayed"] == pytest.approx(one["replayed"], abs=1e-6)
    rank0, rank1 = two["fingerprints"]
    assert len(rank0) == len(rank1) == 3 and not set(rank0) & set(rank1)  # each rank recorded its own routing
