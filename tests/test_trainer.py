"""GSPOTrainer against TRL's own GRPOTrainer, TRL features under gspo types, and per-token advantages."""

import logging

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset
from trl import GRPOConfig, GRPOTrainer

from trl_gspo import GSPOTrainer
from trl_gspo.config import TRL_LOSS_TYPES
from trl_gspo.losses import gspo_loss, gspo_token_loss
from trl_gspo.quickstart.model import build_dense_model, build_model


def _train(trainer_cls, model, config, tokenizer):
    trainer = trainer_cls(model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer)
    trainer.train()
    losses = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("gradient_accumulation_steps", [1, 2])
def test_gspo_matches_trl_sequence_level_grpo(tmp_path, tokenizer, gradient_accumulation_steps):
    """The drift guard: same model, data and seed, off-policy; GSPO must equal TRL's sequence-level 'grpo'."""
    common = dict(steps_per_generation=4 * gradient_accumulation_steps, max_steps=5,
                  gradient_accumulation_steps=gradient_accumulation_steps, per_device_train_batch_size=4)
    ours_cfg = tiny_config(tmp_path / "ours", loss_type="gspo", clip_band="fixed", **common)  # TRL's band is fixed
    trl_cfg = tiny_config(tmp_path / "trl", config_cls=GRPOConfig, loss_type="grpo",
                          importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, **common)
    ours, ours_losses = _train(GSPOTrainer, build_model(tokenizer, seed=0), ours_cfg, tokenizer)
    theirs, trl_losses = _train(GRPOTrainer, build_model(tokenizer, seed=0), trl_cfg, tokenizer)

    assert len(ours_losses) == 5
    # Off-policy for real: some ratio moved away from 1 and some sequence was clipped.
    history = ours.state.log_history
    assert max(h.get("gspo/log_ratio_abs_max", 0) for h in history) > 1e-3
    assert max(h.get("clip_ratio/region_mean", 0) for h in history) > 0
    for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(ours_losses, trl_losses):
        assert loss == pytest.approx(ref_loss, abs=1e-6, rel=1e-5)
        assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-6, rel=1e-5)
    ours_params, trl_params = _params(ours.model), _params(theirs.model)
    initial = _params(build_model(tokenizer, seed=0))
    assert any(not torch.equal(ours_params[n], initial[n]) for n in initial)  # training did move the weights
    for name in ours_params:
        torch.testing.assert_close(ours_params[name], trl_params[name], rtol=1e-5, atol=1e-6)
    # TRL's clip metrics keep their names and values.
    for ours_h, trl_h in zip(history, theirs.state.log_history):
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            if key in trl_h:
                assert ours_h[key] == pytest.approx(trl_h[key])


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_every_trl_loss_type_trains_in_gspo_trainer_exactly_as_in_trl(tmp_path, tokenizer, loss_type):
    """The README's "every other TRL loss type still works": GSPOTrainer with GSPOConfig(loss_type=X) hands X to TRL
    and trains exactly as TRL's GRPOTrainer with GRPOConfig(loss_type=X), off-policy (losses, gradient norms, final
    weights), for each of TRL's loss types (TRL_LOSS_TYPES, which tests/test_trl_contract.py keeps equal to TRL's
    own list)."""
    from trl_gspo import GSPOConfig

    level = {"luspo": "sequence"}.get(loss_type, "token")  # TRL refuses luspo per token and the others per sequence
    common = dict(loss_type=loss_type, importance_sampling_level=level, steps_per_generation=4, max_steps=3,
                  per_device_train_batch_size=4)
    ours, ours_losses = _train(GSPOTrainer, build_model(tokenizer, seed=0),
                               tiny_config(tmp_path / "ours", config_cls=GSPOConfig, **common), tokenizer)
    theirs, trl_losses = _train(GRPOTrainer, build_model(tokenizer, seed=0),
                                tiny_config(tmp_path / "trl", config_cls=GRPOConfig, **common), tokenizer)
    assert len(ours_losses) == len(trl_losses) == 3
    assert any(grad_norm > 0 for _, grad_norm in ours_losses)  # something was learned: the comparison can tell
    for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(ours_losses, trl_losses):
        assert loss == pytest.approx(ref_loss, abs=1e-6, rel=1e-5)
        assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-6, rel=1e-5)
    trl_params = _params(theirs.model)
    for name, param in _params(ours.model).items():
        torch.testing.assert_close(param, trl_params[name], rtol=1e-5, atol=1e-6)


