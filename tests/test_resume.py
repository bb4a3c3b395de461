"""Resume: partial checkpoints are skipped, `true`/`latest` resolve, and resuming anywhere (at a rollout boundary or
in the middle of a rollout batch) trains exactly as the uninterrupted run."""

import json
import logging
import os
import shutil

import pytest
import torch
from support.helpers import cpu_env, digit_reward, tiny_config, toy_dataset

from trl_gspo import GSPOTrainer
from trl_gspo.checkpoints import (
    IncompleteCheckpointError,
    checkpoint_problem,
    latest_complete_checkpoint,
    resolve_resume_from_checkpoint,
)
from trl_gspo.quickstart.model import build_model

# In the pytest process, and one run script at a time: CI runs these beside the launching tests
pytestmark = pytest.mark.one_process

# 4 mini-batches per rollout batch (GSPOConfig's paper preset with gradient_accumulation_steps=1): steps 1-4 use
# rollout batch 1, steps 5-8 rollout batch 2. Off-policy, so the buffered old log-probs matter.
MAX_STEPS = 6
BOUNDARY, MID_ROLLOUT = 4, 2


def _trainer(output_dir, tokenizer, **overrides):
    config = tiny_config(output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=4, save_strategy="steps",
                         save_steps=1, **overrides)
    return GSPOTrainer(build_model(tokenizer, seed=0), digit_reward, args=config, train_dataset=toy_dataset(),
                       processing_class=tokenizer)


def _weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _max_diff(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tokenizer):
    """A full run that saves a checkpoint after every step; its checkpoints are the resume points."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = _trainer(out, tokenizer)
    trainer.train()
    return out, _weights(trainer)


def _resume_into(tmp_path, source, step, tokenizer, drop_buffer=False, resume="latest"):
    """Copy checkpoint-`step` of `source` into a fresh output_dir and resume there to MAX_STEPS."""
    out = tmp_path / f"resume_{step}"
    shutil.copytree(source / f"checkpoint-{step}", out / f"checkpoint-{step}")
    if drop_buffer:
        os.remove(out / f"checkpoint-{step}" / "rollout_buffer_0.pt")
    trainer = _trainer(out, tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("step", [BOUNDARY, MID_ROLLOUT])
def test_resume_is_exact_at_a_rollout_boundary_and_mid_rollout(tmp_path, tokenizer, uninterrupted, step):
    source, reference = uninterrupted
    trainer = _resume_into(tmp_path, source, step, tokenizer)
    assert trainer.state.global_step == MAX_STEPS
    assert _max_diff(_weights(trainer), reference) == 0.0


@pytest.mark.slow
def test_mid_rollout_resume_without_the_saved_rollout_batch_diverges(tmp_path, tokenizer, uninterrupted, caplog):
    """The control: the previous behaviour (a new rollout batch on resume) does change the trajectory, with a
    warning saying so; so the exact equality above is the saved rollout batch's doing."""
    source, reference = uninterrupted
    with caplog.at_level(logging.WARNING, logger="trl_gspo.trainer"):
        trainer = _resume_into(tmp_path, source, MID_ROLLOUT, tokenizer, drop_buffer=True)
    difference = _max_diff(_weights(trainer), reference)
    print(f"max weight difference, mid-rollout resume without the saved rollout batch: {difference:.4g}")
    assert difference > 1e-4
    assert "in the middle of a rollout batch" in caplog.text


def _make_partial(checkpoint):
    """What a SIGKILL during a checkpoint write leaves: an empty optimizer.pt and no trainer_state.json."""
    (checkpoint / "optimizer.pt").write_bytes(b"")
    (checkpoint / "trainer_state.json").unlink()


