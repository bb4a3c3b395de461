"""GSPOConfig presets and early, clear errors for options GSPO cannot honour."""

import copy
import functools
import re
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.helpers import digit_reward, tiny_config, toy_dataset
from trl import GRPOConfig

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.config import BatchShape, validate_gspo_args

CPU = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
def test_paper_presets_for_gspo_types(loss_type):
    cfg = GSPOConfig(**CPU, loss_type=loss_type, gradient_accumulation_steps=2)
    assert (cfg.epsilon, cfg.epsilon_high, cfg.beta) == (3e-4, 4e-4, 0.0)
    assert cfg.importance_sampling_level == "sequence"
    assert cfg.steps_per_generation == 8  # 4 mini-batches per rollout batch


def test_explicit_values_win_over_presets():
    cfg = GSPOConfig(**CPU, epsilon=1e-3, epsilon_high=2e-3, beta=0.01, steps_per_generation=3)
    assert (cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.steps_per_generation) == (1e-3, 2e-3, 0.01, 3)
    cfg = GSPOConfig(**CPU, generation_batch_size=16, per_device_train_batch_size=8)
    assert cfg.steps_per_generation == 2  # derived from generation_batch_size, not overridden


def test_trl_loss_types_keep_trl_defaults():
    cfg = GSPOConfig(**CPU, loss_type="dapo")
    ref = GRPOConfig(**CPU, loss_type="dapo")
    for name in ("epsilon", "epsilon_high", "beta", "importance_sampling_level", "steps_per_generation"):
        assert getattr(cfg, name) == getattr(ref, name), name


BAD = [
    (dict(loss_type="gsop"), "loss_type"),
    (dict(epsilon=0.0), "epsilon"),
    (dict(epsilon=-3e-4), "epsilon"),
    (dict(epsilon=1.5), "epsilon"),
    (dict(epsilon_high=-1.0), "epsilon_high"),
    (dict(beta=-0.1), "beta"),
    (dict(importance_sampling_level="token"), "importance_sampling_level"),
    (dict(importance_sampling_level="sentence"), "importance_sampling_level"),
    (dict(delta=1.0004), "delta"),  # not above 1 + epsilon_high: it would cap inside the clip band
    (dict(delta=0.5), "delta"),
    (dict(epsilon_high=0.3, delta=1.2), "delta"),
]


@pytest.mark.parametrize("options,option_name", BAD)
def test_bad_options_raise_naming_the_option(options, option_name):
    with pytest.raises(ValueError, match=f"`{option_name}`.*Fix:"):
        GSPOConfig(**CPU, **options)


@pytest.mark.parametrize("accepted, refused", [
    (dict(delta=1.002), dict(delta=1.0004)),  # above 1 + epsilon_high, or at it (it would cap inside the band)
    # TRL's own semantics for its loss types
    (dict(loss_type="grpo", epsilon_high=0.3, delta=1.2), dict(epsilon_high=0.3, delta=1.2)),
    (dict(importance_sampling_level="sequence"), dict(importance_sampling_level="token")),
])
def test_options_beside_a_refusal_are_accepted(accepted, refused):
    """Each accepted value sits next to a refused one of the same option: the check draws the line there, and the
    accepted config also passes the trainer's own validation. (`use_adaptive_entropy` with a GSPO type trains:
    tests/test_trainer.py.)"""
    validate_gspo_args(GSPOConfig(**CPU, **accepted))  # raises ValueError if refused
    with pytest.raises(ValueError, match="Fix:"):
        GSPOConfig(**CPU, **refused)


@pytest.mark.parametrize("options,option_name", [(dict(loss_type="gsop"), "loss_type"), (dict(loss_type="gspo", epsilon=0.0), "epsilon")])
def test_trainer_validates_plain_grpo_config_before_loading_anything(options, option_name):
    cfg = GRPOConfig(**CPU)
    for key, value in options.items():
        setattr(cfg, key, value)  # GRPOConfig itself does not validate these
    # The model path does not exist: reaching it would raise OSError, so a ValueError proves we failed first.
    with pytest.raises(ValueError, match=f"`{option_name}`"):
        GSPOTrainer("/nonexistent/model", digit_reward, args=cfg, train_dataset=toy_dataset())


def test_grpo_config_token_level_is_accepted_for_gspo(tmp_path, tokenizer):
    """TRL's GRPOConfig defaults importance_sampling_level to 'token'; it cannot tell an explicit value apart, so
    gspo accepts it (the ratio is per sequence by construction) rather than failing every GRPOConfig user."""
    cfg = tiny_config(tmp_path, config_cls=GRPOConfig, loss_type="gspo")
    assert cfg.importance_sampling_level == "token"
    validate_gspo_args(cfg)  # raises ValueError if refused
    with pytest.raises(ValueError, match="`importance_sampling_level`"):  # a GSPOConfig says it on purpose
        GSPOConfig(**CPU, importance_sampling_level="token")


