"""`AsyncGSPOConfig`: TRL's `AsyncGRPOConfig` with GSPO's loss types, a clip band set by the run, the decoupled
objective and R3 (for `trl_gspo.async_trainer.AsyncGSPOTrainer`). Apart from the trainer, so
that reading a recipe loads no training code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig
from trl.experimental.async_grpo import AsyncGRPOConfig

from ..config import (CLIP_BAND_FIELDS, CLIP_BAND_HELP, RANK_WAIT_TIMEOUT_FIELD, GSPO_LOSS_TYPES, PAPER_EPSILON_HIGH,
                      PAPER_EPSILON_LOW, _check_types, _error, check_adaptive_band, check_clip_band,
                      check_rank_wait_timeout, did_you_mean, fill_presets, parent_errors_as_ours)

# TRL 1.16's sequence-level successors of GSPO that `GRPOTrainer` ships, run on the packed rows by
# `trl_gspo.losses.packed_policy_loss` (parity with `GRPOTrainer._compute_loss`: tests/test_async_losses.py).
TRL_SUCCESSOR_LOSS_TYPES = ("luspo", "sapo", "cispo", "vespo")
# "grpo": TRL's asynchronous loss as it ships (token-level clipped ratio, mean over the micro-batch's tokens).
ASYNC_LOSS_TYPES = (*GSPO_LOSS_TYPES, *TRL_SUCCESSOR_LOSS_TYPES, "grpo")
# Clip GSPO's sequence ratio, so GSPO's band applies as it is: presets, clip_band="adaptive", delta.
SEQUENCE_BAND_LOSS_TYPES = (*GSPO_LOSS_TYPES, "luspo")
# No hard clip: what bounds the update instead, and the options that tune it.
SOFT_LOSS_TYPES = {"sapo": ("a temperature-controlled sigmoid gate", "sapo_temperature_pos / sapo_temperature_neg"),
                   "vespo": ("a Gamma weight of the sequence ratio",
                             "vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg")}
# CISPO's cap on the token weight when `epsilon_high` is unset: the value TRL's GRPOConfig help recommends (ScaleRL's
# eps_max). TRL's own fallback, `epsilon` (0.2), would cap every on-policy weight (~1) at 0.2.
CISPO_EPSILON_HIGH = 5.0
_GRPO_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}


def _trl_field(name: str):
    """`GRPOConfig`'s field `name`: its default and help, read from TRL."""
    return field(default=_GRPO_FIELDS[name].default, metadata=dict(_GRPO_FIELDS[name].metadata))


# "none": pi_old is the sampler's log-probs (the paper's objective as written); the others: the decoupled objective.
STALENESS_CORRECTIONS = ("none", "truncate", "mask")
# The band an unset `clip_band` takes for gspo types with the band unset and the paper's objective
# (staleness_correction="none"): chosen from the asynchronous band table, docs/gspo.md#a-clip-band-set-by-the-run.
ASYNC_DEFAULT_CLIP_BAND = "adaptive"


def default_clip_band(args) -> str:
    """The band an unset `clip_band` takes, read before the presets fill `epsilon`: `ASYNC_DEFAULT_CLIP_BAND` for gspo
    types whose `epsilon`, `epsilon_high` and `delta` are unset and whose ratio is against the sampler
    (`staleness_correction="none"`); "fixed" when a band or a cap `delta` is given (the band given, or the paper's
    under the cap, is the band used), with the
    decoupled objective (its ratio is 1 by construction) and for TRL's "grpo"."""
    # A two-sided cap `delta` is set against a band: the band the user knows (the paper's, or the one given).
    band_given = args.epsilon is not None or args.epsilon_high is not None or getattr(args, "delta", None) is not None
    paper_objective = getattr(args, "staleness_correction", "none") == "none"
    return (ASYNC_DEFAULT_CLIP_BAND if args.loss_type in SEQUENCE_BAND_LOSS_TYPES and not band_given
            and paper_objective else "fixed")


def check_loss_options(args) -> None:
    """Refuse, in one line naming the option, a band option the loss type has nothing to apply to (SAPO and VESPO
    have no hard clip; CISPO caps its weight from above only); TRL's SAPO / VESPO options are checked with the others
    (`NUMBER_RANGES`, by `_check_types`). Reads `epsilon` / `epsilon_high` as given: call before the presets fill
    them."""
    loss_type = args.loss_type
    given = [name for name in ("epsilon", "epsilon_high", "delta") if getattr(args, name) is not None]
    if args.clip_band == "adaptive":
        given.insert(0, "clip_band")
    if loss_type in SOFT_LOSS_TYPES and given:
        bound, tune = SOFT_LOSS_TYPES[loss_type]
        raise _error(given[0], f"loss_type={loss_type!r} has no hard clip ({bound} bounds the update instead), so "
                     f"{given[0]} would be ignored.", f"leave clip_band, epsilon, epsilon_high and delta unset; tune "
                     f"{tune}.")
    if loss_type == "cispo":
        refused = [name for name in given if name != "epsilon_high"]
        if refused:
            raise _error(refused[0], "loss_type='cispo' has one hard clip, a cap on each token's importance weight at "
                         "epsilon_high (TRL's CISPO): no lower edge, no sequence band, no two-sided cap.",
                         f"leave {refused[0]} unset{' or fixed' if refused[0] == 'clip_band' else ''}; set the cap "
                         f"with epsilon_high (unset: {CISPO_EPSILON_HIGH}).")


