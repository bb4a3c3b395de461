"""`clip_band="adaptive"` (trl_gspo/trainer/clip_band.py): what the rule reads (learnable tokens only, noise kept out,
no signal and skipped steps leave it), on synthetic streams of the signals real runs bring, then in GSPOTrainer (the
band logged for a step is the band it trained with, most prompts with equal rewards, resume) and the configs around
it. The rule's formula itself: tests/test_losses.py."""

import logging
import math
import shutil
import types

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.losses import gspo_loss, gspo_token_loss
from trl_gspo.metrics import per_sequence_values
from trl_gspo.quickstart.model import build_model
from trl_gspo.trainer.clip_band import (LEARNABLE_ADVANTAGE, NO_SIGNAL_LOG_RATIO, NOISE_MARGIN, SHARE_METRIC,
                                        AdaptiveClipBand, ClipBandStep, band_columns, band_stats)

BASE = dict(use_cpu=True, bf16=False, report_to="none")


# ---------------------------------------------------------------------------------------------- synthetic streams
def _micro_batch(band, log_s, advantages, noise_only=False, tokens=4):
    """One micro-batch through the real loss and the metrics' per-sequence rows: every token of sequence i moved by
    log_s[i], so its ratio is exp(log_s[i]); the band's statistics go to `band.observe`. Returns them."""
    n = log_s.shape[0]
    old = torch.full((n, tokens), -2.0, dtype=torch.float64)
    mask = torch.ones(n, tokens)
    out = gspo_loss(old + log_s[:, None], old, advantages, mask, *band.band)
    rows = torch.cat([per_sequence_values(out, mask), band_columns(out, mask, advantages, noise_only)], 1)
    stats = band_stats(rows, torch.ones(n, dtype=torch.bool), 5)
    band.observe(stats.tolist())
    return stats


def _moving(generator, n, sigma, advantages):
    """A policy step's movement: sequences with a positive advantage drift up, negative down, plus spread."""
    drift = advantages.sign() * sigma * torch.randn(n, generator=generator, dtype=torch.float64).abs()
    return drift + sigma * torch.randn(n, generator=generator, dtype=torch.float64)


def _signs(generator, n):
    return torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1


def test_tokens_of_groups_with_equal_rewards_do_not_count():
    """90% of the tokens have a zero advantage (groups whose completions all got the same reward): the band settles
    where the 10% that can be clipped are clipped at the target share, as if the others were not there. A share over
    every token (the rule this replaced) can never reach 0.15 here, so the band fell to its floor."""
    settled = {}
    for zero_share in (0.0, 0.9):
        generator = torch.Generator().manual_seed(0)
        band, shares = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2), []
        for _ in range(300):
            advantages = _signs(generator, 320)
            advantages[: int(320 * zero_share)] = 0.0
            _micro_batch(band, _moving(generator, 320, 1e-2, advantages), advantages)
            shares.append(band.end_step()[SHARE_METRIC])
        settled[zero_share] = (band.epsilon, sum(shares[100:]) / len(shares[100:]))
    (epsilon_all, share_all), (epsilon_few, share_few) = settled[0.0], settled[0.9]
    assert abs(share_few / 0.15 - 1) < 0.2 and abs(share_all / 0.15 - 1) < 0.1
    assert 0.5 < epsilon_few / epsilon_all < 2  # the band follows the learnable tokens' movement
    assert epsilon_few > 1e-3  # nowhere near the 1e-5 floor


def test_a_step_with_no_learnable_sequence_leaves_the_band():
    band = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2)
    generator = torch.Generator().manual_seed(1)
    advantages = torch.zeros(64, dtype=torch.float64)  # every group answered alike
    advantages[:8] = LEARNABLE_ADVANTAGE / 10  # TRL's rounding residue of a zero advantage is not an advantage
    _micro_batch(band, _moving(generator, 64, 1e-1, _signs(generator, 64)), advantages)
    assert band.end_step() == {} and band.band == (3e-4, 4e-4)


