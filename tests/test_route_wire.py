"""R3's routes as raw bytes from `trl-gspo vllm-serve` (trl_gspo/sampling/route_wire.py): the frame holds every
array exactly, rows shared with the array before are sent once, and the server middleware frames only the answers of
requests that ask, leaving every other answer (stock TRL's client) as vLLM wrote it."""

import asyncio
import json

import numpy as np
import pytest

from trl_gspo.sampling import route_wire


def _arrays(seed=0):
    """Route arrays as vLLM's n samples of two prompts give them: each prompt's rows shared by its completions, one
    completion sharing more than its prompt (same first token and routes), one of another dtype, one empty."""
    rng = np.random.default_rng(seed)
    arrays = []
    for prompt_len in (5, 3):
        prompt = rng.integers(0, 128, (prompt_len, 4, 2), dtype=np.uint8)
        for completion_len in (6, 1, 4):
            arrays.append(np.concatenate([prompt, rng.integers(0, 128, (completion_len, 4, 2), dtype=np.uint8)]))
    arrays.insert(2, np.concatenate([arrays[1], rng.integers(0, 128, (2, 4, 2), dtype=np.uint8)]))
    arrays.append(arrays[-1].astype(np.int32))  # same values, another dtype: nothing shared
    arrays.append(np.zeros((0, 4, 2), dtype=np.uint8))
    return arrays


def test_a_frame_carries_the_answer_and_every_array_exactly():
    arrays = _arrays()
    answer = {"choices": [{"token_ids": [i], "routed_experts": f"#{i}"} for i in range(len(arrays))]}
    frame = route_wire.Frame.parse(b"".join(route_wire.encode_frame(json.dumps(answer).encode(), arrays)))
    assert frame.answer == answer
    shared = [entry["shared"] for entry in frame.index]
    assert shared == [0, 5, 6, 5, 0, 3, 3, 0, 0]  # prompt rows once per prompt; 6: all of the one before
    for i, array in enumerate(arrays):
        got = frame.array(i)
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
        # stored with one more row, no_route (the dtype's maximum): R3's row for the last token, used in place
        padded = np.concatenate([array, np.full((1, *array.shape[1:]), np.iinfo(array.dtype).max, array.dtype)])
        assert np.array_equal(frame.rows(i, 0, len(padded)), padded)
        assert np.array_equal(frame.rows(i, 2, 6), padded[2:6])
    assert frame.own_rows(0).base is not None and frame.own_rows(0).flags.writeable  # a view of the bytes, no copy
    # the bytes on the wire: each array's rows after its shared ones and its no_route row, nothing else
    row_bytes = [int(np.prod(a.shape[1:])) * a.itemsize for a in arrays]
    routes_bytes = sum(a[s:].nbytes + row for a, s, row in zip(arrays, shared, row_bytes))
    assert len(frame._routes) == routes_bytes < sum(a.nbytes for a in arrays) + sum(row_bytes)


def test_a_part_of_a_frame_is_a_frame_of_its_own():
    """What the main process sends a rank: arrays first..last, the first's shared rows resolved, in one buffer."""
    arrays = _arrays()
    frame = route_wire.Frame.parse(b"".join(route_wire.encode_frame(b"{}", arrays)))
    for first, last in [(1, 3), (2, 2), (0, len(arrays) - 1), (5, 6)]:
        index, data = frame.part(first, last)
        part = route_wire.Frame(index, bytearray(data.tobytes()))
        assert index[0]["shared"] == 0
        for j, i in enumerate(range(first, last + 1)):
            assert np.array_equal(part.array(j), arrays[i])
        assert data.nbytes <= sum(arrays[i].nbytes + int(np.prod(arrays[i].shape[1:])) * arrays[i].itemsize
                                  for i in range(first, last + 1))


def test_a_frame_is_refused_when_it_is_not_one():
    with pytest.raises(ValueError, match="not a trl-gspo route frame"):
        route_wire.Frame.parse(b'{"choices": []}')
    frame = route_wire.Frame.parse(b"".join(route_wire.encode_frame(b"{}", [np.zeros((2, 1, 1), np.uint8)])))
    frame.index[0]["shared"] = 1  # a first array cannot share rows with one before it
    with pytest.raises(ValueError, match="first array claims rows shared"):
        frame.array(0)


def test_shared_rows_is_the_longest_common_prefix():
    a = np.arange(24, dtype=np.uint8).reshape(6, 2, 2)
    b = a.copy()
    b[4, 1, 0] += 1
    assert route_wire.shared_rows(None, a) == 0
    assert route_wire.shared_rows(a, b) == 4
    assert [route_wire.shared_rows(a, b, block) for block in (1, 2, 3, 5)] == [4, 4, 4, 4]  # blocks of rows
    assert route_wire.shared_rows(a, a[:3]) == 3
    assert route_wire.shared_rows(a, a.astype(np.int16)) == 0
    assert route_wire.shared_rows(a, a.reshape(6, 4, 1)) == 0


