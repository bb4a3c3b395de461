"""Imports flow one way: command (`launch.cli`) -> launched entry point (`launch.train`, by module name) ->
`launch.recipe`, `launch.checks`, `launch.rewards` -> trainer. Read from the source (every import statement, also
those inside functions) and checked in a fresh interpreter. Also: every import path the docs show, and the paths the
launch side had before it moved into `trl_gspo/launch/`, still import (the same objects)."""

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_gspo"
# The launch side's modules before they moved into trl_gspo/launch/; each old path is kept by a shim.
MOVED = {f"trl_gspo.{name}": f"trl_gspo.launch.{name}"
         for name in ("cli", "train", "launching", "multinode", "rewards", "tool_registry", "reporting")}
# trl_gspo/recipe.py was split in two; its old path answers every name it had (as of 573973a) from either half.
SPLIT_RECIPE = ("trl_gspo.launch.recipe", "trl_gspo.launch.checks")
OLD_RECIPE_NAMES = (
    "DatasetMixtureConfig", "ModelConfig", "TrlParser", "GRPOScriptArguments", "GSPOConfig", "BUILTIN_PREFIX",
    "BUILTIN_MODELS", "BUILTIN_DATASETS", "BUILTIN_TASK_MODELS", "CONVERSATIONAL_BUILTIN_DATASETS",
    "SFT_UNDER_DEEPSPEED", "SFT_UNDER_FSDP", "COLD_START_LAUNCHERS", "COLD_START_NOTE_ENV", "RecipeError",
    "GSPOScriptArguments", "_BeforeLaunchGSPOConfig", "make_parser", "_accelerate_options", "_stray_tokens",
    "parse_recipe", "_check_recipe_file", "_relative_to_recipe", "describe", "_check_builtin_dataset", "load_dataset",
    "FSDP_WITHOUT_ACCELERATOR", "has_accelerator", "launch_options", "launcher_type", "launched_processes",
    "launched_machines", "cold_start_before_launch", "check_launch", "check_recipe", "check_dataset_size",
    "_check_output_dir", "_check_model", "_builtin", "_check_builtin_pair", "_check_tools", "check_conversational",
    "_dataset_size", "_probe_dataset",
)
SHIMS = {*MOVED, "trl_gspo.recipe"}


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
    assert {"trl_gspo.launch.recipe", "trl_gspo.launch.checks", "trl_gspo.launch.rewards",
            "trl_gspo.trainer"} <= GRAPH["trl_gspo.launch.train"]
    assert GRAPH["trl_gspo.launch.cli"] >= {"trl_gspo.launch.recipe", "trl_gspo.launch.checks",
                                            "trl_gspo.launch.rewards", "trl_gspo.launch.launching"}


def test_no_module_imports_the_command():
    assert [name for name, targets in GRAPH.items() if targets & {"trl_gspo.launch.cli", "trl_gspo.cli"}] == []


def test_no_import_cycle():
    assert [name for name in GRAPH if name in _reaches(name)] == []


def test_the_command_never_reaches_the_training_code():
    assert not _reaches("trl_gspo.launch.cli") & {"trl_gspo.launch.train", "trl_gspo.trainer", "trl_gspo.losses"}


def test_recipe_checks_and_rewards_know_no_trainer_and_no_entry_point():
    for name in ("trl_gspo.launch.recipe", "trl_gspo.launch.checks", "trl_gspo.launch.rewards",
                 "trl_gspo.launch.tool_registry"):
        assert not _reaches(name) & {"trl_gspo.launch.cli", "trl_gspo.launch.train", "trl_gspo.trainer"}, name


def test_recipe_parsing_does_not_import_the_checks():  # the split's seam: checks read what parsing returns
    assert "trl_gspo.launch.checks" not in _reaches("trl_gspo.launch.recipe")


def test_the_library_never_imports_the_command_side():
    command_side = SHIMS | {name for name in MODULES if name.startswith(("trl_gspo.launch", "trl_gspo.quickstart"))}
    for name in ("trl_gspo.losses", "trl_gspo.config", "trl_gspo.trainer", "trl_gspo.routing"):
        assert not _reaches(name) & command_side, name


