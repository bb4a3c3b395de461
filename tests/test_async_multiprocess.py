"""`AsyncGSPOTrainer` on two CPU processes (DDP, gloo) against one, with R3: TRL's dispatcher splits each micro-batch
into one packed row per rank, and the loss (a mean over the micro-batch's completions, every rank's), the gathered
metrics and the replay counts must come out as on one process packing the same samples into one row."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
SCRIPT = Path(__file__).parent / "scripts" / "async_multiprocess_run.py"
ONE = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
TWO = ["--config_file", str(Path(__file__).parents[1] / "recipes" / "accelerate" / "cpu_ddp.yaml"), "--num_processes",
       "2"]


def _launch(out_dir, launch_args, model_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, "--main_process_port", str(port),
               str(SCRIPT), str(out_dir), str(model_dir), "--loss-type", "gspo", "--routing-replay"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=cpu_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_two_processes_train_the_packed_micro_batch_as_one(tmp_path, tiny_moe_dir):
    one = _launch(tmp_path / "one", ONE, tiny_moe_dir)
    two = _launch(tmp_path / "two", TWO, tiny_moe_dir)
    assert (one["world_size"], two["world_size"]) == (1, 2) and len(one["logs"]) == len(two["logs"]) == 3
    first, other = one["logs"][0], two["logs"][0]  # same weights, same samples: equal up to float32 rounding
    assert other["loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert other["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4)
    for step_one, step_two in zip(one["logs"], two["logs"]):  # counts over every rank's completions and tokens
        for name in ("clip_ratio/region_mean", "gspo/clipped_token_fraction", "routing/replay_drift"):
            assert step_two[name] == pytest.approx(step_one[name], abs=1e-6), name
        assert step_two["gspo/ratio_mean"] == pytest.approx(step_one["gspo/ratio_mean"], rel=1e-3)
    assert 0 < first["clip_ratio/region_mean"] < 1 and first["routing/replay_drift"] > 0.3
    # Later steps follow Adam from gradients equal to ~1e-5: the weights stay together, not bit for bit.
    assert two["checksum"] == pytest.approx(one["checksum"], rel=1e-5)