def test_gspo_with_the_loss_options_on_trains_like_trl(tmp_path, tokenizer):
    """Every loss-shaping option at once (KL with bias correction, top-entropy masking, adaptive entropy bonus,
    two-sided clipping, off-policy sequence mask, MoE aux loss), off-policy with gradient accumulation: gspo trains
    exactly as TRL's sequence-level 'grpo' (losses, gradient norms, weights, every TRL metric)."""
    options = dict(beta=0.04, use_bias_correction_kl=True, top_entropy_quantile=0.8, entropy_coef=0.01,
                   use_adaptive_entropy=True, entropy_target=1e3, delta=1.0008, off_policy_mask_threshold=0.1,
                   steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=2)
    ours_cfg = tiny_config(tmp_path / "ours", loss_type="gspo", **options)
    trl_cfg = tiny_config(tmp_path / "trl", config_cls=GRPOConfig, loss_type="grpo",
                          importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, **options)
    path = tmp_path / "base"
    build_model(tokenizer, seed=0).save_pretrained(path)  # TRL loads the reference model (beta > 0) from a path
    ours, ours_losses = _train(GSPOTrainer, str(path), ours_cfg, tokenizer)
    theirs, trl_losses = _train(GRPOTrainer, str(path), trl_cfg, tokenizer)
    assert ours.aux_loss_enabled and len(ours_losses) == 2
    for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(ours_losses, trl_losses, strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-6, rel=1e-5)
        assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-6, rel=1e-5)
    for name, value in _params(ours.model).items():
        torch.testing.assert_close(value, _params(theirs.model)[name], rtol=1e-5, atol=1e-6)
    history, trl_history = ours.state.log_history, theirs.state.log_history
    for ours_h, trl_h in zip(history, trl_history, strict=True):
        assert set(trl_h) - {"step_time"} <= set(ours_h)
        for key in set(trl_h) - {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}:
            assert ours_h[key] == pytest.approx(trl_h[key], rel=1e-5, abs=1e-6), key
    # The options were live: the controller moved, the KL and the clipping are non-zero. (delta rarely binds here:
    # negative-advantage sequences become less likely; test_loss_parity_with_trl_features[delta] makes it bind.)
    assert [h["entropy_coef"] for h in history if "entropy_coef" in h] == pytest.approx([0.015, 0.02])
    assert max(h["kl"] for h in history if "kl" in h) > 0
    assert max(h.get("clip_ratio/region_mean", 0) for h in history) > 0


