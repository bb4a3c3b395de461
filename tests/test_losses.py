"""Tests for trl_gspo.losses against an independent float64 reference.

The reference (``_ref_*`` below) is written from the equations of *Group Sequence Policy Optimization*
(arXiv 2507.18071) as plain Python loops over sequences and tokens in float64; it never calls into
``trl_gspo.losses``.  Gradients of the reference are derived analytically:

* GSPO (Eq. 5, 7): loss_i = -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp_t - old_t)).
  d loss_i / d logp_t = -A_i s_i / |y_i| when the unclipped term is the one selected (s A <= clip(s) A,
  which includes the tie inside the band), 0 when the clipped term is strictly smaller (then s is outside
  the band and clip(s) is constant).
* GSPO-token (Eq. 13, 14): s_i,t = sg[s_i] pi_t / sg[pi_t], so d s_i,t / d logp_u = s_i [t == u];
  loss_i = -(1/|y_i|) sum_t min(s_i A_i,t, clip(s_i) A_i,t);
  d loss_i / d logp_t = -A_i,t s_i / |y_i| if s_i A_i,t <= clip(s_i) A_i,t else 0.
* Two-sided clipping (``delta``, INTELLECT-2 as TRL defines it for token ratios, here on s_i): the unclipped term
  becomes min(s_i, delta) A; its gradient is that of s_i A where s_i < delta and 0 where s_i > delta.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_gspo.losses import (
    _clipped_surrogate,
    adaptive_clip_epsilon,
    adaptive_entropy_coef,
    applied_entropy_coef,
    gspo_loss,
    gspo_token_loss,
    k3_kl,
    nonfinite_counts,
    raise_if_nonfinite,
)

EPS_LOW = 3e-4
EPS_HIGH = 4e-4
TOL = 1e-6


# --------------------------------------------------------------------------------------------------------------
# Independent float64 reference
# --------------------------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().to(torch.float64).tolist()


def _seq_log_ratio(lp_row, old_row, m_row) -> tuple[float, int]:
    idx = [t for t, m in enumerate(m_row) if m]
    n = len(idx)
    if n == 0:
        return 0.0, 0
    return math.fsum(lp_row[t] - old_row[t] for t in idx) / n, n


def _clip(s: float, eps_low: float, eps_high: float) -> float:
    return min(max(s, 1.0 - eps_low), 1.0 + eps_high)


def _unclipped(s: float, delta) -> tuple[float, float]:
    """The unclipped ratio term and its derivative in s: s (1), or min(s, delta) with two-sided clipping."""
    if delta is not None and s > delta:
        return delta, 0.0
    return s, 1.0


def _ref_gspo(logps, old_logps, advantages, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=None):
    """Returns (per_sequence_loss, d sum(loss) / d logps, log_ratio, low_clipped, high_clipped) as lists."""
    lp, old, m = _rows(logps), _rows(old_logps), mask.tolist()
    adv = advantages.detach().to(torch.float64).reshape(-1).tolist()
    B, T = len(lp), len(lp[0])
    losses, grads, log_ratios, lows, highs = [], [], [], [], []
    for i in range(B):
        lr, n = _seq_log_ratio(lp[i], old[i], m[i])
        log_ratios.append(lr)
        g = [0.0] * T
        low = [False] * T
        high = [False] * T
        if n == 0:
            losses.append(0.0)
        else:
            s = math.exp(lr)
            a = adv[i]
            c = _clip(s, eps_low, eps_high)
            u, du = _unclipped(s, delta)
            unclipped, clipped = u * a, c * a
            losses.append(-min(unclipped, clipped))
            for t in range(T):
                if not m[i][t]:
                    continue
                if unclipped <= clipped:
                    g[t] = -a * du * s / n
                low[t] = s < 1.0 - eps_low and a < 0
                high[t] = s > 1.0 + eps_high and a > 0
        grads.append(g)
        lows.append(low)
        highs.append(high)
    return losses, grads, log_ratios, lows, highs


def _ref_gspo_token(logps, old_logps, advantages, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=None):
    """GSPO-token reference; ``advantages`` is (B,) or (B, T). Same return layout as ``_ref_gspo``."""
    lp, old, m = _rows(logps), _rows(old_logps), mask.tolist()
    B, T = len(lp), len(lp[0])
    adv = advantages.detach().to(torch.float64)
    if adv.dim() == 1:
        adv = adv[:, None].expand(B, T)
    adv = adv.tolist()
    losses, grads, log_ratios, lows, highs = [], [], [], [], []
    for i in range(B):
        lr, n = _seq_log_ratio(lp[i], old[i], m[i])
        log_ratios.append(lr)
        g = [0.0] * T
        low = [False] * T
        high = [False] * T
        if n == 0:
            losses.append(0.0)
        else:
            s = math.exp(lr)
            c = _clip(s, eps_low, eps_high)
            u, du = _unclipped(s, delta)
            terms = []
            for t in range(T):
                if not m[i][t]:
                    continue
                a = adv[i][t]
                unclipped, clipped = u * a, c * a
                terms.append(min(unclipped, clipped))
                if unclipped <= clipped:
                    g[t] = -a * du * s / n
                low[t] = s < 1.0 - eps_low and a < 0
                high[t] = s > 1.0 + eps_high and a > 0
            losses.append(-math.fsum(terms) / n)
        grads.append(g)
        lows.append(low)
        highs.append(high)
    return losses, grads, log_ratios, lows, highs


def _ref_k3(logps, ref_logps):
    out = []
    for lp_row, ref_row in zip(_rows(logps), _rows(ref_logps)):
        out.append([math.exp(r - l) - (r - l) - 1.0 for l, r in zip(lp_row, ref_row)])
    return out


# --------------------------------------------------------------------------------------------------------------
# Shared functions
# --------------------------------------------------------------------------------------------------------------


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def _close(actual: torch.Tensor, expected, tol=TOL):
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach().to(torch.float64), expected_t, rtol=tol, atol=tol)


def _run(fn, logps, old_logps, advantages, mask, **kw):
    """Call ``fn`` on a fresh leaf copy of logps; return (output, grad of per_sequence_loss.sum())."""
    leaf = logps.detach().clone().requires_grad_(True)
    out = fn(leaf, old_logps, advantages, mask, **kw)
    out.per_sequence_loss.sum().backward()
    return out, leaf.grad


def _make_old(logps, mask, target_log_ratio, noise=0.3, generator=None):
    """old_logps such that the masked mean of (logps - old_logps) per row equals ``target_log_ratio[i]``.

    Per-token differences are not constant (noise with zero masked mean is added), so a length-weighted or
    unmasked implementation would give a different ratio.
    """
    mask_f = mask.to(torch.float64)
    diff = torch.randn(logps.shape, dtype=torch.float64, generator=generator) * noise
    n = mask_f.sum(-1, keepdim=True).clamp(min=1)
    diff = diff - (diff * mask_f).sum(-1, keepdim=True) / n  # zero masked mean
    diff = diff + torch.as_tensor(target_log_ratio, dtype=torch.float64)[:, None]
    return logps.to(torch.float64) - diff


def _lengths_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()


def _check_against_ref(fn, ref, logps, old, adv, mask, **kw):
    out, grad = _run(fn, logps, old, adv, mask, **kw)
    losses, grads, log_ratios, lows, highs = ref(logps, old, adv, mask, **kw)
    _close(out.per_sequence_loss, losses)
    _close(grad, grads)
    _close(out.log_ratio, log_ratios)
    assert out.low_clipped.dtype == torch.bool and out.high_clipped.dtype == torch.bool
    assert out.low_clipped.tolist() == lows
    assert out.high_clipped.tolist() == highs
    _check_per_token_loss(fn, out, logps, old, adv, mask, losses, **kw)
    return out, grad, losses, grads


def _ref_token_losses(logps, old_logps, advantages, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=None):
    """(B, T) reference per-token loss: -min(s_i A_i,t, clip(s_i) A_i,t) on valid tokens, 0 elsewhere."""
    lp, old, m = _rows(logps), _rows(old_logps), mask.tolist()
    B, T = len(lp), len(lp[0])
    adv = advantages.detach().to(torch.float64)
    adv = adv.reshape(B, -1).expand(B, T).tolist()
    out = []
    for i in range(B):
        lr, n = _seq_log_ratio(lp[i], old[i], m[i])
        s = math.exp(lr)
        c = _clip(s, eps_low, eps_high)
        u = _unclipped(s, delta)[0]
        out.append([-min(u * adv[i][t], c * adv[i][t]) if m[i][t] else 0.0 for t in range(T)])
    return out


def _check_per_token_loss(fn, out, logps, old, adv, mask, losses, **kw):
    """per_token_loss: (B, T), 0 at padding, its masked token mean is per_sequence_loss; for GSPO every valid
    token holds the sequence loss, for GSPO-token the token's own clipped term."""
    ptl = out.per_token_loss
    B, T = logps.shape
    assert ptl.shape == (B, T)
    assert torch.all(ptl[mask == 0] == 0)
    assert torch.isfinite(ptl).all()
    mask_f = mask.to(torch.float64)
    token_mean = (ptl.detach().double() * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)
    _close(token_mean, losses)
    if fn is gspo_loss:
        expected = [[losses[i] if mask[i, t] else 0.0 for t in range(T)] for i in range(B)]
    else:
        expected = _ref_token_losses(logps, old, adv, mask, **kw)
    _close(ptl, expected)


