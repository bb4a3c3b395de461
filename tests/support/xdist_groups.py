"""Which tests pytest-xdist must keep on one worker, for CI's `pytest -m vllm -n 2 --dist loadgroup` (and anyone's
`-n N --dist loadgroup` run of the other tests).

Called from tests/conftest.py's collection hook (before pytest-xdist's own reads the marks added here);
tests/test_xdist_groups.py checks, in a pytest run of its own, that a grouped module fixture is built once.
"""

import pytest


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
