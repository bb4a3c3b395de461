"""`old_logps="sampler"` (GSPO paper Sec. 5.4): pi_old from the sampler's log-probs, TRL's old-policy pass skipped.
Here with HF generate, whose log-probs R3 records; tests/test_vllm.py runs it on a real vLLM engine."""

import logging
import math

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset
from transformers.utils import logging as hf_logging

import trl_gspo.routing.rollout as rollout
from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.quickstart.model import build_model
from trl_gspo.sampling.old_logps import MOST_OUTSIDE_BAND, SamplerOldLogps, check_server_logprobs, gap_warning


def _config(tmp_path, **overrides):
    return tiny_config(tmp_path, **overrides)


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("overrides, message", [
    (dict(old_logps="recomputed"), "use 'trainer'"),
    (dict(old_logps="sampler"), "use_vllm=True, routing_replay='sampler'"),
    (dict(old_logps="sampler", use_vllm=True, routing_replay="old"), "routing_replay='sampler' (R3"),
])
def test_options_that_cannot_work_are_refused_naming_the_fix(overrides, message, tmp_path):
    with pytest.raises(ValueError, match="`old_logps`") as error:
        _config(tmp_path, **overrides)
    assert message in str(error.value) and "Fix:" in str(error.value)


def test_the_default_recomputes_pi_old(tmp_path):
    assert GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).old_logps == "trainer"


class _Server:
    base_url = "http://10.0.0.1:8000"

    def __init__(self, mode):
        self.mode = mode

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": self.mode}}


def test_a_server_without_processed_logprobs_is_refused():
    check_server_logprobs(_Server("processed_logprobs"))
    with pytest.raises(ValueError, match="logprobs mode 'raw_logprobs'") as error:
        check_server_logprobs(_Server("raw_logprobs"))
    assert "http://10.0.0.1:8000" in str(error.value) and "trl-gspo vllm-serve" in str(error.value)


# ------------------------------------------------------------------ the pieces, against float64 references
def test_the_old_pass_answer_has_trls_layout():
    state = SamplerOldLogps(lambda: (3e-4, 4e-4), ("float32", "float32"))
    state.start_round(training=True)
    state.keep([[-0.5, -1.0], [-2.0, None, -0.25]])
    with torch.no_grad():  # TRL runs its old-policy pass without grad
        assert state.answers_old_pass(is_policy=True, reference_pass=False)
        logps, entropies, aux = state.old_pass(4, "cpu")
        assert not state.answers_old_pass(is_policy=True, reference_pass=False)  # one per round: a later pass runs
    expected = torch.tensor([[-0.5, -1.0, 0, 0], [-2.0, math.nan, -0.25, 0]])
    assert torch.equal(torch.isnan(logps), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(logps), torch.nan_to_num(expected)) and entropies is None and aux is None
    assert state.skipped_passes == 1


def test_only_the_rounds_no_grad_policy_pass_is_answered():
    state = SamplerOldLogps(lambda: (3e-4, 4e-4), ("float32", "float32"))
    state.start_round(training=True)
    state.keep([[-1.0]])
    assert not state.answers_old_pass(is_policy=False, reference_pass=False)  # a separate reference model
    assert not state.answers_old_pass(is_policy=True, reference_pass=True)  # PEFT's reference pass
    assert not state.answers_old_pass(is_policy=True, reference_pass=False)  # grad enabled: a training pass
    with torch.no_grad():
        assert state.answers_old_pass(is_policy=True, reference_pass=False)