# --------------------------------------------------------------------------------------------------------------
# GSPO sequence loss
# --------------------------------------------------------------------------------------------------------------


def _token_surrogate_sum(lp_new, lp0, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=None):
    """Eq. 13/14 with the stop-gradients made explicit: s_i,t = s_i(lp0) * exp(lp_new_t - lp0_t)."""
    total = 0.0
    lp_new, lp0, old, m, adv = _rows(lp_new), _rows(lp0), _rows(old), mask.tolist(), _rows(adv)
    for i in range(len(lp0)):
        lr, n = _seq_log_ratio(lp0[i], old[i], m[i])
        if n == 0:
            continue
        s0 = math.exp(lr)
        for t in range(len(lp0[i])):
            if m[i][t]:
                s_it = s0 * math.exp(lp_new[i][t] - lp0[i][t])
                a = adv[i][t]
                total -= min(_unclipped(s_it, delta)[0] * a, _clip(s_it, eps_low, eps_high) * a) / n
    return total


def test_reference_self_check_gradient_matches_finite_differences():
    """Guard the analytic reference gradients with float64 central differences.

    GSPO: difference of the reference loss itself. GSPO-token: the loss value also depends on logps through
    sg[s_i], so the difference is taken of the explicit stop-gradient surrogate instead.
    """
    torch.manual_seed(0)
    B, T = 4, 5
    logps = -torch.rand(B, T, dtype=torch.float64) * 3
    mask = _lengths_mask([5, 3, 1, 4], T)
    old = _make_old(logps, mask, [1e-4, -5e-4, 0.0, 2e-3])
    h = 1e-7
    adv_seq = _t([1.0, -0.7, 0.4, -1.3])
    adv_tok = torch.randn(B, T, dtype=torch.float64)
    _, grads_seq, *_ = _ref_gspo(logps, old, adv_seq, mask)
    _, grads_tok, *_ = _ref_gspo_token(logps, old, adv_tok, mask)
    n_nonzero = 0
    for i in range(B):
        for t in range(T):
            plus, minus = logps.clone(), logps.clone()
            plus[i, t] += h
            minus[i, t] -= h
            fd = (sum(_ref_gspo(plus, old, adv_seq, mask)[0]) - sum(_ref_gspo(minus, old, adv_seq, mask)[0])) / (2 * h)
            assert abs(fd - grads_seq[i][t]) < 1e-6
            fd_tok = (
                _token_surrogate_sum(plus, logps, old, adv_tok, mask)
                - _token_surrogate_sum(minus, logps, old, adv_tok, mask)
            ) / (2 * h)
            assert abs(fd_tok - grads_tok[i][t]) < 1e-6
            n_nonzero += grads_seq[i][t] != 0
    assert n_nonzero > 0


def test_gspo_random_inputs_match_reference():
    torch.manual_seed(1)
    B, T = 8, 7
    logps = -torch.rand(B, T, dtype=torch.float64) * 4
    old = logps + torch.randn(B, T, dtype=torch.float64) * 1e-3
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    out, grad, losses, _ = _check_against_ref(gspo_loss, _ref_gspo, logps, old, adv, mask)
    assert out.per_sequence_loss.shape == (B,)
    assert out.low_clipped.shape == out.high_clipped.shape == (B, T)
    assert out.log_ratio.dtype == torch.float64
    _close(out.ratio, [math.exp(v) for v in out.log_ratio.tolist()])
    # Objective is the plain mean of per-sequence losses.
    _close(out.per_sequence_loss.mean(), sum(losses) / B)
    # Sanity: the random inputs actually exercise gradients.
    assert grad.abs().max() > 0


