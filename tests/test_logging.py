"""Logging and rewards: `report_to: tensorboard` works offline; the recipes' math rewards resolve and score."""

import pytest
from support.helpers import skip_without_math_verify
from support.helpers import digit_reward, tiny_config, toy_dataset

from trl_gspo import GSPOTrainer
from trl_gspo.quickstart.model import build_model

pytestmark = pytest.mark.slow


def test_tensorboard_event_file_holds_gspo_metrics(tmp_path, tokenizer):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    args = tiny_config(tmp_path, report_to="tensorboard", max_steps=4,
                       steps_per_generation=4, per_device_train_batch_size=4, learning_rate=1e-2)
    trainer = GSPOTrainer(build_model(tokenizer), digit_reward, args=args, train_dataset=toy_dataset(),
                          processing_class=tokenizer)
    trainer.train()
    trainer.accelerator.end_training()  # flush and close the writer, as the end of a script does

    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file written"
    scalars = {}
    for path in events:
        accumulator = event_accumulator.EventAccumulator(str(path))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars[tag] = [event.value for event in accumulator.Scalars(tag)]
    assert len(scalars.get("train/reward", [])) == 1  # TRL logs rollout metrics once per generation round
    for tag in ("train/loss", "train/clip_ratio/region_mean", "train/gspo/ratio_mean", "train/gspo/log_ratio_abs_max",
                "train/gspo/clipped_token_fraction", "train/routing/drift_mean"):
        assert tag in scalars, f"{tag} missing; have {sorted(scalars)}"
        assert len(scalars[tag]) == 4  # one value per optimizer step
    assert max(scalars["train/routing/drift_mean"]) > 0  # real values, not placeholders


def test_math_recipe_rewards_resolve_and_score():
    """The real-model recipes name TRL's accuracy_reward (math-verify) and think_format_reward."""
    from types import SimpleNamespace

    from trl_gspo.launch.rewards import resolve_rewards

    skip_without_math_verify(["accuracy_reward"])

    accuracy, think_format = resolve_rewards(SimpleNamespace(
        reward_model_name_or_path=None, reward_funcs=["accuracy_reward", "think_format_reward"]))
    completions = [[{"role": "assistant", "content": "<think>6*7</think> The answer is \\boxed{42}"}],
                   [{"role": "assistant", "content": "\\boxed{41}"}]]
    assert accuracy(completions, solution=["42", "42"]) == [1.0, 0.0]
    assert think_format(completions) == [1.0, 0.0]
