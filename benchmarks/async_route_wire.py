"""R3's routes in the asynchronous rollout loop at the flagship's size: what one `/v1/completions` answer holds, and
what reading it costs the rollout worker, with the routes as vLLM's base64 inside the JSON against the route frame of
`trl-gspo vllm-serve` (trl_gspo/sampling/route_wire.py, a safetensors file), side by side in one run; and the route
frame's codec against the hand-written one it replaced (kept here only, as the baseline arm).

TRL's asynchronous rollout loop asks for one completion per request (`n=1`), so each sample is its own answer:
`[prompt + completion - 1, layers, top_k]` uint8 routes, plus the answer's JSON (token ids and log-probs as TRL asks
for them). The answers are built here as the server writes them (vLLM's base64 `.npy`, or route_wire's own frame
encoder) and read with the client's own functions (`decode_server_routes`; `Frame.parse`, `framed_completions_answer`),
to arrays ready for stitching. Printed:

- bytes per sample on the wire: the answer without routes, with base64 routes in the JSON, and as a frame; for the
  group (its completions share the prompt), the same per sample, and for reference what one `n=group` request (the
  synchronous trainer's) would send as a frame, where the prompt's rows travel once;
- decode seconds per sample (median over the group's samples and the repeats): the JSON answer without routes (the
  floor: TRL's own parse), with base64 routes, and the frame;
- unless `--no-http`, the wall seconds per call of `RoutedRolloutLoop._post` against a local aiohttp server sending
  the prebuilt answers (the request, the transfer over loopback, the read and the routes kept for the turn);
- the route frame's codec, hand-written (`MAGIC | u64 length | answer | u64 length | index JSON | route bytes`, read
  in place from a populated receive buffer: trl-gspo's frame before safetensors) against safetensors (now): bytes,
  encode and decode milliseconds (median, interleaved) for one sample, for the group as one `n=group` frame, and for
  that frame without TRL's answer (the routes alone), with `--round-prompts` also for the synchronous trainer's round;
  decode ends at the answer parsed and every array's own rows.

    python benchmarks/async_route_wire.py                 # flagship: 48 layers x top-8 of 128, 4096 tokens, group 8
    python benchmarks/async_route_wire.py --repeats 3     # faster
    python benchmarks/async_route_wire.py --round-prompts 64 --repeats 3 --no-http   # codecs on the flagship's round

Last line, exactly: `async_route_wire: <bytes json/frame> bytes, <decode json/frame> decode (json / frame)`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402  (the header line)
from server_routes import npy_base64  # noqa: E402  (vLLM's base64 `.npy` encoding of routed_experts)

from trl_gspo.sampling.route_wire import CONTENT_TYPE, Frame, encode_frame, shared_rows  # noqa: E402
from trl_gspo.sampling.routes import decode_server_routes  # noqa: E402
from trl_gspo.sampling.server import framed_completions_answer  # noqa: E402


def group_samples(prompt_len: int, sample_len: int, group: int, layers: int, top_k: int, experts: int, seed=0):
    """The group's samples as (prompt ids, completion ids, log-probs, routes): one prompt, `group` completions, the
    prompt's routes the same in each (one prefill on the server); top_k distinct experts per token and layer."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, prompt_len).tolist()
    spacing = experts // top_k
    prompt_routes = None
    for _ in range(group):
        completion = rng.integers(0, 150_000, sample_len - prompt_len).tolist()
        logprobs = rng.uniform(-3, 0, len(completion)).round(6).tolist()
        first = rng.integers(0, spacing, (sample_len - 1, layers, 1), dtype=np.uint8)
        routes = first + np.arange(top_k, dtype=np.uint8) * spacing
        if prompt_routes is None:
            prompt_routes = routes[:prompt_len].copy()
        routes[:prompt_len] = prompt_routes
        yield prompt, completion, logprobs, routes


def choice(index, prompt, completion, logprobs, routed_experts) -> dict:
    """One choice of vLLM's `/v1/completions` answer as TRL's rollout loop asks for it (`return_token_ids`,
    `logprobs=0`)."""
    return {"index": index, "text": "", "prompt_token_ids": prompt, "token_ids": completion, "finish_reason": "length",
            "logprobs": {"tokens": [f"token_id:{t}" for t in completion], "token_logprobs": logprobs,
                         "top_logprobs": [None] * len(completion), "text_offset": [0] * len(completion)},
            "routed_experts": routed_experts}


def answer(choices: list[dict]) -> bytes:
    return json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "m", "choices": choices}).encode()


def read_json(body: bytes):
    """The stock-vLLM path: the JSON answer parsed (as aiohttp's `response.json()`), the routes decoded from base64."""
    content = json.loads(body.decode("utf-8"))
    return decode_server_routes(content["choices"][0]["routed_experts"])


