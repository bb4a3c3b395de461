"""The gate-weight formulas of trl_gspo/routing/formulas.py, one by one, against a naive float64 reference.

Routing replay recomputes a router's gate weights from its live logits at forced experts, so the router keeps
learning: each formula must give the family's weights *and* their gradient w.r.t. the logits. The reference below
is written from each family's routing rule, token by token, in plain Python floats, with its gradient derived by
hand (a vector-Jacobian product); it shares no code with formulas.py nor with transformers' routers. Each family's
reference is also checked against the stock transformers router at the router's natural choices, so that it really
is that family's rule (with its config knobs), and the formula is then checked against it at random forced experts.
Last, the fallback for router classes formulas.py does not know.
"""

import importlib
import inspect
import math
from dataclasses import dataclass, field

import pytest
import torch
from support.moe_families import family_config

from trl_gspo.routing import RoutingReplay, RoutingReplayError, formulas


# ---------------------------------------------------------------- the naive reference
@dataclass(frozen=True)
class Rule:
    """One family's gate-weight rule for one config.

    activation: "softmax_all" (softmax over all experts, then the chosen ones), "softmax_chosen" (softmax over the
        chosen experts' logits only) or "sigmoid" (of each chosen logit).
    normalise: divide the chosen experts' values by their sum, plus `eps`, or by `max(sum, floor)`.
    scale: multiply at the end (`routed_scaling_factor`).
    """

    activation: str
    normalise: bool = False
    eps: float = 0.0
    floor: float | None = None
    scale: float = 1.0


def reference(rule: Rule, logits: list[float], chosen: list[int], cotangent: list[float]):
    """`(weights, gradient)` of one token: the gate weights of the `chosen` experts from the token's router `logits`,
    and the gradient of `sum_i cotangent[i] * weights[i]` w.r.t. every logit. Plain Python floats (float64)."""
    experts = len(logits)
    if rule.activation == "softmax_all":  # p_e = exp(l_e) / sum_f exp(l_f);  a_i = p_{c_i}
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        p = [x / total for x in exps]
        values = [p[e] for e in chosen]

        def backward(d_values):  # d a_i / d l_e = p_{c_i} (delta_{e, c_i} - p_e)
            inner = sum(d * p[e] for d, e in zip(d_values, chosen))
            grad = [-p[e] * inner for e in range(experts)]
            for d, e in zip(d_values, chosen):
                grad[e] += d * p[e]
            return grad
    elif rule.activation == "softmax_chosen":  # q_i = exp(l_{c_i}) / sum_j exp(l_{c_j})
        top = max(logits[e] for e in chosen)
        exps = [math.exp(logits[e] - top) for e in chosen]
        total = sum(exps)
        values = [x / total for x in exps]

        def backward(d_values):  # d q_i / d l_{c_j} = q_i (delta_ij - q_j); other logits: 0
            inner = sum(d * q for d, q in zip(d_values, values))
            grad = [0.0] * experts
            for d, q, e in zip(d_values, values, chosen):
                grad[e] += q * (d - inner)
            return grad
    elif rule.activation == "sigmoid":  # s_i = 1 / (1 + exp(-l_{c_i}))
        values = [1.0 / (1.0 + math.exp(-logits[e])) for e in chosen]

        def backward(d_values):  # d s_i / d l_{c_i} = s_i (1 - s_i)
            grad = [0.0] * experts
            for d, s, e in zip(d_values, values, chosen):
                grad[e] += d * s * (1.0 - s)
            return grad
    else:
        raise AssertionError(rule.activation)

    total = sum(values)
    if not rule.normalise:
        denominator, d_denominator = 1.0, 0.0
    elif rule.floor is not None:
        denominator, d_denominator = max(total, rule.floor), float(total > rule.floor)
    else:
        denominator, d_denominator = total + rule.eps, 1.0
    weights = [rule.scale * v / denominator for v in values]
    # w_i = scale * v_i / D(sum_j v_j):  d w_i / d v_l = scale * (delta_il / D - v_i * D' / D^2)
    inner = sum(g * v for g, v in zip(cotangent, values))
    d_values = [rule.scale * (g / denominator - inner * d_denominator / denominator ** 2) for g in cotangent]
    return weights, backward(d_values)


def reference_batch(rule, logits, chosen, cotangent):
    """`reference` row by row, as float64 tensors `[tokens, k]` and `[tokens, experts]`."""
    rows = [reference(rule, l, c, g) for l, c, g in zip(logits.tolist(), chosen.tolist(), cotangent.tolist())]
    return (torch.tensor([w for w, _ in rows], dtype=torch.float64),
            torch.tensor([g for _, g in rows], dtype=torch.float64))


