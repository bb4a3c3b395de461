"""Routing replay on stock transformers MoE models, against an independent naive reference."""

from contextlib import nullcontext

import pytest
import torch
import transformers
from support.moe_families import COMMON, FAMILIES, build_family_model, family_config, router_weight

from trl_gspo.routing import RoutingReplay, RoutingReplayError, find_routers, route_changes

def _batch(seed=0, batch=3, length=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: pad tokens are routed too and must replay consistently
    ids[0, :4] = 0
    return ids, mask


def _perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_self_replay_is_exact_and_perturbed_replay_forces_experts(name):
    model = build_family_model(name)
    ids, mask = _batch()
    rr = RoutingReplay(model)
    with torch.no_grad():
        with rr.record() as rec:
            natural = model(input_ids=ids, attention_mask=mask).logits
        assert rec.indices.dtype == torch.uint8 and rec.indices.shape[:2] == ids.shape
        assert rec.bytes_per_token == len(rr.routers) * rr.top_k  # 1 byte per (token, layer, k)
        with rr.replay(rec.indices):
            replayed = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(replayed, natural, rtol=0, atol=0)
    assert float(rr.drift.max()) == 0.0

    _perturb(model)
    with torch.no_grad():
        with rr.record() as after:
            moved = model(input_ids=ids, attention_mask=mask).logits
        with rr.replay(rec.indices):
            forced = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.equal(after.indices, rec.indices)  # the perturbation really changed routing
    assert float(rr.drift.max()) > 0
    assert not torch.allclose(forced, moved)  # replay changed the forward: the tests below can fail
    with torch.no_grad(), rr.replay(after.indices):  # replaying the new natural choices = natural forward
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, moved, rtol=0, atol=0)


# ---------------------------------------------------------------- independent naive reference
# Written from each family's published routing rule, per token, from raw parameter tensors; it shares no code with
# transformers' routers and experts nor with trl_gspo.routing.formulas.

def _reference_gate_weights(rule, config, logits, chosen):
    """Gate weights of the `chosen` experts from one token's router `logits` (float64)."""
    logits = logits.double()
    if rule == "softmax_gather":  # softmax over all experts; renormalized over the chosen if norm_topk_prob
        weights = logits.exp()[chosen] / logits.exp().sum()
        return weights / weights.sum() if getattr(config, "norm_topk_prob", False) else weights
    if rule == "softmax_gather_renorm":
        weights = logits.exp()[chosen]
        return weights / weights.sum()
    if rule == "softmax_selected":  # softmax over the chosen logits only
        return logits[chosen].exp() / logits[chosen].exp().sum()
    scores = 1 / (1 + (-logits[chosen]).exp())
    if rule == "sigmoid_selected":
        return scores
    if rule == "sigmoid_gather_renorm":
        return scores / scores.sum()
    if rule == "sigmoid_gather":  # DeepSeek-V3 / GLM4 / LFM2: renormalize if norm_topk_prob, then scale
        if getattr(config, "norm_topk_prob", False):
            scores = scores / scores.sum()
        return scores * getattr(config, "routed_scaling_factor", 1.0)
    raise AssertionError(rule)


def _reference_expert(kind, experts, e, x, config):
    """Expert `e` applied to one token `x`, from the raw expert parameter tensors."""
    if kind == "glu":  # gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], SiLU
        assert getattr(config, "hidden_act", "silu") == "silu"  # LFM2 hard-codes SiLU and has no such field
        gate, up = (experts.gate_up_proj[e] @ x).chunk(2)
        return experts.down_proj[e] @ (gate * torch.sigmoid(gate) * up)
    if kind == "llama4":  # gate_up_proj [E, H, 2I], down_proj [E, I, H]
        gate, up = (x @ experts.gate_up_proj[e]).chunk(2)
        return (gate * torch.sigmoid(gate) * up) @ experts.down_proj[e]
    if kind == "gpt_oss":  # interleaved gate/up columns, biases, clamped SwiGLU with alpha, (up + 1)
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        gate, up = gate_up[::2].clamp(max=config.swiglu_limit), gate_up[1::2].clamp(-config.swiglu_limit,
                                                                                      config.swiglu_limit)
        glu = gate * torch.sigmoid(gate * config.swiglu_alpha)
        return ((up + 1) * glu) @ experts.down_proj[e] + experts.down_proj_bias[e]
    raise AssertionError(kind)


