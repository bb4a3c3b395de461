"""R3 (rollout routing replay) in TRL's asynchronous trainer: the experts each token used where the vLLM server sampled
it, sent from the server through TRL's rollout worker into the packed rows, and forced in the training forward.

The server returns them when started by `trl-gspo vllm-serve` (vLLM's `--enable-return-routed-experts`): each
`/v1/completions` choice then holds `routed_experts`, `[prompt + completion - 1, layers, top_k]`, one row per token
that has a successor. TRL's rollout worker reads tokens and log-probs from that answer and drops the routes; here:

1. `RoutedRolloutLoop` (TRL's rollout loop, in its child process) asks for the routes as raw bytes (the route frame
   of `trl_gspo.sampling.route_wire`; a server that does not frame them, stock vLLM, answers JSON with base64 routes,
   read from the JSON), keeps each turn's routes (`_post`, per conversation through a context variable: every
   conversation is its own asyncio task) and stitches a training sequence's routes from its turns
   (`stitch_turn_routes`: each position takes the route of the first turn whose tokens up to it are the sequence's,
   so a turn's prompt keeps the routes first computed for it, and tool results take the next turn's prefill), then
   queues `RoutedRolloutSample`s.
2. `packed_routes` lays a packed row's routes out in TRL's packed order (a position shared by several samples of
   the row takes the first sample's route: for a shared prompt, the server's prefix cache returns one computation).
3. `AsyncGSPOTrainer` forces them with `trl_gspo.routing.RoutingReplay` around each micro-batch's forward and
   backward (`routing_replay="sampler"`).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, fields

import numpy as np
import torch
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample, _AsyncRolloutLoop

from ..routing.stitching import first_computation_spans
from ..sampling.route_wire import CONTENT_TYPE, HEADER, Frame
from ..sampling.routes import decode_server_routes
from ..sampling.server import FramedRoute, framed_completions_answer, json_completions_answer

# The current conversation's turns as the server answered them: (prompt ids, output ids, routes or None).
_TURNS: contextvars.ContextVar[list | None] = contextvars.ContextVar("trl_gspo_async_turns", default=None)


@dataclass(slots=True)
class RoutedRolloutSample(RolloutSample):
    """TRL's `RolloutSample` with the sampler's routes of its `input_ids`, `[len(input_ids) - 1, layers, top_k]`
    (None: the server returned none)."""

    routes: np.ndarray | None = None


def stitch_turn_routes(input_ids: list[int], turns: list[tuple[list[int], list[int], np.ndarray | None]]):
    """Routes of a training sequence `input_ids` from its conversation's turns `(prompt ids, output ids, routes)`,
    `routes[p]` the route of position p (`[len(prompt) + len(output) - 1, layers, top_k]`, vLLM's layout). Position p
    takes the route of the first turn whose tokens up to p equal the sequence's: where that turn computed the token
    (prompt: its prefill; its sampled tokens: its decode). Returns `[len(input_ids) - 1, layers, top_k]`, or None
    when some position has no route (a turn without routes, or a sequence no turn covers)."""
    need = len(input_ids) - 1
    if need <= 0:
        return None
    for prompt, output, routes in turns:
        if routes is None:
            return None
        if routes.shape[0] != len(prompt) + len(output) - 1:
            raise ValueError(f"routing_replay='sampler': the server's routed_experts has {routes.shape[0]} rows for "
                             f"{len(prompt) + len(output)} tokens ({len(prompt) + len(output) - 1} expected). Cause: "
                             "a server whose routes do not belong to its answer's tokens (a vLLM outside trl-gspo's "
                             "tested range).")
    spans = first_computation_spans(input_ids, [list(prompt) + list(output) for prompt, output, _ in turns])
    if not spans or spans[-1][2] < need:
        return None
    return np.concatenate([turns[k][2][start:stop] for k, start, stop in spans])


class RoutedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (the rollout worker's child process) that keeps the server's routes with each sample."""

    async def _post(self, path, payload, timeout, max_retries=3):
        if path != "/v1/completions":
            return await super()._post(path, payload, timeout, max_retries)
        content = await self._retry(lambda: self._post_completions(payload, timeout), label=f"POST {path}",
                                    max_attempts=max_retries)
        turns = _TURNS.get()
        if turns is not None:
            choice = content["choices"][0]
            routes = choice.get("routed_experts")
            turns.append((payload["prompt"], choice["token_ids"],
                          routes.array() if isinstance(routes, FramedRoute) else decode_server_routes(routes)))
        return content

    async def _post_completions(self, payload: dict, timeout: float) -> dict:
        """TRL's `/v1/completions` call asking for the routes as a route frame (header `X-TRL-GSPO-Routes`): the
        answer is read from the frame when the server sends one (`trl-gspo vllm-serve`: each choice's
        `routed_experts` a `FramedRoute`, a view of the received bytes), from JSON otherwise (stock vLLM: base64)."""
        import aiohttp

        async with self.session.post(f"{self.vllm_server_url}/v1/completions", json=payload, headers={HEADER: "1"},
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            response.raise_for_status()
            if not response.headers.get("content-type", "").startswith(CONTENT_TYPE):
                content = await response.json()
                return json_completions_answer(content, self.vllm_server_url) if content else {}
            return framed_completions_answer(await _read_frame(response))

    async def _generate_one(self, *args, **kwargs):
        token = _TURNS.set([])
        try:
            result = await super()._generate_one(*args, **kwargs)
            turns = _TURNS.get()
        finally:
            _TURNS.reset(token)
        for sequence in result[2]:  # the conversation's training sequences (TrainingSequence)
            sequence.routes = stitch_turn_routes(sequence.input_ids, turns)
        return result

    async def _score_group(self, group):
        samples = await super()._score_group(group)
        sequences = [sequence for conversation in group.completions_sequences for sequence in conversation]
        if len(sequences) != len(samples):
            raise RuntimeError(f"TRL's rollout worker scored {len(samples)} samples from {len(sequences)} training "
                               "sequences; routing_replay='sampler' pairs them in order.")
        names = [f.name for f in fields(RolloutSample)]
        return [RoutedRolloutSample(**{name: getattr(sample, name) for name in names},
                                    routes=getattr(sequence, "routes", None))
                for sample, sequence in zip(samples, sequences)]


async def _read_frame(response) -> Frame:
    """The route frame of an aiohttp response: its body as one `bytes` object (aiohttp's `read`, which raises
    `ClientPayloadError` for a body cut short), read by safetensors."""
    return Frame.parse(await response.read())


def packed_routes(row, routes: list[np.ndarray | None], layers: int, top_k: int, dtype=torch.uint8):
    """`(routes [N, layers, top_k], routed [N] bool)` of a TRL `TreeRow` in its packed order (`row.pack()`): position
    n takes the route of the first of the row's samples whose token sits there (`routes[i]`: sample i's
    `[len - 1, layers, top_k]`, or None); `routed` is False where no sample has one (a sample's last token, or a
    sample without routes), which keeps natural routing there."""
    # The packed position of each trie node: TRL's own layout, read by packing the node ids as if they were tokens.
    tokens, row.tokens = row.tokens, list(range(len(row.tokens)))
    try:
        order = row.pack()["input_ids"]
    finally:
        row.tokens = tokens
    position = torch.empty(len(order), dtype=torch.long)
    position[order] = torch.arange(len(order))
    out = torch.zeros((len(order), layers, top_k), dtype=dtype)
    routed = torch.zeros(len(order), dtype=torch.bool)
    for nodes, sample_routes in zip(row.sample_nodes, routes):
        if sample_routes is None:
            continue
        if tuple(sample_routes.shape) != (len(nodes) - 1, layers, top_k):
            raise ValueError(f"routing_replay='sampler': a sample of {len(nodes)} tokens came with routes of shape "
                             f"{tuple(sample_routes.shape)}; expected {(len(nodes) - 1, layers, top_k)} for this "
                             "model. Cause: a server serving another model than the trainer's.")
        where = position[torch.tensor(nodes[:-1], dtype=torch.long)]
        fresh = ~routed[where]
        out[where[fresh]] = torch.from_numpy(np.ascontiguousarray(sample_routes)).to(dtype)[fresh]
        routed[where] = True
    return out, routed