class _TokenCreditTrainer(GSPOTrainer):
    def token_advantages(self, inputs, mask):
        return super().token_advantages(inputs, mask) * mask


@pytest.mark.parametrize("loss_type", ["gspo", "grpo", "dapo"])
def test_token_advantages_override_needs_gspo_token(loss_type):
    """An override only gspo_token calls would be silently ignored under any other loss type: refused before the
    model is loaded (the path does not exist, so reaching it would raise OSError instead)."""
    cfg = GSPOConfig(**CPU, loss_type=loss_type)
    with pytest.raises(ValueError, match=r"`loss_type`: _TokenCreditTrainer overrides `token_advantages`.*"
                                         r"Fix: set loss_type='gspo_token'"):
        _TokenCreditTrainer("/nonexistent/model", digit_reward, args=cfg, train_dataset=toy_dataset())


def test_token_advantages_override_accepted_under_gspo_token():
    cfg = GSPOConfig(**CPU, loss_type="gspo_token")
    with pytest.raises(OSError):  # passes our check and reaches model loading
        _TokenCreditTrainer("/nonexistent/model", digit_reward, args=cfg, train_dataset=toy_dataset())


@pytest.mark.parametrize("config", ["GSPOConfig", "AsyncGSPOConfig"])
@pytest.mark.parametrize("options,option", [(dict(), "bf16"), (dict(bf16=True), "bf16"),
                                            (dict(bf16=False, bf16_full_eval=True), "bf16_full_eval")])
def test_bf16_without_a_gpu_is_one_line_naming_use_cpu(config, options, option, fake_accelerator):
    """The README's `GSPOConfig(output_dir=..., loss_type="gspo", ...)` on a CPU: bf16 (TRL's default when unset) is
    refused by our check, before transformers' "Your setup doesn't support bf16/gpu", naming use_cpu and the fix.
    No GPU is faked, so this runs on a GPU machine too; with one (faked) the same config builds."""
    import trl_gspo
    from trl_gspo.config import BF16DeviceError

    cls = getattr(trl_gspo, config)
    fake_accelerator(False)
    with pytest.raises(BF16DeviceError) as raised:
        cls(output_dir="unused", loss_type="gspo", per_device_train_batch_size=8, num_generations=8, **options)
    message = str(raised.value)
    assert message.startswith(f"`{option}`:") and "\n" not in message and "bf16/gpu" not in message
    assert f"use_cpu=True and {option}=False" in message and f"--use_cpu true --{option} false" in message
    # what the message says works: on a CPU, with use_cpu (the CPU's bf16 autocast) or with bf16 off
    assert cls(output_dir="unused", use_cpu=True, **options).use_cpu
    assert not cls(output_dir="unused", **{**options, option: False}).bf16_full_eval
    fake_accelerator(True)
    assert cls(output_dir="unused", **options).bf16 == (option == "bf16")


def _parents():
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_gspo import AsyncGSPOConfig

    return {"GSPOConfig": (GSPOConfig, GRPOConfig), "AsyncGSPOConfig": (AsyncGSPOConfig, AsyncGRPOConfig)}


def _use_cpu_as_trl_tests_do(monkeypatch):
    """TRL's own tests/conftest.py, autouse fixture `force_use_cpu_without_accelerator`: on a machine without an
    accelerator, every TRL config gets `use_cpu = True` just before `_BaseConfig.__post_init__` runs."""
    from trl.trainer.base_config import _BaseConfig

    original = _BaseConfig.__post_init__

    def post_init(self):
        self.use_cpu = True
        original(self)

    monkeypatch.setattr(_BaseConfig, "__post_init__", post_init)


@pytest.mark.parametrize("config", ["GSPOConfig", "AsyncGSPOConfig"])
def test_trl_test_suite_pattern_builds_both_configs(config, monkeypatch, fake_accelerator):
    """Code written for TRL's configs, under the hook TRL's test suite puts on `_BaseConfig.__post_init__`: our
    configs build wherever their parents do (bf16 left unset, TRL's default True, on a machine without a GPU)."""
    ours, parent = _parents()[config]
    fake_accelerator(False)
    _use_cpu_as_trl_tests_do(monkeypatch)
    expected = parent(output_dir="unused", report_to="none")
    built = ours(output_dir="unused", report_to="none")
    assert (built.bf16, built.use_cpu) == (expected.bf16, expected.use_cpu) == (True, True)


