"""Rollout routing replay (R3) from Hugging Face `generate`: the experts each token used where it was sampled.

Records, during one `model.generate(..., use_cache=True)` call, the experts every token was routed to (the prefill
forward for prompt tokens, each decode step for the completion token fed in that step) and the sampler's per-token
log-prob, then lays the routes out like TRL's padded `[prompt | completion]` tensors so `RoutingReplay.replay` can
force them in the trainer's passes. Knows nothing of TRL.

    rr = RoutingReplay(model)
    with record_generation(rr, temperature=T) as rec:
        seqs = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=T)
    sampled = rec.per_sample(seqs, prompt_mask, completion_lengths)   # unpadded, on CPU
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, trl_prompt_mask, completion_mask)
    with rr.replay(routes, mask=has_route(routes) & attention_mask.bool(), stats_mask=...):
        model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=attention_mask)

Layout: the token at position t of a sequence is routed in the forward that is fed token t. The last sampled token
is never fed forward (vLLM's `routed_experts` has `prompt_len + completion_len - 1` rows for the same reason), so it
has no route; nor has padding. (HF generate does feed a completion that stopped early its stop token in the next
step, with pad tokens after it; those routes are dropped too, so every completion has the same layout as vLLM's.)
Such slots hold the sentinel `no_route(dtype)` (the dtype's maximum) in all k slots, never expert 0, and must be
masked out of replay (`mask=has_route(...)`; also out of `stats_mask`, else they count as drift). The last token's
route could only affect positions after it, which are padding and never scored, so leaving it unforced changes no
scored log-prob.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .replay import RoutingReplay, RoutingReplayError

__all__ = ["GenerationRecording", "SampledRoutes", "check_sampled_routes", "has_route", "no_route", "pad_routes_like",
           "record_generation", "route_dtype", "wrapping_method"]


def route_dtype(num_experts: int, top_k: int) -> torch.dtype:
    """The smallest integer dtype that stores expert indices with an unambiguous `no_route` sentinel (its maximum).

    uint8 (1 byte per (token, layer, k)) up to 256 experts, except 256 experts with top-1, where expert 255 is a real
    route: a route with all k slots at the maximum is a sentinel only if k > 1 (a real top-k set has k distinct
    experts) or the maximum is not an expert. That one case, and 257..32767 experts, use int16; more use int32.
    """
    for dtype in (torch.uint8, torch.int16, torch.int32):
        top = torch.iinfo(dtype).max
        if num_experts - 1 < top or (num_experts - 1 == top and top_k > 1):
            return dtype
    raise RoutingReplayError(f"{num_experts} experts do not fit an int32 route recording.")


def no_route(dtype: torch.dtype) -> int:
    """The `NO_ROUTE` sentinel of a route dtype: its maximum value, in every one of a token-layer's k slots."""
    return torch.iinfo(dtype).max


def has_route(indices: torch.Tensor) -> torch.Tensor:
    """`[batch, seq_len]` bool: True where every MoE layer of the token holds a real route in `indices`
    `[batch, seq_len, layers, top_k]`. A layer has no route when all its k slots hold `no_route(indices.dtype)`."""
    if indices.dim() != 4 or indices.is_floating_point():
        raise RoutingReplayError(f"has_route needs integer routes [batch, seq_len, layers, top_k], got "
                                 f"{indices.dtype} {tuple(indices.shape)}.")
    return (indices != no_route(indices.dtype)).any(-1).all(-1)


@dataclass
class SampledRoutes:
    """Per sample, unpadded, on CPU: `prompt_routes[i]` `[p_len_i, layers, k]` (real prompt tokens only),
    `completion_routes[i]` `[c_len_i, layers, k]` (the last row is `no_route`), `sampler_logps[i]` `[c_len_i]` float32
    (log_softmax(logits / temperature) of the sampled token, in the sampler's forward)."""

    prompt_routes: list[torch.Tensor]
    completion_routes: list[torch.Tensor]
    sampler_logps: list[torch.Tensor]


_CHECK_ROWS = 1 << 15  # (token, layer) rows checked together: their k columns stay in the CPU's cache


