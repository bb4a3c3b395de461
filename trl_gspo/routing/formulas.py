"""Gate-weight formulas of MoE routers, recomputed from live router logits at given expert indices.

A replayed router keeps its live logits (so the router still receives gradients) but uses forced expert
indices; the gate weights must then be recomputed with the router family's own formula. Each formula is checked
at runtime against the router's own output at its natural choices (`RoutingReplay` does this once per router
class), so a future transformers change is caught instead of silently training with wrong weights.

tests/test_router_formulas.py checks every `KNOWN_ROUTERS` entry, weights and gradients w.r.t. the logits, at random
forced experts and with the family's config knobs, against a naive float64 reference written from the family's
rule (itself checked against the stock transformers router), and the `CANDIDATES` fallback for unknown router
classes. Formulas that follow their router in computing in float32 are compared there at float32 resolution.
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
    """Softmax over all experts, gather the selected, renormalize if `norm_topk_prob` (Qwen2/3-MoE, Qwen3-Next,
    OLMoE; Jamba has no such flag and never renormalizes)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights


def _softmax_gather_renormalized(router, logits, indices):
    """Softmax over all experts, gather, always renormalize (Mixtral, Qwen3.5-MoE, HunYuan-MoE). ERNIE-4.5
    clamps the denominator at `norm_min`."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    denominator = weights.sum(-1, keepdim=True)
    norm_min = getattr(router, "norm_min", None)
    return weights / (denominator if norm_min is None else denominator.clamp(min=norm_min))


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


def _sigmoid_gather_renormalized(router, logits, indices):
    """Sigmoid scores in float32, gather, always renormalize (MiniMax-M2; its correction bias is selection-only)."""
    weights = logits.float().sigmoid().gather(-1, indices)
    return weights / weights.sum(-1, keepdim=True)


def _sigmoid_gather_lfm2(router, logits, indices):
    """Sigmoid scores, gather, renormalize with +1e-6 if `norm_topk_prob`, times `routed_scaling_factor`
    (LFM2-MoE; its expert bias is selection-only)."""
    weights = logits.sigmoid().gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-6)
    return weights * getattr(router, "routed_scaling_factor", 1.0)


def _sigmoid_selected(router, logits, indices):
    """Sigmoid of each selected logit, no normalization (Llama4, which scales the expert *input* by it). Computed on
    the dense [tokens, experts] layout, as Llama4 does, so the result is bit-identical (CPU sigmoid kernels round
    differently on differently shaped tensors)."""
    dense = torch.full_like(logits, float("-inf")).scatter(-1, indices, logits.gather(-1, indices))
    return dense.float().sigmoid().gather(-1, indices)


SOFTMAX_GATHER = GateFormula("softmax over experts, gather, renormalize if norm_topk_prob", _softmax_gather)
SOFTMAX_GATHER_RENORM = GateFormula("softmax over experts, gather, renormalize", _softmax_gather_renormalized)
SOFTMAX_SELECTED = GateFormula("softmax over the selected logits", _softmax_selected)
SIGMOID_GATHER_SCALED = GateFormula(
    "sigmoid, gather, renormalize if norm_topk_prob, times routed_scaling_factor", _sigmoid_gather_scaled
)
SIGMOID_GATHER_RENORM = GateFormula("sigmoid, gather, renormalize", _sigmoid_gather_renormalized)
SIGMOID_GATHER_LFM2 = GateFormula(
    "sigmoid, gather, renormalize (+1e-6) if norm_topk_prob, times routed_scaling_factor", _sigmoid_gather_lfm2
)
SIGMOID_SELECTED = GateFormula("sigmoid of the selected logits", _sigmoid_selected)


@dataclass(frozen=True)
class OutputLayout:
    """How a router's output maps to `(logits, weights [tokens, k], indices [tokens, k])` and back."""

    unpack: Callable[[torch.nn.Module, tuple], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    pack: Callable[[torch.nn.Module, tuple, torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def _unpack_triple(router, output):
    return output


def _pack_triple(router, output, logits, weights, indices):
    return logits, weights, indices


def _unpack_dense_scores(router, output):
    # Llama4 returns (scores [tokens, experts], logits): sigmoid of the top-k logits, exactly 0 elsewhere.
    scores, logits = output
    indices = torch.topk(logits, router.top_k, dim=-1).indices
    return logits, scores.gather(-1, indices), indices


def _pack_dense_scores(router, output, logits, weights, indices):
    return torch.zeros_like(output[0]).scatter(-1, indices, weights), logits


TRIPLE = OutputLayout(_unpack_triple, _pack_triple)
DENSE_SCORES = OutputLayout(_unpack_dense_scores, _pack_dense_scores)


@dataclass(frozen=True)
class RouterFamily:
    formula: GateFormula
    layout: OutputLayout = TRIPLE


# Router class name -> family. Every entry is checked against a naive reference, gradients included, by
# tests/test_router_formulas.py, which fails for an entry added here without a reference there.
KNOWN_ROUTERS: dict[str, RouterFamily] = {
    "Qwen3MoeTopKRouter": RouterFamily(SOFTMAX_GATHER),
    "Qwen2MoeTopKRouter": RouterFamily(SOFTMAX_GATHER),
    "Qwen3NextTopKRouter": RouterFamily(SOFTMAX_GATHER),
    "OlmoeTopKRouter": RouterFamily(SOFTMAX_GATHER),
    "JambaTopKRouter": RouterFamily(SOFTMAX_GATHER),
    "MixtralTopKRouter": RouterFamily(SOFTMAX_GATHER_RENORM),
    "Qwen3_5MoeTopKRouter": RouterFamily(SOFTMAX_GATHER_RENORM),
    "HunYuanMoEV1Gate": RouterFamily(SOFTMAX_GATHER_RENORM),
    "Ernie4_5_MoeTopKRouter": RouterFamily(SOFTMAX_GATHER_RENORM),
    "GptOssTopKRouter": RouterFamily(SOFTMAX_SELECTED),
    "GraniteMoeTopKRouter": RouterFamily(SOFTMAX_SELECTED),
    "DeepseekV3TopkRouter": RouterFamily(SIGMOID_GATHER_SCALED),
    "Glm4MoeTopkRouter": RouterFamily(SIGMOID_GATHER_SCALED),
    "MiniMaxM2TopKRouter": RouterFamily(SIGMOID_GATHER_RENORM),
    "Lfm2MoeTopKRouter": RouterFamily(SIGMOID_GATHER_LFM2),
    "Llama4Router": RouterFamily(SIGMOID_SELECTED, DENSE_SCORES),
}

# Routers that cannot be replayed through their output, with the reason given to the user.
UNSUPPORTED_ROUTERS: dict[str, str] = {
    "DbrxRouter": "DBRX's router returns only logits and the experts are picked later inside DbrxFFN, so there is "
                  "no router output to replace",
    "PhimoeTopKRouter": "PhiMoE's sparsemixer samples experts in training and weighs each pick with a masked "
                        "softmax that depends on the order of the picks, which forced experts do not define",
}

# Tried, in order, for a router class not in KNOWN_ROUTERS that returns (logits, weights, indices); the first that
# reproduces the router's own weights at its natural choices is used, none means the router is refused.
CANDIDATES = (SOFTMAX_GATHER, SOFTMAX_GATHER_RENORM, SOFTMAX_SELECTED, SIGMOID_GATHER_SCALED, SIGMOID_GATHER_RENORM)


def reproduces(formula: GateFormula, router, logits, weights, indices) -> bool:
    """Does `formula` give the router's own `weights` at its own `indices`? Tolerance follows the dtype."""
    try:
        recomputed = formula.fn(router, logits, indices.long()).to(weights.dtype)
    except (RuntimeError, IndexError, TypeError, AttributeError):  # e.g. a router attribute the formula needs is gone
        return False
    tolerance = 1e-5 if weights.dtype in (torch.float32, torch.float64) else 1e-2
    return recomputed.shape == weights.shape and torch.allclose(recomputed, weights, atol=tolerance, rtol=tolerance)
