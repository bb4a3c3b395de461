"""`old_logps="sampler"`: pi_old from the sampler's per-token log-probs, without the trainer's old-policy pass.

GSPO paper (arXiv 2507.18071), Sec. 5.4: GSPO uses only sequence likelihoods, so it should tolerate the precision
gap between the inference engine and the trainer, and the engine's likelihoods could serve as pi_old directly,
skipping their recomputation by the trainer. TRL 1.16 recomputes pi_old with the trainer whenever a rollout batch
outlives one optimizer step (the paper's off-policy setup) or vLLM's importance-sampling (IS) correction is on.

With `old_logps="sampler"`:
- TRL's old-policy pass is answered with the sampler's log-probs instead of a forward pass (`SamplerOldLogps.old_pass`;
  counted in `skipped_passes`), and the batch's `old_per_token_logps` are the sampler's in every case. With R3 the
  training passes still replay the sampler's routes, so an MoE run needs no old-policy pass at all.
- TRL's vLLM IS correction would be pi_old / pi_sampler = 1 exactly; GSPOTrainer turns it off (no ratio of ones, no
  `sampling/sampling_logp_difference` of zeros in the logs).
- The precision gap moves into every importance ratio. Until the first optimizer step after a rollout the trainer's
  weights are the sampling weights, so the micro-batches of that step measure the gap alone: their `sampling/*`
  metrics are logged (same names as with recomputation, docs/sampling.md) and, when most sequences fall outside
  the clip band there (`MOST_OUTSIDE_BAND`), a warning says so at once (`gap_warning`).

Measured (docs/gspo.md, "Training on the sampler's likelihoods"): safe with a sampler computing in the trainer's
precision; a bfloat16 vLLM engine against a float32 trainer puts most sequences outside GSPO's 3e-4 band.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.utils import logging

from .mismatch import mismatch_sums, reduce_mismatch

logger = logging.get_logger(__name__)

OLD_LOGPS_SOURCES = ("trainer", "sampler")
# Share of sequences outside the clip band, on the sampling weights, above which the band mostly measures precision.
MOST_OUTSIDE_BAND = 0.5


def check_old_logps_option(args, suggestion: str = "") -> None:
    """Refuse `old_logps` values that cannot work, before any model is loaded (`ValueError` naming the fix).
    `suggestion`: what an unknown value's message adds (" (did you mean 'sampler'?)")."""
    source = getattr(args, "old_logps", "trainer")
    if source not in OLD_LOGPS_SOURCES:
        raise ValueError(f"`old_logps`: unknown value {source!r}{suggestion}. Fix: use "
                         "'trainer' (recompute pi_old, TRL's behaviour) or 'sampler' (the sampler's log-probs, GSPO "
                         "paper Sec. 5.4).")
    if source != "sampler":
        return
    routing_replay = getattr(args, "routing_replay", "none")
    if routing_replay == "old":
        raise ValueError("`old_logps`: 'sampler' skips TRL's old-policy pass, whose routes routing_replay='old' (R2) "
                         "records and replays. Fix: routing_replay='sampler' (R3: the sampler's routes, no old-policy "
                         "pass needed), or old_logps='trainer'.")
    if not args.use_vllm and routing_replay != "sampler":
        raise ValueError("`old_logps`: 'sampler' needs the sampler's per-token log-probs; TRL's HF generate path "
                         "returns none (R3 records them while it records the routes). Fix: use_vllm=True, "
                         "routing_replay='sampler' (a Mixture-of-Experts model), or old_logps='trainer'.")


def processed_logps_differ(args) -> list[str]:
    """The sampling options under which the sampler's processed log-probs are not the tempered policy the trainer
    scores (vLLM applies them before it reports log-probs), e.g. `["top_p=0.9"]`."""
    options = []
    if args.top_p is not None and args.top_p < 1.0:
        options.append(f"top_p={args.top_p}")
    if args.top_k is not None and args.top_k > 0:
        options.append(f"top_k={args.top_k}")
    if args.min_p is not None and args.min_p > 0.0:
        options.append(f"min_p={args.min_p}")
    if args.repetition_penalty is not None and args.repetition_penalty != 1.0:
        options.append(f"repetition_penalty={args.repetition_penalty}")
    return options


