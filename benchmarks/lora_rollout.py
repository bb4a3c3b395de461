"""LoRA on attention and the fused experts: a rollout's time with PEFT's adapters active vs folded into the weights
(trl_gspo/lora_merge.py), measured side by side, arms interleaved.

    python benchmarks/lora_rollout.py                  # CPU size (benchmarks/_setup.py "cpu"), bf16
    python benchmarks/lora_rollout.py --size gpu       # Qwen3-30B-A3B layer widths, 4 layers, bf16, CUDA
    python benchmarks/lora_rollout.py --size gpu --step-memory 4096,256 --step-batch 2
        # also: peak memory of one LoRA training step (forward, backward, AdamW; checkpointing) at that length

Arms, median over `--repeats`:
- HF generate, `--batch` prompts x `--new-tokens` tokens (every completion full length): time per decode step,
  adapters active (PEFT rebuilds W + delta of every expert of a layer in every forward) vs the experts folded for
  the call (as GSPOTrainer's rollouts do; attention adapters stay active).
- the old-policy pass: `--micro-batches` no-grad forwards of `--batch` x `--seq-len` tokens, active vs the experts
  folded once for all of them (what GSPOTrainer does; bit for bit the active forward, checked here too).
- folding the experts (enter and leave `merged_adapters`) beside PEFT's merge_adapter + unmerge_adapter (all).

Prints the header, one line per arm, `folded_memory_gib` (the extra copy a folded rollout holds), and last
`lora_rollout: <generate active / folded> (target > 1: folding pays)`.
"""

import argparse
import os
import statistics
import sys
import time

import torch

from trl_gspo.lora_merge import adapter_targets, merged_adapters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def lora_model(size: str, device: str, dtype, rank: int):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = _setup.build(size, device, dtype)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(model, config)
    with torch.no_grad():  # trained adapters: B is zero at PEFT's init
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1e-3)
    return model.eval(), tokenizer


def step_memory(model, device, batch, prompt, completion):
    """Peak GiB above the weights, adapters and AdamW state of one LoRA step at `batch` x (prompt + completion)."""
    model.train()
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + completion), device=device)
    for step in range(2):  # the first step creates AdamW's state
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated()
    return (peak - before) / 2**30, peak / 2**30


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(_setup.SIZES), default="cpu")
    parser.add_argument("--device", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=None, help="prompts per generate call / rows per micro-batch")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row of the old-policy pass")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-memory", default=None, help="PROMPT,COMPLETION tokens: measure a LoRA step (CUDA)")
    parser.add_argument("--step-batch", type=int, default=2)
    args = parser.parse_args()
    gpu = args.size == "gpu"
    device = args.device or ("cuda" if gpu else "cpu")
    batch = args.batch or (64 if gpu else 8)
    new_tokens = args.new_tokens or (64 if gpu else 16)
    seq_len = args.seq_len or (1024 if gpu else 128)
    dtype = torch.bfloat16
    _setup.header("lora_rollout", device, dtype, _setup.size_kernel(args.size))
    torch.manual_seed(0)
    model, tokenizer = lora_model(args.size, device, dtype, args.rank)
    targets = adapter_targets(model)
    extra = sum(t.parameter.numel() * t.parameter.element_size() for t in targets) / 2**30
    experts = sum(t.parameter.numel() * t.parameter.element_size() for t in targets if t.expert_stack) / 2**30
    print(f"model: {args.size} size, LoRA r {args.rank} on q/k/v/o and the fused experts, {len(targets)} adapted "
          f"tensors", flush=True)

    prompts = torch.randint(3, model.config.vocab_size, (batch, 8), device=device)
    rows = [torch.randint(3, model.config.vocab_size, (batch, seq_len), device=device)
            for _ in range(args.micro_batches)]

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    def generate_folded():  # as GSPOTrainer folds a rollout: the experts (attention LoRA stays active)
        with merged_adapters(model, experts_only=True, cache={}):
            return generate()

    def old_pass():
        with torch.no_grad():
            return [model(input_ids=ids).logits[:, -1].float() for ids in rows]

    def old_pass_folded():
        with merged_adapters(model, experts_only=True, cache={}):  # built once for all micro-batches
            return old_pass()

    def peft_merge():
        with torch.no_grad():
            model.merge_adapter()
            model.unmerge_adapter()

    def fold():
        with merged_adapters(model, experts_only=True, cache={}):
            pass

    arms = {"generate_active": generate, "generate_folded": generate_folded, "old_pass_active": old_pass,
            "old_pass_folded": old_pass_folded, "fold": fold, "peft_merge_unmerge": peft_merge}
    times = {name: [] for name in arms}
    outputs = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, fn in arms.items():
            seconds, outputs[name] = _timed(fn, device)
            if repeat:
                times[name].append(seconds)
    median = {name: statistics.median(values) for name, values in times.items()}
    exact = all(torch.equal(a, b) for a, b in zip(outputs["old_pass_active"], outputs["old_pass_folded"]))
    same_tokens = torch.equal(outputs["generate_active"], outputs["generate_folded"])
    per_step = {name: median[f"generate_{name}"] / new_tokens * 1e3 for name in ("active", "folded")}
    print(f"generate, {batch} x {new_tokens} tokens, per decode step: active {per_step['active']:.2f} ms, folded "
          f"{per_step['folded']:.2f} ms (the fold included): {per_step['active'] / per_step['folded']:.2f}x; "
          f"same tokens: {same_tokens}",
          flush=True)
    print(f"old-policy pass, {args.micro_batches} x {batch} x {seq_len} tokens: active "
          f"{median['old_pass_active']:.3f} s, experts folded once {median['old_pass_folded']:.3f} s: "
          f"{median['old_pass_active'] / median['old_pass_folded']:.2f}x; bit for bit equal: {exact}", flush=True)
    print(f"fold + unfold (merged_adapters) {median['fold']:.3f} s; PEFT merge_adapter + unmerge_adapter "
          f"{median['peft_merge_unmerge']:.3f} s", flush=True)
    print(f"folded_memory_gib: {experts:.2f} (the adapted expert weights, held through a rollout; "
          f"{extra:.2f} with attention too, as a weight sync sends them, one tensor at a time)", flush=True)
    if args.step_memory:
        if torch.device(device).type != "cuda":
            print("step memory: skipped (needs CUDA)")
        else:
            prompt, completion = (int(n) for n in args.step_memory.split(","))
            above, peak = step_memory(model, device, args.step_batch, prompt, completion)
            print(f"LoRA step, {args.step_batch} x ({prompt} + {completion}) tokens, checkpointing: peak "
                  f"{peak:.1f} GiB, {above:+.1f} GiB above weights, adapters and AdamW state", flush=True)
    if not (exact and same_tokens):
        raise SystemExit("folded experts changed the old-policy pass or the generated tokens")
    print(f"lora_rollout: {median['generate_active'] / median['generate_folded']:.3f} (target > 1: folding pays)")


if __name__ == "__main__":
    main()
