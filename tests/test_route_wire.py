"""R3's routes as raw bytes from `trl-gspo vllm-serve` (trl_gspo/sampling/route_wire.py): the frame (a safetensors
file) holds every array exactly, rows shared with the array before are sent once, a frame that is not one is refused
with a `RouteFrameError` (also under random mutations), and the server middleware frames only the answers of requests
that ask, leaving every other answer (stock TRL's client) as vLLM wrote it."""

import asyncio
import json
import time

import numpy as np
import pytest
import safetensors.numpy

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
    frame = route_wire.Frame.parse(route_wire.encode_frame(json.dumps(answer).encode(), arrays))
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
    assert frame.own_rows(0).flags.writeable  # R3 uses the received rows in place
    assert frame.rows(1, 5, 8).base is not None  # a view of array 1's own rows, no copy
    # the routes on the wire: each array's rows after its shared ones and its no_route row, nothing else
    row_bytes = [int(np.prod(a.shape[1:])) * a.itemsize for a in arrays]
    routes_bytes = sum(a[s:].nbytes + row for a, s, row in zip(arrays, shared, row_bytes))
    assert sum(frame.own_rows(i).nbytes for i in range(len(arrays))) == routes_bytes
    assert routes_bytes < sum(a.nbytes for a in arrays) + sum(row_bytes)


def test_a_part_of_a_frame_is_a_frame_of_its_own():
    """What the main process sends a rank: arrays first..last, the first's shared rows resolved, in one buffer."""
    arrays = _arrays()
    frame = route_wire.Frame.parse(route_wire.encode_frame(b'{"choices": []}', arrays))
    for first, last in [(1, 3), (2, 2), (0, len(arrays) - 1), (5, 6)]:
        index, data = frame.part(first, last)
        part = route_wire.Frame.from_buffer(index, bytearray(data.tobytes()))
        assert index[0]["shared"] == 0
        for j, i in enumerate(range(first, last + 1)):
            assert np.array_equal(part.array(j), arrays[i])
        assert data.nbytes <= sum(arrays[i].nbytes + int(np.prod(arrays[i].shape[1:])) * arrays[i].itemsize
                                  for i in range(first, last + 1))


def _tensors(arrays=None, answer=b'{"choices": [{"routed_experts": "#0"}]}'):
    """A valid frame's tensors (safetensors' own reading), to break one thing at a time."""
    arrays = [np.zeros((3, 2, 2), np.uint8), np.ones((4, 2, 2), np.int32)] if arrays is None else arrays
    return safetensors.numpy.load(route_wire.encode_frame(answer, arrays))


def _with(**changes):
    tensors = _tensors()
    for name, value in changes.items():
        name = name.replace("_", ".")  # routes_0 -> routes.0
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return safetensors.numpy.save(tensors)


def _oversized_header():
    frame = route_wire.encode_frame(b"{}", [np.zeros((1, 1, 1), np.uint8)])
    return (10**9).to_bytes(8, "little") + frame[8:]


def _last_row_routed():
    routes = _tensors()["routes.1"].copy()
    routes[-1, 0, 0] = 5
    return _with(routes_1=routes)


def _negative_expert():
    routes = _tensors()["routes.1"].copy()
    routes[0, 1, 1] = -3
    return _with(routes_1=routes)


@pytest.mark.parametrize("frame,problem", [
    (b'{"choices": []}', "safetensors cannot read it"),
    (route_wire.encode_frame(b"{}", [np.zeros((2, 1, 1), np.uint8)])[:-3], "safetensors cannot read it"),
    (_oversized_header(), "safetensors cannot read it.*header too large"),
    (_with(routes_1=np.ones((4, 2, 2), np.float32)), "routes.1 has dtype float32"),
    (_with(routes_1=np.full((4, 4), 255, np.uint8)), r"routes.1 has shape \[4, 4\]"),
    (_with(routes_1=np.zeros((0, 2, 2), np.int32)), r"routes.1 has shape \[0, 2, 2\]"),
    (_with(routes_1=None), r"missing tensors \['routes.1'\], extra tensors \[\]"),
    (_with(routes_7=np.zeros((1, 1, 1), np.uint8)), r"missing tensors \[\], extra tensors \['routes.7'\]"),
    (_with(shared=None), "no 1-D int64 tensor `shared`"),
    (_with(answer=np.frombuffer(b"{not json", np.uint8)), "its answer is not JSON"),
    (_with(answer=np.frombuffer(b'{"choices": 3}', np.uint8)), "not a JSON object with a list of choices"),
    (_with(answer=np.frombuffer(b'[]', np.uint8)), "not a JSON object with a list of choices"),
    (_with(answer=np.frombuffer(b'{"choices": [{"routed_experts": "#2"}]}', np.uint8)),
     "names routes #2 for a choice but holds 2 route array"),
    (_last_row_routed(), "routes.1's last row is not no_route"),
    (_negative_expert(), "routes.1 holds expert indices out of range: -3"),
    (_with(shared=np.array([1, 0])), "routes.0 claims 1 rows shared with an array before it, which it lacks"),
    (_with(shared=np.array([0, -1])), "routes.1 claims a negative count of shared rows, -1"),
    (_with(shared=np.array([0, 2])), "routes.1 claims 2 rows shared with the array before it, which holds 3 rows of"
                                     r" \[2, 2\] uint8 \(this one: \[2, 2\] int32\)"),
], ids=["json answer", "truncated", "oversized header", "wrong dtype", "wrong ndim", "no rows", "missing tensor",
        "extra tensor", "no shared", "answer not json", "choices not a list", "answer not an object",
        "reference out of range", "last row routed", "negative expert", "first shares", "negative shared",
        "shares what is not there"])
