"""R3's routes as raw bytes from `trl-gspo vllm-serve` (trl_gspo/sampling/route_wire.py): the frame (a safetensors
file) holds every array exactly, rows shared with the array before are sent once, a frame that is not one is refused
with a `RouteFrameError` (also any mutation of a valid one that Hypothesis draws: its bytes flipped, overwritten, cut,
inserted or deleted, its header's length, numbers or fields edited, its tensors changed and saved again), and the
server middleware frames only the answers of requests that ask, leaving every other answer (stock TRL's client) as
vLLM wrote it."""

import asyncio
import json
import re
import time

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

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


# The frame the mutations start from: every array of `_arrays`, each choice naming its own.
_ANSWER = {"choices": [{"token_ids": [i], "routed_experts": f"#{i}"} for i in range(len(_arrays()))]}
_FRAME = route_wire.encode_frame(json.dumps(_ANSWER).encode(), _arrays())
_HEADER_END = 8 + int.from_bytes(_FRAME[:8], "little")

# Hypothesis draws each edit as a tuple, `(kind, ...)`: a failing frame is shown as the edits that made it.
_PICK = st.integers(0, 2**16)  # an index, taken modulo what there is to pick from
_AT = st.tuples(st.booleans(), _PICK)  # a byte: in the header (where its structure is), or anywhere
_TEXT = st.text("#0123456789ab\"\\{} ", max_size=4)  # a few characters, no Unicode tables to build
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=6)
_DTYPE_NAMES = ["BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64", "I64", "F64", "F8_E4M3",
                "X9"]  # safetensors' names, and one it lacks
_DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.float16, np.uint32, np.int32, np.float32, np.uint64,
           np.int64, np.float64]
_TENSORS = sorted(safetensors.numpy.load(_FRAME))  # answer, routes.0 .. routes.8, shared
_TENSOR = st.sampled_from(_TENSORS)
_NAMES = [*_TENSORS, "routes.9", "routes.-1", "routes.01", "__metadata__", "x"]
_BYTE_EDITS = st.one_of(  # the bytes as they are: bit flips, bytes overwritten, cut, inserted or deleted
    st.tuples(st.just("flip"), _AT, st.integers(0, 7)),
    st.tuples(st.just("byte"), _AT, st.integers(0, 255)),
    st.tuples(st.just("cut"), _PICK),
    st.tuples(st.just("insert"), _AT, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), _AT, st.integers(1, 8)),
    # the header's length field off by a little, or any 64-bit value
    st.tuples(st.just("length by"), st.integers(-16, 16)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1)),
    # one of the header's numbers (a shape, an offset) replaced
    st.tuples(st.just("number"), _PICK, st.integers(-9, 10**20)),
)
_HEADER_EDITS = st.one_of(  # a field of the header's JSON, which is then written back well-formed with its length
    st.tuples(st.just("dtype"), _TENSOR, st.sampled_from(_DTYPE_NAMES)),
    st.tuples(st.just("shape"), _TENSOR, st.lists(st.integers(0, 9) | st.integers(-1, 2**40), max_size=4)),
    st.tuples(st.just("data_offsets"), _TENSOR, st.lists(st.integers(0, len(_FRAME)) | st.integers(-1, 2**64),
                                                         max_size=3)),
    st.tuples(st.just("rename"), _TENSOR, st.sampled_from(_NAMES)),
    st.tuples(st.just("drop entry"), _TENSOR),
    st.tuples(st.just("metadata"), st.dictionaries(_TEXT, _TEXT | st.integers(), max_size=2)),
)
_TENSOR_EDITS = st.one_of(  # a tensor changed and the frame saved again: only the route frame's own checks stand
    st.tuples(st.just("value"), _TENSOR, _PICK, st.sampled_from(["min", "max", 0, 1]) | st.integers(-2**63, 2**64)),
    st.tuples(st.just("shared count"), _PICK, st.integers(-2, 12)),  # rows an array takes from the one before
    st.tuples(st.just("astype"), _TENSOR, st.sampled_from(_DTYPES)),
    st.tuples(st.just("reshape"), _TENSOR, st.sampled_from(["flat", "leading axis", "2-D"])),
    st.tuples(st.just("rows"), _TENSOR, _PICK),
    st.tuples(st.just("drop tensor"), _TENSOR),
    st.tuples(st.just("add tensor"), st.sampled_from(_NAMES[:-2]), st.integers(1, 3)),
    # another answer: a choice's reference to any array (or anything), choices of any JSON, any JSON, not JSON
    st.tuples(st.just("reference"), _PICK, st.integers(-1, 12).map(lambda i: f"#{i}") | _TEXT | _JSON),
    st.tuples(st.just("choices"), _JSON),
    st.tuples(st.just("answer"), _JSON),
    st.tuples(st.just("answer bytes"), st.binary(max_size=16)),
)
_EDITS = st.lists(_BYTE_EDITS | _HEADER_EDITS | _TENSOR_EDITS, min_size=1, max_size=3)
_EXAMPLES = 200  # mutated frames a run draws: about a second on two busy cores


