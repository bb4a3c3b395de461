"""Multi-turn rollouts: stitch the routes of a rollout's sampler calls into one route per token ("first computation").

A tool-calling rollout is sampled in turns. Call 1 generates `c1` from the prompt; after a tool runs, call 2 is given
`prompt | c1 | s1` (`s1` the tool result's tokens) and generates `c2`; and so on, only for the samples that called a
tool, in ascending sample order (TRL's `_tool_call_loop`). The trained sequence is `prompt | c1 | s1 | c2 | ... | cK`.
Every call returns routes for its own `prompt | completion` minus the last token (`SampledRoutes`), so most tokens
have several candidate routes. The one replayed is the route of the forward pass that first computed the token:

    prompt tokens                         call 1's prefill
    c_k's tokens but the last             call k's decode steps (the route each token was sampled under)
    c_k's last token, s_k's tokens        call k+1's prefill (they are first fed forward there)
    the sequence's final token            none (never fed forward; `no_route`)

This keeps the single-turn convention (sampled tokens keep their decode routes). Taking every route from the last
call instead would overwrite earlier turns' decode routes with later prefill routes: the experts a token was
*sampled* under are the ones its log-prob came from.

Calls are matched to samples by order and tokens, never by content alone (identical samples are common): the outputs
of call k belong, in order, to samples extended by call k-1 whose final tokens start with the call's prompt and are
longer than what the sample held. Anything that does not line up is refused (`RoutingReplayError`), never guessed: an
output no sample matches, tokens that differ, a route count that is not `len(sequence) - 1`. The final sequence may
be shorter than the last call's (TRL trims the last turn to `max_completion_length`): routes are cut by prefix.

    calls = [SamplerCall(prompt_ids, completion_ids, routes_of_call_1), SamplerCall(...), ...]
    stitched = stitch_turns(calls, final_prompt_ids, final_completion_ids)   # a SampledRoutes, one entry per sample

The rule itself, position by position, is `first_computation_spans`; the asynchronous trainer applies it to a vLLM
server's turns (`trl_gspo.async_trainer.routing.stitch_turn_routes`), this module to HF generate's and vLLM's calls.
Knows nothing of TRL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .replay import RoutingReplayError
from .rollout import SampledRoutes, no_route

__all__ = ["SamplerCall", "first_computation_spans", "stitch_turns"]


def first_computation_spans(sequence: Sequence[int], turns: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """Where each position of `sequence` takes its route from: `(turn, start, stop)` spans, in order, covering
    positions `[0, stop of the last span)` of the `len(sequence) - 1` that have a route (the last token is never fed
    forward). `turns[k]` is the tokens turn k computed (its prompt and output); it routes positions `0 ..
    len(turns[k]) - 2`, each from the tokens up to it. Position p takes the route of the first turn whose tokens up to
    p are the sequence's: for a prompt, the prefill that first computed it; for a sampled token, the decode step it
    was sampled in; for a tool result, the next turn's prefill. Fewer positions covered than needed: some position
    has no turn that computed it."""
    need = len(sequence) - 1
    spans, filled = [], 0
    for k, tokens in enumerate(turns):
        common = 0
        for a, b in zip(tokens, sequence):
            if a != b:
                break
            common += 1
        reach = min(common, len(tokens) - 1, need)  # routes of positions < common depend on the sequence's tokens only
        if reach > filled:
            spans.append((k, filled, reach))
            filled = reach
    return spans


@dataclass
class SamplerCall:
    """One generate call of a rollout round: per output, its prompt and completion tokens and their routes
    (`routes.prompt_routes[j]` `[len(prompt_ids[j]), L, K]`, `routes.completion_routes[j]` `[len(completion_ids[j]),
    L, K]`, whose last row is `no_route`)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    routes: SampledRoutes


def _refuse(what: str) -> RoutingReplayError:
    return RoutingReplayError(
        f"routing_replay='sampler' across turns: {what} The routes would be replayed on other tokens. Fix: report "
        "this with your TRL version and the generation backend; set routing_replay='old' meanwhile.")


