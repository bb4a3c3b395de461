"""Rollout routing replay (R3) from vLLM: the experts each token used in the vLLM engine that sampled it.

vLLM records routes when its engine is built with `enable_return_routed_experts=True`; each finished
`CompletionOutput` then holds `routed_experts`, a numpy integer array `[prompt_len + completion_len - 1,
num_moe_layers, top_k]` (the last sampled token is never fed forward). Checked in vLLM 0.22.0's wheel
(`vllm/outputs.py`, `vllm/config/model.py`, `vllm/engine/arg_utils.py`; int32 transit buffers) and in vLLM's
main branch; TRL 1.16 supports vLLM 0.22.0 to 0.31.0, the range here.

TRL 1.16 builds its colocate engine without that flag (and without a dtype) and drops the field;
`trl_gspo.sampling.engine` adds them and this module reads the routes back, keeping TRL's engine, sampling
parameters and weight sync:

    with engine_options(enable_return_routed_experts=True):   # around GRPOTrainer.__init__: TRL's colocate LLM
        trainer = ...
    with capture_routes(trainer.vllm_generation, accelerator) as take:   # around TRL's generate call
        ...
    sampled = take(completion_lengths, index_dtype)   # this rank's completions, TRL's order

The three layouts TRL runs vLLM in, and where each rank's routes come from (`capture_routes`):

    colocate, TP 1      the rank's own engine generates its own prompts: all of its outputs are its own
    colocate, TP > 1    the engines of a TP group generate the group's gathered prompts, identically on every rank;
                        TRL keeps the rank's slice of the completions, and so do the routes (same slice)
    server              `trl-gspo vllm-serve` (TRL's server plus `--enable-return-routed-experts`) returns each
                        completion's routes with its tokens (`routed_experts`, base64 `.npy`, in vLLM's
                        `/v1/completions` choices); the main process reads them from the response TRL's client
                        receives and sends each other rank only its TRL process slice of the answer (point to
                        point); every rank decodes and checks its own
"""

from __future__ import annotations

import base64
import contextlib
import io
import warnings
from types import SimpleNamespace

import torch
from packaging.version import Version

from ..routing.rollout import SampledRoutes, no_route, wrapping_method
from .server import SERVER_ROUTES_FLAG, FramedRoute, capture_server_choices

VLLM_RANGE = (Version("0.22.0"), Version("0.31.0"))  # routed_experts exists throughout; TRL 1.16's vLLM range


@contextlib.contextmanager
def capture_outputs(llm):
    """Keep the `RequestOutput`s of every `llm.generate` call made inside the block (TRL discards their routes)."""
    outputs = []

    def keeping(original):
        def generate(*args, **kwargs):
            result = original(*args, **kwargs)
            outputs.extend(result)
            return result
        return generate

    with wrapping_method(llm, "generate", keeping):
        yield outputs


