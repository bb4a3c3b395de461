"""R3's routes from `trl-gspo vllm-serve` to the trainer as raw bytes: one framed answer per `/v1/completions` call.

vLLM's server writes each completion's `routed_experts` into its JSON answer as base64 of a `.npy` file: at the
flagship's size (512 completions of ~4.3k tokens, 48 layers x top-8) 1.1 GB of text for 0.85 GB of uint8, a base64
decode per choice and a JSON parse of all of it. Here the server's answer keeps TRL's JSON as it is, minus the routes
(each choice's `routed_experts` becomes a short reference, `"#<i>"`), followed by the routes as raw bytes:

    b"TRLGSPO1" | u64 length | the JSON answer | u64 length | index (JSON) | the route bytes

The index lists one entry per array in choice order: dtype, shape `[rows, layers, top_k]` and `shared`, the number of
leading rows equal to the previous array's (the server compares each array with the one before; the `n` completions
of a prompt share its prompt's rows, which are then sent once). An array's bytes are its rows after `shared`.

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


def shared_rows(previous: np.ndarray | None, current: np.ndarray) -> int:
    """How many leading rows `current` shares with `previous` (0 when their dtype or row shape differ)."""
    if previous is None or previous.dtype != current.dtype or previous.shape[1:] != current.shape[1:]:
        return 0
    rows = min(len(previous), len(current))
    differs = (previous[:rows].reshape(rows, -1) != current[:rows].reshape(rows, -1)).any(1)
    return int(differs.argmax()) if differs.any() else rows


def encode_frame(answer_json: bytes, arrays: list[np.ndarray]) -> list[bytes]:
    """The frame for a JSON answer and its choices' route arrays (in choice order), as chunks to send in turn."""
    index, chunks, offset, previous = [], [], 0, None
    for array in arrays:
        array = np.ascontiguousarray(array)
        shared = shared_rows(previous, array)
        own = array[shared:].tobytes()
        index.append({"dtype": array.dtype.str, "shape": list(array.shape), "shared": shared, "offset": offset})
        chunks.append(own)
        offset += len(own)
        previous = array
    index_json = json.dumps(index).encode()
    head = MAGIC + _LENGTH.pack(len(answer_json)) + answer_json + _LENGTH.pack(len(index_json)) + index_json
    return [head, b"".join(chunks)]


class Frame:
    """A received frame: `answer` (TRL's JSON answer, each choice's `routed_experts` a `"#<i>"` reference) and the
    route arrays, read straight from the frame's bytes (`array(i)`: no copy unless rows are shared)."""

    def __init__(self, content: bytes):
        view = memoryview(content)
        if bytes(view[:len(MAGIC)]) != MAGIC:
            raise ValueError("not a trl-gspo route frame (the server answered something else)")
        position = len(MAGIC)
        (length,) = _LENGTH.unpack_from(view, position)
        self.answer = json.loads(bytes(view[position + 8:position + 8 + length]))
        position += 8 + length
        (length,) = _LENGTH.unpack_from(view, position)
        self.index = json.loads(bytes(view[position + 8:position + 8 + length]))
        self._routes = view[position + 8 + length:]

    def own_rows(self, i: int) -> np.ndarray:
        """Array `i`'s rows after its shared ones, a view of the frame's bytes."""
        entry = self.index[i]
        rows, *row_shape = entry["shape"]
        dtype = np.dtype(entry["dtype"])
        count = (rows - entry["shared"]) * int(np.prod(row_shape)) * dtype.itemsize
        data = self._routes[entry["offset"]:entry["offset"] + count]
        return np.frombuffer(data, dtype=dtype).reshape(rows - entry["shared"], *row_shape)

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
        return self.rows(i, 0, self.index[i]["shape"][0])


def reference_index(reference) -> int | None:
    """The array index of a choice's `routed_experts` reference `"#<i>"`, or None for anything else."""
    if isinstance(reference, str) and reference.startswith("#") and reference[1:].isdigit():
        return int(reference[1:])
    return None


def frame_routes(response) -> Frame | None:
    """The frame of a `requests` response from `trl-gspo vllm-serve`, or None for a JSON answer."""
    if not response.headers.get("content-type", "").startswith(CONTENT_TYPE):
        return None
    return Frame(response.content)


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