def test_a_round_without_sampler_logps_or_with_a_missing_one_on_a_trained_token_is_refused():
    state = SamplerOldLogps(lambda: (3e-4, 4e-4), ("float32", "float32"))
    batch = {"completion_mask": torch.tensor([[1, 1, 0]]), "tool_mask": torch.tensor([[1, 0, 1]])}
    state.start_round(training=True)
    with pytest.raises(ValueError, match="returned no sampler log-probs"):
        state.keep(None)  # at the end of TRL's rollout, before its old-policy pass
    # NaN under a tool result (tool_mask 0) or padding is not trained on: accepted
    state.start_round(training=True)
    state.keep([[-1.0, 0.0]])
    ok = state.finish_round(dict(batch, sampling_per_token_logps=torch.tensor([[-1.0, math.nan, math.nan]])))
    assert ok["old_per_token_logps"] is ok["sampling_per_token_logps"]
    state.start_round(training=True)
    state.keep([[None, -1.0, -1.0]])
    with pytest.raises(ValueError, match="no log-prob for 1 trained tokens"):
        state.finish_round(dict(batch, sampling_per_token_logps=torch.tensor([[math.nan, -1.0, -1.0]])))


def test_an_evaluation_round_keeps_trls_pi_old():
    """HF generate records no log-probs outside training: an evaluation round is left to TRL."""
    state = SamplerOldLogps(lambda: (3e-4, 4e-4), ("float32", "float32"))
    state.start_round(training=False)
    state.keep(None)
    with torch.no_grad():
        assert not state.answers_old_pass(is_policy=True, reference_pass=False)
    batch = {"completion_mask": torch.ones(1, 2), "old_per_token_logps": torch.zeros(1, 2)}
    assert state.finish_round(dict(batch)).keys() == batch.keys()


class _OneRank:
    def reduce(self, tensor, reduction):
        return tensor

    def gather(self, tensor):
        return tensor


def _reference_outside_band(logps, old, mask, eps_low, eps_high):
    """Share of sequences whose s_i = exp(mean_t log(pi/pi_old)) (GSPO Eq. 7) lies outside [1 - eps_low, 1 + eps_high],
    float64, one sequence at a time."""
    outside = 0
    for row, old_row, mask_row in zip(logps.double(), old.double(), mask.bool()):
        s = math.exp(float((row[mask_row] - old_row[mask_row]).mean()))
        outside += not (1 - eps_low <= s <= 1 + eps_high)
    return outside / len(logps)


def test_the_gap_is_measured_over_the_micro_batches_before_the_optimizer_step():
    generator = torch.Generator().manual_seed(0)
    band = (3e-4, 4e-4)
    state = SamplerOldLogps(lambda: band, ("bfloat16", "float32"))
    state.start_round(training=True)
    batches = []
    for shift in (1e-5, 1e-3):  # two micro-batches: the first inside the band, the second outside
        old = -torch.rand(4, 5, generator=generator) - 0.1
        mask = torch.ones(4, 5)
        mask[0, 3:] = 0
        logps = old + shift * (1 + torch.rand(4, 5, generator=generator))
        batches.append((logps, old, mask))
    for i, (logps, old, mask) in enumerate(batches):
        state.micro_batch({"old_per_token_logps": old, "completion_mask": mask}, training=True)
        values = state.training_pass(logps, _OneRank(), sync_gradients=i == 1)
        assert (values is None) == (i == 0)
    expected = sum(_reference_outside_band(*b, *band) for b in batches) / 2
    assert values["sampling/seq_outside_clip_band"] == pytest.approx(expected) and expected == 0.5
    tokens = sum(m.sum() for _, _, m in batches)
    abs_log = sum(((lp.double() - o.double()).abs() * m).sum() for lp, o, m in batches) / tokens
    assert values["sampling/abs_log_ratio_mean"] == pytest.approx(float(abs_log), rel=1e-9)
    # measured once per rollout: after the optimizer step the weights are no longer the sampling ones
    state.micro_batch({"old_per_token_logps": old, "completion_mask": mask}, training=True)
    assert state.training_pass(logps, _OneRank(), sync_gradients=True) is None


