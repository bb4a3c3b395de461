"""The `trl-gspo` command: recipe parsing, dry runs and one-screen errors."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from support.helpers import BASE_RECIPE as BASE
from support.helpers import cpu_env, skip_without_math_verify

from trl_gspo.launch.cli import main, parse_recipe

ROOT = Path(__file__).resolve().parents[1]


def _recipe(tmp_path, body):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(body))
    return str(path)




def test_recipe_resolves_gspo_fields_and_overrides(tmp_path):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + "loss_type: gspo_token\nnum_processes: 1\n")
    script, training, model, _, launch, _ = parse_recipe(["--config", path, "--epsilon", "5e-4"])
    assert training.loss_type == "gspo_token"
    assert training.epsilon == 5e-4 and training.epsilon_high == 4e-4  # CLI override, then paper preset
    assert model.model_name_or_path == "builtin:tiny-qwen3-moe"
    assert script.reward_funcs == ["digit_match_reward"]
    assert launch == ["--num_processes", "1"]


def test_accelerate_config_name_resolves_to_trl_file(tmp_path):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + "accelerate_config: zero2\n")
    *_, launch, _ = parse_recipe(["--config", path])
    assert launch[0] == "--config_file" and launch[1].endswith("zero2.yaml")


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("epsilonn: 0.1\n", "unknown key `epsilonn`"),
        ("accelerate_config: no_such_config\n", "accelerate_config"),
        ("loss_type: gsop\n", "loss_type"),
        ("importance_sampling_level: token\n", "importance_sampling_level"),
    ],
)
def test_bad_recipes_print_one_clear_error(tmp_path, capsys, extra, needle):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + extra)
    assert main(["--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-gspo: error:") and needle in err
    assert "Traceback" not in err


def test_missing_recipe_file(capsys):
    assert main(["--config", "/no/such/recipe.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_wrong_type_is_reported_by_name(tmp_path):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + "max_steps: many\n")
    result = subprocess.run([sys.executable, "-m", "trl_gspo.launch.cli", "--config", path], capture_output=True,
                            text=True, env=cpu_env())
    assert result.returncode == 2
    assert "max_steps" in result.stderr and "many" in result.stderr


def test_unknown_command_line_flag(tmp_path, capsys):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o"))
    assert main(["--config", path, "--learnig_rate", "1e-3"]) == 2
    assert "unknown key `learnig_rate`" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["recipe", "command line"])
@pytest.mark.parametrize("typo,meant", [("num_generation", "num_generations"), ("learnig_rate", "learning_rate"),
                                        ("num_proceses", "num_processes"),  # an `accelerate launch` option
                                        ("accelerate_confg", "accelerate_config")])
def test_an_unknown_key_names_the_nearest_valid_ones(tmp_path, capsys, where, typo, meant):
    """A misspelt key in the recipe or on the command line is refused with the valid names nearest to it; on the
    command line never taken as an abbreviation (argparse would call `--num_generation` ambiguous, and take
    `--learning_rat` for learning_rate)."""
    extra, argv = (f"{typo}: 4\n", []) if where == "recipe" else ("", [f"--{typo}", "4"])
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + extra)
    assert main(["--config", path, *argv, "--dry_run", "true"]) == 2
    err = capsys.readouterr().err
    assert f"unknown key `{typo}` in the {where} (did you mean `{meant}`?" in err, err
    assert f"Fix: rename it to `{meant}`" in err and err.count("\n") == 1
    if where == "recipe":  # the recipe's file and the key's line
        line = Path(path).read_text().splitlines().index(extra.strip()) + 1
        assert err.startswith(f"trl-gspo: error: {path}:{line}: unknown key"), err


@pytest.mark.parametrize("key,typo,meant", [
    ("loss_type", "gpso", "gspo"), ("importance_sampling_level", "sequense", "sequence"),
    ("routing_replay", "sampelr", "sampler"), ("old_logps", "trainr", "trainer"), ("vllm_dtype", "float23", "float32"),
    ("trainer", "asyn", "async"), ("lr_scheduler_type", "cosin", "cosine"),  # transformers' choices, via argparse
    ("model_name_or_path", "builtin:tiny-qwen3-mo", "builtin:tiny-qwen3-moe"),
    ("dataset_name", "builtin:adition", "builtin:addition"),
    ("reward_funcs", "[digit_match_rewrd]", "digit_match_reward"),
    ("environment_factory", "CalculatorEn", "CalculatorEnv"), ("tools", "[ad]", "add")])
def test_an_unknown_value_names_the_nearest_valid_one(tmp_path, capsys, key, typo, meant):
    """Every enumerated key, in a recipe: a misspelt value is refused in one line with the valid value nearest to it,
    as a misspelt key is."""
    keys = dict(line.split(": ", 1) for line in BASE.format(out=tmp_path / "o").strip().splitlines())
    if key in ("tools", "environment_factory"):  # the tool task
        keys.update(model_name_or_path="builtin:tiny-qwen3-moe-tools", dataset_name="builtin:tool_addition",
                    reward_funcs="[tool_answer_reward]")
    path = _recipe(tmp_path, "".join(f"{name}: {value}\n" for name, value in {**keys, key: typo}.items()))
    assert main(["--config", path, "--dry_run", "true"]) == 2
    err = capsys.readouterr().err
    assert f"(did you mean {meant!r}?)" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("options,meant", [(dict(loss_type="gspo_tokn"), "gspo_token"),
                                           (dict(routing_replay="sampelr"), "sampler"),
                                           (dict(staleness_correction="trunc"), "truncate")])
def test_the_asynchronous_config_names_the_nearest_valid_value(tmp_path, options, meant):
    from trl_gspo import AsyncGSPOConfig

    with pytest.raises(ValueError, match=rf"\(did you mean {meant!r}\?\)\. Fix:"):
        AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, **options)


def test_a_key_prefix_is_no_abbreviation_and_a_far_key_gets_no_guess(tmp_path, capsys):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o"))
    assert main(["--config", path, "--learning_rat", "1e-3", "--dry_run", "true"]) == 2  # not learning_rate
    assert "unknown key `learning_rat` in the command line (did you mean `learning_rate`?" in capsys.readouterr().err
    assert main(["--config", path, "--zzz", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key `zzz`" in err and "did you mean" not in err and "trl-gspo --help" in err


def test_dry_run_prints_resolved_config(tmp_path, capsys):
    path = _recipe(tmp_path, BASE.format(out=tmp_path / "o"))
    assert main(["--config", path, "--dry_run", "true"]) == 0
    out = capsys.readouterr().out
    assert "epsilon=0.0003" in out and "steps_per_generation=4" in out and "recipe is valid" in out
    # Which band will run, and every field the config's presets filled (the recipe leaves them unset)
    assert "clip band:      one ratio per sequence, clipped to [0.9997, 1.0004] (clip_band='fixed'" in out
    filled = next(line for line in out.splitlines() if line.startswith("filled in:"))
    for field in ("beta=0.0", "epsilon=0.0003", "epsilon_high=0.0004", "importance_sampling_level=sequence",
                  "steps_per_generation=4"):
        assert field in filled, filled
    assert main(["--config", path, "--dry_run", "true", "--clip_band", "adaptive"]) == 0
    assert "clip_band='adaptive'" in capsys.readouterr().out


RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
@pytest.mark.parametrize("recipe", RECIPES, ids=[str(p.relative_to(ROOT / "recipes")) for p in RECIPES])
def test_shipped_recipes_resolve(recipe, gpu, capsys, monkeypatch, fake_accelerator):
    """Every recipe resolves into a valid GSPOConfig / ModelConfig and launch options without downloading anything,
    on a machine with a GPU and on one without (the probe is faked: both branches run anywhere). The hub dataset is
    not cached on the (offline) test machine, where a dry run rightly refuses it (tests/test_recipe_checks.py);
    here the dataset probe only records what it was asked."""
    settings = yaml.safe_load(recipe.read_text())
    skip_without_math_verify(settings["reward_funcs"])
    fake_accelerator(gpu)
    if settings.get("use_vllm") and importlib.util.find_spec("vllm") is None:
        # The default test environment has no vLLM (CI installs it for `pytest -m vllm`, where
        # tests/test_recipes_vllm.py dry-runs these recipes against it); R3 in colocate mode asks for it in a dry run,
        # as the dataset probe asks for the hub, so here the version check answers as for an installed vLLM.
        from trl_gspo.sampling import engine

        monkeypatch.setattr(engine, "installed_vllm_version", lambda: engine.VLLM_RANGE[0])
    probed = []
    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: probed.append((key, path)))
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    assert main(["--config", str(recipe), "--dry_run", "true"]) == 0
    dataset = yaml.safe_load(recipe.read_text())["dataset_name"]
    assert probed == ([] if dataset.startswith("builtin:") else [("dataset_name", dataset)])
    out = capsys.readouterr().out
    assert "recipe is valid" in out
    # Without a GPU a bf16 recipe is validated as CPU/fp32 and says so; with one it is validated as written.
    asks_for_gpu = settings.get("bf16", True) and not settings.get("use_cpu", False)
    assert ("no GPU here" in out) == (asks_for_gpu and not gpu)
    name = settings.get("accelerate_config")
    if name:  # the recipe's own accelerate config file, found relative to the recipe
        assert Path(out.split("--config_file")[1].split()[0]).resolve() == (recipe.parent / name).resolve()


def test_paper_comparison_recipes_differ_only_where_the_paper_does():
    folder = ROOT / "recipes" / "qwen3_30b_a3b"
    gspo, grpo, replay = (yaml.safe_load((folder / f"{n}.yaml").read_text())
                          for n in ("gspo", "grpo", "grpo_routing_replay"))
    assert (gspo["loss_type"], gspo["epsilon"], gspo["epsilon_high"]) == ("gspo", 3e-4, 4e-4)
    assert gspo["clip_band"] == "fixed"  # the paper's band (the default, made explicit)
    assert (grpo["loss_type"], grpo["epsilon"], grpo["epsilon_high"]) == ("grpo", 0.2, 0.27)
    assert replay["routing_replay"] == "old" and "routing_replay" not in grpo
    for recipe in (gspo, grpo, replay):  # 4 mini-batches per rollout batch, no KL
        assert recipe["steps_per_generation"] == 4 * recipe["gradient_accumulation_steps"] and recipe["beta"] == 0
    shared = {k for k in gspo if k not in {"loss_type", "epsilon", "epsilon_high", "clip_band", "output_dir",
                                            "importance_sampling_level"}}
    assert all(gspo[k] == grpo[k] == replay[k] for k in shared)


@pytest.mark.parametrize("rewards,needle", [("[no_such_reward]", "unknown reward 'no_such_reward'"),
                                            ("[accuracy_reward]", 'pip install -e ".[math]" in the trl-gspo checkout')])
def test_reward_problems_fail_before_launch(tmp_path, capsys, monkeypatch, rewards, needle):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else
                        find_spec(name, *a))
    recipe = BASE.format(out=tmp_path / "o").replace("[digit_match_reward]", rewards)
    assert main(["--config", _recipe(tmp_path, recipe), "--dry_run", "true"]) == 2
    assert needle in capsys.readouterr().err


@pytest.fixture
def launches(monkeypatch):
    """The commands `trl-gspo` would run (the cold-start process, the accelerate launch) with their environments,
    instead of running them; each "succeeds"."""
    commands = []
    monkeypatch.setattr("trl_gspo.launch.launching.run_forwarding_signals",
                        lambda cmd, env=None, **kw: commands.append((cmd, env)) or 0)
    return commands


@pytest.mark.parametrize("launcher", [["--accelerate_config", str(ROOT / "recipes/accelerate/cpu_zero3.yaml")],
                                      ["--use_deepspeed"]])
def test_builtin_cold_start_under_deepspeed_runs_in_one_process_before_the_launch(tmp_path, capsys, launches,
                                                                                  launcher):
    """DeepSpeed processes cannot run the SFT (one DeepSpeed Accelerator per process): `trl-gspo` runs it first in
    one plain process (`python -m trl_gspo.launch.train cold-start`, no accelerate), then launches the DeepSpeed
    processes from its output with sft_steps 0, and tells their end-of-run report so."""
    recipe = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + "sft_steps: 5\n")
    assert main(["--config", recipe, *launcher, "--dry_run", "true"]) == 0 and launches == []
    assert "runs in one process before the DeepSpeed launch" in capsys.readouterr().out
    assert main(["--config", recipe, *launcher]) == 0
    (cold_start, _), (launch, env) = launches
    assert cold_start[1:4] == ["-m", "trl_gspo.launch.train", "cold-start"]  # a plain process: no accelerate launch
    assert cold_start[4:] == ["--config", recipe, *launcher]
    initial = str(tmp_path / "o" / "initial_model")
    assert launch[-4:] == ["--model_name_or_path", initial, "--sft_steps", "0"]  # last: they win over the recipe
    # accelerate's launch, run through trl_gspo.launch.launching (its harmless defaults warning filtered: quiet.py)
    assert launch[1:3] == ["-m", "trl_gspo.launch.launching"] and "trl_gspo.launch.train" in launch
    assert float(env["TRL_GSPO_COLD_START_SECONDS"]) >= 0 and float(env["TRL_GSPO_COMMAND_STARTED"]) > 0
    assert env["TRL_GSPO_COLD_START_BEFORE_LAUNCH"] == f"cold start: ran before the DeepSpeed launch, in one process " \
                                                      f"(sft_steps 5): {initial}"
    out = capsys.readouterr().out
    assert f"[trl-gspo] cold start ran before the DeepSpeed launch: {initial}" in out
    assert "the DeepSpeed processes start from it with sft_steps 0: " in out and initial in out


def test_builtin_cold_start_before_deepspeed_is_reused_when_its_inputs_match(tmp_path, capsys, launches):
    """A second run with the same output_dir (a resume) finds the cold start's mark with the same inputs and
    launches without running it again; other inputs (here sft_steps) run it again."""
    from types import SimpleNamespace

    from trl_gspo.quickstart import reuse

    out = tmp_path / "o"
    recipe = _recipe(tmp_path, BASE.format(out=out) + "sft_steps: 5\nseed: 3\n")
    path = out / "initial_model"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    inputs = reuse.cold_start_inputs("tiny-qwen3-moe", SimpleNamespace(sft_steps=5, sft_learning_rate=3e-3,
                                                                       sft_correct_fraction=0.5), 3, 1)
    reuse.write_mark(str(path), inputs)  # what the one-process cold start leaves
    deepspeed = ["--accelerate_config", str(ROOT / "recipes/accelerate/cpu_zero3.yaml")]
    assert main(["--config", recipe, *deepspeed]) == 0
    ((launch, env),) = launches  # no cold-start process
    assert launch[-4:] == ["--model_name_or_path", str(path), "--sft_steps", "0"]
    assert env["TRL_GSPO_COLD_START_BEFORE_LAUNCH"].startswith("cold start: reused before the DeepSpeed launch")
    assert "[trl-gspo] cold start reused before the DeepSpeed launch" in capsys.readouterr().out
    launches.clear()
    assert main(["--config", recipe, *deepspeed, "--sft_steps", "6"]) == 0
    assert [cmd[3] for cmd, _ in launches] == ["cold-start", "--config_file"]


def test_builtin_cold_start_on_several_deepspeed_nodes_is_refused_before_launch(tmp_path, capsys, launches):
    """Every node runs the command: each would cold-start into the shared output_dir."""
    recipe = _recipe(tmp_path, BASE.format(out=tmp_path / "o") + "sft_steps: 5\n")
    assert main(["--config", recipe, "--accelerate_config", str(ROOT / "recipes/accelerate/cpu_zero3.yaml"),
                 "--num_machines", "2", "--num_processes", "2", "--machine_rank", "0", "--main_process_ip",
                 "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert "`sft_steps` with DeepSpeed on several nodes" in err and "python -m trl_gspo.launch.train cold-start" in err
    assert launches == [] and not (tmp_path / "o").exists()


def test_sft_steps_with_a_model_that_is_not_builtin_is_refused_under_deepspeed(tmp_path, capsys, launches):
    recipe = _recipe(tmp_path, BASE.format(out=tmp_path / "o").replace("builtin:tiny-qwen3-moe", str(tmp_path))
                     + "sft_steps: 5\n")
    assert main(["--config", recipe, "--accelerate_config", str(ROOT / "recipes/accelerate/cpu_zero3.yaml")]) == 2
    err = capsys.readouterr().err
    assert "`sft_steps` 5 cold-starts a `builtin:` model" in err and "Fix: set sft_steps: 0" in err
    assert launches == []


@pytest.mark.parametrize("flag, launch", [("ACCELERATE_USE_DEEPSPEED", "a DeepSpeed"),
                                          ("ACCELERATE_USE_FSDP", "an FSDP")])
def test_a_process_launched_by_hand_refuses_the_cold_start(tmp_path, monkeypatch, flag, launch):
    """`accelerate launch` with DeepSpeed or FSDP and `-m trl_gspo.launch.train` by hand: the process cannot run the
    SFT, and says which command can."""
    from trl import ModelConfig

    from trl_gspo import GSPOConfig
    from trl_gspo.launch.recipe import GSPOScriptArguments, RecipeError
    from trl_gspo.launch.train import _prepare_builtin_model

    monkeypatch.setenv(flag, "true")
    script = GSPOScriptArguments(dataset_name="builtin:addition", reward_funcs=["digit_match_reward"], sft_steps=5)
    training = GSPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(RecipeError, match=f"cannot run inside {launch} launch.*launch with `trl-gspo`"):
        _prepare_builtin_model(script, training, ModelConfig(model_name_or_path="builtin:tiny-qwen3"))
    assert not (tmp_path / "o").exists()


def test_builtin_cold_start_runs_in_one_process_before_an_fsdp_launch(tmp_path, capsys, launches, monkeypatch):
    """An FSDP process's SFT trainer would shard the model it must save (measured with FSDP2 on one CPU process,
    tests/scripts/fsdp_cpu.py: `save_pretrained` failed on the sharded storage): as before a DeepSpeed launch, the
    cold start runs first in one plain process, and the FSDP processes start from its output with sft_steps 0."""
    monkeypatch.setattr("trl_gspo.launch.checks.has_accelerator", lambda: True)
    recipe = _recipe(tmp_path, BASE.format(out=tmp_path / "o").replace("use_cpu: true", "use_cpu: false")
                     + "sft_steps: 5\n")
    fsdp2 = ["--accelerate_config", str(ROOT / "recipes/accelerate/fsdp2_fp32.yaml"), "--num_processes", "1"]
    assert main(["--config", recipe, *fsdp2]) == 0
    (cold_start, _), (launch, env) = launches
    assert cold_start[1:4] == ["-m", "trl_gspo.launch.train", "cold-start"]
    initial = str(tmp_path / "o" / "initial_model")
    assert launch[-4:] == ["--model_name_or_path", initial, "--sft_steps", "0"]
    assert env["TRL_GSPO_COLD_START_BEFORE_LAUNCH"].startswith("cold start: ran before the FSDP launch")
    assert "the FSDP processes start from it with sft_steps 0" in capsys.readouterr().out


def test_reward_names_come_from_trls_registry():
    """`reward_funcs` accepts every reward function `trl.rewards` exports (a TRL release that adds one makes it
    available), `get_soft_overlong_punishment` built as `trl grpo` builds it, and the built-in task's rewards."""
    import inspect

    import trl.rewards

    from trl_gspo.launch.rewards import reward_registry

    registry = reward_registry()
    exported = {name for name in trl.rewards.__all__ if inspect.isfunction(getattr(trl.rewards, name))}
    assert {name for name in exported if not name.startswith("get_")} <= set(registry)
    assert {"accuracy_reward", "think_format_reward", "get_soft_overlong_punishment", "digit_match_reward",
            "exact_match_reward"} <= set(registry)
    assert registry["think_format_reward"] is trl.rewards.think_format_reward
    overlong = registry["get_soft_overlong_punishment"]  # max_completion_len=1280, soft_punish_cache=256
    assert overlong([[0] * 1000, [0] * 1280]) == [0.0, pytest.approx(-1.0)]


def test_help_lists_every_option(capsys):
    """`trl-gspo --help` (which the errors above point to) prints every option's help: argparse %-formats each help
    string, so a bare percent sign in one would turn the help into an error."""
    from transformers import HfArgumentParser

    from trl_gspo.async_trainer.config import AsyncGSPOConfig

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    assert "--clip_band_target" in out and "--loss_type" in out and "--routing_replay" in out
    assert "--max_staleness" in HfArgumentParser(AsyncGSPOConfig).format_help()