def routes_from_vllm(request_outputs, index_dtype: torch.dtype = torch.uint8, *,
                     server: bool = False) -> SampledRoutes:
    """Split vLLM's `routed_experts` per completion, in TRL's order (each request's completions in turn), into
    prompt routes `[prompt_len, L, K]` and completion routes `[completion_len, L, K]` whose last row (the token
    never fed forward) is the `no_route` sentinel. Refuses any length that does not match (a misaligned route would
    be replayed on the wrong token).

    Memory: each completion's routes are copied once, into their own `[completion_len, L, K]` tensor; the prompt's
    rows are kept once per prompt when its completions hold the same ones (one prefill: vLLM's `n` samples of a
    prompt), so a prompt's routes are not held `n` times. `routed_experts` may be a zero-argument callable that
    returns the array (decoded only when its turn comes, then dropped)."""
    prompt_routes, completion_routes = [], []
    sentinel = no_route(index_dtype)
    previous_prompt = None  # (token ids, routes) of the last prompt kept: its next completions usually share them
    for request in request_outputs:
        prompt_len = len(request.prompt_token_ids)
        for completion in request.outputs:
            routes, completion_len = completion.routed_experts, len(completion.token_ids)
            routes = routes() if callable(routes) else routes
            if routes is None and server:
                raise RuntimeError("routing_replay='sampler': the vLLM server returned a completion without "
                                   "`routed_experts`. Cause: it was started without "
                                   f"{SERVER_ROUTES_FLAG} (plain `trl vllm-serve`), it serves a model without experts "
                                   "(`trl-gspo vllm-serve` leaves the flag out for one), or its vLLM predates routes "
                                   "in /v1/completions. Fix: start it with `trl-gspo vllm-serve` (same arguments as "
                                   "`trl vllm-serve`) on the policy's MoE model, or set routing_replay='old'.")
            if routes is None:
                raise RuntimeError("routing_replay='sampler': vLLM returned a completion without `routed_experts`. "
                                   "Cause: its engine was built without enable_return_routed_experts=True, or the "
                                   "request did not finish. Fix: build GSPOTrainer with routing_replay='sampler' "
                                   "(it sets the flag), or set routing_replay='old'.")
            with warnings.catch_warnings():  # a read-only view of a route frame's bytes: only read, never written
                warnings.simplefilter("ignore", UserWarning)
                routes = torch.as_tensor(routes)
            expected = prompt_len + completion_len - 1
            if routes.dim() != 3 or routes.shape[0] != expected:
                raise RuntimeError(
                    f"routing_replay='sampler': vLLM's routed_experts has shape {tuple(routes.shape)} for a "
                    f"{prompt_len}-token prompt and {completion_len}-token completion; expected [{expected}, layers, "
                    "top_k]. The routes would not line up with the tokens. Fix: use a vLLM version in "
                    f"{VLLM_RANGE[0]}..{VLLM_RANGE[1]}, or set routing_replay='old'.")
            if completion_len == 0:
                raise RuntimeError("routing_replay='sampler': vLLM returned an empty completion; it has no tokens "
                                   "to route. Fix: set min_tokens >= 1 in generation_kwargs.")
            if routes.dtype != index_dtype and (bool((routes < 0).any()) or int(routes.max()) >= sentinel):
                raise RuntimeError(f"routing_replay='sampler': vLLM's expert indices fall outside 0..{sentinel - 1}, "
                                   f"which {index_dtype} stores. Fix: report the model; set routing_replay='old'.")
            prompt = routes[:prompt_len]
            if (previous_prompt is not None and previous_prompt[0] == request.prompt_token_ids
                    and torch.equal(previous_prompt[1], prompt.to(index_dtype))):
                prompt_routes.append(previous_prompt[1])
            else:
                prompt_routes.append(prompt.to(index_dtype, copy=True))
                previous_prompt = (request.prompt_token_ids, prompt_routes[-1])
            kept = torch.empty((completion_len, *routes.shape[1:]), dtype=index_dtype)
            kept[:-1] = routes[prompt_len:]
            kept[-1] = sentinel
            completion_routes.append(kept)
    return SampledRoutes(prompt_routes, completion_routes, sampler_logps=[])


def routes_from_rollout_func(routes, prompt_ids, completion_ids,
                             index_dtype: torch.dtype = torch.uint8) -> SampledRoutes:
    """A rollout_func's `routed_experts` (one integer array per sample, `[len(prompt) + len(completion) - 1, layers,
    top_k]`: vLLM's layout, so vLLM's arrays pass through unchanged) split like `routes_from_vllm`, after refusing a
    count or shape that does not fit the samples TRL received from the same rollout_func."""
    fix = ("Fix: return one array per sample in the order of `completion_ids`, with rows for every token of prompt + "
           "completion but the last (docs/sampling.md), or set routing_replay='old'.")
    if len(routes) != len(prompt_ids):
        raise ValueError(f"`routing_replay`: the rollout_func returned {len(routes)} `routed_experts` arrays for "
                         f"{len(prompt_ids)} samples. {fix}")
    requests = []
    for i, (prompt, completion, sample_routes) in enumerate(zip(prompt_ids, completion_ids, routes)):
        shape = tuple(getattr(sample_routes, "shape", ()))
        if sample_routes is None or len(shape) != 3 or shape[0] != len(prompt) + len(completion) - 1:
            raise ValueError(f"`routing_replay`: the rollout_func's `routed_experts` for sample {i} has shape {shape}; "
                             f"its {len(prompt)}-token prompt and {len(completion)}-token completion need "
                             f"[{len(prompt) + len(completion) - 1}, layers, top_k]. {fix}")
        requests.append(SimpleNamespace(prompt_token_ids=prompt, outputs=[SimpleNamespace(
            token_ids=completion, routed_experts=sample_routes)]))
    return routes_from_vllm(requests, index_dtype)


