"""CI must run the README's test command, verbatim."""

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
