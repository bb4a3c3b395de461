"""Every MoE family routing replay supports either trains a step under GSPOTrainer or is refused at construction,
with the option and the fix named (a GraniteMoE once failed inside TRL after 144 s)."""

import math

import pytest
import transformers
import trl
from support.helpers import digit_reward, tiny_config, toy_dataset
from support.moe_families import FAMILIES, build_family_model, family_config

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.trainer.model_checks import aux_loss_enabled, check_moe_aux_loss, model_config

# The families whose config names the expert count other than `num_experts`, which TRL 1.16's aux loss reads.
REFUSED_WITH_AUX_LOSS = {"granitemoe", "llama4"}
# Text-only Llama4ForCausalLM: its base_model_prefix names no submodule, so TRL's log-prob path cannot run it.
REFUSED_BACKBONE = {"llama4"}


def test_aux_loss_rule_follows_trl(tmp_path):
    config = family_config("granitemoe")
    assert aux_loss_enabled(config, GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))
    assert not aux_loss_enabled(config, GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                   router_aux_loss_coef=0.0))
    # DeepSeek-V3 declares no coefficient: TRL then uses 0, nothing to compute
    assert not aux_loss_enabled(family_config("deepseek_v3"),
                                GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))


def test_granite_is_refused_with_the_fix_and_accepted_without_aux_loss(tmp_path):
    args = GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"^`router_aux_loss_coef`.*num_experts.*Fix: set router_aux_loss_coef=0"):
        check_moe_aux_loss(family_config("granitemoe"), args)
    check_moe_aux_loss(family_config("granitemoe"), GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                               router_aux_loss_coef=0.0))
    check_moe_aux_loss(family_config("qwen3_moe"), args)


def test_a_hub_id_is_checked_from_its_config_without_loading_weights(tmp_path, monkeypatch):
    """Refused from the config alone, before TRL's constructor runs: no model, tokenizer or weights are loaded (each
    is made to fail the test), so the refusal costs a config read, however large the model."""
    path = tmp_path / "granite"
    family_config("granitemoe").save_pretrained(path)  # a config alone: a refusal must not need the weights
    args = tiny_config(tmp_path / "out")
    assert type(model_config(str(path), args)).__name__ == "GraniteMoeConfig"
    assert model_config(str(tmp_path / "nothing-here"), args) is None  # TRL reports that one itself

    def loaded(*args, **kwargs):
        pytest.fail("loaded before the refusal")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", loaded)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(loaded))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loaded)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        GSPOTrainer(str(path), digit_reward, args=args, train_dataset=toy_dataset())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_trains_a_step_or_is_refused_at_construction(name, tmp_path, tokenizer):
    model = build_family_model(name)
    model.generation_config = transformers.GenerationConfig(pad_token_id=tokenizer.pad_token_id,
                                                            eos_token_id=tokenizer.eos_token_id)
    args = tiny_config(tmp_path, max_steps=1, steps_per_generation=2, max_completion_length=3)
    if name in REFUSED_WITH_AUX_LOSS:
        with pytest.raises(ValueError, match="Fix: set router_aux_loss_coef=0"):
            GSPOTrainer(model, digit_reward, args=args, train_dataset=toy_dataset(), processing_class=tokenizer)
        args = tiny_config(tmp_path, max_steps=1, steps_per_generation=2, max_completion_length=3,
                           router_aux_loss_coef=0.0)  # the fix the message names: then it trains
    if name in REFUSED_BACKBONE:
        with pytest.raises(ValueError, match=r"^`model`: .*base_model_prefix.*Fix: "):
            GSPOTrainer(model, digit_reward, args=args, train_dataset=toy_dataset(), processing_class=tokenizer)
        return
    trainer = GSPOTrainer(model, digit_reward, args=args, train_dataset=toy_dataset(), processing_class=tokenizer)
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(logged["loss"]) and "gspo/ratio_mean" in logged


def test_a_model_neither_local_nor_cached_nor_reachable_is_refused_in_one_line(monkeypatch, tmp_path):
    """Offline, or with the Hub out of reach, a Hub id that is not cached fails at once naming `model`, instead of
    transformers' retries and traceback; a cached one, a local path and a missing path (transformers says so at once)
    pass."""
    from huggingface_hub import constants
    from support.helpers import hub_out_of_reach

    from trl_gspo.trainer.model_checks import ModelSourceError, check_model_source

    cache = tmp_path / "cache"
    hub_out_of_reach(monkeypatch, cache)
    with pytest.raises(ModelSourceError, match=r"^`model`: 'org/not-here' is neither a local path nor a cached "
                                               r"model, and the Hub cannot be reached from here \(127\.0\.0\.1:\d+: "
                                               r"Connection refused\)\. Fix: check the network"):
        check_model_source("org/not-here")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"offline mode is on \(HF_HUB_OFFLINE\)\. Fix: give a local path"):
        check_model_source("org/not-here")  # an OSError where transformers raises one, and a ValueError
    snapshot = cache / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--org--cached" / "refs").mkdir()
    (cache / "models--org--cached" / "refs" / "main").write_text("0" * 40)
    check_model_source("org/cached")
    check_model_source(str(tmp_path))
    check_model_source(str(tmp_path / "nothing-here"))


def test_the_trainer_refuses_an_unreachable_model_before_loading_anything(monkeypatch, tmp_path):
    from support.helpers import hub_out_of_reach

    from trl_gspo.trainer.model_checks import ModelSourceError

    hub_out_of_reach(monkeypatch, tmp_path / "cache")

    def loaded(*args, **kwargs):
        pytest.fail("transformers asked the Hub before the refusal")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", loaded)
    monkeypatch.setattr(trl.GRPOTrainer, "__init__", loaded)
    with pytest.raises(ModelSourceError, match="^`model`: 'org/not-here' is neither a local path nor a cached model"):
        GSPOTrainer("org/not-here", digit_reward, args=tiny_config(tmp_path / "out"), train_dataset=toy_dataset())
