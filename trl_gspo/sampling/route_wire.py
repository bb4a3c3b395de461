"""R3's routes from `trl-gspo vllm-serve` to the trainer as raw bytes: one route frame per `/v1/completions` call.

vLLM's server writes each completion's `routed_experts` into its JSON answer as base64 of a `.npy` file: at the
flagship's size (512 completions of ~4.3k tokens, 48 layers x top-8) 1.1 GB of text for 0.85 GB of uint8, a base64
decode per choice and a JSON parse of all of it. Here the server's answer keeps TRL's JSON as it is, minus the routes
(each choice's `routed_experts` becomes a short reference, `"#<i>"`), and sends it with the routes as raw bytes in
one safetensors file (https://huggingface.co/docs/safetensors), written and read by the safetensors library
(`safetensors.numpy.save` / `load`; its parser checks that the header and the buffers add up):

    answer      uint8 [bytes]                         TRL's JSON answer, routes replaced by references
    shared      int64 [arrays]                        per array, its leading rows equal to the previous array's
    routes.<i>  integer [rows - shared, layers, top_k]  array i's own rows: its rows after `shared`

vLLM's array for a completion is `[prompt + completion - 1, layers, top_k]` (the last token is never fed forward).
The frame stores it with one more row, `no_route` (the dtype's maximum, `trl_gspo.routing.rollout.no_route`), so
that rows `prompt .. prompt + completion` are exactly the completion's routes as R3 keeps them, and the trainer uses
them in place, without a copy. `shared`: the server compares each array with the one before; the `n` completions of
a prompt share its prompt's rows, which are then sent once. `Frame.parse` refuses, with a `RouteFrameError`, a frame
safetensors refuses (cut short, a header too large or inconsistent) and one whose tensors are not the above: missing
or extra tensors, a dtype other than integers, a shape other than 3-D, a `shared` that names rows no array before
holds, a last row other than `no_route`, negative expert indices, an answer that is not JSON or names an array the
frame lacks.

Only a request that asks for it gets the frame (header `X-TRL-GSPO-Routes: 1`, which the trainer's client adds);
every other client, stock TRL's included, gets vLLM's JSON answer unchanged. `trl-gspo vllm-serve` loads
`BinaryRoutes` with vLLM's `--middleware` option; it replaces vLLM's base64 encoder in its completion endpoint for
the requests that ask (checked in vLLM 0.29: `vllm.entrypoints.openai.completion.serving.numpy2base64`). A vLLM
without that encoder answers with JSON, and the trainer says so once and reads the JSON (`frame_routes` returns None).
"""

from __future__ import annotations

import asyncio
import contextvars
import json

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

HEADER = "X-TRL-GSPO-Routes"  # request header asking for the frame
CONTENT_TYPE = "application/x-trl-gspo-routes"

_stored: contextvars.ContextVar[list | None] = contextvars.ContextVar("trl_gspo_routes", default=None)


class RouteFrameError(ValueError):
    """A route frame that cannot be read; the message starts with "route frame:" and says what is wrong."""

    def __init__(self, problem: str):
        super().__init__(f"route frame: {problem}")


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


def encode_frame(answer_json: bytes, arrays: list[np.ndarray]) -> bytes:
    """The frame of a JSON answer and its choices' vLLM route arrays (in choice order)."""
    tensors, shared, previous = {"answer": np.frombuffer(answer_json, dtype=np.uint8)}, [], None
    for i, array in enumerate(arrays):
        shared.append(shared_rows(previous, array))
        own = np.empty((len(array) + 1 - shared[-1], *array.shape[1:]), dtype=array.dtype)
        own[:-1] = array[shared[-1]:]
        own[-1] = np.iinfo(array.dtype).max  # no_route: the row R3 keeps for the last token
        tensors[f"routes.{i}"], previous = own, array
    tensors["shared"] = np.array(shared, dtype=np.int64)
    return safetensors.numpy.save(tensors)


def _load(content) -> dict[str, np.ndarray]:
    """The frame's tensors as safetensors reads them (writable arrays, one copy of the bytes)."""
    try:
        return safetensors.numpy.load(content if isinstance(content, bytes) else bytes(content))
    except (SafetensorError, KeyError, ValueError) as error:  # KeyError: a dtype numpy lacks (bfloat16, float8)
        raise RouteFrameError(f"safetensors cannot read it ({type(error).__name__}: {error}): cut short, corrupt, "
                              "or not a route frame (a server of another trl-gspo version)") from None


