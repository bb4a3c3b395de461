"""Every rank stops together where the agreement in `trl_gspo.ranks` cannot reach: a rank that fails alone in a place
where the others wait in a collective it will never join (out of memory in a backward, a reward function that
raises), or a rank that never arrives (a reward function that never returns).

- `phase(name, bound)`: what this rank is doing, for the messages; with a `bound` (seconds) it is also a backstop.
- `RankWatch`: one thread per rank, started for a multi-process run. A rank whose training raises publishes the error
  on the process group's store (`publish`); every other rank's thread reads it within `poll` seconds and, unless its
  own main thread stops by itself within `grace` seconds (the agreed sections of `trl_gspo.ranks` raise on every rank
  at once), prints the same error class and message, naming the failing rank and its phase, and exits the process.
  A bounded phase that runs past its bound on any rank is published as `RanksStalled` and stops every rank the same
  way. The failing rank waits (at most `grace` + 5 s) until the others have stopped before it exits, so the launcher
  does not kill them before they say why.

Costs nothing on the training path: no collective and no device sync, one small read of the store per `poll` from a
background thread. Needs only `torch.distributed` (no TRL, no accelerate)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

_phases: list[list] = []  # the main thread's open phases, innermost last: [name, start, bound]


class RanksStalled(RuntimeError):
    """A bounded phase ran past its bound on some rank: a rank that never arrives would otherwise hold every rank in
    a collective until the process group's timeout."""


@contextlib.contextmanager
def phase(name: str, bound: float | None = None):
    """The main thread is `name` ("computing rewards") inside the block. An error raised inside is tagged with the
    innermost phase (`phase_of`). With `bound` > 0, a `RankWatch` stops every rank when the block runs longer."""
    entry = [name, time.monotonic(), bound if bound and bound > 0 else None]
    _phases.append(entry)
    try:
        yield
    except BaseException as error:
        if getattr(error, "_trl_gspo_phase", None) is None:
            with contextlib.suppress(AttributeError, TypeError):
                error._trl_gspo_phase = name
        raise
    finally:
        _phases.remove(entry)


def current_phase() -> str:
    return _phases[-1][0] if _phases else "training"


def phase_of(error: BaseException) -> str:
    """The phase an error was raised in: the innermost `phase` it left, else "training"."""
    return getattr(error, "_trl_gspo_phase", None) or "training"


def rebuilt(report: dict) -> BaseException:
    """The error of another rank's published report, of its class and message (`trl_gspo.ranks`' rules)."""
    import pickle

    from . import _from_rank, _rebuilt

    error_type, args = pickle.loads(bytes.fromhex(report["portable"]))
    return _from_rank(_rebuilt(error_type, args, report["message"]), report["rank"])


def _default_store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a process group without a store: no watch, as before
        return None


