"""R3's routes from `trl-gspo vllm-serve` to the trainer as raw bytes: one framed answer per `/v1/completions` call.

vLLM's server writes each completion's `routed_experts` into its JSON answer as base64 of a `.npy` file: at the
flagship's size (512 completions of ~4.3k tokens, 48 layers x top-8) 1.1 GB of text for 0.85 GB of uint8, a base64
decode per choice and a JSON parse of all of it. Here the server's answer keeps TRL's JSON as it is, minus the routes
(each choice's `routed_experts` becomes a short reference, `"#<i>"`), followed by the routes as raw bytes:

    b"TRLGSPO1" | u64 length | the JSON answer | u64 length | index (JSON) | the route bytes

vLLM's array for a completion is `[prompt + completion - 1, layers, top_k]` (the last token is never fed forward).
The frame stores it with one more row, `no_route` (the dtype's maximum, `trl_gspo.routing.rollout.no_route`), so
that rows `prompt .. prompt + completion` are exactly the completion's routes as R3 keeps them, and the trainer uses
them in place, without a copy. The index lists one entry per array in choice order: dtype, shape `[rows, layers,
top_k]` (with that row) and `shared`, the number of leading rows equal to the previous array's (the server compares
each array with the one before; the `n` completions of a prompt share its prompt's rows, which are then sent once).
An array's bytes are its rows after `shared`.

Only a request that asks for it gets the frame (header `X-TRL-GSPO-Routes: 1`, which the trainer's client adds);
every other client, stock TRL's included, gets vLLM's JSON answer unchanged. `trl-gspo vllm-serve` loads
`BinaryRoutes` with vLLM's `--middleware` option; it replaces vLLM's base64 encoder in its completion endpoint for
the requests that ask (checked in vLLM 0.29: `vllm.entrypoints.openai.completion.serving.numpy2base64`). A vLLM
without that encoder answers with JSON, and the trainer says so once and reads the JSON (`frame_routes` returns None).
"""

from __future__ import annotations

import contextvars
import json
import struct

import numpy as np

MAGIC = b"TRLGSPO1"
HEADER = "X-TRL-GSPO-Routes"  # request header asking for the frame
CONTENT_TYPE = "application/x-trl-gspo-routes"
_LENGTH = struct.Struct("<Q")

_stored: contextvars.ContextVar[list | None] = contextvars.ContextVar("trl_gspo_routes", default=None)


def shared_rows(previous: np.ndarray | None, current: np.ndarray, block: int = 256) -> int:
    """How many leading rows `current` shares with `previous` (0 when their dtype or row shape differ), compared
    `block` rows at a time so that a difference early on (after a prompt) stops the comparison."""
    if previous is None or previous.dtype != current.dtype or previous.shape[1:] != current.shape[1:]:
        return 0
    rows = min(len(previous), len(current))
    before, after = previous.reshape(len(previous), -1), current.reshape(len(current), -1)
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        differs = (before[start:stop] != after[start:stop]).any(1)
        if differs.any():
            return start + int(differs.argmax())
    return rows


def encode_frame(answer_json: bytes, arrays: list[np.ndarray]) -> list:
    """The frame for a JSON answer and its choices' vLLM route arrays (in choice order), as two chunks to send in
    turn: the head and the route bytes (written once, into one buffer)."""
    index, offset, previous = [], 0, None
    arrays = [np.ascontiguousarray(array) for array in arrays]
    for array in arrays:
        shared = shared_rows(previous, array)
        entry = {"dtype": array.dtype.str, "shape": [len(array) + 1, *array.shape[1:]], "shared": shared,
                 "offset": offset}
        index.append(entry)
        offset += _nbytes(entry, len(array) + 1 - shared)
        previous = array
    routes = bytearray(offset)
    for array, entry in zip(arrays, index):
        rows = entry["shape"][0] - entry["shared"]
        target = np.frombuffer(routes, dtype=array.dtype, count=rows * int(np.prod(array.shape[1:])),
                               offset=entry["offset"]).reshape(rows, *array.shape[1:])
        target[:-1] = array[entry["shared"]:]
        target[-1] = np.iinfo(array.dtype).max  # no_route: the row R3 keeps for the last token
    index_json = json.dumps(index).encode()
    head = MAGIC + _LENGTH.pack(len(answer_json)) + answer_json + _LENGTH.pack(len(index_json)) + index_json
    return [head, routes]


def _nbytes(entry: dict, rows: int) -> int:
    return rows * int(np.prod(entry["shape"][1:])) * np.dtype(entry["dtype"]).itemsize