def _at(data, at) -> int:
    """The byte `at` picks: in the header or anywhere."""
    in_header, pick = at
    return pick % max(min(_HEADER_END, len(data)) if in_header else len(data), 1)


def _edit_bytes(data: bytearray, kind, *args) -> None:
    """`_BYTE_EDITS`' edit of `data`, in place."""
    if not data:
        data += args[-1] if kind == "insert" else b""
    elif kind == "flip":
        data[_at(data, args[0])] ^= 1 << args[1]
    elif kind == "byte":
        data[_at(data, args[0])] = args[1]
    elif kind == "cut":
        del data[args[0] % len(data):]
    elif kind == "insert":
        at = _at(data, args[0])
        data[at:at] = args[1]
    elif kind == "delete":
        at = _at(data, args[0])
        del data[at:at + args[1]]
    elif kind.startswith("length") and len(data) >= 8:
        length = args[0] if kind == "length" else max(int.from_bytes(data[:8], "little") + args[0], 0)
        data[:8] = length.to_bytes(8, "little")
    elif kind == "number":
        numbers = list(re.finditer(rb"\d+", bytes(data[8:_HEADER_END])))
        if numbers:
            number = numbers[args[0] % len(numbers)]
            data[8 + number.start():8 + number.end()] = str(args[1]).encode()


def _edit_header(data: bytearray, kind, *args) -> None:
    """`_HEADER_EDITS`' edit of `data`, in place."""
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    try:
        header = json.loads(bytes(data[8:8 + length]))
    except ValueError:
        return  # an edit before broke the header
    if not isinstance(header, dict):
        return
    name = "__metadata__" if kind == "metadata" else args[0]
    if name not in header and kind != "metadata":
        return  # an edit before renamed or dropped it
    if kind in ("dtype", "shape", "data_offsets") and isinstance(header[name], dict):
        header[name][kind] = args[1]
    elif kind == "rename":
        header[args[1]] = header.pop(name)
    elif kind == "drop entry":
        del header[name]
    elif kind == "metadata":
        header[name] = args[0]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data[:] = len(text).to_bytes(8, "little") + text + data[8 + length:]


def _edit_tensors(data: bytearray, kind, *args) -> None:
    """`_TENSOR_EDITS`' edit of `data`, in place."""
    try:
        tensors = safetensors.numpy.load(bytes(data))
    except (safetensors.SafetensorError, KeyError, ValueError):
        return  # an edit before broke the container
    name = args[0] if kind in ("value", "astype", "reshape", "rows", "drop tensor") else "answer"
    tensor = tensors.get(name, np.zeros(1, np.uint8))
    if kind == "value" and tensor.size and tensor.dtype.kind in "iu":
        low, high = int(np.iinfo(tensor.dtype).min), int(np.iinfo(tensor.dtype).max)
        value = {"min": low, "max": high}.get(args[2], args[2])
        flat = tensor.reshape(-1).copy()
        flat[args[1] % flat.size] = low + (value - low) % (high - low + 1)  # wrapped into the dtype's range
        tensors[name] = flat.reshape(tensor.shape)
    elif kind == "shared count" and "shared" in tensors and tensors["shared"].size:
        shared = tensors["shared"].copy()
        shared[args[0] % shared.size] = args[1]
        tensors["shared"] = shared
    elif kind == "astype":
        with np.errstate(over="ignore", invalid="ignore"):  # values the new dtype cannot hold: whatever numpy makes
            tensors[name] = tensor.astype(args[1])
    elif kind == "reshape":
        tensors[name] = (tensor.reshape(-1) if args[1] == "flat" else tensor[None] if args[1] == "leading axis" or
                         not tensor.ndim else tensor.reshape(len(tensor), int(np.prod(tensor.shape[1:]))))
    elif kind == "rows" and tensor.ndim:
        tensors[name] = tensor[:args[1] % max(len(tensor), 1)]
    elif kind == "drop tensor":
        tensors.pop(name, None)
    elif kind == "add tensor":
        tensors[args[0]] = np.full((args[1], 1, 1), 255, np.uint8)
    elif kind in ("reference", "choices", "answer", "answer bytes"):
        answer = json.loads(json.dumps(_ANSWER))
        if kind == "reference":
            answer["choices"][args[0] % len(answer["choices"])]["routed_experts"] = args[1]
        elif kind == "choices":
            answer["choices"] = args[0]
        elif kind == "answer":
            answer = args[0]
        raw = args[0] if kind == "answer bytes" else json.dumps(answer).encode()
        tensors["answer"] = np.frombuffer(raw, np.uint8)
    data[:] = safetensors.numpy.save(tensors)