# ---------------------------------------------------------------- each family's rule, from its definition
@dataclass(frozen=True)
class Family:
    """A router class of formulas.KNOWN_ROUTERS: its transformers model type (tests/support/moe_families.py), its
    rule from its config, the config knobs to try, and whether its formula computes in float32 whatever the logits'
    dtype (as transformers' router does: `softmax(..., dtype=torch.float)` or `.float()` before the activation)."""

    model_type: str
    rule: object  # config -> Rule
    cases: list = field(default_factory=lambda: [{}])
    float32: bool = False


NORM_TOPK = [{"norm_topk_prob": True}, {"norm_topk_prob": False}]
SCALED = [{"norm_topk_prob": True, "routed_scaling_factor": 2.5},
          {"norm_topk_prob": False, "routed_scaling_factor": 1.7},
          {"norm_topk_prob": True, "routed_scaling_factor": 1.0}]


def _softmax_all_if_norm_topk(config):
    return Rule("softmax_all", normalise=config.norm_topk_prob)


def _softmax_all_renormalised(config):
    return Rule("softmax_all", normalise=True)


def _sigmoid_scaled(eps):
    def rule(config):
        return Rule("sigmoid", normalise=config.norm_topk_prob, eps=eps, scale=config.routed_scaling_factor)
    return rule


FAMILIES: dict[str, Family] = {
    # Softmax over all experts, top-k, renormalised over the chosen iff norm_topk_prob.
    "Qwen3MoeTopKRouter": Family("qwen3_moe", _softmax_all_if_norm_topk, NORM_TOPK, float32=True),
    "Qwen2MoeTopKRouter": Family("qwen2_moe", _softmax_all_if_norm_topk, NORM_TOPK, float32=True),
    "Qwen3NextTopKRouter": Family("qwen3_next", _softmax_all_if_norm_topk, NORM_TOPK, float32=True),
    "OlmoeTopKRouter": Family("olmoe", _softmax_all_if_norm_topk, NORM_TOPK, float32=True),
    # Jamba: softmax over all experts, top-k, never renormalised (its config has no such knob).
    "JambaTopKRouter": Family("jamba", lambda config: Rule("softmax_all"), float32=True),
    # Softmax over all experts, top-k, always renormalised.
    "MixtralTopKRouter": Family("mixtral", _softmax_all_renormalised, float32=True),
    "Qwen3_5MoeTopKRouter": Family("qwen3_5_moe", _softmax_all_renormalised, float32=True),
    "HunYuanMoEV1Gate": Family("hunyuan_v1_moe", _softmax_all_renormalised, float32=True),
    # ERNIE-4.5: experts chosen on softmax + a selection-only bias; weights are the plain softmax of the chosen,
    # renormalised by max(sum, moe_norm_min). 0.5 makes the floor bite for some tokens and not for others.
    "Ernie4_5_MoeTopKRouter": Family(
        "ernie4_5_moe", lambda config: Rule("softmax_all", normalise=True, floor=config.moe_norm_min),
        [{"moe_norm_min": 1e-12}, {"moe_norm_min": 0.5}], float32=True),
    # Top-k of the logits, softmax over the chosen logits only.
    "GptOssTopKRouter": Family("gpt_oss", lambda config: Rule("softmax_chosen")),
    "GraniteMoeTopKRouter": Family("granitemoe", lambda config: Rule("softmax_chosen")),
    # Sigmoid, chosen with a selection-only bias (and groups), renormalised (+1e-20) iff norm_topk_prob, times
    # routed_scaling_factor.
    "DeepseekV3TopkRouter": Family("deepseek_v3", _sigmoid_scaled(1e-20), SCALED),
    "Glm4MoeTopkRouter": Family("glm4_moe", _sigmoid_scaled(1e-20), SCALED),
    # MiniMax-M2: sigmoid, chosen with a selection-only bias, always renormalised (no epsilon).
    "MiniMaxM2TopKRouter": Family("minimax_m2", lambda config: Rule("sigmoid", normalise=True), float32=True),
    # LFM2-MoE: sigmoid, chosen with a selection-only bias if use_expert_bias, renormalised with +1e-6 iff
    # norm_topk_prob, times routed_scaling_factor.
    "Lfm2MoeTopKRouter": Family("lfm2_moe", _sigmoid_scaled(1e-6), SCALED + [
        {"norm_topk_prob": True, "routed_scaling_factor": 1.3, "use_expert_bias": False}]),
    # Llama4: top-k of the logits, sigmoid of each chosen logit, nothing else (it scales the expert input by it).
    "Llama4Router": Family("llama4", lambda config: Rule("sigmoid"), float32=True),
}

CASES = [pytest.param(name, case, id=f"{name}-{i}") for name, family in FAMILIES.items()
         for i, case in enumerate(family.cases)]


def test_every_known_router_has_a_reference():
    """A router class added to formulas.KNOWN_ROUTERS without a reference here fails this test."""
    assert FAMILIES.keys() == formulas.KNOWN_ROUTERS.keys()