@pytest.mark.parametrize("eps_low,eps_high", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_ratios_inside_and_outside_band_both_signs(eps_low, eps_high):
    """Each row lands in a chosen regime: inside band, above it, below it; with A > 0 and A < 0."""
    torch.manual_seed(2)
    T = 6
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    inside = 0.5 * hi
    above = hi + 0.5 * max(eps_high, 1e-3)
    below = lo - 0.5 * max(eps_low, 1e-3)
    cases = [
        (inside, 1.3),   # unclipped, grad -A s/n
        (inside, -0.8),  # unclipped
        (above, 1.1),    # clipped (high): grad 0
        (above, -0.9),   # unclipped (min picks s*A since A<0 and s > clip(s))
        (below, -1.2),   # clipped (low): grad 0
        (below, 0.7),    # unclipped (min picks s*A since A>0 and s < clip(s))
    ]
    B = len(cases)
    logps = -torch.rand(B, T, dtype=torch.float64) * 3 - 0.1
    mask = torch.ones(B, T, dtype=torch.long)
    old = _make_old(logps, mask, [c[0] for c in cases])
    adv = _t([c[1] for c in cases])
    kw = dict(eps_low=eps_low, eps_high=eps_high)
    out, grad, losses, grads = _check_against_ref(gspo_loss, _ref_gspo, logps, old, adv, mask, **kw)

    _close(out.log_ratio, [c[0] for c in cases])
    ratio = out.ratio
    # Rows 2 and 4 are clipped: loss is -clip(s)*A, which differs from the unclipped -s*A.
    assert torch.allclose(out.per_sequence_loss[2], -(1 + eps_high) * adv[2])
    assert torch.allclose(out.per_sequence_loss[4], -(1 - eps_low) * adv[4])
    assert not torch.allclose(out.per_sequence_loss[2], -ratio[2] * adv[2], rtol=0, atol=1e-9)
    assert not torch.allclose(out.per_sequence_loss[4], -ratio[4] * adv[4], rtol=0, atol=1e-9)
    # Clipped rows: zero gradient; all others: gradient -A s / |y| on every token.
    for i in range(B):
        if i in (2, 4):
            assert torch.all(grad[i] == 0)
        else:
            expected = -adv[i] * ratio[i] / T
            assert expected.abs() > 0
            _close(grad[i], torch.full((T,), float(expected), dtype=torch.float64))
    assert out.high_clipped[2].all() and not out.high_clipped[[0, 1, 3, 4, 5]].any()
    assert out.low_clipped[4].all() and not out.low_clipped[[0, 1, 2, 3, 5]].any()


def test_gspo_min_tie_inside_band_gives_full_unclipped_gradient():
    """Inside the band both min() terms are equal; the gradient must be the whole unclipped one, not half."""
    T = 4
    logps = _t([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -0.6, -0.8]])
    mask = torch.ones(2, T, dtype=torch.long)
    old = logps.clone()  # s == 1 exactly, strictly inside the band
    adv = _t([2.0, -3.0])
    out, grad = _run(gspo_loss, logps, old, adv, mask)
    _close(out.per_sequence_loss, [-2.0, 3.0])
    _close(grad, [[-2.0 / T] * T, [3.0 / T] * T])
    # Exactly at the band edges nothing is clipped (the clip indicators are strict), so the full gradient flows.
    # torch 2.14's min/clamp subgradients would give half of it here; the loss must not depend on them. The ratio
    # is set directly: built from log-probs, exp(mean(logps - old)) lands an ulp either side of the edge.
    for edge, a in ((1.0 + EPS_HIGH, 1.0), (1.0 - EPS_LOW, -1.0)):
        ratio = torch.tensor([edge], dtype=torch.float64, requires_grad=True)
        loss, low, high, capped = _clipped_surrogate(ratio, _t([a]), EPS_LOW, EPS_HIGH)
        loss.sum().backward()
        _close(loss, [-a * edge])
        _close(ratio.grad, [-a])
        assert not low.any() and not high.any() and not capped.any()


def test_gspo_is_plain_mean_not_length_weighted():
    torch.manual_seed(3)
    T = 10
    lengths = [10, 2]
    mask = _lengths_mask(lengths, T)
    logps = -torch.rand(2, T, dtype=torch.float64)
    old = _make_old(logps, mask, [1e-4, -1e-4])
    adv = _t([1.0, 1.0])
    out, _ = _run(gspo_loss, logps, old, adv, mask)
    losses, *_ = _ref_gspo(logps, old, adv, mask)
    _close(out.per_sequence_loss.mean(), sum(losses) / 2)
    length_weighted = sum(l * n for l, n in zip(losses, lengths)) / sum(lengths)
    assert abs(sum(losses) / 2 - length_weighted) > 1e-6