@pytest.mark.parametrize("config", ["GSPOConfig", "AsyncGSPOConfig"])
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "trl-tests-hook"])
@pytest.mark.parametrize("accelerator", [False, True], ids=["no-gpu", "gpu"])
def test_precision_options_refused_exactly_where_the_parent_refuses(config, hooked, accelerator, monkeypatch,
                                                                    fake_accelerator):
    """Every combination of bf16, fp16 and use_cpu (each unset, True or False): our config raises where its TRL
    parent raises and builds where it builds; its error is one line of ours naming the option and the fix, with the
    parent's error chained (`__cause__`)."""
    import itertools

    ours, parent = _parents()[config]
    fake_accelerator(accelerator)
    if hooked:
        _use_cpu_as_trl_tests_do(monkeypatch)
    for values in itertools.product((None, True, False), repeat=3):
        options = {name: value for name, value in zip(("bf16", "fp16", "use_cpu"), values) if value is not None}
        try:
            expected = parent(output_dir="unused", report_to="none", **options)
        except ValueError as err:
            with pytest.raises(ValueError) as raised:
                ours(output_dir="unused", report_to="none", **options)
            message = str(raised.value)
            assert message.startswith("`") and "Fix:" in message and "\n" not in message, (options, message)
            assert str(raised.value.__cause__) == str(err), options
            continue
        built = ours(output_dir="unused", report_to="none", **options)
        assert (built.bf16, built.fp16, built.use_cpu) == (expected.bf16, expected.fp16, expected.use_cpu), options


# A typo in each enumerated option transformers refuses at config time ("X is not a valid SaveStrategy, please select
# one of [...]"). The bad value may equal another field's value (lr_scheduler_type defaults to "linear",
# logging_strategy to "steps"): the refusal must still name the field that holds the typo.
TRANSFORMERS_TYPOS = [
    (dict(save_strategy="linear"), "save_strategy"),
    (dict(hub_strategy="steps"), "hub_strategy"),
    (dict(logging_strategy="epoch_"), "logging_strategy"),
    (dict(eval_strategy="step"), "eval_strategy"),
    (dict(lr_scheduler_type="cosin"), "lr_scheduler_type"),
    (dict(optim="adamw_torh"), "optim"),
    (dict(debug="underflow_overflo"), "debug"),
    (dict(debug="tpu_metrics_debug underflow_overflo"), "debug"),  # transformers splits debug on spaces
]


@pytest.mark.parametrize("config", ["GSPOConfig", "AsyncGSPOConfig"])
@pytest.mark.parametrize("bad,option", TRANSFORMERS_TYPOS)
def test_typo_in_transformers_enumerated_option_names_that_option(config, bad, option, tmp_path):
    cls = _parents()[config][0]
    with pytest.raises(ValueError) as raised:
        cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **bad)
    typo = bad[option].split()[-1]
    message = str(raised.value)
    assert message.startswith(f"`{option}`: unknown value {typo!r}") and "Fix: use one of" in message, message
    assert "\n" not in message and raised.value.__cause__ is not None


@pytest.mark.parametrize("bad,suggestion", [
    (dict(logging_strategy="epoch_"), "epoch"), (dict(eval_strategy="step"), "steps"),
    (dict(lr_scheduler_type="cosin"), "cosine"), (dict(optim="adamw_torh"), "adamw_torch")])
def test_typo_in_transformers_enumerated_option_suggests_the_nearest(bad, suggestion, tmp_path):
    with pytest.raises(ValueError, match=f"did you mean {suggestion!r}"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **bad)


@pytest.mark.parametrize("bad,option", [
    (dict(loss_type="gsop"), "loss_type"), (dict(importance_sampling_level="sequense"), "importance_sampling_level"),
    (dict(routing_replay="olde"), "routing_replay"), (dict(old_logps="sampeler"), "old_logps"),
    (dict(vllm_dtype="float23"), "vllm_dtype"), (dict(clip_band="adaptiv"), "clip_band")])
def test_typo_in_our_enumerated_option_names_that_option(bad, option, tmp_path):
    with pytest.raises(ValueError) as raised:
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **bad)
    assert str(raised.value).startswith(f"`{option}`: unknown value {bad[option]!r} (did you mean"), str(raised.value)


def test_report_to_typo_is_not_refused_at_config_time(tmp_path):
    """transformers does not check `report_to` in `TrainingArguments.__post_init__` (it only wraps it in a list); the
    Trainer refuses an unknown integration when it builds its callbacks."""
    from transformers.integrations import get_reporting_integration_callbacks

    cfg = GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="wandbb")
    assert cfg.report_to == ["wandbb"]
    with pytest.raises(ValueError, match="wandbb is not supported"):
        get_reporting_integration_callbacks(cfg.report_to)


