"""Imports flow one way: command (`launch.cli`) -> launched entry point (`launch.train`, by module name) ->
`launch.recipe`, `launch.checks`, `launch.rewards` -> trainer. Read from the source (every import statement, also
those inside functions) and checked in a fresh interpreter. Also: the public API is what docs/api.md documents, and
every import path the docs show imports."""

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from support.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_gspo"
# `from trl_gspo import ...`: the names README.md and docs/api.md show; loaded lazily (trl_gspo/__init__.py)
PUBLIC = {"__version__", "GSPOConfig", "GSPOTrainer", "AsyncGSPOConfig", "AsyncGSPOTrainer", "gspo_loss",
          "gspo_token_loss", "sequence_log_ratio"}
# The trainer packages' `__init__` load their trainer lazily: importing `trl_gspo.async_trainer.config` (a recipe
# with `trainer: async`) runs `trl_gspo/async_trainer/__init__.py` and nothing more.
TRAINING_CODE = {"trl_gspo.launch.train", "trl_gspo.trainer.gspo_trainer", "trl_gspo.async_trainer.trainer",
                 "trl_gspo.async_trainer.routing", "trl_gspo.losses", "trl.trainer.grpo_trainer"}
TOP_LEVEL_MODULES_AT_MOST = 8


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
    assert [name for name, targets in GRAPH.items() if "trl_gspo.launch.cli" in targets] == []


def test_no_import_cycle():
    assert [name for name in GRAPH if name in _reaches(name)] == []


def test_the_command_never_reaches_the_training_code():
    assert not _reaches("trl_gspo.launch.cli") & {"trl_gspo.launch.train", "trl_gspo.trainer.gspo_trainer",
                                                 "trl_gspo.losses"}


def test_recipe_checks_and_rewards_know_no_trainer_and_no_entry_point():
    for name in ("trl_gspo.launch.recipe", "trl_gspo.launch.checks", "trl_gspo.launch.rewards",
                 "trl_gspo.launch.tool_registry"):
        assert not _reaches(name) & {"trl_gspo.launch.cli", "trl_gspo.launch.train", "trl_gspo.trainer.gspo_trainer",
                                     "trl_gspo.async_trainer.trainer"}, name


def test_recipe_parsing_does_not_import_the_checks():  # the split's seam: checks read what parsing returns
    assert "trl_gspo.launch.checks" not in _reaches("trl_gspo.launch.recipe")


def test_the_library_never_imports_the_command_side():
    command_side = {name for name in MODULES if name.startswith(("trl_gspo.launch", "trl_gspo.quickstart"))}
    for name in ("trl_gspo.losses", "trl_gspo.config", "trl_gspo.trainer.gspo_trainer", "trl_gspo.routing",
                 "trl_gspo.async_trainer.trainer", "trl_gspo.turn_advantages"):
        assert not _reaches(name) & command_side, name


def test_importing_the_package_the_command_or_reading_a_recipe_loads_no_training_code():
    """In a fresh interpreter: `import trl_gspo`, `import trl_gspo.launch.cli` (what the `trl-gspo` script does) and
    parsing a recipe load neither our training modules nor TRL's GRPOTrainer."""
    parse = "from trl_gspo.launch.recipe import parse_recipe; parse_recipe(['--config', {!r}])"
    recipes = [ROOT / "recipes" / "quickstart.yaml", ROOT / "recipes" / "qwen3_30b_a3b" / "async" / "gspo.yaml"]
    for code in ("import trl_gspo", "import trl_gspo.launch.cli", *(parse.format(str(r)) for r in recipes)):
        probe = (f"import json, sys; {code}; print(json.dumps(sorted(m for m in sys.modules "
                 "if m.startswith(('trl_gspo', 'trl.trainer.grpo_trainer')))))")
        loaded = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                           env=cpu_env(), cwd=ROOT).stdout.splitlines()[-1])
        assert "trl_gspo" in loaded
        assert not set(loaded) & TRAINING_CODE, (code, loaded)


def test_our_modules_do_not_pass_on_trls_experimental_warning():
    """TRL warns at the first import of `trl.experimental` that its APIs may change; trl-gspo pins TRL and tests what
    it uses, so importing the asynchronous trainer's modules (which build on `trl.experimental`) does not warn."""
    modules = ", ".join(name for name in MODULES if name.startswith("trl_gspo.async_trainer"))
    result = subprocess.run([sys.executable, "-W", "error::trl.import_utils.TRLExperimentalWarning", "-c",
                             f"import {modules}"], capture_output=True, text=True, env=cpu_env(), cwd=ROOT)
    assert result.returncode == 0 and "TRLExperimentalWarning" not in result.stderr, result.stderr[-2000:]


def test_the_package_layout_is_the_one_docs_architecture_shows():
    """At most `TOP_LEVEL_MODULES_AT_MOST` modules beside the packages, and docs/architecture.md names every module
    file of the package under its folder, so the page is the tree as built."""
    top_level = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top_level) <= TOP_LEVEL_MODULES_AT_MOST, top_level
    tree = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    folder, listed = "", set()
    for line in tree.splitlines()[1:]:  # below `trl_gspo/`
        words = line.split()
        if line.startswith("  ") and not line.startswith("    ") and words[0].endswith("/"):
            folder = words[0]
            continue
        inner = line.startswith("    ")
        # a folder's line may list several modules; a top-level line names one, then says what it holds
        names = [w for w in (words if inner else words[:1]) if w.endswith(".py")]
        listed |= {(folder if inner else "") + name for name in names}
    built = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    assert built == listed, (sorted(built - listed), sorted(listed - built))


def test_the_public_api_is_what_the_docs_document():
    """`trl_gspo.__all__` is exactly the documented top-level API; each name loads, and docs/api.md documents it."""
    import trl_gspo

    assert set(trl_gspo.__all__) == PUBLIC
    api = (ROOT / "docs" / "api.md").read_text()
    for name in PUBLIC - {"__version__"}:
        value = getattr(trl_gspo, name)
        assert f"::: {value.__module__}.{name}" in api or f"::: {value.__module__}\n" in api, name


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
                getattr(importlib.import_module(module), name)
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
    """`trl-gspo` (pyproject's console script) is `trl_gspo.launch.cli:main`; `python -m` runs the command and the
    launched entry point."""
    script = re.search(r'^trl-gspo = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    module, _, function = script.partition(":")
    assert module == "trl_gspo.launch.cli" and callable(getattr(importlib.import_module(module), function))
    import trl_gspo.launch.cli

    assert trl_gspo.launch.cli.TRAINING_MODULE == "trl_gspo.launch.train"
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    for entry, printed in (("trl_gspo.launch.cli", "recipe is valid"), ("trl_gspo.launch.train", "model:")):
        result = subprocess.run([sys.executable, "-m", entry, "--config", recipe, "--dry_run", "true"],
                                capture_output=True, text=True, env=cpu_env(), cwd=ROOT)
        assert result.returncode == 0 and printed in result.stdout, (entry, result.stderr[-2000:])
