"""Sampler/trainer mismatch metrics (trl_gspo.sampling.mismatch) against an independent float64 reference written
from their definitions with Python loops, over ragged masks, missing sampler log-probs and empty sequences."""

import math

import pytest
import torch

from trl_gspo.sampling.mismatch import finish_mismatch, mismatch_sums, sampling_metrics


def reference(logps, sampler, mask, eps_low, eps_high, changed=None):
    """Plain-Python definitions (docs/sampling.md): r_t = exp(trainer - sampler) over tokens with a sampler log-prob."""
    ratios, log_rs, seq_ratios, missing, masked, by_route = [], [], [], 0, 0, {True: [], False: []}
    for b in range(len(logps)):
        row = []
        for t in range(len(logps[b])):
            if not mask[b][t]:
                continue
            masked += 1
            if math.isnan(sampler[b][t]):
                missing += 1
                continue
            log_r = logps[b][t] - sampler[b][t]
            row.append(log_r)
            if changed is not None:
                by_route[bool(changed[b][t])].append(abs(log_r))
        log_rs += row
        ratios += [math.exp(x) for x in row]
        if row:
            seq_ratios.append(math.exp(sum(row) / len(row)))
    n, s = len(ratios), len(seq_ratios)
    values = {
        "sampling/token_ratio_mean": sum(ratios) / n if n else 1.0,
        "sampling/token_ratio_min": min(ratios) if n else 1.0,
        "sampling/token_ratio_max": max(ratios) if n else 1.0,
        "sampling/token_ratio_outside_0.5_2": sum(r < 0.5 or r > 2 for r in ratios) / max(n, 1),
        "sampling/abs_log_ratio_mean": sum(abs(x) for x in log_rs) / max(n, 1),
        "sampling/seq_ratio_mean": sum(seq_ratios) / s if s else 1.0,
        "sampling/seq_ratio_min": min(seq_ratios) if s else 1.0,
        "sampling/seq_ratio_max": max(seq_ratios) if s else 1.0,
        "sampling/seq_outside_clip_band": sum(not (1 - eps_low <= r <= 1 + eps_high) for r in seq_ratios) / max(s, 1),
        "sampling/k3_kl": sum(r - 1 - x for r, x in zip(ratios, log_rs)) / max(n, 1),
        "sampling/chi2": sum(r * r for r in ratios) / n - 1 if n else 0.0,
        "sampling/missing_logp_fraction": missing / max(masked, 1),
    }
    if changed is not None:
        values["routing/sampler_changed_token_fraction"] = len(by_route[True]) / max(n, 1)
        values["routing/sampler_changed_abs_log_ratio"] = sum(by_route[True]) / max(len(by_route[True]), 1)
        values["routing/sampler_unchanged_abs_log_ratio"] = sum(by_route[False]) / max(len(by_route[False]), 1)
    return values


def _batch(seed, batch=6, length=9, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    sampler = logps + torch.randn(batch, length, generator=g, dtype=torch.float64) * scale
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    lengths[0] = 0  # an empty completion
    mask = torch.arange(length)[None] < lengths[:, None]
    sampler[1, 0] = float("nan")  # a token the sampler did not score
    sampler[2] = float("nan")  # a whole sequence without sampler log-probs
    changed = torch.rand(batch, length, generator=g) < 0.3
    return logps.float(), sampler.float(), mask, changed


class _OneRank:
    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor


@pytest.mark.parametrize("seed,scale", [(0, 0.3), (1, 1.5), (2, 1e-4)])
def test_each_metric_matches_the_float64_reference(seed, scale):
    logps, sampler, mask, changed = _batch(seed, scale=scale)
    got = sampling_metrics(_OneRank(), logps, sampler, mask, 3e-4, 4e-4, changed)
    want = reference(logps.double().tolist(), sampler.double().tolist(), mask.tolist(), 3e-4, 4e-4, changed.tolist())
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-9), name


