"""Which tests pytest-xdist must keep on one worker, for CI's `pytest -m vllm -n 2 --dist loadgroup` and
`pytest -m slow -n 2 --dist loadgroup` (and anyone's `-n N --dist loadgroup` run of the other tests).

Called from tests/conftest.py's collection hook (before pytest-xdist's own reads the marks added here);
tests/test_xdist_groups.py checks, in a pytest run of its own, that a grouped module fixture is built once.
"""

import pytest

# The modules whose slow tests train in the pytest process itself (one torch thread under two workers). Every other
# slow test launches processes (two ranks, a launcher, a node per process) and joins LAUNCHES, unless it is marked
# `one_process` (a single run script or a one-process `trl-gspo` run, its torch threads capped like the worker's by
# tests/conftest.py's `one_process_threads`): on 2 cores, two launches at once only spin against each other, while
# one launch beside one-core runs fills the cores a launch leaves idle while it imports and starts. A new slow module
# launches until it is listed here; tests/test_xdist_groups.py checks that these modules start no process.
IN_PROCESS_SLOW_MODULES = frozenset({
    "test_clip_band", "test_end_to_end", "test_logging", "test_multi_turn", "test_old_logps",
    "test_rollout_replay_trainer", "test_trainer_routing", "test_turn_advantages"})
LAUNCHES = "launches"


def group_launches(items):
    """Under pytest-xdist (`-m slow -n 2 --dist loadgroup`, as CI runs the slow leg), the slow tests that launch
    processes go to one worker, one at a time; the in-process and `one_process` ones share the other worker. The vLLM
    and GPU suites keep their own grouping (`group_module_fixture_users`)."""
    for item in items:
        if (item.get_closest_marker("slow") is not None and item.get_closest_marker("xdist_group") is None
                and not any(item.get_closest_marker(name) for name in ("vllm", "gpu", "one_process"))
                and item.module.__name__.rpartition(".")[2] not in IN_PROCESS_SLOW_MODULES):
            item.add_marker(pytest.mark.xdist_group(LAUNCHES))


def group_module_fixture_users(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, as CI runs the vLLM leg), the tests that share a
    module-scoped fixture (a vLLM server, a reference run) go to one worker, so it is built once, not once per worker.
    Tests joined through any shared fixture form one group; a test's own `xdist_group` mark wins."""
    parent = {}

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {}
    for item in items:
        infos = getattr(item, "_fixtureinfo", None)
        names = [f"{item.module.__name__}::{name}" for name, defs in (infos.name2fixturedefs if infos else {}).items()
                 if defs and defs[-1].scope == "module"]
        if names and item.get_closest_marker("xdist_group") is None:
            shared[item] = names
            for name in names[1:]:
                parent[root(name)] = root(names[0])
    for item, names in shared.items():
        item.add_marker(pytest.mark.xdist_group(root(names[0])))
