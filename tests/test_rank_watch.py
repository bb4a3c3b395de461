"""trl_gspo/ranks/watch.py on two gloo processes, each bounded by a timeout so that a regression fails instead of
hanging: a rank that fails alone while the other waits in a collective it never joins stops that rank through the
store, with the same error; a bounded phase that one rank never leaves stops both; ranks that raise together stand
down (nothing exits), and every rank ends with the first rank's report. The end-to-end cells are
tests/test_fault_matrix.py."""

import json
import os
import time

import pytest
from support.multiprocess import run_ranks

from trl_gspo.ranks.watch import RankWatch, RanksStalled, current_phase, phase, phase_of

EXITED = 3  # the exit code the tests give the watch, so that a stop by the watch tells from any other exit
RAISED = 4  # a rank whose collective failed once the other rank had left, as the trainer handles it


def _setup(rank, init_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)


def _watch(rank, out, **kwargs):
    def on_stop(report):
        with open(f"{out}/watch{rank}.json", "w") as file:
            json.dump({**report, "at": time.time()}, file)
    return RankWatch.start(rank, 2, poll=0.1, grace=1.0, on_stop=on_stop, exit=lambda code: os._exit(EXITED),
                           **kwargs)


def _one_rank_fails(rank, init_file, out):
    import torch.distributed as dist

    _setup(rank, init_file)
    watch = _watch(rank, out)
    if rank == 1:  # fails alone; rank 0 waits for it in a barrier it will never reach
        error = ValueError("a reward function failed (stand-in)")
        with open(f"{out}/failed_at", "w") as file:
            file.write(repr(time.time()))
        report = watch.publish(error, "fix it")
        with open(f"{out}/publish1.json", "w") as file:
            json.dump(report, file)
        os._exit(1)
    dist.barrier()
    os._exit(0)  # never reached: the watch stops rank 0


def test_a_rank_failing_alone_stops_the_rank_waiting_in_a_collective(tmp_path):
    codes = run_ranks(_one_rank_fails, tmp_path, timeout=60)
    assert codes == [EXITED, 1], codes  # rank 0 stopped by its watch, not by the timeout
    stopped = json.loads((tmp_path / "watch0.json").read_text())
    assert (stopped["error"], stopped["message"], stopped["rank"]) == ("ValueError",
                                                                        "a reward function failed (stand-in)", 1)
    assert stopped["advice"] == "fix it" and stopped["phase"] == "training"
    assert stopped["at"] - float((tmp_path / "failed_at").read_text()) < 10
    # rank 1 waited for rank 0 to stop before it left (so the launcher cannot end rank 0 before it says why)
    assert json.loads((tmp_path / "publish1.json").read_text())["rank"] == 1


def _one_rank_never_arrives(rank, init_file, out):
    import torch.distributed as dist

    _setup(rank, init_file)
    watch = _watch(rank, out)
    try:
        with phase("computing rewards", bound=1.0):
            if rank == 1:
                while True:  # a reward function that never returns
                    time.sleep(60)
            dist.barrier()
    except RuntimeError as error:
        # The other rank's watch exited first, and this rank's barrier failed (gloo: "connection closed by peer")
        # before its own watch exited: the trainer hands such an error to the watch (trl_gspo.ranks.phases), which
        # gives back the first report.
        with open(f"{out}/raised{rank}.json", "w") as file:
            json.dump(watch.publish(error), file)
        os._exit(RAISED)
    os._exit(0)


def test_a_bounded_phase_one_rank_never_leaves_stops_both(tmp_path):
    codes = run_ranks(_one_rank_never_arrives, tmp_path, timeout=60)
    assert codes[1] == EXITED and codes[0] in (EXITED, RAISED), codes  # stopped by the watch, not the timeout
    reports = [json.loads((tmp_path / f"{'watch' if code == EXITED else 'raised'}{rank}.json").read_text())
               for rank, code in enumerate(codes)]
    assert {r["error"] for r in reports} == {RanksStalled.__name__}
    assert all(r["phase"] == "computing rewards" and "rank_wait_timeout" in r["advice"] for r in reports)
    assert reports[0]["message"] == reports[1]["message"]  # one stall, reported once


def _both_raise(rank, init_file, out):
    from trl_gspo.ranks import RankFailed, _from_rank

    _setup(rank, init_file)
    watch = _watch(rank, out)
    try:
        with phase("syncing weights"):
            if rank == 0:
                raise ConnectionError("server gone")
            raise _from_rank(ConnectionError("server gone"), 0) from RankFailed("raised on rank 0")
    except ConnectionError as error:
        time.sleep(0.3 * rank)
        report = watch.publish(error, "restart it")
    watch.close()
    with open(f"{out}/publish{rank}.json", "w") as file:
        json.dump(report, file)
    os._exit(0)


def test_ranks_raising_together_stand_down_and_agree_on_the_first_report(tmp_path):
    codes = run_ranks(_both_raise, tmp_path, timeout=60)
    assert codes == [0, 0], codes  # nobody was stopped by the watch
    reports = [json.loads((tmp_path / f"publish{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0] == reports[1] and reports[0]["rank"] == 0  # rank 1's copy names rank 0, where it began
    assert reports[0]["phase"] == "syncing weights"
    assert not list(tmp_path.glob("watch*.json"))


def test_phases_name_where_an_error_was_raised():
    assert current_phase() == "training"
    with pytest.raises(KeyError) as raised:
        with phase("outer"):
            with phase("inner", bound=5):
                assert current_phase() == "inner"
                raise KeyError("x")
    assert phase_of(raised.value) == "inner" and current_phase() == "training"
    assert phase_of(ValueError()) == "training"
    assert RankWatch.start(0, 1) is None  # one process: nothing to watch
