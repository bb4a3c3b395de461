"""The vLLM variants of the flagship recipes (recipes/<model>/vllm_colocate/ and vllm_server/): each layout's trio
differs only where the HF-generation trio does; each recipe differs from its HF-generation recipe one folder up only
in the vLLM keys, the launcher, the batch split over processes and routing replay (R2 -> R3); each layout is
consistent (tensor parallel divides the training processes, the server's GPUs are not the trainer's, the launch
commands in the header parse and name this recipe); the header marks its memory figures as estimates.

Every one of them is dry-run by tests/test_cli.py::test_shipped_recipes_resolve (it globs recipes/, with and without
a GPU); `test_dry_run_with_the_installed_vllm` here dry-runs them against a real vLLM install (`pytest -m vllm`)."""

import re
import shlex
from pathlib import Path

import pytest
import yaml
from support.helpers import skip_without_math_verify
from support.recipe_headers import command_gpus, header_commands

from trl_gspo.launch.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRIOS = {"qwen3_30b_a3b": ("gspo", "grpo", "grpo_routing_replay"), "granite_3b_a800m": ("gspo", "grpo", "grpo_replay")}
LAYOUTS = ("vllm_colocate", "vllm_server")
VARIANTS = [(model, layout, name) for model, trio in TRIOS.items() for layout in LAYOUTS for name in trio]
IDS = [f"{model}/{layout}/{name}" for model, layout, name in VARIANTS]
# What the arms of a trio may differ in (as tests/test_moe_presets.py and test_cli.py's paper comparison).
ARM_KEYS = {"loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "clip_band", "routing_replay",
            "routing_replay_offload", "output_dir"}
# What a vLLM variant may change from its HF-generation recipe.
LAUNCH_KEYS = {"accelerate_config", "num_processes"}
BATCH_KEYS = {"gradient_accumulation_steps", "steps_per_generation"}


def _path(model, layout, name) -> Path:
    return ROOT / "recipes" / model / layout / f"{name}.yaml"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _processes(recipe: dict) -> int:
    return recipe.get("num_processes", 1)


def test_every_variant_is_listed_here():
    """A recipe added to a vLLM layout folder is checked by this file too (and dry-run by test_cli's glob)."""
    found = sorted(p.relative_to(ROOT / "recipes") for p in (ROOT / "recipes").glob("*/vllm_*/*.yaml"))
    assert found == sorted(_path(*variant).relative_to(ROOT / "recipes") for variant in VARIANTS)