def test_pure_bf16_noise_at_learning_rate_zero_is_not_clipped():
    """old_logps="sampler" with a bfloat16 sampler and learning rate 0: every ratio is the sampler's rounding. The first
    step of each rollout scores the batch on its sampling weights (noise only): the band stays above that noise from
    then on, so no later step clips it, where the rule this replaced held 15% of the noise clipped."""
    generator = torch.Generator().manual_seed(2)
    band = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2)
    clipped_after_first_rollout = []
    for rollout in range(30):
        for step in range(4):  # 4 mini-batches per rollout; the first on the sampling weights
            advantages = _signs(generator, 64)
            logps = -3.0 * torch.rand(64, 24, generator=generator, dtype=torch.float64)
            sampler = logps.to(torch.bfloat16).double()  # the bfloat16 sampler's log-probs
            log_s = (logps - sampler).mean(-1)
            largest = float(log_s.abs().max())
            stats = _micro_batch(band, log_s, advantages, noise_only=step == 0, tokens=1)
            if rollout > 0:
                clipped_after_first_rollout.append(float(stats[0]))
            if step == 0:
                assert float(stats[3]) == pytest.approx(largest)  # the noise the floor reads
            band.end_step()
    assert largest > 3e-4  # bf16 rounding alone leaves the paper's band
    assert sum(clipped_after_first_rollout) == 0
    assert band.noise_floor >= NOISE_MARGIN * 0.9 * largest * 0.5 and band.epsilon >= band.noise_floor
    assert band.in_use()["gspo/clip_band_noise_floor"] == band.noise_floor  # logged


def test_noise_only_sequences_are_left_out_of_the_share():
    band = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2)
    advantages = torch.ones(8, dtype=torch.float64)
    stats = _micro_batch(band, torch.full((8,), 0.1, dtype=torch.float64), advantages, noise_only=True)
    assert stats[:3].tolist() == [0.0, 0.0, 0.0] and float(stats[3]) == pytest.approx(0.1)
    band.end_step()
    floor = NOISE_MARGIN * max(-math.expm1(-0.1), math.expm1(0.1) / (4 / 3))
    assert band.noise_floor == pytest.approx(floor) and band.epsilon == pytest.approx(floor)


def test_the_no_signal_threshold_is_its_own_constant():
    """Real movement of 1e-4 counts even with clip_band_min raised to 1e-3 (the rule this replaced read the floor as
    its no-signal threshold and discarded it); ratios within NO_SIGNAL_LOG_RATIO of 1 do not."""
    band = AdaptiveClipBand(3e-3, 4e-3, 0.15, 1e-3, 0.2)
    advantages = torch.ones(8, dtype=torch.float64)
    _micro_batch(band, torch.full((8,), 1e-4, dtype=torch.float64), advantages)
    assert band.end_step() == {SHARE_METRIC: 0.0}
    _micro_batch(band, torch.full((8,), NO_SIGNAL_LOG_RATIO / 2, dtype=torch.float64), advantages)
    before = band.band
    assert band.end_step() == {} and band.band == before


def test_a_skipped_optimizer_step_leaves_the_band():
    band = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2)
    advantages = torch.ones(8, dtype=torch.float64)
    _micro_batch(band, torch.full((8,), 0.5, dtype=torch.float64), advantages)
    assert band.end_step(skipped=True) == {} and band.band == (3e-4, 4e-4)
    band.end_step()  # what the skipped step measured is gone with it
    assert band.band == (3e-4, 4e-4)
    # through the callback: accelerate says whether the optimizer step was skipped (fp16 overflow, DeepSpeed)
    trainer = types.SimpleNamespace(_adaptive_band=band, _metrics={"train": {}}, epsilon_low=0, epsilon_high=0,
                                    accelerator=types.SimpleNamespace(optimizer_step_was_skipped=True))
    trainer._metrics["train"] = __import__("collections").defaultdict(list)
    _micro_batch(band, torch.full((8,), 0.5, dtype=torch.float64), advantages)
    ClipBandStep(trainer).on_step_end(None, None, None)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (3e-4, 4e-4) and not trainer._metrics["train"]
    trainer.accelerator.optimizer_step_was_skipped = False
    _micro_batch(band, torch.full((8,), 0.5, dtype=torch.float64), advantages)
    ClipBandStep(trainer).on_step_end(None, None, None)
    assert trainer.epsilon_low == pytest.approx(6e-4) and trainer._metrics["train"][SHARE_METRIC] == [1.0]


