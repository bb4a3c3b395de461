"""`accelerate_config: fsdp1 | fsdp2` (TRL's names). accelerate has no FSDP on CPU: measured with two CPU processes,
an FSDP2 config trains as plain data parallelism (accelerate picks MULTI_CPU, `Trainer.is_fsdp_enabled` is false) and
an FSDP1 config with `fsdp_sync_module_states: true` (as TRL's fsdp1.yaml) fails after the model is loaded. So FSDP
is refused before launch on a machine without an accelerator, and again by every launched process that did not get
FSDP."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.helpers import cpu_env

import trl_gspo.launch.checks
import trl_gspo.launch.launching
from trl_gspo.config import GSPOConfig
from trl_gspo.launch.cli import main, parse_recipe
from trl_gspo.launch.recipe import RecipeError, launcher_type
from trl_gspo.launch.train import check_distributed_setup

ROOT = Path(__file__).resolve().parents[1]
RECIPE = """
model_name_or_path: builtin:tiny-qwen3
dataset_name: builtin:addition
reward_funcs: [digit_match_reward]
output_dir: {out}
use_cpu: {use_cpu}
bf16: false
report_to: none
"""


def _recipe(tmp_path, use_cpu="true", extra=""):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(RECIPE.format(out=tmp_path / "out", use_cpu=use_cpu)) + extra)
    return str(path)


@pytest.fixture
def launched(monkeypatch):
    """The command `trl-gspo` would run, instead of running it."""
    commands = []
    monkeypatch.setattr(trl_gspo.launch.launching, "run_forwarding_signals",
                        lambda cmd, **kw: commands.append(cmd) or 0)
    return commands


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_trl_fsdp_names_resolve_to_an_fsdp_launch(tmp_path, name):
    *_, launch, _ = parse_recipe(["--config", _recipe(tmp_path, extra=f"accelerate_config: {name}\n")])
    assert launch[0] == "--config_file" and launch[1].endswith(f"{name}.yaml")
    assert launcher_type(launch) == "FSDP"
    assert launcher_type(["--use_fsdp"]) == "FSDP" and launcher_type([]) == "NO"


@pytest.mark.parametrize("launcher", [["--accelerate_config", "fsdp1"], ["--accelerate_config", "fsdp2"],
                                      ["--use_fsdp", "--fsdp_version", "2"]])
def test_fsdp_without_an_accelerator_is_refused_before_launch(tmp_path, capsys, monkeypatch, launched, launcher):
    monkeypatch.setattr(trl_gspo.launch.checks, "has_accelerator", lambda: False)
    assert main(["--config", _recipe(tmp_path, use_cpu="false"), *launcher]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-gspo: error: `accelerate_config`: FSDP needs a GPU") and "cpu_ddp.yaml" in err
    assert launched == [] and not (tmp_path / "out").exists()
    # A dry run (which validates GPU recipes on any machine) passes and says that launching here would be refused.
    # (in the recipe's precision: float32, where TRL's fsdp configs train bf16, a refusal of its own)
    assert main(["--config", _recipe(tmp_path, use_cpu="false"), *launcher, "--mixed_precision", "no",
                 "--dry_run", "true"]) == 0
    assert "launching here would be refused" in capsys.readouterr().out


def test_fsdp_with_an_accelerator_is_launched_unless_the_recipe_asks_for_cpu(tmp_path, capsys, monkeypatch, launched):
    monkeypatch.setattr(trl_gspo.launch.checks, "has_accelerator", lambda: True)
    assert main(["--config", _recipe(tmp_path, use_cpu="true"), "--accelerate_config", "fsdp2"]) == 2
    assert "the recipe sets `use_cpu: true`" in capsys.readouterr().err
    # TRL's fsdp2 config trains in bf16 mixed precision, and this recipe in float32: refused, then launched with the
    # launcher's precision set to the recipe's on the command line
    assert main(["--config", _recipe(tmp_path, use_cpu="false"), "--accelerate_config", "fsdp2"]) == 2
    assert "sets bf16: false" in capsys.readouterr().err
    assert main(["--config", _recipe(tmp_path, use_cpu="false"), "--accelerate_config", "fsdp2",
                 "--mixed_precision", "no"]) == 0
    (command,) = launched
    assert command[command.index("--config_file") + 1].endswith("fsdp2.yaml") and "trl_gspo.launch.train" in command


def test_the_launched_process_refuses_fsdp_it_did_not_get(monkeypatch):
    """`accelerate launch -m trl_gspo.launch.train` by hand: the FSDP flag is set, but accelerate runs on CPU."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match="FSDP needs a GPU.*runs on cpu"):
        check_distributed_setup(GSPOConfig(output_dir="unused", use_cpu=True, report_to="none"))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    check_distributed_setup(GSPOConfig(output_dir="unused", use_cpu=True, report_to="none"))



