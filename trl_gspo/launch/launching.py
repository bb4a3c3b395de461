"""Run the training launcher as a child whose whole process tree stops when `trl-gspo` is told to stop.

`accelerate launch` starts the training processes as its own children (torchrun workers on several processes).
Signalling only the command that started them is not enough: a SIGTERM to `trl-gspo` must also end every training
process, or they keep running and keep writing checkpoints into `output_dir`. So the launcher runs in its own
process group, and SIGINT / SIGTERM received here are forwarded to that group (and to any descendant that left it),
then escalated to SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Time the training processes get to stop cleanly after a forwarded signal before they are killed.
GRACE_SECONDS = 30.0


def accelerate_launch_command(accelerate_tokens: list[str]) -> list[str]:
    """`accelerate launch <tokens>` run with this interpreter (the same environment as `trl-gspo`), through this
    module's `__main__`: accelerate's own launch, with the warnings of `quiet.py` filtered."""
    return [sys.executable, "-m", "trl_gspo.launch.launching", *accelerate_tokens]


def accelerate_launch(argv: list[str]) -> None:
    """`accelerate launch argv` in this process (what `python -m accelerate.commands.launch argv` does), with the
    third-party warnings a trl-gspo run cannot act on filtered (`trl_gspo.launch.quiet`)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from . import quiet

    quiet.install()
    launch_command(launch_command_parser().parse_args(argv))


def run_forwarding_signals(cmd: list[str], grace_seconds: float = GRACE_SECONDS, env: dict | None = None) -> int:
    """Run `cmd` in a new process group; forward SIGINT/SIGTERM to the group and wait for all of it to end.

    Returns the command's exit code; `128 + signal` when it (or this process) was stopped by a signal, as a shell
    reports it. When a forwarded signal does not stop every process of the tree within `grace_seconds`, the rest
    are sent SIGKILL. Every process of the tree has ended when this returns. `env`: the child's environment (this
    process's by default).
    """
    child = subprocess.Popen(cmd, start_new_session=True, env=env)  # its own process group, signalled as one
    received: list[int] = []
    known: dict[int, psutil.Process] = {}

    def remember_tree() -> None:
        # Descendants that call setsid() leave the group; remember them by pid (psutil guards against pid reuse).
        try:
            for process in psutil.Process(child.pid).children(recursive=True):
                known.setdefault(process.pid, process)
        except psutil.NoSuchProcess:
            pass

    def signal_tree(signum: int) -> None:
        remember_tree()
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass
        for process in known.values():
            try:
                process.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    def forward(signum, _frame) -> None:
        received.append(signum)
        signal_tree(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        deadline = None
        while True:
            try:
                returncode = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            remember_tree()
            if received and deadline is None:
                deadline = time.monotonic() + grace_seconds
            if deadline is not None and time.monotonic() > deadline:
                signal_tree(signal.SIGKILL)
        # The launcher has exited; its children may not have (e.g. it was killed first). End and reap the rest.
        remember_tree()
        _stop_stragglers(child.pid, list(known.values()), grace_seconds if received else 5.0)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        return 128 + received[0]
    return 128 - returncode if returncode < 0 else returncode


def _stop_stragglers(group: int, processes: list[psutil.Process], grace_seconds: float) -> None:
    try:
        os.killpg(group, signal.SIGTERM)  # members that were never seen as descendants
    except ProcessLookupError:
        pass
    alive = [p for p in processes if _running(p)]
    for process in alive:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_seconds)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5.0)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    accelerate_launch(sys.argv[1:])