def test_the_gap_is_compared_with_the_band_in_use():
    """With a band that moves (clip_band="adaptive") the outside-band share and its warning use the band of the
    rollout being measured, not the band the run started with."""
    generator = torch.Generator().manual_seed(1)
    band = [(3e-4, 4e-4)]
    state = SamplerOldLogps(lambda: band[0], ("bfloat16", "float32"))
    old = -torch.rand(8, 5, generator=generator) - 0.1
    mask = torch.ones(8, 5)
    logps = old + 1e-3 * (1 + torch.rand(8, 5, generator=generator))  # every sequence 1e-3 to 2e-3 above pi_old
    shares = []
    for current in ((3e-4, 4e-4), (3e-2, 4e-2)):  # a rollout at the paper's band, then one after it widened
        band[0] = current
        state.start_round(training=True)
        state.micro_batch({"old_per_token_logps": old, "completion_mask": mask}, training=True)
        shares.append(state.training_pass(logps, _OneRank(), sync_gradients=True)["sampling/seq_outside_clip_band"])
    assert shares == [_reference_outside_band(logps, old, mask, 3e-4, 4e-4),
                      _reference_outside_band(logps, old, mask, 3e-2, 4e-2)] == [1.0, 0.0]


def test_the_guard_fires_when_most_sequences_fall_outside_the_band():
    values = {"sampling/seq_outside_clip_band": 0.875, "sampling/abs_log_ratio_mean": 2e-3}
    message = gap_warning(values, (3e-4, 4e-4), ("bfloat16", "float32"), first=True)
    assert "88%" in message and "bfloat16" in message and "vllm_dtype='float32'" in message
    assert "old_logps='trainer'" in message and "first rollout" in message
    at_threshold = dict(values, **{"sampling/seq_outside_clip_band": MOST_OUTSIDE_BAND})
    assert gap_warning(at_threshold, (3e-4, 4e-4), ("bfloat16", "float32"), first=True) is None


# ------------------------------------------------------------------ in GSPOTrainer, HF generate with R3
class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train(tmp_path, tokenizer, **config):
    """Train the tiny MoE with R3; returns (trainer, old-policy forwards run, rounds: (pi_old, sampler log-probs))."""
    config = {"steps_per_generation": 4, "max_steps": 8, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
              "routing_replay": "sampler", **config}
    torch.manual_seed(0)
    trainer = GSPOTrainer(build_model(tokenizer), digit_reward, args=tiny_config(tmp_path, **config),
                          train_dataset=toy_dataset(), processing_class=tokenizer)
    counts = {"generating": False, "scoring_forwards": 0}
    generate = trainer.model.generate

    def generating(*args, **kwargs):
        counts["generating"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            counts["generating"] = False

    trainer.model.generate = generating

    def count(module, args):  # a no-grad forward of the policy outside generate: TRL's old-policy pass
        if not counts["generating"] and not torch.is_grad_enabled():
            counts["scoring_forwards"] += 1

    trainer.model.register_forward_pre_hook(count)
    rounds = []
    score = trainer._generate_and_score_completions

    def scoring(inputs):
        output = score(inputs)
        rounds.append((output.get("old_per_token_logps"), output.get("sampling_per_token_logps")))
        return output

    trainer._generate_and_score_completions = scoring
    warnings = _Warnings()
    hf_logging.get_logger("trl_gspo").addHandler(warnings)
    try:
        trainer.train()
    finally:
        hf_logging.get_logger("trl_gspo").removeHandler(warnings)
    return trainer, counts["scoring_forwards"], rounds, warnings.messages


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token", "grpo"])
def test_trains_on_the_sampler_logps_without_an_old_policy_forward(loss_type, tmp_path, tokenizer):
    """pi_old is the sampler's log-probs in every round, no old-policy forward runs, and since HF generate in float32
    gives the trainer's log-probs to ~1e-6 (measured), training equals the recomputing run's to float rounding."""
    sampler, forwards, rounds, _ = _train(tmp_path / "sampler", tokenizer, loss_type=loss_type, old_logps="sampler")
    assert forwards == 0 and sampler._sampler_logps.skipped_passes == 2 == len(rounds)
    for old, sampled in rounds:
        assert old is not None and torch.equal(old, sampled)
    gaps = [h for h in sampler.state.log_history if "sampling/seq_outside_clip_band" in h]
    assert len(gaps) == 2  # measured on the micro-batches before each rollout's first optimizer step
    assert all(h["sampling/abs_log_ratio_mean"] < 1e-4 and h["sampling/seq_outside_clip_band"] <= 0.25 for h in gaps)
    assert "importance_sampling_ratio" not in str(sampler.state.log_history)

    trainer, forwards, rounds, _ = _train(tmp_path / "trainer", tokenizer, loss_type=loss_type)
    assert forwards > 0 and all(not torch.equal(old, sampled) for old, sampled in rounds)  # recomputed
    assert _losses(sampler) == pytest.approx(_losses(trainer), rel=1e-3, abs=1e-5)


@pytest.mark.slow
def test_on_policy_training_also_takes_pi_old_from_the_sampler(tmp_path, tokenizer):
    """Fully on-policy, TRL runs no old-policy pass and uses pi_old = pi_theta (every ratio 1); with
    old_logps='sampler' the ratio is pi_theta / pi_sampler instead."""
    trainer, forwards, rounds, _ = _train(tmp_path, tokenizer, old_logps="sampler", steps_per_generation=1,
                                          max_steps=2)
    assert forwards == 0 and trainer._sampler_logps.skipped_passes == 0  # TRL had no pass to skip
    assert len(rounds) == 2 and all(torch.equal(old, sampled) for old, sampled in rounds)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["gspo", "grpo"])