def read_frame(body: bytes):
    """The frame path: the body (as `_read_frame` receives it, `bytes`) parsed, the reference resolved."""
    content = framed_completions_answer(Frame.parse(body))
    return content["choices"][0]["routed_experts"].array()


# --- the baseline arm: trl-gspo's hand-written route frame before its safetensors one (not in the library) ---

HANDWRITTEN_MAGIC, _LENGTH = b"TRLGSPO1", struct.Struct("<Q")


def handwritten_encode(answer_json: bytes, arrays: list[np.ndarray]) -> list:
    """`MAGIC | u64 length | answer | u64 length | index (JSON) | route bytes`, as the two chunks the middleware sent
    (head, routes): each array's rows after `shared` and its `no_route` row, written once into one buffer."""
    index, offset, previous = [], 0, None
    for array in arrays:
        shared = shared_rows(previous, array)
        index.append({"dtype": array.dtype.str, "shape": [len(array) + 1, *array.shape[1:]], "shared": shared,
                      "offset": offset})
        offset += (len(array) + 1 - shared) * int(np.prod(array.shape[1:])) * array.itemsize
        previous = array
    routes = bytearray(offset)
    for array, entry in zip(arrays, index):
        rows = entry["shape"][0] - entry["shared"]
        own = np.frombuffer(routes, dtype=array.dtype, count=rows * int(np.prod(array.shape[1:])),
                            offset=entry["offset"]).reshape(rows, *array.shape[1:])
        own[:-1] = array[entry["shared"]:]
        own[-1] = np.iinfo(array.dtype).max
    index_json = json.dumps(index).encode()
    return [HANDWRITTEN_MAGIC + _LENGTH.pack(len(answer_json)) + answer_json + _LENGTH.pack(len(index_json))
            + index_json, routes]


def handwritten_receive_buffer(size: int):
    """The old client's buffer for a frame: anonymous memory mapped with MAP_POPULATE (a bytearray elsewhere)."""
    import mmap

    populate = getattr(mmap, "MAP_POPULATE", None)
    if populate is None or size == 0:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)


def handwritten_decode(body: bytes):
    """The old client: the body copied into its receive buffer (as it read a response), the answer and index parsed
    by hand, each array's own rows a view of the buffer. Returns (answer, own rows per array)."""
    buffer = handwritten_receive_buffer(len(body))
    view = memoryview(buffer)
    view[:] = body
    position = len(HANDWRITTEN_MAGIC)
    (length,) = _LENGTH.unpack_from(view, position)
    answer = json.loads(bytes(view[position + 8:position + 8 + length]))
    position += 8 + length
    (length,) = _LENGTH.unpack_from(view, position)
    index = json.loads(bytes(view[position + 8:position + 8 + length]))
    routes, own = view[position + 8 + length:], []
    for entry in index:
        rows, *row_shape = entry["shape"]
        count = (rows - entry["shared"]) * int(np.prod(row_shape))
        own.append(np.frombuffer(routes, dtype=entry["dtype"], count=count, offset=entry["offset"])
                   .reshape(rows - entry["shared"], *row_shape))
    return answer, own


def safetensors_decode(body: bytes):
    """The library's reader, to the same point: (answer, own rows per array)."""
    frame = Frame.parse(body)
    return frame.answer, [frame.own_rows(i) for i in range(len(frame.index))]


def compare_codecs(cases: dict[str, tuple[bytes, list[np.ndarray]]], repeats: int) -> dict:
    """Per case (answer JSON, arrays): bytes, median encode and decode seconds of each codec, the codecs and cases
    interleaved (a busy machine then slows them alike). Both codecs' readers give the same answer and rows."""
    encoders = {"hand-written": handwritten_encode, "safetensors": encode_frame}
    decoders = {"hand-written": handwritten_decode, "safetensors": safetensors_decode}
    bodies = {(case, codec): b"".join(encoders[codec](*cases[case])) if codec == "hand-written"
              else encoders[codec](*cases[case]) for case in cases for codec in encoders}
    for case in cases:
        (old_answer, old_rows), (new_answer, new_rows) = (decoders[codec](bodies[case, codec]) for codec in decoders)
        assert old_answer == new_answer and all(np.array_equal(a, b) for a, b in zip(old_rows, new_rows, strict=True))
    times = {(case, codec, step): [] for case in cases for codec in encoders for step in ("encode", "decode")}
    for _ in range(repeats):
        for case, (answer_json, arrays) in cases.items():
            for codec in encoders:
                start = time.perf_counter()
                encoders[codec](answer_json, arrays)
                middle = time.perf_counter()
                decoders[codec](bodies[case, codec])
                times[case, codec, "encode"].append(middle - start)
                times[case, codec, "decode"].append(time.perf_counter() - middle)
    return {(case, codec): (len(bodies[case, codec]), statistics.median(times[case, codec, "encode"]),
                            statistics.median(times[case, codec, "decode"])) for case in cases for codec in encoders}


