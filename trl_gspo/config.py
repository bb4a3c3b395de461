"""`GSPOConfig`: TRL's `GRPOConfig` plus the GSPO loss types, the paper's presets and early validation."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

from transformers.utils import logging
from trl import GRPOConfig

from .sampling.old_logps import OLD_LOGPS_SOURCES, check_old_logps_option

logger = logging.get_logger(__name__)  # transformers' logger: adds `warning_once`

GSPO_LOSS_TYPES = ("gspo", "gspo_token")
# Loss types TRL 1.16 implements itself; GSPOTrainer hands these to `GRPOTrainer._compute_loss` untouched.
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

# Every field TRL's `GRPOConfig` adds to `transformers.TrainingArguments`, sorted by what gspo types do with it.
# tests/test_trl_contract.py fails when TRL adds, removes or renames one, until it is placed here (docs/trl_contract.md).
GSPO_LOSS_FIELDS = (
    # Shape the policy loss; gspo types honour each as TRL's sequence-level "grpo" does (parity-tested).
    "loss_type", "epsilon", "epsilon_high", "delta", "beta", "use_bias_correction_kl", "importance_sampling_level",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
    "entropy_coef_delta", "entropy_target", "off_policy_mask_threshold", "router_aux_loss_coef",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
    # Decide what reaches the loss (old-policy pass, masks), applied by TRL before `_compute_loss` for every type.
    "steps_per_generation", "generation_batch_size", "num_iterations", "mask_truncated_completions",
    "cast_lm_head_to_fp32",
)
OTHER_LOSS_TYPE_FIELDS = (
    # Parameters of other TRL loss types only; gspo types do not read them.
    "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg",
)
NON_LOSS_FIELDS = (
    # Model loading and the reference model (TRL's own code, any loss type).
    "model_init_kwargs", "trust_remote_code", "disable_dropout", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    # Data, generation and tools.
    "shuffle_dataset", "pad_to_multiple_of", "num_generations", "num_generations_eval", "max_completion_length",
    "ds3_gather_for_generation", "temperature", "top_p", "top_k", "min_p", "generation_kwargs",
    "chat_template_kwargs", "repetition_penalty", "cache_implementation", "max_tool_calling_iterations",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged",
    # vLLM engine and server.
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
    # Rewards and advantages: computed by TRL in `_generate_and_score_completions`, identically for every loss type.
    "reward_weights", "multi_objective_aggregation", "scale_rewards",
    # Logging.
    "log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
)
# Fields `GSPOConfig` adds to `GRPOConfig`.
GSPO_CONFIG_FIELDS = ("routing_replay", "routing_replay_offload", "routing_replay_min_agreement", "vllm_dtype",
                      "vllm_server_stall_timeout", "old_logps", "merge_adapters_for_rollout", "exact_lora_merge",
                      "clip_band", "clip_band_target", "clip_band_min", "clip_band_max", "rank_wait_timeout")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MIN_ROUTE_AGREEMENT = 0.75  # routing_replay_min_agreement's default (a plain GRPOConfig has no such field)
DEFAULT_SERVER_STALL_TIMEOUT = 300.0  # vllm_server_stall_timeout's default, likewise
DEFAULT_RANK_WAIT_TIMEOUT = 600.0  # rank_wait_timeout's default: well under the process group's 1800 s
RANK_WAIT_TIMEOUT_FIELD = dict(
    default=DEFAULT_RANK_WAIT_TIMEOUT,
    metadata={
        "help": "Several processes: seconds a phase in which every rank must arrive (a weight sync, computing "
        "rewards) may last on any rank before every rank stops with an error naming the phase "
        "(trl_gspo/ranks/watch.py). A rank that never arrives (a reward function that never returns) would otherwise "
        "hold the others until the process group's timeout (`ddp_timeout`, 1800 s). Raise it for a slower reward "
        "or weight sync; 0 turns the bound off. A rank that raises stops the others at once, whatever this is."
    },
)

# GSPO paper (arXiv 2507.18071), Section 5.1: clip range 3e-4 / 4e-4, no KL term, and each rollout batch
# split into 4 mini-batches for gradient updates.
PAPER_EPSILON_LOW = 3e-4
PAPER_EPSILON_HIGH = 4e-4
PAPER_BETA = 0.0
PAPER_MINI_BATCHES_PER_ROLLOUT = 4


# The adaptive clip band's options, shared by GSPOConfig and AsyncGSPOConfig (trl_gspo/trainer/clip_band.py).
CLIP_BAND_HELP = (
    "GSPO's clip band. 'fixed': epsilon / epsilon_high throughout (unset: the paper's 3e-4 / 4e-4). 'adaptive' "
    "(opt-in): starts there and moves after every optimizer step toward clipping clip_band_target of the tokens that "
    "can be clipped (those of groups whose rewards differ), within [clip_band_min, clip_band_max] and above the "
    "sampler's measured noise (docs/gspo.md#a-clip-band-set-by-the-run). TRL's loss types: 'fixed', the only value "
    "they take.")
CLIP_BAND_FIELDS = {
    "clip_band": dict(default="fixed", metadata={"help": CLIP_BAND_HELP}),
    "clip_band_target": dict(default=0.15, metadata={
        "help": "With clip_band='adaptive': the share of tokens of groups whose rewards differ the band aims to "
        "clip (the GSPO paper reports about 15 percent of tokens clipped with its band on Qwen3-30B-A3B)."}),
    "clip_band_min": dict(default=1e-5, metadata={
        "help": "With clip_band='adaptive': the narrowest epsilon the band may reach."}),
    "clip_band_max": dict(default=0.2, metadata={
        "help": "With clip_band='adaptive': the widest epsilon the band may reach (TRL's token-level band): a "
        "diverging policy still meets a trust region. A two-sided cap `delta` must lie above the widest band."}),
}


def recording_given_fields(config_class):
    """Wrap a config dataclass's `__init__` to keep the names of the fields passed (`given_fields`), so that a
    refusal can name the option the user set, even one set to its default (`num_generations=8`). HfArgumentParser
    (recipes, command lines) passes every field: there all count as given."""
    init = config_class.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        self.given_fields = frozenset(kwargs)
        init(self, *args, **kwargs)

    config_class.__init__ = __init__
    return config_class


@recording_given_fields
@dataclass
class GSPOConfig(GRPOConfig):
    """Configuration for `GSPOTrainer`: every `trl.GRPOConfig` field, plus GSPO's loss types and presets.

    For `loss_type="gspo"` or `"gspo_token"`, fields left unset take the GSPO paper's values (arXiv 2507.18071,
    Section 5.1): `epsilon=3e-4`, `epsilon_high=4e-4`, `beta=0.0`, and `steps_per_generation =
    4 * gradient_accumulation_steps` (each rollout batch is split into 4 mini-batches, so 3 of every 4 updates are
    off-policy). The band stays fixed (`clip_band="fixed"`, the paper's objective); `clip_band="adaptive"` lets the
    run set it. A value you set explicitly is always kept. For TRL's own loss types the defaults are TRL's.

    Parameters:
        loss_type (`str`, defaults to `"gspo"`):
            `"gspo"`: sequence-level ratio and clipping, Eq. 5 and 7. `"gspo_token"`: GSPO-token, Eq. 13-14, same
            value and gradient as `"gspo"` with per-sequence advantages, and accepts per-token advantages (see
            `GSPOTrainer.token_advantages`). Any TRL loss type (`"grpo"`, `"dapo"`, `"dr_grpo"`, `"bnpo"`,
            `"cispo"`, `"sapo"`, `"luspo"`, `"vespo"`) runs TRL's own implementation.
        epsilon (`float`, *optional*):
            Lower clip range: ratios below `1 - epsilon` are clipped. GSPO paper: `3e-4`. TRL default: `0.2`.
        epsilon_high (`float`, *optional*):
            Upper clip range: ratios above `1 + epsilon_high` are clipped. GSPO paper: `4e-4`. For TRL's loss
            types, `None` means "same as `epsilon`".
        importance_sampling_level (`str`, *optional*):
            For gspo types the ratio is per sequence by definition; `None` resolves to `"sequence"` and
            `"token"` is refused. For TRL loss types `None` resolves to TRL's default `"token"`.
        steps_per_generation (`int`, *optional*):
            Mini-batches (optimizer micro-steps) per rollout batch. For gspo types `None` resolves to
            `4 * gradient_accumulation_steps` (4 optimizer updates per rollout, as in the paper) unless
            `generation_batch_size` is set. Equal to `gradient_accumulation_steps` with `num_iterations=1`
            means fully on-policy training: every ratio is exactly 1 and GSPO coincides with GRPO.
        old_logps (`str`, defaults to `"trainer"`):
            Where pi_old comes from. `"trainer"`: TRL's old-policy pass recomputes it. `"sampler"`: the sampler's
            per-token log-probs, and no old-policy pass runs (paper Sec. 5.4; `trl_gspo.sampling.old_logps`).
            Measured safe only with a sampler in the trainer's precision (docs/gspo.md).
        merge_adapters_for_rollout (`bool`, defaults to `True`):
            With LoRA on the experts: HF generate and the old-policy pass with the experts' adapters folded once
            per rollout, bit for bit the active forward (PEFT otherwise rebuilds them in every forward). The frozen
            base is never written; costs one copy of the adapted expert weights during a rollout (docs/lora.md).
        exact_lora_merge (`bool`, defaults to `True`):
            With LoRA and vLLM: weight syncs send `W + delta` built out of place, one parameter at a time, so the
            frozen base stays bit for bit unchanged (TRL's in-place merge and unmerge drift it in bf16).
        clip_band (`str`, defaults to `"fixed"`):
            `"fixed"`: the paper's band (or `epsilon` / `epsilon_high` as set) throughout. `"adaptive"` (opt-in): the
            band starts at `epsilon` / `epsilon_high` and moves after every optimizer step toward clipping
            `clip_band_target` (0.15) of the tokens of groups whose rewards differ, within `[clip_band_min,
            clip_band_max]` (1e-5, 0.2) and above the sampler's measured noise, the same on every rank and saved with
            checkpoints (docs/gspo.md#a-clip-band-set-by-the-run).
    """

    loss_type: str = field(
        default="gspo",
        metadata={
            "help": "Loss formulation. 'gspo' (sequence-level ratio, GSPO paper Eq. 5/7), 'gspo_token' (GSPO-token, "
            "Eq. 13-14, accepts per-token advantages), or any TRL loss type: 'grpo', 'dapo', 'dr_grpo', 'bnpo', "
            "'cispo', 'sapo', 'luspo', 'vespo' (TRL's own implementation is used)."
        },
    )
    epsilon: float | None = field(
        default=None,
        metadata={"help": "Lower clip range. Unset: 3e-4 for gspo types (GSPO paper), 0.2 for TRL loss types."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip range. Unset: 4e-4 for gspo types (GSPO paper); for TRL loss types, same as epsilon."
        },
    )
    beta: float | None = field(
        default=None,
        metadata={"help": "KL coefficient to the reference model. Unset: 0.0 (GSPO paper and TRL default)."},
    )
    importance_sampling_level: str | None = field(
        default=None,
        metadata={
            "help": "'token' or 'sequence'. Unset: 'sequence' for gspo types (the only valid value there), 'token' "
            "for TRL loss types."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Mini-batches per rollout batch. Unset for gspo types: 4 x gradient_accumulation_steps (GSPO "
            "paper: 4 mini-batches per rollout batch, so training is off-policy); for TRL loss types: "
            "gradient_accumulation_steps."
        },
    )

    routing_replay: str = field(
        default="none",
        metadata={
            "help": "MoE routing replay. 'none': natural routing (routing drift is still measured and logged when "
            "TRL runs an old-policy pass). 'old' (R2): record the experts each token used in TRL's old-policy pass "
            "and force them when the current policy is scored (the GSPO paper's GRPO baseline; works with every loss "
            "type). Needs an off-policy setup: fully on-policy training has no old-policy pass to record. "
            "'sampler' (R3, rollout routing replay): record the experts each token used where it was sampled (HF "
            "generate, or vLLM with routed experts) and force them in the old-policy pass and every training pass, "
            "so the trainer scores the experts that produced the tokens; also records the sampler's log-probs "
            "(sampling/* metrics). See docs/sampling.md."
        },
    )
    routing_replay_offload: bool = field(
        default=False,
        metadata={"help": "Keep routing recordings on CPU (pinned when a GPU is present) instead of the device."},
    )
    routing_replay_min_agreement: float = field(
        default=DEFAULT_MIN_ROUTE_AGREEMENT,
        metadata={
            "help": "R3: training stops when, in a generation round, fewer than this share of (token, layer) routes "
            "of the sampler equal the trainer's own routes in TRL's old-policy pass (same weights, so only "
            "precision and kernels differ: measured 0.987-1.0, docs/results.md#r3-on-cpu-route-checks-and-layouts). "
            "Lower means routes that do not belong to these tokens: misaligned (routes shifted by one token: 0.572 on "
            "the 4-expert test model), from another model, or a sampler that missed a weight sync. 0 turns the check "
            "off."
        },
    )
    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of TRL's colocate vLLM engine: 'auto' (vLLM's choice, TRL's default: a float32 checkpoint "
            "is served in bfloat16), 'float32', 'bfloat16' or 'float16'. GSPOTrainer warns when the engine computes "
            "in another dtype than the trainer. In server mode set the server's --dtype instead."
        },
    )
    rank_wait_timeout: float = field(**RANK_WAIT_TIMEOUT_FIELD)
    vllm_server_stall_timeout: float = field(
        default=DEFAULT_SERVER_STALL_TIMEOUT,
        metadata={
            "help": "Server mode: seconds a vLLM server may go without progress (its /metrics counters of engine "
            "steps and tokens stand still, or /metrics does not answer) while a generation request is out, before "
            "training stops with an error naming the server, the newest complete checkpoint and the resume. TRL's "
            "client alone waits forever for a hung server. A slow server that makes progress is never stopped. 0 "
            "turns the watch off."
        },
    )

    old_logps: str = field(
        default="trainer",
        metadata={
            "help": "Where pi_old comes from. 'trainer': TRL's old-policy pass recomputes it with the trainer. "
            "'sampler': the sampler's per-token log-probs (vLLM's, or those R3 records during HF generate), no "
            "old-policy pass (GSPO paper Sec. 5.4); TRL's vLLM importance-sampling correction is then the identity "
            "and turned off. Safe only when the sampler computes in the trainer's precision: a bfloat16 engine "
            "against a float32 trainer puts most sequences outside GSPO's clip band (measured, docs/gspo.md)."
        },
    )

    merge_adapters_for_rollout: bool = field(
        default=True,
        metadata={
            "help": "With LoRA on the experts (PEFT `target_parameters`): HF generate and TRL's old-policy pass "
            "run with the experts' adapters folded into the weights, W + delta built once per rollout instead of in "
            "every forward; bit for bit the active forward. Needs the whole model on the device (one process, DDP, "
            "ZeRO-1/2, ZeRO-3 with `ds3_gather_for_generation`) and one copy of the adapted expert weights during "
            "the rollout; the frozen base is never written (docs/lora.md)."
        },
    )
    exact_lora_merge: bool = field(
        default=True,
        metadata={
            "help": "With LoRA and vLLM: weight syncs send each adapted weight as W + delta built out of place, one "
            "parameter at a time, so the frozen base stays bit for bit unchanged. False: TRL's in-place "
            "merge_adapter()/unmerge_adapter(), whose bf16 rounding moves the base at every sync (docs/lora.md)."
        },
    )
    clip_band: str | None = field(**CLIP_BAND_FIELDS["clip_band"])
    clip_band_target: float = field(**CLIP_BAND_FIELDS["clip_band_target"])
    clip_band_min: float = field(**CLIP_BAND_FIELDS["clip_band_min"])
    clip_band_max: float = field(**CLIP_BAND_FIELDS["clip_band_max"])

    def __post_init__(self):
        _check_types(self)  # before TRL's __post_init__, which computes with these sizes (0: ZeroDivisionError there)
        is_gspo = self.loss_type in GSPO_LOSS_TYPES
        mini_batches = (PAPER_MINI_BATCHES_PER_ROLLOUT * self.gradient_accumulation_steps
                        if is_gspo and self.generation_batch_size is None else None)
        # Before TRL's __post_init__: it derives generation_batch_size from steps_per_generation, filled here.
        filled = fill_presets(self, {
            "epsilon": PAPER_EPSILON_LOW if is_gspo else 0.2, "epsilon_high": PAPER_EPSILON_HIGH if is_gspo else None,
            "beta": PAPER_BETA, "importance_sampling_level": "sequence" if is_gspo else "token",
            "steps_per_generation": mini_batches})
        # The paper's values this config filled in (not a dataclass field: not in `to_dict()`); GSPOTrainer names them
        # at startup beside the sizes they resolve to (`setup_summary`).
        self.paper_presets = filled if is_gspo else {}
        with parent_errors_as_ours(self):
            super().__post_init__()
        validate_gspo_args(self)


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take: above `low` (`low_open`: strictly), below `high` (likewise), or one of
    `also` (a sentinel such as max_steps' -1). Infinite and NaN values are outside every range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    example: str = ""

    def holds(self, value) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def text(self) -> str:
        """"> 0", ">= 1", "in (0, 1]", "-1 or >= 1"."""
        if self.low is not None and self.high is not None:
            interval = (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                        f"{')' if self.high_open else ']'}")
        else:
            interval = f"{'>' if self.low_open else '>='} {self.low:g}"
        return " or ".join([*(f"{value:g}" for value in self.also), interval])


# Every number a user sets, and its valid values: checked before TRL's `__post_init__` (a size of 0 is a
# ZeroDivisionError there) and before any model loads; values transformers would silently reinterpret (max_steps -5
# trains by epochs) are refused too. docs/own_task.md's table of ranges is this table (tests/test_config.py).
NUMBER_RANGES = {
    "per_device_train_batch_size": Range(1, example="8"), "per_device_eval_batch_size": Range(1, example="8"),
    "gradient_accumulation_steps": Range(1, example="1"), "num_generations": Range(2, example="8"),
    "num_generations_eval": Range(2, example="8"), "steps_per_generation": Range(1, example="4"),
    "generation_batch_size": Range(1, example="64"), "num_iterations": Range(1, example="1"),
    "max_completion_length": Range(1, example="512"),
    "max_steps": Range(1, also=(-1,), example="1000, or -1 to train num_train_epochs"),
    "num_train_epochs": Range(0, low_open=True, example="1"),
    "learning_rate": Range(0, example="1e-6"), "warmup_steps": Range(0, example="0"),
    "weight_decay": Range(0, example="0.0"), "max_grad_norm": Range(0, example="1.0 (0 turns clipping off)"),
    "adam_beta1": Range(0, 1, high_open=True, example="0.9"),
    "adam_beta2": Range(0, 1, high_open=True, example="0.999"),
    "adam_epsilon": Range(0, low_open=True, example="1e-8"),
    "temperature": Range(0, low_open=True, example="1.0 (completions are sampled)"),
    "top_p": Range(0, 1, low_open=True, example="1.0"), "top_k": Range(0, example="0 (off)"),
    "min_p": Range(0, 1, example="0.0"), "repetition_penalty": Range(0, low_open=True, example="1.0"),
    "logging_steps": Range(0, low_open=True, example="10"), "save_steps": Range(0, low_open=True, example="500"),
    "eval_steps": Range(0, low_open=True, example="500"), "seed": Range(0, example="42"),
    "dataloader_num_workers": Range(0, example="0"),
    "vllm_gpu_memory_utilization": Range(0, 1, low_open=True, example="0.3"),
    "vllm_tensor_parallel_size": Range(1, example="1"),
    # TRL's SAPO / VESPO options: a temperature of 0 divides by 0 in SAPO's gate, a negative k or lambda turns VESPO's
    # down-weighting into an up-weighting (TRL clamps lambda to 1e-4 silently).
    "sapo_temperature_pos": Range(0, low_open=True, example="1.0"),
    "sapo_temperature_neg": Range(0, low_open=True, example="1.05"),
    "vespo_k_pos": Range(0, example="2.0"), "vespo_lambda_pos": Range(0, low_open=True, example="3.0"),
    "vespo_k_neg": Range(0, example="3.0"), "vespo_lambda_neg": Range(0, low_open=True, example="2.0"),
}


# Fields that `validate_gspo_args` compares, and their types: a wrong type fails here naming the field, not later
# inside a comparison (`GSPOConfig(epsilon="3e-4")`). `None` is left to the defaults and to `validate_gspo_args`. An
# option with a range in NUMBER_RANGES takes its example from there (`None` here).
_FIELD_TYPES = {"loss_type": (str, "a string", "'gspo'"), "importance_sampling_level": (str, "a string", "'sequence'"),
                "routing_replay": (str, "a string", "'old'"), "routing_replay_offload": (bool, "a bool", "True"),
                "merge_adapters_for_rollout": (bool, "a bool", "False"), "exact_lora_merge": (bool, "a bool", "False"),
                "routing_replay_min_agreement": (numbers.Real, "a number", "0.75"),
                "vllm_dtype": (str, "a string", "'float32'"),
                "vllm_server_stall_timeout": (numbers.Real, "a number of seconds", "600"),
                "rank_wait_timeout": (numbers.Real, "a number of seconds", "1200"), "old_logps": (str, "a string", "'sampler'"),
                "epsilon": (numbers.Real, "a number", "3e-4"), "epsilon_high": (numbers.Real, "a number", "4e-4"),
                "clip_band": (str, "a string", "'adaptive'"), "clip_band_target": (numbers.Real, "a number", "0.15"),
                "clip_band_min": (numbers.Real, "a number", "1e-5"), "clip_band_max": (numbers.Real, "a number", "0.2"),
                "beta": (numbers.Real, "a number", "0.0"), "delta": (numbers.Real, "a number", "1.5"),
                "steps_per_generation": (numbers.Integral, "an integer", None),
                "staleness_weight_cap": (numbers.Real, "a number", "2.0"),
                **{name: (numbers.Real, "a number", None) for name in (
                    "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                    "vespo_lambda_neg")},
                "max_staleness": (numbers.Integral, "an integer", "4")}


def _check_types(args) -> None:
    for name, (expected, kind, example) in _FIELD_TYPES.items():
        example = NUMBER_RANGES[name].example if name in NUMBER_RANGES else example
        value = getattr(args, name, None)
        if value is not None and (not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool)):
            raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__}). Fix: pass {kind}, "
                            f"e.g. {name}={example}.")
    for name, valid in NUMBER_RANGES.items():
        value = getattr(args, name, None)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and not valid.holds(value):
            raise ValueError(f"`{name}` must be {valid.text()}, got {value}. Fix: e.g. {name}={valid.example}.")


class BF16DeviceError(ValueError):
    """`bf16` (or `bf16_full_eval`) asks for bfloat16 mixed precision on a machine without a device for it."""


@contextmanager
def parent_errors_as_ours(args):
    """Run the parent's `__post_init__` (TRL's, then transformers', and whatever a user hooked there) and turn the
    precision errors and unknown enumerated values transformers refuses into one line naming the option and the fix
    (with the nearest valid value), chained to the original (`raise ... from`): so the config refuses exactly what
    its TRL parent refuses, in every environment. transformers says "Your setup doesn't support bf16/gpu" where `bf16`
    (TRL's default when unset and `fp16` is not set) or `bf16_full_eval` meets a machine without a bfloat16 device and
    `use_cpu` is not set. Shared by `GSPOConfig` and `AsyncGSPOConfig`."""
    bf16_given = args.bf16  # None (unset) until TRL's __post_init__ resolves it
    shape = BatchShape.given(args)  # as given: TRL's __post_init__ derives the rest
    try:
        yield
        if args.use_cpu and (args.bf16 or args.fp16):  # transformers allows it and says nothing
            half = "bf16" if args.bf16 else "fp16"
            given = (f"{half}=True" if bf16_given or args.fp16 else
                     "bf16 unset (TRL's configs then default it to True)")
            logger.warning_once(f"use_cpu=True with {given}: training runs in {half} autocast on the CPU, not in "
                                f"float32. For float32 on a CPU set {half}=False (command line: `--{half} false`).")
    except ValueError as err:
        if "bf16/gpu" in str(err):
            option = "bf16" if args.bf16 else "bf16_full_eval"
            given = ("bf16 is unset, and TRL's configs then default it to True, which"
                     if option == "bf16" and bf16_given is None else f"{option}=True")
            raise BF16DeviceError(
                f"`{option}`: {given} needs a GPU with bfloat16 support, and none is visible here (use_cpu=False). "
                f"Fix: on a CPU pass use_cpu=True and {option}=False (command line: `--use_cpu true --{option} "
                "false`); on a GPU machine check that torch sees the GPU (one without bfloat16: fp16=True).") from err
        if "At most one of fp16 and bf16" in str(err):
            full_eval = "for full eval" in str(err)
            fp16, bf16 = ("fp16_full_eval", "bf16_full_eval") if full_eval else ("fp16", "bf16")
            raise _error(bf16, f"{bf16}=True and {fp16}=True ask for two mixed precisions at once.",
                         "set one of them to False.") from err
        processes = max(getattr(args, "world_size", 1) or 1, 1)  # known once transformers set up the devices
        batch_error = _batch_shape_error(args, str(err), dataclasses.replace(shape, processes=processes))
        if batch_error is not None:
            raise batch_error from err
        # transformers' enumerated fields (lr_scheduler_type, save_strategy, optim, ...): name the field and the
        # nearest valid value
        enum = re.fullmatch(r"(.*) is not a valid (\w+), please select one of \[(.*)\]", str(err))
        names = _fields_holding(args, *enum.groups()[:2]) if enum else []
        if names:
            choices = [choice.strip(" '") for choice in enum.group(3).split(",")]
            raise _error(names[0], f"unknown value {enum.group(1)!r}{did_you_mean(enum.group(1), choices)}.",
                         f"use one of {', '.join(map(repr, choices))}.") from err
        raise


def _nearest(values, target: int, count: int = 2) -> list[int]:
    return sorted(values, key=lambda value: (abs(value - target), value))[:count]


def _nearest_multiples(step: int, target: int) -> str:
    """The two multiples of `step` nearest `target`, "a or b"."""
    return " or ".join(map(str, _nearest([step * k for k in range(1, target // step + 3)], target)))


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The batch options as the user gave them, before TRL derives the rest (`steps` may be GSPOConfig's preset,
    `steps_preset`). `valid` is TRL's rule for a rollout batch (GRPOConfig.__post_init__): the generation batch holds
    whole optimizer micro-batches (per_device x processes) and whole groups of num_generations completions."""

    per_device: int
    processes: int
    num_generations: int
    generation_batch: int | None
    steps: int | None
    accumulation: int = 1
    steps_preset: bool = False

    @classmethod
    def given(cls, args) -> BatchShape:
        """Before TRL's `__post_init__`: the processes are known only after it set up the devices (replaced then)."""
        return cls(args.per_device_train_batch_size, 1, getattr(args, "num_generations", None),
                   getattr(args, "generation_batch_size", None), getattr(args, "steps_per_generation", None),
                   args.gradient_accumulation_steps, "steps_per_generation" in getattr(args, "paper_presets", {}))

    def rollout_batch(self) -> int | None:
        """The generation batch TRL derives, or None where TRL refuses the options before deriving one."""
        micro = self.per_device * self.processes
        if self.generation_batch is None:
            return micro * (self.accumulation if self.steps is None else self.steps)
        if self.steps is not None and not self.steps_preset:
            return None  # both set
        return self.generation_batch if self.generation_batch % micro == 0 else None

    def valid(self) -> bool:
        batch = self.rollout_batch()
        return self.num_generations >= 2 and batch is not None and batch % self.num_generations == 0

    def fixes(self) -> dict[str, list[int]]:
        """For each option that can fix the shape alone, its two values nearest the given one that do (each
        checked with `valid`)."""
        found: dict[str, list[int]] = {}

        def nearest(option: str, current: int, candidates) -> None:
            valid = [value for value in candidates if dataclasses.replace(self, **{option: value}).valid()]
            if valid:
                found[option] = _nearest(valid, current)

        nearest("num_generations", self.num_generations, range(2, 4 * self.num_generations + 65))
        nearest("per_device", self.per_device, range(1, 4 * self.per_device + 65))
        if self.steps is None or self.steps_preset:  # a generation batch may replace only TRL's or GSPO's default
            micro = self.per_device * self.processes
            step = micro * self.num_generations // math.gcd(micro, self.num_generations)
            current = self.generation_batch or self.rollout_batch() or step
            nearest("generation_batch", current, [step * k for k in range(1, current // step + 3)])
        if self.generation_batch is None:
            nearest("steps", self.steps or self.accumulation, range(1, 4 * (self.steps or self.accumulation) + 65))
        return found


_BATCH_OPTIONS = {"num_generations": "num_generations", "per_device": "per_device_train_batch_size",
                  "generation_batch": "generation_batch_size", "steps": "steps_per_generation"}


def _batch_shape_error(args, message: str, shape: BatchShape) -> ValueError | None:
    """TRL's batch-shape refusals, which name derived sizes the user never set ("generation_batch_size (128) must be
    divisible by num_generations (7)"), as ours: the option the user set, the sizes behind the derived one, and for
    each option that can fix it alone the nearest values that do (`BatchShape.fixes`, each one checked by TRL's
    rule). `shape`: the options as given, before TRL's `__post_init__` derived the rest. None for any other message."""
    world, per_device = shape.processes, shape.per_device
    groups = re.fullmatch(r"generation_batch_size \((\d+)\) must be divisible by num_generations \((\d+)\)\.",
                          message)
    global_batch = re.fullmatch(r"generation_batch_size \((\d+)\) must be divisible by the global batch size "
                                r"\((\d+)\)\.", message)
    if groups or global_batch:
        fixes = [f"{_BATCH_OPTIONS[option]}={' or '.join(map(str, values))}"
                 for option, values in shape.fixes().items()]
        if shape.steps is not None and not shape.steps_preset and shape.generation_batch is None:
            sizes = (f"per_device_train_batch_size {per_device} x {world} process(es) x steps_per_generation "
                     f"{shape.steps}")
        elif shape.generation_batch is None:
            sizes = (f"per_device_train_batch_size {per_device} x {world} process(es) x steps_per_generation "
                     f"{shape.steps}, GSPOConfig's 4 x gradient_accumulation_steps" if shape.steps_preset else
                     f"per_device_train_batch_size {per_device} x {world} process(es) x gradient_accumulation_steps "
                     f"{shape.accumulation}")
        else:
            sizes = "generation_batch_size"
        if groups:
            batch, size = int(groups.group(1)), int(groups.group(2))
            problem = (f"num_generations {size} does not divide the rollout batch of {batch} completions ({sizes}): "
                       "each prompt's group must fall whole in one rollout batch.")
            explicit = "num_generations" in getattr(args, "given_fields", ())
            option = "num_generations" if explicit else (
                "generation_batch_size" if shape.generation_batch is not None else "per_device_train_batch_size")
        else:
            batch, step = map(int, global_batch.groups())
            problem = (f"{batch} is not a whole number of optimizer micro-batches (per_device_train_batch_size "
                       f"{per_device} x {world} process(es) = {step}).")
            option = "generation_batch_size"
        fixes.sort(key=lambda fix: not fix.startswith(option + "="))  # the option named first
        return _error(option, problem, ("set " + ", or ".join(fixes) + " (each alone)." if fixes else
                                        "change num_generations and the batch sizes together."))
    evaluation = re.fullmatch(r"The global eval batch size \((\d+) \* (\d+)\) must be divisible by the number of "
                              r"generations used for evaluation \((\d+)\)\.", message)
    if evaluation:
        per_device_eval, processes, size = map(int, evaluation.groups())
        step = size // math.gcd(size, processes)
        option = "num_generations_eval" if getattr(args, "num_generations_eval", None) else "num_generations"
        return _error("per_device_eval_batch_size", f"{per_device_eval} x {processes} process(es) does not hold "
                      f"whole groups of {size} completions ({option}).",
                      f"per_device_eval_batch_size={_nearest_multiples(step, per_device_eval)}.")
    if "'generation_batch_size' and 'steps_per_generation' can not be both configured" in message:
        return _error("generation_batch_size", f"both generation_batch_size ({args.generation_batch_size}) and "
                      f"steps_per_generation ({shape.steps}) are set; each fixes the rollout batch.",
                      "set only one of them.")
    return None


def _fields_holding(args, value: str, enum_name: str) -> list[str]:
    """Fields holding `value` (alone, or as one word: `debug="a b"`), those typed with the refusing enum first."""
    held = [f for f in dataclasses.fields(args) if (v := getattr(args, f.name)) == value
            or (isinstance(v, str) and value in v.split())]
    # Another field may hold the same string validly (save_strategy="linear" vs lr_scheduler_type's default "linear")
    return [f.name for f in sorted(held, key=lambda f: not re.search(rf"\b{enum_name}\b", str(f.type)))]


def did_you_mean(value, choices) -> str:
    """`" (did you mean 'gspo'?)"`: the choice closest in spelling to an unknown `value` (`difflib`), or `""` when none
    is close. For every enumerated option's refusal, as unknown recipe keys get the nearest names."""
    import difflib

    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _error(option: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"`{option}`: {problem} Fix: {fix}")


def fill_presets(args, presets: dict) -> dict:
    """Set each field of `presets` that `args` left unset (None) to its preset (a preset of None leaves the field
    unset); returns the fields filled, sorted by name, with their values. Shared by `GSPOConfig` (the paper's values)
    and `AsyncGSPOConfig` (the band measured for asynchronous training)."""
    filled = {name: value for name, value in sorted(presets.items())
              if getattr(args, name) is None and value is not None}
    for name, value in filled.items():
        setattr(args, name, value)
    return filled


def check_clip_band(args) -> None:
    """The clip band `[1 - epsilon, 1 + epsilon_high]` (`epsilon_high` None: `epsilon`) must be non-empty and stay
    above 0, and a two-sided cap `delta` must lie above it. `ValueError` naming the option; wrong types were refused
    before, by `_check_types` (`TypeError`). Shared by `GSPOConfig` and `AsyncGSPOConfig`."""
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.epsilon is None or not 0 < args.epsilon < 1:
        raise _error("epsilon", f"must be in (0, 1) for loss_type={args.loss_type!r}, got {args.epsilon}.",
                     "leave it unset for the preset (GSPO paper: 3e-4), or pass a value in (0, 1).")
    if not epsilon_high > 0:
        raise _error("epsilon_high", f"must be > 0, got {epsilon_high}.",
                     "use the GSPO paper's 4e-4, or leave it unset.")
    delta = getattr(args, "delta", None)
    if delta is not None and not delta > 1.0 + epsilon_high:
        raise _error(
            "delta",
            f"two-sided clipping caps the sequence ratio at delta, which must lie above the clip band "
            f"(> 1 + epsilon_high = {1.0 + epsilon_high}), got {delta}.",
            f"set delta > {1.0 + epsilon_high} (e.g. {round(1.0 + 4 * epsilon_high, 6)}), or unset it.",
        )


def default_output_dir(model, suffix: str) -> str:
    """TRL's default `output_dir` naming: the model's last path component (or `model`), a dash, the trainer's name."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
    return f"{str(name).rstrip('/').split('/')[-1] or 'model'}-{suffix}"


def check_rank_wait_timeout(args) -> None:
    timeout = getattr(args, "rank_wait_timeout", DEFAULT_RANK_WAIT_TIMEOUT)
    if not (timeout >= 0 and math.isfinite(timeout)):
        raise _error("rank_wait_timeout", f"must be a finite number of seconds >= 0, got {timeout}.",
                     f"use the default {DEFAULT_RANK_WAIT_TIMEOUT:.0f}, more for a phase that may take longer on one "
                     "rank, or 0 to turn the bound off.")


def validate_gspo_args(args: GRPOConfig) -> None:
    """Check a `GRPOConfig`/`GSPOConfig` for options GSPO cannot honour. Raises `ValueError` naming the option.

    Called by `GSPOConfig.__post_init__` and again by `GSPOTrainer.__init__` (for plain `GRPOConfig`s), before any
    model is loaded.
    """
    known = GSPO_LOSS_TYPES + TRL_LOSS_TYPES
    if args.loss_type not in known:
        raise _error("loss_type", f"unknown value {args.loss_type!r}{did_you_mean(args.loss_type, known)}.",
                     f"use one of {', '.join(map(repr, known))}.")
    if args.importance_sampling_level not in ("token", "sequence"):
        raise _error(
            "importance_sampling_level",
            f"unknown value {args.importance_sampling_level!r}"
            f"{did_you_mean(args.importance_sampling_level, ('token', 'sequence'))}.",
            "use 'token' or 'sequence'.",
        )
    routing_replay = getattr(args, "routing_replay", "none")
    if routing_replay not in ("none", "old", "sampler"):
        raise _error("routing_replay", f"unknown value {routing_replay!r}"
                     f"{did_you_mean(routing_replay, ('none', 'old', 'sampler'))}.", "use 'none', 'old' or 'sampler'.")
    if routing_replay == "sampler":
        _check_sampler_can_route(args)
    min_agreement = getattr(args, "routing_replay_min_agreement", DEFAULT_MIN_ROUTE_AGREEMENT)
    if not 0 <= min_agreement <= 1:
        raise _error("routing_replay_min_agreement", f"must lie in [0, 1], got {min_agreement}.",
                     "use the default 0.75, or 0 to turn the check off.")
    stall_timeout = getattr(args, "vllm_server_stall_timeout", DEFAULT_SERVER_STALL_TIMEOUT)
    if not (stall_timeout >= 0 and math.isfinite(stall_timeout)):
        raise _error("vllm_server_stall_timeout", f"must be a finite number of seconds >= 0, got {stall_timeout}.",
                     f"use the default {DEFAULT_SERVER_STALL_TIMEOUT:.0f}, more for a server that may pause longer, "
                     "or 0 to turn the watch off.")
    check_rank_wait_timeout(args)
    check_old_logps_option(args, did_you_mean(getattr(args, "old_logps", "trainer"), OLD_LOGPS_SOURCES))
    vllm_dtype = getattr(args, "vllm_dtype", "auto")
    if vllm_dtype not in VLLM_DTYPES:
        raise _error("vllm_dtype", f"unknown value {vllm_dtype!r}{did_you_mean(vllm_dtype, VLLM_DTYPES)}.",
                     f"use one of {', '.join(map(repr, VLLM_DTYPES))}.")
    if vllm_dtype != "auto" and args.use_vllm and args.vllm_mode != "colocate":
        raise _error("vllm_dtype", f"{vllm_dtype!r} sets the dtype of TRL's colocate engine; in vllm_mode="
                     f"{args.vllm_mode!r} the server builds its own.",
                     f"start the server with `trl vllm-serve --dtype {vllm_dtype}` and leave vllm_dtype='auto'.")
    check_adaptive_band(args)
    if args.loss_type not in GSPO_LOSS_TYPES:
        return

    check_clip_band(args)
    if args.beta is None or args.beta < 0:
        raise _error("beta", f"must be >= 0, got {args.beta}.", "use 0.0 (GSPO paper) or a small positive KL weight.")
    if isinstance(args, GSPOConfig) and args.importance_sampling_level == "token":
        raise _error(
            "importance_sampling_level",
            f"loss_type={args.loss_type!r} always uses one importance ratio per sequence (Eq. 7); 'token' "
            "contradicts it.",
            "remove the option (it resolves to 'sequence'), or use loss_type='grpo' for token-level ratios.",
        )


CLIP_BANDS = ("fixed", "adaptive")


def check_adaptive_band(args, band_loss_types=GSPO_LOSS_TYPES) -> None:
    """`clip_band` and, when adaptive, its target and bounds (`0 < clip_band_min <= epsilon <= clip_band_max < 1`), a
    `delta` above the widest band the rule can reach, and a ratio that can move. Shared by `GSPOConfig` and
    `AsyncGSPOConfig`; called for every loss type, since only `band_loss_types` (those clipping GSPO's sequence ratio
    with this band) take an adaptive band: on the others it would be ignored."""
    band = getattr(args, "clip_band", None) or "fixed"
    if band not in CLIP_BANDS:
        raise _error("clip_band", f"unknown value {band!r}{did_you_mean(band, CLIP_BANDS)}.", "use 'fixed' or 'adaptive'.")
    if band == "fixed":
        return
    if args.loss_type not in band_loss_types:
        raise _error("clip_band", f"'adaptive' moves GSPO's sequence band; loss_type={args.loss_type!r} would ignore it.",
                     f"use loss_type={' or '.join(map(repr, band_loss_types))}, or leave clip_band='fixed' "
                     "(TRL's loss types).")
    if getattr(args, "staleness_correction", "none") != "none":
        raise _error("clip_band", f"'adaptive' reads how far the policy moved since pi_old, but with "
                     f"staleness_correction={args.staleness_correction!r} the band bounds the ratio against the weights "
                     "that train the sample, which is 1 by construction: nothing would move it.",
                     "leave clip_band='fixed' with the decoupled objective, or staleness_correction='none'.")
    if not 0 < args.clip_band_target < 1:
        raise _error("clip_band_target", f"must lie in (0, 1), got {args.clip_band_target}.",
                     "use the default 0.15 (the paper's clipped share).")
    if not 0 < args.clip_band_min <= args.epsilon <= args.clip_band_max < 1:
        raise _error("clip_band_min", f"the adaptive band needs 0 < clip_band_min <= epsilon <= clip_band_max < 1, got "
                     f"{args.clip_band_min} <= {args.epsilon} <= {args.clip_band_max}.",
                     "keep epsilon inside [clip_band_min, clip_band_max] (defaults 1e-5 and 0.2).")
    delta = getattr(args, "delta", None)
    ratio = (args.epsilon if args.epsilon_high is None else args.epsilon_high) / args.epsilon
    widest_high = args.clip_band_max * ratio
    if delta is not None and not delta > 1.0 + widest_high:
        raise _error("delta", f"{delta} caps the sequence ratio, and must lie above the widest band the adaptive rule "
                     f"can reach: 1 + clip_band_max * epsilon_high / epsilon = {1.0 + widest_high:g}.",
                     f"set clip_band='fixed' (the band then stays where epsilon / epsilon_high put it), set delta "
                     f"above {1.0 + widest_high:g}"
                     + (f", or lower clip_band_max below {(delta - 1.0) / ratio:g}." if delta > 1.0 else "."))


def _check_sampler_can_route(args) -> None:
    """R3 needs the routes of every sampled token, laid out like TRL's batch; refuse the samplers that cannot give
    them (each refusal names the fix)."""
    if getattr(args, "use_transformers_continuous_batching", False):
        raise _error("routing_replay", "'sampler' records routes during HF `generate`; continuous batching "
                     "(use_transformers_continuous_batching) does not call it.",
                     "set use_transformers_continuous_batching=False, or routing_replay='old'.")
    if args.use_vllm:
        from .sampling.engine import check_vllm_routes

        check_vllm_routes(args)


def runs_old_policy_pass(args) -> bool:
    """Whether TRL computes `old_per_token_logps` (its condition in `_generate_and_score_completions`): only when a
    rollout batch outlives one optimizer step, or for vLLM importance-sampling correction. Otherwise training is
    fully on-policy and every importance ratio is exactly 1."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(
        args.use_vllm and args.vllm_importance_sampling_correction
    )


def warn_about_setup(args) -> None:
    """Warn (once) about a gspo setup that does not do what the paper does: TRL's GRPOConfig clip range, or fully
    on-policy training, where every ratio is 1."""
    if not isinstance(args, GSPOConfig):
        epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        if (args.epsilon, epsilon_high) != (PAPER_EPSILON_LOW, PAPER_EPSILON_HIGH):
            logger.warning_once(
                f"loss_type={args.loss_type!r} with TRL's GRPOConfig: clip range epsilon={args.epsilon}, "
                f"epsilon_high={epsilon_high}. The GSPO paper uses epsilon=3e-4, epsilon_high=4e-4, beta=0 and "
                "steps_per_generation = 4 x gradient_accumulation_steps; trl_gspo.GSPOConfig applies these "
                "by default.",
            )
    if not runs_old_policy_pass(args):
        logger.warning_once(
            f"loss_type={args.loss_type!r} with steps_per_generation={args.steps_per_generation}, "
            f"num_iterations={args.num_iterations}, gradient_accumulation_steps={args.gradient_accumulation_steps}: "
            "training is fully on-policy, so every importance ratio is exactly 1 and nothing is ever clipped "
            "(GSPO then coincides with GRPO). For the paper's off-policy setup set steps_per_generation to "
            "4 x gradient_accumulation_steps or num_iterations > 1.",
        )


PAPER_BAND_NOTE = ": the GSPO paper's band"


def band_description(args) -> str:
    """The clip band a gspo run trains with, in words, for the startup lines of both trainers."""
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    edges = f"[{1 - args.epsilon:g}, {1 + high:g}]"
    paper = (args.epsilon, high) == (PAPER_EPSILON_LOW, PAPER_EPSILON_HIGH)
    if getattr(args, "clip_band", None) == "adaptive":
        return (f"one ratio per sequence, clipped to a band set by the run (clip_band='adaptive'): from {edges}, "
                f"moved after every optimizer step toward {args.clip_band_target:g} of the tokens with a non-zero "
                f"advantage clipped, within epsilon [{args.clip_band_min:g}, {args.clip_band_max:g}] and above the "
                "sampler's measured noise")
    return f"one ratio per sequence, clipped to {edges} (clip_band='fixed'{PAPER_BAND_NOTE if paper else ''})"


def setup_summary(args, num_processes: int) -> str:
    """What a run's options resolve to, in one line: the rollout batch, its mini-batches and optimizer steps, the clip
    band and its level, and (for a `GSPOConfig`) the GSPO paper's values it filled in for fields left unset. A GRPO
    user swapping in GSPOTrainer sees here what changed: e.g. the paper's 4 mini-batches per rollout make the
    generation batch (memory, KV cache) 4x TRL's default."""
    prompts = args.generation_batch_size // args.num_generations
    # a fraction when a rollout batch is smaller than one optimizer step's micro-batches (e.g. "1/2")
    steps_per_rollout = Fraction(args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps)
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.loss_type in GSPO_LOSS_TYPES:
        band = band_description(args)
    else:  # TRL's own types use epsilon each in its way (clip, soft gate, weight cap)
        band = f"{args.importance_sampling_level}-level ratios, epsilon={args.epsilon:g}, epsilon_high={high:g}"
    text = (f"loss_type={args.loss_type!r}: each rollout batch is {args.generation_batch_size} completions ({prompts} "
            f"prompts x {args.num_generations} generations) over {num_processes} process(es), trained as "
            f"{args.steps_per_generation} mini-batches of {args.per_device_train_batch_size} per process: "
            f"{steps_per_rollout} optimizer step(s) per rollout batch; {band}; beta={args.beta:g}.")
    presets = getattr(args, "paper_presets", {})
    if presets:
        text += " GSPOConfig filled in the GSPO paper's values for fields left unset: " + ", ".join(
            f"{name}={value!r}" for name, value in presets.items()) + "."
    return text


# accelerate's `mixed_precision` values (ACCELERATE_MIXED_PRECISION), as the startup lines and the dry run name them
PRECISIONS = {"no": "float32", "bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision"}


def launch_summary(args, accelerator) -> str:
    """What the run trains in and over what, once the launcher has applied its settings (accelerate exports its
    mixed_precision; transformers takes it when bf16 and fp16 are false): the startup line beside `setup_summary`."""
    precision = PRECISIONS.get(args.mixed_precision, args.mixed_precision)
    if args.mixed_precision != "no" and not (args.bf16 or args.fp16):
        precision += " (the launcher's ACCELERATE_MIXED_PRECISION: bf16 and fp16 are false)"
    layout = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        layout += f" ZeRO-{plugin.zero_stage}"
    return (f"trains in {precision}{' on the CPU' if args.use_cpu else ''}; {accelerator.num_processes} process(es), "
            f"{layout}; {args.per_device_train_batch_size} x {accelerator.num_processes} x "
            f"{args.gradient_accumulation_steps} accumulation steps per optimizer step.")


def refuse_unused_token_advantages(overridden: bool, trainer_name: str, loss_type: str) -> None:
    """Only `loss_type="gspo_token"` calls `GSPOTrainer.token_advantages`; an override (`overridden`) under any
    other loss type would be silently ignored (training would run on per-sequence advantages): refuse it."""
    if overridden and loss_type != "gspo_token":
        raise ValueError(
            f"`loss_type`: {trainer_name} overrides `token_advantages`, which only loss_type='gspo_token' calls; with "
            f"loss_type={loss_type!r} the override would be silently ignored. Fix: set loss_type='gspo_token' (or "
            "remove the override).")
