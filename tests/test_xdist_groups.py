"""CI runs the vLLM leg on two pytest-xdist workers (`-n 2 --dist loadgroup`, .ci/run); tests that share a
module-scoped fixture (a vLLM server, a reference run) must stay on one worker, or each worker builds the fixture
again (a vLLM server: about a minute). tests/support/xdist_groups.py marks them; here a small suite of its own runs
under exactly that mode and says where each test ran. This fails if pytest-xdist ignores the groups, as it did silently
with pytest 9.2 (pyproject.toml pins pytest below it)."""

import json
import subprocess
import sys
import textwrap
import types
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

@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_launches_ranks(i, tmp_path_factory):
    _note(tmp_path_factory, "launch")

@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("i", range(4))
def test_runs_one_process(i, request, tmp_path_factory):
    _note(tmp_path_factory, "one process" if request.node.get_closest_marker("xdist_group") is None else "grouped")
'''

CONFTEST = f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from support.xdist_groups import group_launches, group_module_fixture_users

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    group_launches(items)
    group_module_fixture_users(items)
'''


def test_tests_sharing_a_module_fixture_run_on_one_worker_under_cis_xdist_mode(tmp_path):
    """Also the slow leg's rule, in the same run: slow tests that launch ranks on one worker, `one_process` ones in no
    group."""
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
    assert len(workers["launch"]) == 1 and sum(what == "launch" for what, _ in notes) == 4
    assert sum(what == "one process" for what, _ in notes) == 4 and "grouped" not in workers
    assert {worker for _, worker in notes} == {"gw0", "gw1"}  # and two workers ran


class _Item:
    """What `group_launches` reads of a collected test: its markers and its module's name."""

    def __init__(self, module, *markers):
        self.module = types.SimpleNamespace(__name__=module)
        self.markers = {name: pytest.Mark(name, (), {}) for name in markers}

    def get_closest_marker(self, name):
        return self.markers.get(name)

    def add_marker(self, mark):
        self.markers[mark.name] = mark.mark

    def group(self):
        marker = self.markers.get("xdist_group")
        return marker.args[0] if marker else None


def test_slow_tests_that_launch_processes_share_one_worker_and_the_rest_spread():
    """CI's slow leg (`-m slow -n 2 --dist loadgroup`): the launching tests and a new slow module (launching until
    listed), one at a time on one worker; the in-process and `one_process` ones spread; the vLLM and GPU suites' own
    groups kept."""
    from support.xdist_groups import IN_PROCESS_SLOW_MODULES, LAUNCHES, group_launches

    in_process = _Item(f"tests.{sorted(IN_PROCESS_SLOW_MODULES)[0]}", "slow")
    launching, new_module = _Item("tests.test_multiprocess", "slow"), _Item("tests.test_something_new", "slow")
    fast, vllm = _Item("tests.test_multiprocess"), _Item("tests.test_vllm", "slow", "vllm")
    gpu, one_process = _Item("test_gpu", "slow", "gpu"), _Item("tests.test_quickstart", "slow", "one_process")
    own = _Item("tests.test_quickstart", "slow")
    own.add_marker(pytest.mark.xdist_group("its own"))
    items = (in_process, launching, new_module, fast, vllm, gpu, one_process, own)
    group_launches(list(items))
    assert [item.group() for item in items] == [None, LAUNCHES, LAUNCHES, None, None, None, None, "its own"]


@pytest.mark.parametrize("module", sorted(__import__("support.xdist_groups").xdist_groups.IN_PROCESS_SLOW_MODULES))
def test_the_in_process_slow_modules_start_no_process(module):
    """A module listed as in-process runs beside a launch on 2 cores: it must not launch one itself. It exists and
    still holds slow tests (a stale entry would hide nothing, but says what is no longer so)."""
    source = (TESTS / f"{module}.py").read_text()
    assert "pytest.mark.slow" in source
    starts = ("subprocess", "cpu_env", "multiprocessing", "Popen", "spawn(", "fault_matrix", "accelerate_launch")
    assert [word for word in starts if word in source] == []
