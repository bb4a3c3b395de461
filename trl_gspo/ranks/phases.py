"""How both trainers stop every rank together (docs/architecture.md, "Ranks that stop together"):

- Agreed sections (`trl_gspo.ranks`): where one rank talks to something outside (the main process to the vLLM
  server), its failures are kept while the stream of collectives completes (`kept_failures`: a failed transfer still
  walks the rest of the stream, whose ZeRO-3 gathers and FSDP `full_tensor` calls are collectives the other ranks are
  in), and one flag after the stream raises the same error on every rank. Server errors are named on the main
  process before they are shared, so every rank raises the same class and message.
- Phases and the watch (`trl_gspo.ranks.watch`): everywhere else a rank can fail alone (a reward function, out of
  memory in a backward, a full disk at a checkpoint) its error is published on the process group's store and every
  other rank stops with it within seconds; a bounded phase (`rank_wait_timeout`: weight syncs, rewards) stops
  every rank when one never arrives.

`RanksStopTogether` wires both into a trainer: mixed in before TRL's class, each method extends TRL's of its name."""

from __future__ import annotations

import contextlib

from ..config import DEFAULT_RANK_WAIT_TIMEOUT
from ..routing.rollout import wrapping_method
from . import together
from .watch import RankWatch, phase, phase_of, rebuilt

SYNC = "syncing weights to the vLLM server"
REWARDS = "computing rewards"
SAVE = "saving a checkpoint"
GENERATION = "generating completions"
STEP = "running a training step"

_ADVICE = {
    SYNC: "start the vLLM server again with the same command and resume",
    REWARDS: "fix the reward function (the traceback on the failing rank names it) and resume",
    SAVE: "free space where output_dir lives (or set save_total_limit) and resume",
    GENERATION: "fix what the traceback on the failing rank names and resume",
}


def rank_wait_timeout(args) -> float:
    """Seconds a bounded phase may last on any rank (`rank_wait_timeout`; TRL's own configs lack it)."""
    return float(getattr(args, "rank_wait_timeout", DEFAULT_RANK_WAIT_TIMEOUT) or 0.0)


def stop_advice(error: BaseException, where: str, output_dir: str) -> str:
    """What to do after `error` stopped training in phase `where`: the fix, and the checkpoint to resume from."""
    from ..checkpoints import latest_complete_checkpoint

    if "out of memory" in str(error).lower():
        fix = ("lower per_device_train_batch_size or max_completion_length, or turn gradient_checkpointing on, and "
               "resume")
    else:
        fix = _ADVICE.get(where, "fix what the error names and resume")
    checkpoint = latest_complete_checkpoint(output_dir)[0]
    resume = (f"with resume_from_checkpoint='latest' (the newest complete checkpoint is {checkpoint})" if checkpoint
              else f"from the start: no complete checkpoint was saved in {output_dir} yet")
    return f"{fix} {resume}."


def kept_failures(target, names, failures: list, drains=()):
    """Around calls of `target`'s methods `names` (bound, on the main process): an error is kept in `failures`
    instead of raised, and once one is kept the later calls do nothing (the server is gone). A method in `drains`
    takes an iterator as its last argument: after a failure the rest of it is walked, sending nothing, since each
    tensor it yields may be a collective (a ZeRO-3 gather) the other ranks are in. The caller raises the kept error
    after the stream, inside an agreed section."""
    stack = contextlib.ExitStack()
    for name in names:
        if not hasattr(target, name):
            continue

        def keeping(original, name=name):
            def call(*args, **kwargs):
                if failures:
                    if name in drains:
                        for _ in args[-1]:
                            pass
                    return None
                try:
                    return original(*args, **kwargs)
                except Exception as error:  # noqa: BLE001 - raised after the stream, on every rank
                    failures.append(error)
                    if name in drains:
                        for _ in args[-1]:  # the rest of the stream; a failure before it starts walks all of it
                            pass
                    return None
            return call

        stack.enter_context(wrapping_method(target, name, keeping))
    return stack


def named_server_failures(target, names, client, output_dir: str) -> contextlib.ExitStack:
    """Around calls of `target`'s methods `names` that talk to the server of TRL's `client` (on the main process): a
    connection error becomes the `SamplerServerError` that names the server, the newest complete checkpoint and the
    resume, before it is kept and shared, so every rank raises that class and message."""
    import types

    from ..sampling.server import server_failures

    # TRL's synchronous client names its server `base_url`, the asynchronous one `server_url`
    server = types.SimpleNamespace(base_url=getattr(client, "base_url", None) or getattr(client, "server_url", None))

    def named(method):
        def call(*args, **kwargs):
            with server_failures(server, output_dir, during="a weight sync"):
                return method(*args, **kwargs)
        return call

    stack = contextlib.ExitStack()
    for name in names:
        if hasattr(target, name):
            stack.enter_context(wrapping_method(target, name, named))
    return stack