class Frame:
    """Received routes: `index` (one entry per array, module docstring) and the arrays' bytes, read in place (`rows`:
    a view of the buffer unless the rows span arrays). `answer` is TRL's JSON answer (each choice's
    `routed_experts` a `"#<i>"` reference) for a frame parsed from a response, None for a part handed to a rank.
    Give a writable buffer (a bytearray) so the views are writable torch tensors."""

    def __init__(self, index: list[dict], routes, answer: dict | None = None):
        self.index, self.answer, self._routes = index, answer, memoryview(routes)

    @classmethod
    def parse(cls, content) -> Frame:
        """A whole frame as the server sent it (read-only `bytes` are copied into a bytearray: writable views). A frame
        whose index names more route bytes than follow it is refused here, not when an array is first read."""
        view = memoryview(content if not isinstance(content, bytes) else bytearray(content))
        if bytes(view[:len(MAGIC)]) != MAGIC:
            raise ValueError("not a trl-gspo route frame (the server answered something else)")
        position = len(MAGIC)
        (length,) = _LENGTH.unpack_from(view, position)
        answer = json.loads(bytes(view[position + 8:position + 8 + length]))
        position += 8 + length
        (length,) = _LENGTH.unpack_from(view, position)
        index = json.loads(bytes(view[position + 8:position + 8 + length]))
        routes = view[position + 8 + length:]
        needed = max((entry["offset"] + _nbytes(entry, entry["shape"][0] - entry["shared"]) for entry in index),
                     default=0)
        if needed > len(routes):
            raise ValueError(f"a route frame whose index names {needed} bytes of routes holds {len(routes)}: its "
                             "routes are missing (a frame cut short, or a server that encodes them differently)")
        return cls(index, routes, answer)

    def own_rows(self, i: int) -> np.ndarray:
        """Array `i`'s rows after its shared ones, a view of the frame's bytes."""
        entry = self.index[i]
        rows, *row_shape = entry["shape"]
        data = self._routes[entry["offset"]:entry["offset"] + _nbytes(entry, rows - entry["shared"])]
        return np.frombuffer(data, dtype=np.dtype(entry["dtype"])).reshape(rows - entry["shared"], *row_shape)

    def rows(self, i: int, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` of array `i`, following shared rows back through the arrays before it."""
        parts, end = [], stop
        while end > start:
            shared = self.index[i]["shared"]
            if end > shared:  # the rows from max(start, shared) come from array i's own bytes
                parts.append(self.own_rows(i)[max(start, shared) - shared:end - shared])
                end = max(start, shared)
            if end > start:
                i -= 1  # the rest are shared with the array before
                if i < 0:
                    raise ValueError("a route frame's first array claims rows shared with none before it")
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts[::-1]) if parts else self.own_rows(i)[:0]

    def array(self, i: int) -> np.ndarray:
        """Array `i` as vLLM returned it (without the frame's last `no_route` row)."""
        return self.rows(i, 0, self.index[i]["shape"][0] - 1)

    def part(self, first: int, last: int) -> tuple[list[dict], np.ndarray]:
        """Arrays `first..last` as a frame of their own (index, bytes) for the rank that uses them: the first array's
        shared rows resolved, the others' own bytes as they are (one copy of their share)."""
        head = self.rows(first, 0, self.index[first]["shape"][0])
        start = self.index[first + 1]["offset"] if last > first else 0
        stop = (self.index[last]["offset"] + _nbytes(self.index[last], self.index[last]["shape"][0]
                                                      - self.index[last]["shared"])) if last > first else 0
        data = np.empty(head.nbytes + stop - start, dtype=np.uint8)
        data[:head.nbytes] = head.reshape(-1).view(np.uint8)
        data[head.nbytes:] = np.frombuffer(self._routes[start:stop], dtype=np.uint8)
        index = [{**self.index[first], "shared": 0, "offset": 0}]
        for entry in self.index[first + 1:last + 1]:
            index.append({**entry, "offset": entry["offset"] - start + head.nbytes})
        return index, data


def reference_index(reference) -> int | None:
    """The array index of a choice's `routed_experts` reference `"#<i>"`, or None for anything else."""
    if isinstance(reference, str) and reference.startswith("#") and reference[1:].isdigit():
        return int(reference[1:])
    return None


def receive_buffer(size: int):
    """A writable buffer of `size` bytes for a frame. Linux: anonymous memory mapped with MAP_POPULATE, its pages
    mapped in one call rather than one fault per 4 KiB page on first write, which makes copying a frame into it
    faster than into a fresh bytearray (docs/results.md#r3s-routes-in-server-mode-at-the-flagships-size); elsewhere a
    bytearray."""
    import mmap

    populate = getattr(mmap, "MAP_POPULATE", None)
    if populate is None or size == 0:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)


def frame_routes(response) -> Frame | None:
    """The frame of a `requests` response from `trl-gspo vllm-serve`, or None for a JSON answer. A response opened
    with `stream=True` is read straight into one bytearray of its length (the route bytes are then used in place);
    one already read is copied once into a bytearray."""
    headers = response.headers
    if not headers.get("content-type", "").startswith(CONTENT_TYPE):
        return None
    raw = getattr(response, "raw", None)
    if getattr(response, "_content_consumed", True) or raw is None or headers.get("content-encoding") or \
            "content-length" not in headers:
        return Frame.parse(response.content)
    buffer = receive_buffer(int(headers["content-length"]))
    view, received = memoryview(buffer), 0
    try:
        while received < len(buffer):
            count = raw.readinto(view[received:])
            if not count:
                raise EOFError("the connection closed")
            received += count
    except Exception as error:  # as requests reports a body cut short, for the trainer's server error
        try:
            from requests.exceptions import ChunkedEncodingError as cut_short
        except ImportError:  # no TRL client here either (a unit test): the builtin
            cut_short = ConnectionError
        raise cut_short(f"the route frame ended after {received} of {len(buffer)} bytes ({error})") from error
    response._content_consumed = True
    return Frame.parse(buffer)


# --- server side: loaded into vLLM's API server by `--middleware trl_gspo.sampling.route_wire.BinaryRoutes` ---


_base64 = []  # vLLM's own encoder, once `_keep_routes` wrapped it


def _keep_routes(original):
    """vLLM's base64 encoder for `routed_experts`, keeping the array instead for requests that asked for a frame."""
    _base64[:] = [original]

    def encode(array):
        stored = _stored.get()
        if stored is None:
            return original(array)
        stored.append(array)
        return f"#{len(stored) - 1}"
    encode.trl_gspo_original = original
    return encode


def install_encoder() -> bool:
    """Route vLLM's completion endpoint's base64 encoder through `_keep_routes`; False where this vLLM has none."""
    try:
        from vllm.entrypoints.openai.completion import serving
    except ImportError:
        return False
    original = getattr(serving, "numpy2base64", None)
    if original is None:
        return False
    if not hasattr(original, "trl_gspo_original"):
        serving.numpy2base64 = _keep_routes(original)
    return True


def _with_base64(answer: bytes, arrays: list[np.ndarray]) -> bytes:
    """A JSON answer whose `routed_experts` references are replaced by vLLM's base64 of the arrays they name."""
    body = json.loads(answer)
    for choice in body.get("choices", []) if isinstance(body, dict) else []:
        index = reference_index(choice.get("routed_experts"))
        if index is not None:
            choice["routed_experts"] = _base64[0](arrays[index])
    return json.dumps(body).encode()


class BinaryRoutes:
    """ASGI middleware for vLLM's API server: a `/v1/completions` request with the `X-TRL-GSPO-Routes` header gets
    its answer as a frame (module docstring); every other request passes through untouched."""

    def __init__(self, app):
        self.app = app
        self.installed = install_encoder()

    async def __call__(self, scope, receive, send):
        wants = scope["type"] == "http" and scope.get("path") == "/v1/completions" and self.installed and any(
            name.lower() == HEADER.lower().encode() for name, _ in scope.get("headers", []))
        if not wants:
            await self.app(scope, receive, send)
            return
        arrays: list[np.ndarray] = []
        token = _stored.set(arrays)
        start, body = {}, []

        async def keep(message):
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            answer = b"".join(body)
            if start.get("status") != 200 or not arrays:  # an error, or no routes: vLLM's answer as it is
                if arrays:  # references in an answer that is not framed: back to vLLM's base64
                    answer = _with_base64(answer, arrays)
                    start["headers"] = [(name, str(len(answer)).encode() if name.lower() == b"content-length"
                                         else value) for name, value in start.get("headers", [])]
                await send(start)
                await send({"type": "http.response.body", "body": answer})
                return
            chunks = encode_frame(answer, arrays)
            arrays.clear()
            headers = [(name, value) for name, value in start.get("headers", [])
                       if name.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", CONTENT_TYPE.encode()),
                        (b"content-length", str(sum(map(len, chunks))).encode())]
            await send({**start, "headers": headers})
            for i, chunk in enumerate(chunks):
                await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

        try:
            await self.app(scope, receive, keep)
        finally:
            _stored.reset(token)
