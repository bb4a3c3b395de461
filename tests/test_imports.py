"""Imports flow one way: command (`cli`) -> launched entry point (`train`, by module name) -> `recipe`, `rewards` ->
trainer. Read from the source (every import statement, also those inside functions) and checked in a fresh
interpreter."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import cpu_env

PACKAGE = Path(__file__).resolve().parents[1] / "trl_gspo"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The trl_gspo modules that module `name` imports anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from .quickstart import addition` imports the module trl_gspo.quickstart.addition
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _reaches(start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for target in GRAPH[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def test_the_source_is_read():  # the graph is not empty by mistake
    assert {"trl_gspo.recipe", "trl_gspo.rewards", "trl_gspo.trainer"} <= GRAPH["trl_gspo.train"]
    assert GRAPH["trl_gspo.cli"] >= {"trl_gspo.recipe", "trl_gspo.rewards", "trl_gspo.launching"}


def test_no_module_imports_the_command():
    assert [name for name, targets in GRAPH.items() if "trl_gspo.cli" in targets] == []


def test_no_import_cycle():
    assert [name for name in GRAPH if name in _reaches(name)] == []


def test_the_command_never_reaches_the_training_code():
    assert not _reaches("trl_gspo.cli") & {"trl_gspo.train", "trl_gspo.trainer", "trl_gspo.losses"}


def test_recipe_and_rewards_know_no_trainer_and_no_entry_point():
    for name in ("trl_gspo.recipe", "trl_gspo.rewards", "trl_gspo.tool_registry"):
        assert not _reaches(name) & {"trl_gspo.cli", "trl_gspo.train", "trl_gspo.trainer"}, name


def test_the_library_never_imports_the_command_side():
    command_side = {"trl_gspo.cli", "trl_gspo.train", "trl_gspo.recipe", "trl_gspo.rewards",
                    "trl_gspo.tool_registry"} | {
        name for name in MODULES if name.startswith("trl_gspo.quickstart")}
    for name in ("trl_gspo.losses", "trl_gspo.config", "trl_gspo.trainer", "trl_gspo.routing"):
        assert not _reaches(name) & command_side, name


def test_importing_the_command_loads_no_training_code():
    """In a fresh interpreter: `import trl_gspo.cli` (what the `trl-gspo` script does) loads neither our training
    modules nor TRL's GRPOTrainer."""
    code = ("import json, sys, trl_gspo.cli; print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('trl_gspo.', 'trl.trainer.grpo_trainer')))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       env=cpu_env()).stdout)
    assert "trl_gspo.cli" in loaded
    assert not set(loaded) & {"trl_gspo.train", "trl_gspo.trainer", "trl_gspo.losses",
                              "trl.trainer.grpo_trainer"}, loaded