def test_gspo_token_trains_like_gspo(tmp_path, tokenizer):
    results = {}
    for loss_type in ("gspo", "gspo_token"):
        cfg = tiny_config(tmp_path / loss_type, loss_type=loss_type, max_steps=4, per_device_train_batch_size=4)
        trainer, losses = _train(GSPOTrainer, build_dense_model(tokenizer, seed=1), cfg, tokenizer)
        results[loss_type] = (losses, _params(trainer.model))
    for (a, ga), (b, gb) in zip(results["gspo"][0], results["gspo_token"][0]):
        assert a == pytest.approx(b, abs=1e-6) and ga == pytest.approx(gb, rel=1e-5, abs=1e-6)
    for name, value in results["gspo"][1].items():
        torch.testing.assert_close(value, results["gspo_token"][1][name], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- _compute_loss parity with features
def _fake_batch(tokenizer, batch=6, prompt_len=4, completion_len=7, seed=0, vocab_hi=None):
    g = torch.Generator().manual_seed(seed)
    vocab_hi = vocab_hi or len(tokenizer)
    prompt_ids = torch.randint(4, vocab_hi, (batch, prompt_len), generator=g)
    completion_ids = torch.randint(4, vocab_hi, (batch, completion_len), generator=g)
    lengths = torch.tensor([completion_len, 1, 3, 0, completion_len - 1, 5])[:batch]
    completion_mask = (torch.arange(completion_len)[None] < lengths[:, None]).long()
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    old = -torch.rand(batch, completion_len, generator=g) * 3 - 1
    ref = old + torch.randn(batch, completion_len, generator=g) * 0.05
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, 2.0, -1.5, 0.7])[:batch],
        "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": completion_mask.sum(),
    }


OFFSETS = (1.0, -0.1, 0.1, 0.0, -1.0, 0.05)
# Sequence 1 (advantage -0.5) gets s = exp(2e-3) above delta = 1.001: two-sided clipping binds there.
DELTA_OFFSETS = (1.0, 2.0, 0.1, 0.0, -1.0, 0.05)


def _with_real_old_logps(trainer, inputs, scale, offsets=OFFSETS):
    """Old log-probs = the model's own minus a per-sequence offset, so log s_i = offset_i: sequences 0 and 4
    land outside the band on the side where their advantage makes the clip bind, the others inside."""
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].size(1),
        )
    g = torch.Generator().manual_seed(3)
    inputs = dict(inputs)
    offsets = scale * torch.tensor(offsets)[: logps.size(0), None]
    inputs["old_per_token_logps"] = logps - offsets
    inputs["ref_per_token_logps"] = logps + 0.05 * torch.randn(logps.shape, generator=g)
    return inputs


FEATURES = {
    "plain": {},
    "beta": {"beta": 0.04},
    "beta_bias_corrected": {"beta": 0.04, "use_bias_correction_kl": True},
    "off_policy_mask": {"off_policy_mask_threshold": 1e-4},
    "top_entropy": {"top_entropy_quantile": 0.5},
    "entropy_bonus": {"entropy_coef": 0.01},
    "mask_truncated": {"mask_truncated_completions": True},
    "delta": {"delta": 1.001},
    "adaptive_entropy": {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 1e3},
}
# Metrics gspo logs that TRL's "grpo" does not (TRL logs policy_loss only with an entropy bonus); see docs/metrics.md.
GSPO_ONLY_METRICS = {"policy_loss", "gspo/clipped_token_fraction", "gspo/delta_clipped_token_fraction",
                     "gspo/ratio_mean", "gspo/ratio_std", "gspo/ratio_min", "gspo/ratio_max", "gspo/log_ratio_abs_max"}


