"""A hung vLLM server stops training; a slow one does not (trl_gspo/sampling/server_watch.py). Against a local HTTP
server that answers `/v1/completions` late or never and serves vLLM-style `/metrics` counters that move or stand
still; tests/test_vllm.py freezes a real vLLM server with SIGSTOP. Last, a generation request the server refuses (a
prompt longer than its context) becomes one line that says which lengths to change."""

import contextlib
import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from trl_gspo.sampling import server_watch
from trl_gspo.sampling.server import SamplerRequestRefused, SamplerServerError, server_failures

METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}
vllm:generation_tokens_total{{engine="1",model_name="m"}} 5.0
vllm:prompt_tokens_total{{engine="0",model_name="m"}} 100.0
vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}
vllm:num_requests_running{{engine="0",model_name="m"}} {tokens}
"""


@contextlib.contextmanager
def fake_server(answer_after: float | None, progress: str):
    """`answer_after`: seconds before /v1/completions answers (None: never, within the test); `progress`: 'moves'
    (each /metrics read shows more tokens), 'still', 'silent' (/metrics never answers) or 'none' (404)."""
    reads = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, code, body, content_type="application/json"):
            self.send_response(code)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path != "/metrics" or progress == "none":
                return self._answer(404, b"{}")
            if progress == "silent":
                time.sleep(30)
                return
            reads.append(1)
            tokens = 10.0 * len(reads) if progress == "moves" else 10.0
            self._answer(200, METRICS.format(tokens=tokens, steps=tokens).encode(), "text/plain")

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            time.sleep(30 if answer_after is None else answer_after)
            self._answer(200, json.dumps({"choices": [{"token_ids": [1, 2]}]}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", reads
    finally:
        server.shutdown()
        server.server_close()


def _post(url):
    request = urllib.request.Request(url, data=b'{"prompt": [[0]]}', method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_progress_is_read_from_vllms_counters():
    with fake_server(0, "moves") as (url, reads):
        first = server_watch.server_progress(url, timeout=5)
        second = server_watch.server_progress(url, timeout=5)
    assert first == (10.0, 100.0, 15.0) and second == (20.0, 100.0, 25.0)  # steps, prompt, generated (both engines)
    with fake_server(0, "none") as (url, _), pytest.raises(server_watch.MetricsUnavailable):
        server_watch.server_progress(url, timeout=5)
    with fake_server(0, "silent") as (url, _):
        assert server_watch.server_progress(url, timeout=0.5) is None


@pytest.mark.parametrize("progress", ["still", "silent"])
def test_a_server_without_progress_is_stopped_after_the_stall_timeout(progress, monkeypatch):
    """Stopped once the stall timeout (1.5 s) has passed without progress, while the request is still out (the server
    would answer after 30 s): at the first poll past the timeout, not later. Polls are counted, not timed, so a busy
    machine cannot fail it: each lasts at least `poll_seconds` (0.25 s) waiting on the request, plus as long again
    waiting on a /metrics that does not answer, so at most 1.5 / 0.25 polls after the first ('still': the first one
    reads the counters that then stand still), or 1.5 / 0.5 ('silent'), fit before the watch must stop."""
    polls, read = [], server_watch.server_progress

    def counted(base_url, timeout):
        polls.append(timeout)
        return read(base_url, timeout)

    monkeypatch.setattr(server_watch, "server_progress", counted)
    with fake_server(None, progress) as (url, _):
        started = time.monotonic()
        with pytest.raises(server_watch.ServerStalled) as stalled:
            server_watch.watch_generation(lambda: _post(url + "/v1/completions"), url, stall_timeout=1.5,
                                          poll_seconds=0.25)
        seconds = time.monotonic() - started
    assert 1.5 <= stalled.value.seconds <= seconds
    most = 1 + 1.5 / 0.25 if progress == "still" else 1.5 / 0.5
    assert 1 <= len(polls) <= most + 1 and set(polls) == {0.25}, polls  # + 1 of margin


def test_a_slow_server_that_makes_progress_is_not_stopped():
    """Its answer takes 3 s, twice the stall timeout, while its token counters move: the answer comes back."""
    with fake_server(3.0, "moves") as (url, reads):
        answer = server_watch.watch_generation(lambda: _post(url + "/v1/completions"), url, stall_timeout=1.5,
                                               poll_seconds=0.25)
    assert answer == {"choices": [{"token_ids": [1, 2]}]} and len(reads) >= 6


def test_a_server_without_metrics_is_waited_for_and_said_once(caplog):
    server_watch._unwatched.clear()
    with fake_server(1.0, "none") as (url, _), caplog.at_level("WARNING"):
        for _ in range(2):
            answer = server_watch.watch_generation(lambda: _post(url + "/v1/completions"), url, stall_timeout=0.3,
                                                   poll_seconds=0.1)
            assert answer["choices"]
    said = [r.getMessage() for r in caplog.records if "has no /metrics" in r.getMessage()]
    assert len(said) == 1
    server_watch._unwatched.clear()


def test_errors_of_the_request_reach_the_caller():
    def failing():
        raise ConnectionResetError("reset by peer")

    with fake_server(0, "moves") as (url, _), pytest.raises(ConnectionResetError, match="reset by peer"):
        server_watch.watch_generation(failing, url, stall_timeout=5, poll_seconds=0.1)


class _Session:
    """What TRL's VLLMClient posts through (`session.post`), over urllib here."""

    def __init__(self):
        self.urls = []

    def post(self, url, json=None, **kwargs):
        self.urls.append(url)
        return _post(url)


