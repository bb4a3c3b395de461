"""docs/own_task.md stays correct: its Python example runs as written (offline, the built-in tiny model), and its YAML
example, laid out as the page shows (a reward module, a directory of JSON lines, the recipe), passes a dry run."""

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "own_task.md").read_text()


def _block(language: str) -> str:
    [block] = re.findall(rf"```{language}\n(.*?)```", PAGE, flags=re.S)
    return block


def test_the_python_example_trains(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.chdir(tmp_path)  # the example writes to outputs/ where it runs
    scope = {}
    exec(compile(_block("python"), "docs/own_task.md", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 8
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards)  # the reward ran on the page's data
    # the reward reads the dataset's extra column: a right answer scores 1, a wrong one 0
    assert scope["exact_sum"](["3 ", "4"], answer=["3", "3"]) == [1.0, 0.0]


def test_the_yaml_example_passes_a_dry_run(tmp_path, monkeypatch, capsys):
    from trl_gspo.launch.cli import main

    task = tmp_path / "my_task"
    (task / "data").mkdir(parents=True)
    (task / "__init__.py").write_text("")
    reward = re.search(r"def exact_sum\(.*?\n\n", _block("python"), flags=re.S).group(0)
    (task / "rewards.py").write_text(reward)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (task / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = _block("yaml")
    assert yaml.safe_load(recipe)["dataset_name"] == "my_task/data"
    (task / "recipe.yaml").write_text(recipe)
    monkeypatch.chdir(tmp_path)  # "from the directory above my_task/"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_task", raising=False)
    assert main(["--config", "my_task/recipe.yaml", "--dry_run", "true"]) == 0
    assert "recipe is valid" in capsys.readouterr().out


def test_the_page_is_in_the_docs_navigation_second_after_the_quickstart():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = [next(iter(entry.values())) for entry in nav]
    assert pages[:3] == ["index.md", "quickstart.md", "own_task.md"]