def _call_rows(call: SamplerCall, j: int) -> torch.Tensor:
    """Routes of output j over `prompt | completion` minus the last token, after checking their counts."""
    prompt, completion = call.prompt_ids[j], call.completion_ids[j]
    prompt_routes, completion_routes = call.routes.prompt_routes[j], call.routes.completion_routes[j]
    if len(prompt_routes) != len(prompt) or len(completion_routes) != len(completion):
        raise _refuse(f"a call returned {len(prompt_routes)} prompt and {len(completion_routes)} completion route rows "
                      f"for a {len(prompt)}-token prompt and {len(completion)}-token completion.")
    return torch.cat([prompt_routes, completion_routes])[:len(prompt) + len(completion) - 1]


def stitch_turns(calls: Sequence[SamplerCall], prompt_ids: Sequence[Sequence[int]],
                 completion_ids: Sequence[Sequence[int]]) -> SampledRoutes:
    """Per sample, the routes of `prompt_ids[i] | completion_ids[i]` (the final, trained tokens), stitched from the
    round's sampler `calls` in call order by first computation (module docstring). Returns unpadded
    `SampledRoutes` (no sampler log-probs), ready for `pad_routes_like`."""
    if not calls:
        raise _refuse("the round recorded no sampler call.")
    batch = len(prompt_ids)
    finals = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    first = calls[0]
    if len(first.prompt_ids) != batch or len(first.completion_ids) != batch:
        raise _refuse(f"the first call generated {len(first.prompt_ids)} completions for {batch} samples.")
    turns = []  # per sample, every call's (tokens, route rows); the last call's tokens are what the sample holds
    for i in range(batch):
        if list(first.prompt_ids[i]) != list(prompt_ids[i]):
            raise _refuse(f"sample {i}'s prompt differs from the first call's prompt {i}.")
        turns.append([(list(first.prompt_ids[i]) + list(first.completion_ids[i]), _call_rows(first, i))])
    extended = list(range(batch))  # the samples the previous call extended, ascending
    for number, call in enumerate(calls[1:], start=2):
        taken, cursor = [], 0
        for j, prompt in enumerate(call.prompt_ids):
            prompt = list(prompt)
            while cursor < len(extended):
                i = extended[cursor]
                cursor += 1
                held = turns[i][-1][0]
                if len(prompt) > len(held) and finals[i][:len(prompt)] == prompt and prompt[:len(held)] == held:
                    break
            else:
                raise _refuse(f"output {j} of call {number} continues none of the samples call {number - 1} "
                              "extended (matched by order and tokens).")
            turns[i].append((prompt + list(call.completion_ids[j]), _call_rows(call, j)))
            taken.append(i)
        extended = taken
    prompt_routes, completion_routes = [], []
    for i in range(batch):
        final, sampled = finals[i], turns[i][-1][0]
        if sampled[:len(final)] != final:
            raise _refuse(f"sample {i}'s trained tokens differ from the tokens its sampler calls produced "
                          f"({len(final)} trained, {len(sampled)} sampled).")
        # every call's tokens extend the previous call's and the final tokens are a prefix of the last: covered
        spans = first_computation_spans(final, [turn_tokens for turn_tokens, _ in turns[i]])
        rows = torch.cat([turns[i][k][1][start:stop] for k, start, stop in spans] or [turns[i][0][1][:0]])
        width, length = len(prompt_ids[i]), len(completion_ids[i])
        sentinel = torch.full((1, *rows.shape[1:]), no_route(rows.dtype), dtype=rows.dtype)
        prompt_routes.append(rows[:width].clone())  # the final token (last row) is never fed forward: no route
        completion_routes.append(torch.cat([rows[width:width + length - 1], sentinel])[:length])
    return SampledRoutes(prompt_routes, completion_routes, sampler_logps=[])