def _app(arrays, status=200):
    """A stand-in for vLLM's completion endpoint: encodes each array with vLLM's encoder as this middleware wraps it
    (route_wire._keep_routes around a base64 encoder), answers JSON with the results."""
    encode = route_wire._keep_routes(lambda array: "base64:" + array.tobytes().hex())

    async def app(scope, receive, send):
        body = json.dumps({"choices": [{"routed_experts": encode(a)} for a in arrays]}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    return app


def _call(middleware, path, headers):
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": headers}
    asyncio.run(middleware(scope, None, send))
    headers = dict(sent[0]["headers"])
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_the_server_middleware_frames_only_the_answers_that_ask(monkeypatch):
    monkeypatch.setattr(route_wire, "install_encoder", lambda: True)
    arrays = _arrays()
    middleware = route_wire.BinaryRoutes(_app(arrays))
    asks = [(route_wire.HEADER.lower().encode(), b"1")]
    status, headers, body = _call(middleware, "/v1/completions", asks)
    assert status == 200 and headers[b"content-type"] == route_wire.CONTENT_TYPE.encode()
    assert int(headers[b"content-length"]) == len(body)
    frame = route_wire.Frame.parse(body)
    references = [choice["routed_experts"] for choice in frame.answer["choices"]]
    assert references == [f"#{i}" for i in range(len(arrays))]
    assert all(np.array_equal(frame.array(route_wire.reference_index(r)), a) for r, a in zip(references, arrays))
    # stock TRL's client (no header), another endpoint, an error answer: vLLM's JSON, base64 routes, untouched
    for path, headers_in, app_status in [("/v1/completions", [], 200), ("/v1/chat/completions", asks, 200),
                                         ("/v1/completions", asks, 400)]:
        middleware = route_wire.BinaryRoutes(_app(arrays, app_status))
        status, headers, body = _call(middleware, path, headers_in)
        assert status == app_status and headers[b"content-type"] == b"application/json"
        assert json.loads(body)["choices"][0]["routed_experts"].startswith("base64:")


def test_a_vllm_without_the_encoder_leaves_answers_as_json(monkeypatch):
    """A vLLM whose completion endpoint has no `numpy2base64` to replace: the middleware passes everything through
    (the trainer then reads the JSON and says so once)."""
    monkeypatch.setattr(route_wire, "install_encoder", lambda: False)
    middleware = route_wire.BinaryRoutes(_app(_arrays()))
    status, headers, body = _call(middleware, "/v1/completions", [(route_wire.HEADER.lower().encode(), b"1")])
    assert headers[b"content-type"] == b"application/json"
    assert json.loads(body)["choices"][0]["routed_experts"].startswith("base64:")


def test_the_trainer_announces_a_json_answer_once(tokenizer, caplog):
    """A server that answers JSON with base64 routes (plain `vllm serve --enable-return-routed-experts`, an older
    trl-gspo) still works: the routes are read from the JSON, and a warning says once that it is the slow path."""
    from support.fake_vllm import PROMPTS, fake_server

    from trl_gspo.sampling import routes as vllm_routes
    from trl_gspo.sampling import server as vllm_server

    monkey_state = list(vllm_server._json_fallback_announced)
    vllm_server._json_fallback_announced.clear()
    try:
        for framed in (False, False, True):
            llm, client = fake_server(tokenizer, framed=framed)
            with caplog.at_level("WARNING"), vllm_server.capture_server_choices(client) as choices:
                client.session.post("http://h/v1/completions", json={"prompt": [PROMPTS[0]]})
            assert len(vllm_routes.routes_from_server(choices).completion_routes) == 2
    finally:
        vllm_server._json_fallback_announced[:] = monkey_state
    said = [r.getMessage() for r in caplog.records if "base64 inside its JSON answer" in r.getMessage()]
    assert len(said) == 1 and "trl-gspo vllm-serve" in said[0]


def test_a_streamed_answer_is_read_into_one_writable_buffer():
    """The trainer opens `/v1/completions` with `stream=True` and reads the frame straight into one buffer of the
    answer's length (route_wire.receive_buffer), so the routes are used in place as writable arrays."""
    import io
    from types import SimpleNamespace

    arrays = _arrays()
    body = b"".join(route_wire.encode_frame(b'{"choices": []}', arrays))
    response = SimpleNamespace(headers={"content-type": route_wire.CONTENT_TYPE, "content-length": str(len(body))},
                               raw=io.BytesIO(body), _content_consumed=False)
    frame = route_wire.frame_routes(response)
    assert frame.answer == {"choices": []} and response._content_consumed
    assert all(np.array_equal(frame.array(i), array) for i, array in enumerate(arrays))
    assert frame.own_rows(0).flags.writeable
    json_answer = SimpleNamespace(headers={"content-type": "application/json"})
    assert route_wire.frame_routes(json_answer) is None


def test_a_frame_cut_short_is_a_connection_error():
    requests = pytest.importorskip("requests")  # TRL's client's transport: the trainer reports its errors
    import io
    from types import SimpleNamespace

    body = b"".join(route_wire.encode_frame(b"{}", _arrays()))
    response = SimpleNamespace(headers={"content-type": route_wire.CONTENT_TYPE, "content-length": str(len(body))},
                               raw=io.BytesIO(body[:-10]), _content_consumed=False)
    with pytest.raises(requests.exceptions.ChunkedEncodingError, match="ended after"):
        route_wire.frame_routes(response)
