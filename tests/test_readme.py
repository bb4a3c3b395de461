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