@dataclass
class AsyncGSPOConfig(AsyncGRPOConfig):
    """`AsyncGRPOConfig` with GSPO's loss types. For `"gspo"` / `"gspo_token"` with `epsilon` and `epsilon_high` unset
    and `staleness_correction="none"`, the clip band is `ASYNC_DEFAULT_CLIP_BAND`: set by the run
    (`clip_band="adaptive"`), starting at the GSPO paper's 3e-4 / 4e-4 and moving after every optimizer step toward
    clipping 15% of the tokens of groups whose rewards differ, above the sampler's measured noise. Each sample is trained
    once against the sampler's log-probs, so the band is the only trust region, and how far a stale sample has moved
    depends on the model, the learning rate and the sample's age. The paper has no asynchronous setting; the default
    follows the asynchronous band table (docs/gspo.md "A clip band set by the run"). `clip_band="fixed"` keeps the
    paper's band (or the band set); setting `epsilon` / `epsilon_high` keeps the band given. TRL's asynchronous
    trainer has no KL term and no reference model, so the paper's `beta=0` holds by construction. For `"grpo"` the
    defaults are TRL's (`0.2`). TRL's successors, as `GRPOTrainer` computes them: `"luspo"` takes GSPO's band as it is
    (presets, `clip_band`, `delta`); `"cispo"` caps its token weight at `epsilon_high` (unset: 5.0, TRL's recommended
    value); `"sapo"` and `"vespo"` have no hard clip and refuse the band's options (`sapo_*` / `vespo_*` instead)."""

    loss_type: str = field(
        default="gspo",
        metadata={"help": "'gspo' (sequence ratio, GSPO paper Eq. 5/7), 'gspo_token' (Eq. 13-14), TRL's successors "
                          "'luspo' (GSPO's term times the length; GSPO's band), 'cispo' (capped token weight, "
                          "epsilon_high), 'sapo' / 'vespo' (no hard clip: a soft gate / a Gamma weight), each as TRL's "
                          "GRPOTrainer computes it, or 'grpo' (TRL's own asynchronous token-level loss)."},
    )
    epsilon: float | None = field(
        default=None,
        metadata={"help": "Lower clip range. Unset: for gspo types the GSPO paper's 3e-4, where the adaptive band "
                          "starts (clip_band); 0.2 for 'grpo' (TRL's)."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clip range. Unset: for gspo types and 'luspo' the GSPO paper's 4e-4, where the "
                          "adaptive band starts (clip_band); for 'cispo' (its cap on the token weight) 5.0; for "
                          "'grpo', same as epsilon."},
    )
    sapo_temperature_neg: float = _trl_field("sapo_temperature_neg")
    sapo_temperature_pos: float = _trl_field("sapo_temperature_pos")
    vespo_k_pos: float = _trl_field("vespo_k_pos")
    vespo_lambda_pos: float = _trl_field("vespo_lambda_pos")
    vespo_k_neg: float = _trl_field("vespo_k_neg")
    vespo_lambda_neg: float = _trl_field("vespo_lambda_neg")
    routing_replay: str = field(
        default="none",
        metadata={"help": "'none', or 'sampler' (R3): force, in the training forward, the experts each token used "
                          "where the vLLM server sampled it. Needs a Mixture-of-Experts model and a server started with "
                          "`trl-gspo vllm-serve`, which returns them (trl_gspo/async_trainer/routing.py)."},
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "gspo types: cap on the unclipped sequence ratio for negative advantages (two-sided / dual "
                          "clip, > 1 + epsilon_high): a stale sample the policy has made much more likely can no "
                          "longer push an unbounded negative update. None (default): the paper's objective."},
    )

    staleness_correction: str = field(
        default="none",
        metadata={"help": "gspo types: 'none' (the paper's objective with the sampler's log-probs as pi_old: the band "
                          "bounds the sequence ratio against the sampler, however stale), or the decoupled objective "
                          "(docs/gspo.md): the band bounds the ratio against the trainer's weights when it trains the "
                          "sample, and the sampler-to-trainer gap enters as a length-normalised sequence weight, "
                          "'truncate'd at `staleness_weight_cap` or, with 'mask', completions whose weight leaves "
                          "[1/cap, cap] dropped."},
    )
    staleness_weight_cap: float = field(
        default=2.0,
        metadata={"help": "Cap C of the decoupled objective's sequence weight (> 1); unused with "
                          "staleness_correction='none'."},
    )

    exact_lora_merge: bool = field(
        default=True,
        metadata={"help": "With LoRA synced as merged weights: each adapted weight is sent as W + delta built out of "
                          "place, one parameter at a time, so the frozen base stays bit for bit unchanged. False: "
                          "TRL's in-place merge_adapter()/unmerge_adapter(), whose bf16 rounding moves the base at "
                          "every sync (docs/lora.md)."},
    )

    clip_band: str | None = field(default=None, metadata={"help": CLIP_BAND_HELP + (
        f" Unset: '{ASYNC_DEFAULT_CLIP_BAND}' for gspo types with epsilon / epsilon_high / delta unset and "
        "staleness_correction='none' (measured: docs/gspo.md#a-clip-band-set-by-the-run), else 'fixed'.")})
    clip_band_target: float = field(**CLIP_BAND_FIELDS["clip_band_target"])
    clip_band_min: float = field(**CLIP_BAND_FIELDS["clip_band_min"])
    clip_band_max: float = field(**CLIP_BAND_FIELDS["clip_band_max"])
    rank_wait_timeout: float = field(**RANK_WAIT_TIMEOUT_FIELD)

    def __post_init__(self):
        is_gspo = self.loss_type in GSPO_LOSS_TYPES
        sequence_band = self.loss_type in SEQUENCE_BAND_LOSS_TYPES
        check_loss_options(self)  # before the presets: it reads which band options were given
        # Before the parent's __post_init__, so that it (and any hook there) sees the band the run will use; the
        # band's kind first, since it asks whether epsilon was set.
        band = fill_presets(self, {"clip_band": default_clip_band(self)})
        high = PAPER_EPSILON_HIGH if sequence_band else CISPO_EPSILON_HIGH if self.loss_type == "cispo" else None
        filled = {**band, **fill_presets(self, {"epsilon": PAPER_EPSILON_LOW if sequence_band else 0.2,
                                                "epsilon_high": high})}
        self.presets = (filled if sequence_band else
                        {"epsilon_high": filled["epsilon_high"]} if "epsilon_high" in filled else {})
        with parent_errors_as_ours(self):
            super().__post_init__()
        _check_types(self)  # wrong types: TypeError naming the field, as GSPOConfig
        if self.loss_type not in ASYNC_LOSS_TYPES:
            raise ValueError(f"`loss_type`: {self.loss_type!r} is not one AsyncGSPOTrainer runs"
                             f"{did_you_mean(self.loss_type, ASYNC_LOSS_TYPES)}. Fix: use one of "
                             f"{', '.join(repr(t) for t in ASYNC_LOSS_TYPES)} (the losses AsyncGSPOTrainer computes "
                             "on TRL's packed rows).")
        if self.routing_replay not in ("none", "sampler"):
            raise ValueError(f"`routing_replay`: {self.routing_replay!r} is not one AsyncGSPOTrainer runs"
                             f"{did_you_mean(self.routing_replay, ('none', 'sampler'))}. Fix: 'none' "
                             "or 'sampler' (R3; the asynchronous trainer has no old-policy pass for 'old' to record).")
        if self.staleness_correction not in STALENESS_CORRECTIONS:
            raise ValueError(f"`staleness_correction`: {self.staleness_correction!r} is not one AsyncGSPOTrainer runs"
                             f"{did_you_mean(self.staleness_correction, STALENESS_CORRECTIONS)}. Fix: one of "
                             f"{', '.join(repr(c) for c in STALENESS_CORRECTIONS)}.")
        if self.delta is not None and not sequence_band:
            raise ValueError("`delta`: TRL's asynchronous 'grpo' loss has no two-sided clip. Fix: leave delta "
                             "unset, or use loss_type='gspo'.")
        check_clip_band(self)
        check_adaptive_band(self, SEQUENCE_BAND_LOSS_TYPES)
        check_rank_wait_timeout(self)
        if self.staleness_correction != "none" and not is_gspo:
            raise ValueError(f"`staleness_correction`: loss_type={self.loss_type!r} has no decoupled form here. Fix: "
                             "leave staleness_correction='none', or use loss_type='gspo'.")
        if not self.staleness_weight_cap > 1:
            raise ValueError(f"`staleness_weight_cap` ({self.staleness_weight_cap}) must exceed 1 (an unchanged "
                             "policy's weight is 1). Fix: e.g. 2.0.")
        if self.max_staleness < 0:
            raise ValueError(f"`max_staleness` ({self.max_staleness}) must be >= 0. Fix: 0 trains on-policy samples "
                             "only; TRL's default is 4.")
