"""Route stitching across the turns of a tool-calling rollout (trl_gspo/routing/stitching.py): each token's route comes
from the forward that first computed it. Routes here encode (call, position), so every expectation below says, by
hand, which call each token's route must come from."""

import random

import pytest
import torch

from trl_gspo.routing import RoutingReplayError
from trl_gspo.routing.rollout import SampledRoutes, no_route
from trl_gspo.routing.stitching import SamplerCall, first_computation_spans, stitch_turns

NONE = no_route(torch.uint8)


def _route(call, position):
    return torch.tensor([[call, position]], dtype=torch.uint8)  # one layer, "top-2": (call number, position)


def _call(number, prompts, completions):
    """A generate call as a sampler returns it: every output's routes over its prompt and completion, the last row
    `no_route`; each route names this call and the token's position in the sequence."""
    prompt_routes, completion_routes = [], []
    for prompt, completion in zip(prompts, completions):
        prompt_routes.append(torch.stack([_route(number, t) for t in range(len(prompt))]))
        rows = [_route(number, len(prompt) + t) for t in range(len(completion) - 1)]
        completion_routes.append(torch.stack(rows + [torch.full((1, 2), NONE, dtype=torch.uint8)]))
    return SamplerCall([list(p) for p in prompts], [list(c) for c in completions],
                       SampledRoutes(prompt_routes, completion_routes, []))


def _calls_of(stitched, i):
    """(call number, position) of each route of sample i over prompt | completion; None for `no_route`."""
    rows = torch.cat([stitched.prompt_routes[i], stitched.completion_routes[i]])
    return [None if int(r[0, 0]) == NONE else (int(r[0, 0]), int(r[0, 1])) for r in rows]


# Three samples: 0 calls a tool twice, 1 answers at once, 2 calls once (its last turn trimmed by TRL by 2 tokens).
P = [[1, 2], [1, 3, 4], [1, 2]]
C1 = [[10, 11, 12], [20, 21], [30, 31]]
S1 = {0: [90, 91], 2: [92]}
C2 = {0: [13, 14], 2: [32, 33, 34, 35]}
S2 = {0: [93]}
C3 = {0: [15]}


def _rollout():
    call1 = _call(1, P, C1)
    prompts2 = [P[0] + C1[0] + S1[0], P[2] + C1[2] + S1[2]]
    call2 = _call(2, prompts2, [C2[0], C2[2]])
    prompts3 = [prompts2[0] + C2[0] + S2[0]]
    call3 = _call(3, prompts3, [C3[0]])
    completions = [C1[0] + S1[0] + C2[0] + S2[0] + C3[0], C1[1], C1[2] + S1[2] + C2[2][:2]]
    return [call1, call2, call3], completions


def test_each_token_takes_the_route_of_the_forward_that_first_computed_it():
    calls, completions = _rollout()
    stitched = stitch_turns(calls, P, completions)
    # sample 0: prompt + c1 but its last token from call 1; c1's last token and s1 from call 2's prefill; c2 but its
    # last from call 2's decode; c2's last and s2 from call 3's prefill; c3's only token is the final one: no route
    assert _calls_of(stitched, 0) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 4), (2, 5), (2, 6), (2, 7), (3, 8),
                                      (3, 9), None]
    assert _calls_of(stitched, 1) == [(1, 0), (1, 1), (1, 2), (1, 3), None]  # single turn: as before
    # sample 2: trimmed last turn, routes cut by prefix; the final kept token has none
    assert _calls_of(stitched, 2) == [(1, 0), (1, 1), (1, 2), (2, 3), (2, 4), (2, 5), None]
    assert [len(r) for r in stitched.prompt_routes] == [len(p) for p in P]
    assert [len(r) for r in stitched.completion_routes] == [len(c) for c in completions]


