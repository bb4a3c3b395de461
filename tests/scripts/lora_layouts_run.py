"""Run under `accelerate launch` in one layout (one process, DDP, ZeRO-2, ZeRO-3, FSDP v1 or FSDP2 on CPU): two short
GSPOTrainer runs of a tiny Qwen3-MoE with LoRA on attention and on the fused experts, HF generate, 2 mini-batches
per rollout (an old-policy pass before training; 1: none), `merge_adapters_for_rollout` on and then off, in the same
processes.

    lora_layouts_run.py OUT_DIR [--dtype bfloat16|float32] [--ds3-gather true|false] [--steps-per-generation N]

FSDP on CPU: accelerate runs no FSDP without a GPU, so under an FSDP config this script makes accelerate pick the
backend a GPU would (gloo instead of NCCL) and trains on the CPU; a test's stand-in for the GPU layout, never training.

Prints one line on the main process, `RESULT {json}`: per run (`fold`, `active`) the folded blocks by pass, the most
bytes of folded weights a rollout held (`lora/folded_rollout_bytes`), whether `model_is_whole` sees whole weights
after training (outside any gather), the base tensors that changed (gathered whole on every layout), and the logged
history without times.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.helpers import digit_reward, tiny_config, toy_dataset  # noqa: E402

try:  # skip DeepSpeed's 60-80 s JIT build of a shared-memory op that gloo on CPU does not need
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
except ImportError:
    pass

if os.environ.get("ACCELERATE_USE_FSDP") == "true":  # accelerate's backend as on a GPU, on the CPU (docstring)
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
        "gloo", DistributedType.MULTI_GPU)

from trl_gspo import GSPOTrainer  # noqa: E402
from trl_gspo.quickstart.model import build_model  # noqa: E402
from trl_gspo.quickstart.tokenizer import build_tokenizer  # noqa: E402

import trl_gspo.trainer.lora as trainer_lora  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out_dir", type=Path)
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--ds3-gather", default="true")
parser.add_argument("--steps-per-generation", type=int, default=2, help="mini-batches per rollout")
parser.add_argument("--runs", default="fold,active", help="which runs, in order: fold (merge_adapters_for_rollout "
                    "on), active (off)")
parser.add_argument("--targets", default="attention,experts", help="LoRA on attention, the fused experts, or both")
cli = parser.parse_args()
torch.set_num_threads(1)

folds = []
folding = trainer_lora.merged_adapters


def counting(model_, experts_only=False, cache=None):  # named after its caller in trl_gspo/trainer/lora.py
    folds.append("generate" if sys._getframe(1).f_code.co_name == "folded_generate" else "old_pass")
    return folding(model_, experts_only, cache)


trainer_lora.merged_adapters = counting


def vllm_name(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "base_model.model.", "module."):
        name = name.replace(wrapper, "")
    return name.replace(".base_layer", "")


def whole_base(trainer) -> dict:
    """The base (non-adapter) parameters, gathered whole on every layout, by their plain model names."""
    import contextlib

    model = trainer.model_wrapped
    gather = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    elif trainer.is_fsdp_enabled and trainer.accelerator.state.fsdp_plugin.fsdp_version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        gather = FSDP.summon_full_params(model, writeback=False)
    with gather:
        params = {}
        for name, param in model.named_parameters():
            if "lora_" in name:
                continue
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            params[vllm_name(name)] = tensor.detach().clone()
        return params


LORA_TARGETS = {}
if "attention" in cli.targets:
    LORA_TARGETS["target_modules"] = ["q_proj", "v_proj"]
if "experts" in cli.targets:
    LORA_TARGETS["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def run(fold: bool) -> dict:
    from peft import LoraConfig

    folds.clear()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0).to(getattr(torch, cli.dtype))
    before = {vllm_name(name): param.detach().clone() for name, param in model.named_parameters()}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = tiny_config(cli.out_dir / ("fold" if fold else "active"), loss_type="gspo", max_steps=4,
                       steps_per_generation=cli.steps_per_generation, per_device_train_batch_size=8 // world,
                       learning_rate=5e-2, ddp_backend="gloo" if world > 1 else None, merge_adapters_for_rollout=fold,
                       ds3_gather_for_generation=cli.ds3_gather == "true",
                       use_cpu=os.environ.get("ACCELERATE_USE_FSDP") != "true")  # FSDP: the GPU's path (above)
    trainer = GSPOTrainer(model, digit_reward, args=args, train_dataset=toy_dataset(), processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, **LORA_TARGETS))
    trainer.train()
    after = whole_base(trainer)
    assert after.keys() == before.keys(), sorted(set(after) ^ set(before))[:6]
    history = [{k: v for k, v in h.items() if "time" not in k and "runtime" not in k and "per_second" not in k}
               for h in trainer.state.log_history]
    held = [h.pop("lora/folded_rollout_bytes") for h in history if "lora/folded_rollout_bytes" in h]
    from trl_gspo.lora_merge import model_is_whole

    return {"folds": {name: folds.count(name) for name in ("generate", "old_pass")},
            "whole_between_steps": model_is_whole(trainer.accelerator.unwrap_model(trainer.model)),
            "held": max(held) if held else None,
            "base_changed": [name for name in before if not torch.equal(after[name], before[name])],
            "history": history, "is_main": trainer.accelerator.is_main_process,
            "world_size": trainer.accelerator.num_processes,
            "layout": ("fsdp%d" % trainer.accelerator.state.fsdp_plugin.fsdp_version if trainer.is_fsdp_enabled else
                       "zero%d" % trainer.accelerator.state.deepspeed_plugin.zero_stage
                       if trainer.is_deepspeed_enabled else trainer.accelerator.distributed_type.value)}


runs = {name: run(name == "fold") for name in cli.runs.split(",")}
if all([run.pop("is_main") for run in runs.values()]):
    print("RESULT " + json.dumps(runs), flush=True)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # see tests/scripts/multiprocess_run.py: a gloo worker thread can abort interpreter teardown
