"""Real vLLM servers for the tests that need one (`pytest -m vllm`: tests/test_vllm.py, tests/test_async_vllm.py):
`trl-gspo vllm-serve` on loopback, vLLM's CPU build patched by tests/support/vllm_cpu_engine.py."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from support.helpers import cpu_env, free_port


@contextlib.contextmanager
def serving(root, model_dir, max_model_len=128, started=None, extra=()):
    """A real vLLM server, `trl-gspo vllm-serve --model MODEL_DIR` on loopback, until the block ends; yields its URL.
    Its processes load tests/support/vllm_cpu_engine.py as a vLLM plugin (route capture in the CPU MoE kernel).
    `started`: a list that receives the server's process (its process group: the server and its engine); `extra`: more
    arguments.
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
                    time.sleep(2)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):  # a test may have killed it
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