def test_gspo_padded_variable_lengths_with_garbage_and_nan():
    torch.manual_seed(4)
    B, T = 5, 9
    lengths = [9, 4, 1, 6, 2]
    mask = _lengths_mask(lengths, T)
    logps = -torch.rand(B, T, dtype=torch.float64) * 3
    old = _make_old(logps, mask, [1e-4, 6e-4, -2e-4, -9e-4, 0.0])
    adv = _t([0.5, 1.2, -0.3, -1.0, 2.0])
    pad = mask == 0
    garbage_logps = logps.masked_fill(pad, float("nan"))
    garbage_logps[1, 7] = float("inf")
    garbage_logps[3, 8] = -1e30
    garbage_old = old.masked_fill(pad, 123.0)
    garbage_old[4, -1] = float("nan")
    garbage_old[2, 3] = float("-inf")

    out, grad, _, _ = _check_against_ref(gspo_loss, _ref_gspo, garbage_logps, garbage_old, adv, mask)
    assert torch.isfinite(out.per_sequence_loss).all() and torch.isfinite(grad).all()
    assert torch.all(grad[pad] == 0)
    # Same as the clean inputs.
    clean, clean_grad = _run(gspo_loss, logps, old, adv, mask)
    _close(out.per_sequence_loss, clean.per_sequence_loss)
    _close(grad, clean_grad)
    # The padding really matters: an unmasked mean of the clean inputs gives different ratios.
    unmasked = (logps - old).mean(-1)
    assert (unmasked - clean.log_ratio).abs().max() > 1e-3
    # bool mask and float mask give the same result.
    out_b, grad_b = _run(gspo_loss, garbage_logps, garbage_old, adv, mask.bool())
    out_f, grad_f = _run(gspo_loss, garbage_logps, garbage_old, adv, mask.double())
    _close(out_b.per_sequence_loss, out.per_sequence_loss)
    _close(out_f.per_sequence_loss, out.per_sequence_loss)
    _close(grad_b, grad)
    _close(grad_f, grad)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_zero_length_completions_finite_zero_loss_and_gradient(fn):
    torch.manual_seed(5)
    B, T = 4, 5
    mask = _lengths_mask([5, 0, 3, 0], T)
    logps = -torch.rand(B, T, dtype=torch.float64)
    old = _make_old(logps, mask, [1e-4, 0.0, -1e-4, 0.0])
    logps[1] = 7.0  # garbage in the empty rows (finite: an empty row has no valid position at all)
    old[3] = -50.0
    adv = _t([1.0, 5.0, -1.0, -5.0])
    out, grad = _run(fn, logps, old, adv, mask)
    assert torch.isfinite(out.per_sequence_loss).all()
    assert out.per_sequence_loss[1] == 0 and out.per_sequence_loss[3] == 0
    assert torch.all(grad[[1, 3]] == 0)
    assert torch.all(out.log_ratio[[1, 3]] == 0)
    assert grad[mask.bool() & (adv[:, None] != 0)].abs().min() > 0
    assert not out.low_clipped[[1, 3]].any() and not out.high_clipped[[1, 3]].any()
    ref = _ref_gspo if fn is gspo_loss else _ref_gspo_token
    losses, grads, *_ = ref(logps, old, adv, mask)
    _close(out.per_sequence_loss, losses)
    _close(grad, grads)
    # All-empty batch: still finite.
    out0, grad0 = _run(fn, logps, old, adv, torch.zeros(B, T, dtype=torch.long))
    assert torch.all(out0.per_sequence_loss == 0) and torch.all(grad0 == 0)
    assert torch.isfinite(out0.per_sequence_loss.mean())


# --------------------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------------------


