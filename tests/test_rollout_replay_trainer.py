"""Rollout routing replay (R3, `routing_replay="sampler"`) inside GSPOTrainer, with TRL's own HF generation: the
experts each token used while it was sampled are replayed in the old-policy pass and in every training pass."""

import shutil

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset

import trl_gspo.routing.rollout as rollout
from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.model import build_dense_model, build_model

pytestmark = pytest.mark.slow


def _trainer(tokenizer, output_dir, peft_config=None, model=None, **config):
    config = {"steps_per_generation": 4, "max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
              "routing_replay": "sampler", **config}
    return GSPOTrainer(model or build_model(tokenizer), digit_reward, args=tiny_config(output_dir, **config),
                       train_dataset=toy_dataset(), processing_class=tokenizer, peft_config=peft_config)


def _logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def _rounds(trainer):
    return [h for h in trainer.state.log_history if "routing/sampler_agreement" in h]


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token", "grpo"])
def test_r3_trains_and_logs_the_sampler_comparison(loss_type, tmp_path, tokenizer):
    """On CPU in float32, HF generate with a KV cache and one full forward route every token alike (measured),
    so the sampler agrees with the trainer's old-policy pass on every route and the
    mismatch metrics sit at their no-mismatch values; after updates, replay forces the sampler's routes."""
    trainer = _trainer(tokenizer, tmp_path, loss_type=loss_type)
    trainer.train()
    logs = _logs(trainer)
    rounds = _rounds(trainer)  # the sampler comparison is logged once per generation round
    assert len(logs) == 4 and len(rounds) == 1
    assert all(h["routing/sampler_agreement"] == 1.0 for h in rounds)
    assert all(abs(h["sampling/token_ratio_mean"] - 1) < 1e-4 and h["sampling/k3_kl"] < 1e-8 for h in rounds)
    assert all(h["sampling/missing_logp_fraction"] == 0.0 for h in rounds)
    assert max(h["routing/replayed_token_fraction"] for h in logs) > 0  # off-policy mini-batches drifted


def test_r3_equals_r2_when_sampler_and_trainer_route_alike_and_differs_when_they_do_not(tmp_path, tokenizer,
                                                                                      monkeypatch):
    r2 = _trainer(tokenizer, tmp_path / "r2", loss_type="grpo", routing_replay="old")
    r2.train()
    r3 = _trainer(tokenizer, tmp_path / "r3", loss_type="grpo")
    r3.train()
    # equal up to float rounding: R3's old-policy pass recomputes the gate weights of the replayed experts
    assert [h["loss"] for h in _logs(r3)] == pytest.approx([h["loss"] for h in _logs(r2)], rel=1e-4, abs=1e-6)

    # A sampler that routed every prompt token elsewhere (expert e -> e + 1): R3 must replay those routes.
    real = rollout.GenerationRecording.per_sample

    def shifted(self, *args, **kwargs):
        sampled = real(self, *args, **kwargs)
        experts = self.replay.num_experts
        sampled.prompt_routes = [(r.long() + 1).remainder(experts).to(r.dtype) for r in sampled.prompt_routes]
        return sampled

    monkeypatch.setattr(rollout.GenerationRecording, "per_sample", shifted)
    # routing_replay_min_agreement=0: these routes are wrong on purpose, the check that refuses them is off here
    moved = _trainer(tokenizer, tmp_path / "moved", loss_type="grpo", routing_replay_min_agreement=0.0)
    moved.train()
    assert max(h["routing/sampler_agreement"] for h in _rounds(moved)) < 0.9
    assert any(abs(a["loss"] - b["loss"]) > 1e-6 for a, b in zip(_logs(moved), _logs(r2)))


