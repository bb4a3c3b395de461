"""The suite's skip accounting (tests/conftest.py): each run prints its skip count and reasons, and CI's runs
(TRL_GSPO_STRICT_SKIPS=1, .ci/run) fail on a skip the machine does not explain."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import cpu_env


PROBE = '''
import pytest

def test_runs():
    pass

@pytest.mark.vllm
def test_needs_vllm():
    pytest.skip("vLLM is not installed (probe)")

def test_skips_by_luck():
    pytest.skip("no second turn on this machine (probe)")
'''


@pytest.mark.parametrize("select, strict, code", [
    ("test_runs or test_needs_vllm", True, 0), ("test_runs or test_skips_by_luck", True, 1),
    ("test_runs or test_skips_by_luck", False, 0)])
def test_ci_fails_a_run_with_a_skip_the_machine_does_not_explain(tmp_path, select, strict, code):
    """With TRL_GSPO_STRICT_SKIPS=1 (.ci/run) a skip fails the run unless the machine lacks a GPU, or vLLM for a test
    marked `vllm`; every run prints its skip count and reasons (tests/conftest.py)."""
    if importlib.util.find_spec("vllm") is not None and "needs_vllm" in select:
        code = 1  # vLLM is installed: that skip is not explained either
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = cpu_env(PYTHONPATH=str(Path(__file__).parent), TRL_GSPO_STRICT_SKIPS="1" if strict else "0")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                             "-c", os.devnull, "--rootdir", str(tmp_path), "-m", "vllm or not vllm", "-k", select,
                             str(tmp_path / "test_probe.py")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == code, result.stdout[-2000:]
    assert "trl-gspo: 1 skipped" in result.stdout