def _reference_routed(name, router, experts, hidden, forced):
    """Routed-expert output for every token: forced experts, weights from the current (live) router logits."""
    _, _, _, rule, kind = FAMILIES[name]
    config = family_config(name)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logits = flat.float() @ router_weight(router).float().T
    if getattr(router, "bias", None) is not None:
        logits = logits + router.bias
    rows = []
    for t in range(flat.shape[0]):
        chosen = forced[t]
        weights = _reference_gate_weights(rule, config, logits[t], chosen).to(flat.dtype)
        if kind == "llama4":  # Llama4 scales the expert input, not its output
            rows.append(sum(_reference_expert(kind, experts, e, w * flat[t], config)
                            for w, e in zip(weights, chosen.tolist())))
        else:
            rows.append(sum(w * _reference_expert(kind, experts, e, flat[t], config)
                            for w, e in zip(weights, chosen.tolist())))
    return torch.stack(rows), logits


def _swap_in_reference(name, model, rr, recording):
    """Replace every MoE layer's routed experts by the naive reference fed with the recorded experts; returns an
    undo function."""
    undo = []
    for layer, router_name in enumerate(rr.layer_names):
        block = model.get_submodule(router_name.rsplit(".", 1)[0])
        forced = recording[:, :, layer].reshape(-1, rr.top_k).long()
        if FAMILIES[name][4] == "llama4":  # the block scales inputs itself: swap the whole block
            def forward(hidden, block=block, forced=forced):
                flat = hidden.reshape(-1, hidden.shape[-1])
                routed, logits = _reference_routed(name, block.router, block.experts, flat, forced)
                return block.shared_expert(flat) + routed, logits
            target = block
        else:
            router = rr.routers[layer]

            def forward(hidden, *_, router=router, experts=block.experts, forced=forced):
                return _reference_routed(name, router, experts, hidden, forced)[0].reshape(hidden.shape)
            target = block.experts
        target.forward = forward
        undo.append(target)
    return lambda: [vars(target).pop("forward") for target in undo]


def _recorded_then_perturbed(name="qwen3_moe"):
    """A tiny model, its recording on `_batch()`, then weights perturbed so natural routing drifts."""
    model = build_family_model(name)
    ids, mask = _batch()
    rr = RoutingReplay(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids, attention_mask=mask)
    _perturb(model)
    return model, ids, mask, rr, rec


def _replayed_loss_and_grads(model, ids, mask, rr, rec):
    with rr.replay(rec.indices):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(FAMILIES))
def test_replay_matches_naive_reference_with_gradients(name):
    model, ids, mask, rr, rec = _recorded_then_perturbed(name)
    model.train()
    loss, grads = _replayed_loss_and_grads(model, ids, mask, rr, rec)
    assert float(rr.drift.max()) > 0  # the perturbation moved routing, so replay had something to force
    router_params = {n for n, p in model.named_parameters() if any(p is router_weight(r) for r in rr.routers)}
    assert router_params and all(grads[n].abs().sum() > 0 for n in router_params)  # the router still learns

    undo = _swap_in_reference(name, model, rr, rec.indices)
    try:
        reference_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        reference_loss.backward()
    finally:
        undo()
    reference_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        natural_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert not torch.allclose(natural_loss, reference_loss)  # the reference is not the natural forward
    torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-5, atol=1e-6)
    assert reference_grads.keys() == grads.keys()
    for param_name, reference in reference_grads.items():
        torch.testing.assert_close(grads[param_name], reference, rtol=1e-4, atol=1e-6, msg=param_name)


