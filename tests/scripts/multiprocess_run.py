"""Run under `accelerate launch` (DDP or DeepSpeed, 1 or 2 processes): a short GSPO/GRPO run on a tiny Qwen3-MoE.

    multiprocess_run.py OUT_DIR [--loss-type gspo] [--routing-replay old] [--lora] [--save-steps N] [--resume]

The global batch is the same whatever the number of processes (8 completions per step), and sampling noise is keyed
by (prompt, copy, position) instead of by each rank's RNG stream, so one process and two draw the same completions
and their losses can be compared. Each batch is used for two optimizer steps (`num_iterations=2`): the second is
off-policy, so routing drifts and replay has something to force.

Prints one JSON line (rank 0): per-step losses, grad norms, clip and routing metrics, a checksum of the final
weights, and per rank a fingerprint of the experts its recordings hold (ranks see different prompts, so they must
route differently).
"""

import argparse
import copy
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.helpers import tiny_config, toy_dataset  # noqa: E402

from trl_gspo import GSPOTrainer  # noqa: E402
from trl_gspo.quickstart.model import build_model  # noqa: E402
from trl_gspo.quickstart.tokenizer import build_tokenizer  # noqa: E402

try:  # skip DeepSpeed's 60-80 s JIT build of a shared-memory op that gloo on CPU does not need
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
except ImportError:
    pass


class FingerprintingTrainer(GSPOTrainer):
    fingerprints: list[str] = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        recorded = output.get("routing_indices")
        if recorded is not None:
            self.fingerprints.append(hashlib.sha1(recorded.cpu().numpy().tobytes()).hexdigest()[:12])
        return output


class KeyedGumbelNoise(LogitsProcessor):
    """Gumbel-max sampling from the model's distribution with noise seeded per (row key, position)."""

    def __init__(self, keys):
        self.keys = keys

    def __call__(self, input_ids, scores):
        position = input_ids.shape[1]
        noise = torch.stack([
            -torch.empty(scores.shape[-1]).exponential_(generator=torch.Generator().manual_seed(key * 4096 + position)).log()
            for key in self.keys])
        return scores.log_softmax(-1) + noise.to(scores.device)


def keyed_sampling(model, num_generations):
    generate = model.generate

    def keyed_generate(input_ids, attention_mask, generation_config, **kwargs):
        keys = [zlib.crc32(ids[mask.bool()].cpu().numpy().tobytes()) * num_generations + row % num_generations
                for row, (ids, mask) in enumerate(zip(input_ids, attention_mask))]
        greedy = copy.deepcopy(generation_config)
        greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p = False, None, None, None
        return generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=greedy,
                        logits_processor=LogitsProcessorList([KeyedGumbelNoise(keys)]), **kwargs)

    model.generate = keyed_generate
    return model


def distinct_characters(completions, **kwargs):
    """Varies within every group from the first step on (digit_reward is mostly 0 for an untrained model)."""
    return [float(len(set(completion))) for completion in completions]


parser = argparse.ArgumentParser()
parser.add_argument("out_dir", type=Path)
parser.add_argument("--loss-type", default="grpo")
parser.add_argument("--routing-replay", default="old")
parser.add_argument("--lora", action="store_true", help="LoRA on attention and on the fused experts")
parser.add_argument("--max-steps", type=int, default=6)
parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in OUT_DIR")
parser.add_argument("--clip-band", default="fixed", help="GSPOConfig.clip_band")
cli = parser.parse_args()

torch.set_num_threads(1)
tokenizer = build_tokenizer()
world_size = int(os.environ.get("WORLD_SIZE", "1"))
args = tiny_config(cli.out_dir, loss_type=cli.loss_type, routing_replay=cli.routing_replay, steps_per_generation=1,
                   num_iterations=2, max_steps=cli.max_steps, per_device_train_batch_size=8 // world_size,
                   learning_rate=1e-2, ddp_backend="gloo" if world_size > 1 else None,
                   router_aux_loss_coef=0.0,  # the balancing loss is per rank, so it does not add up across ranks
                   save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500,
                   clip_band=cli.clip_band)
peft_config = None
if cli.lora:
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
folds = []  # with --lora: each block with the adapters folded (trl_gspo/trainer/lora.py), by pass
if cli.lora:
    import trl_gspo.trainer.lora as trainer_lora

    folding = trainer_lora.merged_adapters

    def counting(model_, experts_only=False, cache=None):  # named after its caller in trl_gspo/trainer/lora.py
        folds.append("generate" if sys._getframe(1).f_code.co_name == "folded_generate" else "old_pass")
        return folding(model_, experts_only, cache)

    trainer_lora.merged_adapters = counting
model = keyed_sampling(build_model(tokenizer, seed=0), args.num_generations)
trainer = FingerprintingTrainer(model, distinct_characters, args=args, train_dataset=toy_dataset(),
                                processing_class=tokenizer, peft_config=peft_config)
trainer.train(resume_from_checkpoint=cli.resume or None)
history = [h for h in trainer.state.log_history if "loss" in h]
fingerprints = trainer.accelerator.gather_for_metrics([trainer.fingerprints], use_gather_object=True)
bands = trainer.accelerator.gather_for_metrics(  # each rank's own band per step and at the end
    [([h.get("gspo/clip_epsilon_low") for h in history], trainer.epsilon_low, trainer.epsilon_high)],
    use_gather_object=True)
if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
        checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
else:
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
if trainer.accelerator.is_main_process:
    print("RESULT " + json.dumps({
        "world_size": trainer.accelerator.num_processes,
        "deepspeed": trainer.is_deepspeed_enabled,
        "step": [h["step"] for h in history],
        "loss": [h["loss"] for h in history],
        "grad_norm": [h["grad_norm"] for h in history],
        "clip": [h.get("clip_ratio/region_mean") for h in history],
        "drift": [h.get("routing/drift_mean") for h in history],
        "replayed": [h.get("routing/replayed_token_fraction") for h in history],
        "checksum": checksum,
        "fingerprints": fingerprints,
        "bands": bands,
        "folds": {name: folds.count(name) for name in ("generate", "old_pass")},
    }), flush=True)
trainer.end()
# Then leave without interpreter teardown. A gloo worker thread can still be destroying the last all_gather's work
# object when Python finalizes; its tensor decref needs the GIL, which a finalizing interpreter refuses by ending the
# thread, and the unwind through a noexcept frame calls std::terminate (SIGABRT after a successful run). gdb on a
# core: AsyncAllgatherWork::~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit. A barrier before
# exit does not prevent it; skipping finalization does.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
