"""GSPO and GSPO-token on packed rows (`trl_gspo.losses.gspo_packed_loss`), as TRL's asynchronous trainer lays out a
batch: per packed target a log-prob, the sampler's log-prob, an advantage and `segment_id`, the completion it belongs
to, completions interleaved. Checked against a float64 reference written from the paper (Eq. 5, 7, 13, 14), value
and gradient, one completion at a time in plain Python."""

import pytest
import torch

from trl_gspo.losses import LOSS_REDUCTIONS, gspo_packed_loss, packed_policy_loss, unpack_segments

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def clipped_term(ratio, advantage):
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), the paper's clipped objective term."""
    clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    return torch.minimum(ratio * advantage, clipped * advantage)


def reference_gspo(logps, old_logps, advantages, segment_id):
    """-J: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean over i's targets of log ratio) (Eq. 5, 7)."""
    terms = []
    for i in sorted(set(segment_id.tolist())):
        mine = [t for t in range(len(segment_id)) if segment_id[t] == i]
        log_ratio = sum(logps[t] - old_logps[t] for t in mine) / len(mine)
        terms.append(clipped_term(torch.exp(log_ratio), advantages[mine[0]]))
    return -sum(terms) / len(terms)


def reference_gspo_token(logps, old_logps, advantages, segment_id):
    """-J: J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it), s_it = sg[s_i] pi_t / sg[pi_t] (13, 14)."""
    terms = []
    for i in sorted(set(segment_id.tolist())):
        mine = [t for t in range(len(segment_id)) if segment_id[t] == i]
        sequence_ratio = torch.exp(sum(logps[t] - old_logps[t] for t in mine) / len(mine)).detach()
        token_terms = [clipped_term(sequence_ratio * torch.exp(logps[t] - logps[t].detach()), advantages[t])
                       for t in mine]
        terms.append(sum(token_terms) / len(mine))
    return -sum(terms) / len(terms)


def _packed(seed, lengths=(5, 1, 7, 3), spread=2e-4):
    """Completions of `lengths` interleaved in one packed row; old log-probs within +-spread of the new ones per
    token, so some sequence ratios fall inside GSPO's band and some outside (shifted by -1e-3 / +1e-3)."""
    generator = torch.Generator().manual_seed(seed)
    segment_id = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    segment_id = segment_id[torch.randperm(len(segment_id), generator=generator)]
    logps = -torch.rand(len(segment_id), generator=generator, dtype=torch.float64) * 3
    shift = torch.tensor([0.0, -1e-3, 1e-3, 0.0], dtype=torch.float64)[segment_id]
    old_logps = logps - shift + (torch.rand(len(segment_id), generator=generator, dtype=torch.float64) - 0.5) * spread
    sequence_advantage = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
    return logps, old_logps, sequence_advantage[segment_id], segment_id


def _value_and_grad(objective_of, logps):
    """(objective, d objective / d logps) of `objective_of(logps)` at a fresh leaf copy of `logps`."""
    leaf = logps.clone().requires_grad_()
    objective = objective_of(leaf)
    objective.backward()
    return objective.detach(), leaf.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_on_packed_rows_matches_the_float64_reference(seed):
    logps, old_logps, advantages, segment_id = _packed(seed)
    losses = []

    def packed(leaf):
        losses.append(gspo_packed_loss(leaf, old_logps, advantages, segment_id, eps_low=EPS_LOW, eps_high=EPS_HIGH))
        return losses[-1].per_sequence_loss.mean()

    objective, grad = _value_and_grad(packed, logps)
    expected, expected_grad = _value_and_grad(lambda leaf: reference_gspo(leaf, old_logps, advantages, segment_id),
                                              logps)
    assert torch.allclose(objective, expected, rtol=0, atol=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12)
    ratios = losses[0].ratio
    assert ((ratios < 1 - EPS_LOW) | (ratios > 1 + EPS_HIGH)).any() and (ratios.sub(1).abs() < EPS_LOW).any()
    assert (grad != 0).any() and (grad == 0).any()  # clipped completions get no gradient


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_token_on_packed_rows_matches_the_reference_with_per_token_advantages(seed):
    logps, old_logps, advantages, segment_id = _packed(seed)
    advantages = advantages * (1 + torch.linspace(-0.5, 0.5, len(advantages), dtype=torch.float64))
    objective, grad = _value_and_grad(lambda leaf: gspo_packed_loss(
        leaf, old_logps, advantages, segment_id, token_level=True, eps_low=EPS_LOW, eps_high=EPS_HIGH
    ).per_sequence_loss.mean(), logps)
    expected, expected_grad = _value_and_grad(
        lambda leaf: reference_gspo_token(leaf, old_logps, advantages, segment_id), logps)
    assert torch.allclose(objective, expected, rtol=0, atol=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12)