def slice_routes(sampled: SampledRoutes, start: int, completion_lengths: list[int]) -> SampledRoutes:
    """The routes of completions `start .. start + len(completion_lengths) - 1`: the slice TRL keeps for this rank
    (its TP-group slice in colocate mode, its process slice in server mode). Refuses a slice whose completion lengths
    are not the ones TRL kept, so routes never move to another rank's completions."""
    stop = start + len(completion_lengths)
    kept = SampledRoutes(sampled.prompt_routes[start:stop], sampled.completion_routes[start:stop],
                         sampled.sampler_logps[start:stop])
    lengths = [len(routes) for routes in kept.completion_routes]  # one row per completion token
    if lengths != list(completion_lengths):
        raise RuntimeError(
            f"routing_replay='sampler': the routes of completions {start}..{stop - 1} of the "
            f"{len(sampled.prompt_routes)} vLLM returned have lengths {lengths}, but TRL kept completions of lengths "
            f"{list(completion_lengths)} "
            "for this rank, so they would be replayed on other tokens. Fix: report this with your TRL and vLLM "
            "versions; set routing_replay='old'.")
    return kept


def decode_server_routes(encoded: str | None):
    """A choice's `routed_experts` from vLLM's server (base64 of a `.npy` file, `numpy2base64`), or None."""
    if encoded is None:
        return None
    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def _has_routes(value) -> bool:
    return value is not None and not (isinstance(value, str) and not value)


def routes_from_server(choices: list[dict], index_dtype: torch.dtype = torch.uint8) -> SampledRoutes:
    """`routes_from_vllm` for the choices of vLLM's `/v1/completions` answers (prompt-major, TRL's order), each with
    `prompt_token_ids`, `token_ids` and `routed_experts`: a `FramedRoute` (read in place, `_split_framed`), an array,
    or vLLM's base64 text. Each choice's routes are taken out of the choice (`routed_experts` set to None) when read,
    so base64 text and its decoded routes are never held together for the whole answer."""
    import numpy as np

    def decoder(choice):
        def decode():
            encoded, choice["routed_experts"] = choice.get("routed_experts"), None
            return encoded if isinstance(encoded, np.ndarray) else decode_server_routes(encoded)
        return decode

    sampled, previous, pending = SampledRoutes([], [], sampler_logps=[]), None, []

    def flush():  # choices answered in JSON, together (a prompt's routes then kept once, as routes_from_vllm does)
        if pending:
            decoded = routes_from_vllm(pending, index_dtype, server=True)
            sampled.prompt_routes.extend(decoded.prompt_routes)
            sampled.completion_routes.extend(decoded.completion_routes)
            pending.clear()

    for choice in choices:
        routes = choice.get("routed_experts")
        if isinstance(routes, FramedRoute):
            flush()
            prompt, completion, previous = _split_framed(routes, len(choice["prompt_token_ids"]),
                                                         len(choice["token_ids"]), index_dtype, previous)
            choice["routed_experts"] = None
            sampled.prompt_routes.append(prompt)
            sampled.completion_routes.append(completion)
        else:
            pending.append(SimpleNamespace(prompt_token_ids=choice["prompt_token_ids"], outputs=[SimpleNamespace(
                token_ids=choice["token_ids"], routed_experts=decoder(choice) if _has_routes(routes) else None)]))
    flush()
    return sampled


