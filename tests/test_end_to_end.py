"""Tiny end-to-end runs: dense and MoE, LoRA, beta > 0, gradient accumulation, checkpoint save and resume."""

import json
import math

import pytest
from support.helpers import digit_reward, tiny_config, toy_dataset

from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.model import build_dense_model, build_model

pytestmark = pytest.mark.slow


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _run(model, tokenizer, output_dir, **config):
    trainer = GSPOTrainer(model, digit_reward, args=tiny_config(output_dir, **config),
                          train_dataset=toy_dataset(), processing_class=tokenizer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("builder", [build_dense_model, build_model], ids=["dense", "moe"])
@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
def test_tiny_runs_with_gradient_accumulation(tmp_path, tokenizer, builder, loss_type):
    trainer = _run(builder(tokenizer), tokenizer, tmp_path, loss_type=loss_type, gradient_accumulation_steps=2,
                   per_device_train_batch_size=4, max_steps=3)
    assert trainer.args.steps_per_generation == 8
    losses = _losses(trainer)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert any(h.get("clip_ratio/region_mean", 0) > 0 for h in trainer.state.log_history)


def test_lora_trains_only_adapters(tmp_path, tokenizer):
    from peft import LoraConfig

    trainer = GSPOTrainer(build_model(tokenizer), digit_reward,
                          args=tiny_config(tmp_path, max_steps=2),
                          train_dataset=toy_dataset(), processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("experts" in n for n in trainable)  # adapters reached the fused 3-D expert weights
    changed = {n for n, p in trainer.model.named_parameters() if not (p.detach() == before[n]).all()}
    assert changed and changed <= trainable


def test_beta_uses_reference_model(tmp_path, tokenizer):
    path = tmp_path / "base"
    build_dense_model(tokenizer).save_pretrained(path)  # TRL reloads the reference from the model's path
    tokenizer.save_pretrained(path)
    trainer = GSPOTrainer(str(path), digit_reward, args=tiny_config(tmp_path / "o", beta=0.1, max_steps=3),
                          train_dataset=toy_dataset(), processing_class=tokenizer)
    assert trainer.ref_model is not None
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(kls) == 3 and kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 0


def test_checkpoint_resume_reproduces_uninterrupted_run(tmp_path, tokenizer):
    """Save at a rollout boundary (step 4 of steps_per_generation=4), resume, and compare steps 5-8."""
    common = dict(max_steps=8, save_strategy="steps", save_steps=4, per_device_train_batch_size=4)
    full = _run(build_model(tokenizer), tokenizer, tmp_path / "full", **common)
    resumed = GSPOTrainer(build_model(tokenizer), digit_reward, args=tiny_config(tmp_path / "full2", **common),
                          train_dataset=toy_dataset(), processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    full_losses, resumed_losses = _losses(full), _losses(resumed)
    assert len(full_losses) == len(resumed_losses) == 8  # the resumed history starts with the checkpoint's 4
    assert resumed_losses[4:] == pytest.approx(full_losses[4:], rel=1e-5, abs=1e-7)
    state = json.loads((tmp_path / "full" / "checkpoint-8" / "trainer_state.json").read_text())
    assert any("gspo/ratio_mean" in h for h in state["log_history"])
