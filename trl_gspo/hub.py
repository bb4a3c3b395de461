"""The Hugging Face Hub as the checks see it: whether it can be reached at all, asked once, bounded in time (a Hub
request otherwise retries with backoff for about 30 s, or 51 s for a model's files), and a model name that is
neither local, nor cached, nor reachable refused in one line before any retry. Knows no trainer and no TRL."""

from __future__ import annotations

import functools
import os

# Seconds the checks wait for the Hub to accept a connection before they treat it as unreachable and read the cache
# only. Without this, each Hub request retries five times with backoff (about 30 s) before it fails.
HUB_PROBE_TIMEOUT = 3.0


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """Why the Hub cannot be reached from here (no such host, connection refused, no answer within `timeout`
    seconds), or None when its endpoint (`HF_ENDPOINT`, or the proxy the environment names for it) accepts a TCP
    connection. One attempt, bounded in time, name lookup included."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    outcome = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{host}:{port}: {err.strerror or err}")

    probe = threading.Thread(target=connect, daemon=True)  # a name lookup can outlast the socket's timeout
    probe.start()
    probe.join(timeout)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {timeout:g} s"


@functools.lru_cache(maxsize=None)
def hub_unreachable_once(endpoint: str) -> str | None:
    """`hub_unreachable()`, asked once per process and Hub endpoint: every dataset of a recipe shares the answer, so
    an unreachable Hub costs one probe's timeout, not one per dataset."""
    return hub_unreachable()


class ModelSourceError(OSError, ValueError):
    """A model name that is neither local, nor cached, nor reachable: an `OSError` where transformers would raise one
    after its retries, and a `ValueError` like the other refusals of a bad option."""


def check_model_source(model: str, key: str = "model") -> None:
    """Refuse, in one line naming `key`, a model name that is neither a local path, nor in the Hub cache, nor
    reachable (offline mode, or a Hub that does not accept a connection within `HUB_PROBE_TIMEOUT` seconds), before
    transformers' retry loop and traceback. A name the Hub can serve passes: transformers reports a wrong one."""
    if os.path.exists(model):
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except ValueError:  # a path that does not exist, not a Hub id: transformers says so at once, without retries
        return
    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    fix = "give a local path, or download it once online (`hf download NAME`)."
    if constants.HF_HUB_OFFLINE:
        raise ModelSourceError(f"`{key}`: {model!r} is neither a local path nor a cached model, and offline mode is on "
                         f"(HF_HUB_OFFLINE). Fix: {fix}")
    unreachable = hub_unreachable_once(constants.ENDPOINT)
    if unreachable:
        raise ModelSourceError(f"`{key}`: {model!r} is neither a local path nor a cached model, and the Hub cannot be "
                         f"reached from here ({unreachable}). Fix: check the network (or HF_ENDPOINT, a proxy), {fix}")