def test_sums_over_ranks_equal_the_whole_batch():
    """Two ranks' sums added and extremes maxed give the metrics of the concatenated batch."""
    logps, sampler, mask, changed = _batch(3)
    parts = [mismatch_sums(logps[rows], sampler[rows], mask[rows], 3e-4, 4e-4, changed[rows])
             for rows in (slice(0, 3), slice(3, 6))]
    totals = {k: parts[0][0][k] + parts[1][0][k] for k in parts[0][0]}
    extremes = torch.maximum(parts[0][1], parts[1][1])
    split = {k: float(v) for k, v in finish_mismatch(totals, extremes).items()}
    whole = sampling_metrics(_OneRank(), logps, sampler, mask, 3e-4, 4e-4, changed)
    assert split == pytest.approx(whole)


def test_no_mismatch_and_nothing_to_compare_read_as_neutral():
    logps, _, mask, _ = _batch(4)
    same = sampling_metrics(_OneRank(), logps, logps.clone(), mask, 3e-4, 4e-4)
    assert same["sampling/token_ratio_mean"] == same["sampling/token_ratio_max"] == 1.0
    assert same["sampling/k3_kl"] == same["sampling/seq_outside_clip_band"] == 0.0
    nothing = sampling_metrics(_OneRank(), logps, torch.full_like(logps, float("nan")), mask, 3e-4, 4e-4)
    assert all(math.isfinite(v) for v in nothing.values())
    assert nothing["sampling/missing_logp_fraction"] == 1.0 and nothing["sampling/token_ratio_mean"] == 1.0


def test_route_agreement_comes_from_the_replay_counts():
    logps, sampler, mask, _ = _batch(5)
    counts = torch.tensor([[3, 3, 10], [1, 1, 10]])  # (differing, forced, counted) per layer
    got = sampling_metrics(_OneRank(), logps, sampler, mask, 3e-4, 4e-4, agreement_counts=counts)
    assert got["routing/sampler_agreement"] == pytest.approx(1 - 4 / 20)


def test_sampler_drift_rule():
    from trl_gspo.sampling.mismatch import sampler_drifted

    # a bf16 engine's round-1 gap (0.025) that stays put or grows a little is not drift; 0.424 (an engine that
    # missed its weight sync, docs/sampling.md) is; a tiny float32 gap growing to 0.02 stays under the margin
    assert not sampler_drifted(0.025, 0.027) and not sampler_drifted(0.025, 0.07)
    assert sampler_drifted(0.025, 0.424) and sampler_drifted(0.025, 0.101)
    assert not sampler_drifted(1e-7, 0.02) and sampler_drifted(1e-7, 0.051)


def _round_warnings(caplog, rounds, dtypes=("bfloat16", "float32")):
    """check_sampler_round over successive rounds' gaps; the warnings logged, one list per round."""
    from trl_gspo.sampling.mismatch import check_sampler_round

    reference, seen = None, []
    for gap in rounds:
        caplog.clear()
        reference = check_sampler_round({"sampling/abs_log_ratio_mean": gap}, reference, 0.0, dtypes)
        seen.append([r.getMessage() for r in caplog.records])
    return seen


def test_a_sampler_wrong_from_the_first_round_is_announced_at_once(caplog):
    from trl_gspo.sampling.mismatch import SAMPLER_GAP_FLOOR

    caplog.set_level("WARNING")
    # wrong from round 1 (another checkpoint): the first round sets the drift baseline, so only the floor can see it
    first, second = _round_warnings(caplog, [0.8, 0.8])
    assert len(first) == 1 and first[0].startswith("SAMPLER GAP") and "0.8000" in first[0]
    assert "bfloat16 sampler against a float32 trainer" in first[0] and "first round" in first[0]
    assert len(second) == 1 and second[0].startswith("SAMPLER GAP")  # and every round it stays wrong
    # a healthy precision gap (bf16 engine vs float32 trainer measured 0.001-0.01; 0.03 for margin) stays quiet,
    # at the floor too
    assert _round_warnings(caplog, [0.03, 0.025, SAMPLER_GAP_FLOOR]) == [[], [], []]
    # a sync that breaks later: one drift warning per round, not two
    later = _round_warnings(caplog, [0.025, 0.7, 0.42])
    assert later[0] == [] and all(len(w) == 1 and w[0].startswith("SAMPLER DRIFT") for w in later[1:])