def agreed_server_sync(trainer) -> None:
    """Server mode (GSPOTrainer): TRL's weight sync as an agreed section. On the main process a failed request to the
    server (before the stream, inside it, or resetting the prefix cache after it) is named (`SamplerServerError`),
    kept while the stream completes, then raised on every rank by one all-reduced flag after the stream
    (`trl_gspo.ranks.together`). Every rank syncs at the same steps in server mode; in colocate mode with sleep mode
    TRL syncs before each generate call, and the ranks of a tool loop make different numbers of calls, so a flag per
    sync there would pair with another collective: colocate syncs are not wrapped."""
    generation, accelerator = trainer.vllm_generation, trainer.accelerator
    client = generation.vllm_client if accelerator.is_main_process else None
    sync = generation.sync_weights
    bound = rank_wait_timeout(trainer.args)

    def sync_kept():
        failures: list[BaseException] = []
        with contextlib.ExitStack() as stack:
            if client is not None:
                names = ("update_named_params", "reset_prefix_cache")
                stack.enter_context(named_server_failures(client, names, client, trainer.args.output_dir))
                stack.enter_context(kept_failures(client, names, failures, drains=("update_named_params",)))
            try:
                sync()
            except Exception as error:  # noqa: BLE001 - a failure outside the client's calls: raised together too
                failures.append(error)
        if failures:
            raise failures[0]

    agreed = together(accelerator, sync_kept)

    def sync_weights():
        with phase(SYNC, bound):
            agreed()

    generation.sync_weights = sync_weights


def _note(error: BaseException, rank: int, where: str, advice: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+: printed under the traceback
        error.add_note(f"trl-gspo: raised on rank {rank} while {where}. What to do: {advice}")


def server_guards(trainer) -> contextlib.ExitStack:
    """Around GSPOTrainer's server-mode generation call, on the main process: a server that dies or hangs mid-run
    becomes one `SamplerServerError` naming it, the newest complete checkpoint and how to resume
    (docs/reliability.md), sent where the other ranks wait for the server's answer (`failures_shared`)."""
    from ..config import DEFAULT_SERVER_STALL_TIMEOUT
    from ..sampling.server import failures_shared, server_failures

    guards = contextlib.ExitStack()
    if trainer.use_vllm and trainer.vllm_mode == "server" and trainer.accelerator.is_main_process:
        client = trainer.vllm_generation.vllm_client
        guards.enter_context(failures_shared(client, trainer.accelerator.num_processes))
        guards.enter_context(server_failures(client, trainer.args.output_dir, getattr(
            trainer.args, "vllm_server_stall_timeout", DEFAULT_SERVER_STALL_TIMEOUT)))
    return guards


class RanksStopTogether:
    """Mixed into `GSPOTrainer` and `AsyncGSPOTrainer` before TRL's trainer: phases for the messages and the
    backstop, and the watch that stops every rank when one fails alone (`trl_gspo.ranks.watch`)."""

    def train(self, *args, **kwargs):
        accelerator = self.accelerator
        watch = RankWatch.start(accelerator.process_index, accelerator.num_processes)
        try:
            with phase(STEP):
                return super().train(*args, **kwargs)
        except BaseException as error:
            where, rank = phase_of(error), accelerator.process_index
            advice = stop_advice(error, where, self.args.output_dir)
            report = watch.publish(error, advice) if watch is not None else None
            if report is not None and report["rank"] != rank:
                # Another rank failed first; this rank's error followed from it (e.g. gloo's "connection closed by
                # peer" once that rank's process left): every rank raises the first error, as an agreed section does.
                raised, where, rank, advice = rebuilt(report), report["phase"], report["rank"], report["advice"]
                _note(raised, rank, where, advice)
                raise raised from error
            _note(error, rank, where, advice)
            raise
        finally:
            if watch is not None:
                watch.close()

    def _calculate_rewards(self, *args, **kwargs):  # the rewards are gathered at its end: a collective
        with phase(REWARDS, rank_wait_timeout(self.args)):
            return super()._calculate_rewards(*args, **kwargs)

    def _generate_and_score_completions(self, *args, **kwargs):
        with phase(GENERATION):
            return super()._generate_and_score_completions(*args, **kwargs)

    def _save_checkpoint(self, *args, **kwargs):
        # Named, not bounded: a large model's optimizer state can take longer to write than any fixed bound, and a
        # full disk raises (the watch stops the ranks waiting in the save's barrier).
        with phase(SAVE):
            return super()._save_checkpoint(*args, **kwargs)