def timed(readers: dict, forms: dict[str, list[bytes]], repeats: int) -> dict[str, float]:
    """Median seconds per body of each form's reader, the forms interleaved body by body (a busy machine then slows
    them alike)."""
    times = {form: [] for form in readers}
    for _ in range(repeats):
        for i in range(len(next(iter(forms.values())))):
            for form, read in readers.items():
                start = time.perf_counter()
                read(forms[form][i])
                times[form].append(time.perf_counter() - start)
    return {form: statistics.median(samples) for form, samples in times.items()}


def over_http(forms: dict[str, list[bytes]], prompts: list[list[int]], repeats: int) -> dict[str, float]:
    """Median wall seconds per call of `RoutedRolloutLoop._post` against a local aiohttp server per form answering
    its prebuilt answers (the forms interleaved call by call), and a check that every form keeps the same routes."""
    import collections

    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from trl_gspo.async_trainer.routing import _TURNS, RoutedRolloutLoop

    form_of_port, times, kept = {}, {form: [] for form in forms}, {}

    async def completions(request):
        i = (await request.json())["sample"]
        form = form_of_port[request.url.port]
        return web.Response(body=forms[form][i], content_type=CONTENT_TYPE if form == "frame" else "application/json")

    async def run():
        app = web.Application(client_max_size=2**30)
        app.router.add_post("/v1/completions", completions)
        servers = {form: TestServer(app, host="127.0.0.1") for form in forms}
        for form, server in servers.items():
            await server.start_server()
            form_of_port[server.port] = form
        try:
            async with aiohttp.ClientSession() as session:
                loops = {}
                for form, server in servers.items():
                    loops[form] = RoutedRolloutLoop.__new__(RoutedRolloutLoop)
                    loops[form].vllm_server_url = f"http://127.0.0.1:{server.port}"
                    loops[form].session, loops[form]._counters = session, collections.Counter()
                for _ in range(repeats):
                    for i, prompt in enumerate(prompts):
                        for form, loop in loops.items():
                            token = _TURNS.set([])
                            start = time.perf_counter()
                            await loop._post("/v1/completions", {"prompt": prompt, "sample": i}, timeout=60)
                            times[form].append(time.perf_counter() - start)
                            kept[form, i] = _TURNS.get()[0][2]
                            _TURNS.reset(token)
        finally:
            for server in servers.values():
                await server.close()

    asyncio.run(run())
    for i in range(len(prompts)):
        assert np.array_equal(kept["json", i], kept["frame", i]), "the two forms kept different routes"
    return {form: statistics.median(samples) for form, samples in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48, help="MoE layers (Qwen3-30B-A3B: 48)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--sample-tokens", type=int, default=4096, help="prompt + completion tokens per sample")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="the prompt the group's samples share")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-http", action="store_true", help="skip the calls through a local aiohttp server")
    parser.add_argument("--round-prompts", type=int, default=0,
                        help="also compare the codecs on the synchronous trainer's round: one frame of this many "
                             "prompts x group (the flagship's: 64, 0.85 GB of routes; --repeats rounds)")
    args = parser.parse_args()
    _setup.header("async_route_wire", "cpu", "uint8 routes", "-")

    samples = list(group_samples(args.prompt_tokens, args.sample_tokens, args.group, args.layers, args.top_k,
                                 args.experts))
    forms = {"plain": [], "json": [], "frame": []}
    for prompt, completion, logprobs, routes in samples:  # one request (n=1) per sample, as TRL's rollout loop asks
        forms["plain"].append(answer([choice(0, prompt, completion, logprobs, None)]))
        forms["json"].append(answer([choice(0, prompt, completion, logprobs, npy_base64(routes))]))
        forms["frame"].append(encode_frame(answer([choice(0, prompt, completion, logprobs, "#0")]), [routes]))
    # For reference: the group as one n=group request (the synchronous trainer's), the prompt's rows sent once.
    one_request = encode_frame(answer([choice(i, *sample[:3], f"#{i}") for i, sample in enumerate(samples)]),
                               [sample[3] for sample in samples])
    route_bytes = samples[0][3].nbytes

    size = {form: statistics.mean(map(len, bodies)) for form, bodies in forms.items()}
    routes_part = {form: size[form] - size["plain"] for form in ("json", "frame")}
    print(f"sample: {args.sample_tokens} tokens ({args.prompt_tokens} prompt), {args.layers} layers x top-{args.top_k} "
          f"of {args.experts} experts, uint8 routes: {route_bytes:,} bytes of routes; group of {args.group}")
    print("bytes per sample on the wire (one request per sample):")
    print(f"  answer without routes  {size['plain']:>12,.0f}")
    print(f"  base64 routes in JSON  {size['json']:>12,.0f}   routes part {routes_part['json']:>12,.0f}")
    print(f"  route frame            {size['frame']:>12,.0f}   routes part {routes_part['frame']:>12,.0f}")
    print(f"  ratio json / frame     {size['json'] / size['frame']:>12.3f}   routes part "
          f"{routes_part['json'] / routes_part['frame']:>12.3f}")
    print(f"  for reference, the group as one n={args.group} frame (prompt rows once): "
          f"{len(one_request) / args.group:,.0f} per sample")

    for i, (*_, routes) in enumerate(samples):  # both readers give the arrays sent
        assert np.array_equal(read_json(forms["json"][i]), routes)
        assert np.array_equal(read_frame(forms["frame"][i]), routes)
    decode = timed({"plain": lambda body: json.loads(body.decode("utf-8")), "json": read_json, "frame": read_frame},
                   forms, args.repeats)
    ms = {form: seconds * 1e3 for form, seconds in decode.items()}
    print(f"decode seconds per sample (median of {args.repeats} x {args.group}, interleaved):")
    print(f"  JSON without routes (TRL's own parse)  {ms['plain']:8.3f} ms")
    print(f"  base64 routes in JSON                  {ms['json']:8.3f} ms")
    print(f"  route frame                            {ms['frame']:8.3f} ms")
    print(f"  ratio json / frame {ms['json'] / ms['frame']:.2f}; over the floor: json {ms['json'] - ms['plain']:.3f} "
          f"ms, frame {ms['frame'] - ms['plain']:.3f} ms")

    if not args.no_http and importlib.util.find_spec("aiohttp") is None:  # the asynchronous extra's transport
        args.no_http = True
        print("RoutedRolloutLoop._post over loopback: skipped (aiohttp not installed: pip install -e \".[async]\")")
    if not args.no_http:
        http = over_http({"json": forms["json"], "frame": forms["frame"]}, [s[0] for s in samples], args.repeats)
        print(f"RoutedRolloutLoop._post over loopback, wall seconds per call (median of {args.repeats} x "
              f"{args.group}, interleaved): json {http['json'] * 1e3:.3f} ms, frame {http['frame'] * 1e3:.3f} ms, "
              f"ratio {http['json'] / http['frame']:.2f}")

    group_answer = answer([choice(i, *sample[:3], f"#{i}") for i, sample in enumerate(samples)])
    cases = {"one sample": (answer([choice(0, *samples[0][:3], "#0")]), [samples[0][3]]),
             f"group, one n={args.group} frame": (group_answer, [sample[3] for sample in samples]),
             "  its routes alone": (b'{"choices": []}', [sample[3] for sample in samples])}
    codecs = compare_codecs(cases, args.repeats * args.group)
    repeats = f"median of {args.repeats * args.group}"
    if args.round_prompts:  # the synchronous trainer's round: one frame, every prompt's group
        round_samples = [sample for seed in range(args.round_prompts) for sample in group_samples(
            args.prompt_tokens, args.sample_tokens, args.group, args.layers, args.top_k, args.experts, seed)]
        round_case = {f"round, {args.round_prompts} x {args.group}": (
            answer([choice(i, *sample[:3], f"#{i}") for i, sample in enumerate(round_samples)]),
            [sample[3] for sample in round_samples])}
        codecs.update(compare_codecs(round_case, args.repeats))
        cases.update(round_case)
        repeats += f" ({args.repeats} for the round)"
    print(f"route frame codec, hand-written (baseline, before) against safetensors (now), {repeats}, interleaved:")
    print(f"  {'case':<26} {'codec':<13} {'bytes':>13} {'encode ms':>10} {'decode ms':>10}")
    for (case, codec), (nbytes, encode, decode) in codecs.items():
        print(f"  {case:<26} {codec:<13} {nbytes:>13,} {encode * 1e3:>10.3f} {decode * 1e3:>10.3f}")
    ratios = []
    for case in cases:
        (old_bytes, old_encode, old_decode), (new_bytes, new_encode, new_decode) = (
            codecs[case, codec] for codec in ("hand-written", "safetensors"))
        ratios.append(f"{case.strip()}: bytes {new_bytes / old_bytes:.3f}, encode {new_encode / old_encode:.2f}, "
                      f"decode {new_decode / old_decode:.2f}")
    print("frame_codec (safetensors / hand-written): " + "; ".join(ratios))

    print(f"async_route_wire: {size['json'] / size['frame']:.3f} bytes, {ms['json'] / ms['frame']:.2f} decode "
          "(json / frame)")

if __name__ == "__main__":
    main()
