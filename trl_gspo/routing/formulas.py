"""Gate-weight formulas of MoE routers, recomputed from live router logits at given expert indices.

A replayed router keeps its live logits (so the router still receives gradients) but uses forced expert
indices; the gate weights must then be recomputed with the router family's own formula. Each formula is checked
at runtime against the router's own output at its natural choices (`RoutingReplay` does this once per router).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GateFormula:
    """`weights = fn(router, logits, indices)`; `router` gives access to config-dependent attributes."""

    name: str
    fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_gather(router, logits, indices):
    """Softmax over all experts, gather the selected, renormalize if `norm_topk_prob` (Qwen2/3-MoE, OLMoE)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights


def _softmax_gather_renormalized(router, logits, indices):
    """Softmax over all experts, gather, always renormalize (Mixtral)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    return weights / weights.sum(-1, keepdim=True)


def _softmax_selected(router, logits, indices):
    """Softmax over the selected experts' logits only (GPT-OSS, GraniteMoE)."""
    return torch.softmax(logits.gather(-1, indices), dim=-1)


def _sigmoid_gather_scaled(router, logits, indices):
    """Sigmoid scores, gather, renormalize if `norm_topk_prob`, times `routed_scaling_factor` (DeepSeek-V3,
    GLM4-MoE). The score-correction bias only affects selection, not the weights."""
    weights = logits.sigmoid().gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * getattr(router, "routed_scaling_factor", 1.0)


SOFTMAX_GATHER = GateFormula("softmax over experts, gather, renormalize if norm_topk_prob", _softmax_gather)
SOFTMAX_GATHER_RENORM = GateFormula("softmax over experts, gather, renormalize", _softmax_gather_renormalized)
SOFTMAX_SELECTED = GateFormula("softmax over the selected logits", _softmax_selected)
SIGMOID_GATHER_SCALED = GateFormula(
    "sigmoid, gather, renormalize if norm_topk_prob, times routed_scaling_factor", _sigmoid_gather_scaled
)

# Router class name -> formula, for the routers that return (logits, weights, indices).
KNOWN_ROUTERS: dict[str, GateFormula] = {
    "Qwen3MoeTopKRouter": SOFTMAX_GATHER,
    "Qwen2MoeTopKRouter": SOFTMAX_GATHER,
    "Qwen3NextTopKRouter": SOFTMAX_GATHER,
    "OlmoeTopKRouter": SOFTMAX_GATHER,
    "MixtralTopKRouter": SOFTMAX_GATHER_RENORM,
    "GptOssTopKRouter": SOFTMAX_SELECTED,
    "GraniteMoeTopKRouter": SOFTMAX_SELECTED,
    "DeepseekV3TopkRouter": SIGMOID_GATHER_SCALED,
    "Glm4MoeTopkRouter": SIGMOID_GATHER_SCALED,
}

# Tried, in order, for a router class not in KNOWN_ROUTERS; the first that reproduces the router's own weights at
# its natural choices is used, none means the router is refused.
CANDIDATES = (SOFTMAX_GATHER, SOFTMAX_GATHER_RENORM, SOFTMAX_SELECTED, SIGMOID_GATHER_SCALED)


def reproduces(formula: GateFormula, router, logits, weights, indices) -> bool:
    """Does `formula` give the router's own `weights` at its own `indices`? Tolerance follows the dtype."""
    recomputed = formula.fn(router, logits, indices.long()).to(weights.dtype)
    tolerance = 1e-5 if weights.dtype in (torch.float32, torch.float64) else 1e-2
    return recomputed.shape == weights.shape and torch.allclose(recomputed, weights, atol=tolerance, rtol=tolerance)