def test_checkpointing_gives_the_same_gradients_under_replay():
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    model.train()
    loss, grads = _replayed_loss_and_grads(model, ids, mask, rr, rec)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed_loss, checkpointed_grads = _replayed_loss_and_grads(model, ids, mask, rr, rec)
    torch.testing.assert_close(checkpointed_loss, loss, rtol=0, atol=0)
    assert grads.keys() == checkpointed_grads.keys()
    for name in grads:
        torch.testing.assert_close(checkpointed_grads[name], grads[name], rtol=1e-6, atol=1e-8, msg=name)


def test_a_first_replay_under_checkpointing_recomputes_what_it_saved():
    """A RoutingReplay whose first use is `replay()` (no `record()` before: routes from a sampler, as in the
    asynchronous trainer) checks the router's gate formula in that first forward; done with autograd on, the check
    made a checkpointed layer save more tensors than its recomputation (CheckpointError in backward, found there)."""
    model, ids, mask, _, rec = _recorded_then_perturbed()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fresh = RoutingReplay(model)
    with fresh.replay(rec.indices):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_closing_replay_before_backward_is_caught_under_checkpointing():
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with rr.replay(rec.indices):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    with pytest.raises(RoutingReplayError, match="closed before backward"):
        loss.backward()
    # A new forward disarms the guard: natural-routing training with checkpointing is unaffected afterwards.
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    # Without checkpointing nothing is recomputed, so closing early is harmless and nothing is raised.
    model.gradient_checkpointing_disable()
    with rr.replay(rec.indices):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()


def test_mask_leaves_tokens_to_natural_routing():
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    with torch.no_grad():
        with rr.record() as natural:
            expected = model(input_ids=ids, attention_mask=mask).logits
        nothing_forced = torch.zeros(ids.shape, dtype=torch.bool)
        with rr.replay(rec.indices, mask=nothing_forced):
            unforced = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(unforced, expected, rtol=0, atol=0)  # every token kept its natural experts
        assert rr.overridden_fraction == 0.0
        assert float(rr.drift.max()) > 0  # ...while drift against the recording is still measured
        # Drift over real tokens only, against an independent count from the two recordings.
        with rr.replay(rec.indices, mask=nothing_forced, stats_mask=mask):
            model(input_ids=ids, attention_mask=mask)
    changed = (natural.indices.long().sort(-1).values != rec.indices.long().sort(-1).values).any(-1)  # [B,S,L]
    expected_drift = (changed.float() * mask[..., None]).sum((0, 1)) / mask.sum()
    torch.testing.assert_close(rr.drift, expected_drift.float())
    forced_half = torch.zeros(ids.shape, dtype=torch.bool)
    forced_half[:, ::2] = True
    with torch.no_grad(), rr.replay(rec.indices, mask=forced_half):
        model(input_ids=ids, attention_mask=mask)
    assert 0 < rr.overridden_fraction < float(rr.drift.mean()) + 1e-9


def test_errors_are_clear():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with pytest.raises(RoutingReplayError, match="no MoE router"):
        RoutingReplay(Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8, intermediate_size=16)))
    model = build_family_model("qwen3_moe")
    rr = RoutingReplay(model)
    ids, mask = _batch()
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(RoutingReplayError, match="token-count mismatch"):
        with torch.no_grad(), rr.replay(rec.indices):
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1])
    with pytest.raises(RoutingReplayError, match="shape"):
        with rr.replay(rec.indices[:, :, :1]):
            pass
    with pytest.raises(RoutingReplayError, match="not called"):
        with rr.replay(rec.indices):
            pass