def _answer(data: np.ndarray, arrays: int) -> dict:
    """TRL's JSON answer of a frame holding `arrays` route arrays, its references to them checked."""
    try:
        answer = json.loads(data.tobytes())
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, or nested past Python's stack
        raise RouteFrameError(f"its answer is not JSON ({type(error).__name__}: {error})") from None
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not all(isinstance(choice, dict) for choice in choices):
        raise RouteFrameError("its answer is not a JSON object with a list of choices")
    for choice in choices:
        index = reference_index(choice.get("routed_experts"))
        if index is not None and index >= arrays:
            raise RouteFrameError(f"its answer names routes #{index} for a choice but holds {arrays} route array(s) "
                                  "(a server whose route encoder and answer disagree: a `trl-gspo vllm-serve` of "
                                  "another version)")
    return answer


def _check_routes(name: str, own: np.ndarray) -> None:
    """Route array `name`'s own rows as R3 uses them: integer indices `[rows, layers, top_k]`, in range, the last
    row `no_route`."""
    if not np.issubdtype(own.dtype, np.integer):
        raise RouteFrameError(f"{name} has dtype {own.dtype}; expert indices are integers")
    if own.ndim != 3 or 0 in own.shape:
        raise RouteFrameError(f"{name} has shape {list(own.shape)}; expected [rows >= 1, layers >= 1, top_k >= 1]")
    no_route = np.iinfo(own.dtype).max
    if not (own[-1] == no_route).all():
        raise RouteFrameError(f"{name}'s last row is not no_route ({no_route}), the row R3 keeps for the last token")
    if own.dtype.kind == "i" and own.min() < 0:  # unsigned indices are all in range, 0 .. no_route
        raise RouteFrameError(f"{name} holds expert indices out of range: {int(own.min())}")


def _check_shared(name: str, shared: int, own: np.ndarray, before: dict | None) -> None:
    """`shared` leading rows of route array `name` taken from the array `before` it (None: the first)."""
    if shared == 0:
        return
    if shared < 0:
        raise RouteFrameError(f"{name} claims a negative count of shared rows, {shared}")
    if before is None:
        raise RouteFrameError(f"{name} claims {shared} rows shared with an array before it, which it lacks")
    if before["dtype"] != own.dtype.str or before["shape"][1:] != list(own.shape[1:]) or \
            shared > before["shape"][0] - 1:
        raise RouteFrameError(f"{name} claims {shared} rows shared with the array before it, which holds "
                              f"{before['shape'][0] - 1} rows of {before['shape'][1:]} {np.dtype(before['dtype'])} "
                              f"(this one: {list(own.shape[1:])} {own.dtype})")


