"""Routing replay on stock transformers MoE models, against an independent naive reference."""

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM, GraniteMoeConfig,
    GraniteMoeForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
    Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

from trl_gspo.routing import RoutingReplay, RoutingReplayError

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, pad_token_id=0)
ARCHITECTURES = {
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=6, num_experts_per_tok=2,
                                                      moe_intermediate_size=16, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                                      moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                      intermediate_size=32)),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**COMMON, num_local_experts=6, num_experts_per_tok=2,
                                                  intermediate_size=16)),
    "olmoe": (OlmoeForCausalLM, OlmoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2, intermediate_size=16)),
    "granitemoe": (GraniteMoeForCausalLM, GraniteMoeConfig(**COMMON, num_local_experts=6, num_experts_per_tok=2,
                                                           intermediate_size=16)),
    "gpt_oss": (GptOssForCausalLM, GptOssConfig(**COMMON, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
                                                intermediate_size=16, layer_types=["full_attention"] * 2)),
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True)),
}


def _build(name, seed=0):
    cls, config = ARCHITECTURES[name]
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():  # wider routers than the 0.02 init, so routing is not a near-tie
        for module in model.modules():
            if "Router" in type(module).__name__ and hasattr(module, "weight"):
                module.weight.normal_(0, 1.0 / module.weight.shape[-1] ** 0.5)
    return model


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
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_self_replay_is_exact_and_perturbed_replay_forces_experts(name):
    model = _build(name)
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


def _naive_qwen3_moe_block(block, hidden, forced):
    """Per token: forced experts, weights = softmax(live logits) gathered and renormalized, experts from the raw
    3-D parameter tensors. Independent of transformers' expert and router code."""
    batch, length, width = hidden.shape
    flat = hidden.reshape(-1, width)
    logits = flat @ block.gate.weight.T
    probs = torch.softmax(logits.float(), dim=-1)
    out = []
    for t in range(flat.shape[0]):
        chosen = forced[t]
        weights = probs[t, chosen] / probs[t, chosen].sum()
        total = torch.zeros(width)
        for j, e in enumerate(chosen.tolist()):
            gate_up = block.experts.gate_up_proj[e] @ flat[t]
            gate, up = gate_up.chunk(2)
            total = total + weights[j] * (block.experts.down_proj[e] @ (F.silu(gate) * up))
        out.append(total)
    return torch.stack(out).reshape(batch, length, width)


def _recorded_then_perturbed():
    """A tiny Qwen3-MoE, its recording on `_batch()`, then weights perturbed so natural routing drifts."""
    model = _build("qwen3_moe")
    ids, mask = _batch()
    rr = RoutingReplay(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids, attention_mask=mask)
    _perturb(model)
    return model, ids, mask, rr, rec


@pytest.mark.parametrize("checkpointing", [False, True])
def test_replay_matches_naive_reference_with_gradients(checkpointing):
    model, ids, mask, rr, rec = _recorded_then_perturbed()
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    with rr.replay(rec.indices):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router still learns
    model.zero_grad()
    model.gradient_checkpointing_disable()

    # Reference: swap every MoE block for the naive one, fed with the recorded experts.
    originals = {}
    for layer_index, layer in enumerate(model.model.layers):
        block = layer.mlp
        forced = rec.indices[:, :, layer_index].reshape(-1, 2).long()
        originals[layer_index] = block.forward
        block.forward = lambda h, block=block, forced=forced: _naive_qwen3_moe_block(block, h, forced)
    try:
        ref_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        ref_loss.backward()
    finally:
        for layer_index, layer in enumerate(model.model.layers):
            layer.mlp.forward = originals[layer_index]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


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
    dense_cfg = ARCHITECTURES["qwen3_moe"][1]
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with pytest.raises(RoutingReplayError, match="no MoE router"):
        RoutingReplay(Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8, intermediate_size=16)))
    model = _build("qwen3_moe")
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
    assert dense_cfg.num_experts == 6


def test_changed_router_formula_is_detected(monkeypatch):
    from trl_gspo.routing import formulas

    model = _build("qwen3_moe")
    broken = formulas.GateFormula("wrong", lambda router, logits, idx: torch.ones(idx.shape))
    monkeypatch.setitem(formulas.KNOWN_ROUTERS, "Qwen3MoeTopKRouter", broken)
    rr = RoutingReplay(model)
    ids, mask = _batch()
    with pytest.raises(RoutingReplayError, match="no longer reproduces"):
        with torch.no_grad(), rr.record():
            model(input_ids=ids, attention_mask=mask)
