"""CI runs the vLLM leg on two pytest-xdist workers (`-n 2 --dist loadgroup`, .ci/run); tests that share a
module-scoped fixture (a vLLM server, a reference run) must stay on one worker, or each worker builds the fixture
again (a vLLM server: about a minute). tests/support/xdist_groups.py marks them; here a small suite of its own runs
under exactly that mode and says where each test ran. This fails if pytest-xdist ignores the groups, as it did silently
with pytest 9.2 (pyproject.toml pins pytest below it)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.helpers import cpu_env

TESTS = Path(__file__).parent

SUITE = '''
import json, os
import pytest

def _note(tmp_path_factory, what):
    with open(os.environ["SUITE_NOTES"], "a") as notes:
        notes.write(json.dumps([what, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _note(tmp_path_factory, "server built")
    return "server"

@pytest.fixture(scope="module")
def reference(server, tmp_path_factory):
    _note(tmp_path_factory, "reference built")
    return "reference"

@pytest.mark.parametrize("i", range(4))
def test_uses_the_server(i, server, tmp_path_factory):
    _note(tmp_path_factory, "server user")

@pytest.mark.parametrize("i", range(4))
def test_uses_the_reference(i, reference, tmp_path_factory):
    _note(tmp_path_factory, "reference user")

@pytest.mark.parametrize("i", range(8))
def test_alone(i, tmp_path_factory):
    _note(tmp_path_factory, "alone")
'''

CONFTEST = f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from support.xdist_groups import group_module_fixture_users

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    group_module_fixture_users(items)
'''


def test_tests_sharing_a_module_fixture_run_on_one_worker_under_cis_xdist_mode(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_suite.py").write_text(SUITE)
    (tmp_path / "suite" / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                             "-q", "--basetemp", str(tmp_path / "base"), str(tmp_path / "suite")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=cpu_env(SUITE_NOTES=str(tmp_path / "notes.jsonl")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    notes = [json.loads(line) for line in (tmp_path / "notes.jsonl").read_text().splitlines()]
    workers = {what: {worker for w, worker in notes if w == what} for what, _ in notes}
    assert sum(what == "server built" for what, _ in notes) == 1  # once, not once per worker
    assert sum(what == "reference built" for what, _ in notes) == 1
    # the server's and the reference's users are one group (the reference uses the server): one worker for all
    assert len(workers["server user"] | workers["reference user"]) == 1
    assert {worker for _, worker in notes} == {"gw0", "gw1"}  # and two workers ran

