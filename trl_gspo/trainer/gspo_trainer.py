"""`GSPOTrainer`: TRL's `GRPOTrainer` with GSPO's loss. Everything else (generation, rewards, advantages,
logging, distributed training, checkpoints) is TRL's own."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers.utils import logging
from trl import GRPOTrainer

from .. import metrics as gspo_metrics
from ..checkpoints import CheckpointMixin
from ..config import (DEFAULT_MIN_ROUTE_AGREEMENT, GSPO_LOSS_TYPES, PAPER_EPSILON_HIGH,
                     PAPER_EPSILON_LOW, GSPOConfig, default_output_dir, launch_summary, refuse_unused_token_advantages,
                     runs_old_policy_pass, setup_summary, validate_gspo_args, warn_about_setup)
from ..losses import (adaptive_entropy_coef, applied_entropy_coef, entropy_window_stats, gspo_loss, gspo_token_loss,
                      masked_sequence_mean, masked_token_mean, nonfinite_counts)
from ..ranks.phases import RanksStopTogether, agreed_server_sync, server_guards
from ..sampling.engine import check_sampler_at_start, engine_options, trainer_engine_options
from ..sampling.mismatch import SamplerWatch, log_turns, sampling_metrics
from ..sampling.old_logps import SamplerOldLogps
from ..sampling.routes import capture_routes
from .clip_band import AdaptiveClipBand, ClipBandStep, band_columns, band_stats, trl_group_rewards_differ
from .lora import TrainerLora
from .model_checks import check_model
from .routing import TrainerRouting, _first_adapter_layer, _reference_pass
from .tool_lockstep import ToolTurnsMixin
from .trl_options import apply_trl_options

logger = logging.get_logger(__name__)  # transformers' logger: adds `warning_once`

# Arguments of `_get_per_token_logps_and_entropies` that are model inputs held in the batch dict (images,
# token types, ...). Read from TRL's signature so new multimodal inputs are forwarded without code changes here.
_NOT_BATCH_KEYS = {"self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                   "compute_entropy", "compute_aux_loss"}
_FORWARD_BATCH_KEYS = tuple(
    name for name in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    if name not in _NOT_BATCH_KEYS
)


def _band_row_stats(rows, present):  # the band's columns follow `metrics.per_sequence_values`'s
    return band_stats(rows, present, gspo_metrics.PER_SEQUENCE_COLUMNS)


class GSPOTrainer(RanksStopTogether, CheckpointMixin, ToolTurnsMixin, GRPOTrainer):
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
            args = GSPOConfig(output_dir=default_output_dir(model, "GSPO"))
        # Validate before TRL loads models or datasets: a bad option should cost nothing.
        validate_gspo_args(args)
        refuse_unused_token_advantages(type(self).token_advantages is not GSPOTrainer.token_advantages,
                                       type(self).__name__, args.loss_type)
        check_model(model, args)  # trl_gspo/trainer/model_checks.py: unsupported architectures fail here, not mid-step
        if args.loss_type in GSPO_LOSS_TYPES:
            warn_about_setup(args)
        with engine_options(**trainer_engine_options(args)) if args.use_vllm else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        base = self.accelerator.unwrap_model(self.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        # warns on a dtype gap; server mode with R3: refuses a server that returns no routes (`trl-gspo vllm-serve`)
        dtypes = check_sampler_at_start(self, base)
        self._sampler_watch = SamplerWatch(getattr(args, "routing_replay_min_agreement", DEFAULT_MIN_ROUTE_AGREEMENT),
                                           dtypes)
        self._adapter_layer = _first_adapter_layer(base)
        # old_logps="sampler", or None; it compares the sampler's gap with the band in use (`_clip_band`)
        self._sampler_logps = SamplerOldLogps.build(self, self._clip_band, dtypes,
                                                     warns=self.loss_type in GSPO_LOSS_TYPES)
        self._routing = TrainerRouting.build(base, self.args, runs_old_policy_pass(self.args))
        self._replay_stack, self._replay_opened = None, False  # open while a micro-batch runs forward and backward
        self._lora = TrainerLora.build(self)  # LoRA folded for rollouts and weight syncs, base untouched; or None
        if self.use_vllm and self.vllm_mode == "server":  # every rank raises a sync's failure (ranks/phases.py)
            agreed_server_sync(self)
        self._adaptive_band = (AdaptiveClipBand.build(self.args, self.epsilon_low, self.epsilon_high)
                               if self.loss_type in GSPO_LOSS_TYPES else None)  # clip_band="adaptive", or None
        # Until the first optimizer step after a rollout the weights are those that sampled it: ratios then measure
        # the sampler's noise (old_logps="sampler") or kernel rounding, never movement (clip_band.py).
        self._on_sampling_weights = False
        self._round_rewards = None  # the rewards of the rollout being scored, every rank's (`_calculate_rewards`)
        if self._adaptive_band is not None:
            self.add_callback(ClipBandStep(self))
        if self.accelerator.is_main_process:  # the resolved sizes; a warning when paper presets changed TRL's
            log = logger.warning if getattr(self.args, "paper_presets", None) else logger.info
            log(setup_summary(self.args, self.accelerator.num_processes))
            logger.info(launch_summary(self.args, self.accelerator))

    # ------------------------------------------------------------------ MoE routing (trl_gspo/trainer/routing.py)
    def _clip_band(self):  # "outside the clip band" for any loss type: GSPO's band for TRL's own types
        return ((self.epsilon_low, self.epsilon_high) if self.loss_type in GSPO_LOSS_TYPES
                else (PAPER_EPSILON_LOW, PAPER_EPSILON_HIGH))

    def _generate_and_score_completions(self, inputs):
        if self._lora is None:
            return self._generate_and_score_round(inputs)
        with self._lora.rollout():  # generation and the old-policy pass with the adapters folded (lora.py)
            return self._generate_and_score_round(inputs)

    def _generate_and_score_round(self, inputs):
        self._on_sampling_weights = self.model.training
        if self._sampler_logps is not None:
            self._sampler_logps.start_round(training=self.model.training)
        if self._routing is None:
            output, (counts, changed) = super()._generate_and_score_completions(inputs), (None, None)
        else:
            with self._routing.round(training=self.model.training):
                output = self._routing.finish_round(super()._generate_and_score_completions(inputs))
                counts, changed = self._routing.sampler_comparison()
        if self._adaptive_band is not None and self._round_rewards is not None:  # what the band reads (clip_band.py)
            output["rewards_differ"] = self._rewards_differ(len(output["prompt_ids"]))
        if self._sampler_logps is not None:  # pi_old := the sampler's; its gap is measured in the first training step
            return self._sampler_logps.finish_round(output)
        trainer_logps, sampler_logps = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if trainer_logps is not None and sampler_logps is not None:  # sampling/*: docs/sampling.md
            mask = output["completion_mask"] * output.get("tool_mask", 1)
            values = sampling_metrics(self.accelerator, trainer_logps, sampler_logps, mask, *self._clip_band(),
                                      changed, counts)
            self._log_sampler_values(values, training=self.model.training)
        return output

    def _calculate_rewards(self, *args, **kwargs):
        rewards = super()._calculate_rewards(*args, **kwargs)
        self._round_rewards = rewards  # (every rank's sequences, reward functions), in TRL's group order
        return rewards

    def _rewards_differ(self, local: int) -> torch.Tensor:
        """Per sequence of this rank, whether its group's rewards differ, from the rewards TRL normalised (not from its
        float32 advantage, which is not 0 for equal float rewards: 8 rewards of 0.9 give 6e-4)."""
        rewards, self._round_rewards = self._round_rewards, None
        group = self.num_generations if self.model.training else self.num_generations_eval
        differ = trl_group_rewards_differ(rewards, self.reward_weights.to(rewards.device), group,
                                          getattr(self, "multi_objective_aggregation", "sum_then_normalize"))
        start = self.accelerator.process_index * local
        return differ[start:start + local]

    def _log_sampler_values(self, values, training):
        for name, value in values.items():
            self._metrics["train" if training else "eval"][name].append(value)
        if training:  # stops on implausible R3 routes, announces a sampler drift or gap (docs/sampling.md)
            self._sampler_watch.check(values)

    def _generate_single_turn(self, *args, **kwargs):
        with server_guards(self):  # a server failure raised on every rank (ranks/phases.py)
            if self._routing is None:
                return super()._generate_single_turn(*args, **kwargs)
            # vLLM: a lockstep tool turn says how the group's results were split (trl_gspo/trainer/tool_lockstep.py)
            target = (functools.partial(capture_routes, self.vllm_generation, self.accelerator,
                                        lambda: self._turn_split) if self.use_vllm else
                      lambda: self.accelerator.unwrap_model(self.model_wrapped))
            with self._routing.sampling(target, vllm=self.use_vllm) as finish:
                completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
                if finish is not None:  # R3: this call's sampler routes, and the sampler's log-probs for TRL
                    logprobs = finish(args[0] if args else kwargs["prompt_ids"], completion_ids, logprobs)
            return completion_ids, logprobs

    def _generate(self, prompts):
        output = super()._generate(prompts)  # (prompt_ids, completion_ids, tool_mask, ..., extra_fields, ...)
        if self._routing is not None:  # R3: one route per token, stitched across a tool loop's turns
            self._routing.end_sampling(output[0], output[1], output[5])
        if self._sampler_logps is not None:
            self._sampler_logps.keep(output[4])
        if output[2] is not None:  # a tool loop or a rollout_func's env_mask: model turns per sample
            log_turns(self.accelerator, self._metrics["train" if self.model.training else "eval"], output[2])
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        call = lambda: super(GSPOTrainer, self)._get_per_token_logps_and_entropies(  # noqa: E731
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        sampler = self._sampler_logps
        if sampler is not None and sampler.answers_old_pass(model is self.model, _reference_pass(self._adapter_layer)):
            return sampler.old_pass(logits_to_keep, input_ids.device)  # old_logps="sampler": no forward
        folded = (self._lora.old_policy_pass(model, torch.is_grad_enabled()) if self._lora is not None
                  else contextlib.nullcontext())
        with folded:  # the old-policy pass with LoRA experts built once per rollout: bit for bit the active forward
            if self._routing is None or model is not self.model:  # the reference model keeps natural routing
                result = call()
            else:
                result = self._routing.policy_pass(call, input_ids, attention_mask, logits_to_keep)
        if sampler is not None and torch.is_grad_enabled() and self.model.training:  # the gap, on sampling weights
            values = sampler.training_pass(result[0], self.accelerator, self.accelerator.sync_gradients)
            if values is not None:
                self._log_sampler_values(values, training=True)
        return result

    def training_step(self, model, inputs, num_items_in_batch):
        TrainerLora.keep_factors_gathered(self)  # ZeRO-3: PEFT reads `target_parameters` factors directly (lora.py)
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
            counts = self._routing.drift_counts().to(self.accelerator.device)  # no copy: counted on the device
            self._routing.keep_drift_counts(self.accelerator.reduce(counts, reduction="sum"))
        return loss

    def log(self, logs, start_time=None):
        if self._routing is not None and self.model.training:  # routing/*: one host read per logging step
            for name, value in self._routing.take_metrics():
                self._metrics["train"][name].append(value)
        super().log(logs, start_time)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._sampler_logps is not None:
            self._sampler_logps.micro_batch(inputs, training=self.model.training)
        if self._replay_stack is not None and self.model.training:
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            replay = self._routing.replay_for(inputs, attention_mask)
            if replay is not None:
                self._replay_stack.enter_context(replay)
                self._replay_opened = True
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def token_advantages(self, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        """Advantages per completion token, `(B, T)`, used by `loss_type="gspo_token"`.

        The default broadcasts TRL's per-sequence advantages `inputs["advantages"]` (shape `(B,)`) over each
        completion's tokens, which makes `gspo_token` identical to `gspo`. Override it for per-token credit
        assignment, e.g. multi-turn RL where each turn gets its own advantage; `inputs` is the batch dict TRL
        built in `_generate_and_score_completions` (extend that method to add extra per-sample tensors: they
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
            model, torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
            compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
            # Only keys the batch has: an argument a new TRL adds keeps its default instead of receiving None.
            **{key: inputs[key] for key in _FORWARD_BATCH_KEYS if key in inputs},
        )
        # TRL skips the old-policy pass when training is fully on-policy: then pi_old = pi_theta, every ratio is 1.
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps

        if self.loss_type == "gspo":
            advantages = inputs["advantages"]
            if advantages.dim() == 2 and advantages.shape[1] > 1:
                raise ValueError("`loss_type='gspo'` needs one advantage per sequence but the batch holds per-token "
                                 f"advantages of shape {tuple(advantages.shape)}. Fix: use `loss_type='gspo_token'`.")
            out = gspo_loss(logps, old_logps, advantages, mask, self.epsilon_low, self.epsilon_high,
                            check_inputs=False, delta=self.args.delta)
        else:
            advantages = self.token_advantages(inputs, mask)
            out = gspo_token_loss(logps, old_logps, advantages, mask, self.epsilon_low, self.epsilon_high,
                                  check_inputs=False, delta=self.args.delta)
        # Checked without waiting for the device: read with the metrics below, before backward can run.
        nonfinite = nonfinite_counts(logps.detach(), old_logps, advantages, mask)

        # TRL's optional token weights and KL term, applied as TRL's "grpo" loss applies them (trl_options.py).
        per_token_loss, entropy_mask, per_token_kl = apply_trl_options(self, inputs, out.per_token_loss, logps,
                                                                       old_logps, entropies, mask)
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

        band = self._adaptive_band if mode == "train" else None  # clip_band="adaptive": what it reads
        columns = None if band is None else band_columns(out, mask, advantages, self._on_sampling_weights,
                                                         inputs.get("rewards_differ"))
        read = self._log_gspo_metrics(mode, out, mask, entropies.detach(), policy_loss.detach(),
                                      per_token_kl.detach() if self.beta != 0.0 else None,
                                      aux_loss.detach() if self.aux_loss_enabled else None, nonfinite, columns)
        if band is not None:  # the band this micro-batch trained with; it moves at the step's end (ClipBandStep)
            band.observe(read.row_stats)
            for name, value in band.in_use().items():
                self._metrics[mode][name].append(value)
        return loss

    def _update_entropy_controller(self, entropies, mask):
        """TRL's adaptive entropy controller state (saved with checkpoints by TRL): window sums, then at the optimizer
        step the mean over all ranks' tokens moves the coefficient (`losses.adaptive_entropy_coef`)."""
        self._entropy_window_stats = entropy_window_stats(self._entropy_window_stats, entropies, mask)
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        entropy = (totals[0] / totals[1].clamp(min=1.0)).item()  # one sync per optimizer step
        a = self.args
        self.entropy_coef = adaptive_entropy_coef(self.entropy_coef, entropy, a.entropy_target, a.entropy_coef_delta,
                                                  a.entropy_coef_min, a.entropy_coef_max)
        self._last_world_entropy, self._entropy_window_stats = entropy, None

    def _log_gspo_metrics(self, mode, out, mask, entropies, policy_loss, per_token_kl, aux_loss, nonfinite,
                          band_columns=None):
        """Into TRL's `_metrics` (`metrics.read_to_host`): one reduce, one gather, one host read with the NaN/Inf counts
        of the loss inputs, so a non-finite input raises before backward on every rank (the counts are summed). With
        the adaptive band's `band_columns`, its statistics come back in the same read (`read.row_stats`)."""
        read = gspo_metrics.read_to_host(self.accelerator, out, mask, entropies, policy_loss, nonfinite,
                                         per_token_kl=per_token_kl, aux_loss=aux_loss,
                                         with_delta=self.args.delta is not None, extra_columns=band_columns,
                                         row_stats=None if band_columns is None else _band_row_stats)
        for name, value in read.values.items():
            self._metrics[mode][name].append(value)
        return read