def test_a_frame_that_is_not_one_is_refused_naming_what_is_wrong(frame, problem):
    with pytest.raises(route_wire.RouteFrameError, match="^route frame: .*" + problem):
        route_wire.Frame.parse(frame)


def _mutate(rng, frame: bytes, header_end: int) -> bytes:
    """`frame` changed at random: bit flips, bytes overwritten, cut, inserted or deleted, in its header or anywhere,
    its header's length field or one of the header's numbers (a shape, an offset) edited."""
    data = bytearray(frame)
    kind = rng.integers(8)
    where = int(rng.integers(header_end)) if rng.random() < 0.6 else int(rng.integers(len(data)))
    if kind == 0:
        data[where] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        data[where] = int(rng.integers(256))
    elif kind == 2:
        del data[int(rng.integers(len(data))):]
    elif kind == 3:
        data[where:where] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
    elif kind == 4:
        del data[where:where + int(rng.integers(1, 9))]
    elif kind == 5:  # the header's length: off by a little, or any 64-bit value
        length = int.from_bytes(data[:8], "little")
        length = length + int(rng.integers(-16, 17)) if rng.random() < 0.5 else int(rng.integers(2**63))
        data[:8] = max(length, 0).to_bytes(8, "little")
    elif kind == 6:  # a number in the header's JSON (a shape or a data offset) replaced
        digits = [i for i in range(8, header_end) if chr(data[i]).isdigit()]
        i = digits[int(rng.integers(len(digits)))]
        data[i:i + 1] = str(int(rng.integers(0, 10 ** int(rng.integers(1, 6))))).encode()
    else:  # several flips at once
        for _ in range(int(rng.integers(2, 6))):
            data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    return bytes(data)


def test_a_mutated_frame_is_refused_with_a_route_frame_error_or_read_as_valid_routes():
    """1,200 seeded mutations of a valid frame: each is refused with a `RouteFrameError`, or read as routes R3 can use
    (integer indices `[rows, layers, top_k]`, none negative, the last row `no_route`, every reference resolved);
    no other exception, and no mutation takes long (a hang would)."""
    from trl_gspo.sampling.server import FramedRoute, framed_completions_answer

    arrays = _arrays()
    answer = {"choices": [{"token_ids": [i], "routed_experts": f"#{i}"} for i in range(len(arrays))]}
    frame = route_wire.encode_frame(json.dumps(answer).encode(), arrays)
    header_end = 8 + int.from_bytes(frame[:8], "little")
    rng = np.random.default_rng(20261128)
    outcomes, slowest = {"refused": 0, "read": 0}, 0.0
    for _ in range(1200):
        mutated = _mutate(rng, frame, header_end)
        start = time.perf_counter()
        try:
            parsed = route_wire.Frame.parse(mutated)
        except route_wire.RouteFrameError as error:
            assert str(error).startswith("route frame: ")
            outcomes["refused"] += 1
            continue
        finally:
            slowest = max(slowest, time.perf_counter() - start)
        outcomes["read"] += 1
        for i, entry in enumerate(parsed.index):
            routes = parsed.rows(i, 0, entry["shape"][0])
            assert np.issubdtype(routes.dtype, np.integer) and list(routes.shape) == entry["shape"]
            assert routes.ndim == 3 and 0 not in routes.shape and routes.min() >= 0
            assert (routes[-1] == np.iinfo(routes.dtype).max).all()
        for choice in framed_completions_answer(parsed)["choices"]:
            if isinstance(choice.get("routed_experts"), FramedRoute):
                choice["routed_experts"].array()
    assert outcomes["refused"] > 600 and outcomes["read"] > 20, outcomes  # both outcomes exercised
    assert slowest < 1.0, slowest


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


def test_a_streamed_answer_is_read_in_one_call_into_writable_arrays():
    """The trainer opens `/v1/completions` with `stream=True` and reads the frame in one call of the answer's length
    (route_wire.frame_routes); safetensors reads it into writable arrays, used in place."""
    import io
    from types import SimpleNamespace

    arrays = _arrays()
    body = route_wire.encode_frame(b'{"choices": []}', arrays)
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

    body = route_wire.encode_frame(b"{}", _arrays())
    response = SimpleNamespace(headers={"content-type": route_wire.CONTENT_TYPE, "content-length": str(len(body))},
                               raw=io.BytesIO(body[:-10]), _content_consumed=False)
    with pytest.raises(requests.exceptions.ChunkedEncodingError, match="ended after"):
        route_wire.frame_routes(response)