def test_the_package_imports_the_launch_side_by_its_new_path():
    assert [name for name in GRAPH if GRAPH[name] & SHIMS] == []


def test_importing_the_command_loads_no_training_code():
    """In a fresh interpreter: `import trl_gspo.launch.cli` (what the `trl-gspo` script does), or its old path, loads
    neither our training modules nor TRL's GRPOTrainer."""
    for command in ("trl_gspo.launch.cli", "trl_gspo.cli"):
        code = (f"import json, sys, {command}; print(json.dumps(sorted(m for m in sys.modules "
                "if m.startswith(('trl_gspo.', 'trl.trainer.grpo_trainer')))))")
        loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                           env=cpu_env()).stdout)
        assert "trl_gspo.launch.cli" in loaded
        assert not set(loaded) & {"trl_gspo.launch.train", "trl_gspo.train", "trl_gspo.trainer", "trl_gspo.losses",
                                  "trl.trainer.grpo_trainer"}, loaded


def test_the_old_paths_are_the_moved_modules():
    """`trl_gspo.cli`, `trl_gspo.rewards`, ... are the moved modules themselves, so patching either patches both."""
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_the_old_recipe_path_answers_every_name_it_had():
    import trl_gspo.recipe

    halves = [importlib.import_module(name) for name in SPLIT_RECIPE]
    for name in OLD_RECIPE_NAMES:
        homes = [half for half in halves if hasattr(half, name)]
        assert homes, name
        assert getattr(trl_gspo.recipe, name) is getattr(homes[0], name), name
    from trl_gspo.recipe import check_recipe, parse_recipe  # `from ... import` goes through the same lookup

    assert (parse_recipe, check_recipe) == (halves[0].parse_recipe, halves[1].check_recipe)


def _documented_texts() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def test_every_documented_import_path_imports():
    """Each `from trl_gspo... import names`, `::: trl_gspo...` (the API pages) and `-m trl_gspo...` in README.md and
    docs/*.md names something that exists; and each old path of a moved module gives the same objects."""
    checked = 0
    for doc, text in _documented_texts().items():
        for module, names in re.findall(r"from (trl_gspo[\w.]*) import ([\w, ]+)", text):
            for name in (n.strip() for n in names.split(",")):
                value = getattr(importlib.import_module(module), name)
                old = next((o for o, n in MOVED.items() if module == n), None)
                if old:
                    assert getattr(importlib.import_module(old), name) is value, (doc, old, name)
                checked += 1
        for path in re.findall(r"^::: (trl_gspo[\w.]*)", text, flags=re.M):
            module, _, attribute = path.rpartition(".") if "." in path.removeprefix("trl_gspo") else (path, "", "")
            try:
                importlib.import_module(path)
            except ModuleNotFoundError:
                assert hasattr(importlib.import_module(module), attribute), (doc, path)
            checked += 1
        for module in re.findall(r"-m (trl_gspo[\w.]*)", text):
            assert importlib.util.find_spec(module) is not None, (doc, module)
            checked += 1
    assert checked > 20  # the patterns still match the docs


def test_the_console_script_and_module_entry_points():
    """`trl-gspo` (pyproject's console script) is the moved command; `python -m` runs the old paths too."""
    script = re.search(r'^trl-gspo = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    module, _, function = script.partition(":")
    assert module == "trl_gspo.launch.cli"
    assert getattr(importlib.import_module(module), function) is importlib.import_module("trl_gspo.cli").main
    import trl_gspo.launch.cli

    assert trl_gspo.launch.cli.TRAINING_MODULE == "trl_gspo.launch.train"
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    for old, printed in (("trl_gspo.cli", "recipe is valid"), ("trl_gspo.train", "model:")):
        result = subprocess.run([sys.executable, "-m", old, "--config", recipe, "--dry_run", "true"],
                                capture_output=True, text=True, env=cpu_env(), cwd=ROOT)
        assert result.returncode == 0 and printed in result.stdout, (old, result.stderr[-2000:])
