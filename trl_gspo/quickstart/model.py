"""Tiny Qwen3 models (Mixture-of-Experts and dense) built from scratch, offline.

The MoE config ships with the package as ``tiny_qwen3_moe.json``. Vocabulary size and the
special token ids are taken from the tokenizer, so the model always matches
:func:`trl_gspo.quickstart.tokenizer.build_tokenizer`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

#: Path of the MoE config that ships with the package.
TINY_MOE_CONFIG_PATH = Path(__file__).with_name("tiny_qwen3_moe.json")

# Keys of the JSON file that describe the file rather than configure the model.
_NON_CONFIG_KEYS = ("architectures", "model_type", "transformers_version")

#: Standard deviation of the router logits right after initialisation (per token, per expert).
#: transformers initialises router weights with ``initializer_range`` (0.02), which for a
#: 96-wide model gives logits of about 0.2 and near-ties between experts. Scaling the weights so
#: that logits start at about 1.0 makes the top-2 routing meaningful from the first step.
DEFAULT_ROUTER_LOGIT_STD = 1.0


def _token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def load_tiny_moe_config(
    tokenizer: PreTrainedTokenizerBase | None = None, config_overrides: dict[str, Any] | None = None
) -> Qwen3MoeConfig:
    """Read ``tiny_qwen3_moe.json``; set vocab size and pad/bos/eos ids from ``tokenizer``; apply overrides."""
    with open(TINY_MOE_CONFIG_PATH, encoding="utf-8") as f:
        kwargs = {k: v for k, v in json.load(f).items() if k not in _NON_CONFIG_KEYS}
    if tokenizer is not None:
        kwargs.update(_token_ids(tokenizer))
    kwargs.update(config_overrides or {})
    return Qwen3MoeConfig(**kwargs)


def _set_generation_ids(model, tokenizer: PreTrainedTokenizerBase) -> None:
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id


@torch.no_grad()
def widen_router_init(model: torch.nn.Module, logit_std: float = DEFAULT_ROUTER_LOGIT_STD) -> int:
    """Re-initialise every MoE router so its logits have std ``logit_std`` on unit-RMS inputs.

    Returns the number of routers re-initialised.
    """
    n = 0
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter") and hasattr(module, "weight"):
            hidden = module.weight.shape[-1]
            module.weight.normal_(mean=0.0, std=logit_std / math.sqrt(hidden))
            n += 1
    return n


def build_model(
    tokenizer: PreTrainedTokenizerBase,
    config_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    router_logit_std: float = DEFAULT_ROUTER_LOGIT_STD,
) -> Qwen3MoeForCausalLM:
    """A freshly initialised tiny ``Qwen3MoeForCausalLM`` from ``tiny_qwen3_moe.json`` (float32, CPU)."""
    config = load_tiny_moe_config(tokenizer, config_overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    widen_router_init(model, router_logit_std)
    _set_generation_ids(model, tokenizer)
    return model


def build_dense_model(
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Qwen3ForCausalLM:
    """A freshly initialised tiny dense ``Qwen3ForCausalLM`` (same width/depth as the MoE model)."""
    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_token_ids(tokenizer),
    )
    kwargs.update(config_overrides or {})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    _set_generation_ids(model, tokenizer)
    return model