@pytest.fixture(scope="module")
def trainer_pair(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("pair")
    ours = GSPOTrainer(build_model(tokenizer, seed=2), digit_reward,  # TRL's band is fixed: so is ours here
                       args=tiny_config(out / "o", loss_type="gspo", steps_per_generation=4, clip_band="fixed"),
                       train_dataset=toy_dataset(), processing_class=tokenizer)
    theirs = GRPOTrainer(build_model(tokenizer, seed=2), digit_reward,
                         args=tiny_config(out / "t", config_cls=GRPOConfig, loss_type="grpo",
                                          importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                                          steps_per_generation=4),
                         train_dataset=toy_dataset(), processing_class=tokenizer)
    return ours, theirs


OPTION_DEFAULTS = {"beta": 0.0, "off_policy_mask_threshold": None, "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
                   "use_bias_correction_kl": False, "mask_truncated_completions": False, "delta": None,
                   "use_adaptive_entropy": False, "entropy_target": 0.2}


def _configure(trainer, **options):
    """Set loss options on a built trainer as TRL's __init__ would have from the config."""
    args = trainer.args
    for name, default in OPTION_DEFAULTS.items():
        value = options.get(name, default)
        setattr(args, name, value)
        if hasattr(trainer, name):
            setattr(trainer, name, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._last_world_entropy, trainer._entropy_window_stats = float("inf"), None
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    trainer.use_vllm = options.get("use_vllm", False)
    trainer.vllm_importance_sampling_correction = options.get("use_vllm", False)
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("feature", list(FEATURES) + ["vllm_token_is", "vllm_sequence_is"])
def test_loss_parity_with_trl_features(trainer_pair, tokenizer, feature):
    ours, theirs = trainer_pair
    options = dict(FEATURES.get(feature, {}))
    inputs = _fake_batch(tokenizer)
    if feature.startswith("vllm"):
        options["use_vllm"] = True
        g = torch.Generator().manual_seed(5)
        shape = (6, 1) if feature == "vllm_sequence_is" else (6, 7)
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=g)
    for trainer in (ours, theirs):
        _configure(trainer, **options)
        trainer._metrics["train"].clear()
    inputs = _with_real_old_logps(ours, inputs, scale=1e-3, offsets=DELTA_OFFSETS if "delta" in options else OFFSETS)
    loss, grads = _loss_and_grads(ours, inputs)
    ref_loss, ref_grads = _loss_and_grads(theirs, inputs)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7)
    metrics = ours._metrics["train"]
    assert 0.0 < metrics["clip_ratio/region_mean"][-1] < 1.0  # ratios straddle the band: the test can tell
    if options.get("beta"):
        assert metrics["kl"][-1] > 0
    if options.get("delta"):  # sequence 1 (1 of 22 completion tokens) are capped: the test can tell
        assert metrics["gspo/delta_clipped_token_fraction"][-1] == pytest.approx(1 / 22)
    # Every metric TRL logs for its "grpo" loss is logged for gspo under the same name, with the same value.
    trl_metrics = theirs._metrics["train"]
    assert set(trl_metrics) <= set(metrics)
    assert set(metrics) - set(trl_metrics) <= GSPO_ONLY_METRICS
    for name, values in trl_metrics.items():
        assert metrics[name] == pytest.approx(values, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("top_entropy", [1.0, 0.5])
def test_adaptive_entropy_matches_trl_over_accumulation_windows(trainer_pair, tokenizer, top_entropy):
    """Two optimizer steps of two micro-batches each: the bonus is off in the first window (no measurement yet),
    the controller raises the coefficient at each step (entropy below the target) and applies it in the second
    window; loss, gradients, controller state and the logged `entropy_coef` equal TRL's at every micro-batch."""
    ours, theirs = trainer_pair
    options = dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=1e3, top_entropy_quantile=top_entropy)
    for trainer in (ours, theirs):
        _configure(trainer, **options)
        trainer._metrics["train"].clear()
    state = theirs.accelerator.gradient_state
    try:
        for micro_step in range(4):
            state._set_sync_gradients(micro_step % 2 == 1)  # the optimizer steps after micro-batches 1 and 3
            inputs = _with_real_old_logps(ours, _fake_batch(tokenizer, seed=micro_step), scale=1e-3)
            loss, grads = _loss_and_grads(ours, inputs)
            ref_loss, ref_grads = _loss_and_grads(theirs, inputs)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7)
            assert ours.entropy_coef == pytest.approx(theirs.entropy_coef)
            assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy)
    finally:
        state._set_sync_gradients(True)
    assert ours._metrics["train"]["entropy_coef"] == pytest.approx(theirs._metrics["train"]["entropy_coef"])
    assert ours._metrics["train"]["entropy_coef"] == pytest.approx([0.015, 0.02])  # raised by entropy_coef_delta
    # The second window applied the bonus: the same batch without it gives a different loss.
    _configure(ours)
    assert not torch.isclose(_loss_and_grads(ours, inputs)[0], loss)


