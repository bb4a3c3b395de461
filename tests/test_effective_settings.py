"""A run's settings once the launcher has applied its own (trl_gspo/launch/effective.py): `accelerate launch` exports
its config's mixed_precision, and transformers trains with it whenever bf16 and fp16 are false. The dry run prints the
settings, and a recipe whose launcher overrides its precision is refused, before launching and inside a launched
process."""

from pathlib import Path

import pytest
from support.helpers import cpu_env  # noqa: F401  (the test environment)

from trl_gspo import AsyncGSPOConfig, GSPOConfig
from trl_gspo.launch.cli import main
from trl_gspo.launch.effective import Launcher, check_agreement, resolve
from trl_gspo.launch.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = ROOT / "recipes" / "accelerate"
ASYNC_FLAGSHIP = ROOT / "recipes" / "qwen3_30b_a3b" / "async" / "gspo.yaml"


def _launcher(name: str, *options: str) -> Launcher:
    return Launcher.from_launch_args(["--config_file", str(ACCELERATE / name), *options])


@pytest.mark.parametrize("name,precision,layout,processes,offload", [
    ("fsdp2.yaml", "bf16", ("FSDP", None), 8, ()),
    ("fsdp2_fp32.yaml", "no", ("FSDP", None), 8, ()),
    ("zero3_offload.yaml", "bf16", ("DEEPSPEED", 3), 8, ("parameters", "optimizer state")),
    ("zero2.yaml", "bf16", ("DEEPSPEED", 2), 8, ()),
    ("cpu_zero3_offload.yaml", "no", ("DEEPSPEED", 3), 2, ("parameters",)),
    ("cpu_ddp.yaml", "no", ("MULTI_GPU", None), 2, ()),
])
def test_each_shipped_launcher_resolves_to_its_settings(name, precision, layout, processes, offload):
    launcher = _launcher(name)
    assert (launcher.mixed_precision, (launcher.distributed_type, launcher.zero_stage), launcher.processes,
            launcher.offload) == (precision, layout, processes, offload)
    assert _launcher(name, "--num_processes", "3", "--mixed_precision", "fp16").processes == 3
    assert _launcher(name, "--mixed_precision", "fp16").mixed_precision == "fp16"  # the command line wins


def test_transformers_takes_the_launchers_precision_when_bf16_is_false(monkeypatch, tmp_path):
    """The fact the rest rests on, for both configs: bf16=False under ACCELERATE_MIXED_PRECISION=bf16 trains bf16."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    for config in (GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
                   AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)):
        assert config.mixed_precision == "bf16"
        settings = resolve(config)  # this process's launcher: the environment
        assert settings.precision == "bf16" and "ACCELERATE_MIXED_PRECISION" in settings.precision_from
        with pytest.raises(RecipeError, match="`accelerate_config`: .* sets bf16: false .*mixed_precision bf16.*Fix:"):
            check_agreement(settings)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    check_agreement(resolve(GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)))


def _dry_run(capsys, monkeypatch, *argv) -> tuple[int, str, str]:
    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda *args, **kwargs: None)
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda *args, **kwargs: None)  # hub items, offline
    code = main([*argv, "--dry_run", "true"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_async_flagship_recipe_trains_in_float32_through_its_own_launcher(capsys, monkeypatch):
    """Its header says float32 on both sides; the launcher it names (fsdp2_fp32.yaml) keeps it so, and the dry
    run says so. Under fsdp2.yaml (mixed_precision bf16) the same recipe is refused, naming the float32 config."""
    code, out, err = _dry_run(capsys, monkeypatch, "--config", str(ASYNC_FLAGSHIP))
    assert code == 0, err
    assert "precision: float32 (bf16 and fp16 false), weights loaded in float32" in out, out
    assert "processes: 8 over 1 machine(s); FSDP" in out
    code, out, err = _dry_run(capsys, monkeypatch, "--config", str(ASYNC_FLAGSHIP),
                              "--accelerate_config", str(ACCELERATE / "fsdp2.yaml"))
    assert code == 2 and "sets bf16: false and dtype float32" in err and "fsdp2_fp32.yaml" in err, err
    code, out, err = _dry_run(capsys, monkeypatch, "--config", str(ASYNC_FLAGSHIP), "--bf16", "true",
                              "--accelerate_config", str(ACCELERATE / "fsdp2.yaml"))
    assert code in (0, 2) and "sets bf16: false" not in err  # bf16 asked for: no contradiction (GPU-only here)


def test_a_launched_process_refuses_a_launcher_that_overrides_the_recipes_precision(capsys, monkeypatch):
    """`accelerate launch --mixed_precision bf16 -m trl_gspo.launch.train --config <a float32 recipe>`: refused in
    the process, before any model or dataset loads."""
    from trl_gspo.launch.train import main as train_main

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr("trl_gspo.launch.train.load_dataset", lambda *a, **k: pytest.fail("loaded the dataset"))
    assert train_main(["--config", str(ROOT / "recipes" / "quickstart.yaml")]) == 2
    assert "mixed_precision bf16" in capsys.readouterr().err


def test_the_dry_run_prints_the_effective_batch(capsys, monkeypatch):
    code, out, err = _dry_run(capsys, monkeypatch, "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                              "--accelerate_config", str(ACCELERATE / "cpu_ddp.yaml"))
    assert code == 0, err
    assert "effective settings (after the launcher):" in out
    assert "precision: float32 on the CPU (use_cpu)" in out and "data parallel (DDP)" in out
    assert "x 2 process(es) x" in out and "completions per optimizer step" in out


def test_bf16_on_the_cpu_is_said(tmp_path, caplog):
    """transformers trains bf16 autocast on the CPU when use_cpu and bf16 meet, without a word: the config warns, and
    the effective settings say where it trains."""
    import logging

    from transformers.utils.logging import warning_once

    warning_once.cache_clear()  # transformers' once-only cache: another test on this worker may have warned already
    with caplog.at_level(logging.WARNING):
        config = GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True)
    assert "use_cpu=True with bf16=True: training runs in bf16 autocast on the CPU" in caplog.text
    assert resolve(config).lines()[0].startswith("precision: bf16 mixed precision on the CPU (use_cpu) (bf16: true)")