def _valid_inputs(B=3, T=4):
    torch.manual_seed(6)
    logps = -torch.rand(B, T, dtype=torch.float64)
    old = logps - 1e-4
    adv = _t([1.0, -1.0, 0.5])
    mask = _lengths_mask([4, 2, 3], T)
    return logps, old, adv, mask


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("name", ["logps", "old_logps", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_at_valid_positions_raises(fn, name, bad):
    logps, old, adv, mask = _valid_inputs()
    args = {"logps": logps, "old_logps": old, "advantages": adv}
    args[name] = args[name].clone()
    if name == "advantages":
        args[name][1] = bad
    else:
        args[name][1, 1] = bad  # mask[1, 1] == 1
    with pytest.raises(ValueError, match=f"`{name}`"):
        fn(args["logps"], args["old_logps"], args["advantages"], mask)
    # The unmodified inputs are accepted.
    fn(logps, old, adv, mask)


def test_non_finite_per_token_advantage_at_valid_position_raises():
    logps, old, _, mask = _valid_inputs()
    adv = torch.ones(3, 4, dtype=torch.float64)
    adv[2, 1] = float("nan")
    with pytest.raises(ValueError, match="`advantages`"):
        gspo_token_loss(logps, old, adv, mask)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_nan_at_masked_position_does_not_raise(fn):
    logps, old, adv, mask = _valid_inputs()
    logps = logps.clone()
    old = old.clone()
    logps[1, 3] = float("nan")  # mask[1, 3] == 0
    old[1, 2] = float("inf")  # mask[1, 2] == 0
    out = fn(logps, old, adv, mask)
    assert torch.isfinite(out.per_sequence_loss).all()
    losses, *_ = (_ref_gspo if fn is gspo_loss else _ref_gspo_token)(logps, old, adv, mask)
    _close(out.per_sequence_loss, losses)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("eps_low,eps_high", [(0.0, 4e-4), (-1e-4, 4e-4), (3e-4, 0.0), (3e-4, -0.1), (1.0, 0.2)])
def test_bad_eps_raises(fn, eps_low, eps_high):
    logps, old, adv, mask = _valid_inputs()
    with pytest.raises(ValueError):
        fn(logps, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    fn(logps, old, adv, mask, eps_low=0.2, eps_high=0.28)  # valid range accepted


@pytest.mark.parametrize(
    "fn,shape",
    [
        (gspo_loss, (2,)),
        (gspo_loss, (4,)),
        (gspo_loss, (3, 4)),  # per-token advantages are not accepted by the sequence loss
        (gspo_token_loss, (2,)),
        (gspo_token_loss, (4,)),
        (gspo_token_loss, (3, 3)),
        (gspo_token_loss, (3, 5)),
        (gspo_token_loss, (2, 4)),
        (gspo_token_loss, (3, 4, 1)),
    ],
)
def test_wrong_advantage_shape_raises(fn, shape):
    logps, old, _, mask = _valid_inputs()
    with pytest.raises(ValueError, match="advantages"):
        fn(logps, old, torch.ones(shape, dtype=torch.float64), mask)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_advantages_b1_shape_accepted(fn):
    logps, old, adv, mask = _valid_inputs()
    a, _ = _run(fn, logps, old, adv, mask)
    b, _ = _run(fn, logps, old, adv[:, None], mask)
    _close(b.per_sequence_loss, a.per_sequence_loss)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_mismatched_logps_shapes_raise_without_input_checks(fn):
    logps, old, adv, mask = _valid_inputs()
    with pytest.raises(ValueError, match="same"):
        fn(logps, old[:, :3], adv, mask, check_inputs=False)
    with pytest.raises(ValueError, match="same"):
        fn(logps, old, adv, mask[:, :3], check_inputs=False)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("which", ["old_logps", "mask"])
def test_mismatched_logps_shapes_raise_value_error(fn, which):
    logps, old, adv, mask = _valid_inputs()
    if which == "old_logps":
        old = old[:, :3]
    else:
        mask = mask[:, :3]
    with pytest.raises(ValueError, match="same"):
        fn(logps, old, adv, mask)


# --------------------------------------------------------------------------------------------------------------
# GSPO-token
# --------------------------------------------------------------------------------------------------------------


def _mixed_batch(seed, B=6, T=8, eps_low=EPS_LOW, eps_high=EPS_HIGH):
    g = torch.Generator().manual_seed(seed)
    lengths = [8, 5, 3, 7, 1, 6][:B]
    mask = _lengths_mask(lengths, T)
    logps = -torch.rand(B, T, dtype=torch.float64, generator=g) * 4
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    targets = [0.5 * hi, hi + 2 * eps_high, lo - 2 * eps_low, 0.3 * lo, hi + 5 * eps_high, lo - 5 * eps_low][:B]
    old = _make_old(logps, mask, targets, generator=g)
    return logps, old, mask, targets


def test_gspo_token_equals_gspo_with_sequence_advantages():
    logps, old, mask, _ = _mixed_batch(7)
    B = logps.shape[0]
    for adv in (_t([1.0, 1.0, -1.0, -0.5, -2.0, 0.8]), _t([-1.0, -1.0, 1.0, 0.5, 2.0, -0.8])):
        seq, seq_grad = _run(gspo_loss, logps, old, adv, mask)
        for a in (adv, adv[:, None], adv[:, None].expand(B, logps.shape[1]).clone()):
            tok, tok_grad = _run(gspo_token_loss, logps, old, a, mask)
            _close(tok.per_sequence_loss, seq.per_sequence_loss)
            _close(tok_grad, seq_grad)
            _close(tok.log_ratio, seq.log_ratio)
            assert torch.equal(tok.low_clipped, seq.low_clipped)
            assert torch.equal(tok.high_clipped, seq.high_clipped)
        # both regimes are present: some rows have gradient, some are clipped to zero
        row_has_grad = (seq_grad.abs().sum(-1) > 0).tolist()
        assert any(row_has_grad) and not all(row_has_grad)
        _check_against_ref(gspo_token_loss, _ref_gspo_token, logps, old, adv, mask)


@pytest.mark.parametrize("eps_low,eps_high", [(EPS_LOW, EPS_HIGH), (0.2, 0.28)])
def test_gspo_token_per_token_advantages_match_reference(eps_low, eps_high):
    torch.manual_seed(8)
    logps, old, mask, _ = _mixed_batch(8, eps_low=eps_low, eps_high=eps_high)
    adv = torch.randn(logps.shape, dtype=torch.float64)
    adv[mask == 0] = 1e6  # large but finite values at padding must not matter
    out, grad, losses, grads = _check_against_ref(
        gspo_token_loss, _ref_gspo_token, logps, old, adv, mask, eps_low=eps_low, eps_high=eps_high
    )
    assert torch.all(grad[mask == 0] == 0)
    # Per-token advantages differ from their per-sequence mean: the loss differs from gspo with mean advantage
    # in at least one clipped row (mixed-sign tokens: some clipped, some not).
    mean_adv = (adv * mask).sum(-1) / mask.sum(-1)
    seq, _ = _run(gspo_loss, logps, old, mean_adv, mask, eps_low=eps_low, eps_high=eps_high)
    assert (seq.per_sequence_loss - out.per_sequence_loss).abs().max() > 1e-6
    assert out.low_clipped.any() and out.high_clipped.any()


def test_gspo_token_gradient_follows_token_advantages():
    logps = _t([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.3, -0.7, -1.1, -2.2, -0.9]])
    mask = _t([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).long()
    # Row 0 inside the band; row 1 above the band (s > 1 + eps_high).
    old = _make_old(logps, mask, [1e-4, 2e-3])
    adv = _t([[1.0, 0.0, -2.0, 0.5, 3.0], [1.0, -1.0, 0.0, 2.0, 9.0]])
    out, grad, losses, grads = _check_against_ref(gspo_token_loss, _ref_gspo_token, logps, old, adv, mask)
    s = out.ratio
    # Row 0 (inside band): grad_t = -A_t s / 5, zero exactly where A_t == 0.
    _close(grad[0], -adv[0] * s[0] / 5)
    assert grad[0, 1] == 0 and torch.all(grad[0, [0, 2, 3, 4]] != 0)
    # Row 1 (above band): positive-advantage tokens are clipped (zero grad), negative ones are not,
    # zero-advantage token and padding have zero grad.
    assert grad[1, 0] == 0 and grad[1, 3] == 0 and grad[1, 2] == 0 and grad[1, 4] == 0
    _close(grad[1, 1], -(-1.0) * s[1] / 4)
    assert grad[1, 1] != 0
    assert out.high_clipped[1].tolist() == [True, False, False, True, False]
    assert not out.low_clipped.any()
    # Gradients differ per token, unlike GSPO with a single advantage where all tokens share one value.
    assert len(set(grad[0].tolist())) == 5


# --------------------------------------------------------------------------------------------------------------
# Clip statistics
# --------------------------------------------------------------------------------------------------------------


def test_clip_statistics_masks():
    T = 4
    eps_low, eps_high = 0.1, 0.2
    logps = -torch.ones(6, T, dtype=torch.float64)
    mask = _lengths_mask([4, 3, 2, 4, 1, 4], T)
    log_s = [math.log(0.8), math.log(0.8), math.log(1.3), math.log(1.3), math.log(1.05), math.log(0.8)]
    old = _make_old(logps, mask, log_s)
    adv = _t([-1.0, 1.0, 1.0, -1.0, 1.0, 0.0])
    for fn in (gspo_loss, gspo_token_loss):
        out = fn(logps, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
        valid = mask.bool()
        exp_low = torch.zeros(6, T, dtype=torch.bool)
        exp_high = torch.zeros(6, T, dtype=torch.bool)
        exp_low[0] = valid[0]  # s < 0.9, A < 0
        exp_high[2] = valid[2]  # s > 1.2, A > 0
        assert torch.equal(out.low_clipped, exp_low), fn.__name__
        assert torch.equal(out.high_clipped, exp_high), fn.__name__
        assert out.high_clipped[2].sum() == 2  # restricted to valid tokens
    # per-token advantages: flags follow the token's advantage sign
    adv_t = _t([[-1.0, 1.0, -2.0, 0.0]] * 6)
    out = gspo_token_loss(logps, old, adv_t, mask, eps_low=eps_low, eps_high=eps_high)
    _, _, _, lows, highs = _ref_gspo_token(logps, old, adv_t, mask, eps_low=eps_low, eps_high=eps_high)
    assert out.low_clipped.tolist() == lows
    assert out.high_clipped.tolist() == highs
    assert out.low_clipped[0].tolist() == [True, False, True, False]
    assert out.high_clipped[2].tolist() == [False, True, False, False]


# --------------------------------------------------------------------------------------------------------------
# bf16 inputs
# --------------------------------------------------------------------------------------------------------------


def test_bf16_logps_ratio_arithmetic_in_float32():
    torch.manual_seed(9)
    B, T = 3, 16
    logps = (-torch.rand(B, T) * 3 - 1.0).to(torch.bfloat16)
    target = 1e-4
    old = logps.float() - target  # float32 old logps, 1e-4 below the bf16 policy logps
    # bf16 cannot represent this difference at these magnitudes: cast to bf16, old == logps.
    assert torch.equal(old.to(torch.bfloat16), logps)
    assert torch.tensor(math.exp(target), dtype=torch.bfloat16) == 1.0
    mask = torch.ones(B, T, dtype=torch.long)
    adv = torch.tensor([1.0, -1.0, 0.5])
    for fn in (gspo_loss, gspo_token_loss):
        leaf = logps.clone().requires_grad_(True)
        out = fn(leaf, old, adv, mask)
        assert out.log_ratio.dtype == torch.float32
        assert out.per_sequence_loss.dtype == torch.float32
        torch.testing.assert_close(out.log_ratio, torch.full((B,), target), rtol=0, atol=1e-6)
        # s = exp(1e-4) is inside the band: loss is -s*A, distinguishable from -A.
        expected = -math.exp(target) * adv
        torch.testing.assert_close(out.per_sequence_loss, expected, rtol=0, atol=1e-6)
        assert (out.per_sequence_loss - (-adv)).abs().min() > 4e-5
        out.per_sequence_loss.sum().backward()
        assert leaf.grad.dtype == torch.bfloat16
        torch.testing.assert_close(
            leaf.grad.float(), (-adv * math.exp(target) / T)[:, None].expand(B, T), rtol=1e-2, atol=0
        )


def test_bf16_both_inputs_match_float64_reference_and_clip_band():
    """With both sides bf16, the exact token differences are averaged in float32 and land inside/outside
    the 3e-4/4e-4 band correctly (bf16 spacing near 1.0 is 7.8e-3, so bf16 arithmetic could not)."""
    T = 64
    base = torch.full((2, T), -2.0)
    logps = base.to(torch.bfloat16)
    step = 2.0**-6  # bf16 spacing in [2, 4)
    old = base.clone()
    old[0, :1] -= step  # mean diff = step/64 = 2.44e-4 -> inside band
    old[1, :2] -= step  # mean diff = 4.88e-4 -> above 1 + 4e-4
    old = old.to(torch.bfloat16)
    assert torch.all(old.float() - logps.float() <= 0)
    mask = torch.ones(2, T, dtype=torch.long)
    adv = torch.tensor([1.0, 1.0])
    leaf = logps.clone().requires_grad_(True)
    out = gspo_loss(leaf, old, adv, mask)
    assert out.log_ratio.dtype == torch.float32
    losses, grads, log_ratios, lows, highs = _ref_gspo(logps, old, adv, mask)
    _close(out.log_ratio, log_ratios)
    _close(out.per_sequence_loss, losses)
    assert highs[1][0] and not highs[0][0]
    assert out.high_clipped.tolist() == highs
    out.per_sequence_loss.sum().backward()
    assert torch.all(leaf.grad[1] == 0) and torch.all(leaf.grad[0] != 0)


# --------------------------------------------------------------------------------------------------------------
# k3 KL
# --------------------------------------------------------------------------------------------------------------


def test_k3_kl_values():
    torch.manual_seed(10)
    logps = -torch.rand(4, 6, dtype=torch.float64) * 5
    ref = logps + torch.randn(4, 6, dtype=torch.float64)
    kl = k3_kl(logps, ref)
    assert kl.shape == (4, 6) and kl.dtype == torch.float64
    _close(kl, _ref_k3(logps, ref))
    assert torch.all(kl >= 0)
    assert torch.all(k3_kl(logps, logps) == 0)
    # Direction matters: k3(logp, ref) != k3(ref, logp).
    assert (k3_kl(ref, logps) - kl).abs().max() > 1e-3
    # bf16 inputs are promoted to float32
    kl16 = k3_kl(logps.to(torch.bfloat16), ref.to(torch.bfloat16))
    assert kl16.dtype == torch.float32
    _close(kl16, _ref_k3(logps.to(torch.bfloat16), ref.to(torch.bfloat16)), tol=1e-5)
    # Hand-computed point: delta = 1 -> e - 2.
    _close(k3_kl(_t([[0.0]]), _t([[1.0]])), [[math.e - 2.0]])


# --------------------------------------------------------------------------------------------------------------
# Regressions: NaN in padding, shape errors before finiteness checks, per-sequence clip decisions in float32
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["logps", "advantages"])
def test_gspo_token_nan_padding_does_not_poison_gradient(where):
    logps, old, adv, mask = _valid_inputs()
    adv = adv[:, None].expand(3, 4).clone()
    logps = logps.clone()
    if where == "logps":
        logps[1, 3] = float("nan")  # padded
    else:
        adv[1, 3] = float("nan")  # padded
    out, grad = _run(gspo_token_loss, logps, old, adv, mask)
    assert torch.isfinite(out.per_sequence_loss).all()
    assert torch.isfinite(grad).all()
    assert grad[1, 3] == 0


def test_gspo_token_float32_clip_decision_is_per_sequence():
    logps = torch.tensor([[-3.1, -17.3, -29.7, -11.9]], dtype=torch.float32)
    old = torch.tensor([[-3.10031009, -17.3002892, -29.7003002, -11.9003]], dtype=torch.float32)
    mask = torch.ones(1, 4, dtype=torch.long)
    adv = torch.tensor([1.0])
    seq = gspo_loss(logps, old, adv, mask, eps_low=0.5, eps_high=3e-4)
    tok = gspo_token_loss(logps, old, adv, mask, eps_low=0.5, eps_high=3e-4)
    row = tok.high_clipped[0]
    assert bool(row.all()) or not bool(row.any())
    assert torch.equal(tok.high_clipped, seq.high_clipped)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_per_token_loss_token_mean_has_same_gradient_as_sequence_loss(fn):
    logps, old, mask, _ = _mixed_batch(11)
    adv = _t([1.0, 1.0, -1.0, -0.5, -2.0, 0.8])
    leaf = logps.clone().requires_grad_(True)
    out = fn(leaf, old, adv, mask)
    mask_f = mask.to(torch.float64)
    token_mean = (out.per_token_loss * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)
    (g_tok,) = torch.autograd.grad(token_mean.sum(), leaf, retain_graph=True)
    (g_seq,) = torch.autograd.grad(out.per_sequence_loss.sum(), leaf)
    _close(g_tok, g_seq)
    _, grads, *_ = _ref_gspo(logps, old, adv, mask)
    _close(g_tok, grads)
    assert g_tok.abs().max() > 0


# --------------------------------------------------------------------------------------------------------------
# Two-sided clipping (delta) on the sequence ratio
# --------------------------------------------------------------------------------------------------------------

DELTA = 1.0 + 3 * EPS_HIGH


def _delta_batch(seed):
    """Rows in every regime: inside the band, between the band and delta, above delta, below the band; both signs."""
    lo, hi, cap = math.log(1 - EPS_LOW), math.log(1 + EPS_HIGH), math.log(DELTA)
    cases = [(0.5 * hi, -1.0), ((hi + cap) / 2, -0.8), (cap + 2 * EPS_HIGH, -1.3), (cap + 2 * EPS_HIGH, 0.9),
             (cap + 2 * EPS_HIGH, 0.0), (lo - EPS_LOW, -0.6), ((hi + cap) / 2, 1.2)]
    g = torch.Generator().manual_seed(seed)
    T = 6
    mask = _lengths_mask([6, 4, 5, 6, 3, 2, 6], T)
    logps = -torch.rand(len(cases), T, dtype=torch.float64, generator=g) * 3
    old = _make_old(logps, mask, [c[0] for c in cases], generator=g)
    return logps, old, _t([c[1] for c in cases]), mask


@pytest.mark.parametrize("fn,ref", [(gspo_loss, _ref_gspo), (gspo_token_loss, _ref_gspo_token)])
def test_delta_matches_float64_reference(fn, ref):
    logps, old, adv, mask = _delta_batch(12)
    out, grad, losses, grads = _check_against_ref(fn, ref, logps, old, adv, mask, delta=DELTA)
    # Only row 2 (A < 0, s > delta) is capped: constant term -delta A, zero gradient.
    assert out.delta_clipped.tolist() == [[bool(mask[i, t]) and i == 2 for t in range(6)] for i in range(7)]
    _close(out.per_sequence_loss[2], -DELTA * adv[2])
    assert torch.all(grad[2] == 0)
    # Without delta, that row has a gradient and a larger loss (the unbounded s A); nothing else changes.
    plain, plain_grad = _run(fn, logps, old, adv, mask)
    assert torch.all(plain_grad[2][mask[2].bool()] != 0)
    assert plain.per_sequence_loss[2] > out.per_sequence_loss[2]
    others = [i for i in range(7) if i != 2]
    _close(out.per_sequence_loss[others], plain.per_sequence_loss[others])
    _close(grad[others], plain_grad[others])
    assert not plain.delta_clipped.any()
    # Row 1 (A < 0, between the band and delta) is not capped: its full unclipped gradient flows.
    assert torch.all(grad[1][mask[1].bool()] != 0)


def test_delta_reference_gradient_matches_finite_differences():
    logps, old, adv, mask = _delta_batch(13)
    adv_tok = torch.randn(logps.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, grads_seq, *_ = _ref_gspo(logps, old, adv, mask, delta=DELTA)
    _, grads_tok, *_ = _ref_gspo_token(logps, old, adv_tok, mask, delta=DELTA)
    h = 1e-8
    for i in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            plus, minus = logps.clone(), logps.clone()
            plus[i, t] += h
            minus[i, t] -= h
            fd = (sum(_ref_gspo(plus, old, adv, mask, delta=DELTA)[0])
                  - sum(_ref_gspo(minus, old, adv, mask, delta=DELTA)[0])) / (2 * h)
            assert abs(fd - grads_seq[i][t]) < 1e-6
            fd_tok = (_token_surrogate_sum(plus, logps, old, adv_tok, mask, delta=DELTA)
                      - _token_surrogate_sum(minus, logps, old, adv_tok, mask, delta=DELTA)) / (2 * h)
            assert abs(fd_tok - grads_tok[i][t]) < 1e-6


def test_delta_with_per_token_advantages_caps_only_negative_tokens():
    logps, old, _, mask = _delta_batch(14)
    adv = torch.randn(logps.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, grad, *_ = _check_against_ref(gspo_token_loss, _ref_gspo_token, logps, old, adv, mask, delta=DELTA)
    expected = (adv < 0) & mask.bool()
    expected[[i for i in range(7) if i not in (2, 3, 4)]] = False  # rows 2-4 have s > delta
    assert torch.equal(out.delta_clipped, expected) and expected.any()
    assert torch.all(grad[expected] == 0)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("delta", [1.0, 1.0 + EPS_HIGH, 0.5])
def test_delta_inside_or_below_the_band_raises(fn, delta):
    logps, old, adv, mask = _valid_inputs()
    with pytest.raises(ValueError, match="delta must be > 1 \\+ eps_high"):
        fn(logps, old, adv, mask, delta=delta)


# --------------------------------------------------------------------------------------------------------------
# Entropy bonus coefficient (TRL's static and adaptive control, Skywork-OR1)
# --------------------------------------------------------------------------------------------------------------


def test_applied_entropy_coef():
    assert applied_entropy_coef(0.01, float("inf"), 0.2, adaptive=False) == 0.01  # static: always applied
    assert applied_entropy_coef(0.01, float("inf"), 0.2, adaptive=True) == 0.0  # no measurement yet
    assert applied_entropy_coef(0.01, 0.2, 0.2, adaptive=True) == 0.01  # at the target: applied
    assert applied_entropy_coef(0.01, 0.3, 0.2, adaptive=True) == 0.0  # above the target: off


def test_adaptive_entropy_coef_moves_by_step_within_bounds():
    kw = dict(target=0.2, step=0.005, coef_min=0.0, coef_max=0.012)
    assert adaptive_entropy_coef(0.01, 0.1, **kw) == pytest.approx(0.012)  # below target: up, capped at max
    assert adaptive_entropy_coef(0.0, 0.2, **kw) == pytest.approx(0.005)  # at target: up
    assert adaptive_entropy_coef(0.01, 0.5, **kw) == pytest.approx(0.005)  # above target: down
    assert adaptive_entropy_coef(0.003, 0.5, **kw) == 0.0  # floored at min


def test_nonfinite_counts_respect_the_mask_and_name_the_input():
    logps, old, adv, mask = _valid_inputs()
    logps, old, adv = logps.clone(), old.clone(), adv.clone()
    padded = (mask == 0).nonzero()[0].tolist()
    logps[padded[0], padded[1]] = float("nan")  # padding: not counted
    old[0, 0] = float("inf")
    adv[1] = float("nan")
    assert nonfinite_counts(logps, old, adv, mask).tolist() == [0, 1, 1]
    token_adv = adv[:, None].expand_as(mask).clone()
    token_adv[padded[0], padded[1]] = float("nan")  # per-token advantages: padding not counted either
    assert nonfinite_counts(logps, old, token_adv, mask).tolist()[2] == int(mask[1].sum())
    with pytest.raises(ValueError, match="`old_logps` contains 1 NaN/Inf"):
        raise_if_nonfinite([0, 1, 1])
    raise_if_nonfinite([0, 0, 0])


def _clipped_token_share(sigma: float, epsilon: float, epsilon_high: float, generator) -> float:
    """One step of a synthetic ratio stream: 256 completions of 1-24 tokens whose sequence log-ratios are
    N(0, sigma), advantages +-1; the share of completion tokens gspo_loss clipped."""
    lengths = torch.randint(1, 25, (256,), generator=generator)
    mask = (torch.arange(24)[None, :] < lengths[:, None]).float()
    shift = torch.randn(256, generator=generator, dtype=torch.float64) * sigma
    old = torch.randn(256, 24, generator=generator, dtype=torch.float64) - 2.0
    logps = old + shift[:, None]  # every token moved by the same amount: log s_i = shift exactly
    advantages = torch.randint(0, 2, (256,), generator=generator).double() * 2 - 1
    out = gspo_loss(logps, old, advantages, mask, epsilon, epsilon_high)
    return float(((out.low_clipped | out.high_clipped).double() * mask).sum() / mask.sum())


@pytest.mark.parametrize("sigma", [1e-4, 1e-1])
def test_adaptive_clip_band_reaches_its_target_at_any_movement(sigma):
    """From the paper's band, the adaptive band settles where it clips its target share of tokens, whether one step
    moves a sequence by 1e-4 (below the paper's band) or by 1e-1 (300x above it): the band scales with the movement.
    """
    generator = torch.Generator().manual_seed(0)
    epsilon, ratio, target, shares = 3e-4, 4 / 3, 0.15, []
    for _ in range(300):
        share = _clipped_token_share(sigma, epsilon, epsilon * ratio, generator)
        shares.append(share)
        epsilon = adaptive_clip_epsilon(epsilon, share, target, epsilon_min=1e-5, epsilon_max=0.2)
    settled = shares[150:]
    assert abs(sum(settled) / len(settled) - target) < 0.1 * target
    # and the band it settled on is of the movement's size (sequence |log s| beyond ~1 sigma clip on one side)
    assert 0.3 * sigma < epsilon < 3 * sigma


def test_adaptive_clip_band_stays_within_its_bounds_when_ratios_blow_up_or_vanish():
    generator = torch.Generator().manual_seed(1)
    epsilon, seen = 3e-4, []
    for sigma in [50.0] * 60 + [0.0] * 120:  # a diverging policy, then one that does not move at all
        share = _clipped_token_share(sigma, epsilon, epsilon * 4 / 3, generator)
        epsilon = adaptive_clip_epsilon(epsilon, share, 0.15, epsilon_min=1e-5, epsilon_max=0.2)
        seen.append(epsilon)
    assert max(seen) == 0.2 and seen[59] == 0.2  # widened to its bound and no further: still a trust region
    assert min(seen) == 1e-5 and seen[-1] == 1e-5
    steps = [b / a for a, b in zip([3e-4] + seen, seen)]
    assert max(steps) <= 2.0 + 1e-12 and min(steps) >= 0.5 - 1e-12  # at most 2x per optimizer step


@pytest.mark.parametrize("gain,max_step", [(0.15, 2.0), (0.05, 1.5), (0.5, 4.0), (2.0, 1.1)])
def test_adaptive_clip_epsilon_against_the_docs_formula(gain, max_step):
    """docs/gspo.md's rule, written out in float64 from its text (a step in log epsilon linear in the share, clamped
    to +-log(max_step), then the band clamped to its bounds), at several gains and step caps."""

    def documented(epsilon, share, target, lowest, highest):
        step = gain * (share - target) / target
        step = max(-math.log(max_step), min(math.log(max_step), step))
        return min(highest, max(lowest, epsilon * math.exp(step)))

    for epsilon in (1e-5, 3e-4, 1e-2, 0.19):
        for share in (0.0, 0.05, 0.15, 0.3, 0.9, 1.0):
            for target in (0.05, 0.15, 0.4):
                got = adaptive_clip_epsilon(epsilon, share, target, 1e-5, 0.2, gain=gain, max_step=max_step)
                assert got == pytest.approx(documented(epsilon, share, target, 1e-5, 0.2), rel=1e-12, abs=0)
    assert adaptive_clip_epsilon(3e-4, 0.15, 0.15, 1e-5, 0.2, gain=gain, max_step=max_step) == 3e-4  # on target


def test_adaptive_clip_band_settles_on_its_target_with_a_noisy_share():
    """32 completions a step give a per-step share whose standard deviation is near its mean (0.14-0.20 measured in
    the staleness benchmark). A step in log epsilon linear in the share settles with its mean share on the target
    (within 10%); the rule it replaced, a step of log((c + 0.01) / (target + 0.01)), settles 15% above it here (0.172)."""
    generator = torch.Generator().manual_seed(3)
    epsilon, shares = 3e-4, []
    for _ in range(1500):
        advantages = torch.randint(0, 2, (32,), generator=generator).double() * 2 - 1
        spread = torch.randn(32, generator=generator, dtype=torch.float64)
        log_s = 5e-3 * advantages * torch.randn(32, generator=generator, dtype=torch.float64).abs() + 1e-2 * spread
        high = (advantages > 0) & (log_s > math.log1p(epsilon * 4 / 3))
        low = (advantages < 0) & (log_s < math.log1p(-epsilon))
        share = float((high | low).double().mean())
        shares.append(share)
        epsilon = adaptive_clip_epsilon(epsilon, share, 0.15, 1e-5, 0.2)
    settled = torch.tensor(shares[300:], dtype=torch.float64)
    assert float(settled.std()) > 0.05  # a noisy share
    assert abs(float(settled.mean()) / 0.15 - 1) < 0.1
