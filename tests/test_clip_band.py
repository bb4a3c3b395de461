"""`clip_band="adaptive"` in GSPOTrainer (trl_gspo/trainer/clip_band.py): the band moves with the run's clipped share,
within its bounds, the loss uses it, it is logged, and a resumed run continues with the same band, bit for bit. The
rule itself against synthetic ratio streams: tests/test_losses.py."""

import shutil

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.quickstart.model import build_model
from trl_gspo.trainer.clip_band import AdaptiveClipBand


def _trainer(output_dir, tokenizer, **overrides):
    config = tiny_config(output_dir, **{**dict(max_steps=8, per_device_train_batch_size=4, learning_rate=2e-2,
                                               clip_band="adaptive"), **overrides})
    return GSPOTrainer(build_model(tokenizer, seed=0), digit_reward, args=config, train_dataset=toy_dataset(),
                       processing_class=tokenizer)


def _bands(trainer):
    return [(h["step"], h["gspo/clip_epsilon_low"], h["gspo/clip_epsilon_high"]) for h in trainer.state.log_history
            if "gspo/clip_epsilon_low" in h]


def test_the_band_moves_with_the_clipped_share_and_the_loss_uses_it(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, max_steps=6)
    seen = []  # the band each loss call ran with
    compute = trainer._compute_loss

    def recording(model, inputs):
        seen.append((trainer.epsilon_low, trainer.epsilon_high))
        return compute(model, inputs)

    trainer._compute_loss = recording
    trainer.train()
    bands = _bands(trainer)
    fixed = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    # 'fixed' (asked for, or implied by a band given) builds no controller and logs nothing; unset is adaptive
    assert AdaptiveClipBand.build(GSPOConfig(**fixed, clip_band="fixed"), 3e-4, 4e-4) is None
    assert AdaptiveClipBand.build(GSPOConfig(**fixed, epsilon=3e-4, epsilon_high=4e-4), 3e-4, 4e-4) is None
    assert AdaptiveClipBand.build(GSPOConfig(**fixed), 3e-4, 4e-4) is not None
    assert len(bands) == 6 and len({low for _, low, _ in bands}) > 2  # it moved
    assert all(high == pytest.approx(low * 4 / 3, rel=1e-12) for _, low, high in bands)  # the paper's ratio kept
    assert all(1e-5 <= low <= 0.2 for _, low, _ in bands)
    assert seen[0] == (3e-4, 4e-4)  # starts at the paper's band
    assert [low for low, _ in seen[1:]] == [low for _, low, _ in bands[:-1]]  # step k+1 trains with step k's band
    shares = [h.get("gspo/clip_band_clipped_fraction") for h in trainer.state.log_history if "loss" in h]
    assert shares[0] is None  # the first mini-batch of a rollout is on-policy: its ratios say nothing, no update
    assert [low for _, low, _ in bands[:1]] == [3e-4]


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


@pytest.mark.parametrize("overrides,option", [
    (dict(clip_band="adaptve"), "clip_band"), (dict(clip_band="adaptive", clip_band_target=1.5), "clip_band_target"),
    (dict(clip_band="adaptive", epsilon=0.3), "clip_band_min"),
    (dict(loss_type="grpo", clip_band="adaptive"), "clip_band"),  # TRL's types would ignore it: refused
])
def test_bad_adaptive_band_options_are_refused_naming_the_option(tmp_path, overrides, option):
    with pytest.raises(ValueError, match=f"`{option}`"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **overrides)


def test_the_run_summary_and_curves_show_the_band(tmp_path, capsys):
    import types

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