def _config(name, case):
    config = family_config(FAMILIES[name].model_type)
    for key, value in case.items():
        setattr(config, key, value)
    return config


def _router(name, case, seed=0):
    """The stock transformers router of the family, built from a config with the case's knobs, with random weights
    and a random selection bias where the family has one."""
    config = _config(name, case)
    model_type = FAMILIES[name].model_type
    cls = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)
    router = cls(config, layer_idx=0) if "layer_idx" in inspect.signature(cls).parameters else cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*router.parameters(), *router.buffers()]:  # weights, GPT-OSS's bias, selection biases
            tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=tensor.dtype) / config.hidden_size ** 0.5
                         if tensor.dim() == 2 and tensor.shape[-1] == config.hidden_size
                         else torch.randn(tensor.shape, generator=g, dtype=tensor.dtype) * 0.3)
    return router.eval(), config


def _natural_output(name, router, config, hidden, g):
    """`(logits, weights [tokens, k], indices [tokens, k])` of the router's own forward at its natural choices."""
    if name == "MiniMaxM2TopKRouter":  # the selection bias lives in the MoE block and is passed in
        return router(hidden, torch.randn(router.num_experts, generator=g) * 0.3)
    if name == "Lfm2MoeTopKRouter":
        return router(hidden, torch.randn(router.num_experts, generator=g) * 0.3 if config.use_expert_bias else None)
    if name == "Llama4Router":  # (dense scores, logits): sigmoid of the chosen logits, exactly 0 elsewhere
        scores, logits = router(hidden)
        indices = (scores > 0).nonzero()[:, 1].reshape(len(hidden), -1)
        return logits, scores.gather(-1, indices), indices
    return router(hidden)


@pytest.mark.parametrize("name, case", CASES)
def test_reference_is_the_family_rule(name, case):
    """The reference reproduces the stock transformers router's own weights at its natural choices, so it is that
    family's rule with that config (this is what makes it a fair judge of the formula below)."""
    router, config = _router(name, case)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(12, config.hidden_size, generator=g)
    with torch.no_grad():
        logits, weights, indices = _natural_output(name, router, config, hidden, g)
    expected, _ = reference_batch(FAMILIES[name].rule(config), logits.double(), indices,
                                  torch.zeros(indices.shape, dtype=torch.float64))
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)


def _forced(tokens, experts, k, g):
    """Random distinct experts per token."""
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name, case", CASES)
def test_formula_matches_reference_with_gradients(name, case, k):
    router, config = _router(name, case)
    family = FAMILIES[name]
    rule = family.rule(config)
    g = torch.Generator().manual_seed(2 + k)
    tokens, experts = 8, router.num_experts
    logits = (torch.randn(tokens, experts, generator=g, dtype=torch.float64) * 2).requires_grad_()
    forced = _forced(tokens, experts, k, g)
    cotangent = torch.randn(tokens, k, generator=g, dtype=torch.float64)
    expected, expected_grad = reference_batch(rule, logits.detach(), forced, cotangent)

    weights = formulas.KNOWN_ROUTERS[name].formula.fn(router, logits, forced)
    (grad,) = torch.autograd.grad((weights.double() * cotangent).sum(), logits)

    # float64 in, float64 out, except where the family's router computes in float32 (the formula follows it there,
    # so that it reproduces the router's weights bit for bit): then compare at float32 resolution.
    assert weights.dtype == (torch.float32 if family.float32 else torch.float64)
    tolerance = dict(rtol=2e-6, atol=1e-7) if family.float32 else dict(rtol=0, atol=1e-12)
    torch.testing.assert_close(weights.double(), expected, **tolerance)
    torch.testing.assert_close(grad, expected_grad, **tolerance)
    if rule.floor is not None and rule.floor > 1e-6 and k > 1:  # both sides of ERNIE's floor were exercised
        sums = torch.softmax(logits.detach(), -1).gather(-1, forced).sum(-1)
        assert (sums < rule.floor).any() and (sums > rule.floor).any()


def test_selection_bias_does_not_enter_the_weights():
    """DeepSeek-V3 / GLM4 keep their selection-only bias on the router: the formula must ignore it."""
    for name in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"):
        router, config = _router(name, SCALED[0])
        logits = torch.randn(4, router.num_experts, dtype=torch.float64)
        forced = _forced(4, router.num_experts, 2, torch.Generator().manual_seed(0))
        before = formulas.KNOWN_ROUTERS[name].formula.fn(router, logits, forced)
        with torch.no_grad():
            router.e_score_correction_bias.add_(5.0)
        torch.testing.assert_close(formulas.KNOWN_ROUTERS[name].formula.fn(router, logits, forced), before,
                                   rtol=0, atol=0)