def test_changed_router_formula_is_detected(monkeypatch):
    from trl_gspo.routing import formulas

    model = build_family_model("qwen3_moe")
    broken = formulas.GateFormula("wrong", lambda router, logits, idx: torch.ones(idx.shape))
    monkeypatch.setitem(formulas.KNOWN_ROUTERS, "Qwen3MoeTopKRouter", formulas.RouterFamily(broken))
    rr = RoutingReplay(model)
    ids, mask = _batch()
    with pytest.raises(RoutingReplayError, match="no longer reproduces"):
        with torch.no_grad(), rr.record():
            model(input_ids=ids, attention_mask=mask)


def test_router_that_does_not_choose_experts_is_refused():
    """transformers 5.20's Jamba router was a bare Linear (top-k ran in the MoE block): nothing replay can force."""
    model = build_family_model("qwen3_moe")
    for router in find_routers(model):
        del router[1].top_k
    with pytest.raises(RoutingReplayError, match="only computes logits"):
        RoutingReplay(model)


@pytest.mark.parametrize("phase", ["record", "replay"])
def test_changed_router_output_layout_is_detected(phase):
    """transformers 5.20's GraniteMoe router returned (indices, weights, logits), the reverse of 5.23's order. A
    release that reorders router outputs must fail with a clear error, in recording and in replay."""
    model = build_family_model("qwen3_moe")
    rr = RoutingReplay(model)
    ids, mask = _batch()
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids, attention_mask=mask)
    handles = [router.register_forward_hook(lambda module, args, output: tuple(reversed(output)))
               for router in rr.routers]
    context = rr.record() if phase == "record" else rr.replay(rec.indices)
    with pytest.raises(RoutingReplayError, match=r"Qwen3MoeTopKRouter does not return \(router_logits"):
        with torch.no_grad(), context:
            model(input_ids=ids, attention_mask=mask)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_replay_under_every_experts_implementation_and_dtype(name, implementation, dtype, monkeypatch):
    from transformers.integrations.moe import ExpertsInterface

    calls = []
    if implementation != "eager":  # prove the requested implementation really ran
        original = ExpertsInterface._global_mapping[implementation]
        monkeypatch.setitem(ExpertsInterface._global_mapping, implementation,
                            lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    ids, mask = _batch()

    def replayed(model, rr, indices):
        model.train()
        with rr.replay(indices):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
        router_grad = torch.cat([router_weight(r).grad.flatten().float() for r in rr.routers])
        return loss.detach().float(), router_grad

    # float32 eager replay of the same weights is the yardstick
    reference_model = build_family_model(name)
    reference_rr = RoutingReplay(reference_model)
    model = build_family_model(name, dtype=dtype, experts_implementation=implementation)
    rr = RoutingReplay(model)
    with torch.no_grad():
        with rr.record() as rec:
            natural = model(input_ids=ids, attention_mask=mask).logits
        with rr.replay(rec.indices):  # self-replay is bit-exact in every dtype and implementation
            torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, natural, rtol=0, atol=0)
    _perturb(model)
    _perturb(reference_model)
    with torch.no_grad():  # same perturbed weights, up to the cast
        for p, q in zip(reference_model.parameters(), model.parameters()):
            p.copy_(q.float())
    loss, router_grad = replayed(model, rr, rec.indices)
    reference_loss, reference_router_grad = replayed(reference_model, reference_rr, rec.indices)
    assert float(rr.drift.max()) > 0 and float(reference_rr.drift.max()) > 0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, reference_loss, rtol=tolerance, atol=tolerance)
    relative_error = (router_grad - reference_router_grad).norm() / reference_router_grad.norm()
    assert relative_error < (1e-4 if dtype == torch.float32 else 5e-2)
    assert implementation == "eager" or calls


