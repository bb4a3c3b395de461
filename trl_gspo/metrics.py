"""The gspo loss's logged metrics (docs/metrics.md), for both trainers. The pure functions are sync-free: every value
stays on the device; the sums are reduced over ranks (one `reduce`), the per-sequence values gathered (one `gather`)
and the result read to the host once. Knows no trainer and no TRL; `read_to_host` takes an accelerate `Accelerator`.

    sums = metric_sums(out, mask, entropies, policy_loss, per_token_kl, aux_loss, delta_clipped)
    per_sequence = per_sequence_values(out, mask)
    values = finish(reduce(sums), gather(per_sequence))      # dict name -> 0-d tensor

`read_to_host` does those three steps and the host read, with the loss inputs' NaN/Inf counts in the same reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .losses import raise_if_nonfinite


def metric_sums(out, mask, entropies, policy_loss, per_token_kl=None, aux_loss=None, with_delta=False) -> dict:
    """Per-rank sums to add over ranks: token counts and token sums (for means over every rank's tokens) and
    per-rank scalars with a rank count (for means over ranks). `out` is a `GSPOLossOutput`."""
    mask = mask.float()
    sums = {
        "tokens": mask.sum(),
        "entropy": (entropies.float() * mask).sum(),
        "clipped": ((out.low_clipped | out.high_clipped).float() * mask).sum(),
        "policy_loss": policy_loss.float(),
        "ranks": torch.ones((), device=mask.device),
    }
    if per_token_kl is not None:
        sums["kl"] = (per_token_kl.float() * mask).sum()
    if with_delta:
        sums["delta_clipped"] = (out.delta_clipped.float() * mask).sum()
    if aux_loss is not None:
        sums["aux_loss"] = aux_loss.float()
    return sums


PER_SEQUENCE_COLUMNS = 5  # `per_sequence_values`'s columns; a caller's extra columns follow them


def per_sequence_values(out, mask) -> torch.Tensor:
    """`[sequences, 5]`: low-clipped, high-clipped, clipped, log s_i, non-empty. A sequence counts as clipped if its
    ratio was (for gspo_token with per-token advantages: if any of its tokens was)."""
    return torch.stack([
        out.low_clipped.any(-1).float(), out.high_clipped.any(-1).float(),
        (out.low_clipped | out.high_clipped).any(-1).float(), out.log_ratio.float(), (mask.sum(-1) > 0).float(),
    ], dim=1)


def finish(totals: dict, per_sequence: torch.Tensor, present: torch.Tensor | None = None) -> dict:
    """Metric values from the rank-summed `totals` and every rank's `per_sequence` rows. Ratio statistics are over
    non-empty sequences (1 / 0 when there is none). `present` (rows,) marks the real rows where a gather padded
    ranks to one shape (without a host read to drop the padding); None: all rows are real."""
    tokens = totals["tokens"].clamp(min=1.0)
    if present is None:
        present = torch.ones(per_sequence.shape[0], dtype=torch.bool, device=per_sequence.device)
    per_sequence = torch.where(present[:, None], per_sequence, torch.zeros_like(per_sequence))
    low, high, region, log_ratio, nonempty = per_sequence[:, :5].unbind(1)
    nonempty = nonempty.bool() & present
    count = nonempty.sum()
    rows = present.sum().clamp(min=1)
    one = torch.ones((), device=per_sequence.device)
    log_ratio = torch.where(nonempty, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    ratio_mean = (ratio * nonempty).sum() / count.clamp(min=1)
    ratio_var = ((ratio - ratio_mean) ** 2 * nonempty).sum() / (count - 1).clamp(min=1)
    inf = torch.full_like(ratio, float("inf"))
    values = {
        "entropy": totals["entropy"] / tokens,
        "policy_loss": totals["policy_loss"] / totals["ranks"],
        "clip_ratio/low_mean": low.sum() / rows, "clip_ratio/low_min": torch.where(present, low, inf).min(),
        "clip_ratio/high_mean": high.sum() / rows, "clip_ratio/high_max": torch.where(present, high, -inf).max(),
        "clip_ratio/region_mean": region.sum() / rows,
        # The paper's "fraction of clipped tokens": completion tokens whose objective term was clipped.
        "gspo/clipped_token_fraction": totals["clipped"] / tokens,
        "gspo/ratio_mean": torch.where(count > 0, ratio_mean, one),
        "gspo/ratio_std": torch.where(count > 1, ratio_var.sqrt(), 0 * one),
        "gspo/ratio_min": torch.where(count > 0, torch.where(nonempty, ratio, inf).min(), one),
        "gspo/ratio_max": torch.where(count > 0, torch.where(nonempty, ratio, -inf).max(), one),
        "gspo/log_ratio_abs_max": log_ratio.abs().max(),
    }
    if "kl" in totals:
        values["kl"] = totals["kl"] / tokens
    if "aux_loss" in totals:
        values["aux_loss"] = totals["aux_loss"] / totals["ranks"]
    if "delta_clipped" in totals:
        values["gspo/delta_clipped_token_fraction"] = totals["delta_clipped"] / tokens
    return values


@dataclass
class HostMetrics:
    """What `read_to_host` read: the metric values (`finish`'s names) and the counts they are means over, each summed
    over every rank; the caller's extra sums, reduced; the caller's statistics of the gathered rows."""

    values: dict[str, float]
    tokens: float
    completions: float
    nonempty: float
    extra_sums: list[float] = field(default_factory=list)
    row_stats: list[float] = field(default_factory=list)


def read_to_host(accelerator, out, mask, entropies, policy_loss, nonfinite, *, per_token_kl=None, aux_loss=None,
                 with_delta=False, extra_sums=None, extra_columns=None, ranks_differ=False,
                 row_stats: Callable | None = None) -> HostMetrics:
    """One reduce (the metric sums, the NaN/Inf counts `nonfinite` of the loss inputs and the caller's `extra_sums`),
    one gather (the per-sequence rows, with the caller's `extra_columns` appended), one host read; then
    `raise_if_nonfinite`, on every rank at once since the counts were summed. `ranks_differ`: ranks hold different
    numbers of sequences, so rows are padded with NaN for the gather (accelerate's `pad_across_processes`, one more
    small collective) and left out by `finish`'s `present`. `row_stats(rows, present)` computes more values from the
    gathered rows on the device, read in the same host read."""
    sums = metric_sums(out, mask, entropies, policy_loss, per_token_kl, aux_loss, with_delta=with_delta)
    device = mask.device
    extra = torch.zeros(0, device=device) if extra_sums is None else extra_sums.float().flatten()
    reduced = accelerator.reduce(torch.cat([nonfinite.float(), torch.stack(list(sums.values())), extra]),
                                 reduction="sum")
    totals = dict(zip(sums, reduced[3:3 + len(sums)]))
    rows = per_sequence_values(out, mask)
    if extra_columns is not None:
        rows = torch.cat([rows, extra_columns.float()], 1)
    present = None
    if ranks_differ:  # column 0 (low-clipped, 0 or 1) is never NaN in a real row
        rows = accelerator.gather(accelerator.pad_across_processes(rows, dim=0, pad_index=float("nan")))
        present = ~rows[:, 0].isnan()
    else:
        rows = accelerator.gather(rows)
    values = finish(totals, rows, present)
    real = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device) if present is None else present
    counts = torch.stack([totals["tokens"], real.sum().float(), (real & (rows[:, 4] > 0)).sum().float()])
    stats = torch.zeros(0, device=rows.device) if row_stats is None else row_stats(rows, real)
    host = torch.cat([reduced[:3], counts, torch.stack(list(values.values())).float(), reduced[3 + len(sums):],
                      stats.float()]).tolist()  # the one sync
    raise_if_nonfinite(host[:3])
    tokens, completions, nonempty = host[3:6]
    host = host[6:]
    named = dict(zip(values, host))
    host = host[len(values):]
    return HostMetrics(named, tokens, completions, nonempty, host[:len(extra)], host[len(extra):])
