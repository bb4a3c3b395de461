"""Checkpoints that survive a kill: which `checkpoint-N` directories are complete, `resume_from_checkpoint: true /
latest`, and the buffered rollout batch that makes a resume in the middle of a rollout batch exact.

A checkpoint is written file by file (model, optimizer, scheduler, RNG states, then `trainer_state.json` last, see
`transformers.Trainer._save_checkpoint`). A SIGKILL in between leaves a directory without a valid
`trainer_state.json`, or with a truncated file; `Trainer` would still pick it as the latest and fail to load it.
`GSPOTrainer` makes `trainer_state.json` the completion mark for every rank (all ranks finish their files before
rank 0 writes it) and resumes from the newest complete checkpoint, naming each one it skips.

The file-system side (`list_checkpoints` .. `has_full_weights`) knows no trainer: the CLI checks a resume with it
before anything loads. `CheckpointMixin` wires it into `GSPOTrainer` and imports transformers only when it runs.
"""

from __future__ import annotations

import json
import logging
import os
import re

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
# Weights a complete checkpoint holds, one of (full model, sharded full model, PEFT adapter, DeepSpeed/FSDP dirs).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
LATEST_VALUES = ("true", "latest")
ROLLOUT_BUFFER = "rollout_buffer_{rank}.pt"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


