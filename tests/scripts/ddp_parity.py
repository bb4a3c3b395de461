"""Run under `accelerate launch --multi_gpu --num_processes 2`: GSPO vs TRL's sequence-level GRPO, same seed.

Prints one JSON line (rank 0): the per-step losses and grad norms of both trainers, and the weights' checksum.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.helpers import digit_reward, tiny_config, toy_dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_gspo import GSPOTrainer  # noqa: E402
from trl_gspo.quickstart.model import build_model  # noqa: E402
from trl_gspo.quickstart.tokenizer import build_tokenizer  # noqa: E402

out_dir = Path(sys.argv[1])
torch.set_num_threads(1)
tokenizer = build_tokenizer()
common = dict(steps_per_generation=4, max_steps=4, per_device_train_batch_size=4, ddp_backend="gloo")
runs = {}
for name, cls, cfg in [
    ("gspo", GSPOTrainer, tiny_config(out_dir / "gspo", loss_type="gspo", clip_band="fixed", **common)),
    ("trl", GRPOTrainer, tiny_config(out_dir / "trl", config_cls=GRPOConfig, loss_type="grpo",
                                     importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, **common)),
]:
    trainer = cls(build_model(tokenizer, seed=0), digit_reward, args=cfg, train_dataset=toy_dataset(),
                  processing_class=tokenizer)
    trainer.train()
    history = trainer.state.log_history
    runs[name] = {
        "loss": [h["loss"] for h in history if "loss" in h],
        "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
        "clip": [h.get("clip_ratio/region_mean") for h in history if "loss" in h],
        "checksum": float(sum(p.double().sum() for p in trainer.model.parameters())),
        "world_size": trainer.accelerator.num_processes,
    }
if runs["gspo"]["world_size"] and trainer.accelerator.is_main_process:
    print("RESULT " + json.dumps(runs), flush=True)
trainer.end()
# Then leave without interpreter teardown. A gloo worker thread can still be destroying the last all_gather's work
# object when Python finalizes; its tensor decref needs the GIL, which a finalizing interpreter refuses by ending the
# thread, and the unwind through a noexcept frame calls std::terminate (SIGABRT after a successful run). gdb on a
# core: AsyncAllgatherWork::~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit. A barrier before
# exit does not prevent it; skipping finalization does.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