def test_identical_samples_take_their_calls_in_order():
    prompt, first = [1, 2], [5, 6]
    calls = [_call(1, [prompt] * 3, [first] * 3),
             _call(2, [prompt + first + [9]] * 2, [[7], [8, 8]])]  # samples 0 and 1 called the tool; 2 did not
    completions = [first + [9, 7], first + [9, 8, 8], first]
    stitched = stitch_turns(calls, [prompt] * 3, completions)
    assert _calls_of(stitched, 0)[3:] == [(2, 3), (2, 4), None]
    assert _calls_of(stitched, 1)[3:] == [(2, 3), (2, 4), (2, 5), None]
    assert _calls_of(stitched, 2) == [(1, 0), (1, 1), (1, 2), None]


def test_a_truncated_sample_whose_tokens_prefix_a_tool_calling_one_is_not_taken_for_it():
    """Sample 0 stopped (truncated) inside what sample 1 went on to generate; only sample 1 called the tool. Its
    final tokens are shorter than the call's prompt, so the call goes to sample 1."""
    calls = [_call(1, [[1], [1]], [[5, 6], [5, 6, 7]]), _call(2, [[1, 5, 6, 7, 9]], [[8]])]
    stitched = stitch_turns(calls, [[1], [1]], [[5, 6], [5, 6, 7, 9, 8]])
    assert _calls_of(stitched, 0) == [(1, 0), (1, 1), None]
    assert _calls_of(stitched, 1) == [(1, 0), (1, 1), (1, 2), (2, 3), (2, 4), None]


def test_stitching_refuses_what_does_not_line_up():
    calls, completions = _rollout()
    with pytest.raises(RoutingReplayError, match="continues none of the samples"):
        stitch_turns(calls, P, [completions[0], completions[1], C1[2]])  # TRL says sample 2 never called a tool
    with pytest.raises(RoutingReplayError, match="trained tokens differ"):
        stitch_turns(calls, P, [completions[0], [20, 99], completions[2]])
    with pytest.raises(RoutingReplayError, match="prompt differs"):
        stitch_turns(calls, [P[0], [1, 3, 5], P[2]], completions)
    with pytest.raises(RoutingReplayError, match="generated 3 completions for 2 samples"):
        stitch_turns(calls, P[:2], completions[:2])
    short = calls[1].routes.prompt_routes[0][:-1]
    broken = SamplerCall(calls[1].prompt_ids, calls[1].completion_ids,
                         SampledRoutes([short, calls[1].routes.prompt_routes[1]], calls[1].routes.completion_routes, []))
    with pytest.raises(RoutingReplayError, match="route rows"):
        stitch_turns([calls[0], broken, calls[2]], P, completions)
    with pytest.raises(RoutingReplayError, match="no sampler call"):
        stitch_turns([], P, completions)


def test_one_call_gives_the_single_turn_layout():
    call = _call(1, P, C1)
    stitched = stitch_turns([call], P, C1)
    for i in range(3):
        assert torch.equal(stitched.prompt_routes[i], call.routes.prompt_routes[i])
        assert torch.equal(stitched.completion_routes[i], call.routes.completion_routes[i])


def test_first_computation_spans_match_a_position_by_position_reference():
    """The rule both trainers stitch with: position p (of the positions that have a route) takes the first turn
    whose tokens up to p are the sequence's and that routes p; checked against that definition, position by position,
    on random turns that extend, diverge from and trim the sequence."""
    rng = random.Random(0)
    for _ in range(300):
        sequence = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        turns = []
        for _ in range(rng.randrange(1, 5)):
            cut = rng.randrange(len(sequence) + 1)
            turns.append(sequence[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 4))])
        expected = []
        for p in range(len(sequence) - 1):
            owner = next((k for k, tokens in enumerate(turns)
                          if p < len(tokens) - 1 and tokens[:p + 1] == sequence[:p + 1]), None)
            if owner is None:
                break
            expected.append(owner)
        spans = first_computation_spans(sequence, turns)
        got = [k for k, start, stop in spans for _ in range(start, stop)]
        assert [start for _, start, _ in spans] == [0, *(stop for _, _, stop in spans)][:len(spans)]  # in order
        assert got == expected, (sequence, turns, spans)