# ---------------------------------------------------------------- router classes formulas.py does not know
class UnknownRouter(torch.nn.Module):
    """A router of a family formulas.KNOWN_ROUTERS does not list, returning `(logits, weights, indices)`. It picks
    its experts with a sort, not `torch.topk`, so replay cannot steer its own code and must use the fallback formula.
    Its weights follow `rule` (`temperature` != 1 gives a rule no candidate formula has)."""

    def __init__(self, rule: Rule, hidden=16, experts=6, top_k=2, temperature=1.0, **attributes):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, dtype=torch.float64) / hidden ** 0.5)
        self.rule, self.top_k, self.num_experts, self.temperature = rule, top_k, experts, temperature
        for key, value in attributes.items():  # e.g. norm_topk_prob, routed_scaling_factor
            setattr(self, key, value)

    def forward(self, hidden):
        logits = hidden @ self.weight.T
        indices = logits.argsort(-1, descending=True)[:, :self.top_k]
        scaled = logits / self.temperature
        if self.rule.activation == "softmax_all":
            values = scaled.softmax(-1).gather(-1, indices)
        elif self.rule.activation == "softmax_chosen":
            values = scaled.gather(-1, indices).softmax(-1)
        else:
            values = scaled.gather(-1, indices).sigmoid()
        if self.rule.normalise:
            values = values / (values.sum(-1, keepdim=True) + self.rule.eps)
        return logits, values * self.rule.scale, indices


class UnknownMoeModel(torch.nn.Module):
    """Embedding then one `UnknownRouter`; found by RoutingReplay through transformers' output recorder."""

    def __init__(self, router):
        super().__init__()
        from transformers.utils.output_capturing import OutputRecorder

        self._can_record_outputs = {"router_logits": OutputRecorder(type(router), index=0)}
        self.embed = torch.nn.Embedding(32, router.weight.shape[1], dtype=torch.float64)
        self.router = router

    def forward(self, input_ids, attention_mask=None):
        logits, weights, indices = self.router(self.embed(input_ids).reshape(-1, self.embed.embedding_dim))
        return logits, weights, indices


UNKNOWN_RULES = {
    "softmax_gather": (Rule("softmax_all"), {}),
    "softmax_gather_renormalised": (Rule("softmax_all", normalise=True), {}),
    "softmax_gather_norm_topk_prob": (Rule("softmax_all", normalise=True), {"norm_topk_prob": True}),
    "softmax_chosen": (Rule("softmax_chosen"), {}),
    "sigmoid_gather": (Rule("sigmoid"), {}),
    "sigmoid_gather_scaled": (Rule("sigmoid", normalise=True, eps=1e-20, scale=2.5),
                              {"norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    "sigmoid_gather_renormalised": (Rule("sigmoid", normalise=True), {}),
}


@pytest.mark.parametrize("rule_name", list(UNKNOWN_RULES))
def test_unknown_router_falls_back_to_a_formula_that_matches_the_reference(rule_name):
    """An unknown router class gets the first candidate formula that reproduces its own weights at its natural
    choices; under replay, that formula's weights and gradients at forced experts equal the router's rule."""
    rule, attributes = UNKNOWN_RULES[rule_name]
    torch.manual_seed(0)
    model = UnknownMoeModel(UnknownRouter(rule, **attributes))
    rr = RoutingReplay(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (2, 5), generator=g)
    with torch.no_grad(), rr.record():  # the fallback formula is chosen here
        model(input_ids=ids)
    forced = torch.stack([_forced(5, 6, 2, g) for _ in range(2)])[:, :, None, :]  # [batch, seq, layers, k]
    with rr.replay(forced.to(torch.uint8)):
        logits, weights, indices = model(input_ids=ids)
    assert torch.equal(indices, forced.reshape(-1, 2))  # the forced experts, through the fallback formula
    cotangent = torch.randn(weights.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((weights * cotangent).sum(), logits)
    expected, expected_grad = reference_batch(rule, logits.detach(), indices, cotangent)
    torch.testing.assert_close(weights.double(), expected, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=2e-6, atol=1e-7)
    assert float(rr.overridden_fraction) > 0  # replay really changed experts


def test_unknown_router_without_a_matching_formula_is_refused():
    """No candidate reproduces a temperature softmax: refused at the first forward, naming the class and the fix."""
    model = UnknownMoeModel(UnknownRouter(Rule("softmax_all"), temperature=2.0))
    rr = RoutingReplay(model)
    with pytest.raises(RoutingReplayError, match=r"UnknownRouter: no known gate-weight formula reproduces this "
                                                  r"router's weights.*add the router's formula to "
                                                  r"trl_gspo/routing/formulas\.py"):
        with torch.no_grad(), rr.record():
            model(input_ids=torch.randint(0, 32, (2, 5)))
