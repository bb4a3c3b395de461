"""Ranks that fail together. A rank that raises alone leaves the others in their next collective until the process
group's timeout (`ddp_timeout`, 1800 s by default) on several nodes; on one node the launcher ends them once the
failed process exits. Where one rank can fail without the others, they agree first:

- `raise_together` (`together` wraps a function in it): after a step any rank may fail alone (a weight sync to
  vLLM), one all-reduced flag; when a rank failed, every rank raises the same error (one more gather, on failure
  only).
- `every_rank`: one all-reduced flag for a choice the ranks must make alike (resuming on a saved rollout batch).
- `FailedElsewhere`: where the others already wait for an object from the failing rank (a broadcast, a send), it is
  sent in their place and raises the same error where they use it: no collective is added on success.

The functions take an accelerate `Accelerator` (or anything with `num_processes`, `process_index`, `device`) and
need no TRL."""

from __future__ import annotations

import torch


class RankFailed(RuntimeError):
    """The cause of an error raised on a rank that did not fail itself: which rank did."""


def _rebuilt(error_type: type, args: tuple, message: str) -> BaseException:
    try:
        return error_type(*args)
    except Exception:  # an error class whose constructor takes other arguments than it keeps
        return RuntimeError(f"{error_type.__name__}: {message}")


def _from_rank(error: BaseException, rank: int) -> BaseException:
    error._trl_gspo_rank = rank  # where it was first raised: `origin_rank`
    return error


def origin_rank(error: BaseException, default: int) -> int:
    """The rank an error was first raised on: another rank's for an error raised here on its behalf."""
    return getattr(error, "_trl_gspo_rank", default)


def _portable(error: BaseException) -> tuple[type, tuple]:
    """The error's class and arguments as they travel to another rank (pickled): its arguments when they are plain
    values, else its message; a class pickle cannot name (defined in a function) becomes RuntimeError."""
    import pickle

    try:
        pickle.dumps(type(error))
    except Exception:
        return RuntimeError, (f"{type(error).__name__}: {error}",)
    plain = all(isinstance(arg, (str, int, float, bool, type(None))) for arg in error.args)
    return type(error), error.args if plain else (str(error),)


class FailedElsewhere:
    """Sent by a failing rank in place of the object another rank waits for (picklable): unpacking, iterating or
    indexing it raises the failing rank's error there, of the same class and message, caused by `RankFailed`."""

    def __init__(self, error: BaseException, rank: int):
        (self.error_type, self.args), self.message, self.rank = _portable(error), str(error), rank

    def raise_here(self):
        raise _from_rank(_rebuilt(self.error_type, self.args, self.message), self.rank) from RankFailed(
            f"raised on rank {self.rank}; this rank stopped with it")

    def __iter__(self):
        self.raise_here()

    def __getitem__(self, key):
        self.raise_here()


def every_rank(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on every rank, the same answer everywhere: one all-reduce of one number."""
    if accelerator.num_processes == 1:
        return flag
    import torch.distributed as dist

    failed = torch.tensor([0 if flag else 1], dtype=torch.int32, device=accelerator.device)
    dist.all_reduce(failed)
    return int(failed.item()) == 0


def raise_together(accelerator, error: BaseException | None) -> None:
    """Call on every rank after a step that may have failed on some (`error`, else None). Returns when no rank failed;
    otherwise every rank raises: the lowest failing rank's error there, of the same class and message on every other
    rank (chained to the rank's own error if it had one, else to `RankFailed` naming the rank)."""
    if every_rank(accelerator, error is None):
        return
    reports = [None] * accelerator.num_processes
    mine = (accelerator.process_index, *_portable(error), str(error)) if error is not None else None
    if accelerator.num_processes == 1:
        reports = [mine]
    else:
        import torch.distributed as dist

        dist.all_gather_object(reports, mine)
    rank, error_type, args, message = min((r for r in reports if r is not None), key=lambda report: report[0])
    if rank == accelerator.process_index:
        raise error
    cause = error if error is not None else RankFailed(f"raised on rank {rank}")
    raise _from_rank(_rebuilt(error_type, args, message), rank) from cause


def together(accelerator, step):
    """`step` wrapped to run on every rank and then `raise_together`: called with `step`'s arguments, it returns
    `step`'s result when no rank failed."""
    def run_together(*args, **kwargs):
        failure = result = None
        try:
            result = step(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - raised by raise_together, on every rank
            failure = error
        raise_together(accelerator, failure)
        return result
    return run_together