def check_server_logprobs(client) -> None:
    """Server mode: refuse a server whose log-probs are not the processed (tempered) distribution's, which pi_old
    must be (`trl vllm-serve` and `trl-gspo vllm-serve` start it with `--logprobs-mode processed_logprobs`)."""
    mode = client.get_server_info().get("model_config", {}).get("logprobs_mode")
    if mode != "processed_logprobs":
        raise ValueError(f"`old_logps`: 'sampler' needs the server's log-probs after temperature and logit processing, "
                         f"but the server at {client.base_url} runs with logprobs mode {mode!r}. Fix: restart it with "
                         "`trl-gspo vllm-serve` (or `--logprobs-mode processed_logprobs`), or set old_logps='trainer'.")


def gap_warning(values: dict, band: tuple[float, float], dtypes: tuple[str, str], first: bool) -> str | None:
    """The warning for a rollout whose sampler gap alone puts most sequences outside the clip band, or None.
    `values`: `sampling/*` metrics on the sampling weights; `dtypes`: (sampler, trainer) compute dtype names."""
    outside = values["sampling/seq_outside_clip_band"]
    if not outside > MOST_OUTSIDE_BAND:
        return None
    sampler, trainer = dtypes
    return (f"SAMPLER LIKELIHOODS OUTSIDE THE CLIP BAND: with old_logps='sampler', {outside:.0%} of sequences fall "
            f"outside the clip band [1 - {band[0]:g}, 1 + {band[1]:g}] {'in the first rollout' if first else 'in this rollout'}, before "
            f"any update (mean |log ratio| {values['sampling/abs_log_ratio_mean']:.2e} nats, a {sampler} sampler "
            f"against a {trainer} trainer): the clip band measures the sampler's precision, not the policy's change, "
            "and each of those whose ratio lies on its advantage's side is clipped (no gradient). Fix: sample in the trainer's precision (vllm_dtype='float32' with "
            "a float32 trainer, or bf16=True), or recompute pi_old with old_logps='trainer'. docs/gspo.md, "
            "'Training on the sampler's likelihoods', has the measurements.")


_NO_LOGPROBS = ("`old_logps`: 'sampler', but this rollout returned no sampler log-probs (a rollout_func without "
                "'logprobs', or a sampler that reports none). Fix: return the sampler's per-token log-probs, or set "
                "old_logps='trainer'.")