class IncompleteCheckpointError(ValueError):
    """`resume_from_checkpoint` names a checkpoint that cannot be resumed; the message names the fix."""


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint directory `path` is not complete, or `None` when it is.

    Complete means: `trainer_state.json` parses (it is written last), no file is empty (a write cut short), model
    weights are present, and every shard a weights index lists exists.
    """
    if not os.path.isdir(path):
        return "it is not a directory"
    state = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state):
        return f"no {TRAINER_STATE} (the checkpoint write did not finish)"
    try:
        with open(state) as handle:
            json.load(handle)
    except (OSError, ValueError):
        return f"{TRAINER_STATE} is not valid JSON (the checkpoint write did not finish)"
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            if os.path.isfile(file) and not os.path.islink(file) and os.path.getsize(file) == 0:
                return f"{os.path.relpath(file, path)} is empty (0 bytes)"
    names = set(os.listdir(path))
    has_sharded_engine_state = any(name.startswith(("global_step", "pytorch_model_fsdp")) for name in names)
    if not names & set(WEIGHT_FILES) and not has_sharded_engine_state:
        return f"no model weights (none of {', '.join(WEIGHT_FILES)})"
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            try:
                with open(os.path.join(path, index)) as handle:
                    shards = set(json.load(handle)["weight_map"].values())
            except (OSError, ValueError, KeyError):
                return f"{index} is not a valid weights index"
            missing = sorted(shard for shard in shards if shard not in names)
            if missing:
                return f"weight shards missing: {', '.join(missing[:3])}"
    return None


def list_checkpoints(output_dir: str) -> list[str]:
    """`checkpoint-N` directories of `output_dir`, oldest (smallest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_DIR.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def latest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint of `output_dir` (or `None`), and `(path, problem)` for each newer one skipped."""
    skipped = []
    for path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def resolve_resume_from_checkpoint(value, output_dir: str, warn=logger.warning) -> str | None:
    """The checkpoint directory `Trainer.train(resume_from_checkpoint=value)` should load.

    `value` may be `None` / `False` / `"false"` / `""` (start fresh), `True` / `"true"` / `"latest"` (any case; the
    newest complete checkpoint in `output_dir`, warning about each newer incomplete one it skips), or a path to a
    checkpoint directory, which must be complete. Raises `IncompleteCheckpointError` naming the fix otherwise.
    """
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "none")):
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in LATEST_VALUES):
        latest, skipped = latest_complete_checkpoint(output_dir)
        for path, problem in skipped:
            warn(f"resume_from_checkpoint: skipping incomplete checkpoint {path}: {problem}.")
        if latest is None:
            found = f"only incomplete ones ({', '.join(p for p, _ in skipped)})" if skipped else "none"
            raise IncompleteCheckpointError(
                f"`resume_from_checkpoint`: no complete checkpoint-N directory in output_dir {output_dir!r} "
                f"(found {found}). Fix: point output_dir at the run to resume, or unset resume_from_checkpoint to "
                "start fresh."
            )
        return latest
    path = os.fspath(value)
    if not os.path.exists(path):
        raise IncompleteCheckpointError(
            f"`resume_from_checkpoint`: {path!r} does not exist. Fix: give a checkpoint-N directory, or `latest` for "
            "the newest complete checkpoint in output_dir."
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        latest, _ = latest_complete_checkpoint(os.path.dirname(os.path.abspath(path)))
        hint = f" ({latest} is the newest complete one)" if latest else ""
        raise IncompleteCheckpointError(
            f"`resume_from_checkpoint`: {path} is incomplete: {problem}. Fix: resume from `latest`, which skips "
            f"incomplete checkpoints{hint}."
        )
    return path


def rollout_buffer_path(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, ROLLOUT_BUFFER.format(rank=rank))


def _map_tensors(value, fn):
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def save_rollout_buffer(path: str, step: int, buffered_inputs, layout: dict) -> None:
    """Write one rank's buffered rollout batch (TRL's `_buffered_inputs`, the mini-batches of the current rollout
    batch) and its micro-step counter (TRL's `_step`), so a resume in the middle of a rollout batch trains on the
    same mini-batches as the uninterrupted run instead of generating a new rollout batch."""
    import torch

    payload = {"step": step, "layout": layout,
               "buffered_inputs": _map_tensors(buffered_inputs, lambda t: t.detach().cpu())}
    torch.save(payload, path)


def load_rollout_buffer(path: str, layout: dict, device) -> tuple[int, list] | str:
    """`(step, buffered_inputs)` saved by `save_rollout_buffer`, on `device`; or, when it cannot be used, the reason."""
    import torch

    if not os.path.isfile(path):
        return f"no {os.path.basename(path)} in the checkpoint"
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("layout") != layout:
        return f"it was saved with {payload.get('layout')}, this run has {layout}"
    return payload["step"], _map_tensors(payload["buffered_inputs"], lambda t: t.to(device))


def check_resume_before_launch(value, output_dir: str) -> None:
    """Resolve `resume_from_checkpoint` before any process starts (raises `IncompleteCheckpointError` with the fix);
    print the checkpoint that will be resumed and each incomplete one skipped."""
    import sys

    checkpoint = resolve_resume_from_checkpoint(
        value, output_dir, warn=lambda message: print(f"trl-gspo: warning: {message}", file=sys.stderr))
    if checkpoint is not None:
        print(f"trl-gspo: resuming from {checkpoint}", file=sys.stderr)


def rollout_layout(args, num_iterations: int) -> dict:
    """What a saved rollout batch depends on: resuming it under another layout would mis-split it."""
    return dict(world_size=args.world_size, steps_per_generation=args.steps_per_generation,
                num_iterations=num_iterations, per_device_train_batch_size=args.per_device_train_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps)


def restore_rollout_state(checkpoint: str, args, num_iterations: int, device, warn) -> tuple[int, list] | None:
    """TRL's micro-step counter and buffered rollout mini-batches saved with `checkpoint` for this rank, or None.
    None in the middle of a rollout batch means the resumed run generates a new one: `warn` says so."""
    restored = load_rollout_buffer(rollout_buffer_path(checkpoint, args.process_index),
                                   rollout_layout(args, num_iterations), device)
    if not isinstance(restored, str):
        return restored
    with open(os.path.join(checkpoint, TRAINER_STATE)) as handle:
        micro_steps = json.load(handle)["global_step"] * args.gradient_accumulation_steps
    if micro_steps % (args.steps_per_generation * num_iterations) != 0:
        warn(f"resuming from {checkpoint}, in the middle of a rollout batch, without its saved rollout batch "
             f"({restored}): a new rollout batch is generated, so training continues differently from the "
             "uninterrupted run.")
    return None


def load_full_weights(model, checkpoint: str) -> None:
    """Load a full-model checkpoint into `model` through `from_pretrained`, which applies transformers' weight
    conversions: transformers 5.x saves fused MoE experts in the hub's per-expert layout, which a plain
    `load_state_dict` would silently skip (the expert weights would keep their current values)."""
    dtype = next(model.parameters()).dtype
    restored = type(model).from_pretrained(checkpoint, dtype=dtype, device_map="cpu")
    missing, unexpected = model.load_state_dict(restored.state_dict(), strict=False)
    # Tied weights (lm_head = embed_tokens) are legitimately absent from the checkpoint.
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"resuming from {checkpoint}: checkpoint does not match the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}). Fix: resume with the model architecture the checkpoint was saved from."
        )


def has_full_weights(checkpoint: str) -> bool:
    return any(os.path.isfile(os.path.join(checkpoint, name))
               for name in ("model.safetensors", "model.safetensors.index.json"))


class CheckpointMixin:
    """Mixed into `GSPOTrainer` before TRL's `GRPOTrainer`: each method extends the `Trainer` method of its name."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint` may also be `"true"` / `"latest"` (the newest *complete*
        checkpoint in `output_dir`, skipping incomplete ones with a warning naming each). A resume in the middle of a
        rollout batch continues on the saved rollout batch, so it trains exactly as the uninterrupted run."""
        from transformers.utils import logging as hf_logging

        from .ranks import every_rank

        hf_logger = hf_logging.get_logger(__name__)  # adds `warning_once`
        warn = hf_logger.warning if self.accelerator.is_main_process else (lambda message: None)
        checkpoint = resolve_resume_from_checkpoint(resume_from_checkpoint, self.args.output_dir, warn=warn)
        if checkpoint is not None:
            restored = restore_rollout_state(checkpoint, self.args, self.num_iterations, self.accelerator.device,
                                             warn=hf_logger.warning_once)
            # Every rank resumes on its saved rollout batch or none does: a rank generating alone would meet the
            # others in different collectives (one all-reduced flag, at resume only).
            if not every_rank(self.accelerator, restored is not None) and restored is not None:
                hf_logger.warning(f"resuming from {checkpoint}: rank {self.accelerator.process_index} has its saved "
                                  "rollout batch but another rank has none, so every rank generates a new one and "
                                  "training continues differently from the uninterrupted run.")
                restored = None
            if restored is not None:
                self._step, self._buffered_inputs = restored  # TRL's micro-step counter and rollout mini-batches
            band = getattr(self, "_adaptive_band", None)
            if band is not None:  # clip_band="adaptive": the band the run had, or one line naming the band it takes
                self.epsilon_low, self.epsilon_high = band.resume(checkpoint, self.accelerator.is_main_process)
        return super().train(checkpoint, *args, **kwargs)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        save_rollout_buffer(rollout_buffer_path(output_dir, self.args.process_index), self._step,
                            self._buffered_inputs, rollout_layout(self.args, self.num_iterations))
        band = getattr(self, "_adaptive_band", None)
        if band is not None and self.args.should_save:  # the same on every rank: the main process writes it
            band.save(output_dir)
        # trainer_state.json, written next by rank 0, marks the checkpoint complete: every rank's files come first.
        self.accelerator.wait_for_everyone()

    def _save_checkpoint(self, model, trial) -> None:
        # Re-saving over a partial checkpoint of the same step: drop its old completion mark first.
        stale = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}", TRAINER_STATE)
        if self.args.should_save and os.path.isfile(stale):
            os.remove(stale)
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Resume full-model weights through `from_pretrained` (`load_full_weights`: transformers' own resume
        silently skips fused MoE experts). PEFT, DeepSpeed and FSDP checkpoints keep TRL's path."""
        from transformers import PreTrainedModel

        model = self.model if model is None else model
        if (not isinstance(model, PreTrainedModel) or not has_full_weights(resume_from_checkpoint)
                or self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_full_weights(model, resume_from_checkpoint)