@pytest.mark.slow
def test_resume_latest_skips_a_partial_checkpoint(tmp_path, tokenizer, uninterrupted, caplog):
    source, reference = uninterrupted
    out = tmp_path / "run"
    for step in (MAX_STEPS - 2, MAX_STEPS - 1):
        shutil.copytree(source / f"checkpoint-{step}", out / f"checkpoint-{step}")
    partial = out / f"checkpoint-{MAX_STEPS - 1}"
    _make_partial(partial)
    trainer = _trainer(out, tokenizer)
    with caplog.at_level(logging.WARNING, logger="trl_gspo.trainer"):
        trainer.train(resume_from_checkpoint=True)
    assert f"skipping incomplete checkpoint {partial}: no trainer_state.json" in caplog.text
    assert trainer.state.global_step == MAX_STEPS
    assert _max_diff(_weights(trainer), reference) == 0.0  # resumed from checkpoint-4, the newest complete one
    # Training re-saved the partial checkpoint's step: it is complete now.
    assert checkpoint_problem(str(partial)) is None


def test_complete_and_partial_checkpoints(tmp_path):
    def checkpoint(step, files):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        for name, content in files.items():
            (path / name).write_text(content)
        return path

    good = {"trainer_state.json": json.dumps({"global_step": 1}), "model.safetensors": "w", "optimizer.pt": "o"}
    first = checkpoint(1, good)
    checkpoint(10, {**good, "optimizer.pt": ""})  # a write cut short
    checkpoint(3, {k: v for k, v in good.items() if k != "trainer_state.json"})
    checkpoint(4, {**good, "trainer_state.json": '{"global_st'})
    checkpoint(5, {k: v for k, v in good.items() if k != "model.safetensors"})
    checkpoint(6, {**good, "model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-1.safetensors"}})})
    (tmp_path / "checkpoint-7").write_text("a file, not a checkpoint")
    latest, skipped = latest_complete_checkpoint(str(tmp_path))
    assert latest == str(first)
    assert [(os.path.basename(p), why) for p, why in skipped] == [
        ("checkpoint-10", "optimizer.pt is empty (0 bytes)"),
        ("checkpoint-6", "weight shards missing: model-1.safetensors"),
        ("checkpoint-5", "no model weights (none of model.safetensors, model.safetensors.index.json, "
                         "pytorch_model.bin, pytorch_model.bin.index.json, adapter_model.safetensors, "
                         "adapter_model.bin)"),
        ("checkpoint-4", "trainer_state.json is not valid JSON (the checkpoint write did not finish)"),
        ("checkpoint-3", "no trainer_state.json (the checkpoint write did not finish)"),
    ]


@pytest.mark.parametrize("value", [True, "true", "True", "latest", "LATEST"])
def test_true_and_latest_resolve_to_the_newest_complete_checkpoint(tmp_path, value):
    for step in (2, 12):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        (path / "model.safetensors").write_text("w")
        (path / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-12" / "optimizer.pt").write_text("")
    warnings = []
    assert resolve_resume_from_checkpoint(value, str(tmp_path), warn=warnings.append) == str(tmp_path / "checkpoint-2")
    assert warnings == [f"resume_from_checkpoint: skipping incomplete checkpoint {tmp_path / 'checkpoint-12'}: "
                        "optimizer.pt is empty (0 bytes)."]


@pytest.mark.parametrize("value", [None, False, "false", ""])
def test_unset_resume_starts_fresh(tmp_path, value):
    assert resolve_resume_from_checkpoint(value, str(tmp_path)) is None


def test_resume_errors_name_the_fix(tmp_path):
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint-N directory.*found none.*Fix:"):
        resolve_resume_from_checkpoint("latest", str(tmp_path))
    partial = tmp_path / "checkpoint-3"
    partial.mkdir()
    (partial / "model.safetensors").write_text("w")
    with pytest.raises(IncompleteCheckpointError, match="found only incomplete ones"):
        resolve_resume_from_checkpoint(True, str(tmp_path))
    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint-3 is incomplete: no trainer_state.json.*"
                                                        r"Fix: resume from `latest`"):
        resolve_resume_from_checkpoint(str(partial), str(tmp_path))
    with pytest.raises(IncompleteCheckpointError, match="does not exist"):
        resolve_resume_from_checkpoint(str(tmp_path / "checkpoint-9"), str(tmp_path))


