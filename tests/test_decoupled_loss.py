"""The decoupled GSPO objective for stale samples (`trl_gspo.losses.decoupled_gspo_loss`, derived in docs/gspo.md)
against a float64 reference written from its equations, one completion at a time in plain Python:

    w_i = exp(mean_t [log pi_prox - log mu])          truncated: min(w_i, C); masked: 0 outside [1/C, C]
    r_i = exp(mean_t [log pi_theta - log pi_prox])    (GSPO-token: r_i,t = sg[r_i] pi_theta / sg[pi_theta])
    J   = (1/N) sum_i w~_i min(r_i A_i, clip(r_i, 1 - eps_low, 1 + eps_high) A_i)

Values and gradients (autograd through the reference), truncation and masking binding on some completions, the
band binding on others; what it reduces to when the proximal policy is the current one (each sample trained once);
and the packed form TRL's asynchronous trainer uses."""

import math

import pytest
import torch

from trl_gspo.losses import behaviour_weights, decoupled_gspo_loss, gspo_loss, gspo_packed_loss

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def reference(logps, proximal, behaviour, advantages, mask, cap, mode, token_level, eps_low=EPS_LOW,
              eps_high=EPS_HIGH):
    terms = []
    for i in range(logps.shape[0]):
        keep = mask[i].bool()
        if not keep.any():
            terms.append(0.0 * logps[i].sum())
            continue
        lp, prox, mu = logps[i][keep], proximal[i][keep], behaviour[i][keep]
        weight = math.exp(float((prox - mu).mean()))  # a constant of the objective
        if mode == "truncate":
            weight = min(weight, cap)
        elif not 1 / cap <= weight <= cap:
            weight = 0.0
        log_r = (lp - prox).mean()
        if token_level:
            a = advantages[i][keep] if advantages.dim() == 2 else advantages[i].expand(len(lp))
            ratio = torch.exp(log_r).detach() * torch.exp(lp - lp.detach())
            term = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a).mean()
        else:
            ratio = torch.exp(log_r)
            a = advantages[i]
            term = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
        terms.append(weight * term)
    return -torch.stack(terms).mean()