class RankWatch:
    """The watch thread of one rank (see the module's docstring). `exit` and `on_stop` are for embedding: the
    process exits with `exit(1)`; `on_stop(report)` runs just before, with the published report (a dict with
    `error`, `message`, `rank`, `phase`)."""

    _runs = 0  # train() calls so far in this process: every rank counts alike, so keys never meet an old run's

    def __init__(self, store, rank: int, world_size: int, poll: float = 0.5, grace: float = 3.0,
                 on_stop=None, exit=os._exit):
        RankWatch._runs += 1
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll, self.grace, self.on_stop, self._exit = poll, grace, on_stop, exit
        self._key = f"trl_gspo/rank_watch/{RankWatch._runs}/"
        self._stopping = threading.Event()  # this rank's main thread is raising, or training ended
        self._done = threading.Event()
        self._acked = False
        self._thread = threading.Thread(target=self._watch, name="trl-gspo-rank-watch", daemon=True)

    @classmethod
    def start(cls, rank: int, world_size: int, **kwargs) -> RankWatch | None:
        """A started watch for this process, or None (one process, or no store to watch)."""
        store = _default_store() if world_size > 1 else None
        if store is None:
            return None
        watch = cls(store, rank, world_size, **kwargs)
        watch._thread.start()
        return watch

    # ------------------------------------------------------------------ the failing rank
    def publish(self, error: BaseException, advice: str = "") -> dict:
        """This rank's training raised `error`: the first report published wins (the others are the same error
        raised together, or a rank's collective failing because the failed rank's process left). Waits until every
        other rank has stopped or stood down; returns the winning report (`rebuilt` raises it here)."""
        import pickle

        from . import _portable, origin_rank

        self._stopping.set()
        report = {"error": type(error).__name__, "message": str(error), "rank": origin_rank(error, self.rank),
                  "phase": phase_of(error), "advice": advice, "portable": pickle.dumps(_portable(error)).hex()}
        report = self._claim(report)
        self._ack()
        deadline = time.monotonic() + self.grace + 5.0
        while time.monotonic() < deadline and self.store.add(self._key + "acks", 0) < self.world_size:
            time.sleep(0.05)
        return report

    def close(self) -> None:
        """Training ended on this rank without an error."""
        self._stopping.set()
        self._done.set()

    def _claim(self, report: dict) -> dict:
        if self.store.add(self._key + "claims", 1) == 1:
            self.store.set(self._key + "report", json.dumps(report))
            return report
        self.store.wait([self._key + "report"])
        return json.loads(self.store.get(self._key + "report"))

    def _ack(self) -> None:
        if not self._acked:  # once per rank: the failing rank counts the others
            self._acked = True
            self.store.add(self._key + "acks", 1)

    # ------------------------------------------------------------------ every other rank
    def _published(self) -> dict | None:
        if not self.store.check([self._key + "report"]):
            return None
        return json.loads(self.store.get(self._key + "report"))

    def _overdue(self) -> tuple[str, float] | None:
        now = time.monotonic()
        for name, start, bound in list(_phases):
            if bound is not None and now - start > bound:
                return name, bound
        return None

    def _watch(self) -> None:
        try:
            while not self._done.wait(self.poll):
                report = self._published()
                if report is None:
                    overdue = self._overdue()
                    if overdue is None:
                        continue
                    name, bound = overdue
                    report = self._claim({
                        "error": RanksStalled.__name__, "rank": self.rank, "phase": name,
                        "message": f"rank {self.rank} spent more than {bound:g} s {name}: a rank that never arrives "
                                   "(a reward function or tool that never returns, a collective another rank skipped) "
                                   "would otherwise hold every rank until the process group's timeout",
                        "advice": "find the rank that never arrived: each rank prints where its threads stood, "
                                  "above this line; if the phase is only slow, raise `rank_wait_timeout` "
                                  f"(now {bound:g} s), or set 0 to wait as long as the process group allows"})
                    self._stop(report)
                    return
                if report["rank"] == self.rank or self._stopping.wait(self.grace):
                    self._ack()  # this rank raised the same error in its main thread: it stops by itself
                    return
                self._stop(report)
                return
        except Exception:  # noqa: BLE001 - the store went away with the launcher: nothing left to watch
            return

    def _stop(self, report: dict) -> None:
        if report["error"] == RanksStalled.__name__:  # where this rank's threads stood: one of them never arrived
            import faulthandler

            with contextlib.suppress(Exception):
                print(f"trl-gspo: rank {self.rank}'s threads when it stopped:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        source = "this rank" if report["rank"] == self.rank else f"rank {report['rank']}"
        advice = f" What to do: {report['advice']}" if report.get("advice") else ""
        print(f"{report['error']}: {report['message']} [trl-gspo: rank {self.rank} stopped while "
              f"{current_phase()}: raised on {source} while {report['phase']}.{advice}]", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            if self.on_stop is not None:
                self.on_stop(report)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            self._ack()
            if report["rank"] == self.rank:  # a stall found here: the others print theirs before this rank exits
                deadline = time.monotonic() + self.grace + 5.0
                while time.monotonic() < deadline and self.store.add(self._key + "acks", 0) < self.world_size:
                    time.sleep(0.05)
        self._exit(1)
