"""What the README promises: CI runs its test command verbatim, and every install line installs from the checkout."""

import re
from pathlib import Path

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


def _header(recipe: Path) -> str:
    """A recipe's comment header, joined into one line."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def test_the_docs_memory_table_restates_the_recipe_headers():
    """A recipe's memory figures have one home, its header (marked estimate or measured there): every "N GB" (or GiB)
    in the memory column of docs/recipes.md's recipe table is written in the header of each recipe its row names, so a
    header changed without the table (or the reverse) fails here (the table once said 20-30 GB where the header said
    10-20)."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `recipes/")]
    checked = 0
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        first = re.match(r"`(recipes/[^`]+)`", cells[0]).group(1)
        recipes = sorted((ROOT / first).glob("*.yaml")) if first.endswith("/") else [ROOT / first]
        figures = re.findall(r"(\d+(?:\.\d+)?(?:-\d+)?) GB|(\d+(?:\.\d+)?) GiB", cells[-1])
        figures = [f"{gb} GB" if gb else f"{gib} GiB" for gb, gib in figures]
        for recipe in recipes:
            header = _header(recipe)
            missing = [figure for figure in figures if figure not in header]
            assert missing == [], f"{recipe.relative_to(ROOT)}: {missing} not in its header"
            checked += bool(figures)
    assert checked >= 10  # the rows with figures: the flagship, LoRA, vLLM layouts, Granite, Qwen3-0.6B