_EDITORS = {**dict.fromkeys(["flip", "byte", "cut", "insert", "delete", "length by", "length", "number"], _edit_bytes),
            **dict.fromkeys(["dtype", "shape", "data_offsets", "rename", "drop entry", "metadata"], _edit_header),
            **dict.fromkeys(["value", "shared count", "astype", "reshape", "rows", "drop tensor", "add tensor",
                             "reference", "choices", "answer", "answer bytes"], _edit_tensors)}


def _mutated(edits) -> bytes:
    """The frame after `edits`, one after the other."""
    data = bytearray(_FRAME)
    for kind, *args in edits:
        _EDITORS[kind](data, kind, *args)
    return bytes(data)


def test_a_mutated_frame_is_refused_with_a_route_frame_error_or_read_as_valid_routes():
    """A valid frame after one to three random edits (`_EDITS`: of its bytes, its header's fields, or its tensors,
    saved again by safetensors), drawn by Hypothesis, which shrinks a failing one: each is refused with a
    `RouteFrameError`, or read as routes R3 can use (integer indices `[rows, layers, top_k]`, none negative, the last
    row `no_route`, every reference resolved); no other exception, and no mutation takes long (a hang would). Both
    outcomes are drawn often. A reference is resolved as the trainer's `FramedRoute.array` does (`Frame.array`)."""
    outcomes, slowest = {"refused": 0, "read": 0}, [0.0]

    @settings(max_examples=_EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
    @given(_EDITS)
    @example([("metadata", {"a": "b"})])  # still a valid frame
    @example([("astype", "routes.7", np.float32)])  # shared with no other array
    @example([("value", "routes.8", 0, 5)])  # array 8 is empty: its one row is the no_route row
    @example([("value", "routes.7", 3, -3)])  # int32: a negative expert
    @example([("shared count", 0, 1)])  # the first array has none before it
    @example([("shared count", 3, 12)])  # more rows than the array before holds
    @example([("reference", 0, "#9")])  # 9 arrays: #0 .. #8
    def mutated(edits):
        frame = _mutated(edits)
        start = time.perf_counter()
        try:
            parsed = route_wire.Frame.parse(frame)
        except route_wire.RouteFrameError as error:
            assert str(error).startswith("route frame: ")
            outcomes["refused"] += 1
            return
        finally:
            slowest[0] = max(slowest[0], time.perf_counter() - start)
        outcomes["read"] += 1
        for i, entry in enumerate(parsed.index):
            routes = parsed.rows(i, 0, entry["shape"][0])
            assert np.issubdtype(routes.dtype, np.integer) and list(routes.shape) == entry["shape"]
            assert routes.ndim == 3 and 0 not in routes.shape and routes.min() >= 0
            assert (routes[-1] == np.iinfo(routes.dtype).max).all()
        for choice in parsed.answer["choices"]:
            index = route_wire.reference_index(choice.get("routed_experts"))
            if index is not None:
                parsed.array(index)  # the routes a choice names, as the trainer reads them

    mutated()
    total = outcomes["refused"] + outcomes["read"]
    assert outcomes["refused"] > total // 3 and outcomes["read"] > total // 50, outcomes  # both outcomes exercised
    assert slowest[0] < 1.0, slowest


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
