"""What the multi-process tests (tests/test_multiprocess.py, tests/test_multinode.py) share: the script they launch,
the one-process launch they compare against, and the comparison itself."""

from pathlib import Path

import pytest

RUN_SCRIPT = Path(__file__).parents[1] / "scripts" / "multiprocess_run.py"
ONE_PROCESS = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def assert_same_run(two, one, backend):
    """Two processes reproduce the one-process run: the global batch and the sampled completions are the same by
    construction (multiprocess_run.py), so losses, grad norms and every gathered metric must match."""
    assert (two["world_size"], two["deepspeed"], one["world_size"]) == (2, backend != "ddp", 1)
    assert max(one["grad_norm"]) > 1e-2  # real gradients, not all-zero advantages
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4, abs=1e-6)
    assert two["checksum"] == pytest.approx(one["checksum"], rel=1e-6)
    for metric in ("clip", "drift", "replayed"):  # gathered over both ranks' sequences, not rank 0's
        assert two[metric] == pytest.approx(one[metric], abs=1e-6), metric