def _inputs(seed, batch=6, length=7, per_token_advantages=False):
    """Current, proximal and behaviour log-probs: the proximal within a few 1e-4 of the current (so the band binds on
    some completions and not others), the behaviour several versions away (per-token log gaps ~0.1, so a cap of 1.1
    truncates or masks some completions, not all); ragged lengths and one empty completion."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    proximal = logps + torch.randn(batch, 1, generator=g, dtype=torch.float64) * 1e-3
    behaviour = proximal - torch.randn(batch, 1, generator=g, dtype=torch.float64) * 0.12 \
        + torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.01
    lengths = torch.tensor([length, 1, 4, 0, 6, 3][:batch])
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    shape = (batch, length) if per_token_advantages else (batch,)
    advantages = torch.randn(*shape, generator=g, dtype=torch.float64)
    return logps.requires_grad_(), proximal, behaviour, advantages, mask


@pytest.mark.parametrize("seed", [1, 2, 4])
@pytest.mark.parametrize("mode,cap", [("truncate", 1.1), ("truncate", 2.0), ("mask", 1.1)])
@pytest.mark.parametrize("token_level,per_token", [(False, False), (True, False), (True, True)])
def test_value_and_gradient_match_the_float64_reference(seed, mode, cap, token_level, per_token):
    logps, proximal, behaviour, advantages, mask = _inputs(seed, per_token_advantages=per_token)
    out = decoupled_gspo_loss(logps, proximal, behaviour, advantages, mask, token_level=token_level, weight_cap=cap,
                              weight_mode=mode)
    loss = out.per_sequence_loss.mean()
    (grad,) = torch.autograd.grad(loss, logps)
    expected = reference(logps, proximal, behaviour, advantages, mask, cap, mode, token_level)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    # The inputs exercise what they claim to: the band binds on some completions, the cap on some (at 1.1).
    valid = mask.bool().any(-1)
    clipped = (out.low_clipped | out.high_clipped).any(-1)
    assert 0 < int(clipped.sum()) < int(valid.sum())
    if cap == 1.1:
        assert 0 < int(out.weight_capped.sum()) < int(valid.sum())
    log_w = [math.log(math.exp(float((proximal[i] - behaviour[i])[mask[i].bool()].mean()))) if valid[i] else 0.0
             for i in range(len(valid))]
    torch.testing.assert_close(out.behaviour_log_weight, torch.tensor(log_w, dtype=torch.float64))


def test_masked_completions_give_no_value_and_no_gradient():
    logps, proximal, behaviour, advantages, mask = _inputs(3)
    out = decoupled_gspo_loss(logps, proximal, behaviour, advantages, mask, weight_cap=1.1, weight_mode="mask")
    (grad,) = torch.autograd.grad(out.per_sequence_loss.sum(), logps)
    dropped = out.weight_capped
    assert dropped.any()
    assert (out.per_sequence_loss[dropped] == 0).all() and (grad[dropped] == 0).all()
    assert (out.behaviour_weight[dropped] == 0).all()


@pytest.mark.parametrize("token_level", [False, True])
def test_one_update_per_sample_reduces_to_a_weighted_policy_gradient(token_level):
    """pi_prox = sg[pi_theta] (TRL's asynchronous trainer: every sample trains once, with the step's weights): r_i = 1,
    no clip binds, J = (1/N) sum_i w~_i A_i, and grad J = (1/N) sum_i w~_i A_i grad (1/|y_i|) sum_t log pi_theta."""
    logps, _, behaviour, advantages, mask = _inputs(4)
    out = decoupled_gspo_loss(logps, logps.detach(), behaviour, advantages, mask, token_level=token_level,
                              weight_cap=1.1)
    loss = out.per_sequence_loss.mean()
    (grad,) = torch.autograd.grad(loss, logps)
    assert not (out.low_clipped | out.high_clipped).any()
    valid = mask.bool().any(-1)
    weights = []
    for i in range(len(valid)):
        keep = mask[i].bool()
        weights.append(min(math.exp(float((logps[i].detach() - behaviour[i])[keep].mean())), 1.1) if valid[i] else 0.0)
    weights = torch.tensor(weights, dtype=torch.float64)
    torch.testing.assert_close(loss, -(weights * advantages).mean())
    lengths = mask.sum(-1).clamp(min=1)
    expected = -(weights * advantages / lengths)[:, None] * mask / len(valid)
    torch.testing.assert_close(grad, expected)


def test_untruncated_and_unclipped_it_is_gspo_against_the_behaviour_policy():
    """w_i r_i = s_i: with a cap no weight reaches and a band no ratio leaves, the decoupled objective equals Eq. 5
    with pi_old = mu, value and gradient."""
    logps, proximal, behaviour, advantages, mask = _inputs(5)
    wide = dict(eps_low=0.99, eps_high=100.0)
    out = decoupled_gspo_loss(logps, proximal, behaviour, advantages, mask, weight_cap=1e6, **wide)
    plain = gspo_loss(logps, behaviour, advantages, mask, **wide)
    grads = [torch.autograd.grad(o.per_sequence_loss.mean(), logps)[0] for o in (out, plain)]
    torch.testing.assert_close(out.per_sequence_loss, plain.per_sequence_loss)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("token_level", [False, True])
def test_packed_rows_equal_the_padded_form(token_level):
    logps, proximal, behaviour, advantages, mask = _inputs(6)
    keep = mask.bool()
    segment_id = torch.arange(mask.shape[0])[:, None].expand_as(mask)[keep]
    per_token_adv = advantages[:, None].expand_as(mask)[keep]
    packed = gspo_packed_loss(logps[keep], behaviour[keep], per_token_adv, segment_id, token_level=token_level,
                              num_segments=mask.shape[0], proximal_logps=proximal[keep], weight_cap=1.1,
                              weight_mode="truncate")
    padded = decoupled_gspo_loss(logps, proximal, behaviour, advantages, mask, token_level=token_level,
                                 weight_cap=1.1)
    grads = [torch.autograd.grad(o.per_sequence_loss.sum(), logps)[0] for o in (packed, padded)]
    torch.testing.assert_close(packed.per_sequence_loss, padded.per_sequence_loss)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(packed.behaviour_weight, padded.behaviour_weight)


def test_bad_cap_mode_and_non_finite_behaviour_are_refused():
    logps, proximal, behaviour, advantages, mask = _inputs(7)
    with pytest.raises(ValueError, match="cap must be > 1"):
        behaviour_weights(proximal, behaviour, mask, cap=1.0)
    with pytest.raises(ValueError, match="weight mode"):
        behaviour_weights(proximal, behaviour, mask, cap=2.0, mode="clip")
    behaviour = behaviour.clone()
    behaviour[0, 0] = float("nan")
    with pytest.raises(ValueError, match="`old_logps` contains 1 NaN"):
        decoupled_gspo_loss(logps, proximal, behaviour, advantages, mask)