def test_gspo_token_with_sequence_advantages_equals_gspo_on_packed_rows():
    logps, old_logps, advantages, segment_id = _packed(3)
    grads = []
    for token_level in (False, True):
        mine = logps.clone().requires_grad_()
        gspo_packed_loss(mine, old_logps, advantages, segment_id, token_level=token_level).per_sequence_loss.mean() \
            .backward()
        grads.append(mine.grad)
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-12)


def test_unpacking_keeps_each_completions_targets_in_order_and_refuses_what_it_cannot_place():
    segment_id = torch.tensor([1, 0, 1, 2, 0, 1])
    values = torch.tensor([10.0, 20.0, 11.0, 30.0, 21.0, 12.0])
    padded, mask = unpack_segments(segment_id, values, num_segments=4)
    assert padded.tolist() == [[20.0, 21.0, 0.0], [10.0, 11.0, 12.0], [30.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert mask.sum(1).tolist() == [2, 3, 1, 0]  # completion 3 has no target: an empty row
    with pytest.raises(ValueError, match="negative id"):
        unpack_segments(torch.tensor([0, -1]), torch.zeros(2))
    with pytest.raises(ValueError, match="num_segments is 2"):
        unpack_segments(torch.tensor([0, 2]), torch.zeros(2), num_segments=2)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        gspo_packed_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, 2.0]), torch.tensor([0, 0]))


@pytest.mark.parametrize("loss_type", list(LOSS_REDUCTIONS))
def test_a_completion_with_no_target_is_an_empty_row_with_zero_loss_even_when_none_has_one(loss_type):
    """Completion 1 has no trained target (every token masked out): its row is empty and its loss 0, the others' as
    without it; with no target in the whole micro-batch, every row is empty and every loss 0 (not an index error).
    Every loss the asynchronous trainer runs on packed rows (`packed_policy_loss`)."""
    options = {}
    if loss_type == "vespo":
        from trl import GRPOTrainer

        options["gamma_weights"] = GRPOTrainer.get_gamma_weights
    logps, old = torch.tensor([-1.0, -2.0, -1.5], dtype=torch.float64), torch.tensor([-1.1, -2.0, -1.4],
                                                                                        dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, -0.5], dtype=torch.float64)
    with_empty = packed_policy_loss(loss_type, logps, old, advantages, torch.tensor([0, 0, 2]), num_segments=3,
                                    **options).per_sequence_loss
    without = packed_policy_loss(loss_type, logps, old, advantages, torch.tensor([0, 0, 1]), **options)
    assert with_empty[1] == 0 and torch.equal(with_empty[[0, 2]], without.per_sequence_loss)
    nothing = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    empty = packed_policy_loss(loss_type, nothing, nothing.detach(), nothing.detach(),
                               torch.zeros(0, dtype=torch.long), num_segments=2, **options)
    assert empty.per_sequence_loss.tolist() == [0.0, 0.0] and empty.per_token_loss.shape == (2, 0)
