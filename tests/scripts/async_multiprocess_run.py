"""`AsyncGSPOTrainer` under `accelerate launch` (1 or 2 CPU processes, gloo) on queued samples: the same samples in
the same order, so the micro-batch (every rank's rows together) is the same whatever the process count, and a
two-process run must reproduce the one-process run's losses, gradient norms, gathered metrics and weights.

    accelerate launch [options] async_multiprocess_run.py OUT_DIR MODEL_DIR --loss-type gspo [--routing-replay]
Prints `RESULT {json}`.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stand-ins
import async_stand_ins  # noqa: E402
from async_stand_ins import NoWeightTransfer, QueueWorker  # noqa: E402

async_stand_ins.install()

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer  # noqa: E402
from trl_gspo.async_routing import RoutedRolloutSample  # noqa: E402

SAMPLES_PER_STEP = 8


def samples(steps, layers, top_k, experts):
    """Groups of 4 completions of one prompt (shared prefix), fixed random tokens, sampler log-probs near the model's
    so that GSPO's band clips some; routes random (distinct experts)."""
    rng = np.random.default_rng(0)
    out = []
    for group in range(steps * SAMPLES_PER_STEP // 4):
        prompt = list(rng.integers(5, 40, 6))
        for k in range(4):
            completion = list(rng.integers(5, 40, int(rng.integers(2, 7))))
            ids = np.array(prompt + completion)
            mask = np.array([0] * 6 + [1] * len(completion))
            old = np.where(mask, -3.6 + rng.normal(0, 0.05, len(ids)), 0.0).astype(np.float32)
            routes = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
                               for _ in range(len(ids) - 1)]).astype(np.uint8)
            out.append(RoutedRolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask,
                                           old_log_probs=old, advantage=float(k) - 1.5, model_version=0,
                                           group_id=group, metrics={"reward": float(k)}, routes=routes))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("model_dir")
    parser.add_argument("--loss-type", default="gspo")
    parser.add_argument("--routing-replay", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch (before any process group exists)
    tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
    tokenizer.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=options.out_dir, use_cpu=True, report_to="none", max_steps=options.steps,
                           per_device_train_batch_size=SAMPLES_PER_STEP // processes, num_generations=4,
                           token_budget=0, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                           learning_rate=1e-3, loss_type=options.loss_type, max_staleness=8,
                           router_aux_loss_coef=0.0,  # the load-balancing loss is per packed row: rows differ
                           routing_replay="sampler" if options.routing_replay else "none")
    trainer = AsyncGSPOTrainer(model=options.model_dir, args=args,
                               train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}), processing_class=tokenizer,
                               rollout_worker=QueueWorker(samples(options.steps + 2, 2, 2, 4)),
                               weight_transfer=NoWeightTransfer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    checksum = sum(float(p.detach().double().abs().sum()) for p in trainer.model.parameters())
    if trainer.accelerator.is_main_process:
        keep = ("loss", "grad_norm", "clip_ratio/region_mean", "gspo/ratio_mean", "gspo/clipped_token_fraction",
                "routing/replay_drift", "ratio", "entropy")
        print("RESULT " + json.dumps({"world_size": trainer.accelerator.num_processes, "checksum": checksum,
                                      "logs": [{k: h[k] for k in keep if k in h} for h in logs]}), flush=True)


if __name__ == "__main__":
    main()
