"""GSPO's clip band set by the run (`clip_band="adaptive"`, opt-in): after every optimizer step the band moves toward
clipping `clip_band_target` of the tokens that can be clipped (`trl_gspo.losses.adaptive_clip_epsilon`), within
`[clip_band_min, clip_band_max]` and never below the sampler's measured noise, the upper range keeping its ratio to
the lower one. Rule, signal and measurements: docs/gspo.md#a-clip-band-set-by-the-run.

What the rule reads is the policy's movement and nothing else:
- only sequences with a non-zero advantage count (a zero advantage is never clipped, whatever the band);
- sequences scored on the weights that sampled them (before the first optimizer step of a rollout; asynchronously,
  samples of the weight version the trainer holds) measure noise, not movement: their largest `|log s_i|` sets a
  floor the band stays above, and they are left out of the share;
- a step whose every learnable `|log s_i|` is below `NO_SIGNAL_LOG_RATIO`, or with no learnable sequence, leaves the
  band where it is, and so does a skipped optimizer step.

Its inputs are columns of the metrics' gathered per-sequence rows (one gather, one host read, already there), so
every rank computes the same band at every step. The band moves at the end of the optimizer step (a callback), so
the band logged for step k is the band step k trained with. Its state goes into each checkpoint. Shared by
GSPOTrainer and AsyncGSPOTrainer.
"""

from __future__ import annotations

import json
import math
import os

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..losses import adaptive_clip_epsilon

logger = logging.get_logger(__name__)

STATE_FILE = "clip_band_state.json"
# A sequence can be clipped only with a non-zero advantage. TRL's normalised advantage of a group whose rewards are
# all equal is 0 up to rounding (about 1e-13 after its division by std + 1e-4).
LEARNABLE_ADVANTAGE = 1e-8
# Every learnable |log s_i| of a step below this: the ratios are 1 up to kernel rounding (one float32 pass against
# another: docs/results.md), so the step carries no signal. Its own constant, not clip_band_min.
NO_SIGNAL_LOG_RATIO = 1e-6
# The band stays NOISE_MARGIN times above the largest |log s_i| of sequences scored on their sampling weights; each
# new measurement replaces a floor that has decayed by NOISE_DECAY per measurement (it follows the sampler, never
# drops at once).
NOISE_MARGIN = 1.5
NOISE_DECAY = 0.9
# Logged at every training micro-batch: the band it trained with and the noise floor under it.
IN_USE_METRICS = ("gspo/clip_epsilon_low", "gspo/clip_epsilon_high", "gspo/clip_band_noise_floor")
# Logged at the optimizer step: the step's clipped share of learnable tokens (what the rule read).
SHARE_METRIC = "gspo/clip_band_clipped_fraction"
BAND_COLUMNS = 3  # per sequence: clipped learnable tokens, learnable tokens, scored on its sampling weights (0/1)


def band_columns(out, mask: torch.Tensor, advantages: torch.Tensor, noise_only: torch.Tensor | bool) -> torch.Tensor:
    """`[sequences, 3]` columns for the metrics' gather: per sequence its clipped learnable tokens, its learnable
    tokens (non-zero advantage, `(B,)` or per token `(B, T)`), and whether it was scored on the weights that sampled
    it (`noise_only`: a bool, or one per sequence)."""
    advantages = advantages if advantages.dim() == 2 else advantages[:, None]
    learnable = (advantages.abs() > LEARNABLE_ADVANTAGE) & mask.bool()
    clipped = (out.low_clipped | out.high_clipped) & learnable
    noise = torch.as_tensor(noise_only, device=mask.device).float().expand(mask.shape[0])
    return torch.stack([clipped.sum(-1).float(), learnable.sum(-1).float(), noise], 1)


def band_stats(rows: torch.Tensor, present: torch.Tensor, first: int) -> torch.Tensor:
    """From the gathered rows (every rank's sequences; column 3 is log s_i, column 4 non-empty, the band's columns
    from `first`), on the device: `[clipped learnable tokens, learnable tokens, largest learnable |log s_i|, largest
    noise-only |log s_i|]` over the sequences that measure movement (learnable, not noise-only) and those that
    measure noise (noise-only, non-empty)."""
    log_ratio = rows[:, 3].abs()
    clipped, learnable, noise = rows[:, first], rows[:, first + 1], rows[:, first + 2] > 0
    signal = present & ~noise & (learnable > 0)
    noisy = present & noise & (rows[:, 4] > 0)
    zero = torch.zeros(1, device=rows.device)
    return torch.stack([torch.where(signal, clipped, 0).sum(), torch.where(signal, learnable, 0).sum(),
                        torch.cat([zero, log_ratio[signal]]).max(), torch.cat([zero, log_ratio[noisy]]).max()])


