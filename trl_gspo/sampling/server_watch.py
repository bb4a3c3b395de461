"""A vLLM server that hangs while a generation request is out: TRL 1.16's client waits for its answer without a
timeout, so a frozen server (stopped, deadlocked, a GPU that stopped responding) stalls training forever.

`watch_generation` runs the request in a worker thread and, while it is out, reads the server's progress from its
Prometheus `/metrics` (vLLM's counters of engine steps, prompt and generated tokens). A server whose counters move is
working, however slowly; one whose counters stand still, or whose `/metrics` does not answer, for
`stall_timeout` seconds is hung, and `ServerStalled` is raised in the caller's thread (the worker thread, blocked on
the dead connection, is a daemon and ends with the process). A server without `/metrics` (HTTP 404) cannot be
watched: the request then runs unwatched, said once.
"""

from __future__ import annotations

import threading
import time

from transformers.utils import logging

logger = logging.get_logger(__name__)

# vLLM's counters that move while it works (v1 engine): engine steps, prompt tokens prefilled, tokens generated.
PROGRESS_COUNTERS = ("vllm:iteration_tokens_total_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")


class ServerStalled(RuntimeError):
    """The server made no progress for `seconds` while a generation request was out."""

    def __init__(self, seconds: float):
        super().__init__(f"no progress for {seconds:.0f} s")
        self.seconds = seconds


class MetricsUnavailable(RuntimeError):
    """The server has no `/metrics` endpoint."""


def server_progress(base_url: str, timeout: float) -> tuple[float, ...] | None:
    """The server's progress counters (`PROGRESS_COUNTERS`, each summed over its label sets), or None when the server
    does not answer within `timeout` seconds. Raises `MetricsUnavailable` on HTTP 404."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            raise MetricsUnavailable(base_url) from error
        return None
    except (OSError, ValueError):  # refused, reset, timed out
        return None
    totals = dict.fromkeys(PROGRESS_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            try:
                totals[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return tuple(totals.values())


_unwatched = []


def watch_generation(call, base_url: str, stall_timeout: float, poll_seconds: float | None = None):
    """`call()` (a generation request to the server at `base_url`), run in a daemon thread and returned or re-raised
    here; raises `ServerStalled` when the server's progress counters stand still (or `/metrics` does not answer) for
    `stall_timeout` seconds while it is out."""
    poll = poll_seconds if poll_seconds is not None else min(10.0, max(0.5, stall_timeout / 6))
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="trl-gspo generation request", daemon=True)
    thread.start()
    last, moved = None, time.monotonic()
    while True:
        thread.join(poll)
        if not thread.is_alive():
            break
        try:
            progress = server_progress(base_url, timeout=poll)
        except MetricsUnavailable:
            if not _unwatched:
                _unwatched.append(base_url)
                logger.warning(f"the vLLM server at {base_url} has no /metrics, so GSPOTrainer cannot tell a hung "
                               "server from a slow one: generation requests wait for its answer without a limit, as "
                               "in TRL. Fix: serve with `trl-gspo vllm-serve` (vLLM's server, metrics on).")
            thread.join()
            break
        now = time.monotonic()
        if progress is not None and progress != last:
            last, moved = progress, now
        elif now - moved >= stall_timeout:
            raise ServerStalled(now - moved)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
