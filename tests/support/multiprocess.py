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


def run_ranks(target, out_dir, world_size: int = 2, timeout: float = 120) -> list[int]:
    """`target(rank, init_file, out_dir)` in `world_size` spawned processes (a gloo group through a file); returns
    their exit codes. A process still running after `timeout` seconds is killed and the test fails there, so a
    regression that hangs a collective fails the suite instead of hanging it."""
    import multiprocessing
    import time

    context = multiprocessing.get_context("spawn")
    init_file = Path(out_dir) / "init"
    processes = [context.Process(target=target, args=(rank, str(init_file), str(out_dir)), daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
    if hung:
        pytest.fail(f"ranks {hung} still ran after {timeout} s (a collective waiting for a rank that left?)")
    return [process.exitcode for process in processes]