def test_a_sampler_gap_that_puts_most_sequences_outside_the_band_is_announced_at_the_first_rollout(
        tmp_path, tokenizer, monkeypatch, loss_type):
    """A sampler whose log-probs sit 0.01 nats above the trainer's on every token (a precision gap): every sequence
    is outside GSPO's band before any update; under GSPO the first rollout says so, once. TRL's token loss clips at
    its own band (0.2 here), which the gap does not reach: the share is logged, no warning."""
    real = rollout.GenerationRecording.per_sample

    def offset(self, *args, **kwargs):
        sampled = real(self, *args, **kwargs)
        sampled.sampler_logps = [logps + 0.01 for logps in sampled.sampler_logps]
        return sampled

    monkeypatch.setattr(rollout.GenerationRecording, "per_sample", offset)
    band = {} if loss_type == "gspo" else {"epsilon": 0.2}
    trainer, _, _, warnings = _train(tmp_path, tokenizer, old_logps="sampler", loss_type=loss_type, **band)
    gaps = [h for h in trainer.state.log_history if "sampling/seq_outside_clip_band" in h]
    assert gaps[0]["sampling/seq_outside_clip_band"] == 1.0
    assert gaps[0]["sampling/abs_log_ratio_mean"] == pytest.approx(0.01, abs=1e-4)
    announced = [m for m in warnings if m.startswith("SAMPLER LIKELIHOODS OUTSIDE THE CLIP BAND")]
    if loss_type == "grpo":
        assert announced == []
        return
    assert len(announced) == 1 and "100% of sequences" in announced[0] and "first rollout" in announced[0]


@pytest.mark.slow
def test_evaluation_runs_with_the_sampler_logps_option(tmp_path, tokenizer):
    """An evaluation round (HF generate records no log-probs there) keeps TRL's pi_old; training rounds skip it."""
    torch.manual_seed(0)
    args = tiny_config(tmp_path, steps_per_generation=4, max_steps=4, per_device_train_batch_size=4,
                       per_device_eval_batch_size=4, routing_replay="sampler", old_logps="sampler",
                       eval_strategy="steps", eval_steps=4)
    trainer = GSPOTrainer(build_model(tokenizer), digit_reward, args=args, train_dataset=toy_dataset(),
                          eval_dataset=toy_dataset(4), processing_class=tokenizer)
    trainer.train()
    assert any("eval_loss" in h for h in trainer.state.log_history)
    assert trainer._sampler_logps.skipped_passes == 1
