"""Shared setup for the benchmarks: the model sizes, trainers for each loss, host-read counting, the header line
every benchmark prints first, and the MoE task the mechanism, stress and sampler benchmarks train on."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# name -> (trainer class name, config overrides); TRL's trainers are the baselines
ARMS = {
    "gspo": ("GSPOTrainer", dict(loss_type="gspo")),  # the default band: the paper's, fixed
    "gspo_adaptive_band": ("GSPOTrainer", dict(loss_type="gspo", clip_band="adaptive")),  # the band set by the run
    "trl_sequence_grpo": ("GRPOTrainer", dict(loss_type="grpo", importance_sampling_level="sequence",
                                              epsilon=3e-4, epsilon_high=4e-4)),
    "trl_token_grpo": ("GRPOTrainer", dict(loss_type="grpo", importance_sampling_level="token",
                                           epsilon=0.2, epsilon_high=0.27)),
    "grpo": ("GSPOTrainer", dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2,
                                 epsilon_high=0.27)),
    "grpo_routing_replay": ("GSPOTrainer", dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2,
                                                epsilon_high=0.27, routing_replay="old")),
}
SIZES = {  # overrides of trl_gspo/quickstart/tiny_qwen3_moe.json
    "tiny": {},  # the quickstart's model itself (the benchmarks' smoke tests)
    "cpu": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                num_experts=16, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                max_position_embeddings=512),
    # Qwen3-30B-A3B layer shapes, 4 layers, with the experts kernel a real checkpoint gets from `from_pretrained`
    # (transformers' default, grouped_mm), not the tiny model's eager loop (21x slower per step on an H100).
    "gpu": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
                num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                max_position_embeddings=4096, experts_implementation=None),
}


def experts_kernel(model) -> str:
    """The MoE experts implementation a model runs (eager, batched_mm, grouped_mm, ...), or "dense"."""
    config = model.config.get_text_config()
    if not any(hasattr(config, k) for k in ("num_experts", "num_local_experts")):
        return "dense"
    return str(getattr(config, "_experts_implementation", None) or "transformers default")


def size_kernel(size: str) -> str:
    """The experts kernel of `build(size, ...)`, without building the model."""
    from trl_gspo.quickstart.model import load_tiny_moe_config

    return str(load_tiny_moe_config(config_overrides=SIZES[size])._experts_implementation or "transformers default")


def header(name: str, device, dtype, kernel: str) -> str:
    """One line naming what a benchmark measured on: device, dtype, experts kernel, versions and commit. Printed
    first by every benchmark, so a figure copied from its output keeps its conditions."""
    import importlib.metadata
    import platform
    import subprocess

    device = torch.device(device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.machine()}, {torch.get_num_threads()} threads"
    versions = []
    for package in ("torch", "transformers", "trl", "trl-gspo"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} -")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        commit = "-"
    line = (f"# {name}: device {device.type} = {where} | dtype {str(dtype).replace('torch.', '')} | experts kernel "
            f"{kernel} | {', '.join(versions)} | commit {commit}")
    print(line, flush=True)
    return line


def build(size: str, device: str, dtype: torch.dtype, seed: int = 0):
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, config_overrides=SIZES[size], seed=seed).to(device, dtype)
    return model, tokenizer


def dataset(count: int = 512):
    from trl_gspo.quickstart.addition import make_rl_dataset

    return make_rl_dataset(count, seed=0)


def length_reward(completions, **kwargs):
    """Varies within every group, so advantages are non-zero."""
    return [float(len(c)) for c in completions]


def trainer(arm: str, model, tokenizer, output_dir: str, device: str, dtype: torch.dtype, completion_length: int,
            batch: int, trainer_cls=None, **overrides):
    import trl

    import trl_gspo

    class_name, arm_overrides = ARMS[arm]
    cls = trainer_cls or getattr(trl_gspo if class_name == "GSPOTrainer" else trl, class_name)
    config_cls = trl_gspo.GSPOConfig if class_name == "GSPOTrainer" else trl.GRPOConfig
    args = config_cls(
        output_dir=output_dir, use_cpu=device == "cpu", bf16=dtype == torch.bfloat16, report_to="none",
        per_device_train_batch_size=batch, num_generations=8, steps_per_generation=4, gradient_accumulation_steps=1,
        max_completion_length=completion_length, temperature=1.0, beta=0.0, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, gradient_checkpointing=False,
        # every completion has the full length, so all arms process the same number of tokens
        generation_kwargs={"min_new_tokens": completion_length}, **{**arm_overrides, **overrides})
    built = cls(copy.deepcopy(model), length_reward, args=args, train_dataset=dataset(), processing_class=tokenizer)
    built.current_gradient_accumulation_steps = 1  # normally set by train(); the losses divide by it
    from transformers import PrinterCallback

    built.remove_callback(PrinterCallback)  # the benchmarks print their own summary
    return built


class _ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), bool(t), int(t), float(t)
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads():
    """Count the reads of tensor values by the host inside the block: each waits for the device on a GPU (a
    device-to-host sync). Counted on any device, so a CPU run measures how often a GPU step would stall:
    `.item()`/`bool()`/`int()`/`float()` (seen by a dispatch mode) and `.tolist()`/`.cpu()`/`.numpy()` calls.
    Yields a dict whose `"count"` is filled in on exit."""
    result = {"count": 0}
    calls = {"count": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def counting(original):
        def wrapper(self, *args, **kwargs):
            calls["count"] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        with _ScalarReads() as scalars:
            yield result
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    result["count"] = scalars.count + calls["count"]


# ---------------------------------------------------------------------------------------------------- the MoE task
# Shared by moe_mechanism.py, moe_stress.py and sampler_mismatch.py: a small Qwen3-MoE pretrained on addition
# strings so that its experts specialise (cached by config), rollouts of three sums, and per-token log-probs.
GRPO_LOW, GRPO_HIGH = 0.2, 0.27  # the paper's tuned GRPO clip range: r_t in [0.8, 1.27]
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4  # GSPO's clip range on s_i
N_SUMS = 3  # sums per prompt: completions are ~10 tokens ("46 72 89<eos>")

MODELS = {  # (experts, top-k) -> overrides of trl_gspo/quickstart/tiny_qwen3_moe.json
    (e, k): dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=e, num_experts_per_tok=k,
                 router_aux_loss_coef=0.0, experts_implementation="grouped_mm")
    for e, k in ((8, 2), (32, 4), (64, 8))
}
QUICK_MODEL = dict(MODELS[(8, 2)], num_hidden_layers=2, hidden_size=64, head_dim=16)


# ---------------------------------------------------------------------------------------------------- the task
def make_problem(rng: random.Random) -> tuple[str, str]:
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(N_SUMS)]
    return " ".join(f"{a}+{b}" for a, b in pairs) + "=", " ".join(str(a + b) for a, b in pairs)


def reward(completion: str, answer: str) -> float:
    """Partial credit: per sum, the fraction of its digits right (position by position), averaged over the sums."""
    got, want = completion.split(), answer.split()
    got += [""] * (len(want) - len(got))
    return sum(sum(a == b for a, b in zip(g, w)) / max(len(g), len(w)) for g, w in zip(got, want)) / len(want)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # Explicit position ids from the attention mask, so that extra left padding changes only the numerics.
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pretrain(overrides: dict, steps: int, cache: Path, log, device: str = "cpu") -> torch.nn.Module:
    """Language-model training on addition strings, so the experts specialise. Cached by config (not by device:
    the weights are the same computation's, trained in float32 wherever it ran)."""
    from transformers import AutoModelForCausalLM

    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import EOS_TOKEN, build_tokenizer

    key = hashlib.sha256(json.dumps([overrides, steps, N_SUMS, "v1"], sort_keys=True).encode()).hexdigest()[:12]
    folder = cache / key
    if (folder / "done").exists():
        return AutoModelForCausalLM.from_pretrained(folder, experts_implementation=overrides["experts_implementation"]
                                                    ).to(device)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(tokenizer, config_overrides=overrides, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    rng = random.Random(0)
    started = time.perf_counter()
    loss = torch.tensor(float("nan"))  # steps=0: the untrained control
    for step in range(steps):
        texts = [p + a + EOS_TOKEN for p, a in (make_problem(rng) for _ in range(64))]
        batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, position_ids=_positions(batch["attention_mask"]), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    log(f"pretrained {overrides['num_experts']} experts top-{overrides['num_experts_per_tok']}: {steps} steps, "
        f"final LM loss {loss.item():.3f}, {time.perf_counter() - started:.0f}s (cached in {folder})")
    model.save_pretrained(folder)
    (folder / "done").write_text("")
    return model


# ---------------------------------------------------------------------------------------------------- RL pieces
@torch.no_grad()
def rollout(model, tokenizer, rng: random.Random, prompts: int, group: int, max_new: int = 14) -> dict:
    problems = [make_problem(rng) for _ in range(prompts)]
    texts = [p for p, _ in problems for _ in range(group)]
    answers = [a for _, a in problems for _ in range(group)]
    enc = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    model.eval()
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    prompt_len = enc["input_ids"].shape[1]
    completion = out[:, prompt_len:]
    is_eos = completion == tokenizer.eos_token_id
    # completion tokens up to and including the first <eos>
    completion_mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0
    completion = completion.masked_fill(~completion_mask, tokenizer.pad_token_id)
    rewards = torch.tensor([reward(tokenizer.decode(c[m], skip_special_tokens=True), a)
                            for c, m, a in zip(completion.cpu(), completion_mask.cpu(), answers)], device=model.device)
    grouped = rewards.view(prompts, group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    attention_mask = torch.cat([enc["attention_mask"], completion_mask.long()], dim=1)
    return dict(input_ids=torch.cat([enc["input_ids"], completion], dim=1), attention_mask=attention_mask,
                completion_mask=completion_mask, prompt_len=prompt_len, rewards=rewards, advantages=advantages)


def token_logps(model, batch: dict, rows=slice(None)) -> torch.Tensor:
    """log pi(y_t) of every completion token, [rows, completion_len] (padding positions hold garbage)."""
    ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    start = batch["prompt_len"]
    scoring = logits[:, start - 1:-1].float().log_softmax(-1)  # position t-1 scores token t
    return scoring.gather(-1, ids[:, start:, None]).squeeze(-1)