def test_static_entropy_bonus_logs_entropy_coef_like_trl(trainer_pair, tokenizer):
    ours, theirs = trainer_pair
    inputs = _with_real_old_logps(ours, _fake_batch(tokenizer), scale=1e-3)
    for trainer in (ours, theirs):
        _configure(trainer, entropy_coef=0.01)
        trainer._metrics["train"].clear()
        _loss_and_grads(trainer, inputs)
    assert ours._metrics["train"]["entropy_coef"] == theirs._metrics["train"]["entropy_coef"] == [0.01]


def test_aux_loss_is_added(trainer_pair, tokenizer):
    ours, _ = trainer_pair
    _configure(ours)
    inputs = _with_real_old_logps(ours, _fake_batch(tokenizer), scale=1e-3)
    assert ours.aux_loss_enabled  # tiny Qwen3-MoE config declares router_aux_loss_coef
    with_aux, _ = _loss_and_grads(ours, inputs)
    ours.aux_loss_enabled = False
    try:
        without_aux, _ = _loss_and_grads(ours, inputs)
    finally:
        ours.aux_loss_enabled = True
    aux = ours._metrics["train"]["aux_loss"][-1]
    expected = ours.router_aux_loss_coef * aux / ours.current_gradient_accumulation_steps
    assert (with_aux - without_aux).item() == pytest.approx(expected, rel=1e-4)


# --------------------------------------------------------------------------- per-token advantages
class LastTokensTrainer(GSPOTrainer):
    """Example override: credit only the last `keep` tokens of each completion (e.g. the final turn)."""

    keep = 2

    def token_advantages(self, inputs, mask):
        advantages = super().token_advantages(inputs, mask)
        position_from_end = mask.flip(-1).cumsum(-1).flip(-1)  # 1 on the last valid token, 2 before it...
        return advantages * (position_from_end <= self.keep) * mask


def test_token_advantages_hook_steers_the_gradient(tmp_path, tokenizer):
    trainer = LastTokensTrainer(build_dense_model(tokenizer, seed=3), digit_reward,
                                args=tiny_config(tmp_path, loss_type="gspo_token"),
                                train_dataset=toy_dataset(), processing_class=tokenizer)
    _configure(trainer)
    inputs = _with_real_old_logps(trainer, _fake_batch(tokenizer), scale=1e-5)  # inside the band
    loss, grads = _loss_and_grads(trainer, inputs)

    # Independent check: the same loss from the pure function with explicit token advantages.
    mask = inputs["completion_mask"]
    token_adv = trainer.token_advantages(inputs, mask)
    assert token_adv.shape == mask.shape and (token_adv[:, :3] == 0).any()
    trainer.model.zero_grad()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), mask.size(1))
    direct = gspo_token_loss(logps, inputs["old_per_token_logps"], token_adv, mask, 3e-4, 4e-4)
    (direct.per_sequence_loss.mean() / 2).backward()
    torch.testing.assert_close(loss, (direct.per_sequence_loss.mean() / 2).detach())
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-8)

    # The per-token gradient follows the token advantages: logps of zero-advantage tokens get no gradient.
    logps = logps.detach().requires_grad_(True)
    gspo_token_loss(logps, inputs["old_per_token_logps"], token_adv, mask).per_sequence_loss.sum().backward()
    assert torch.all(logps.grad[token_adv == 0] == 0)
    assert torch.all(logps.grad[(token_adv != 0)] != 0)

    # And it differs from the broadcast default (which equals gspo).
    plain = GSPOTrainer.token_advantages(trainer, inputs, mask)
    assert not torch.equal(plain, token_adv)


