"""Sampler/trainer mismatch metrics (docs/sampling.md), as pure tensor functions plus one logging function.

Inputs, per completion token: the trainer's log-prob `logps` (TRL's old-policy pass: the weights that sampled),
the sampler's `sampler_logps` (vLLM or HF generate; NaN where the sampler gave none) and the completion `mask`.
With `r_t = pi_trainer(y_t) / pi_sampler(y_t)`, the raw token ratio before any clip or correction:

    token ratio           mean, min, max of r_t; share of tokens with r_t outside [0.5, 2]; mean |log r_t|
    sequence ratio        s_i = exp(mean_t log r_t) (GSPO's view, eq. 7 of arXiv 2507.18071): mean, min, max, and
                          the share of sequences outside GSPO's clip band [1 - eps_low, 1 + eps_high] from the
                          mismatch alone
    k3 KL                 mean_t (r_t - 1 - log r_t): an unbiased, non-negative estimate of KL(sampler || trainer)
                          from tokens drawn from the sampler (Schulman's k3 estimator, since E_sampler[r] = 1)
    chi-squared           mean_t r_t^2 - 1: estimates chi^2(trainer || sampler) = E_sampler[r^2] - 1
    missing log-probs     share of completion tokens without a sampler log-prob

Sums are kept per rank and reduced by the caller, so the values are over every rank's tokens.
"""

from __future__ import annotations

import math

import torch
from transformers.utils import logging

from ..routing import RoutingReplayError

logger = logging.get_logger(__name__)

__all__ = ["SAMPLER_GAP_FLOOR", "SamplerWatch", "check_sampler_round", "finish_mismatch", "log_turns",
           "mismatch_sums", "model_turns", "reduce_mismatch", "sampler_drifted", "sampling_metrics"]

# A round's mean |log r_t| counts as drift when it exceeds both DRIFT_FACTOR x the first round's and the first round's
# + DRIFT_MARGIN nats: a correct engine stays near its round-1 gap as training moves the weights, and one that missed
# a weight sync grows far past both bounds (measured: docs/results.md#the-sampler-gap-on-vllms-cpu-build).
DRIFT_FACTOR, DRIFT_MARGIN = 4.0, 0.05
# Beyond this mean |log r_t| (nats, trainer and sampler on the same weights) no precision gap explains a round, first
# round included: a bf16 sampler against a float32 trainer measured 0.0009-0.0083 (CPU and GPU size), an engine
# computing with other weights 2.44-3.41 (a missed sync): docs/results.md#the-sampler-gap-on-vllms-cpu-build.
SAMPLER_GAP_FLOOR = 0.1


