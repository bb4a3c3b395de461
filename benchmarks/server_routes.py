"""The server-mode route path of R3 at the flagship's size: what receiving vLLM's routes costs the trainer.

In server mode (`trl-gspo vllm-serve`) each completion's routes come back inside vLLM's `/v1/completions` JSON answer
as base64 `.npy` (`routed_experts`, `[prompt + completion - 1, layers, top_k]`, uint8). The main process receives
the answer; TRL's `VLLMClient.generate` parses it; trl-gspo decodes the routes, hands each rank the routes of the
completions TRL keeps for it, and each rank checks them (`check_sampled_routes`) before replaying them.

A synthetic answer shaped like vLLM's is built once (real `/v1/completions` layout: `prompt_token_ids`, `token_ids`,
`logprobs` as TRL asks for them, `routed_experts`), and each measured round runs in fresh processes (1 or 2, gloo on
CPU) through TRL's own client (`VLLMClient.generate` on a session that returns the answer) and TRL's broadcast and
slice of the payload, with trl-gspo's `capture_routes` around it exactly as `GSPOTrainer` calls it. Printed per
size and process count: wall time of the round and each rank's peak RSS (the whole process: imports, the answer's
bytes on the main process, the round), with routes and without (the same answer without `routed_experts`: TRL's own
cost), and the time ratio.

    python benchmarks/server_routes.py                 # small (64 x 1k tokens) and flagship (512 x 4.3k, 48 x 8)
    python benchmarks/server_routes.py --sizes small   # seconds

Flagship: 512 completions (64 prompts x 8 generations) of 300 prompt + 4000 completion tokens, 48 MoE layers, top-8
of 128 experts (Qwen3-30B-A3B): 0.85 GB of routes, 1.1 GB of base64 in the answer. Needs ~8 GB of RAM. Last line,
exactly: `route_path: <size>:<processes> <seconds with routes> <seconds without> ...`.
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

SIZES = {  # prompts, generations, prompt tokens, completion tokens, MoE layers, top_k, experts
    "small": (8, 8, 100, 900, 48, 8, 128),
    "quarter": (16, 8, 300, 4000, 48, 8, 128),
    "flagship": (64, 8, 300, 4000, 48, 8, 128),
}


def write_answer(path: Path, size: str, routes: bool) -> None:
    """vLLM's `/v1/completions` answer for `size`, as bytes on disk (with or without `routed_experts`)."""
    prompts, generations, prompt_len, completion_len, layers, top_k, experts = SIZES[size]
    rng = np.random.default_rng(0)
    spacing = experts // top_k  # expert e_0 + j * spacing: top_k distinct experts per (token, layer)
    choices = []
    for p in range(prompts):
        prompt = rng.integers(0, 1000, prompt_len).tolist()
        prompt_routes = None
        for g in range(generations):
            tokens = rng.integers(0, 1000, completion_len).tolist()
            choice = {"index": p * generations + g, "text": "", "prompt_token_ids": prompt, "token_ids": tokens,
                      "finish_reason": "length",
                      "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                                   "token_logprobs": rng.uniform(-3, 0, completion_len).round(6).tolist(),
                                   "top_logprobs": [None] * completion_len, "text_offset": [0] * completion_len}}
            if routes:
                first = rng.integers(0, spacing, (prompt_len + completion_len - 1, layers, 1), dtype=np.uint8)
                rows = first + (np.arange(top_k, dtype=np.uint8) * spacing)
                if prompt_routes is None:
                    prompt_routes = rows[:prompt_len].copy()
                rows[:prompt_len] = prompt_routes  # one prefill: every generation of a prompt shares its routes
                buffer = io.BytesIO()
                np.save(buffer, rows, allow_pickle=False)
                choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode()
            choices.append(choice)
    path.write_bytes(json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "m", "choices": choices})
                     .encode())


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_round(rank: int, world: int, port: int, answer: str, size: str, routes: bool, queue) -> None:
    """One generation round's route path in process `rank` of `world` (gloo)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from types import SimpleNamespace

    import requests
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list
    from trl.generation.vllm_client import VLLMClient

    from trl_gspo.routing.rollout import check_sampled_routes
    from trl_gspo.sampling.vllm import capture_routes

    torch.set_num_threads(1)
    state = PartialState(cpu=True, backend="gloo")
    prompts, generations, _, _, _, top_k, experts = SIZES[size]
    client = None
    if state.is_main_process:  # the answer as requests holds it: the response body, bytes
        body = Path(answer).read_bytes()
        client = VLLMClient.__new__(VLLMClient)  # no server: the session below answers
        client.base_url, client.model = "http://127.0.0.1:8000", "m"

        class Session:
            def post(self, url, **kwargs):
                response = requests.Response()
                response.status_code, response._content, response.url = 200, body, url
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
            del body
        shared = [payload]
        broadcast_object_list(shared, from_process=0)
        completion_ids = shared[0][1][rank * per_rank:(rank + 1) * per_rank]
        if routes:
            sampled = take([len(ids) for ids in completion_ids], torch.uint8)
            check_sampled_routes(sampled, experts, top_k, "vLLM server")
    seconds = time.perf_counter() - start
    state.wait_for_everyone()
    queue.put((rank, seconds, _peak_mb()))
    queue.close()
    queue.join_thread()  # the result is in the pipe before the hard exit below
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of gloo's threads


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def measure(answer: Path, size: str, routes: bool, world: int) -> tuple[float, list[float]]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=one_round, args=(rank, world, port, str(answer), size, routes, queue))
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
    return max(seconds for _, seconds, _ in results), [grown for _, _, grown in results]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,flagship")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trl_gspo_bench"))
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import _setup
    import torch

    _setup.header("server_routes", "cpu", torch.uint8, "none (route transport)")
    figures = []
    for size in options.sizes.split(","):
        prompts, generations, prompt_len, completion_len, layers, top_k, _ = SIZES[size]
        answers = {}
        for routes in (False, True):
            answers[routes] = Path(options.cache) / f"server_answer_{size}_{'routes' if routes else 'plain'}.json"
            if not answers[routes].exists():
                answers[routes].parent.mkdir(parents=True, exist_ok=True)
                write_answer(answers[routes], size, routes)
        raw = prompts * generations * (prompt_len + completion_len - 1) * layers * top_k
        print(f"\n{size}: {prompts * generations} completions of {prompt_len} + {completion_len} tokens, {layers} x "
              f"top-{top_k}: routes {raw / 1e9:.2f} GB; answer {answers[True].stat().st_size / 1e9:.2f} GB with "
              f"routes, {answers[False].stat().st_size / 1e9:.2f} GB without")
        print(f"{'processes':>9} {'s without':>10} {'s with':>8} {'ratio':>6}   peak RSS MB per rank "
              "(without | with)")
        for world in map(int, options.processes.split(",")):
            plain_s, plain_mb = measure(answers[False], size, False, world)
            routed_s, routed_mb = measure(answers[True], size, True, world)
            print(f"{world:>9} {plain_s:>10.2f} {routed_s:>8.2f} {routed_s / plain_s:>6.1f}   "
                  f"{' '.join(f'{m:.0f}' for m in plain_mb)} | {' '.join(f'{m:.0f}' for m in routed_mb)}", flush=True)
            figures.append(f"{size}:{world} {routed_s:.2f} {plain_s:.2f}")
    print("route_path: " + " ".join(figures))


if __name__ == "__main__":
    main()