def check_sampled_routes(sampled: SampledRoutes, num_experts: int, top_k: int, source: str) -> None:
    """Refuse sampler routes that no top-k router produces, before they are replayed: a wrong number of experts per
    token, an index outside `0..num_experts-1`, or the same expert twice in one token's top-k (e.g. all-zero routes
    from a capture that silently failed). `no_route` rows (all k slots) are skipped. Raises `RoutingReplayError`
    naming the cause.

    Near memory speed (the flagship's round is 0.85 GB of uint8 routes: benchmarks/server_routes.py): in the routes'
    own dtype, `_CHECK_ROWS` rows at a time, transposed into k columns in a reused buffer that stays in the CPU's
    cache, so that each of the k - 1 comparisons of the columns at distance d (all pairs of slots) reads contiguous
    memory; a tensor shared by several samples (a prompt's routes) once; the chunks split over
    `torch.get_num_threads()` threads (numpy releases the GIL). The count of real slots the error names is taken only
    when there is an error."""
    import numpy as np

    where = f"routing_replay='sampler': the routes {source} returned"
    tensors, seen = [], set()
    for routes in (*sampled.prompt_routes, *sampled.completion_routes):
        if not routes.numel() or id(routes) in seen:
            continue
        seen.add(id(routes))
        if routes.shape[-1] != top_k:
            raise RoutingReplayError(f"{where} hold {routes.shape[-1]} experts per token and layer; the model routes "
                                     f"each token to {top_k}. Fix: sample with the model being trained, or set "
                                     "routing_replay='old'.")
        tensors.append(routes.reshape(-1, top_k))
    chunks = [(rows, start) for rows in tensors for start in range(0, len(rows), _CHECK_ROWS)]
    workers = max(1, min(torch.get_num_threads(), len(chunks)))  # numpy releases the GIL in these loops

    def check_chunks(share: list) -> tuple[bool, int, list | None]:
        """(an index outside, repeated rows, one repeated row) over `share`, with this worker's own buffers."""
        buffers, flags = {}, np.empty((top_k, _CHECK_ROWS), dtype=bool)
        twice, repeated, example = np.empty(_CHECK_ROWS, dtype=bool), 0, None
        for rows, start in share:
            chunk = rows[start:start + _CHECK_ROWS].numpy()
            if chunk.dtype not in buffers:
                buffers[chunk.dtype] = np.empty((top_k, _CHECK_ROWS), dtype=chunk.dtype)
            columns, flag, twice_here = buffers[chunk.dtype][:, :len(chunk)], flags[:, :len(chunk)], twice[:len(chunk)]
            np.copyto(columns, chunk.T)
            np.greater_equal(columns, num_experts, out=flag)  # no_route itself is outside: a row mixing it is refused
            outside = np.logical_or.reduce(flag, axis=0)
            if np.issubdtype(chunk.dtype, np.signedinteger):
                outside |= np.logical_or.reduce(columns < 0, axis=0)
            unrouted = None
            if outside.any():
                np.equal(columns, no_route(rows.dtype), out=flag)
                unrouted = np.logical_and.reduce(flag, axis=0)  # no_route rows: skipped
                if (outside & ~unrouted).any():
                    return True, repeated, example
            twice_here[:] = False
            for distance in range(1, top_k):  # slots i and i + distance, every i at once
                same = flag[:top_k - distance]
                np.equal(columns[:top_k - distance], columns[distance:], out=same)
                twice_here |= np.logical_or.reduce(same, axis=0)
            if unrouted is not None:
                twice_here &= ~unrouted
            count = int(np.count_nonzero(twice_here))
            if count and example is None:
                example = chunk[int(twice_here.argmax())].tolist()
            repeated += count
        return False, repeated, example

    if workers == 1:
        results = [check_chunks(chunks)]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(check_chunks, [chunks[w::workers] for w in range(workers)]))
    if any(outside for outside, _, _ in results):
        raise RoutingReplayError(f"{where} hold expert indices outside 0..{num_experts - 1} (the model's experts). "
                                 "Cause: routes from another model, or misread. Fix: sample with the model being "
                                 "trained, or set routing_replay='old'.")
    repeated = sum(count for _, count, _ in results)
    example = next((found for _, _, found in results if found is not None), None)
    if repeated:
        real = sum(int((rows != no_route(rows.dtype)).any(1).sum()) for rows in tensors)  # for the message only
        raise RoutingReplayError(
            f"{where} name the same expert twice within one token's top-{top_k} in {repeated} of "
            f"{real} (token, layer) slots, e.g. {example}; no top-k router does that. Cause: the sampler's "
            "route capture returned placeholders (all-zero routes: a capture that was compiled away or never "
            "bound), or misaligned data. Fix: use a vLLM build whose MoE kernel supports routed-experts capture "
            "(docs/sampling.md), or set routing_replay='old'.")