def test_band_columns_and_statistics_against_a_direct_count():
    """Per-token advantages with zeros (GSPO-token), mixed noise-only rows: the columns and statistics equal a count
    written out sequence by sequence."""
    generator = torch.Generator().manual_seed(4)
    n, t = 12, 5
    old = -torch.rand(n, t, generator=generator, dtype=torch.float64)
    logps = old + 0.01 * torch.randn(n, t, generator=generator, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=generator) > 0.2).float()
    advantages = torch.randn(n, t, generator=generator, dtype=torch.float64)
    advantages[advantages.abs() < 0.5] = 0.0
    noise = torch.rand(n, generator=generator) > 0.7
    out = gspo_token_loss(logps, old, advantages, mask, 3e-4, 4e-4)
    rows = torch.cat([per_sequence_values(out, mask), band_columns(out, mask, advantages, noise)], 1)
    present = torch.ones(n, dtype=torch.bool)
    present[-1] = False  # a padded row from another rank
    stats = band_stats(rows, present, 5).tolist()
    clipped = tokens = largest_signal = largest_noise = 0.0
    for i in range(n - 1):
        log_ratio = abs(float(out.log_ratio[i]))
        learnable = [j for j in range(t) if mask[i, j] and advantages[i, j] != 0]
        if noise[i]:
            if mask[i].sum() > 0:
                largest_noise = max(largest_noise, log_ratio)
            continue
        if learnable:
            tokens += len(learnable)
            clipped += sum(bool(out.low_clipped[i, j] or out.high_clipped[i, j]) for j in learnable)
            largest_signal = max(largest_signal, log_ratio)
    assert stats == pytest.approx([clipped, tokens, largest_signal, largest_noise], rel=1e-6)
    assert clipped > 0 and largest_noise > 0


# ---------------------------------------------------------------------------------------------- GSPOTrainer
def _trainer(output_dir, tokenizer, reward=digit_reward, **overrides):
    config = tiny_config(output_dir, **{**dict(max_steps=8, per_device_train_batch_size=4, learning_rate=2e-2,
                                               clip_band="adaptive"), **overrides})
    return GSPOTrainer(build_model(tokenizer, seed=0), reward, args=config, train_dataset=toy_dataset(),
                       processing_class=tokenizer)


def _bands(trainer):
    return [(h["step"], h["gspo/clip_epsilon_low"], h["gspo/clip_epsilon_high"]) for h in trainer.state.log_history
            if "gspo/clip_epsilon_low" in h]


def test_the_band_logged_for_a_step_is_the_band_it_trained_with(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, max_steps=6)
    seen = []  # the band each loss call ran with, by optimizer step
    compute = trainer._compute_loss

    def recording(model, inputs):
        seen.append((trainer.state.global_step + 1, trainer.epsilon_low, trainer.epsilon_high))
        return compute(model, inputs)

    trainer._compute_loss = recording
    trainer.train()
    bands = _bands(trainer)
    assert len(bands) == 6 and len({low for _, low, _ in bands}) > 2  # it moved
    assert bands == [step for step in seen if step[0] in {b[0] for b in bands}][:6]  # k's band is the one k used
    assert bands[0][1:] == (3e-4, 4e-4)  # starts at the paper's band
    assert all(high == pytest.approx(low * 4 / 3, rel=1e-12) for _, low, high in bands)  # the paper's ratio kept
    assert all(1e-5 <= low <= 0.2 for _, low, _ in bands)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # the first mini-batch of each rollout (every 4th step) is on its sampling weights: no share, band unmoved
    assert all((SHARE_METRIC in h) == (h["step"] % 4 != 1) for h in logs)
    assert all("gspo/clip_band_noise_floor" in h for h in logs)


def test_most_prompts_giving_equal_rewards_do_not_collapse_the_band(tmp_path, tokenizer):
    """3 of 4 prompts give every completion the same reward (advantage 0): the band reads the clipped share of the
    learnable tokens only, which is the whole-batch share divided by the learnable share, and it does not fall
    toward its floor (the rule this replaced fell from 3e-4 to 1.6e-5 in this setting)."""
    def mostly_equal(completions, prompts, **kwargs):
        learnable = [prompt.startswith(("0+", "4+", "8+")) for prompt in prompts]
        return [score if keep else 0.5 for score, keep in zip(digit_reward(completions), learnable)]

    trainer = _trainer(tmp_path, tokenizer, reward=mostly_equal, max_steps=12)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert min(h["frac_reward_zero_std"] for h in logs if "frac_reward_zero_std" in h) >= 0.5
    shares = [(h[SHARE_METRIC], h["gspo/clipped_token_fraction"]) for h in logs if SHARE_METRIC in h]
    assert shares and all(band_share >= whole for band_share, whole in shares)
    assert any(band_share > 1.5 * whole for band_share, whole in shares)
    assert trainer.epsilon_low > 1e-4