def test_unsupported_routers_are_refused_with_the_reason(monkeypatch):
    from transformers import DbrxConfig, DbrxForCausalLM, PhimoeConfig, PhimoeForCausalLM

    dbrx = DbrxForCausalLM(DbrxConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=64,
                                      ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
                                      attn_config={"kv_n_heads": 2, "rope_theta": 10000.0}))
    with pytest.raises(RoutingReplayError, match="DbrxRouter cannot be replayed.*Fix"):
        RoutingReplay(dbrx)
    phimoe = PhimoeForCausalLM(PhimoeConfig(**{**COMMON, "num_hidden_layers": 1}, num_local_experts=4,
                                            num_experts_per_tok=2, intermediate_size=16))
    with pytest.raises(RoutingReplayError, match="PhimoeTopKRouter cannot be replayed.*sparsemixer"):
        RoutingReplay(phimoe)
    model = build_family_model("qwen3_moe")
    # what from_pretrained(..., use_kernels=True) reports (the real setter needs the `kernels` package)
    monkeypatch.setattr(type(model), "use_kernels", property(lambda self: True))
    with pytest.raises(RoutingReplayError, match="use_kernels"):
        RoutingReplay(model)
    monkeypatch.undo()
    model = build_family_model("qwen3_moe")
    model.model.layers[1].mlp.gate.top_k = 3
    with pytest.raises(RoutingReplayError, match="top_k, num_experts"):
        RoutingReplay(model)


def _reference_load_balancing(router_logits, chosen_per_layer, mask, num_experts):
    """Switch-Transformer balancing loss over real tokens, all layers pooled: E * sum_e f_e * P_e, f_e the share of
    top-k assignments given to expert e, P_e its mean router probability."""
    real = mask.reshape(-1).double()
    assignments = torch.zeros(num_experts, dtype=torch.float64)
    probabilities = torch.zeros(num_experts, dtype=torch.float64)
    for logits, chosen in zip(router_logits, chosen_per_layer):
        for t in range(logits.shape[0]):
            assignments[chosen[t]] += real[t]
            probabilities += real[t] * torch.softmax(logits[t].double(), -1)
    rows = real.sum() * len(router_logits)
    return num_experts * ((assignments / rows) * (probabilities / rows)).sum()


def test_aux_loss_under_replay_balances_the_natural_choices():
    """transformers' balancing loss recomputes top-k from the router logits, so under replay it regularizes the
    router's natural choices (docs/routing.md), not the replayed ones, and still trains the router."""
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    model.train()
    with rr.replay(rec.indices):
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        out.aux_loss.backward()
    assert all(router_weight(r).grad.abs().sum() > 0 for r in rr.routers)
    logits = [layer.detach() for layer in out.router_logits]
    natural = [layer.topk(rr.top_k, dim=-1).indices for layer in logits]
    replayed = [rec.indices[:, :, i].reshape(-1, rr.top_k).long() for i in range(len(logits))]
    on_natural = _reference_load_balancing(logits, natural, mask, rr.num_experts)
    on_replayed = _reference_load_balancing(logits, replayed, mask, rr.num_experts)
    torch.testing.assert_close(out.aux_loss.double(), on_natural, rtol=1e-5, atol=1e-7)
    assert float(rr.drift.max()) > 0 and not torch.isclose(on_natural, on_replayed)


# ---------------------------------------------------------------- route_changes
def _reference_route_changes(a, b):
    """Per token and layer, from Python sets: did the chosen experts differ?"""
    batch, length, layers, _ = a.shape
    return torch.tensor([[[set(a[i, t, l].tolist()) != set(b[i, t, l].tolist()) for l in range(layers)]
                          for t in range(length)] for i in range(batch)])