def _generation_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module `generate` calls once per step: the outermost transformers `GenerationMixin` inside `model`
    (the model itself, or the transformers model inside a PEFT wrapper, whose own forward `generate` bypasses)."""
    from transformers import GenerationMixin

    found = next((m for m in model.modules() if isinstance(m, GenerationMixin)), None)
    if found is None:
        raise RoutingReplayError(f"{type(model).__name__} contains no transformers generation model. Fix: record "
                                 "with the RoutingReplay of the model whose `generate` you call.")
    return found


class GenerationRecording:
    """What `record_generation` saw, one entry per forward call of the model (prefill chunk or decode step).

    Calls are laid end to end: call c is fed positions `[start_c, start_c + len_c)` of the output sequence and its
    last logits predict position `start_c + len_c`, the first token of the next call. Routes and fed ids stay on the
    model's device while generating (no host sync per decode step) and go to CPU in `per_sample`.

    transformers 5.23 `generate` internals this relies on (generation/utils.py `_sample`, `_prefill`): one prefill
    call (or several with `prefill_chunk_size`), then one call per new token but the last, fed the previous token;
    logits come as `[batch, 1, vocab]` (`logits_to_keep=1`); finished rows are fed pad tokens; a `DeferredStopCheck`
    (mps) runs one extra decode call that generate undoes; under `synced_gpus` a rank that finished keeps calling the
    model, fed its last token, until all ranks finish. `per_sample` checks the fed ids against generate's output,
    so a layout these facts no longer describe fails there instead of misaligning routes.
    """

    def __init__(self, replay: RoutingReplay, temperature: float):
        self.replay = replay
        self.temperature = float(temperature)
        self.dtype = route_dtype(replay.num_experts, replay.top_k)
        self.fed: list[torch.Tensor] = []                 # ids fed per call, [batch, len]
        self.routes: list[list[torch.Tensor | None]] = []  # per call, per layer: [batch * len, k]
        self.logps: dict[int, torch.Tensor] = {}           # position -> [batch] float32 log-prob of the token there
        self.pending: tuple[int, torch.Tensor] | None = None  # (predicted position, [batch, vocab] log-probs)
        self.position = 0

    # ------------------------------------------------------------------ hooks
    def _before_call(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
        if ids is None:
            raise RoutingReplayError("record_generation needs `input_ids` in every forward of generate (got "
                                     "`inputs_embeds`). Fix: call generate with input_ids.")
        if self.pending is not None:  # the previous call's distribution at the token it produced (fed now)
            position, logps = self.pending
            self.logps[position] = logps.gather(1, ids[:, :1].to(logps.device)).squeeze(1)
            self.pending = None
        self.fed.append(ids.detach())
        self.routes.append([None] * len(self.replay.routers))
        self.position += ids.shape[1]

    def _after_call(self, module, args, kwargs, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        # logits_to_keep=1 in generate gives [batch, 1, vocab]; a model without it, [batch, len, vocab]
        self.pending = (self.position, torch.log_softmax(logits[:, -1].float() / self.temperature, dim=-1))

    def _router(self, layer, router, output):
        if not self.routes:
            raise RoutingReplayError("a router ran outside a forward of the generation model.")
        _, _, indices = self.replay._unpack(router)(output)
        self.routes[-1][layer] = indices.detach().to(self.dtype)

    # ------------------------------------------------------------------ result
    def per_sample(self, sequences: torch.Tensor, prompt_mask: torch.Tensor,
                   completion_lengths: Sequence[int] | torch.Tensor) -> SampledRoutes:
        """Split the recording per sample.

        Args:
            sequences: `generate`'s output `[batch, P + G]` (prompts as passed, left-padded, then G new tokens).
            prompt_mask: the `[batch, P]` attention mask passed to generate (left padding).
            completion_lengths: tokens kept per completion (e.g. TRL's truncation after the first EOS), each <= G.
        """
        batch, width = prompt_mask.shape
        generated = sequences.shape[1] - width
        lengths = torch.as_tensor(completion_lengths, dtype=torch.long).cpu()
        if sequences.shape[0] != batch or lengths.shape != (batch,) or generated < 1:
            raise RoutingReplayError(
                f"per_sample got sequences {tuple(sequences.shape)}, prompt_mask {tuple(prompt_mask.shape)}, "
                f"{lengths.numel()} completion lengths. Fix: pass generate's output, the attention mask passed to "
                "generate and one completion length per row.")
        if bool((lengths < 0).any() | (lengths > generated).any()):
            raise RoutingReplayError(f"completion lengths {lengths.tolist()} must lie in [0, {generated}], the "
                                     "number of tokens generate produced.")
        # Routes exist for positions 0 .. P+G-2 (the last token is never fed). Forwards after those are fed the last
        # token again and are dropped for a uniform layout: one from a deferred stop check, or one per step that
        # another rank still generates under `synced_gpus` (ZeRO-3 / FSDP on several processes, where generate keeps
        # a finished rank stepping with the others, re-feeding its last token, until every rank is done).
        needed = width + generated - 1
        same_batch = all(ids.shape[0] == batch for ids in self.fed)
        fed = torch.cat([ids.to(sequences.device) for ids in self.fed], 1) if self.fed and same_batch else None
        lined_up = (fed is not None and needed <= fed.shape[1]
                    and torch.equal(fed[:, :needed], sequences[:, :needed])
                    and bool((fed[:, needed:] == sequences[:, -1:]).all()))
        if not lined_up:
            raise RoutingReplayError(
                f"the recorded forwards were fed {0 if fed is None else fed.shape[1]} positions that do not line up "
                f"with generate's output ({needed} expected: prompt {width} + {generated} new tokens - 1). Fix: "
                "record exactly one `generate(input_ids=..., use_cache=True)` call, from an empty cache, inside "
                "`record_generation`.")
        if self.pending is not None:  # the last call's logits predict the last token: gather it from the output
            position, logps = self.pending
            if position < sequences.shape[1]:
                self.logps[position] = logps.gather(1, sequences[:, position:position + 1].to(logps.device)).squeeze(1)
        missing = [layer for call in self.routes for layer, t in enumerate(call) if t is None]
        if missing:
            raise RoutingReplayError(f"router {self.replay.layer_names[missing[0]]} did not run in a recorded forward.")
        routes = torch.cat([torch.stack(call, dim=1).reshape(ids.shape[0], ids.shape[1], len(call), -1)
                            for ids, call in zip(self.fed, self.routes)], dim=1)[:, :needed].cpu()
        logps = torch.stack([self.logps[width + j] for j in range(generated)], dim=1).cpu()

        mask = prompt_mask.cpu().bool()
        prompt_lengths = mask.sum(1)
        _check_padding(mask, prompt_lengths, left=True, name="prompt_mask")
        sentinel = no_route(self.dtype)
        prompt_routes, completion_routes, sampler_logps = [], [], []
        for i in range(batch):
            p, c = int(prompt_lengths[i]), int(lengths[i])
            prompt_routes.append(routes[i, width - p:width].clone())
            completion = torch.full((c, *routes.shape[2:]), sentinel, dtype=self.dtype)
            completion[:c - 1] = routes[i, width:width + c - 1]  # the last token was never fed: no route
            completion_routes.append(completion)
            sampler_logps.append(logps[i, :c].clone())
        return SampledRoutes(prompt_routes, completion_routes, sampler_logps)


@contextlib.contextmanager
def record_generation(replay: RoutingReplay, temperature: float = 1.0):
    """Record routes and sampler log-probs of one `generate(..., use_cache=True)` call made inside the block.

    Args:
        replay: the `RoutingReplay` of the model that generates (its routers are hooked).
        temperature: the sampling temperature; log-probs are `log_softmax(logits.float() / temperature)` at the
            sampled token, the policy's tempered distribution (other logits processors, e.g. top-k/top-p, are not
            applied, matching what a trainer scores).

    Yields a `GenerationRecording`; call its `per_sample(...)` after generate returns.
    """
    if not temperature > 0:
        raise RoutingReplayError(f"temperature must be > 0, got {temperature}. Fix: pass the sampling temperature.")
    recording = GenerationRecording(replay, temperature)
    target = _generation_module(replay.model)
    handles = [target.register_forward_pre_hook(recording._before_call, with_kwargs=True),
               target.register_forward_hook(recording._after_call, with_kwargs=True)]
    handles += [router.register_forward_hook(lambda module, args, output, layer=layer:
                                             recording._router(layer, module, output))
                for layer, router in enumerate(replay.routers)]
    try:
        yield recording
    finally:
        for handle in handles:
            handle.remove()


def _check_padding(mask: torch.Tensor, lengths: torch.Tensor, left: bool, name: str) -> None:
    width = mask.shape[1]
    positions = torch.arange(width)
    expected = positions >= width - lengths[:, None] if left else positions < lengths[:, None]
    bad = (mask != expected).any(1).nonzero().flatten()
    if bad.numel():
        side = "left" if left else "right"
        raise RoutingReplayError(f"{name} row {int(bad[0])} is not {side}-padded: {mask[bad[0]].int().tolist()}. "
                                 f"Fix: pass TRL's {side}-padded {name}.")


def pad_routes_like(prompt_routes: Sequence[torch.Tensor], completion_routes: Sequence[torch.Tensor],
                    prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Lay per-sample routes out like TRL's padded `[prompt | completion]` tensors: `[batch, P + C, layers, k]`.

    Prompts are left-padded to `P = prompt_mask.shape[1]`, completions right-padded to `C = completion_mask.shape[1]`
    (any `pad_to_multiple_of`), padding slots `no_route`. Each mask row must be padded on its side and hold exactly as
    many ones as the sample has routes: a route one slot off would be replayed on the wrong token without any error.
    Pass the completion mask before TRL's `mask_truncated_completions` zeroes whole rows.
    """
    batch = prompt_mask.shape[0]
    if not (len(prompt_routes) == len(completion_routes) == batch == completion_mask.shape[0]):
        raise RoutingReplayError(
            f"pad_routes_like got {len(prompt_routes)} prompt and {len(completion_routes)} completion routes for masks "
            f"of {batch} and {completion_mask.shape[0]} rows. Fix: pass routes and masks of the same samples, in "
            "order.")
    if batch == 0:
        raise RoutingReplayError("pad_routes_like got an empty batch.")
    first = prompt_routes[0]
    shapes = {tuple(t.shape[1:]) for t in (*prompt_routes, *completion_routes)}
    dtypes = {t.dtype for t in (*prompt_routes, *completion_routes)}
    if len(shapes) != 1 or len(dtypes) != 1 or first.dim() != 3:
        raise RoutingReplayError(f"routes must all be [tokens, layers, k] of one dtype; got shapes {sorted(shapes)} "
                                 f"and dtypes {dtypes}.")
    for name, mask, routes, left in (("prompt_mask", prompt_mask, prompt_routes, True),
                                     ("completion_mask", completion_mask, completion_routes, False)):
        mask = mask.cpu().bool()
        lengths = torch.tensor([len(t) for t in routes])
        counted = mask.sum(1)
        if not torch.equal(counted, lengths):
            row = int((counted != lengths).nonzero()[0])
            raise RoutingReplayError(
                f"route/mask length mismatch in row {row}: {name} has {int(counted[row])} real tokens, the recorded "
                f"routes {int(lengths[row])}. A misaligned route would be replayed on the wrong token. Fix: pass the "
                f"routes and {name} of the same samples (for completions, the mask before mask_truncated_completions).")
        _check_padding(mask, lengths, left, name)
    width_p, width_c = prompt_mask.shape[1], completion_mask.shape[1]
    out = torch.full((batch, width_p + width_c, *first.shape[1:]), no_route(first.dtype), dtype=first.dtype)
    for i in range(batch):
        p, c = len(prompt_routes[i]), len(completion_routes[i])
        out[i, width_p - p:width_p] = prompt_routes[i].cpu()
        out[i, width_p:width_p + c] = completion_routes[i].cpu()
    return out


@contextlib.contextmanager
def wrapping_method(owner, name: str, wrap):
    """While open, `owner.<name>` is `wrap(original)`; afterwards exactly what it was before, including an instance
    attribute someone else had set (deleting ours would silently remove theirs)."""
    own = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT
    setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


_ABSENT = object()
