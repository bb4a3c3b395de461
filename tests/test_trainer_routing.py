"""Routing replay inside GSPOTrainer: recording in TRL's old-policy pass, replay in the training pass, drift."""

import logging

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset
from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.model import build_dense_model, build_model

pytestmark = pytest.mark.slow


def _run(tokenizer, output_dir, peft_config=None, **config):
    config = {"steps_per_generation": 4, "max_steps": 4, "per_device_train_batch_size": 4,
              "learning_rate": 1e-2, **config}
    trainer = GSPOTrainer(build_model(tokenizer), digit_reward, args=tiny_config(output_dir, **config),
                          train_dataset=toy_dataset(), processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def test_grpo_with_routing_replay_logs_drift(tmp_path, tokenizer):
    """The paper's baseline: token-level GRPO + routing replay, off-policy, on a tiny Qwen3-MoE."""
    trainer, logs = _run(tokenizer, tmp_path, loss_type="grpo", routing_replay="old")
    assert trainer._routing is not None and len(trainer._routing.routers) == 2
    drift = [h["routing/drift_mean"] for h in logs]
    replayed = [h["routing/replayed_token_fraction"] for h in logs]
    assert drift[0] == 0.0  # first mini-batch after generation: nothing has been updated yet
    assert max(drift) > 0 and max(replayed) > 0
    assert all(h["routing/drift_max"] >= h["routing/drift_mean"] for h in logs)
    # The tiny Qwen3-MoE config has router_aux_loss_coef 0.001, so TRL adds the balancing loss under replay too.
    assert trainer.aux_loss_enabled and all(h["aux_loss"] > 0 for h in logs)


def test_drift_is_measured_without_replay(tmp_path, tokenizer):
    _, logs = _run(tokenizer, tmp_path, loss_type="gspo")
    assert max(h["routing/drift_mean"] for h in logs) > 0
    assert all("routing/replayed_token_fraction" not in h for h in logs)


def test_replay_under_gradient_checkpointing_matches_without(tmp_path, tokenizer):
    """Checkpointed layers re-run their routers in backward; replay must still be active then."""
    _, plain = _run(tokenizer, tmp_path / "a", loss_type="grpo", routing_replay="old", gradient_checkpointing=False)
    _, checkpointed = _run(tokenizer, tmp_path / "b", loss_type="grpo", routing_replay="old",
                           gradient_checkpointing=True)
    assert max(h["routing/replayed_token_fraction"] for h in plain) > 0
    for a, b in zip(plain, checkpointed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)


def test_replay_changes_training_versus_natural_routing(tmp_path, tokenizer):
    _, natural = _run(tokenizer, tmp_path / "n", loss_type="grpo")
    _, replayed = _run(tokenizer, tmp_path / "r", loss_type="grpo", routing_replay="old")
    assert natural[0]["loss"] == pytest.approx(replayed[0]["loss"])  # same first (on-policy) mini-batch
    assert any(abs(a["loss"] - b["loss"]) > 1e-6 for a, b in zip(natural[1:], replayed[1:]))


def test_routing_replay_refuses_dense_models(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="`routing_replay`.*no MoE router"):
        GSPOTrainer(build_dense_model(tokenizer), digit_reward,
                    args=tiny_config(tmp_path, routing_replay="old"), train_dataset=toy_dataset(),
                    processing_class=tokenizer)


def test_bad_routing_replay_value(tmp_path):
    with pytest.raises(ValueError, match="`routing_replay`"):
        tiny_config(tmp_path, routing_replay="always")


def test_on_policy_replay_warns(tmp_path, tokenizer, caplog):
    from transformers.utils.logging import warning_once

    warning_once.cache_clear()  # transformers' once-only cache: another test may have warned already
    with caplog.at_level(logging.WARNING, logger="trl_gspo.trainer"):
        GSPOTrainer(build_model(tokenizer), digit_reward,
                    args=tiny_config(tmp_path, loss_type="grpo", routing_replay="old", steps_per_generation=1),
                    train_dataset=toy_dataset(), processing_class=tokenizer)
    assert "nothing to record" in caplog.text


def test_replay_with_lora_on_attention_and_experts_and_a_reference_pass(tmp_path, tokenizer):
    """PEFT: LoRA on attention and on the fused experts (`target_parameters`), beta > 0 so TRL's reference pass
    runs with the adapters disabled; that pass keeps natural routing and must not consume the recording."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer, logs = _run(tokenizer, tmp_path, peft_config=lora, loss_type="grpo", routing_replay="old",
                         beta=0.1, learning_rate=5e-2)
    assert len(trainer._routing.routers) == 2
    assert {"routing/drift_mean", "routing/replayed_token_fraction", "kl"} <= logs[-1].keys()
    assert max(h["routing/replayed_token_fraction"] for h in logs) > 0  # adapters moved routing; replay forced it
    assert all(h["kl"] >= 0 for h in logs) and max(h["kl"] for h in logs) > 0
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 4 and all(p.abs().sum() > 0 for p in lora_b)  # q, v, gate_up, down x 2 layers


# --------------------------------------------------------------------------- fail loud instead of guessing
def _replay_trainer(cls, tokenizer, output_dir, **config):
    config = {"loss_type": "grpo", "routing_replay": "old", "steps_per_generation": 2, "max_steps": 1,
              "per_device_train_batch_size": 4, **config}
    return cls(build_model(tokenizer), digit_reward, args=tiny_config(output_dir, **config),
               train_dataset=toy_dataset(), processing_class=tokenizer)


class _DropsRecording(GSPOTrainer):
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        del output["routing_indices"]
        return output


class _TruncatesRecording(GSPOTrainer):
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output["routing_indices"] = output["routing_indices"][:, 1:]
        return output


def test_replay_refuses_a_micro_batch_without_recording(tmp_path, tokenizer):
    trainer = _replay_trainer(_DropsRecording, tokenizer, tmp_path)
    with pytest.raises(RuntimeError, match="holds no routing recorded.*Fix:"):
        trainer.train()


def test_replay_refuses_a_recording_that_does_not_match_the_tokens(tmp_path, tokenizer):
    trainer = _replay_trainer(_TruncatesRecording, tokenizer, tmp_path)
    with pytest.raises(RuntimeError, match="recording covers.*Fix:"):
        trainer.train()


class _ExtraPolicyPassFirst(GSPOTrainer):
    """A generation round where another pass of the policy model runs before TRL's old-policy pass (as a TRL
    change could introduce): the first-call guess would replay the wrong recording."""

    def _generate(self, prompts):
        result = super()._generate(prompts)
        ids = torch.randint(4, 40, (3, 5))
        with torch.no_grad():
            self._get_per_token_logps_and_entropies(self.model, ids, torch.ones_like(ids), 2)
        return result


def test_old_policy_pass_is_identified_by_its_output_not_its_order(tmp_path, tokenizer):
    trainer = _replay_trainer(_ExtraPolicyPassFirst, tokenizer, tmp_path, max_steps=2, steps_per_generation=4,
                              gradient_accumulation_steps=2)
    trainer.train()
    replayed = [h["routing/replayed_token_fraction"] for h in trainer.state.log_history if "loss" in h]
    assert len(replayed) == 2 and max(replayed) > 0


class _StoresACopy(GSPOTrainer):
    """TRL storing a copy of the old-policy log-probs instead of the pass's own tensor."""

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        return logps.clone(), entropies, aux


def test_unidentifiable_old_policy_pass_raises(tmp_path, tokenizer):
    trainer = _replay_trainer(_StoresACopy, tokenizer, tmp_path)
    with pytest.raises(RuntimeError, match="old-policy routing cannot be identified.*Fix:"):
        trainer.train()


class _FailsInTheLoss(GSPOTrainer):
    def _compute_loss(self, model, inputs):
        raise ValueError("the forward failed")


def test_a_failed_forward_is_not_hidden_by_closing_the_replay(tmp_path, tokenizer):
    """Closing a replay that never saw a forward raises its own error; the ExitStack passes the forward's exception
    to it, so the user sees the real one, and the replay's hooks are removed."""
    trainer = _replay_trainer(_FailsInTheLoss, tokenizer, tmp_path)
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in trainer.model.modules())
    with pytest.raises(ValueError, match="the forward failed"):
        trainer.train()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in trainer.model.modules()) == hooks_before
