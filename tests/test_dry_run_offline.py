"""Every shipped recipe dry-runs on a machine without the Hub, as a user runs it: its header's `trl-gspo` command
(the recipe's own launcher options included) plus `--dry_run true`, in this process, with the Hub offline and its
caches empty, no GPU (faked, so this runs on a GPU machine too) and no model loaded. The dry run checks every key it
can, exits 0 and lists, in one block, what only the Hub (or the machine that trains) can tell: the hub model, its
tokenizer where tools need it, the dataset and the size the dataset must have. The hints that tell a user to run the
dry run are run as they read. Recipes are found by globbing recipes/ (launcher configs aside), so a new one is
covered. Each dry run takes a fraction of a second."""

import ast
import importlib.util
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from support.helpers import skip_without_math_verify
from support.recipe_headers import header_commands

import trl_gspo
from trl_gspo.launch.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.relative_to(ROOT).parts)
BLOCK = "not checked on this machine"


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """This machine without the Hub: offline mode, nothing in the Hub or datasets caches (whatever the developer's
    machine holds), run from the repository root (the recipes' dotted tool and reward paths start there); a model
    load or a launch fails the test."""
    import datasets
    import transformers
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))

    def loaded(*args, **kwargs):
        pytest.fail("a model was loaded or a run launched")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setattr("trl_gspo.launch.launching.run_forwarding_signals", loaded)


def user_command(recipe: Path) -> list[str]:
    """The `trl-gspo` arguments the recipe's header tells a user to run (optional `[...]` parts left out), else
    `--config RECIPE`."""
    name = recipe.relative_to(ROOT).as_posix()
    for command in header_commands(recipe):
        words = shlex.split(re.sub(r"\[[^\]]*\]", "", command))
        if "trl-gspo" in words and "vllm-serve" not in words and name in words:
            return words[words.index("trl-gspo") + 1:]
    return ["--config", name]


def expected_unchecked(settings: dict) -> dict[str, str]:
    """What a dry run without the Hub cannot check in a recipe: item -> the name it must show."""
    model, dataset = settings["model_name_or_path"], settings.get("dataset_name") or ""
    items = {}
    if not model.startswith("builtin:"):
        items["model_name_or_path"] = model
        if settings.get("tools") or settings.get("environment_factory"):
            items["tokenizer"] = model
    if dataset and not dataset.startswith("builtin:"):
        items["dataset_name"] = dataset
        if settings.get("trainer", "sync") != "async":
            items["dataset size"] = settings.get("dataset_train_split", "train")
    if (settings.get("routing_replay") == "sampler" and settings.get("use_vllm")
            and settings.get("vllm_mode") == "colocate" and importlib.util.find_spec("vllm") is None):
        items["vLLM"] = "not installed here"
    return items


