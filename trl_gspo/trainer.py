"""`GSPOTrainer`: TRL's `GRPOTrainer` with GSPO's loss. Everything else (generation, rewards, advantages,
logging, distributed training, checkpoints) is TRL's own."""

from __future__ import annotations

import contextlib
import inspect
import json
import os

import torch
from transformers import PreTrainedModel
from transformers.utils import logging
from trl import GRPOTrainer

from .checkpoints import load_rollout_buffer, resolve_resume_from_checkpoint, rollout_buffer_path, save_rollout_buffer
from .config import GSPO_LOSS_TYPES, PAPER_EPSILON_HIGH, PAPER_EPSILON_LOW, GSPOConfig, validate_gspo_args
from .losses import (
    adaptive_entropy_coef,
    applied_entropy_coef,
    gspo_loss,
    gspo_token_loss,
    k3_kl,
    masked_sequence_mean,
    masked_token_mean,
    nonfinite_counts,
    raise_if_nonfinite,
    sequence_log_ratio,
)
from .model_checks import check_moe_aux_loss, check_trl_backbone, model_config

logger = logging.get_logger(__name__)  # transformers' logger: adds `warning_once`

# Arguments of `_get_per_token_logps_and_entropies` that are model inputs carried in the batch dict (images,
# token types, ...). Read from TRL's signature so new multimodal inputs are forwarded without code changes here.
_NOT_BATCH_KEYS = {"self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                   "compute_entropy", "compute_aux_loss"}
_FORWARD_BATCH_KEYS = tuple(
    name for name in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    if name not in _NOT_BATCH_KEYS
)


class GSPOTrainer(GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that adds `loss_type="gspo"` and `loss_type="gspo_token"`.

    Takes exactly `GRPOTrainer`'s arguments. `args` may be a `GSPOConfig` (paper presets for gspo types) or TRL's
    own `GRPOConfig` (a warning names the paper's values if they differ). Other loss types run TRL's code.

    The loss for gspo types (see `trl_gspo.losses`):
    `loss = mean_i [ mean_t (policy_loss_i,t * w_i,t + beta * KL_i,t) ] / gradient_accumulation_steps`
    where `w` is the product of TRL's optional token weights (off-policy sequence mask, top-entropy token mask,
    vLLM importance-sampling correction), minus TRL's entropy bonus (fixed or adaptive) and plus the MoE aux loss.
    This is TRL's `"grpo"` aggregation, so multi-process and gradient accumulation normalization match TRL's
    `loss_type="grpo"` exactly; every TRL option that shapes that loss is honoured (docs/trl_contract.md).
    """

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GSPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-GSPO")
        # Validate before TRL loads models or datasets: a bad option should cost nothing.
        validate_gspo_args(args)
        _refuse_unused_token_advantages(type(self), args)
        config = model_config(model, args)
        if config is not None:
            check_moe_aux_loss(config, args)
        if not isinstance(model, str):
            check_trl_backbone(model)
        if args.loss_type in GSPO_LOSS_TYPES:
            _warn_about_setup(args)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._setup_routing()

    # ------------------------------------------------------------------ MoE routing: record, replay, drift
    def _setup_routing(self) -> None:
        """Measure routing drift on MoE models; with `routing_replay="old"`, also force the recorded experts."""
        from .routing import RoutingReplay, RoutingReplayError, find_routers

        self.routing_replay_mode = getattr(self.args, "routing_replay", "none")
        self._routing = None
        self._old_pass_runs = runs_old_policy_pass(self.args)
        self._recordings = None  # (logps, routing indices) of each policy pass in the current generation round
        self._replay_stack = None  # open while a training micro-batch runs forward and backward
        self._replay_opened = False
        base = self.accelerator.unwrap_model(self.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        if not find_routers(base):
            if self.routing_replay_mode != "none":
                raise ValueError(f"`routing_replay`: {type(base).__name__} has no MoE router to replay. Fix: set "
                                 "routing_replay='none' (it only applies to Mixture-of-Experts models).")
            return
        try:
            self._routing = RoutingReplay(base, offload_to_cpu=getattr(self.args, "routing_replay_offload", False))
        except RoutingReplayError as err:
            if self.routing_replay_mode != "none":
                raise ValueError(f"`routing_replay`: {err}") from None
            return  # drift measurement is optional; replay was not asked for
        if not self._old_pass_runs and self.routing_replay_mode != "none":
            logger.warning_once("routing_replay='old' with fully on-policy training: TRL runs no "
                                "old-policy pass, so there is nothing to record and replay changes nothing. Set "
                                "steps_per_generation > gradient_accumulation_steps or num_iterations > 1.")

    def _generate_and_score_completions(self, inputs):
        recording = self._routing is not None and self._old_pass_runs and self.model.training
        self._recordings = [] if recording else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            recordings, self._recordings = self._recordings, None
        if recordings is None:
            return output
        # The old-policy pass is the one whose log-probs TRL stored as `old_per_token_logps` (the same tensor
        # object): identified positively, whatever the order of TRL's passes (docs/trl_contract.md).
        old_logps = output.get("old_per_token_logps")
        matches = [indices for logps, indices in recordings if logps is old_logps]
        if len(matches) == 1:
            output["routing_indices"] = matches[0]  # batch-first: TRL's shuffle/split keeps it aligned
        elif self.routing_replay_mode == "old":
            raise RuntimeError(
                f"routing_replay='old': none of the {len(recordings)} policy-model log-prob passes of this generation "
                "round produced the `old_per_token_logps` TRL stored, so the old-policy routing cannot be identified "
                "(this TRL version computes or stores them differently; see docs/trl_contract.md). Fix: use the TRL "
                "version tests/test_trl_contract.py passes with, or set routing_replay='none'."
            )
        return output

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        # During a generation round, record the routing of every pass of the policy model (the reference model
        # keeps natural routing); `_generate_and_score_completions` keeps the old-policy pass's recording.
        if self._recordings is None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        with self._routing.record() as recording:
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self._recordings.append((result[0], recording.indices))
        return result

    def _routing_replay_for(self, inputs, attention_mask):
        """The replay (or drift-only measurement) context for a training micro-batch, or None."""
        indices = inputs.get("routing_indices")
        if indices is None:
            if self.routing_replay_mode == "old" and self._old_pass_runs:
                raise RuntimeError(
                    "routing_replay='old': this off-policy training micro-batch carries no routing recorded in TRL's "
                    "old-policy pass, so it would silently train on natural routing. Cause: its rollout batch was "
                    "built without routing replay (e.g. resumed from a checkpoint saved with routing_replay='none'), "
                    "or by code that bypasses GSPOTrainer._generate_and_score_completions. Fix: resume from a "
                    "checkpoint saved with routing_replay='old' (or start from a rollout boundary), or set "
                    "routing_replay='none'."
                )
            return None
        if tuple(indices.shape[:2]) != tuple(attention_mask.shape):
            raise RuntimeError(
                f"routing_replay: the micro-batch's routing recording covers {tuple(indices.shape[:2])} (batch, "
                f"tokens) but its inputs are {tuple(attention_mask.shape)}, so the recorded experts cannot be matched "
                "to its tokens. Cause: the batch was padded, truncated or re-split after the old-policy pass. Fix: "
                "keep `routing_indices` split with the batch it was recorded on, or set routing_replay='none'."
            )
        force = None if self.routing_replay_mode == "old" else torch.zeros_like(attention_mask, dtype=torch.bool)
        return self._routing.replay(indices, mask=force, stats_mask=attention_mask)

    def _log_routing_metrics(self) -> None:
        from .routing import drift_statistics

        # Sum token counts over ranks before dividing, so the metrics are over all ranks' tokens.
        counts = self.accelerator.reduce(self._routing.token_counts.to(self.accelerator.device), reduction="sum")
        drift, overridden_fraction = drift_statistics(counts.cpu())
        metrics = self._metrics["train"]
        metrics["routing/drift_mean"].append(drift.mean().item())
        metrics["routing/drift_max"].append(drift.max().item())
        if self.routing_replay_mode == "old":
            metrics["routing/replayed_token_fraction"].append(overridden_fraction)

    def training_step(self, model, inputs, num_items_in_batch):
        if self._routing is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # The replay stays open until backward has finished (checkpointed layers re-run their routers there). The
        # ExitStack closes it with the exception of a failed forward/backward, so that exception is the one raised.
        self._replay_opened = False
        with contextlib.ExitStack() as stack:
            self._replay_stack = stack
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._replay_stack = None
        if self._replay_opened:  # closed without error: its drift statistics are complete
            self._log_routing_metrics()
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._replay_stack is not None and self.model.training:
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            replay = self._routing_replay_for(inputs, attention_mask)
            if replay is not None:
                self._replay_stack.enter_context(replay)
                self._replay_opened = True
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    # ------------------------------------------------------------------ checkpoints (see trl_gspo/checkpoints.py)
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, where `resume_from_checkpoint` may also be `"true"` / `"latest"` (the newest *complete*
        checkpoint in `output_dir`; incomplete ones are skipped with a warning naming each), and a resume in the
        middle of a rollout batch continues on the saved rollout batch, so it trains exactly as the uninterrupted
        run."""
        checkpoint = resolve_resume_from_checkpoint(
            resume_from_checkpoint, self.args.output_dir,
            warn=logger.warning if self.accelerator.is_main_process else (lambda message: None),
        )
        if checkpoint is not None:
            self._restore_rollout_buffer(checkpoint)
        return super().train(checkpoint, *args, **kwargs)

    def _rollout_layout(self) -> dict:
        return dict(world_size=self.args.world_size, steps_per_generation=self.args.steps_per_generation,
                    num_iterations=self.num_iterations, per_device_train_batch_size=self.args.per_device_train_batch_size,
                    gradient_accumulation_steps=self.args.gradient_accumulation_steps)

    def _restore_rollout_buffer(self, checkpoint: str) -> None:
        restored = load_rollout_buffer(rollout_buffer_path(checkpoint, self.args.process_index),
                                       self._rollout_layout(), self.accelerator.device)
        if not isinstance(restored, str):
            self._step, self._buffered_inputs = restored  # TRL's micro-step counter and its rollout mini-batches
            return
        with open(os.path.join(checkpoint, "trainer_state.json")) as handle:
            micro_steps = json.load(handle)["global_step"] * self.args.gradient_accumulation_steps
        if micro_steps % (self.args.steps_per_generation * self.num_iterations) != 0:
            logger.warning_once(f"resuming from {checkpoint}, in the middle of a rollout batch, without "
                       f"its saved rollout batch ({restored}): a new rollout batch is generated, so training "
                       "continues differently from the uninterrupted run.")

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        save_rollout_buffer(rollout_buffer_path(output_dir, self.args.process_index), self._step,
                            self._buffered_inputs, self._rollout_layout())
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
        """Resume model weights through `from_pretrained`, which applies transformers' weight conversions.

        transformers 5.x saves fused MoE experts in the hub's per-expert layout, but `Trainer` resumes with a plain
        `load_state_dict(strict=False)`: the expert weights are then silently *not* restored (they keep their
        current values). Loading through `from_pretrained` maps the keys back. PEFT, DeepSpeed and FSDP
        checkpoints keep TRL/transformers' own path.
        """
        model = self.model if model is None else model
        has_full_weights = any(
            os.path.isfile(os.path.join(resume_from_checkpoint, name))
            for name in ("model.safetensors", "model.safetensors.index.json")
        )
        if (not isinstance(model, PreTrainedModel) or not has_full_weights
                or self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        dtype = next(model.parameters()).dtype
        restored = type(model).from_pretrained(resume_from_checkpoint, dtype=dtype, device_map="cpu")
        missing, unexpected = model.load_state_dict(restored.state_dict(), strict=False)
        # Tied weights (lm_head = embed_tokens) are legitimately absent from the checkpoint.
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        missing = [key for key in missing if key not in tied]
        if missing or unexpected:
            raise RuntimeError(
                f"resuming from {resume_from_checkpoint}: checkpoint does not match the model (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}). Fix: resume with the model architecture the checkpoint was saved from."
            )

    # ------------------------------------------------------------------ extension point
    def token_advantages(self, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        """Advantages per completion token, `(B, T)`, used by `loss_type="gspo_token"`.

        The default broadcasts TRL's per-sequence advantages `inputs["advantages"]` (shape `(B,)`) over each
        completion's tokens, which makes `gspo_token` identical to `gspo`. Override it for per-token credit
        assignment, e.g. multi-turn RL where each turn gets its own advantage; `inputs` is the batch dict TRL
        built in `_generate_and_score_completions` (extend that method to carry extra per-sample tensors: they
        are shuffled and split with the batch). Return a float tensor of `mask`'s shape.
        """
        advantages = inputs["advantages"]
        if advantages.dim() == 2:  # a subclass already produced per-token advantages
            return advantages.expand_as(mask) if advantages.shape[1] == 1 else advantages
        return advantages[:, None].expand_as(mask)

    # ------------------------------------------------------------------ loss
    def _compute_loss(self, model, inputs):
        if self.loss_type not in GSPO_LOSS_TYPES:
            return super()._compute_loss(model, inputs)

        mode = "train" if self.model.training else "eval"
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:  # tool outputs inside a completion are not the policy's tokens
            mask = mask * inputs["tool_mask"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            # Only keys the batch has: an argument a new TRL adds keeps its default instead of receiving None.
            **{key: inputs[key] for key in _FORWARD_BATCH_KEYS if key in inputs},
        )
        # TRL skips the old-policy pass when training is fully on-policy: then pi_old = pi_theta, every ratio is 1.
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps

        if self.loss_type == "gspo":
            if inputs["advantages"].dim() == 2 and inputs["advantages"].shape[1] > 1:
                raise ValueError(
                    "`loss_type='gspo'` needs one advantage per sequence but the batch holds per-token advantages "
                    f"of shape {tuple(inputs['advantages'].shape)}. Fix: use `loss_type='gspo_token'`."
                )
            advantages = inputs["advantages"]
            out = gspo_loss(logps, old_logps, advantages, mask, self.epsilon_low, self.epsilon_high,
                            check_inputs=False, delta=self.args.delta)
        else:
            advantages = self.token_advantages(inputs, mask)
            out = gspo_token_loss(logps, old_logps, advantages, mask, self.epsilon_low, self.epsilon_high,
                                  check_inputs=False, delta=self.args.delta)
        # Checked without waiting for the device: read with the metrics below, before backward can run.
        nonfinite = nonfinite_counts(logps.detach(), old_logps, advantages, mask)

        # Optional per-token weights from TRL features, applied as TRL's "grpo" loss applies them.
        per_token_loss = out.per_token_loss
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self._off_policy_keep(inputs, logps, old_logps, mask)
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            per_token_loss = per_token_loss * entropy_mask
        else:
            entropy_mask = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if self.beta != 0.0:
            per_token_kl = k3_kl(logps, inputs["ref_per_token_logps"])
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(sequence_log_ratio(logps, old_logps, mask))[:, None]
            per_token_loss = per_token_loss + self.beta * per_token_kl

        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        policy_loss = masked_sequence_mean(per_token_loss, mask).mean()
        loss = policy_loss / accumulation
        if self._entropy_bonus_enabled:  # L = L_policy - coef * H, H the mean entropy of the trained tokens
            entropy_mask_or_all = mask if entropy_mask is None else mask * entropy_mask
            coef = applied_entropy_coef(self.entropy_coef, self._last_world_entropy, self.args.entropy_target,
                                        self.use_adaptive_entropy)
            loss = loss - coef * masked_token_mean(entropies, entropy_mask_or_all) / accumulation
            if self.use_adaptive_entropy and mode == "train":
                self._update_entropy_controller(entropies, entropy_mask_or_all)
            if mode == "train" and self.accelerator.sync_gradients:  # TRL's metric, once per optimizer step
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation

        self._log_gspo_metrics(mode, out, mask, entropies.detach(), policy_loss.detach(),
                               per_token_kl.detach() if self.beta != 0.0 else None,
                               aux_loss.detach() if self.aux_loss_enabled else None, nonfinite)
        return loss

    def _update_entropy_controller(self, entropies, mask):
        """TRL's adaptive entropy controller state (`entropy_coef`, `_last_world_entropy`, saved with checkpoints by
        TRL): sum entropy and token counts over the micro-batches of an accumulation window, then at the optimizer
        step take the mean over all ranks' tokens and move the coefficient for the next step."""
        stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach().float()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        entropy = (totals[0] / totals[1].clamp(min=1.0)).item()  # one sync per optimizer step
        args = self.args
        self.entropy_coef = adaptive_entropy_coef(self.entropy_coef, entropy, args.entropy_target,
                                                  args.entropy_coef_delta, args.entropy_coef_min, args.entropy_coef_max)
        self._last_world_entropy, self._entropy_window_stats = entropy, None

    def _off_policy_keep(self, inputs, logps, old_logps, mask):
        """TRL's off-policy sequence mask (DeepSeek-V3.2), `(B, 1)`: drop negative-advantage sequences whose
        sampling policy drifted more than `off_policy_mask_threshold` (mean per-token KL)."""
        advantages = inputs["advantages"]
        if advantages.dim() == 2 and advantages.shape[1] > 1:
            raise ValueError(
                "`off_policy_mask_threshold` keeps or drops whole sequences by the sign of their advantage, which "
                "per-token advantages do not define. Fix: unset `off_policy_mask_threshold`."
            )
        return self.get_off_policy_mask(
            advantages=advantages.reshape(-1, 1),
            per_token_logps=logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logps),
            mask=mask,
            off_policy_threshold=self.off_policy_mask_threshold,
        )

    # ------------------------------------------------------------------ metrics
    def _log_gspo_metrics(self, mode, out, mask, entropies, policy_loss, per_token_kl, aux_loss, nonfinite):
        """Logged through TRL's `_metrics`, so every `report_to` backend receives them. See docs/metrics.md.

        All values are computed on the device, reduced over ranks with one `reduce` and one `gather`, and read to
        the host in one transfer, together with the NaN/Inf counts of the loss inputs: the step waits for the device
        once here instead of once per metric and check. A non-finite input raises before backward, on every rank
        (the counts are summed over ranks)."""
        acc = self.accelerator
        mask = mask.float()
        one = torch.ones((), device=mask.device)
        # Sums over every rank's tokens (token means) and over ranks (per-rank means), in one reduce.
        sums = {
            "tokens": mask.sum(),
            "entropy": (entropies.float() * mask).sum(),
            "clipped": ((out.low_clipped | out.high_clipped).float() * mask).sum(),
            "policy_loss": policy_loss.float(),
            "ranks": one,
        }
        if per_token_kl is not None:
            sums["kl"] = (per_token_kl.float() * mask).sum()
        if self.args.delta is not None:
            sums["delta_clipped"] = (out.delta_clipped.float() * mask).sum()
        if aux_loss is not None:
            sums["aux_loss"] = aux_loss.float()
        reduced = acc.reduce(torch.cat([nonfinite.float(), torch.stack(list(sums.values()))]), reduction="sum")
        nonfinite, totals = reduced[:3], dict(zip(sums, reduced[3:]))
        tokens = totals["tokens"].clamp(min=1.0)

        # Per-sequence values of every rank, in one gather. A sequence counts as clipped if its ratio was (for
        # gspo_token with per-token advantages: if any of its tokens was).
        per_sequence = acc.gather(torch.stack([
            out.low_clipped.any(-1).float(), out.high_clipped.any(-1).float(),
            (out.low_clipped | out.high_clipped).any(-1).float(), out.log_ratio.float(), (mask.sum(-1) > 0).float(),
        ], dim=1))
        low, high, region, log_ratio, nonempty = per_sequence.unbind(1)
        # Ratio statistics over non-empty sequences (all 1 / 0 when there is none).
        nonempty = nonempty.bool()
        count = nonempty.sum()
        log_ratio = torch.where(nonempty, log_ratio, torch.zeros_like(log_ratio))
        ratio = log_ratio.exp()
        ratio_mean = (ratio * nonempty).sum() / count.clamp(min=1)
        ratio_var = ((ratio - ratio_mean) ** 2 * nonempty).sum() / (count - 1).clamp(min=1)
        inf = torch.full_like(ratio, float("inf"))

        values = {
            "entropy": totals["entropy"] / tokens,
            "policy_loss": totals["policy_loss"] / totals["ranks"],
            "clip_ratio/low_mean": low.mean(), "clip_ratio/low_min": low.min(),
            "clip_ratio/high_mean": high.mean(), "clip_ratio/high_max": high.max(),
            "clip_ratio/region_mean": region.mean(),
            # The paper's "fraction of clipped tokens": completion tokens whose objective term was clipped.
            "gspo/clipped_token_fraction": totals["clipped"] / tokens,
            "gspo/ratio_mean": torch.where(count > 0, ratio_mean, one),
            "gspo/ratio_std": torch.where(count > 1, ratio_var.sqrt(), 0 * one),
            "gspo/ratio_min": torch.where(count > 0, torch.where(nonempty, ratio, inf).min(), one),
            "gspo/ratio_max": torch.where(count > 0, torch.where(nonempty, ratio, -inf).max(), one),
            "gspo/log_ratio_abs_max": log_ratio.abs().max(),
        }
        if per_token_kl is not None:
            values["kl"] = totals["kl"] / tokens
        if aux_loss is not None:
            values["aux_loss"] = totals["aux_loss"] / totals["ranks"]
        if self.args.delta is not None:
            values["gspo/delta_clipped_token_fraction"] = totals["delta_clipped"] / tokens
        host = torch.cat([nonfinite, torch.stack(list(values.values())).float()]).tolist()  # the one sync
        raise_if_nonfinite(host[:3])
        metrics = self._metrics[mode]
        for name, value in zip(values, host[3:]):
            metrics[name].append(value)


def _refuse_unused_token_advantages(trainer_cls, args) -> None:
    """Only `loss_type="gspo_token"` calls `token_advantages`; an override under any other loss type would be
    silently ignored (training would run on per-sequence advantages), so refuse it at construction."""
    if trainer_cls.token_advantages is GSPOTrainer.token_advantages or args.loss_type == "gspo_token":
        return
    raise ValueError(
        f"`loss_type`: {trainer_cls.__name__} overrides `token_advantages`, which only loss_type='gspo_token' "
        f"calls; with loss_type={args.loss_type!r} the override would be silently ignored. "
        "Fix: set loss_type='gspo_token' (or remove the override)."
    )


def runs_old_policy_pass(args) -> bool:
    """Whether TRL computes `old_per_token_logps` (its condition in `_generate_and_score_completions`): only when a
    rollout batch outlives one optimizer step, or for vLLM importance-sampling correction. Otherwise training is
    fully on-policy and every importance ratio is exactly 1."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(
        args.use_vllm and args.vllm_importance_sampling_correction
    )


def _warn_about_setup(args) -> None:
    if not isinstance(args, GSPOConfig):
        epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        if (args.epsilon, epsilon_high) != (PAPER_EPSILON_LOW, PAPER_EPSILON_HIGH):
            logger.warning_once(
                f"loss_type={args.loss_type!r} with TRL's GRPOConfig: clip range epsilon={args.epsilon}, "
                f"epsilon_high={epsilon_high}. The GSPO paper uses epsilon=3e-4, epsilon_high=4e-4, beta=0 and "
                "steps_per_generation = 4 x gradient_accumulation_steps; trl_gspo.GSPOConfig applies these "
                "by default.",
            )
    if not runs_old_policy_pass(args):
        logger.warning_once(
            f"loss_type={args.loss_type!r} with steps_per_generation={args.steps_per_generation}, "
            f"num_iterations={args.num_iterations}, gradient_accumulation_steps={args.gradient_accumulation_steps}: "
            "training is fully on-policy, so every importance ratio is exactly 1 and nothing is ever clipped "
            "(GSPO then coincides with GRPO). For the paper's off-policy setup set steps_per_generation to "
            "4 x gradient_accumulation_steps or num_iterations > 1.",
        )
