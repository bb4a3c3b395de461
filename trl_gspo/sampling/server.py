"""Server mode (`vllm_mode="server"`, `trl-gspo vllm-serve`): a server that stops answering or hangs during
generation (`server_failures`; the hang watch is `trl_gspo.sampling.server_watch`), and the `/v1/completions` answers
TRL's client receives, with R3's routes as a route frame (`trl_gspo.sampling.route_wire`; each choice's routes then a
`FramedRoute`) or as base64 inside vLLM's JSON (`read_completions_answer`, `capture_server_choices`)."""

from __future__ import annotations

import contextlib
import re

from transformers.utils import logging

from ..routing.rollout import wrapping_method

logger = logging.get_logger(__name__)

SERVER_ROUTES_FLAG = "--enable-return-routed-experts"  # vLLM's `vllm serve` option; `trl-gspo vllm-serve` adds it


class SamplerServerError(RuntimeError):
    """The vLLM server stopped answering in the middle of a run; the message names the server and how to resume."""


class SamplerRequestRefused(RuntimeError):
    """The vLLM server answered a generation request with an error; the message quotes the server's status and
    message, and for a request longer than the server's context names both lengths and what to change."""


# vLLM 0.29's answer to a request whose prompt plus max_tokens exceeds its max_model_len (vllm/renderers/params.py,
# `_token_len_check`); "at least" when vLLM cut the prompt while tokenizing it.
_OVER_CONTEXT = re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) output tokens and "
                           r"your prompt contains (?:at least )?(\d+) input tokens")
_CONTEXT_FIX = ("Fix: start the server with a larger --max-model-len, or lower max_completion_length (TRL asks for that "
                "many tokens in every request, tool turns included), max_tool_calling_iterations (each tool turn's "
                "prompt is the whole conversation so far) or the prompts' length.")


def refused_request(base_url: str, response) -> SamplerRequestRefused:
    """One line for an error answer to a generation request. TRL's client would raise "Request failed: 400, <the
    JSON body>", which leaves the user to work out which lengths to change."""
    try:
        body = response.json()
    except ValueError:
        body = None
    # vLLM answers {"error": {"message": ...}}; FastAPI's own errors {"detail": ...}; anything else is quoted as text
    error = body.get("error", body.get("detail")) if isinstance(body, dict) else None
    message = error.get("message", error) if isinstance(error, dict) else error or response.text
    message = " ".join(str(message).split())[:2000]  # one line, even for a traceback
    refused = f"the vLLM server at {base_url} refused a generation request (HTTP {response.status_code})"
    over = _OVER_CONTEXT.search(message)
    if over:
        max_model_len, max_tokens, prompt = map(int, over.groups())
        return SamplerRequestRefused(
            f"{refused}: a prompt of {prompt} tokens plus max_tokens={max_tokens} (max_completion_length) is "
            f"{prompt + max_tokens} tokens, more than the server's max_model_len={max_model_len}. {_CONTEXT_FIX}")
    if "context length" in message or "max_model_len" in message:  # another wording of the same limit
        return SamplerRequestRefused(f"{refused}: {message} {_CONTEXT_FIX}")
    return SamplerRequestRefused(f"{refused}: {message}")


@contextlib.contextmanager
def server_failures(client, output_dir: str, stall_timeout: float = 0.0, during: str = "generation"):
    """Around a server-mode generation call (TRL's weight sync and generate), on the main process: a server that died
    or restarted and refuses the connection, drops it mid-answer, or hangs (no progress for `stall_timeout` seconds
    while a generation request is out: `trl_gspo.sampling.server_watch`; 0 waits forever, as TRL does) becomes one
    `SamplerServerError` naming the server, the newest complete checkpoint and how to resume, instead of a connection
    traceback from inside TRL's client or a run that never ends. A generation request the server answers with an
    error (a prompt longer than its context) becomes one `SamplerRequestRefused` quoting it (`refused_request`)."""
    from .server_watch import GENERATION_ENDPOINTS, ServerStalled, watch_generation

    try:  # TRL's client's transport (its `vllm` extra); absent, no such error can come
        import requests

        connection_errors = (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError)
    except ImportError:
        connection_errors = ()

    base_url = client.base_url

    def watching(original):
        def post(url, *args, **kwargs):
            if not str(url).endswith(GENERATION_ENDPOINTS):
                return original(url, *args, **kwargs)
            return watch_generation(lambda: original(url, *args, **kwargs), base_url, stall_timeout)
        return post

    def refusing(original):  # read here, before TRL's client turns the answer into "Request failed: <JSON>"
        def post(url, *args, **kwargs):
            response = original(url, *args, **kwargs)
            if str(url).endswith(GENERATION_ENDPOINTS) and not getattr(response, "ok", True):  # `ok`: HTTP 2xx/3xx
                raise refused_request(base_url, response)
            return response
        return post

    def stopped(what: str, err: BaseException) -> SamplerServerError:
        from ..checkpoints import latest_complete_checkpoint

        checkpoint = latest_complete_checkpoint(output_dir)[0]
        saved = (f"The newest complete checkpoint is {checkpoint}." if checkpoint else
                 f"No complete checkpoint was saved in {output_dir} yet (set save_steps).")
        return SamplerServerError(
            f"the vLLM server at {base_url} {what}; training stopped here. {saved} Fix: start the server again with "
            "the same command (`trl-gspo vllm-serve ...`) and resume with resume_from_checkpoint='latest' (YAML: "
            "`resume_from_checkpoint: latest`); the run continues from that checkpoint exactly "
            "(docs/reliability.md).")

    with contextlib.ExitStack() as wrapped:
        if getattr(client, "session", None) is not None:
            wrapped.enter_context(wrapping_method(client.session, "post", refusing))
            if stall_timeout:
                wrapped.enter_context(wrapping_method(client.session, "post", watching))
        try:
            yield
        except connection_errors as err:
            raise stopped(f"stopped answering during {during} ({type(err).__name__})", err) from err
        except ServerStalled as err:
            raise stopped(
                f"made no progress for {err.seconds:.0f} s while a generation request was out (its /metrics counters "
                "of engine steps and tokens stood still, or /metrics did not answer): it hangs (stopped, deadlocked, "
                "or its GPU stopped responding). If it is only slow, raise vllm_server_stall_timeout "
                f"(now {stall_timeout:g} s)", err) from err