def _split_framed(route: FramedRoute, prompt_len: int, completion_len: int, index_dtype: torch.dtype, previous):
    """A framed choice's (prompt routes, completion routes), views of the frame's bytes where its rows lie in one
    array (the frame's array ends with the `no_route` row R3 keeps for the last token): a prompt's completions share
    one prompt tensor. Refuses lengths that do not match, as `routes_from_vllm` does. `previous`: what the last call
    returned as its third value (the frame, array index, prompt length and prompt tensor of the choice before)."""
    import numpy as np

    frame, i = route.frame, route.index
    entry = frame.index[i]
    rows = entry["shape"][0]
    if len(entry["shape"]) != 3 or rows != prompt_len + completion_len:
        raise RuntimeError(
            f"routing_replay='sampler': vLLM's routed_experts has shape {(rows - 1, *entry['shape'][1:])} for a "
            f"{prompt_len}-token prompt and {completion_len}-token completion; expected "
            f"[{prompt_len + completion_len - 1}, layers, top_k]. The routes would not line up with the tokens. Fix: use a vLLM version in "
            f"{VLLM_RANGE[0]}..{VLLM_RANGE[1]}, or set routing_replay='old'.")
    if completion_len == 0:
        raise RuntimeError("routing_replay='sampler': vLLM returned an empty completion; it has no tokens to route. "
                           "Fix: set min_tokens >= 1 in generation_kwargs.")

    def tensor(array):
        converted = torch.from_numpy(array)
        if converted.dtype == index_dtype:
            return converted
        real = converted[(converted != no_route(converted.dtype)).any(-1)]
        if bool((real < 0).any()) or (real.numel() and int(real.max()) >= no_route(index_dtype)):
            raise RuntimeError(f"routing_replay='sampler': vLLM's expert indices fall outside "
                               f"0..{no_route(index_dtype) - 1}, which {index_dtype} stores. Fix: report the "
                               "model; set routing_replay='old'.")
        return torch.where(converted == no_route(converted.dtype), no_route(index_dtype), converted).to(index_dtype)

    if (previous is not None and previous[0] is frame and previous[1] == i - 1 and previous[2] == prompt_len
            and entry["shared"] >= prompt_len):
        prompt = previous[3]  # the same rows as the choice before: one tensor for the prompt's completions
    else:
        prompt = tensor(np.asarray(frame.rows(i, 0, prompt_len)))
    completion = tensor(np.asarray(frame.rows(i, prompt_len, rows)))
    return prompt, completion, (frame, i, prompt_len, prompt)


def hand_out_choices(choices: list[dict], counts: list[int], accelerator) -> list[dict]:
    """Server mode, several processes: give each rank the choices of its slice, collectively. The main process holds
    every rank's choices in rank order, `counts[r]` of them for rank r (TRL's `process_slice`: equal counts; a lockstep
    tool turn, `trl_gspo.trainer.tool_lockstep`: the counts each rank sent). It sends each other rank with a non-empty
    slice only its choices' token ids (pickled, small) and, from a route frame, its arrays as a frame of their own (one flat
    uint8 tensor, `dist.send`: the routes are not pickled), read in place by the rank; base64 text from a JSON answer
    is sent as text and decoded by the rank. One rank at a time, each part dropped once sent."""
    import torch.distributed as dist

    from .route_wire import Frame

    device = accelerator.device if dist.get_backend() == "nccl" else torch.device("cpu")
    if not accelerator.is_main_process:
        if not counts[accelerator.process_index]:
            return []
        received = [None]
        dist.recv_object_list(received, src=0)
        part, index = received[0]
        if index:  # this slice's arrays, a frame of their own, follow as one tensor
            buffer = bytearray(sum(entry["nbytes"] for entry in index))
            flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
            if device.type == "cpu":
                dist.recv(flat, src=0)
            else:
                incoming = torch.empty(len(buffer), dtype=torch.uint8, device=device)
                dist.recv(incoming, src=0)
                flat.copy_(incoming.cpu())
            frame = Frame.from_buffer(index, buffer)
            for choice in part:
                if isinstance(choice["routed_experts"], int):
                    choice["routed_experts"] = FramedRoute(frame, choice["routed_experts"])
        return part
    start, waiting = counts[0], [rank for rank in range(1, accelerator.num_processes) if counts[rank]]
    try:
        _send_parts(choices, counts, accelerator, device, waiting)
    except Exception as error:  # the ranks still waiting for their part raise it too (trl_gspo/ranks.py)
        from ..ranks import FailedElsewhere

        for rank in waiting:
            dist.send_object_list([FailedElsewhere(error, 0)], dst=rank)
        raise
    return choices[:counts[0]]


