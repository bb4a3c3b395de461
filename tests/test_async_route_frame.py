"""R3's routes in the asynchronous rollout loop read from the route frame (trl_gspo/sampling/route_wire.py):
`RoutedRolloutLoop._post` asks every `/v1/completions` call for the frame and reads the answer from it, or from JSON
when the server sends JSON (stock vLLM); the routes kept per turn are the arrays the server sent either way. Driven
over HTTP against a local aiohttp server that answers as `trl-gspo vllm-serve` (route_wire's own encoder) or as vLLM
(base64 `.npy` in the JSON)."""

import asyncio
import collections
import json

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")  # TRL's rollout worker's transport
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402
from support.fake_vllm import npy_base64  # noqa: E402

from trl_gspo.async_trainer.routing import _TURNS, RoutedRolloutLoop, stitch_turn_routes  # noqa: E402
from trl_gspo.sampling import route_wire  # noqa: E402

LAYERS, TOP_K = 3, 2


def _conversation():
    """Two turns of one conversation as the server answers them: (prompt ids, output ids, routes). The second turn's
    routes are long enough to arrive in several chunks."""
    rng = np.random.default_rng(0)
    first = ([1, 2, 3], [4, 5])
    second = (first[0] + first[1] + [9] * 3000, [6, 7])
    return [(prompt, output, rng.integers(0, 128, (len(prompt) + len(output) - 1, LAYERS, TOP_K), dtype=np.uint8))
            for prompt, output in (first, second)]


def _answer(output, routed_experts):
    """vLLM's `/v1/completions` answer for one choice, with what TRL's rollout loop reads (tokens, log-probs)."""
    return {"choices": [{"index": 0, "text": "", "token_ids": output, "finish_reason": "length",
                         "logprobs": {"token_logprobs": [-0.5] * len(output)}, "routed_experts": routed_experts}]}


def _server(turns, form, headers_seen):
    """A stand-in for the server: `form` "frame" answers as `trl-gspo vllm-serve` (the frame, sent in two writes, with
    its length), "chunked frame" the same without a length (chunked transfer), "json" as
    vLLM (base64 routes in the JSON); "missing array" frames an answer that names an array the frame lacks, "cut
    routes" a frame whose route bytes stop short of its index."""
    by_prompt = {tuple(prompt): (output, routes) for prompt, output, routes in turns}

    async def completions(request):
        headers_seen.append(request.headers.get(route_wire.HEADER))
        output, routes = by_prompt[tuple((await request.json())["prompt"])]
        if form == "json":
            return web.json_response(_answer(output, npy_base64(routes)))
        reference = "#1" if form == "missing array" else "#0"
        frame = route_wire.encode_frame(json.dumps(_answer(output, reference)).encode(), [routes])
        if form == "cut routes":
            frame = frame[:-LAYERS * TOP_K]
        response = web.StreamResponse(headers={"Content-Type": route_wire.CONTENT_TYPE})
        if form != "chunked frame":
            response.content_length = len(frame)
        await response.prepare(request)
        for chunk in (frame[:len(frame) // 2], frame[len(frame) // 2:]):
            await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return TestServer(app, host="127.0.0.1")


def _loop(url, session):
    """The rollout loop with only what `_post` uses (TRL's loop needs a dataset, tokenizer and queues to build)."""
    loop = RoutedRolloutLoop.__new__(RoutedRolloutLoop)
    loop.vllm_server_url, loop.session, loop._counters = url, session, collections.Counter()
    return loop


def _run_conversation(form):
    """Each turn of `_conversation()` posted through `RoutedRolloutLoop._post` as TRL's rollout loop posts it, in one
    conversation's context. Returns (TRL's parsed answers, the turns kept, the request headers the server saw, the
    loop's retry counters)."""
    turns, headers_seen = _conversation(), []

    async def run():
        server = _server(turns, form, headers_seen)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                loop = _loop(f"http://127.0.0.1:{server.port}", session)
                token = _TURNS.set([])
                try:
                    answers = [await loop._post("/v1/completions", {"model": "m", "prompt": prompt}, timeout=30)
                               for prompt, _, _ in turns]
                    return answers, _TURNS.get(), loop._counters
                finally:
                    _TURNS.reset(token)
        finally:
            await server.close()

    answers, kept, counters = asyncio.run(run())
    return turns, answers, kept, headers_seen, counters


def test_the_rollout_loop_keeps_the_same_routes_from_a_frame_and_from_json():
    kept_by_form = {}
    for form in ("frame", "chunked frame", "json"):
        turns, answers, kept, headers_seen, _ = _run_conversation(form)
        assert headers_seen == ["1", "1"]  # every /v1/completions call asks for the frame
        for (prompt, output, routes), answer, (kept_prompt, kept_output, kept_routes) in zip(turns, answers, kept):
            choice = answer["choices"][0]  # what TRL's rollout loop reads from the answer
            assert choice["token_ids"] == output and choice["logprobs"]["token_logprobs"] == [-0.5] * len(output)
            assert kept_prompt == prompt and kept_output == output
            assert kept_routes.dtype == routes.dtype and np.array_equal(kept_routes, routes)
        kept_by_form[form] = kept
    for form in ("frame", "chunked frame"):
        for (_, _, framed), (_, _, from_json) in zip(kept_by_form[form], kept_by_form["json"]):
            assert framed.shape == from_json.shape and np.array_equal(framed, from_json)
    assert kept_by_form["frame"][1][2].base is not None  # a view of the received bytes, not a copy
    sequence = turns[1][0] + turns[1][1]
    assert np.array_equal(stitch_turn_routes(sequence, kept_by_form["frame"]),
                          stitch_turn_routes(sequence, kept_by_form["json"]))


@pytest.mark.parametrize("form,message", [("missing array", "names routes #1 for a choice but holds 1"),
                                          ("cut routes", "route frame: safetensors cannot read it")])
def test_a_frame_without_the_routes_it_names_is_refused(form, message):
    with pytest.raises(route_wire.RouteFrameError, match=message):
        _run_conversation(form)