@pytest.mark.parametrize("model,layout,name", VARIANTS, ids=IDS)
def test_variant_differs_from_its_hf_recipe_only_in_vllm_launch_batch_and_replay(model, layout, name):
    base, variant = _load(ROOT / "recipes" / model / f"{name}.yaml"), _load(_path(model, layout, name))
    changed = {key for key in set(base) | set(variant) if base.get(key) != variant.get(key)}
    vllm_keys = {key for key in variant if key == "use_vllm" or key.startswith("vllm_")}
    assert changed <= vllm_keys | LAUNCH_KEYS | BATCH_KEYS | {"routing_replay", "output_dir"}, changed
    assert variant["use_vllm"] is True and variant["vllm_mode"] == layout.removeprefix("vllm_")
    assert variant["vllm_importance_sampling_correction"] is True  # TRL's default, kept and written out
    assert "vllm_dtype" not in variant  # the engine serves the bf16 checkpoint in bf16, as the trainer trains
    # The same completions per optimizer step and per rollout round, 4 mini-batches per round (the paper's setup).
    for per_process in ("gradient_accumulation_steps", "steps_per_generation"):
        assert (_processes(variant) * variant["per_device_train_batch_size"] * variant[per_process]
                == _processes(base) * base["per_device_train_batch_size"] * base[per_process])
    assert variant["steps_per_generation"] == 4 * variant["gradient_accumulation_steps"]
    # Replay: GSPO and plain GRPO have none (as the paper); the replay arm is R3 under vLLM where the HF recipe is R2.
    if "routing_replay" in base:
        assert (base["routing_replay"], variant["routing_replay"]) == ("old", "sampler")
    else:
        assert "routing_replay" not in variant
    assert variant["output_dir"] != base["output_dir"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", TRIOS)
def test_layout_trio_differs_only_in_the_arm(model, layout):
    gspo, grpo, replay = (_load(_path(model, layout, name)) for name in TRIOS[model])
    assert (gspo["loss_type"], gspo["epsilon"], gspo["epsilon_high"]) == ("gspo", 3e-4, 4e-4)
    assert (grpo["loss_type"], grpo["importance_sampling_level"], grpo["epsilon"], grpo["epsilon_high"]) == \
        ("grpo", "token", 0.2, 0.27)
    assert replay["routing_replay"] == "sampler"
    shared = (set(gspo) | set(grpo) | set(replay)) - ARM_KEYS
    assert all(gspo.get(k) == grpo.get(k) == replay.get(k) for k in shared), \
        [k for k in shared if not gspo.get(k) == grpo.get(k) == replay.get(k)]


@pytest.mark.parametrize("model", TRIOS)
def test_colocate_layout(model):
    for name in TRIOS[model]:
        recipe = _load(_path(model, "vllm_colocate", name))
        tensor_parallel = recipe["vllm_tensor_parallel_size"]
        assert tensor_parallel == {"qwen3_30b_a3b": 2, "granite_3b_a800m": 1}[model]  # the headers say why
        assert _processes(recipe) % tensor_parallel == 0  # TRL forms its TP groups from the training ranks
        assert recipe["vllm_enable_sleep_mode"] is True and 0 < recipe["vllm_gpu_memory_utilization"] < 1
        assert header_commands(_path(model, "vllm_colocate", name)) == [
            f"trl-gspo --config recipes/{model}/vllm_colocate/{name}.yaml"]


@pytest.mark.parametrize("model", TRIOS)
def test_server_layout_launch_commands(model):
    """Both sides' commands are in the header: the server parses with `trl vllm-serve`'s own parser (the arguments
    `trl-gspo vllm-serve` takes) on GPUs of its own, sized by its parallelism; the trainer names this recipe and as
    many GPUs as processes, and its `accelerate launch` spelling names the recipe's launcher."""
    from trl.scripts.vllm_serve import make_parser

    for name in TRIOS[model]:
        path = _path(model, "vllm_server", name)
        recipe = _load(path)
        server, trainer, accelerate = header_commands(path)
        server_gpus, trainer_gpus = command_gpus(server), command_gpus(trainer)
        assert not set(server_gpus) & set(trainer_gpus)
        prefix = server.split()[1:3]
        assert prefix == ["trl-gspo", "vllm-serve"], server
        (args,) = make_parser().parse_args_and_config(args=shlex.split(server)[3:])
        assert args.model == recipe["model_name_or_path"] and args.port == recipe["vllm_server_port"]
        assert len(server_gpus) == args.tensor_parallel_size * args.data_parallel_size
        assert trainer.split()[1:] == ["trl-gspo", "--config", f"recipes/{model}/vllm_server/{name}.yaml"]
        assert len(trainer_gpus) == _processes(recipe) and command_gpus(accelerate) == trainer_gpus
        words = accelerate.split()
        assert words[1:3] == ["accelerate", "launch"] and words[-4:] == ["-m", "trl_gspo.launch.train", "--config",
                                                                           f"recipes/{model}/vllm_server/{name}.yaml"]
        assert words[words.index("--num_processes") + 1] == str(_processes(recipe))
        if "accelerate_config" in recipe:
            config = (path.parent / recipe["accelerate_config"]).resolve()
            assert words[words.index("--config_file") + 1] == str(config.relative_to(ROOT))
        else:
            assert "--config_file" not in words


@pytest.mark.parametrize("model,layout,name", VARIANTS, ids=IDS)
def test_header_marks_memory_as_estimates(model, layout, name):
    header = "\n".join(line for line in _path(model, layout, name).read_text().splitlines() if line.startswith("#"))
    assert "estimate, not measured" in header and "Not run by us" in header


def test_output_dirs_are_distinct():
    recipes = [p for p in (ROOT / "recipes").rglob("*.yaml") if p.parent.name != "accelerate"]
    outputs = [_load(p).get("output_dir") for p in recipes]
    assert len(set(outputs)) == len(outputs)


@pytest.mark.vllm
@pytest.mark.parametrize("model,layout,name", VARIANTS, ids=IDS)
def test_dry_run_with_the_installed_vllm(model, layout, name, capsys, monkeypatch, fake_accelerator):
    """The dry run's vLLM checks (R3 asks for a vLLM in TRL's range) against the vLLM installed, not a stand-in."""
    pytest.importorskip("vllm")
    path = _path(model, layout, name)
    skip_without_math_verify(_load(path)["reward_funcs"])
    fake_accelerator(True)
    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: None)  # offline: as test_cli
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    assert main(["--config", str(path), "--dry_run", "true"]) == 0
    assert "recipe is valid" in capsys.readouterr().out


def test_server_commands_in_the_docs_come_from_the_recipe_headers():
    """A recipe's header is the one home of its launch commands: a `vllm-serve` command written out in the README or
    a docs page must be, word for word, one of a recipe header's (docs/gpus.md once had TP 4 and another model name
    where the recipe said TP 2 x DP 2)."""
    # a header may label a command with the node it runs on ("on gen:"): the label is not part of the command
    headers = {" ".join(shlex.split(re.sub(r"^on [\w-]+:\s+", "", command)))
               for path in (ROOT / "recipes").rglob("*.yaml") for command in header_commands(path)}
    written = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")
        written += [(page.name, " ".join(shlex.split(match))) for match in
                    re.findall(r"(?:CUDA_VISIBLE_DEVICES=\S+ )?trl-gspo vllm-serve --model [^`\n]+", text)]
    assert [(name, command) for name, command in written if command not in headers] == []