def test_rollout_buffer_round_trip_and_layout_check(tmp_path):
    from trl_gspo.checkpoints import load_rollout_buffer, save_rollout_buffer

    buffer = [{"prompt_ids": torch.arange(6).view(2, 3), "advantages": torch.randn(2), "old_per_token_logps": None}]
    layout = dict(world_size=1, steps_per_generation=4)
    save_rollout_buffer(str(tmp_path / "b.pt"), 7, buffer, layout)
    step, restored = load_rollout_buffer(str(tmp_path / "b.pt"), layout, device="cpu")
    assert step == 7 and restored[0]["old_per_token_logps"] is None
    assert all(torch.equal(restored[0][k], buffer[0][k]) for k in ("prompt_ids", "advantages"))
    reason = load_rollout_buffer(str(tmp_path / "b.pt"), dict(layout, world_size=2), device="cpu")
    assert isinstance(reason, str) and "world_size" in reason


def test_cli_resolves_resume_before_launch(tmp_path, capsys):
    """`--resume_from_checkpoint latest` (and `true` in YAML) is checked by `trl-gspo` before any process starts."""
    from trl_gspo.launch.cli import main

    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: builtin:tiny-qwen3\ndataset_name: builtin:addition\n"
                      f"reward_funcs: [digit_match_reward]\noutput_dir: {out}\nuse_cpu: true\nbf16: false\n"
                      "resume_from_checkpoint: true\n")
    assert main(["--config", str(recipe), "--dry_run", "true"]) == 2
    assert "`resume_from_checkpoint`: no complete checkpoint-N directory" in capsys.readouterr().err
    for step in (3, 5):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "model.safetensors").write_text("w")
    (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert main(["--config", str(recipe), "--resume_from_checkpoint", "latest", "--dry_run", "true"]) == 0
    err = capsys.readouterr().err
    assert f"warning: resume_from_checkpoint: skipping incomplete checkpoint {out / 'checkpoint-5'}" in err
    assert f"resuming from {out / 'checkpoint-3'}" in err
    assert main(["--config", str(recipe), "--resume_from_checkpoint", str(out / "checkpoint-5"), "--dry_run", "true"]) \
        == 2
    assert "checkpoint-5 is incomplete" in capsys.readouterr().err


KILLED_DURING_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import test_resume
from support.helpers import *  # noqa
from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.tokenizer import build_tokenizer

KILL_AT = {kill_at}
real_save = GSPOTrainer._save_optimizer_and_scheduler

def save_then_die(self, output_dir):
    if self.state.global_step == KILL_AT:  # the model is written; die while the optimizer state is being written
        open(os.path.join(output_dir, "optimizer.pt"), "wb").close()
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(self, output_dir)

GSPOTrainer._save_optimizer_and_scheduler = save_then_die
test_resume._trainer({out!r}, build_tokenizer()).train()
"""


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_latest(tmp_path, tokenizer, uninterrupted, caplog):
    """A real SIGKILL in the middle of writing checkpoint-5; `resume_from_checkpoint="latest"` then skips it, resumes
    from checkpoint-4 and ends with the uninterrupted run's weights."""
    import subprocess
    import sys

    _, reference = uninterrupted
    out = tmp_path / "run"
    tests = os.path.dirname(os.path.abspath(__file__))
    script = KILLED_DURING_SAVE.format(tests=tests, kill_at=MAX_STEPS - 1, out=str(out))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=cpu_env())
    assert result.returncode == -9, result.stderr[-3000:]
    partial = out / f"checkpoint-{MAX_STEPS - 1}"
    assert (partial / "model.safetensors").is_file() and (partial / "optimizer.pt").stat().st_size == 0
    assert checkpoint_problem(str(partial)) is not None
    trainer = _trainer(out, tokenizer)
    with caplog.at_level(logging.WARNING, logger="trl_gspo.trainer"):
        trainer.train(resume_from_checkpoint="latest")
    assert f"skipping incomplete checkpoint {partial}" in caplog.text
    assert _max_diff(_weights(trainer), reference) == 0.0