class SamplerOldLogps:
    """The `old_logps="sampler"` state of one trainer. `band`: returns the clip band in use (eps_low, eps_high), for
    the outside-band share and the warning (it moves with `clip_band="adaptive"`); `dtypes`: (sampler, trainer)
    compute dtype names, for the warning; `warns`: whether the band clips whole sequences in this run's loss (GSPO's
    types). TRL's token losses clip each token at their own, far wider, band, which a precision gap does not reach:
    the share is still logged, the warning would be false."""

    def __init__(self, band: Callable[[], tuple[float, float]], dtypes: tuple[str, str], warns: bool = True):
        self.band, self.dtypes, self.warns = band, dtypes, warns
        self.skipped_passes = 0  # old-policy passes answered with the sampler's log-probs
        self.rounds = 0  # training rollouts whose gap was measured
        self._logprobs = None  # this round's sampler log-probs, one list per completion (TRL's `_generate`)
        self._in_round = False
        self._measuring = False  # between a training rollout and the optimizer step after it: the sampling weights
        self._micro_batch = None  # (old log-probs, mask) of the training micro-batch running now
        self._sums, self._extremes = None, None
        self._warned = False

    @classmethod
    def build(cls, trainer, band: Callable[[], tuple[float, float]], dtypes: tuple[str, str],
              warns: bool = True) -> SamplerOldLogps | None:
        """For a GRPOTrainer once TRL built it: None unless `old_logps="sampler"`. Turns TRL's vLLM IS correction off
        (pi_old / pi_sampler = 1) and warns when the sampler's processed log-probs are not the tempered policy's."""
        if getattr(trainer.args, "old_logps", "trainer") != "sampler":
            return None
        if trainer.use_vllm and trainer.vllm_mode == "server" and trainer.accelerator.is_main_process:
            check_server_logprobs(trainer.vllm_generation.vllm_client)
        trainer.vllm_importance_sampling_correction = False
        truncating = processed_logps_differ(trainer.args)
        if truncating:
            logger.warning(f"old_logps='sampler' with {', '.join(truncating)}: the sampler reports log-probs of the "
                           "truncated distribution while the trainer scores the tempered one, so every importance "
                           "ratio includes the truncation. Fix: leave these options unset, or old_logps='trainer'.")
        return cls(band, dtypes, warns)

    # ------------------------------------------------------------------ generation round
    def start_round(self, training: bool) -> None:
        """A generation round begins. Only training rounds take pi_old from the sampler: an evaluation round keeps
        TRL's behaviour (HF generate records no log-probs outside training)."""
        self._logprobs, self._in_round = None, training
        if training:
            self._measuring, self._sums, self._extremes = True, None, None

    def keep(self, logprobs) -> None:
        """TRL's per-completion sampler log-probs of this round (`_generate`'s fifth output), before TRL's old-policy
        pass: a rollout without them is refused here, before that pass or any training compute runs."""
        if not self._in_round:
            return
        if logprobs is None:
            raise ValueError(_NO_LOGPROBS)
        self._logprobs = logprobs

    def answers_old_pass(self, is_policy: bool, reference_pass: bool) -> bool:
        """Whether a policy-model pass is TRL's old-policy pass (the round's first no-grad pass of the policy with its
        adapters on), to be answered with the sampler's log-probs."""
        return (self._in_round and is_policy and not reference_pass and not torch.is_grad_enabled()
                and self._logprobs is not None)

    def old_pass(self, logits_to_keep: int, device) -> tuple[torch.Tensor, None, None]:
        """The sampler's log-probs in the old-policy pass's layout: `[B, logits_to_keep]`, right-padded with 0 (TRL's
        layout), NaN where the sampler gave none (checked in `finish_round`)."""
        rows = torch.zeros(len(self._logprobs), logits_to_keep)
        for i, row in enumerate(self._logprobs):
            rows[i, :len(row)] = torch.tensor([math.nan if x is None else x for x in row][:logits_to_keep])
        self.skipped_passes += 1
        self._in_round = False  # one old-policy pass per round; later passes (a PEFT reference) run
        return rows.to(device), None, None

    def finish_round(self, output: dict) -> dict:
        """Make the sampler's log-probs the batch's pi_old (also where TRL ran no old-policy pass); refuse a round
        without them or with a missing one on a trained token, before any training pass runs."""
        if self._logprobs is None:  # an evaluation round: TRL's own pi_old
            return output
        self._in_round, self._logprobs = False, None
        logps = output.get("sampling_per_token_logps")
        if logps is None:
            raise ValueError(_NO_LOGPROBS)
        mask = (output["completion_mask"] * output.get("tool_mask", 1)).bool()
        missing = int((torch.isnan(logps) & mask).sum())
        if missing:
            raise ValueError(f"`old_logps`: 'sampler', but the sampler gave no log-prob for {missing} trained tokens "
                             "of this rollout (vLLM reports NaN as None), so pi_old is unknown there. Fix: set "
                             "old_logps='trainer' to recompute pi_old.")
        output["old_per_token_logps"] = logps
        return output

    # ------------------------------------------------------------------ the gap, on the sampling weights
    def micro_batch(self, inputs: dict, training: bool) -> None:
        """Before a micro-batch's loss: keep its pi_old and mask while the weights are still the sampling ones."""
        self._micro_batch = None
        if training and self._measuring and "old_per_token_logps" in inputs:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            self._micro_batch = (inputs["old_per_token_logps"], mask)

    def training_pass(self, logps: torch.Tensor, accelerator, sync_gradients: bool) -> dict | None:
        """After a training pass's log-probs: add its sampler gap; at the micro-batch before the optimizer step, the
        rollout's `sampling/*` values over every rank (one reduce, one gather, one host read), else None."""
        if self._micro_batch is None:
            return None
        old, mask = self._micro_batch
        self._micro_batch = None
        sums, extremes = mismatch_sums(logps.detach(), old, mask, *self.band())
        if self._sums is None:
            self._sums, self._extremes = sums, extremes
        else:
            self._sums = {name: self._sums[name] + value for name, value in sums.items()}
            self._extremes = torch.maximum(self._extremes, extremes)
        if not sync_gradients:
            return None
        values = reduce_mismatch(accelerator, self._sums, self._extremes)
        self._measuring, self._sums, self._extremes = False, None, None
        self.rounds += 1
        message = gap_warning(values, self.band(), self.dtypes, first=self.rounds == 1) if self.warns else None
        if message is not None and not self._warned:  # once, at the first rollout where it happens
            logger.warning(message)
            self._warned = True
        return values