def test_a_hung_server_stops_training_with_the_error_that_names_it(tmp_path, monkeypatch):
    """Through `server_failures`, as GSPOTrainer calls TRL's generate: one `SamplerServerError` naming the server,
    that it made no progress, the option, the newest complete checkpoint and the resume. Other endpoints (weight
    sync) are not watched; the client's own `session.post` is back afterwards."""
    monkeypatch.setattr(server_watch, "watch_generation", _fast(server_watch.watch_generation))
    (tmp_path / "checkpoint-4").mkdir()
    monkeypatch.setattr("trl_gspo.checkpoints.latest_complete_checkpoint",
                        lambda output_dir: (str(tmp_path / "checkpoint-4"), []))
    with fake_server(None, "still") as (url, _):
        client = SimpleNamespace(base_url=url, session=_Session())
        with pytest.raises(SamplerServerError) as error, server_failures(client, str(tmp_path), stall_timeout=1.0):
            client.session.post(url + "/v1/completions", json={})
    message = str(error.value)
    assert f"the vLLM server at {url} made no progress for" in message
    assert "vllm_server_stall_timeout (now 1 s)" in message
    assert f"The newest complete checkpoint is {tmp_path / 'checkpoint-4'}" in message
    assert "resume_from_checkpoint='latest'" in message
    assert "post" not in vars(client.session)
    with fake_server(0, "still") as (url, _):  # a quick answer passes through; stall_timeout=0: no watch at all
        client = SimpleNamespace(base_url=url, session=_Session())
        for timeout in (1.0, 0):
            with server_failures(client, str(tmp_path), stall_timeout=timeout):
                assert client.session.post(url + "/v1/completions", json={})["choices"]


def _fast(watch):
    def fast(call, base_url, stall_timeout, poll_seconds=None):
        return watch(call, base_url, stall_timeout, poll_seconds=0.2)
    return fast


def test_the_stall_timeout_is_checked_at_construction():
    from trl_gspo import GSPOConfig

    cpu = dict(output_dir="/tmp/x", use_cpu=True, bf16=False)
    assert GSPOConfig(**cpu).vllm_server_stall_timeout == 300
    for bad in (-1, float("inf")):
        with pytest.raises(ValueError, match="`vllm_server_stall_timeout`: must be a finite number of seconds >= 0"):
            GSPOConfig(**cpu, vllm_server_stall_timeout=bad)
    with pytest.raises(TypeError, match="`vllm_server_stall_timeout` must be a number of seconds"):
        GSPOConfig(**cpu, vllm_server_stall_timeout="10")


def _client_answering(status, body, url="http://127.0.0.1:8000"):
    """TRL's own `VLLMClient` (its `generate` as the trainer calls it), whose session answers every request with
    `body`; built without its constructor, which needs vLLM and a server."""
    import requests
    from trl.generation.vllm_client import VLLMClient

    response = requests.Response()
    response.status_code, response._content = status, body if isinstance(body, bytes) else json.dumps(body).encode()
    client = object.__new__(VLLMClient)
    client.base_url, client.model = url, "m"
    client.session = SimpleNamespace(post=lambda *args, **kwargs: response)
    return client


def test_a_turn_longer_than_the_servers_context_stops_with_one_line_naming_the_lengths_and_the_fix(tmp_path):
    """vLLM's real answer to a tool turn of 146 prompt tokens plus max_tokens 128 on a server of max_model_len 256
    (TRL's client alone raises "Request failed: 400, " and the JSON): one line with the three numbers and what to
    change. tests/test_vllm.py drives the same request through a real server."""
    from support.vllm_servers import OVER_CONTEXT_ANSWER

    client = _client_answering(400, OVER_CONTEXT_ANSWER)
    with pytest.raises(SamplerRequestRefused) as error, server_failures(client, str(tmp_path)):
        client.generate([[5] * 146], max_tokens=128)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("the vLLM server at http://127.0.0.1:8000 refused a generation request (HTTP 400): a "
                              "prompt of 146 tokens plus max_tokens=128 (max_completion_length) is 274 tokens, more "
                              "than the server's max_model_len=256. Fix: start the server with a larger "
                              "--max-model-len, or lower max_completion_length"), message
    assert "max_tool_calling_iterations" in message and "the prompts' length" in message


@pytest.mark.parametrize("status, body, quoted, fix", [
    (400, {"error": {"message": "This model's maximum context length is 256 tokens. A new wording."}},
     "This model's maximum context length is 256 tokens. A new wording.", True),
    (400, {"error": {"message": "max_tokens=300 cannot be greater than max_model_len=max_total_tokens=256."}},
     "max_tokens=300 cannot be greater than max_model_len=max_total_tokens=256.", True),
    (500, b"Internal Server Error\n  at engine", "Internal Server Error at engine", False),
])
def test_other_refusals_are_quoted_as_the_server_wrote_them(tmp_path, status, body, quoted, fix):
    """A message that does not parse is quoted verbatim, still on one line; the fix is named only for the context."""
    client = _client_answering(status, body)
    with pytest.raises(SamplerRequestRefused) as error, server_failures(client, str(tmp_path)):
        client.generate([[5] * 4], max_tokens=8)
    message = str(error.value)
    assert "\n" not in message and f"(HTTP {status}): {quoted}" in message
    assert ("--max-model-len" in message) == fix
