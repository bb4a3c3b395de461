"""The flagship's real size once: a Qwen3-30B-A3B-shaped model on one GPU, one GSPO step with LoRA and routing replay.

The model is built on the device from the Qwen3-30B-A3B config (48 layers, 128 experts top-8, hidden 2048, expert
width 768, 32 query / 4 key-value heads, vocabulary 151,936; about 30.5 B parameters, 61 GB in bf16) with random
weights: no checkpoint can be downloaded where this runs. LoRA (r 16) on attention (q/k/v/o) and on the fused expert
weights (PEFT `target_parameters`, as recipes/qwen3_30b_a3b/gspo_lora_experts.yaml), router and base weights frozen,
routing replay (R2, `routing_replay="old"`), gradient checkpointing, bf16; rollout batches of short completions from
HF generate, each split into two mini-batches (two optimizer steps) so that the old-policy pass runs. Prints the parameter count, the bytes of the weights, the adapters and their Adam state, build
time, the time of each training step and the peak GPU memory, next to the arithmetic of the recipe headers.

    python benchmarks/flagship_step.py --device cuda                # the real widths (one H200: about 61 GB of weights)
    python benchmarks/flagship_step.py --device cpu --tiny          # the same code path at toy widths (a check, ~1 min)

Last line, exactly: `flagship_step: peak <GiB> GiB, rollout batch <s> s` (generation, the old-policy pass and
the two optimizer steps of the last rollout batch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402  (the header line)

# Qwen/Qwen3-30B-A3B-Base config.json (the fields that set the shape).
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6, tie_word_embeddings=False,
    output_router_logits=False, router_aux_loss_coef=0.001, attention_bias=False, use_sliding_window=False,
)
TINY = dict(QWEN3_30B_A3B, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=256)
GiB = 2**30


def build(widths: dict, tokenizer, device: str, dtype: torch.dtype):
    """Random weights built where they will run (no host copy of 61 GB), routers re-initialised so that routing is
    not a near-tie (trl_gspo.quickstart.model.widen_router_init)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trl_gspo.quickstart.model import widen_router_init

    config = Qwen3MoeConfig(**widths, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    widen_router_init(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy widths: the same code path, for a CPU check")
    parser.add_argument("--rollouts", type=int, default=2,
                        help="rollout batches, 2 optimizer steps each (an off-policy second mini-batch, so the "
                             "old-policy pass runs and replay has routes to force); the first one warms up")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    _setup.header("flagship_step", args.device, str(dtype).removeprefix("torch."), "transformers default")

    from datasets import Dataset
    from peft import LoraConfig

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    widths = TINY if args.tiny else QWEN3_30B_A3B
    started = time.perf_counter()
    model = build(widths, tokenizer, args.device, dtype)
    if cuda:
        torch.cuda.synchronize()
    built = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {widths['num_hidden_layers']} layers, {widths['num_experts']} experts top-"
          f"{widths['num_experts_per_tok']}, {params / 1e9:.2f} B parameters, {weight_bytes / GiB:.1f} GiB of "
          f"{dtype} weights, built on {args.device} in {built:.1f} s", flush=True)

    prompts = Dataset.from_dict({"prompt": [f"{i % 10}+{(3 * i) % 10}=" for i in range(args.prompts * 4)]})

    def length_reward(completions, **kwargs):  # varies within a group, so advantages are non-zero
        return [len(c) / 100.0 for c in completions]

    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with tempfile.TemporaryDirectory() as out:
        config = GSPOConfig(
            output_dir=out, loss_type="gspo", routing_replay="old", use_cpu=not cuda, bf16=cuda,
            per_device_train_batch_size=args.prompts * args.group // 2, num_generations=args.group,
            steps_per_generation=2, max_completion_length=args.completion_length, temperature=1.0,
            learning_rate=2e-5, max_steps=2 * args.rollouts, logging_steps=1, save_strategy="no", report_to="none",
            gradient_checkpointing=True, seed=0, disable_tqdm=True)
        trainer = GSPOTrainer(model, length_reward, args=config, train_dataset=prompts, processing_class=tokenizer,
                              peft_config=lora)
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        adapter_bytes = sum(p.numel() * p.element_size() for p in trainable)
        print(f"LoRA r {args.lora_r}: {sum(p.numel() for p in trainable) / 1e6:.1f} M trainable parameters "
              f"({adapter_bytes / GiB:.2f} GiB; with grads and Adam's two moments about "
              f"{4 * adapter_bytes / GiB:.2f} GiB)", flush=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        step_times = []

        from transformers import TrainerCallback

        class StepClock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                if cuda:
                    torch.cuda.synchronize()
                self.began = time.perf_counter()

            def on_step_end(self, *a, **k):
                if cuda:
                    torch.cuda.synchronize()
                step_times.append(time.perf_counter() - self.began)
                print(f"step {len(step_times)}: {step_times[-1]:.2f} s", flush=True)

        trainer.add_callback(StepClock())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        peak = torch.cuda.max_memory_allocated() / GiB if cuda else float("nan")
        reserved = torch.cuda.max_memory_reserved() / GiB if cuda else float("nan")
        for h in logs:
            print(f"  step {h.get('step')}: loss {h['loss']:.4g}, reward {h.get('reward', float('nan')):.3f}, "
                  f"clip ratio {h.get('clip_ratio/region_mean', float('nan')):.3g}, "
                  f"drift {h.get('routing/drift_mean', float('nan')):.3g}, "
                  f"completion length {h.get('completions/mean_length', float('nan')):.1f}, "
                  f"TRL step_time {h.get('step_time', float('nan')):.2f} s")
        if cuda:
            print(f"memory: allocated before training {before / GiB:.1f} GiB (weights {weight_bytes / GiB:.1f} + "
                  f"adapters), peak allocated {peak:.1f} GiB, peak reserved {reserved:.1f} GiB, so "
                  f"{peak - before / GiB:.1f} GiB over the weights for generation, activations and optimizer state")
    print(f"total {time.perf_counter() - started:.0f} s")
    cycle = sum(step_times[-2:])  # the last rollout batch: generation, old-policy pass, two optimizer steps
    print(f"flagship_step: peak {peak:.1f} GiB, rollout batch {cycle:.2f} s")


if __name__ == "__main__":
    main()