@pytest.mark.parametrize("options, message", [
    (dict(per_device_train_batch_size=32, num_generations=7),  # the user set num_generations: named first
     "`num_generations`: num_generations 7 does not divide the rollout batch of 128 completions "
     "(per_device_train_batch_size 32 x 1 process(es) x steps_per_generation 4, GSPOConfig's 4 x "
     "gradient_accumulation_steps): each prompt's group must fall whole in one rollout batch. Fix: set "
     "num_generations=8 or 4, or per_device_train_batch_size=35 or 28, or generation_batch_size=224 or 448, or "
     "steps_per_generation=7 or 14 (each alone)."),
    (dict(per_device_train_batch_size=31),  # num_generations at TRL's default: the batch size is what was set
     "`per_device_train_batch_size`: num_generations 8 does not divide the rollout batch of 124 completions "
     "(per_device_train_batch_size 31 x 1 process(es) x steps_per_generation 4, GSPOConfig's 4 x "
     "gradient_accumulation_steps): each prompt's group must fall whole in one rollout batch. Fix: set "
     "per_device_train_batch_size=30 or 32, or num_generations=4 or 2, or generation_batch_size=248 or 496, or "
     "steps_per_generation=8 or 16 (each alone)."),
    (dict(per_device_train_batch_size=31, num_generations=8),  # set to the default: still named as set
     "`num_generations`: num_generations 8 does not divide"),
    (dict(generation_batch_size=30, per_device_train_batch_size=6, num_generations=8),  # a set generation batch
     "`num_generations`: num_generations 8 does not divide the rollout batch of 30 completions "
     "(generation_batch_size): each prompt's group must fall whole in one rollout batch. Fix: set num_generations=6 "
     "or 10, or generation_batch_size=24 or 48 (each alone)."),
    (dict(generation_batch_size=30, per_device_train_batch_size=4),  # 28 would hold micro-batches, not groups of 8
     "`generation_batch_size`: 30 is not a whole number of optimizer micro-batches (per_device_train_batch_size 4 x "
     "1 process(es) = 4). Fix: set generation_batch_size=32 or 24 (each alone)."),
    (dict(generation_batch_size=100, per_device_train_batch_size=8),
     "`generation_batch_size`: 100 is not a whole number of optimizer micro-batches (per_device_train_batch_size 8 x "
     "1 process(es) = 8). Fix: set generation_batch_size=96 or 104 (each alone)."),
    (dict(generation_batch_size=64, steps_per_generation=2),
     "`generation_batch_size`: both generation_batch_size (64) and steps_per_generation (2) are set; each fixes the "
     "rollout batch. Fix: set only one of them."),
    (dict(per_device_eval_batch_size=5, eval_strategy="steps", do_eval=True, num_generations=4),
     "`per_device_eval_batch_size`: 5 x 1 process(es) does not hold whole groups of 4 completions "
     "(num_generations). Fix: per_device_eval_batch_size=4 or 8."),
])
def test_trls_batch_shape_refusals_name_the_option_set_and_the_values_that_work(options, message):
    """TRL raises these in its own `__post_init__` naming derived sizes ("generation_batch_size (128) must be
    divisible by num_generations (7)"); GSPOConfig raises at the same point, one line, chained to TRL's error, and
    each value its fix names gives a valid config."""
    with pytest.raises(ValueError) as raised:
        GSPOConfig(**CPU, **options)
    assert str(raised.value).startswith(message) and (message.endswith(".") or "Fix: set" in str(raised.value))
    cause = raised.value.__cause__
    assert isinstance(cause, ValueError) and ("must be divisible" in str(cause) or "both configured" in str(cause))
    for option, value in suggested_fixes(str(raised.value)):  # every value the fix names works
        GSPOConfig(**CPU, **{**options, option: value})


@given(per_device=st.integers(1, 12), processes=st.integers(1, 8), num_generations=st.integers(2, 16),
       accumulation=st.integers(1, 4), loss_type=st.sampled_from(["gspo", "grpo"]),
       rollout=st.one_of(st.none(), st.tuples(st.sampled_from(["generation_batch_size", "steps_per_generation"]),
                                              st.integers(1, 160))),
       num_generations_given=st.booleans())