def unchecked_block(out: str) -> dict[str, str]:
    """The dry run's block of what it could not check: item -> its line."""
    if BLOCK not in out:
        return {}
    lines = out.split(BLOCK, 1)[1].splitlines()[1:]
    items = {}
    for line in lines:
        match = re.match(r"  (model_name_or_path|tokenizer|dataset_name|datasets|dataset size|vLLM) +(.+)", line)
        if not match:
            break
        items[match.group(1)] = match.group(2)
    return items


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.relative_to(ROOT / "recipes").as_posix() for p in RECIPES])
def test_every_recipe_dry_runs_without_the_hub(recipe, no_hub, capsys, fake_accelerator):
    settings = yaml.safe_load(recipe.read_text())
    skip_without_math_verify(settings["reward_funcs"])
    fake_accelerator(False)
    argv = [*user_command(recipe), "--dry_run", "true"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"trl-gspo {shlex.join(argv)} exited {code}:\n{err}"
    assert "recipe is valid" in out.splitlines()[-1], out
    expected, listed = expected_unchecked(settings), unchecked_block(out)
    assert set(listed) == set(expected), f"listed {sorted(listed)}, expected {sorted(expected)}:\n{out}"
    for item, name in expected.items():
        assert name in listed[item], f"{item}: {listed[item]!r} does not name {name!r}"
    if expected:
        assert out.splitlines()[-1].endswith(f"{len(expected)} item(s) above not checked on this machine."), out
        hub = {"model_name_or_path", "dataset_name"} & set(expected)
        assert ("offline mode is on" in out.split(BLOCK, 1)[1].splitlines()[0]) == bool(hub), out


def _dry_run_hints() -> list[str]:
    """Every string of trl_gspo/ (docstrings aside) that tells a user to run `--dry_run true`."""
    found = []
    for path in sorted(Path(trl_gspo.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and ast.get_docstring(node, clean=False) is not None}
        found += [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and "--dry_run true" in node.value and id(node) not in docstrings]
    return found


GPU_RECIPE = "recipes/qwen3_30b_a3b/gspo.yaml"


def test_the_hints_to_dry_run_work_on_a_machine_without_gpu_and_hub(no_hub, capsys, fake_accelerator):
    """The command's usage and its bf16 refusal tell a user to run `--dry_run true`; run as they say on a machine
    without a GPU or the Hub, the dry run passes. A new hint in trl_gspo/ must be added here."""
    fake_accelerator(False)
    hints = _dry_run_hints()
    assert main([]) == 2  # the usage
    usage = capsys.readouterr().err
    command = re.search(r"trl-gspo (RECIPE\.yaml --dry_run true)", usage).group(1)
    assert main(shlex.split(command.replace("RECIPE.yaml", GPU_RECIPE))) == 0
    assert BLOCK in capsys.readouterr().out
    assert main([GPU_RECIPE]) == 2  # the bf16 refusal: a GPU recipe launched here
    refusal = capsys.readouterr().err
    assert "needs a GPU" in refusal, refusal
    flags = re.search(r"`(--dry_run true)` validates it here", refusal).group(1)
    assert main([GPU_RECIPE, *flags.split()]) == 0
    out = capsys.readouterr().out
    assert "no GPU here: validated with use_cpu=true, bf16=false" in out and BLOCK in out
    assert main([GPU_RECIPE, "--dry_run", "false"]) == 2  # not a dry run: refused, not trained on the CPU
    assert "needs a GPU" in capsys.readouterr().err
    others = [hint for hint in hints if hint not in usage and hint not in refusal]
    assert not others, f"a new `--dry_run` hint: run it here as a user reads it:\n{others}"


def test_a_run_refuses_what_a_dry_run_lists(no_hub, capsys, fake_accelerator):
    """Without the Hub, a real run of a hub recipe is refused before launch, as before: only the dry run lists."""
    fake_accelerator(True)  # past the bf16 refusal
    assert main([GPU_RECIPE]) == 2
    err = capsys.readouterr().err
    assert "`dataset_name`: 'trl-lib/DeepMath-103K' is neither a local path nor a dataset" in err, err


def test_what_is_here_is_still_checked(no_hub, tmp_path, capsys, monkeypatch, fake_accelerator):
    """A model given as a local path is not listed; a hub dataset whose metadata is here (faked: cached) is checked
    as before, its size against one rollout batch included; a missing local path is no hub id and stays an error."""
    import datasets

    fake_accelerator(False)
    model = tmp_path / "model"
    model.mkdir()
    argv = [GPU_RECIPE, "--model_name_or_path", str(model), "--dry_run", "true"]
    assert main(argv) == 0
    listed = unchecked_block(capsys.readouterr().out)
    assert set(listed) == {"dataset_name", "dataset size"}, listed

    info = SimpleNamespace(splits={"train": datasets.SplitInfo(name="train", num_examples=10)})
    with monkeypatch.context() as patch:
        patch.setattr(datasets, "load_dataset_builder", lambda *a, **k: SimpleNamespace(info=info))
        assert main(argv) == 2
    assert "the training split has 10 prompts, fewer than one rollout batch" in capsys.readouterr().err
    assert main([GPU_RECIPE, "--dataset_name", "./no/such/prompts.json", "--dry_run", "true"]) == 2
    assert "'./no/such/prompts.json' is neither a local path nor a dataset" in capsys.readouterr().err
