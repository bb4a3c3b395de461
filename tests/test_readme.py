"""What the README promises: CI runs its test command verbatim, and every install line installs from the checkout."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n# \d\. [^\n]*\n([^\n]+)\n```", readme)
    assert len(commands) == 2, commands
    quickstart, tests = commands
    assert "trl-gspo --config recipes/quickstart.yaml" in quickstart
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines
    assert quickstart.startswith("pip install torch==2.13.0") and tests.startswith("pip install torch==2.13.0")


def test_install_lines_install_from_the_checkout():
    """trl-gspo is not on the package index yet: every install line a user reads (README, docs, recipe headers, error
    messages) installs from the checkout, `pip install -e ".[extra]"`; one spelling, none naming a published package."""
    published = re.compile(r"pip install [\"']?trl-gspo\b")
    places = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "recipes").rglob("*.yaml"),
              *(ROOT / "recipes").rglob("*.py"), *(ROOT / "trl_gspo").rglob("*.py"),
              *(ROOT / "benchmarks").rglob("*.py")]
    wrong = [f"{path.relative_to(ROOT)}:{number}" for path in places
             for number, line in enumerate(path.read_text().splitlines(), 1) if published.search(line)]
    assert wrong == []


def _recipe_table():
    """.ci/recipe_table.py, imported by path (.ci is not a package)."""
    spec = importlib.util.spec_from_file_location("recipe_table", ROOT / ".ci" / "recipe_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_recipe_table_is_generated_from_the_recipe_headers():
    """A recipe's memory figures and sizes have one home, the card at the top of its header: docs/recipes.md's table
    between the markers is exactly what .ci/recipe_table.py generates from the cards, so a header changed without the
    table (or the table edited by hand) fails here (the table once said 20-30 GB where the header said 10-20)."""
    recipe_table = _recipe_table()
    page = (ROOT / "docs" / "recipes.md").read_text()
    generated = recipe_table.table()
    assert recipe_table.replace_table(page, generated) == page, "run: python .ci/recipe_table.py --write"
    assert generated.count("\n| `recipes/") == len(recipe_table.recipes()) >= 25


def test_a_recipe_card_without_its_keys_or_source_is_refused(tmp_path):
    """The generator refuses a recipe whose card lacks a key, has a stray line, or gives a memory figure that says
    neither estimate nor measured on a device."""
    recipe_table = _recipe_table()
    recipe = tmp_path / "recipe.yaml"
    good = ["# What: x", "# Sized for: 1 GPU", "# Memory per GPU: 10 GB (estimate)", "# Ran on a GPU: no", "#", "a: 1"]
    recipe.write_text("\n".join(good))
    assert recipe_table.card(recipe)["Memory per GPU"] == "10 GB (estimate)"
    for broken, message in [(good[:1] + good[2:], "lacks ['Sized for']"),
                            (["# Hardware: 1 GPU"] + good, "not one of the card's keys"),
                            (good[:2] + ["# Memory per GPU: 10 GB"] + good[3:], "must say 'estimate'")]:
        recipe.write_text("\n".join(broken))
        with pytest.raises(ValueError, match=re.escape(message)):
            recipe_table.card(recipe)


def test_the_python_example_without_the_hub_stops_in_one_line(monkeypatch, tmp_path, fake_accelerator):
    """The README's Python example, run as written on a machine where the Hub cannot be reached: it stops at
    `GSPOTrainer(model="Qwen/Qwen3-0.6B", ...)` with one line naming `model`, the reason and the fix, before any
    retry loop (transformers is never asked), instead of a minute of "Retrying in 1s" and a traceback."""
    import transformers
    from support.helpers import hub_out_of_reach

    from trl_gspo.trainer.model_checks import ModelSourceError

    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    assert 'GSPOTrainer(model="Qwen/Qwen3-0.6B"' in example
    fake_accelerator(True)  # the example asks for bf16 (a GPU); the refusal comes before any device is used
    hub_out_of_reach(monkeypatch, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)

    def asked(*args, **kwargs):
        pytest.fail("transformers asked the Hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    with pytest.raises(ModelSourceError) as raised:
        exec(compile(example, "README.md", "exec"), {"__name__": "readme_example"})
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        "`model`: 'Qwen/Qwen3-0.6B' is neither a local path nor a cached model, and the Hub cannot be reached from "
        "here (127.0.0.1:"), message
    assert "Fix: check the network" in message


def test_every_readme_line_that_needs_the_hub_says_so():
    """A command of the README whose recipe names a model or dataset from the Hub (not `builtin:`), and the Python
    example (a Hub model), say on their line, or the comment line just above, that they need the Hub: offline, the
    rest of the README runs as written."""
    import yaml

    text = (ROOT / "README.md").read_text()
    checked = 0
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            recipe = re.search(r"--config (recipes/\S+\.yaml)", line)
            if not recipe or line.lstrip().startswith("#") or "--dry_run true" in line:
                continue  # a dry run passes offline, listing what it could not check (tests/test_dry_run_offline.py)
            settings = yaml.safe_load((ROOT / recipe.group(1)).read_text())
            names = [settings.get("model_name_or_path") or "", settings.get("dataset_name") or ""]
            if all(name.startswith("builtin:") for name in names):
                continue
            checked += 1
            said = line + (lines[i - 1] if i and lines[i - 1].lstrip().startswith("#") else "")
            assert "needs" in said and "the Hub" in said, f"README: {line.strip()!r} needs the Hub and does not say so"
    assert checked >= 2
    example = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    if re.search(r'model="[\w.-]+/[\w.-]+"', example):
        assert "hub" in example.splitlines()[0].lower(), example.splitlines()[0]