def test_the_launched_process_accepts_fsdp_on_an_accelerator(monkeypatch):
    """On a GPU, accelerate's process state says MULTI_GPU (its later AcceleratorState makes that FSDP): the check
    must let that through. Before this was fixed it refused every FSDP launch, GPU included (found running FSDP2 on
    one CPU process with tests/scripts/fsdp_cpu.py, which makes accelerate report MULTI_GPU; then measured on an
    H200: docs/results.md)."""
    from accelerate.utils import DistributedType

    class GpuState:  # what PartialState reports in a process launched with FSDP on a GPU machine
        distributed_type = DistributedType.MULTI_GPU
        device = "cuda:0"

    monkeypatch.setattr("accelerate.PartialState", lambda cpu=False: GpuState())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    check_distributed_setup(GSPOConfig(output_dir="unused", use_cpu=False, bf16=False, report_to="none"))
    GpuState.distributed_type = DistributedType.MULTI_CPU
    with pytest.raises(RecipeError, match="FSDP needs a GPU"):
        check_distributed_setup(GSPOConfig(output_dir="unused", use_cpu=False, bf16=False, report_to="none"))

CPU_FSDP2 = """
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_version: 2
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_is_refused_by_each(tmp_path):
    """Two CPU processes launched by hand with an FSDP2 config: accelerate picks MULTI_CPU (no FSDP), and each
    process stops before loading a model instead of training without FSDP. About 15 s on 2 cores."""
    config = tmp_path / "cpu_fsdp2.yaml"
    config.write_text(CPU_FSDP2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
         str(port), "-m", "trl_gspo.launch.train", "--config", _recipe(tmp_path), "--max_steps", "1"],
        capture_output=True, text=True, timeout=300, env=cpu_env(OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    assert result.stderr.count("trl-gspo: error: `accelerate_config`: FSDP needs a GPU") == 2
    assert "accelerate chose MULTI_CPU" in result.stderr
    assert not (tmp_path / "out").exists()


def test_ddp_backend_is_launched_with_several_processes_and_refused_with_one(tmp_path, capsys, launched):
    """`ddp_backend` is for the launched processes' group: the `trl-gspo` process itself must not set up a device with
    it (accelerate fails there with "Default process group has not been initialized"), and a launch of one process
    cannot use it either (measured: `accelerate launch --num_processes 1` fails the same way)."""
    recipe = _recipe(tmp_path, extra="ddp_backend: gloo\n")
    assert main(["--config", recipe, "--accelerate_config", str(ROOT / "recipes/accelerate/cpu_ddp.yaml")]) == 0
    assert len(launched) == 1 and "--module" in launched[0]
    assert recipe in launched[0]  # the launched processes read the recipe as written, ddp_backend included
    _, training, *_ = parse_recipe(["--config", recipe], before_launch=True)
    assert training.ddp_backend == "gloo"  # kept for the launch, only left out of the device set-up
    assert main(["--config", recipe]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-gspo: error: `ddp_backend: gloo`") and "Fix: remove ddp_backend" in err
    assert len(launched) == 1 and not (tmp_path / "out").exists()


def test_third_party_warnings_a_run_cannot_act_on_are_filtered_by_their_text(capsys):
    """trl_gspo/launch/quiet.py: transformers' `gradient_checkpointing` deprecation (TRL's configs always set it) and
    the lines of `accelerate launch`'s defaults warning that change nothing are dropped; any other warning, and any
    other line of accelerate's, is kept."""
    import logging
    import warnings

    from trl_gspo.launch import quiet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the suite ignores FutureWarning (pyproject.toml)
        quiet.install()
        quiet.install()  # idempotent
        for message, category in [("`gradient_checkpointing` is deprecated and will be removed in v6. Use "
                                   "`activation_checkpointing` instead.", FutureWarning),
                                  ("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                                   "`is_activation_checkpointing` instead.", FutureWarning),
                                  ("`other_option` is deprecated and will be removed in v6.", FutureWarning),
                                  ("`gradient_checkpointing` is deprecated and will be removed in v6. Use "
                                   "`activation_checkpointing` instead.", UserWarning)]:
            warnings.warn(message, category)
    assert [str(w.message)[:16] for w in caught] == ["`other_option` i", "`gradient_checkp"]  # other text or category

    def launch_warning(*lines):
        footer = ("To avoid this warning pass in values for each of the problematic parameters or run `accelerate "
                  "config`.")
        record = logging.LogRecord(quiet.ACCELERATE_LAUNCH_LOGGER, logging.WARNING, __file__, 1,
                                   "\n".join([quiet.ACCELERATE_DEFAULTS_HEADER, *lines, footer]), None, None)
        return record.getMessage() if logging.getLogger(quiet.ACCELERATE_LAUNCH_LOGGER).filter(record) else None

    harmless = ["\t`--num_processes` was set to a value of `0`", "\t`--num_machines` was set to a value of `1`",
                "\t`--mixed_precision` was set to a value of `'no'`",
                "\t`--dynamo_backend` was set to a value of `'no'`"]
    assert launch_warning(*harmless) is None
    several = "\t\tMore than one GPU was found, enabling multi-GPU training."
    kept = launch_warning("\t`--num_processes` was set to a value of `4`", several, *harmless[1:])
    assert kept.splitlines()[1:3] == ["\t`--num_processes` was set to a value of `4`", several]
    assert len(kept.splitlines()) == 4 and kept.splitlines()[-1].startswith("To avoid this warning")