def test_route_changes_compares_expert_sets_per_token_and_layer():
    g = torch.Generator().manual_seed(0)
    # distinct experts per (token, layer), as a router's top-k gives: a random permutation's first k
    a = torch.rand(3, 7, 4, 16, generator=g).argsort(-1)[..., :4].to(torch.uint8)
    shuffled = a.gather(-1, torch.rand(a.shape, generator=g).argsort(-1))  # same sets, other order
    assert not torch.equal(shuffled, a)
    assert not route_changes(a, shuffled).any()
    assert not route_changes(a, shuffled, per_layer=True).any()

    b = shuffled.clone()
    b[0, 2, 1, 0] = next(e for e in range(16) if e not in a[0, 2, 1].tolist())  # one expert swapped in layer 1
    b[2, 5, 3] = torch.rand(16, generator=g).argsort()[:4]  # a fresh random set (may or may not differ)
    b[1, 6] = torch.rand(4, 16, generator=g).argsort(-1)[:, :4]
    expected = _reference_route_changes(a, b)
    assert expected[0, 2, 1] and expected.sum() >= 2
    assert torch.equal(route_changes(a, b, per_layer=True), expected)
    assert torch.equal(route_changes(a, b), expected.any(-1))
    assert route_changes(a, b).dtype == torch.bool and route_changes(a, b).shape == (3, 7)
    with pytest.raises(RoutingReplayError, match="same inputs"):
        route_changes(a, b[:, :5])


def test_route_changes_agrees_with_replay_drift_on_a_model():
    model = build_family_model("qwen3_moe")
    ids, mask = _batch()
    rr = RoutingReplay(model)
    with torch.no_grad(), rr.record() as before:
        model(input_ids=ids, attention_mask=mask)
    _perturb(model, scale=0.02)
    with torch.no_grad():
        with rr.record() as after:
            model(input_ids=ids, attention_mask=mask)
        with rr.replay(before.indices):  # replay's own per-layer drift: natural (after) vs recorded (before)
            model(input_ids=ids, attention_mask=mask)
    changed = route_changes(before.indices, after.indices, per_layer=True)
    assert 0 < changed.float().mean() < 1
    torch.testing.assert_close(changed.float().mean((0, 1)), rr.drift, rtol=0, atol=1e-6)