def test_a_checkpoint_without_band_state_resumes_with_one_line(tmp_path, caplog):
    band = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2)
    with caplog.at_level(logging.WARNING):
        assert band.resume(str(tmp_path), is_main_process=True) == (3e-4, 4e-4)
    lines = [r.getMessage() for r in caplog.records if "holds no band state" in r.getMessage()]
    assert len(lines) == 1 and "epsilon=0.0003, epsilon_high=0.0004" in lines[0]
    band.epsilon, band.noise_floor = 2e-3, 1e-3
    band.save(str(tmp_path))
    fresh = AdaptiveClipBand(3e-4, 4e-4, 0.15, 1e-5, 0.2)
    assert fresh.resume(str(tmp_path), is_main_process=True) == pytest.approx((2e-3, 2e-3 * 4 / 3))
    assert fresh.noise_floor == 1e-3


@pytest.mark.slow
def test_a_resumed_run_continues_with_the_same_band_bit_for_bit(tmp_path, tokenizer):
    full = _trainer(tmp_path / "full", tokenizer, save_strategy="steps", save_steps=3)
    full.train()
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint-3", out / "checkpoint-3")
    resumed = _trainer(out, tokenizer, save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint="latest")
    assert _bands(resumed)[3:] == _bands(full)[3:]  # steps 4-8 (steps 1-3 come from the checkpoint's history)
    assert (resumed.epsilon_low, resumed.epsilon_high) == (full.epsilon_low, full.epsilon_high)
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full.model.parameters()))


# ---------------------------------------------------------------------------------------------- configs
def test_gspo_types_default_to_the_papers_fixed_band(tmp_path):
    config = GSPOConfig(output_dir=str(tmp_path), **BASE)
    assert (config.clip_band, config.epsilon, config.epsilon_high) == ("fixed", 3e-4, 4e-4)
    assert AdaptiveClipBand.build(config, 3e-4, 4e-4) is None
    assert GSPOConfig(output_dir=str(tmp_path), loss_type="gspo_token", **BASE).clip_band == "fixed"
    assert AdaptiveClipBand.build(GSPOConfig(output_dir=str(tmp_path), clip_band="adaptive", **BASE), 3e-4,
                                  4e-4) is not None


@pytest.mark.parametrize("overrides,option", [
    (dict(clip_band="adaptve"), "clip_band"), (dict(clip_band="adaptive", clip_band_target=1.5), "clip_band_target"),
    (dict(clip_band="adaptive", epsilon=0.3), "clip_band_min"),
    (dict(loss_type="grpo", clip_band="adaptive"), "clip_band"),  # TRL's types would ignore it: refused
    # a cap the band can widen past: refused at construction, naming delta and clip_band_max (not mid-run)
    (dict(clip_band="adaptive", delta=1.005), "delta"), (dict(clip_band="adaptive", delta=1.2), "delta"),
])
def test_bad_adaptive_band_options_are_refused_naming_the_option(tmp_path, overrides, option):
    with pytest.raises(ValueError, match=f"`{option}`.*Fix") as refusal:
        GSPOConfig(output_dir=str(tmp_path), **BASE, **overrides)
    if option == "delta":
        assert "clip_band_max" in str(refusal.value)


def test_a_delta_above_the_widest_band_is_accepted(tmp_path):
    config = GSPOConfig(output_dir=str(tmp_path), clip_band="adaptive", delta=1.3, **BASE)  # 1 + 0.2 * 4/3 < 1.3
    assert config.delta == 1.3
    assert GSPOConfig(output_dir=str(tmp_path), delta=1.005, **BASE).delta == 1.005  # a fixed band: above 1.0004


def test_the_run_summary_and_curves_show_the_band(tmp_path, capsys):
    from trl_gspo.launch.reporting import RunReportCallback

    history = [{"step": step, "reward": 0.1, "gspo/clip_epsilon_low": band}
               for step, band in enumerate([3e-4, 6e-4, 1.2e-3], start=1)]
    args = types.SimpleNamespace(output_dir=str(tmp_path), loss_type="gspo")
    state = types.SimpleNamespace(is_world_process_zero=True, log_history=history, global_step=3)
    callback = RunReportCallback(plot=True)
    callback.on_train_begin(args, state, None)
    callback.on_train_end(args, state, None)
    assert "clip band (adaptive):  epsilon 0.0003 -> 0.0012" in capsys.readouterr().out
    assert (tmp_path / "training_curves.png").stat().st_size > 10_000
