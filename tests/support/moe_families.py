"""Tiny models of the stock transformers MoE families routing replay supports, each with the reference rules
tests/test_routing.py checks it against; tests/test_model_checks.py trains a step of each."""

import torch
import transformers

from trl_gspo.routing import find_routers

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, pad_token_id=0)
HYBRID_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
# name -> (model class, config class, config kwargs, reference gate-weight rule, reference expert kind)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
        "softmax_gather", "glu"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        intermediate_size=32), "softmax_gather", "glu"),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        intermediate_size=32, norm_topk_prob=True, **HYBRID_ATTENTION), "softmax_gather", "glu"),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        **HYBRID_ATTENTION), "softmax_gather_renorm", "glu"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=16), "softmax_gather_renorm", "glu"),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, intermediate_size=16), "softmax_gather", "glu"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=8,
        q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5,
        norm_topk_prob=True), "sigmoid_gather", "glu"),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True), "sigmoid_gather", "glu"),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        head_dim=8, num_local_experts=6, num_experts_per_tok=2, intermediate_size=16,
        layer_types=["full_attention"] * 2), "softmax_selected", "gpt_oss"),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=16), "softmax_selected", "glu"),
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(
        num_experts=6, num_experts_per_tok=2, intermediate_size=16, expert_layer_period=1, expert_layer_offset=0,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4),
        "softmax_gather", "glu"),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
        moe_layer_start_index=0, moe_layer_interval=1, moe_num_shared_experts=1), "softmax_gather_renorm", "glu"),
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(
        head_dim=8, num_experts=6, moe_topk=2, intermediate_size=16), "softmax_gather_renorm", "glu"),
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", dict(
        head_dim=8, num_local_experts=6, num_experts_per_tok=2, intermediate_size=16, bos_token_id=1,
        eos_token_id=2), "sigmoid_gather_renorm", "glu"),
    "lfm2_moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32, num_dense_layers=0,
        layer_types=["full_attention", "conv"]), "sigmoid_gather", "glu"),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(
        head_dim=8, num_local_experts=6, num_experts_per_tok=2, intermediate_size=16, intermediate_size_mlp=32,
        interleave_moe_layer_step=1), "sigmoid_selected", "llama4"),
}


def family_config(name):
    _, config_class, kwargs, _, _ = FAMILIES[name]
    return getattr(transformers, config_class)(**{**COMMON, **kwargs})


def router_weight(router):
    return router.wg.weight if hasattr(router, "wg") else router.weight


def build_family_model(name, seed=0, dtype=torch.float32, experts_implementation=None):
    torch.manual_seed(seed)
    config = family_config(name)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    model = getattr(transformers, FAMILIES[name][0])(config).to(dtype).eval()
    with torch.no_grad():  # wider routers than the 0.02 init, so routing is not a near-tie
        for _, router in find_routers(model):
            weight = router_weight(router)
            weight.normal_(0, 1.0 / weight.shape[-1] ** 0.5)
    return model