def test_every_batch_shape_a_refusal_suggests_is_accepted(per_device, processes, num_generations, accumulation,
                                                          loss_type, rollout, num_generations_given):
    """For any batch shape (per-device batch, processes, generations, accumulation, a generation batch or steps per
    generation or neither): GSPOConfig accepts it exactly when `BatchShape` says TRL's rule holds, and when it refuses,
    every value its fix suggests, set alone, is accepted, over any number of processes (world size patched)."""
    options = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                   loss_type=loss_type, **dict([rollout] if rollout else []))
    if num_generations_given or num_generations != 8:  # 8: TRL's default, left unset half the time
        options["num_generations"] = num_generations
    world = mock.patch("transformers.TrainingArguments.world_size", new_callable=mock.PropertyMock,
                       return_value=processes)
    with world:
        try:
            config = GSPOConfig(**CPU, **options)
        except ValueError as err:
            refusal = str(err)
        else:
            refusal = None
            assert config.generation_batch_size % (per_device * processes) == 0
        presets = {"steps_per_generation"} if loss_type == "gspo" and "generation_batch_size" not in options and \
            "steps_per_generation" not in options else set()
        shape = BatchShape(per_device, processes, num_generations, options.get("generation_batch_size"),
                           options.get("steps_per_generation", 4 * accumulation if presets else None), accumulation,
                           bool(presets))
        assert shape.valid() == (refusal is None), refusal
        if refusal is None:
            return
        assert refusal.startswith("`") and "Fix:" in refusal
        fixes = suggested_fixes(refusal)
        assert fixes or "both generation_batch_size" in refusal, refusal
        for option, value in fixes:
            GSPOConfig(**CPU, **{**options, option: value})


def suggested_fixes(message: str) -> list[tuple[str, int]]:
    """Each (option, value) a batch-shape refusal suggests: "Fix: set a=1 or 2, or b=3 (each alone)."."""
    fix = message.partition("Fix: ")[2]
    return [(option, int(value)) for option, values in re.findall(r"(\w+)=(\d+(?: or \d+)*)", fix)
            for value in values.split(" or ")]


def range_rows() -> list[str]:
    """docs/own_task.md's table of valid values, from `NUMBER_RANGES`: one row per range, its fields sorted."""
    from trl_gspo.config import NUMBER_RANGES

    fields: dict[str, list[str]] = {}
    for name, valid in NUMBER_RANGES.items():
        fields.setdefault(valid.text(), []).append(name)
    return [f"| {text} | {', '.join(f'`{name}`' for name in sorted(names))} |" for text, names in sorted(fields.items())]


@functools.cache
def _cpu_config() -> GSPOConfig:
    return GSPOConfig(**CPU)


def test_the_docs_table_of_valid_values_is_the_codes():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "own_task.md").read_text()
    table = page.split("<!-- ranges:start -->")[1].split("<!-- ranges:end -->")[0].strip().splitlines()
    assert table[2:] == range_rows(), "\n".join(range_rows())


@pytest.mark.parametrize("field_name", ["max_steps", "num_train_epochs", "learning_rate", "temperature", "top_p",
                                        "adam_beta2", "vllm_gpu_memory_utilization", "num_generations"])
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6)))
def test_a_number_outside_its_range_is_refused_naming_the_field(field_name, value):
    """Any value: accepted by the range check exactly when `NUMBER_RANGES` holds it; refused naming the field and a
    fix otherwise (by both configs, before TRL's own checks)."""
    from trl_gspo.config import NUMBER_RANGES, _check_types

    valid = NUMBER_RANGES[field_name]
    args = copy.copy(_cpu_config())
    object.__setattr__(args, field_name, value)
    if valid.holds(value):
        _check_types(args)
        assert value in valid.also or (value == value and abs(value) != float("inf"))
    else:
        with pytest.raises(ValueError, match=rf"^`{field_name}` must be .*, got .*\. Fix: e\.g\. {field_name}="):
            _check_types(args)


@pytest.mark.parametrize("field_name, value, message", [
    ("sapo_temperature_pos", 0.0, "must be > 0, got 0.0"), ("vespo_k_neg", -1.0, "must be >= 0, got -1.0"),
    ("vespo_lambda_pos", "3", "must be a number, got '3' (str)")])
def test_trls_sapo_and_vespo_options_are_checked_by_both_configs(field_name, value, message):
    """TRL's SAPO / VESPO options: GSPOConfig (for TRL's own sapo / vespo losses) and AsyncGSPOConfig refuse the same
    values in the same line (`NUMBER_RANGES`)."""
    from trl_gspo import AsyncGSPOConfig

    for config in (GSPOConfig, AsyncGSPOConfig):
        with pytest.raises((ValueError, TypeError), match=rf"^`{field_name}` {re.escape(message)}\. Fix: "):
            config(**{**CPU, field_name: value})
