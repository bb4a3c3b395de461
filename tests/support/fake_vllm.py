"""A fake vLLM written to vLLM's documented output types (`RequestOutput.prompt_token_ids`, `.outputs`;
`CompletionOutput.index, text, token_ids, cumulative_logprob, logprobs, routed_experts, finish_reason`, routed_experts
`[prompt_len + completion_len - 1, layers, top_k]`, checked in vLLM 0.22.0's wheel) whose routes are recorded from the
HF model itself, and a fake of its server's `/v1/completions` over it: what tests/test_vllm_routes.py and
tests/test_route_wire.py drive the trainer's route capture with."""

import json as jsonlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from trl_gspo.quickstart.model import build_model
from trl_gspo.routing import RoutingReplay
from trl_gspo.sampling import route_wire


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput's fields, in its order
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = "stop"


@dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list = field(default_factory=list)


class FakeLLM:
    """Answers `generate` with fixed completions and the routes the HF model takes on them, as vLLM would."""

    def __init__(self, model, completions, **engine_kwargs):
        self.model, self.completions, self.engine_kwargs = model, completions, engine_kwargs
        self.replay = RoutingReplay(model)

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        outputs = []
        for prompt, completion in zip(prompts, self.completions):
            ids = torch.tensor([prompt["prompt_token_ids"] + completion])
            with torch.no_grad(), self.replay.record() as recorded:
                self.model(input_ids=ids)
            routes = recorded.indices[0, :-1].numpy().astype(np.int32)  # the last token is never fed forward
            outputs.append(RequestOutput(prompt["prompt_token_ids"], [CompletionOutput(
                0, "", completion, None, None,
                routes if self.engine_kwargs.get("enable_return_routed_experts") else None)]))
        return outputs


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
COMPLETIONS = [[20, 21, 2], [22], [23, 24, 25, 26, 2]]


def npy_base64(array: np.ndarray) -> str:
    """What vLLM's server puts in a choice's `routed_experts`: base64 of the array's `.npy` bytes."""
    import base64
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class FakeSession:
    """A `requests.Session` whose POST to /v1/completions answers like vLLM's server (prompt-major choices, each with
    prompt_token_ids, token_ids and base64 routed_experts), from the fake engine's outputs."""

    def __init__(self, llm, n, with_routes=True, framed=True):
        self.llm, self.n, self.with_routes, self.framed, self.posts = llm, n, with_routes, framed, []

    def post(self, url, json=None, headers=None, **kwargs):
        """As vLLM's server; as `trl-gspo vllm-serve` (routes framed as bytes, route_wire.py) when `framed` and the
        request asks for it."""
        self.posts.append(url)
        choices, arrays = [], []
        framed = self.framed and self.with_routes and route_wire.HEADER in (headers or {})
        if url.endswith("/v1/completions"):
            prompts = [p for p in json["prompt"] for _ in range(self.n)]
            for request in self.llm.generate([{"prompt_token_ids": p} for p in prompts]):
                completion = request.outputs[0]
                routes = completion.routed_experts.astype(np.uint8)
                arrays.append(routes)
                routes = f"#{len(arrays) - 1}" if framed else npy_base64(routes) if self.with_routes else None
                choices.append({"prompt_token_ids": request.prompt_token_ids, "token_ids": completion.token_ids,
                                "routed_experts": routes})
        answer = {"choices": choices}
        if framed:
            content = route_wire.encode_frame(jsonlib.dumps(answer).encode(), arrays)
            return SimpleNamespace(ok=True, headers={"content-type": route_wire.CONTENT_TYPE}, content=content,
                                   raise_for_status=lambda: None)
        return SimpleNamespace(ok=True, headers={"content-type": "application/json"}, json=lambda: answer,
                               raise_for_status=lambda: None)


def fake_server(tokenizer, with_routes=True, framed=True):
    llm = FakeLLM(build_model(tokenizer, seed=0).eval(), [COMPLETIONS[0]] * 2 + [COMPLETIONS[2]] * 2,
                  enable_return_routed_experts=True)
    return llm, SimpleNamespace(session=FakeSession(llm, n=2, with_routes=with_routes, framed=framed),
                                base_url="http://h", model="m")
