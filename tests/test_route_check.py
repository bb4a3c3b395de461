"""`check_sampled_routes` (trl_gspo/routing/rollout.py), chunked and column-wise for speed, against a plain Python
reference written from its contract: per (token, layer) row of k slots, a row of all `no_route` is skipped; any other
row with an index outside 0..E-1 (no_route included) is refused; otherwise a row naming one expert twice counts as
repeated, and any repeated row is refused with the count and the number of real rows."""

import pytest
import torch

from trl_gspo.routing import rollout
from trl_gspo.routing.rollout import RoutingReplayError, SampledRoutes, check_sampled_routes, no_route


def reference(tensors, num_experts):
    """(outside: bool, repeated rows, real rows), row by row in Python."""
    outside, repeated, real = False, 0, 0
    seen = set()
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        sentinel = no_route(tensor.dtype)
        for row in tensor.reshape(-1, tensor.shape[-1]).tolist():
            if all(value == sentinel for value in row):
                continue
            real += 1
            if any(value < 0 or value >= num_experts for value in row):
                outside = True
            elif len(set(row)) < len(row):
                repeated += 1
    return outside, repeated, real


def _routes(generator, rows, layers, k, experts, dtype):
    """Valid top-k routes: k distinct experts per row (a random permutation's first k)."""
    keys = torch.rand(rows * layers, experts, generator=generator)
    return keys.argsort(-1)[:, :k].reshape(rows, layers, k).to(dtype)


@pytest.mark.parametrize("dtype, experts, k", [(torch.uint8, 128, 8), (torch.uint8, 4, 2), (torch.int16, 300, 4),
                                               (torch.int32, 16, 1), (torch.uint8, 40, 8)])
@pytest.mark.parametrize("fault", ["none", "twice", "outside", "mixed_unrouted", "negative"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_check_agrees_with_the_reference(dtype, experts, k, fault, threads, monkeypatch):
    monkeypatch.setattr(rollout, "_CHECK_ROWS", 64)  # many chunks, and tensors that straddle them
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the chunks split over this many threads
    generator = torch.Generator().manual_seed(hash((str(dtype), experts, k, fault)) % 2**31)
    prompt = _routes(generator, 7, 3, k, experts, dtype)
    completions = [_routes(generator, rows, 3, k, experts, dtype) for rows in (5, 40, 1, 23)]
    for routes in completions:
        routes[-1] = no_route(dtype)  # the token never fed forward
    sampled = SampledRoutes([prompt, prompt, prompt, _routes(generator, 2, 3, k, experts, dtype)], completions, [])
    target = completions[1]
    if fault == "twice" and k > 1:
        target[10, 1, k - 1] = target[10, 1, 0]
        target[33, 2, 1] = target[33, 2, 0]
        prompt[6, 0, k - 1] = prompt[6, 0, k - 2]  # a shared prompt tensor: counted once
    elif fault == "outside":
        target[17, 0, k // 2] = experts if experts < torch.iinfo(dtype).max else experts - 1
    elif fault == "mixed_unrouted" and k > 1:
        target[20, 2, 0] = no_route(dtype)  # one slot of a real row
    elif fault == "negative" and dtype.is_signed:
        target[3, 1, 0] = -1
    outside, repeated, real = reference(sampled.prompt_routes + sampled.completion_routes, experts)
    if outside:
        with pytest.raises(RoutingReplayError, match=f"outside 0..{experts - 1}"):
            check_sampled_routes(sampled, experts, k, "the test")
    elif repeated:
        with pytest.raises(RoutingReplayError, match=f"twice within one token's top-{k} in {repeated} of {real} "):
            check_sampled_routes(sampled, experts, k, "the test")
    else:
        check_sampled_routes(sampled, experts, k, "the test")
    assert fault == "none" or outside or repeated or k == 1 or (fault == "negative" and not dtype.is_signed)


def test_all_zero_routes_are_refused_and_unrouted_rows_are_not():
    zeros = torch.zeros(6, 2, 4, dtype=torch.uint8)
    zeros[-1] = no_route(torch.uint8)
    with pytest.raises(RoutingReplayError, match=r"in 10 of 10 \(token, layer\) slots, e\.g\. \[0, 0, 0, 0\]"):
        check_sampled_routes(SampledRoutes([], [zeros], []), 8, 4, "the test")
    only_unrouted = torch.full((3, 2, 4), no_route(torch.uint8), dtype=torch.uint8)
    check_sampled_routes(SampledRoutes([only_unrouted], [], []), 8, 4, "the test")
    with pytest.raises(RoutingReplayError, match="hold 4 experts per token and layer; the model routes each token to 2"):
        check_sampled_routes(SampledRoutes([only_unrouted], [], []), 8, 2, "the test")
