"""`AsyncGSPOTrainer` under `accelerate launch` (1 or 2 CPU processes, gloo) on queued samples: the same samples in
the same order, so an optimizer step holds the same completions whatever the process count, split into micro-batches
differently: one process packs each step's 8 completions as micro-batches of 6 and 2, two processes as 2 + 2 per
micro-batch (gradient accumulation 2). A two-process run must reproduce the one-process run's losses, gradient norms,
gathered metrics and weights (each completion weighs 1 / the step's completions).

With `--nan-at-step S --nan-rank R`, rank R's sampler log-probs hold a NaN at optimizer step S (0-based): every rank
must stop there with the same error; the logs of the steps before it are kept as usual.

    accelerate launch [options] async_multiprocess_run.py OUT_DIR MODEL_DIR --loss-type gspo [--routing-replay]
Each rank writes OUT_DIR/rank<r>.json: `{"error": <message or null>}`, and on the main process also `world_size`,
`checksum` and `logs`. Files, not stdout: the ranks share one pipe, and a line printed by one can land inside the
other's.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stand-ins
from support import async_stand_ins  # noqa: E402
from support.async_stand_ins import NoWeightTransfer, QueueWorker  # noqa: E402

async_stand_ins.install()

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer  # noqa: E402
from trl_gspo.async_trainer.routing import RoutedRolloutSample  # noqa: E402

SAMPLES_PER_STEP = 8
# Completions per rank in each micro-batch of an optimizer step, by process count.
PLAN = {1: [[6], [2]], 2: [[2, 2], [2, 2]]}


class PlannedBatcher(torch.utils.data.IterableDataset):
    """Stands in for TRL's fixed-count batcher: micro-batches cut by `PLAN` (TRL's token-budget batcher makes them
    unequal by length; tests/test_async_trainer.py runs that one), rows filled in queue order, TRL's `TreeRow`s."""

    def __init__(self, dataset, num_processes, microbatch_size):
        self.dataset, self.plan = dataset, PLAN[num_processes]

    def __iter__(self):
        from trl.experimental.async_grpo.packing import TreeRow

        samples = iter(self.dataset)
        while True:
            for counts in self.plan:
                rows = [TreeRow() for _ in counts]
                for row, count in zip(rows, counts):
                    for _ in range(count):
                        row.add(next(samples))
                yield rows


def samples(steps, layers, top_k, experts):
    """Groups of 4 completions of one prompt (shared prefix), fixed random tokens, sampler log-probs near the model's
    so that GSPO's band clips some; routes random (distinct experts), one per token prefix, as one server computation
    of a shared prefix gives them: the same route wherever a packing puts a shared position."""
    rng = np.random.default_rng(0)
    out, route_of_prefix = [], {}
    for group in range(steps * SAMPLES_PER_STEP // 4):
        prompt = list(rng.integers(5, 40, 6))
        for k in range(4):
            completion = list(rng.integers(5, 40, int(rng.integers(2, 7))))
            ids = np.array(prompt + completion)
            mask = np.array([0] * 6 + [1] * len(completion))
            old = np.where(mask, -3.6 + rng.normal(0, 0.05, len(ids)), 0.0).astype(np.float32)
            for p in range(len(ids) - 1):
                route_of_prefix.setdefault(tuple(ids[:p + 1]), np.stack([rng.permutation(experts)[:top_k]
                                                                        for _ in range(layers)]))
            routes = np.stack([route_of_prefix[tuple(ids[:p + 1])] for p in range(len(ids) - 1)]).astype(np.uint8)
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
    parser.add_argument("--nan-at-step", type=int)
    parser.add_argument("--nan-rank", type=int, default=0)
    options = parser.parse_args()
    import trl_gspo.async_trainer

    trl_gspo.async_trainer.trainer.FixedCountBatcher = PlannedBatcher
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch (before any process group exists)
    tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
    tokenizer.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=options.out_dir, use_cpu=True, report_to="none", max_steps=options.steps,
                           per_device_train_batch_size=SAMPLES_PER_STEP // processes, num_generations=4,
                           gradient_accumulation_steps=2, epsilon=3e-4, epsilon_high=4e-4,  # the paper's band
                           token_budget=0, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                           learning_rate=1e-3, loss_type=options.loss_type, max_staleness=8,
                           router_aux_loss_coef=0.0,  # the load-balancing loss is per packed row: rows differ
                           routing_replay="sampler" if options.routing_replay else "none")
    trainer = AsyncGSPOTrainer(model=options.model_dir, args=args,
                               train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}), processing_class=tokenizer,
                               rollout_worker=QueueWorker(samples(options.steps + 2, 2, 2, 4)),
                               weight_transfer=NoWeightTransfer())
    rank = trainer.accelerator.process_index
    if options.nan_at_step is not None and rank == options.nan_rank:
        compute_loss = trainer.compute_loss

        def poisoned(model, inputs, *args, **kwargs):
            if trainer.state.global_step == options.nan_at_step:
                first_target = (inputs["token_index"] >= 0).nonzero()[0]
                inputs["old_log_probs"] = inputs["old_log_probs"].clone()
                inputs["old_log_probs"][tuple(first_target)] = float("nan")
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = poisoned
    error = None
    try:
        trainer.train()
    except (ValueError, RuntimeError) as raised:
        error = f"{type(raised).__name__}: {raised}"
    report = {"error": error}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    checksum = sum(float(p.detach().double().abs().sum()) for p in trainer.model.parameters())
    if trainer.accelerator.is_main_process:
        keep = ("loss", "grad_norm", "clip_ratio/region_mean", "gspo/ratio_mean", "gspo/clipped_token_fraction",
                "routing/replay_drift", "routing/unrouted_token_fraction", "ratio", "entropy")
        report.update(world_size=trainer.accelerator.num_processes, checksum=checksum,
                      logs=[{k: h[k] for k in keep if k in h} for h in logs])
    Path(options.out_dir).mkdir(parents=True, exist_ok=True)
    Path(options.out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    # Every rank has written before any exits: the launcher stops the other ranks as soon as one exits with an error
    trainer.accelerator.wait_for_everyone()
    sys.exit(1 if error is not None else 0)


if __name__ == "__main__":
    main()