def test_token_counts_over_several_calls_match_an_independent_count():
    """`token_counts` (drifted, overridden, counted per layer) of a block with two forward calls, a partial force
    mask and fractional statistics weights, against a count made from two recordings with Python sets."""
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    with torch.no_grad(), rr.record() as natural:
        model(input_ids=ids, attention_mask=mask)
    g = torch.Generator().manual_seed(3)
    force = torch.rand(ids.shape, generator=g) < 0.5
    weight = torch.rand(ids.shape, generator=g).round(decimals=2) * mask
    with torch.no_grad(), rr.replay(rec.indices, mask=force, stats_mask=weight):
        model(input_ids=ids[:2], attention_mask=mask[:2])  # rows are consumed in call order
        model(input_ids=ids[2:], attention_mask=mask[2:])
    batch, length, layers, _ = rec.indices.shape
    expected = torch.zeros(layers, 3, dtype=torch.float64)
    for b in range(batch):
        for s in range(length):
            for layer in range(layers):
                differs = set(rec.indices[b, s, layer].tolist()) != set(natural.indices[b, s, layer].tolist())
                w = float(weight[b, s])
                expected[layer] += torch.tensor([w * differs, w * (differs and bool(force[b, s])), w],
                                                dtype=torch.float64)
    assert expected[:, 1].sum() > 0 and expected[:, 0].sum() > expected[:, 1].sum()  # both counts have content
    torch.testing.assert_close(rr.token_counts, expected, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(rr.drift, (expected[:, 0] / expected[:, 2]).float())
    assert rr.overridden_fraction == pytest.approx(float(expected[:, 1].sum() / expected[:, 2].sum()))


def test_replay_block_reads_nothing_to_the_host():
    """A replayed forward and backward, with a force mask and statistics, never waits for the device: no
    `.item()`/`bool()`/`.tolist()`/`.cpu()` inside the block or at its exit (each is a device sync on a GPU).
    Counted on CPU with benchmarks/_setup.py's counter (as benchmarks/loss_overhead.py counts)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from _setup import count_host_reads

    model, ids, mask, rr, rec = _recorded_then_perturbed()
    force = torch.ones(ids.shape, dtype=torch.bool)
    force[:, -1] = False
    counts = {}
    for replayed in (False, True):
        with count_host_reads() as reads:
            with rr.replay(rec.indices, mask=force, stats_mask=mask) if replayed else nullcontext():
                model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        counts[replayed] = reads["count"]
    assert counts[True] == counts[False]  # the model's own reads (its experts loop, its loss), nothing added
    assert rr.token_counts.shape == (len(rr.routers), 3) and float(rr.drift.max()) > 0  # reading them is the sync


# ---------------------------------------------------------------- operators replay adds
class _CountOperators(torch.utils._python_dispatch.TorchDispatchMode):
    """Non-view operators dispatched inside the block (as benchmarks/routing_replay_overhead.py counts them)."""

    VIEWS = {"view", "_unsafe_view", "select", "slice", "permute", "expand", "detach", "t", "transpose", "unsqueeze",
             "squeeze", "alias", "as_strided", "reshape", "unbind", "split", "split_with_sizes", "unfold", "view_as"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ not in self.VIEWS
        return func(*args, **(kwargs or {}))


def _added_operators(layers):
    """Operators a replayed forward+backward dispatches beyond a plain one, on a Qwen3-MoE of `layers` layers."""
    config = transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": layers}, head_dim=8, num_experts=6,
                                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).train()
    ids, mask = _batch()
    rr = RoutingReplay(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids, attention_mask=mask)

    def step(replay):
        with rr.replay(rec.indices) if replay else nullcontext():
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

    step(False), step(True)  # first calls check the gate formula once per router class
    counts = []
    for replay in (False, True):
        with _CountOperators() as ops:
            step(replay)
        counts.append(ops.count)
    return counts[1] - counts[0]


def test_replay_adds_at_most_three_operators_per_moe_layer():
    """Forward+backward, unmasked replay of a Qwen3-MoE: the slope over the layer count is what each MoE layer adds
    (the rest is paid once per forward call)."""
    two, four = _added_operators(2), _added_operators(4)
    per_layer = (four - two) / 2
    assert per_layer <= 3, f"replay adds {per_layer} operators per MoE layer ({two} at 2 layers, {four} at 4)"
    assert two - 2 * per_layer <= 20, f"replay adds {two - 2 * per_layer} operators per forward call"


def test_drift_statistics_are_the_sorted_top_k_set_comparison():
    """`token_counts` per layer: (tokens whose natural top-k set differs from the recorded one, of those the ones
    forced, tokens counted), as the sorted-set comparison of the two recordings gives them, with real drift."""
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    with torch.no_grad():
        with rr.record() as natural:
            model(input_ids=ids, attention_mask=mask)
        forced = torch.zeros(ids.shape, dtype=torch.bool)
        forced[:, 1::2] = True
        with rr.replay(rec.indices, mask=forced, stats_mask=mask):
            model(input_ids=ids, attention_mask=mask)
    changed = (rec.indices.long().sort(-1).values != natural.indices.long().sort(-1).values).any(-1)  # [B, S, L]
    weight = mask[..., None].double()
    expected = torch.stack([(changed * weight).sum((0, 1)), (changed * forced[..., None] * weight).sum((0, 1)),
                            weight.sum((0, 1)).expand(changed.shape[-1])], dim=1)
    assert expected[:, 0].min() > 0 and expected[:, 1].sum() < expected[:, 0].sum()  # drift, partly forced
    torch.testing.assert_close(rr.token_counts, expected, rtol=0, atol=0)
    torch.testing.assert_close(rr.drift, (expected[:, 0] / expected[:, 2]).float())
    assert rr.overridden_fraction == pytest.approx(float(expected[:, 1].sum() / expected[:, 2].sum()))
