"""Shared setup for the trainer benchmarks: one model, one rollout batch, trainers for each loss."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# name -> (trainer class name, config overrides); TRL's trainers are the baselines
ARMS = {
    "gspo": ("GSPOTrainer", dict(loss_type="gspo")),
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
    first by every benchmark, so a figure copied from its output carries its conditions."""
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