def test_gspo_refuses_per_token_advantages(trainer_pair, tokenizer):
    ours, _ = trainer_pair
    _configure(ours)
    inputs = _fake_batch(tokenizer)
    inputs["advantages"] = torch.ones(6, 7)
    with pytest.raises(ValueError, match="gspo_token"):
        ours._compute_loss(ours.model, inputs)


def test_nan_logps_raise_clear_error(trainer_pair, tokenizer):
    ours, _ = trainer_pair
    _configure(ours)
    inputs = _fake_batch(tokenizer)
    inputs["old_per_token_logps"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="old_logps.*NaN/Inf"):
        ours._compute_loss(ours.model, inputs)


def test_only_batch_keys_present_are_forwarded(trainer_pair, tokenizer, monkeypatch):
    """A model input TRL adds to `_get_per_token_logps_and_entropies` keeps its default unless the batch has it."""
    ours, _ = trainer_pair
    _configure(ours)
    seen = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        seen.append(kwargs)
        return original(self, model, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    inputs = _with_real_old_logps(ours, _fake_batch(tokenizer), scale=1e-3)
    seen.clear()
    ours._compute_loss(ours.model, inputs)
    assert set(seen[0]) == {"compute_entropy", "compute_aux_loss"}
    inputs["token_type_ids"] = torch.zeros_like(torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1))
    ours._compute_loss(ours.model, inputs)
    assert set(seen[1]) == {"compute_entropy", "compute_aux_loss", "token_type_ids"}