def _send_parts(choices: list[dict], counts: list[int], accelerator, device, waiting: list[int]) -> None:
    """hand_out_choices on the main process; each rank sent its part leaves `waiting`."""
    import torch.distributed as dist

    start = counts[0]
    for rank in range(1, accelerator.num_processes):
        stop = start + counts[rank]
        if stop > start:
            framed = [choice["routed_experts"] for choice in choices[start:stop]
                      if isinstance(choice.get("routed_experts"), FramedRoute)]
            frame, first, index, data = None, 0, [], None
            if framed:
                frame, first = framed[0].frame, framed[0].index
                if any(r.frame is not frame for r in framed) or [r.index for r in framed] != list(
                        range(first, first + len(framed))):
                    raise RuntimeError("routing_replay='sampler': the server's routes for one rank came in several "
                                       "answers or out of order. Fix: report this with your TRL version; set "
                                       "routing_replay='old'.")
                index, data = frame.part(first, first + len(framed) - 1)
            part = []
            for choice in choices[start:stop]:
                routes = choice.get("routed_experts")
                if isinstance(routes, FramedRoute):
                    routes = routes.index - first  # its place in the rank's own frame
                part.append({"prompt_token_ids": choice.get("prompt_token_ids"), "token_ids": choice.get("token_ids"),
                             "routed_experts": routes})
                choice["routed_experts"] = None
            dist.send_object_list([(part, index)], dst=rank)
            waiting.remove(rank)
            if data is not None:
                dist.send(torch.from_numpy(data).to(device), dst=rank)
            del part, data
        start = stop


@contextlib.contextmanager
def capture_routes(vllm_generation, accelerator, split=None):
    """Around one TRL vLLM generate call (`VLLMGeneration.generate`), in every process. Yields
    `take(completion_lengths, index_dtype)`: the routes of the completions TRL kept for this process (its slice; see
    the module docstring). `take` is collective in server mode (the main process sends each rank its slice).
    `split()`, read when `take` runs, gives the layout of a lockstep tool turn
    (`trl_gspo.trainer.tool_lockstep.TurnSplit`: the group's counts and this rank's place) or None for TRL's equal slices."""
    layout = split if split is not None else (lambda: None)
    if vllm_generation.mode == "server":
        client = getattr(vllm_generation, "vllm_client", None)  # the main process's only
        with capture_server_choices(client) if client is not None else contextlib.nullcontext([]) as choices:
            def take_server(completion_lengths, index_dtype):
                turn = layout()
                counts = turn.counts if turn is not None else [len(completion_lengths)] * accelerator.num_processes
                mine = choices if accelerator.num_processes == 1 else hand_out_choices(choices, counts, accelerator)
                return slice_routes(routes_from_server(mine, index_dtype), 0, completion_lengths)

            yield _together(accelerator, take_server)
        return
    with capture_outputs(vllm_generation.llm) as outputs:
        def take_colocate(completion_lengths, index_dtype):
            everything = routes_from_vllm(outputs, index_dtype)
            turn, start = layout(), 0
            if turn is not None:  # a lockstep tool turn: the group's results in rank order, `counts` each
                start = turn.start
            elif vllm_generation.tensor_parallel_size > 1:  # TRL gathered the TP group's prompts; it keeps our slice
                start = torch.distributed.get_rank(group=vllm_generation.tp_group) * len(completion_lengths)
            return slice_routes(everything, start, completion_lengths)

        yield take_colocate  # each rank's own engine: the ranks' calls need not pair up (a tool loop at TP 1)


def _together(accelerator, take):
    """`take` in server mode, where one rank may refuse its own slice's routes alone: every rank raises then, through
    one all-reduced flag per call (`trl_gspo.ranks.together`). Every rank makes each server-mode generate call
    (TRL's gather and broadcast; tool turns in lockstep), so the flags pair up."""
    from ..ranks import together

    if accelerator is None or accelerator.num_processes == 1:
        return take
    return together(accelerator, take)
