"""trl_gspo/ranks.py and its uses, on two gloo processes: a failure on one rank becomes the same error on every
rank, through an all-reduced flag (`raise_together`) or an object sent in place of the one the other ranks wait for
(`FailedElsewhere`, as `hand_out_choices` sends it). The end-to-end runs are tests/test_fault_matrix.py."""

import json
import pickle
import types

import pytest
import torch
from support.multiprocess import run_ranks

from trl_gspo.ranks import FailedElsewhere, RankFailed, _rebuilt, every_rank, raise_together


def _outcome(run):
    try:
        run()
    except Exception as error:  # noqa: BLE001 - reported to the test
        cause = error.__cause__
        return [type(error).__name__, str(error), type(cause).__name__ if cause is not None else None]
    return None


def _two_ranks(rank, init_file, out):
    import torch.distributed as dist

    from trl_gspo.sampling.routes import _together, hand_out_choices
    from trl_gspo.sampling.server import FramedRoute

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    accelerator = types.SimpleNamespace(num_processes=2, process_index=rank, is_main_process=rank == 0,
                                        device=torch.device("cpu"))
    try:
        seen = {"agree": [every_rank(accelerator, True), every_rank(accelerator, rank == 0)],
                "no failure": _outcome(lambda: raise_together(accelerator, None)),
                "rank 1 fails": _outcome(lambda: raise_together(
                    accelerator, ValueError("bad tensor on rank 1") if rank == 1 else None))}

        def broadcast_a_failure():
            sent = [FailedElsewhere(KeyError("server gone"), 0) if rank == 0 else None]
            dist.broadcast_object_list(sent, src=0)
            if rank == 1:
                first, second = sent[0]  # TRL unpacks the main process's answer: this raises
            raise KeyError("server gone")  # rank 0's own raise

        seen["broadcast"] = _outcome(broadcast_a_failure)
        # Rank 0's routes came in two frames: it refuses them while rank 1 waits for its part.
        choices = [{"token_ids": [1], "routed_experts": FramedRoute(object(), i)} for i in range(2)]
        seen["hand out"] = _outcome(lambda: hand_out_choices(choices if rank == 0 else [], [0, 2], accelerator))

        def take(lengths, dtype):  # rank 1 refuses its own slice of the server's routes
            if rank == 1:
                raise RuntimeError("vLLM returned an empty completion (stand-in)")
            return "routes"

        seen["own slice"] = _outcome(lambda: _together(accelerator, take)([1], torch.uint8))
        with open(f"{out}/rank{rank}.json", "w") as file:
            json.dump(seen, file)
    finally:
        dist.destroy_process_group()


def test_a_failure_on_one_rank_raises_on_both(tmp_path):
    assert run_ranks(_two_ranks, tmp_path, timeout=120) == [0, 0]  # a rank left waiting fails the test at 120 s
    zero, one = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert zero["agree"] == one["agree"] == [True, False]
    assert zero["no failure"] is one["no failure"] is None
    assert zero["rank 1 fails"] == ["ValueError", "bad tensor on rank 1", "RankFailed"]  # rank 0 did not fail
    assert one["rank 1 fails"] == ["ValueError", "bad tensor on rank 1", None]  # its own error, as raised
    assert zero["broadcast"][:2] == one["broadcast"][:2] == ["KeyError", "'server gone'"]
    assert one["broadcast"][2] == "RankFailed"
    assert zero["hand out"][:2] == one["hand out"][:2] and "several answers" in zero["hand out"][1]
    assert one["hand out"][2] == "RankFailed"
    assert zero["own slice"] == ["RuntimeError", "vLLM returned an empty completion (stand-in)", "RankFailed"]
    assert one["own slice"][:2] == zero["own slice"][:2]


def test_on_one_process_the_error_is_raised_as_it_is():
    accelerator = types.SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    raise_together(accelerator, None)
    error = OSError("disk full")
    with pytest.raises(OSError) as raised:
        raise_together(accelerator, error)
    assert raised.value is error
    assert every_rank(accelerator, True) and not every_rank(accelerator, False)


def test_a_failure_sent_elsewhere_survives_pickling_and_raises_on_any_use():
    class NeedsTwo(Exception):
        def __init__(self, a, b):
            super().__init__(a + b)

    failure = pickle.loads(pickle.dumps(FailedElsewhere(RuntimeError("routes out of order"), 0)))
    for use in (lambda: list(failure), lambda: failure[0], lambda: tuple(failure)):
        with pytest.raises(RuntimeError, match="routes out of order") as raised:
            use()
        assert isinstance(raised.value.__cause__, RankFailed) and "rank 0" in str(raised.value.__cause__)
    # A class pickle cannot name (defined here), or that cannot be rebuilt from what it keeps: RuntimeError, by name
    odd = pickle.loads(pickle.dumps(FailedElsewhere(NeedsTwo("x", "y"), 3)))
    with pytest.raises(RuntimeError, match="NeedsTwo: xy"):
        list(odd)
    assert _rebuilt(NeedsTwo, ("xy",), "xy").args == ("NeedsTwo: xy",)
