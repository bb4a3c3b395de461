"""Real vLLM servers for the tests that need one (`pytest -m vllm`: tests/test_vllm.py, tests/test_async_vllm.py):
`trl-gspo vllm-serve` on loopback, vLLM's CPU build patched by tests/support/vllm_cpu_engine.py.

A server that several tests share (a module-scoped fixture) is put back as it started after each test
(`servers_as_found`, from tests/conftest.py), so that no test's outcome depends on the tests that ran on it before:
its sampler's random state (requests without a seed draw from the engine's one generator: after another test's
rounds, the same run samples other tool turns, whose prompts can outgrow the server's context), its prefix cache, and
with `weights`, its weights (a test whose trainer sends its own).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import requests
from support.helpers import cpu_env, free_port


@contextlib.contextmanager
def serving(root, model_dir, max_model_len=128, started=None, extra=(), weights=None):
    """A real vLLM server, `trl-gspo vllm-serve --model MODEL_DIR` on loopback, until the block ends; yields its URL.
    Its processes load tests/support/vllm_cpu_engine.py as a vLLM plugin (route capture in the CPU MoE kernel).
    `started`: a list that receives the server's process (its process group: the server and its engine); `extra`: more
    arguments; `weights`: a safetensors file of its starting weights, loaded again after each test, for a server
    started with tests/support/async_weight_files.py's worker extension (tests change its weights).
    """
    from support import vllm_cpu_engine

    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "trl_gspo.launch.cli", "vllm-serve", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--max_model_len", str(max_model_len),
             "--enforce_eager", "true", *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=cpu_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
                        PYTHONPATH=vllm_cpu_engine.write_plugin(root / "plugin")))
        if started is not None:
            started.append(server)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=5)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        pytest.fail("the vLLM server did not start:\n" + log_path.read_text()[-4000:])
                    time.sleep(0.5)  # tests wait for it: poll often (a refused connection costs nothing)
            _rpc(url, "trl_gspo_tests_sampler_rng", "save")  # as it starts: what each test after the first gets back
            _live[url] = weights
            yield url
        finally:
            _live.pop(url, None)
            with contextlib.suppress(ProcessLookupError):  # a test may have killed it
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


def completions_choices(answer, status: int = 200) -> list:
    """The choices of a vLLM `/v1/completions` answer (its parsed JSON). One without choices (an error answer:
    `{"error": {"message": ...}}`) raises with the server's status and message, where reading `["choices"]` would
    stop on a KeyError that hides why the server refused."""
    if isinstance(answer, dict) and "choices" in answer:
        return answer["choices"]
    error = answer.get("error", answer) if isinstance(answer, dict) else answer
    message = error.get("message", error) if isinstance(error, dict) else error
    raise RuntimeError(f"the vLLM server answered /v1/completions with HTTP {status} and no choices: {message}")


# vLLM 0.29's answer (HTTP 400) to a 146-token prompt with max_tokens 128 from a server whose max_model_len is 256, as
# sent: tests/test_vllm.py checks that a real server still answers exactly this, tests/test_server_watch.py reads it.
OVER_CONTEXT_ANSWER = {"error": {
    "message": "This model's maximum context length is 256 tokens. However, you requested 128 output tokens and your "
               "prompt contains 146 input tokens, for a total of 274 tokens. Please reduce the length of the input "
               "prompt or the number of requested output tokens. (parameter=input_tokens, value=146)",
    "type": "BadRequestError", "param": "input_tokens", "code": 400}}


_live = {}  # URL -> starting weights file (or None) of each server running now


def _rpc(url, method, *args):
    answer = requests.post(url + "/collective_rpc", json={"method": method, "args": list(args)}, timeout=120)
    answer.raise_for_status()
    return answer.json().get("results", []) if answer.content else []


def servers_as_found():
    """Every server running now back as it started (module docstring). A server running now, between two tests, is one
    they share: a test's own server ends with its test."""
    for url, weights in _live.items():
        if weights is not None:
            for worker in _rpc(url, "load_weights_file", str(weights)):
                assert worker["not_loaded"] == [], worker
        # Refused while a request still holds blocks (one a killed trainer left behind): waits until the server is idle
        deadline = time.monotonic() + 120
        while not requests.post(url + "/reset_prefix_cache", timeout=30).json()["success"]:
            assert time.monotonic() < deadline, f"the vLLM server at {url} still runs a request after 120 s"
            time.sleep(0.5)
        _rpc(url, "trl_gspo_tests_sampler_rng", "restore")
