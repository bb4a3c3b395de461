"""The modules the trainer delegates to, tested without building a trainer: metrics (trl_gspo/metrics.py), the
routing glue (trl_gspo/trainer/routing.py), the rollout state of checkpoints (trl_gspo/checkpoints.py) and TRL's
loss options (trl_gspo/trainer/trl_options.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

from trl_gspo import metrics
from trl_gspo.checkpoints import (load_full_weights, restore_rollout_state, rollout_buffer_path, rollout_layout,
                                  save_rollout_buffer)
from trl_gspo.losses import gspo_loss
from trl_gspo.quickstart.model import build_dense_model, build_model
from trl_gspo.trainer.routing import TrainerRouting, routing_metrics
from trl_gspo.trainer.trl_options import apply_trl_options


# ------------------------------------------------------------------------------------------------ metrics.py
def _loss_output(seed=0, batch=6, length=7):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, length, generator=g)
    old = logps + torch.randn(batch, length, generator=g) * 1e-3
    mask = (torch.arange(length)[None] < torch.randint(0, length + 1, (batch,), generator=g)[:, None]).float()
    advantages = torch.randn(batch, generator=g)
    return gspo_loss(logps, old, advantages, mask), mask, torch.rand(batch, length, generator=g)


def test_metric_sums_over_ranks_equal_the_whole_batch():
    out, mask, entropies = _loss_output()
    whole = metrics.finish(metrics.metric_sums(out, mask, entropies, torch.tensor(0.5)),
                           metrics.per_sequence_values(out, mask))
    halves = [metrics.metric_sums(out.__class__(**{k: (v[rows] if torch.is_tensor(v) and v.dim() else v)
                                                   for k, v in vars(out).items()}),
                                  mask[rows], entropies[rows], torch.tensor(0.5)) for rows in (slice(0, 3), slice(3, 6))]
    totals = {k: halves[0][k] + halves[1][k] for k in halves[0]}
    split = metrics.finish(totals, metrics.per_sequence_values(out, mask))
    for name, value in whole.items():
        assert float(split[name]) == pytest.approx(float(value), abs=1e-6), name
    tokens = mask.sum()
    assert float(whole["entropy"]) == pytest.approx(float((entropies * mask).sum() / tokens))
    nonempty = mask.sum(-1) > 0
    assert float(whole["gspo/ratio_mean"]) == pytest.approx(float(out.log_ratio[nonempty].exp().mean()))
    assert float(whole["policy_loss"]) == pytest.approx(0.5)  # a per-rank mean over the two ranks' 0.5


# --------------------------------------------------------------------------------------------- trainer/routing.py
def _args(**overrides):
    return SimpleNamespace(**{"routing_replay": "old", "routing_replay_offload": False, "temperature": 1.0,
                              "use_vllm": False, **overrides})


def test_glue_is_none_for_dense_models_and_refuses_replay_there(tokenizer):
    dense = build_dense_model(tokenizer)
    assert TrainerRouting.build(dense, _args(routing_replay="none"), old_pass_runs=True) is None
    with pytest.raises(ValueError, match="no MoE router"):
        TrainerRouting.build(dense, _args(), old_pass_runs=True)
    # R3 with tools on TP 2 is no longer refused: the tool turns run in lockstep (trl_gspo/trainer/tool_lockstep.py)
    tool_turns_on_tp2 = _args(routing_replay="sampler", use_vllm=True, vllm_mode="colocate",
                              vllm_tensor_parallel_size=2)
    assert TrainerRouting.build(build_model(tokenizer), tool_turns_on_tp2, True) is not None


def _policy_call(model, ids, mask):
    def call():
        return (model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1),)
    return call


def test_r2_keeps_the_recording_of_the_pass_that_made_old_logps(tokenizer):
    model = build_model(tokenizer, seed=0).eval()
    glue = TrainerRouting.build(model, _args(), old_pass_runs=True)
    ids, mask = torch.randint(3, 20, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad(), glue.round(training=True):
        other = glue.policy_pass(_policy_call(model, ids, mask), ids, mask, 3)
        old = glue.policy_pass(_policy_call(model, ids, mask), ids, mask, 3)
        output = glue.finish_round({"old_per_token_logps": old[0]})
    assert other[0] is not old[0] and tuple(output["routing_indices"].shape[:2]) == (2, 6)
    with pytest.raises(RuntimeError, match="recording covers"):
        glue.replay_for(output, torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="holds no routing"):
        glue.replay_for({}, mask)
    with torch.no_grad(), glue.replay_for(output, mask):
        model(input_ids=ids, attention_mask=mask)
    assert set(routing_metrics(glue.drift_counts(), "old")) == {"routing/drift_mean", "routing/drift_max",
                                                                 "routing/replayed_token_fraction"}
    # Kept on the device per micro-batch, read once when TRL logs: the same values, micro-batch by micro-batch.
    first = glue.drift_counts()
    glue.keep_drift_counts(first)
    glue.keep_drift_counts(first * torch.tensor([0.0, 0.0, 1.0], dtype=first.dtype))  # a micro-batch with no drift
    taken = glue.take_metrics()
    assert taken == list(routing_metrics(first, "old").items()) + list(routing_metrics(
        first * torch.tensor([0.0, 0.0, 1.0], dtype=first.dtype), "old").items())
    assert dict(taken[3:])["routing/drift_max"] == 0.0 and glue.take_metrics() == []  # taken once


def test_r3_lays_the_sampler_routes_over_the_batch_and_replays_them(tokenizer):
    """Around `generate` the glue records routes and log-probs; the old-policy pass replays them; the routes handed
    to the training passes sit on TRL's padded layout and make the forward route as the sampler did."""
    model = build_model(tokenizer, seed=0).eval()
    glue = TrainerRouting.build(model, _args(routing_replay="sampler"), old_pass_runs=True)
    prompts = tokenizer(["1+2=", "13+4=", "7="], return_tensors="pt", padding=True)
    with torch.no_grad(), glue.round(training=True):
        with glue.sampling(lambda: model) as finish:
            sequences = model.generate(**prompts, do_sample=True, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)
            width = prompts["input_ids"].shape[1]
            prompt_ids = [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"])]
            logprobs = finish(prompt_ids, sequences[:, width:].tolist(), None)
        assert "generate" not in vars(model) and [len(row) for row in logprobs] == [4, 4, 4]
        glue.end_sampling(prompt_ids, sequences[:, width:].tolist(), {})
        mask = torch.ones_like(sequences)
        mask[:, :width] = prompts["attention_mask"]
        glue.policy_pass(_policy_call(model, sequences, mask), sequences, mask, 4)
        output = glue.finish_round({"prompt_ids": prompts["input_ids"], "completion_ids": sequences[:, width:]})
        counts, changed = glue.sampler_comparison()
    routes = output["routing_indices"]
    assert routes.dtype == torch.uint8 and bool((routes[:, -1] == 255).all())  # the last token: no route
    assert float(counts[:, 0].sum()) == 0 and not bool(changed.any())  # same dtype on CPU: identical routes
    with torch.no_grad(), glue.replay_for(output, mask):
        model(input_ids=sequences, attention_mask=mask)


# ------------------------------------------------------------------------------------------------ checkpoints.py
def _layout_args(**overrides):
    return SimpleNamespace(**{"world_size": 1, "steps_per_generation": 4, "per_device_train_batch_size": 2,
                              "gradient_accumulation_steps": 1, "process_index": 0, **overrides})


def test_rollout_state_round_trip_and_mid_rollout_warning(tmp_path):
    args = _layout_args()
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    warnings = []
    assert restore_rollout_state(str(tmp_path), args, 1, "cpu", warn=warnings.append) is None
    assert "in the middle of a rollout batch" in warnings[0]
    buffered = [{"routing_indices": torch.zeros(2, 3, 1, 1, dtype=torch.uint8)}]
    save_rollout_buffer(rollout_buffer_path(str(tmp_path), 0), 2, buffered, rollout_layout(args, 1))
    step, restored = restore_rollout_state(str(tmp_path), args, 1, "cpu", warn=warnings.append)
    assert step == 2 and torch.equal(restored[0]["routing_indices"], buffered[0]["routing_indices"])
    assert restore_rollout_state(str(tmp_path), _layout_args(steps_per_generation=8), 1, "cpu",
                                 warn=warnings.append) is None  # another layout would mis-split the batch


def test_full_weights_load_through_from_pretrained_experts_included(tmp_path, tokenizer):
    source = build_model(tokenizer, seed=1)
    source.save_pretrained(tmp_path / "moe")
    target = build_model(tokenizer, seed=2)
    load_full_weights(target, str(tmp_path / "moe"))
    for (name, a), b in zip(source.named_parameters(), target.parameters()):
        assert torch.equal(a, b), name  # the fused experts too


# ------------------------------------------------------------------------------------------------ trl_options.py
def test_trl_options_apply_each_weight_and_the_kl_term():
    g = torch.Generator().manual_seed(0)
    logps, old, ref = (-torch.rand(2, 4, generator=g) for _ in range(3))
    mask, loss = torch.ones(2, 4), torch.rand(2, 4, generator=g)
    trainer = SimpleNamespace(off_policy_mask_threshold=None, top_entropy_quantile=1.0, use_vllm=True,
                              vllm_importance_sampling_correction=True, beta=0.1,
                              args=SimpleNamespace(use_bias_correction_kl=False))
    weights = torch.rand(2, 4, generator=g)
    inputs = {"importance_sampling_ratio": weights, "ref_per_token_logps": ref, "advantages": torch.ones(2)}
    out, entropy_mask, kl = apply_trl_options(trainer, inputs, loss, logps, old, None, mask)
    expected_kl = torch.exp(ref - logps) - (ref - logps) - 1  # k3, Schulman's estimator (TRL's kl)
    assert entropy_mask is None and torch.allclose(kl, expected_kl)
    assert torch.allclose(out, loss * weights + 0.1 * expected_kl)
    trainer.off_policy_mask_threshold, trainer.use_vllm = 0.0, False
    inputs["advantages"] = torch.tensor([-1.0, 1.0])
    inputs["sampling_per_token_logps"] = logps + 1.0  # the negative-advantage sequence drifted: dropped
    out, _, _ = apply_trl_options(trainer, inputs, loss, logps, old, None, mask)
    assert torch.allclose(out[0], 0.1 * expected_kl[0]) and torch.allclose(out[1], loss[1] + 0.1 * expected_kl[1])


def test_reference_pass_is_told_by_the_adapter_state():
    """TRL's PEFT reference pass disables the adapters, or activates the copy it loads as "ref"; R3 leaves that pass
    on natural routing (tests/test_rollout_replay_trainer.py runs it in a trainer)."""
    from types import SimpleNamespace

    from trl_gspo.trainer.routing import _reference_pass

    assert not _reference_pass(None)  # no PEFT: TRL's reference model is a separate model, never a policy pass
    assert not _reference_pass(SimpleNamespace(disable_adapters=False, active_adapters=["default"]))
    assert _reference_pass(SimpleNamespace(disable_adapters=True, active_adapters=["default"]))
    assert _reference_pass(SimpleNamespace(disable_adapters=False, active_adapters=["ref"]))


def test_rollout_func_routes_without_r3_are_dropped_with_a_warning(tokenizer, caplog):
    glue = TrainerRouting.build(build_model(tokenizer), _args(routing_replay="old"), old_pass_runs=True)
    extra = {"routed_experts": [None], "answer": ["3"]}
    with glue.round(training=True):
        glue.end_sampling([[1, 5]], [[6, 2]], extra)
    assert extra == {"answer": ["3"]}  # never reaches the reward functions
    assert "only routing_replay='sampler' replays" in caplog.text
