"""The server-mode route path of R3 at the flagship's size: what receiving vLLM's routes costs the trainer.

In server mode (`trl-gspo vllm-serve`) each completion's routes come back with vLLM's `/v1/completions` answer,
`[prompt + completion - 1, layers, top_k]` uint8 each, in one of two forms:
- `json`: vLLM's own, base64 `.npy` text inside the JSON answer (`routed_experts`); what any `vllm serve
  --enable-return-routed-experts` sends, and what trl-gspo read before its route frame;
- `bytes`: the route frame of `trl-gspo vllm-serve` (trl_gspo/sampling/route_wire.py): one safetensors file holding
  the JSON answer without the routes and the routes as raw bytes, each prompt's rows once for its completions.
The main process receives the answer; TRL's `VLLMClient.generate` parses it; trl-gspo reads the routes, hands each
rank the routes of the completions TRL keeps for it, and each rank checks them (`check_sampled_routes`).

A synthetic answer shaped like vLLM's is built once per form (real `/v1/completions` layout: `prompt_token_ids`,
`token_ids`, `logprobs` as TRL asks for them, routes), and each measured round runs in fresh processes (1 or 2, gloo
on CPU) through TRL's own client (`VLLMClient.generate` on a stand-in that returns the answer) and TRL's broadcast
and slice of the payload, with trl-gspo's `capture_routes` around it exactly as `GSPOTrainer` calls it. Printed per
size and process count: wall time of the round and each rank's peak RSS (the whole process: imports, the answer
as the main process reads it from a stream, as from a socket, the round) without routes (TRL's own cost) and with
each form; the seconds spent in each stage of the route path (reading the answer, handing out, splitting per
completion, the check), summed over ranks; and the floor: the routes' bytes copied once at this machine's measured
memory bandwidth. Each rank computes with the machine's cores shared among the ranks, as `accelerate launch` sets
them. The server's own cost
(encoding the routes: base64 `.npy` per choice, or the frame) is printed once per size.

    python benchmarks/server_routes.py                 # small (64 x 1k tokens) and flagship (512 x 4.3k, 48 x 8)
    python benchmarks/server_routes.py --sizes small   # seconds
    python benchmarks/server_routes.py --sizes flagship --processes 1 --repeats 3   # medians of 3, side by side

Flagship: 512 completions (64 prompts x 8 generations) of 300 prompt + 4000 completion tokens, 48 MoE layers, top-8
of 128 experts (Qwen3-30B-A3B): 0.85 GB of routes, 1.1 GB of base64 in the JSON answer. Needs ~8 GB of RAM. Last line,
exactly: `route_path: <size>:<processes> <s bytes> <s json> <s without> ...`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

import numpy as np

FRAME_VERSION = "frame3"  # cached answers of an older frame layout are not reused (frame3: safetensors)
FORMS = ("plain", "json", "bytes")  # no routes (TRL's own round), vLLM's base64 in JSON, trl-gspo's route frame
SIZES = {  # prompts, generations, prompt tokens, completion tokens, MoE layers, top_k, experts
    "small": (8, 8, 100, 900, 48, 8, 128),
    "quarter": (16, 8, 300, 4000, 48, 8, 128),
    "flagship": (64, 8, 300, 4000, 48, 8, 128),
}


def route_arrays(size: str):
    """Per completion: (prompt ids, completion ids, log-probs, routes), as vLLM's `n` samples of each prompt give
    them (one prefill: a prompt's completions share its routes)."""
    prompts, generations, prompt_len, completion_len, layers, top_k, experts = SIZES[size]
    rng = np.random.default_rng(0)
    spacing = experts // top_k  # expert e_0 + j * spacing: top_k distinct experts per (token, layer)
    for p in range(prompts):
        prompt = rng.integers(0, 1000, prompt_len).tolist()
        prompt_routes = None
        for g in range(generations):
            tokens = rng.integers(0, 1000, completion_len).tolist()
            logprobs = rng.uniform(-3, 0, completion_len).round(6).tolist()
            first = rng.integers(0, spacing, (prompt_len + completion_len - 1, layers, 1), dtype=np.uint8)
            rows = first + (np.arange(top_k, dtype=np.uint8) * spacing)
            if prompt_routes is None:
                prompt_routes = rows[:prompt_len].copy()
            rows[:prompt_len] = prompt_routes
            yield prompt, tokens, logprobs, rows


def npy_base64(array: np.ndarray) -> str:
    """vLLM's encoding of `routed_experts` (`vllm.utils.serial_utils.numpy2base64`)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def write_answer(path: Path, size: str, form: str) -> float:
    """vLLM's `/v1/completions` answer for `size` as bytes on disk, with routes in `form` ('json', 'bytes') or none
    ('plain'). Returns the seconds the server spends encoding the routes."""
    from trl_gspo.sampling.route_wire import encode_frame

    choices, arrays, encoding = [], [], 0.0
    for i, (prompt, tokens, logprobs, rows) in enumerate(route_arrays(size)):
        choice = {"index": i, "text": "", "prompt_token_ids": prompt, "token_ids": tokens, "finish_reason": "length",
                  "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs,
                               "top_logprobs": [None] * len(tokens), "text_offset": [0] * len(tokens)}}
        if form == "json":
            start = time.perf_counter()
            choice["routed_experts"] = npy_base64(rows)
            encoding += time.perf_counter() - start
        elif form == "bytes":
            arrays.append(rows)
            choice["routed_experts"] = f"#{i}"
        choices.append(choice)
    answer = json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "m", "choices": choices}).encode()
    if form == "bytes":
        start = time.perf_counter()
        answer = encode_frame(answer, arrays)
        encoding += time.perf_counter() - start
    path.write_bytes(answer)
    return encoding


def memory_floor(nbytes: int) -> tuple[float, float, float]:
    """(GB/s, seconds, seconds into fresh memory): one copy of `nbytes` at this machine's memory bandwidth (best of 3
    copies into memory already written, numpy), and one copy into memory just allocated, as receiving the routes
    needs (its pages are mapped on first write)."""
    source = np.ones(nbytes, dtype=np.uint8)
    start = time.perf_counter()
    target = np.empty_like(source)
    np.copyto(target, source)
    fresh = time.perf_counter() - start
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9, best, fresh


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


STAGES = {  # stage -> (module, function) timed inside the round
    "read answer": ("trl_gspo.sampling.server", "read_completions_answer"),
    "hand out": ("trl_gspo.sampling.routes", "hand_out_choices"),
    "split per completion": ("trl_gspo.sampling.routes", "routes_from_server"),
    "check": ("trl_gspo.routing.rollout", "check_sampled_routes"),
}


def _timed(stages: dict):
    """Wrap each stage's function so its seconds add up in `stages` (the callers look them up at call time)."""
    import importlib

    for stage, (module_name, name) in STAGES.items():
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def timed(*args, _original=original, _stage=stage, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                stages[_stage] = stages.get(_stage, 0.0) + time.perf_counter() - start
        setattr(module, name, timed)


def one_round(rank: int, world: int, port: int, answer: str, size: str, form: str, queue) -> None:
    """One generation round's route path in process `rank` of `world` (gloo); `form` is 'plain', 'json', 'bytes'."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from types import SimpleNamespace

    import requests
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list
    from trl.generation.vllm_client import VLLMClient

    from trl_gspo.routing import rollout
    from trl_gspo.sampling.route_wire import CONTENT_TYPE
    from trl_gspo.sampling.routes import capture_routes

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the machine's cores shared, as a launch does
    stages = {}
    _timed(stages)
    state = PartialState(cpu=True, backend="gloo")
    prompts, generations, _, _, _, top_k, experts = SIZES[size]
    routes = form != "plain"
    client = None
    if state.is_main_process:
        client = VLLMClient.__new__(VLLMClient)  # no server: the stand-in below answers
        client.base_url, client.model = "http://127.0.0.1:8000", "m"

        class Session:
            def post(self, url, **kwargs):  # the answer is read from a file (page cache) as from a socket
                response = requests.Response()
                response.status_code, response.raw, response.url = 200, open(answer, "rb"), url
                response.headers["content-type"] = CONTENT_TYPE if form == "bytes" else "application/json"
                response.headers["content-length"] = str(Path(answer).stat().st_size)
                return response

        client.session = Session()
    generation = SimpleNamespace(mode="server", vllm_client=client)
    per_rank = prompts * generations // world
    state.wait_for_everyone()
    start = time.perf_counter()
    with capture_routes(generation, state) if routes else _nothing() as take:
        # TRL's server path (VLLMGeneration.generate): the main process asks, everyone gets the payload, keeps a slice
        payload = None
        if state.is_main_process:
            output = client.generate(prompts=[[0]] * prompts, n=generations, max_tokens=4000, logprobs=0)
            payload = (output["prompt_ids"], output["completion_ids"], output["logprobs"])
        shared = [payload]
        broadcast_object_list(shared, from_process=0)
        completion_ids = shared[0][1][rank * per_rank:(rank + 1) * per_rank]
        if routes:
            sampled = take([len(ids) for ids in completion_ids], torch.uint8)
            rollout.check_sampled_routes(sampled, experts, top_k, "vLLM server")
    seconds = time.perf_counter() - start
    state.wait_for_everyone()
    queue.put((rank, seconds, _peak_mb(), stages))
    queue.close()
    queue.join_thread()  # the result is in the pipe before the hard exit below
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of gloo's threads


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _call_into(queue, function, args):
    queue.put(function(*args))


def in_child(function, *args):
    """`function(*args)` in a fresh process: a child's peak RSS starts at its parent's (Linux keeps the high-water
    mark across fork and exec), so the parent, which spawns every measured round, never holds a big buffer."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_call_into, args=(queue, function, args))
    child.start()
    result = queue.get()
    child.join()
    return result


def measure(answer: Path, size: str, form: str, world: int) -> tuple[float, list[float], dict]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=one_round, args=(rank, world, port, str(answer), size, form, queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    results = []
    while len(results) < world:  # a rank that dies (an import error, out of memory) stops the benchmark
        try:
            results.append(queue.get(timeout=5))
        except Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                for process in processes:
                    process.kill()
                sys.exit(f"a rank of the {world}-process round died (exit codes {dead}); its traceback is above")
    results.sort()
    for process in processes:
        process.join()
    stages = {}
    for *_, rank_stages in results:
        for stage, seconds in rank_stages.items():
            stages[stage] = stages.get(stage, 0.0) + seconds
    return max(seconds for _, seconds, _, _ in results), [grown for _, _, grown, _ in results], stages


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,flagship")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per form, side by side; the median is shown")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trl_gspo_bench"))
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import _setup
    import torch

    _setup.header("server_routes", "cpu", torch.uint8, "none (route transport)")
    figures = []
    for size in options.sizes.split(","):
        prompts, generations, prompt_len, completion_len, layers, top_k, _ = SIZES[size]
        answers, encoding = {}, {}
        raw = prompts * generations * (prompt_len + completion_len - 1) * layers * top_k
        for form in FORMS:
            answers[form] = Path(options.cache) / f"server_answer_{size}_{form}_{FRAME_VERSION}.bin"
            timing = answers[form].with_suffix(".seconds")
            if not answers[form].exists() or not timing.exists():
                answers[form].parent.mkdir(parents=True, exist_ok=True)
                timing.write_text(str(in_child(write_answer, answers[form], size, form)))
            encoding[form] = float(timing.read_text())
        bandwidth, floor, fresh = in_child(memory_floor, raw)
        sizes = ", ".join(f"{form} {answers[form].stat().st_size / 1e9:.2f} GB" for form in FORMS)
        print(f"\n{size}: {prompts * generations} completions of {prompt_len} + {completion_len} tokens, {layers} x "
              f"top-{top_k}: routes {raw / 1e9:.2f} GB; answer: {sizes}")
        print(f"floor: one copy of the routes at this machine's {bandwidth:.1f} GB/s = {floor:.2f} s ({fresh:.2f} s "
              "into memory just allocated, as a receiver's); the server "
              f"encodes them in {encoding['json']:.2f} s as base64 .npy (json), {encoding['bytes']:.2f} s as a frame "
              "(bytes)")
        print(f"{'processes':>9} {'s without':>10} {'s json':>7} {'s bytes':>8} {'bytes-plain':>12}   peak RSS MB "
              "per rank (without | json | bytes)")
        for world in map(int, options.processes.split(",")):
            runs = {form: [] for form in FORMS}
            for repeat in range(options.repeats):  # the forms side by side, in rotating order
                for form in FORMS[repeat % 3:] + FORMS[:repeat % 3]:
                    runs[form].append(measure(answers[form], size, form, world))
            median = {form: sorted(runs[form], key=lambda run: run[0])[len(runs[form]) // 2] for form in FORMS}
            (plain_s, plain_mb, _), (json_s, json_mb, json_stages), (bytes_s, bytes_mb, bytes_stages) = (
                median[form] for form in FORMS)
            print(f"{world:>9} {plain_s:>10.2f} {json_s:>7.2f} {bytes_s:>8.2f} {bytes_s - plain_s:>12.2f}   "
                  + " | ".join(" ".join(f"{m:.0f}" for m in mb) for mb in (plain_mb, json_mb, bytes_mb)), flush=True)
            if options.repeats > 1:
                print("          every run, s: " + "; ".join(
                    f"{form} " + " ".join(f"{run[0]:.2f}" for run in runs[form]) for form in FORMS))
            print("          stages, s summed over ranks (json -> bytes): " + ", ".join(
                f"{stage} {json_stages.get(stage, 0):.2f} -> {bytes_stages.get(stage, 0):.2f}" for stage in STAGES))
            figures.append(f"{size}:{world} {bytes_s:.2f} {json_s:.2f} {plain_s:.2f}")
    print("route_path: " + " ".join(figures))


if __name__ == "__main__":
    main()