def mismatch_sums(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, eps_low: float = 3e-4,
                  eps_high: float = 4e-4, changed: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """Per-rank sums (to add over ranks) and `[4]` extremes (max r, -min r, max s, -min s: to max over ranks).
    `changed` (optional, `[B, T]` bool): tokens whose sampler route differed from the trainer's, for the
    changed / unchanged split of |log r_t|."""
    logps, sampler_logps = logps.double(), sampler_logps.double()
    present = mask.bool() & ~torch.isnan(sampler_logps)
    log_r = torch.where(present, logps - sampler_logps, torch.zeros_like(logps))
    ratio = log_r.exp()
    tokens = present.double()
    per_sequence = tokens.sum(-1)
    nonempty = per_sequence > 0
    log_s = log_r.sum(-1) / per_sequence.clamp(min=1)
    outside_band = nonempty & ((log_s < math.log1p(-eps_low)) | (log_s > math.log1p(eps_high)))
    sums = {
        "tokens": tokens.sum(), "missing": (mask.bool() & ~present).double().sum(), "masked": mask.double().sum(),
        "ratio": (ratio * tokens).sum(), "abs_log_r": (log_r.abs() * tokens).sum(),
        "outside_half_double": (((ratio < 0.5) | (ratio > 2.0)) & present).double().sum(),
        "k3": ((ratio - 1 - log_r) * tokens).sum(), "ratio_sq": (ratio.square() * tokens).sum(),
        "sequences": nonempty.double().sum(), "seq_ratio": (log_s.exp() * nonempty).sum(),
        "seq_outside_band": outside_band.double().sum(),
    }
    if changed is not None:
        changed = changed.to(present.device) & present
        sums["changed_tokens"] = changed.double().sum()
        sums["changed_abs_log_r"] = (log_r.abs() * changed).sum()
        sums["unchanged_abs_log_r"] = (log_r.abs() * (present & ~changed)).sum()
    inf = torch.full_like(ratio, math.inf)
    seq_inf = torch.full_like(log_s, math.inf)
    extremes = torch.stack([
        torch.where(present, ratio, -inf).max(), -torch.where(present, ratio, inf).min(),
        torch.where(nonempty, log_s.exp(), -seq_inf).max(), -torch.where(nonempty, log_s.exp(), seq_inf).min(),
    ])
    return sums, extremes


def finish_mismatch(totals: dict, extremes: torch.Tensor) -> dict:
    """Metric values (0-d tensors, names under `sampling/`) from rank-summed `totals` and rank-maxed `extremes`.
    With no token (every sampler log-prob missing) ratios read 1 and divergences 0."""
    tokens, sequences = totals["tokens"].clamp(min=1), totals["sequences"].clamp(min=1)
    has_tokens, has_sequences = totals["tokens"] > 0, totals["sequences"] > 0
    one = torch.ones((), dtype=torch.float64, device=extremes.device)
    values = {
        "sampling/token_ratio_mean": torch.where(has_tokens, totals["ratio"] / tokens, one),
        "sampling/token_ratio_min": torch.where(has_tokens, -extremes[1], one),
        "sampling/token_ratio_max": torch.where(has_tokens, extremes[0], one),
        "sampling/token_ratio_outside_0.5_2": totals["outside_half_double"] / tokens,
        "sampling/abs_log_ratio_mean": totals["abs_log_r"] / tokens,
        "sampling/seq_ratio_mean": torch.where(has_sequences, totals["seq_ratio"] / sequences, one),
        "sampling/seq_ratio_min": torch.where(has_sequences, -extremes[3], one),
        "sampling/seq_ratio_max": torch.where(has_sequences, extremes[2], one),
        "sampling/seq_outside_clip_band": totals["seq_outside_band"] / sequences,
        "sampling/k3_kl": totals["k3"] / tokens,
        "sampling/chi2": torch.where(has_tokens, totals["ratio_sq"] / tokens - 1, 0 * one),
        "sampling/missing_logp_fraction": totals["missing"] / totals["masked"].clamp(min=1),
    }
    if "changed_tokens" in totals:
        unchanged = (totals["tokens"] - totals["changed_tokens"]).clamp(min=1)
        values["routing/sampler_changed_token_fraction"] = totals["changed_tokens"] / tokens
        values["routing/sampler_changed_abs_log_ratio"] = totals["changed_abs_log_r"] / totals["changed_tokens"].clamp(min=1)
        values["routing/sampler_unchanged_abs_log_ratio"] = totals["unchanged_abs_log_r"] / unchanged
    return values


def sampling_metrics(accelerator, logps, sampler_logps, mask, eps_low, eps_high, changed=None,
                     agreement_counts=None) -> dict[str, float]:
    """The metrics over every rank: one sum-reduce, one gather of the extremes, one host read. `agreement_counts`:
    R3's `[layers, 3]` (differing, forced, counted) route counts of the old-policy pass, for
    `routing/sampler_agreement` (share of (token, layer) route sets equal between sampler and trainer)."""
    sums, extremes = mismatch_sums(logps, sampler_logps, mask, eps_low, eps_high, changed)
    if agreement_counts is not None:
        counts = agreement_counts.to(extremes.device, torch.float64)
        sums["route_differing"], sums["route_counted"] = counts[:, 0].sum(), counts[:, 2].sum()
    return reduce_mismatch(accelerator, sums, extremes)


def reduce_mismatch(accelerator, sums: dict, extremes: torch.Tensor) -> dict[str, float]:
    """`mismatch_sums`' per-rank sums and extremes (several micro-batches' may be added first) as metric values over
    every rank: one sum-reduce, one gather of the extremes, one host read. Sums may hold R3's `route_differing` and
    `route_counted`, for `routing/sampler_agreement`."""
    reduced = accelerator.reduce(torch.stack(list(sums.values())), reduction="sum")
    extremes = accelerator.gather(extremes[None]).max(0).values
    totals = dict(zip(sums, reduced))
    values = finish_mismatch(totals, extremes)
    if "route_counted" in totals:
        values["routing/sampler_agreement"] = 1 - totals["route_differing"] / totals["route_counted"].clamp(min=1)
    return dict(zip(values, torch.stack(list(values.values())).tolist()))  # the one host read


def sampler_drifted(reference: float, current: float) -> bool:
    """Whether a round's mean |log r_t| (`sampling/abs_log_ratio_mean`, trainer and sampler holding the same weights)
    has moved far above the first round's `reference`: the sampler no longer samples from the trainer's weights."""
    return current > max(DRIFT_FACTOR * reference, reference + DRIFT_MARGIN)


def check_sampler_round(values: dict, reference: float | None, min_agreement: float,
                        dtypes: tuple[str, str] = ("unknown", "unknown")) -> float:
    """After a training round's metrics (`sampling_metrics`, the same on every rank): raise `RoutingReplayError`
    when R3's sampler/trainer route agreement is below `min_agreement` (`routing_replay_min_agreement`); warn loudly
    when the gap is beyond what precision explains (`SAMPLER_GAP_FLOOR`, any round, the first included), or when it
    drifted from the first round's (`sampler_drifted`). `dtypes`: (sampler, trainer) compute dtypes, for the message.
    Returns the gap reference to keep: `reference`, or this round's gap when there was none."""
    agreement = values.get("routing/sampler_agreement")
    if agreement is not None and agreement < min_agreement:
        raise RoutingReplayError(
            f"routing_replay='sampler': only {agreement:.3f} of the sampler's (token, layer) routes equal the "
            f"trainer's own in TRL's old-policy pass, below routing_replay_min_agreement={min_agreement}. Sampler "
            "and trainer hold the same weights there, so only precision and kernels may differ (measured 0.987-1.0, "
            "docs/results.md#r3-on-cpu-route-checks-and-layouts). Cause: routes shifted against their tokens, routes "
            "of another model, or a sampler that missed the weight sync. Fix: check the sampler's route capture and "
            "weight sync; lower routing_replay_min_agreement only for a gap you measured as legitimate; or set "
            "routing_replay='old'.")
    gap = values["sampling/abs_log_ratio_mean"]
    if reference is not None and sampler_drifted(reference, gap):
        logger.warning(
            f"SAMPLER DRIFT: the sampler's log-probs are {gap:.4f} nats (mean |log ratio|) from the trainer's on the "
            f"same weights, against {reference:.4f} in the first round. The sampler no longer samples from the trained "
            "weights (a weight sync that did not reach the kernels the engine computes with), so every importance "
            "ratio is off. See sampling/abs_log_ratio_mean and docs/sampling.md.")
    elif gap > SAMPLER_GAP_FLOOR:
        sampler_dtype, trainer_dtype = dtypes
        when = "in the first round" if reference is None else f"(first round: {reference:.4f})"
        logger.warning(
            f"SAMPLER GAP: the sampler's log-probs are {gap:.4f} nats (mean |log ratio|) from the trainer's on the "
            f"same weights {when}; a precision gap explains at most ~{SAMPLER_GAP_FLOOR} (a {sampler_dtype} sampler "
            f"against a {trainer_dtype} trainer here; bf16 vs float32 measured 0.0009-0.0083, "
            "docs/results.md#the-sampler-gap-on-vllms-cpu-build). The "
            "sampler computes with other weights than the trainer: likely a server serving another checkpoint or "
            "revision, a weight load or sync that did not reach the engine's kernels, a quantized or mis-configured "
            "engine (dtype, rope scaling, chat template tokens), or other sampling parameters than the trainer's "
            "(temperature). Every importance ratio is off. Fix: point the sampler at the trained weights and check "
            "sampling/abs_log_ratio_mean falls below the bound.")
    return gap if reference is None else reference


class SamplerWatch:
    """The sampler checks of one run, after each training round (`check_sampler_round`); keeps the first round's gap.
    `min_agreement`: `routing_replay_min_agreement`; `dtypes`: (sampler, trainer) compute dtype names."""

    def __init__(self, min_agreement: float, dtypes: tuple[str, str]):
        self.min_agreement, self.dtypes = min_agreement, dtypes
        self.reference: float | None = None  # mean |log r| of the first training round: the sampler/trainer baseline

    def check(self, values: dict) -> None:
        self.reference = check_sampler_round(values, self.reference, self.min_agreement, self.dtypes)


def model_turns(tool_mask) -> list[int]:
    """Per sample, the model's turns in a multi-turn completion: runs of 1s in TRL's unpadded `tool_mask` (1: the
    model's tokens, 0: a tool's or environment's)."""
    return [sum(1 for t, flag in enumerate(mask) if flag and (t == 0 or not mask[t - 1])) for mask in tool_mask]


def log_turns(accelerator, metrics: dict, tool_mask) -> None:
    """`tools/turns_mean` and `tools/turns_max` over every rank's samples into TRL's `metrics` of the mode."""
    turns = accelerator.gather(torch.tensor(model_turns(tool_mask), device=accelerator.device)).float()
    metrics["tools/turns_mean"].append(turns.mean().item())
    metrics["tools/turns_max"].append(turns.max().item())