class Frame:
    """Received routes: `index` (per array: dtype, shape `[rows, layers, top_k]` with its `no_route` row, `shared`)
    and each array's own rows (writable arrays, read in place: `rows` is a view unless the rows span arrays).
    `answer` is TRL's JSON answer (each choice's `routed_experts` a `"#<i>"` reference) for a frame parsed from a
    response, None for a part handed to a rank."""

    def __init__(self, index: list[dict], own: list[np.ndarray], answer: dict | None = None):
        self.index, self.answer, self._own = index, answer, own

    @classmethod
    def parse(cls, content) -> Frame:
        """A whole frame as the server sent it (`bytes`, which safetensors reads; another buffer is copied once),
        checked (module docstring): a frame that is not one raises `RouteFrameError` here, not when it is used."""
        tensors = _load(content)
        for name, dtype in (("answer", np.uint8), ("shared", np.int64)):
            if name not in tensors or tensors[name].dtype != dtype or tensors[name].ndim != 1:
                raise RouteFrameError(f"no 1-D {np.dtype(dtype)} tensor `{name}` (tensors: {sorted(tensors)[:8]})")
        shared = tensors["shared"].tolist()
        expected = {"answer", "shared", *(f"routes.{i}" for i in range(len(shared)))}
        if tensors.keys() != expected:
            missing, extra = sorted(expected - tensors.keys())[:8], sorted(tensors.keys() - expected)[:8]
            raise RouteFrameError(f"`shared` counts {len(shared)} route arrays, routes.0 .. routes.{len(shared) - 1}; "
                                  f"missing tensors {missing}, extra tensors {extra}")
        index, own = [], []
        for i, count in enumerate(shared):
            name, rows = f"routes.{i}", tensors[f"routes.{i}"]
            _check_routes(name, rows)
            _check_shared(name, count, rows, index[-1] if index else None)
            index.append({"dtype": rows.dtype.str, "shape": [count + len(rows), *rows.shape[1:]], "shared": count})
            own.append(rows)
        return cls(index, own, _answer(tensors["answer"], len(own)))

    @classmethod
    def from_buffer(cls, index: list[dict], buffer) -> Frame:
        """A part of a frame (`part`) as a rank receives it: its arrays' own rows one after another in `buffer`
        (`nbytes` each), read in place."""
        own, offset = [], 0
        for entry in index:
            rows, *row_shape = entry["shape"]
            dtype = np.dtype(entry["dtype"])
            own.append(np.frombuffer(buffer, dtype=dtype, count=entry["nbytes"] // dtype.itemsize, offset=offset)
                       .reshape(rows - entry["shared"], *row_shape))
            offset += entry["nbytes"]
        return cls(index, own)

    def own_rows(self, i: int) -> np.ndarray:
        """Array `i`'s rows after its shared ones, as received."""
        return self._own[i]

    def rows(self, i: int, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` of array `i`, following shared rows back through the arrays before it."""
        parts, end = [], stop
        while end > start:
            shared = self.index[i]["shared"]
            if end > shared:  # the rows from max(start, shared) come from array i's own rows
                parts.append(self._own[i][max(start, shared) - shared:end - shared])
                end = max(start, shared)
            if end > start:
                i -= 1  # the rest are shared with the array before
                if i < 0:
                    raise RouteFrameError("its first array claims rows shared with none before it")
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts[::-1]) if parts else self._own[i][:0]

    def array(self, i: int) -> np.ndarray:
        """Array `i` as vLLM returned it (without the frame's last `no_route` row)."""
        return self.rows(i, 0, self.index[i]["shape"][0] - 1)

    def part(self, first: int, last: int) -> tuple[list[dict], np.ndarray]:
        """Arrays `first..last` as a frame of their own for the rank that uses them (`from_buffer`): their index
        (each entry with its `nbytes`) and their own rows in one flat uint8 buffer, the first array's shared rows
        resolved (one copy of their share)."""
        own = [self.rows(first, 0, self.index[first]["shape"][0]), *self._own[first + 1:last + 1]]
        index = [{**self.index[first], "shared": 0}, *(dict(entry) for entry in self.index[first + 1:last + 1])]
        data, offset = np.empty(sum(rows.nbytes for rows in own), dtype=np.uint8), 0
        for entry, rows in zip(index, own):
            entry["nbytes"] = rows.nbytes
            data[offset:offset + rows.nbytes] = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
            offset += rows.nbytes
        return index, data


def reference_index(reference) -> int | None:
    """The array index of a choice's `routed_experts` reference `"#<i>"`, or None for anything else."""
    if isinstance(reference, str) and reference.startswith("#") and reference[1:].isascii() and \
            reference[1:].isdigit():
        return int(reference[1:])
    return None


def frame_routes(response) -> Frame | None:
    """The frame of a `requests` response from `trl-gspo vllm-serve`, or None for a JSON answer. A response opened
    with `stream=True` is read in one call of its length into one `bytes` object, which safetensors reads."""
    headers = response.headers
    if not headers.get("content-type", "").startswith(CONTENT_TYPE):
        return None
    raw = getattr(response, "raw", None)
    if getattr(response, "_content_consumed", True) or raw is None or headers.get("content-encoding") or \
            "content-length" not in headers:
        return Frame.parse(response.content)
    length, body = int(headers["content-length"]), b""
    try:
        body = raw.read(length)
    except Exception as error:  # as requests reports a body cut short, for the trainer's server error
        raise _cut_short(len(body), length, error) from error
    if len(body) < length:
        raise _cut_short(len(body), length, "the connection closed")
    response._content_consumed = True
    return Frame.parse(body)


def _cut_short(received: int, length: int, cause) -> Exception:
    """The error requests raises for a body cut short (the builtin ConnectionError without requests: a unit test)."""
    try:
        from requests.exceptions import ChunkedEncodingError as cut_short
    except ImportError:
        cut_short = ConnectionError
    return cut_short(f"the route frame ended after {received} of {length} bytes ({cause})")


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
            # in a worker thread: safetensors writes the frame mostly without the GIL, so vLLM's server keeps serving
            frame = await asyncio.to_thread(encode_frame, answer, arrays)
            arrays.clear()
            headers = [(name, value) for name, value in start.get("headers", [])
                       if name.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", CONTENT_TYPE.encode()),
                        (b"content-length", str(len(frame)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": frame})

        try:
            await self.app(scope, receive, keep)
        finally:
            _stored.reset(token)