@contextlib.contextmanager
def failures_shared(client, num_processes: int):
    """Around a server-mode generation call on the main process of several: while TRL's request to the server is
    out, the other ranks wait in TRL's broadcast of its answer. An error raised from the request (after
    `server_failures` has named it) is broadcast in the answer's place (`trl_gspo.ranks.FailedElsewhere`), so every
    rank raises it at once instead of waiting in the broadcast until the process group's timeout. Nothing is added on
    success."""
    if num_processes == 1:
        yield
        return
    out = []  # non-empty while the request is out: the others are in the broadcast

    def marking(original):
        def generate(*args, **kwargs):
            out.append(True)
            result = original(*args, **kwargs)
            out.clear()
            return result
        return generate

    with wrapping_method(client, "generate", marking):
        try:
            yield
        except Exception as error:
            if out:
                from accelerate.utils import broadcast_object_list

                from ..ranks import FailedElsewhere

                broadcast_object_list([FailedElsewhere(error, 0)], from_process=0)
            raise


class FramedRoute:
    """A choice's routes inside a received route frame (`trl_gspo.sampling.route_wire`), read when needed."""

    __slots__ = ("frame", "index")

    def __init__(self, frame, index: int):
        self.frame, self.index = frame, index

    def array(self):
        return self.frame.array(self.index)


_json_fallback_announced = []


def _announce_json_routes(base_url: str) -> None:
    if not _json_fallback_announced:
        _json_fallback_announced.append(True)
        logger.warning(
            f"the vLLM server at {base_url} returned R3's routes as base64 inside its JSON answer, not as raw bytes: "
            "it is not `trl-gspo vllm-serve` of this version (or its vLLM lacks the encoder it replaces). Routes are "
            "read from the JSON, which costs several times more time and memory at large rounds (docs/gpus.md). "
            "Fix: start the server with `trl-gspo vllm-serve` (same arguments as `trl vllm-serve`).")


def read_completions_answer(response, base_url: str = "the server") -> dict:
    """A `/v1/completions` answer: a route frame from `trl-gspo vllm-serve` (each choice's `routed_experts` then a
    `FramedRoute`) or vLLM's JSON (base64 routes; announced once as the slower path)."""
    from .route_wire import frame_routes

    frame = frame_routes(response)
    if frame is None:
        return json_completions_answer(response.json(), base_url)
    return framed_completions_answer(frame)


def json_completions_answer(body: dict, base_url: str = "the server") -> dict:
    """vLLM's JSON `/v1/completions` answer as it is; base64 routes in it are announced once as the slower path."""
    if any(choice.get("routed_experts") for choice in body.get("choices", [])):
        _announce_json_routes(base_url)
    return body


def framed_completions_answer(frame) -> dict:
    """The JSON answer of a received route frame, each choice's `routed_experts` reference `"#<i>"` replaced by a
    `FramedRoute` (`Frame.parse` refused a reference to an array the frame does not hold)."""
    from .route_wire import reference_index

    for choice in frame.answer.get("choices", []):
        index = reference_index(choice.get("routed_experts"))
        if index is not None:
            choice["routed_experts"] = FramedRoute(frame, index)
    return frame.answer


@contextlib.contextmanager
def capture_server_choices(client):
    """Keep the choices of every `/v1/completions` answer TRL's `VLLMClient` receives inside the block (TRL reads
    their tokens and log-probs, and drops their routes). Wraps the client's `requests.Session.post`: each request asks
    for the routes as raw bytes (`trl_gspo.sampling.route_wire`; a server that does not frame them answers JSON), the
    answer is parsed once, here, and TRL's client reads the same parsed body."""
    from .route_wire import HEADER

    choices = []

    def keeping(original):
        def post(url, *args, **kwargs):
            completions = str(url).endswith("/v1/completions")
            if completions:  # the frame is then read straight into one buffer (route_wire.frame_routes)
                kwargs["headers"] = {**(kwargs.get("headers") or {}), HEADER: "1"}
                kwargs.setdefault("stream", True)
            response = original(url, *args, **kwargs)
            if completions and response.ok:
                body = read_completions_answer(response, client.base_url)
                response.json = lambda **_: body
                choices.extend(body["choices"])
            return response
        return post

    with wrapping_method(client.session, "post", keeping):
        yield choices