class AdaptiveClipBand:
    """The band's state: the lower range in use, the noise floor, and what the current optimizer step measured."""

    def __init__(self, epsilon_low: float, epsilon_high: float, target: float, epsilon_min: float,
                 epsilon_max: float):
        self.epsilon, self.ratio = epsilon_low, epsilon_high / epsilon_low
        self.target, self.epsilon_min, self.epsilon_max = target, epsilon_min, epsilon_max
        self.noise_floor = 0.0  # the narrowest lower range that clips no measured noise
        self.last_fraction: float | None = None
        self._clipped = self._tokens = 0.0
        self._noise: float | None = None

    @classmethod
    def build(cls, args, epsilon_low: float, epsilon_high: float) -> AdaptiveClipBand | None:
        if getattr(args, "clip_band", "fixed") != "adaptive":
            return None
        return cls(epsilon_low, epsilon_high, args.clip_band_target, args.clip_band_min, args.clip_band_max)

    @property
    def band(self) -> tuple[float, float]:
        return self.epsilon, self.epsilon * self.ratio

    def in_use(self) -> dict[str, float]:
        """The band a training micro-batch runs with, for its metrics."""
        return dict(zip(IN_USE_METRICS, (*self.band, self.noise_floor)))

    def observe(self, stats) -> None:
        """One micro-batch's `band_stats` (over every rank, on the host)."""
        clipped, tokens, largest_signal, largest_noise = stats
        if tokens > 0 and largest_signal > NO_SIGNAL_LOG_RATIO:
            self._clipped += clipped
            self._tokens += tokens
        if largest_noise > 0:
            self._noise = max(self._noise or 0.0, largest_noise)

    def end_step(self, skipped: bool = False) -> dict[str, float]:
        """At the end of an optimizer step: the next band, from this step's share and noise (unchanged on a skipped
        step, or without signal); returns the step's metrics (its clipped share, when it had one)."""
        fraction = None
        if not skipped:
            if self._noise is not None:  # both edges clear the noise: 1 - eps <= e^-n and 1 + ratio * eps >= e^n
                floor = max(-math.expm1(-self._noise), math.expm1(self._noise) / self.ratio)
                self.noise_floor = min(max(NOISE_MARGIN * floor, NOISE_DECAY * self.noise_floor), self.epsilon_max)
            lowest = max(self.epsilon_min, self.noise_floor)
            if self._tokens > 0:
                fraction = self._clipped / self._tokens
                self.epsilon = adaptive_clip_epsilon(self.epsilon, fraction, self.target, lowest, self.epsilon_max)
            else:
                self.epsilon = min(max(self.epsilon, lowest), self.epsilon_max)
        self._clipped = self._tokens = 0.0
        self._noise = None
        self.last_fraction = fraction
        return {} if fraction is None else {SHARE_METRIC: fraction}

    def save(self, checkpoint: str) -> None:
        with open(os.path.join(checkpoint, STATE_FILE), "w") as file:
            json.dump({"epsilon": self.epsilon, "ratio": self.ratio, "noise_floor": self.noise_floor,
                       "last_fraction": self.last_fraction}, file)

    def load(self, checkpoint: str) -> bool:
        """The band saved in `checkpoint`; False when it holds none (a checkpoint of a run with a fixed band)."""
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            return False
        with open(path) as file:
            state = json.load(file)
        self.epsilon, self.ratio, self.last_fraction = state["epsilon"], state["ratio"], state["last_fraction"]
        self.noise_floor = state.get("noise_floor", 0.0)
        return True

    def resume(self, checkpoint: str, is_main_process: bool) -> tuple[float, float]:
        """`load`, or one line saying which band a checkpoint without band state continues with; the band."""
        if not self.load(checkpoint) and is_main_process:
            logger.warning(f"clip_band='adaptive': {checkpoint} holds no band state ({STATE_FILE}: it was written by a "
                           "run with a fixed band), so the run continues with the band it starts from, "
                           f"epsilon={self.band[0]:g}, epsilon_high={self.band[1]:g}, and moves it from there.")
        return self.band


class ClipBandStep(TrainerCallback):
    """Moves the trainer's band at the end of each optimizer step (after the step, so a skipped step is known), before
    the step is logged."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        end_band_step(self.trainer)


def end_band_step(trainer, skipped: bool | None = None) -> None:
    """The end of `trainer`'s optimizer step: its band's next value into `epsilon_low` / `epsilon_high`, the step's
    share into its metrics. `skipped` None: accelerate says whether the optimizer step was skipped (fp16 overflow,
    DeepSpeed's loss scaler)."""
    band = trainer._adaptive_band
    if skipped is None:
        skipped = trainer.accelerator.optimizer_step_was_skipped
    for name, value in band.end_step(skipped).items():
        trainer._metrics["train"][name].append(value)
    trainer.epsilon_low, trainer.epsilon_high = band.band
    if hasattr(trainer, "_on_sampling_weights"):  # GSPOTrainer: the weights have left the rollout's sampling weights
        trainer._on_sampling_weights = False
