"""Checkpoints inside the trainer: resume from the newest complete checkpoint, the rollout batch saved with each
checkpoint (a resume in the middle of a rollout batch trains exactly as the uninterrupted run), completion marks,
and full-weight loading that keeps fused MoE experts. The file-system side is `trl_gspo.checkpoints`."""

from __future__ import annotations

import os

from transformers import PreTrainedModel
from transformers.utils import logging

from .checkpoints import (has_full_weights, load_full_weights, resolve_resume_from_checkpoint, restore_rollout_state,
                          rollout_buffer_path, rollout_layout, save_rollout_buffer)

logger = logging.get_logger(__name__)


class CheckpointMixin:
    """Mixed into `GSPOTrainer` before TRL's `GRPOTrainer`: each method extends the `Trainer` method of its name."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint` may also be `"true"` / `"latest"` (the newest *complete*
        checkpoint in `output_dir`, skipping incomplete ones with a warning naming each). A resume in the middle of a
        rollout batch continues on the saved rollout batch, so it trains exactly as the uninterrupted run."""
        warn = logger.warning if self.accelerator.is_main_process else (lambda message: None)
        checkpoint = resolve_resume_from_checkpoint(resume_from_checkpoint, self.args.output_dir, warn=warn)
        if checkpoint is not None:
            restored = restore_rollout_state(checkpoint, self.args, self.num_iterations, self.accelerator.device,
                                             warn=logger.warning_once)
            if restored is not None:
                self._step, self._buffered_inputs = restored  # TRL's micro-step counter and rollout mini-batches
        return super().train(checkpoint, *args, **kwargs)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        save_rollout_buffer(rollout_buffer_path(output_dir, self.args.process_index), self._step,
                            self._buffered_inputs, rollout_layout(self.args, self.num_iterations))
        # trainer_state.json, written next by rank 0, marks the checkpoint complete: every rank's files come first.
        self.accelerator.wait_for_everyone()

    def _save_checkpoint(self, model, trial) -> None:
        # Re-saving over a partial checkpoint of the same step: drop its old completion mark first.
        stale = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}",
                             "trainer_state.json")
        if self.args.should_save and os.path.isfile(stale):
            os.remove(stale)
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Resume full-model weights through `from_pretrained` (`checkpoints.load_full_weights`: transformers'
        own resume silently skips fused MoE experts). PEFT, DeepSpeed and FSDP checkpoints keep TRL's path."""
        model = self.model if model is None else model
        if (not isinstance(model, PreTrainedModel) or not has_full_weights(resume_from_checkpoint)
                or self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_full_weights(model, resume_from_checkpoint)