def test_r3_with_lora_on_the_experts(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = _trainer(tokenizer, tmp_path, peft_config=lora, loss_type="gspo", learning_rate=5e-2)
    trainer.train()
    assert all(h["routing/sampler_agreement"] == 1.0 for h in _rounds(trainer))
    assert max(h["routing/replayed_token_fraction"] for h in _logs(trainer)) > 0


def test_r3_leaves_the_peft_reference_pass_on_natural_routing(tmp_path, tokenizer):
    """With PEFT and beta > 0, TRL's reference pass is the policy model with its adapters disabled. It routes
    naturally under R3, as a separate reference model does (and as under R2): no replay is open while it runs, while
    the old-policy pass and the training passes replay the sampler's routes."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = _trainer(tokenizer, tmp_path, peft_config=lora, loss_type="gspo", beta=0.1, learning_rate=5e-2)
    adapter_layer = next(m for m in trainer.model.modules() if isinstance(m, BaseTunerLayer))
    replays, passes = [], []  # (adapters disabled?) at each replay opened / each policy-model log-prob pass
    original_replay = trainer._routing.replay.replay
    trainer._routing.replay.replay = lambda *a, **k: replays.append(adapter_layer.disable_adapters) or original_replay(
        *a, **k)
    original_pass = trainer._routing.policy_pass
    trainer._routing.policy_pass = lambda *a, **k: passes.append(adapter_layer.disable_adapters) or original_pass(
        *a, **k)
    trainer.train()
    assert True in passes and False in passes  # TRL ran reference passes (adapters off) and old-policy passes
    assert replays and not any(replays)  # every replay opened with the adapters on: none in a reference pass
    assert {"kl", "routing/sampler_agreement"} <= set().union(*trainer.state.log_history)


def test_r3_resume_in_the_middle_of_a_rollout_batch_is_exact(tmp_path, tokenizer):
    """The sampler routes ride in the buffered rollout batch, so a resume mid-rollout replays the same routes."""
    full = _trainer(tokenizer, tmp_path / "full", loss_type="grpo", save_strategy="steps", save_steps=1)
    full.train()
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = _trainer(tokenizer, resumed_dir, loss_type="grpo", save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint="latest")
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_r3_refusals_name_the_fix(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="`routing_replay`.*no MoE router"):
        _trainer(tokenizer, tmp_path, model=build_dense_model(tokenizer))
    with pytest.raises(ValueError, match="continuous batching.*Fix"):
        tiny_config(tmp_path, routing_replay="sampler", use_transformers_continuous_batching=True)
    def rollout_without_routes(prompts, trainer):  # a custom agent loop that returns no routes
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[5, 6, 2]] * len(ids), "logprobs": [[-1.0] * 3] * len(ids)}

    trainer = GSPOTrainer(build_model(tokenizer), digit_reward, args=tiny_config(tmp_path, routing_replay="sampler"),
                          train_dataset=toy_dataset(), processing_class=tokenizer, rollout_func=rollout_without_routes)
    with pytest.raises(ValueError, match="rollout_func needs the routes.*'routed_experts'.*Fix"):
        trainer.train()  # refused right after the rollout, before any policy pass


def test_r3_replays_on_policy_too(tmp_path, tokenizer):
    """Fully on-policy (no old-policy pass), R3 still has something to do: the training pass scores the sampler's
    experts. The routes are laid out from the batch itself; no sampler comparison is logged (no trainer pass to
    compare before training)."""
    trainer = _trainer(tokenizer, tmp_path, loss_type="grpo", steps_per_generation=1, max_steps=2)
    trainer.train()
    logs = _logs(trainer)
    assert len(logs) == 2 and all("routing/replayed_token_fraction" in h for h in logs)
    assert _rounds(trainer) == []


def _garble(monkeypatch, garble):
    """Make HF generate's recorded routes pass through `garble(routes, num_experts)` (prompt and completion)."""
    real = rollout.GenerationRecording.per_sample

    def garbled(self, *args, **kwargs):
        sampled = real(self, *args, **kwargs)
        experts = self.replay.num_experts
        sampled.prompt_routes = [garble(r, experts) for r in sampled.prompt_routes]
        sampled.completion_routes = [garble(r, experts) for r in sampled.completion_routes]
        return sampled

    monkeypatch.setattr(rollout.GenerationRecording, "per_sample", garbled)


def _keep_sentinel(routes, garbled):
    sentinel = routes == rollout.no_route(routes.dtype)
    return torch.where(sentinel, routes, garbled.to(routes.dtype))


@pytest.mark.parametrize("garble, refusal", [
    # what a capture that silently failed returns (vLLM's CPU kernel under torch.compile did, docs/sampling.md)
    (lambda r, e: _keep_sentinel(r, torch.zeros_like(r)), "same expert twice"),
    (lambda r, e: _keep_sentinel(r, torch.full_like(r, e)), "outside 0..3"),
    # off by one position: each token gets its predecessor's route (the first keeps its own)
    (lambda r, e: torch.cat([r[:1], r[:-1]]) if len(r) > 1 else r, "routing_replay_min_agreement"),
    # routes of another model: valid top-k sets, but other experts (e -> e + 1, e + 2)
    (lambda r, e: _keep_sentinel(r, torch.stack([(r[..., 0].long() + 1) % e, (r[..., 0].long() + 2) % e], -1)),
     "routing_replay_min_agreement"),
])
def test_r3_refuses_routes_that_cannot_be_the_samplers(garble, refusal, tmp_path, tokenizer, monkeypatch):
    _garble(monkeypatch, garble)
    trainer = _trainer(tokenizer, tmp_path, loss_type="gspo", max_steps=1)
    with pytest.raises(rollout.RoutingReplayError, match=refusal) as refused:
        trainer.train()
    print(refused.value)  # its agreement, for docs/results.md#r3-on-cpu-route-checks-and-layouts (`-rP` shows it)
    assert trainer.state.global_step == 0  # refused before any update