def test_loss_and_metrics_read_the_device_once(trainer_pair, tokenizer, monkeypatch):
    """The NaN/Inf checks and every metric reach the host in one read per micro-batch (each read stalls a GPU
    step); counted with benchmarks/_setup.py's counter, the model forward left out."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from _setup import count_host_reads

    ours, _ = trainer_pair
    _configure(ours, beta=0.04, delta=1.001)
    inputs = _with_real_old_logps(ours, _fake_batch(tokenizer), scale=1e-3, offsets=DELTA_OFFSETS)
    forward = ours._get_per_token_logps_and_entropies(
        ours.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1),
        compute_entropy=True, compute_aux_loss=True)
    monkeypatch.setattr(ours, "_get_per_token_logps_and_entropies", lambda *args, **kwargs: forward)
    ours._metrics["train"].clear()
    with count_host_reads() as reads:
        loss = ours._compute_loss(ours.model, inputs)
    assert reads["count"] == 1
    assert torch.isfinite(loss) and len(ours._metrics["train"]["gspo/ratio_max"]) == 1
    # The counter does count: the pure function with its own (eager) input check reads once.
    with count_host_reads() as reads:
        gspo_loss(forward[0], inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"])
    assert reads["count"] == 1


def test_empty_completions_give_zero_gradient(trainer_pair, tokenizer):
    ours, _ = trainer_pair
    _configure(ours)
    inputs = _fake_batch(tokenizer)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    inputs["old_per_token_logps"] = torch.full_like(inputs["old_per_token_logps"], float("nan"))  # padding only
    ours.aux_loss_enabled = False  # the load-balancing loss would still train the routers
    try:
        loss, grads = _loss_and_grads(ours, inputs)
    finally:
        ours.aux_loss_enabled = True
    assert torch.isfinite(loss) and loss == 0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


# --------------------------------------------------------------------------- warnings
def test_grpo_config_with_gspo_warns_paper_values(tmp_path, tokenizer, caplog):
    from transformers.utils.logging import warning_once

    warning_once.cache_clear()  # transformers' once-only cache: another test may have warned already
    cfg = tiny_config(tmp_path, config_cls=GRPOConfig, loss_type="gspo")
    with caplog.at_level(logging.WARNING, logger="trl_gspo.trainer"):
        trainer = GSPOTrainer(build_dense_model(tokenizer), digit_reward, args=cfg, train_dataset=toy_dataset(),
                              processing_class=tokenizer)
    text = caplog.text
    assert "epsilon=0.2" in text and "3e-4" in text
    assert "fully on-policy" in text  # GRPOConfig's steps_per_generation defaults to gradient_accumulation_steps
    assert trainer.epsilon_low == 0.2  # the user's explicit config is honoured, only warned about


def test_setup_warnings_are_emitted_once(tmp_path, caplog):
    from transformers.utils.logging import warning_once

    from trl_gspo.config import warn_about_setup

    warning_once.cache_clear()
    cfg = tiny_config(tmp_path, config_cls=GRPOConfig, loss_type="gspo")
    with caplog.at_level(logging.WARNING, logger="trl_gspo.config"):
        warn_about_setup(cfg)
        warn_about_setup(cfg)
    assert caplog.text.count("fully on-policy") == 1 and caplog.text.count("epsilon=0.2") == 1


def test_adaptive_entropy_state_survives_a_resume(tmp_path, tokenizer):
    """TRL saves the controller's state with each checkpoint and restores it on resume; gspo types use that state, so
    a resumed run continues the coefficient where it stopped."""
    cfg = dict(loss_type="gspo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=1e3, max_steps=2,
               per_device_train_batch_size=4, save_strategy="steps", save_steps=1)
    first, _ = _train(GSPOTrainer, build_dense_model(tokenizer, seed=4), tiny_config(tmp_path / "a", **cfg), tokenizer)
    assert [h["entropy_coef"] for h in first.state.log_history if "entropy_coef" in h] == pytest.approx([0.015, 0.02])
    resumed = GSPOTrainer(build_dense_model(tokenizer, seed=4), digit_reward, args=tiny_config(tmp_path / "a", **cfg),
                          train_dataset=toy_dataset(), processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert [h["entropy_coef"] for h in resumed.state.log_history if "entropy_coef" in h][-1] == pytest.approx(0.02)
    assert resumed.entropy_coef == pytest.approx(first.entropy_coef)


def test_startup_names_the_resolved_sizes_and_the_presets_that_set_them(tmp_path, tokenizer, caplog):
    """A GRPO user swapping in GSPOTrainer sees what changed: the paper's 4 mini-batches per rollout make the rollout
    batch 4x TRL's default (memory, KV cache). One line at startup, a warning when GSPOConfig filled in the paper's
    values; TRL's own loss types without presets get it at info level."""
    from trl_gspo import GSPOConfig

    with caplog.at_level(logging.INFO, logger="trl_gspo.trainer"):
        GSPOTrainer(build_model(tokenizer, seed=0), digit_reward,
                    args=tiny_config(tmp_path / "g", config_cls=GSPOConfig), train_dataset=toy_dataset(),
                    processing_class=tokenizer)
    [record] = [r for r in caplog.records if "each rollout batch" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "loss_type='gspo': each rollout batch is 32 completions (8 prompts x 4 generations) over 1 process(es), "
        "trained as 4 mini-batches of 8 per process: 4 optimizer step(s) per rollout batch; one ratio per sequence, "
        "clipped to [0.9997, 1.0004] (clip_band='fixed': the GSPO paper's band); beta=0. GSPOConfig filled in the "
        "GSPO paper's values for fields left unset: "
        "beta=0.0, epsilon=0.0003, epsilon_high=0.0004, importance_sampling_level='sequence', steps_per_generation=4.")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_gspo.trainer"):
        GSPOTrainer(build_model(tokenizer, seed=0), digit_reward,
                    args=tiny_config(tmp_path / "t", config_cls=GRPOConfig, loss_type="dapo"),
                    train_dataset=toy_dataset(), processing_class=tokenizer)
    [record] = [r for r in caplog.records if "each rollout batch" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "loss_type='dapo': each rollout batch is 8 completions (2 prompts x 4 generations) over 1 process(es), trained "
        "as 1 mini-batches of 8 per process: 1 optimizer step(s) per rollout batch; token-level ratios, epsilon=0.2, "
        "epsilon_high=0.2; beta=0.")
