"""GSPO's clip band set by the run (`clip_band="adaptive"`, opt-in): after every optimizer step the band moves toward
clipping `clip_band_target` of the tokens that can be clipped (`trl_gspo.losses.adaptive_clip_epsilon`), within
`[clip_band_min, clip_band_max]` and never below the sampler's measured noise, the upper range keeping its ratio to
the lower one. Rule, signal and measurements: docs/gspo.md#a-clip-band-set-by-the-run.

What the rule reads is the policy's movement and nothing else:
- only sequences of a group whose rewards differ count (`group_rewards_differ`, read from the rewards: a group whose
  rewards are all equal has nothing to learn, whatever rounding its normalised advantage carries);
- sequences scored on the weights that sampled them (before the first optimizer step of a rollout; asynchronously,
  samples of the weight version the trainer holds) measure noise, not movement: a high quantile of their `|log s_i|`
  sets a floor the band stays above, and they are left out of the share;
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
# Every learnable |log s_i| of a step below this: the ratios are 1 up to kernel rounding (one float32 pass against
# another: docs/results.md), so the step carries no signal. Its own constant, not clip_band_min.
NO_SIGNAL_LOG_RATIO = 1e-6
# The band stays NOISE_MARGIN times above the NOISE_QUANTILE quantile of |log s_i| over an optimizer step's sequences
# scored on their sampling weights; each new measurement replaces a floor that has decayed by NOISE_DECAY per
# measurement (it follows the sampler, never drops at once). A quantile, because the largest of n draws grows with n
# (without bound for a heavy-tailed sampler gap): a floor set by it grows with the batch and can sit far above the
# noise. 0.95, not 0.99: 1.5x above it leaves at most 5% of light- or heavy-tailed noise (Student-t, 2 dof) outside
# the band, and a batch of 16 sequences estimates it, where the 0.99 quantile of any batch under 100 sequences lies
# between its two largest values. Measured: docs/results.md#the-clip-band-asynchronous-the-staleness-benchmark.
NOISE_QUANTILE = 0.95
NOISE_MARGIN = 1.5
NOISE_DECAY = 0.9
# Logged at every training micro-batch: the band it trained with and the noise floor under it.
IN_USE_METRICS = ("gspo/clip_epsilon_low", "gspo/clip_epsilon_high", "gspo/clip_band_noise_floor")
# Logged at the optimizer step: the step's clipped share of learnable tokens (what the rule read).
SHARE_METRIC = "gspo/clip_band_clipped_fraction"
BAND_COLUMNS = 3  # per sequence: clipped learnable tokens, learnable tokens, scored on its sampling weights (0/1)


def group_rewards_differ(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per sequence, whether the rewards of its group differ: `rewards` `(N,)`, or `(N, F)` one column per reward
    function (any column differing counts), groups of `group_size` consecutive rows (TRL's layout), NaN for a reward
    not given. A group differs when the largest of its rewards exceeds the smallest, over the rows that have one; a row
    with no reward (every column NaN: TRL zeroes its advantage) is False."""
    grouped = rewards.reshape(rewards.shape[0] // group_size, group_size, *rewards.shape[1:])
    scored = ~grouped.isnan()
    largest = torch.where(scored, grouped, -math.inf).amax(1)
    smallest = torch.where(scored, grouped, math.inf).amin(1)
    differ, scored = largest > smallest, scored.reshape(rewards.shape)
    if rewards.dim() == 2:
        differ, scored = differ.any(-1), scored.any(-1)
    return differ.repeat_interleave(group_size) & scored


def trl_group_rewards_differ(rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int,
                             aggregation: str = "sum_then_normalize") -> torch.Tensor:
    """`group_rewards_differ` of the rewards TRL's `GRPOTrainer` normalises: `rewards_per_func` `(N, F)` as
    `_calculate_rewards` returns them (every rank's), weighted and summed per row first (`sum_then_normalize`), or
    each weighted reward function on its own (`normalize_then_sum`: TRL normalises each within its group)."""
    if aggregation == "normalize_then_sum":
        return group_rewards_differ(rewards_per_func[:, weights != 0], group_size)
    rewards = (rewards_per_func * weights).nansum(1)
    rewards[rewards_per_func.isnan().all(1)] = math.nan
    return group_rewards_differ(rewards, group_size)


def band_columns(out, mask: torch.Tensor, advantages: torch.Tensor, noise_only: torch.Tensor | bool,
                 rewards_differ: torch.Tensor | None = None) -> torch.Tensor:
    """`[sequences, 3]` columns for the metrics' gather: per sequence its clipped learnable tokens, its learnable
    tokens, and whether it was scored on the weights that sampled it (`noise_only`: a bool, or one per sequence).
    A token is learnable when its group's rewards differ (`rewards_differ`, one per sequence) and its advantage
    (`(B,)`, or per token `(B, T)`) is not exactly 0 (never clipped). `rewards_differ` None (the batch does not say:
    a rollout batch restored from an older checkpoint): the advantage alone."""
    advantages = advantages if advantages.dim() == 2 else advantages[:, None]
    learnable = (advantages != 0) & mask.bool()
    if rewards_differ is not None:
        learnable = learnable & rewards_differ.to(mask.device).bool()[:, None]
    clipped = (out.low_clipped | out.high_clipped) & learnable
    noise = torch.as_tensor(noise_only, device=mask.device).float().expand(mask.shape[0])
    return torch.stack([clipped.sum(-1).float(), learnable.sum(-1).float(), noise], 1)


def band_stats(rows: torch.Tensor, present: torch.Tensor, first: int) -> torch.Tensor:
    """From the gathered rows (every rank's sequences; column 3 is log s_i, column 4 non-empty, the band's columns
    from `first`), on the device: `[clipped learnable tokens, learnable tokens, largest learnable |log s_i|]` over the
    sequences that measure movement (learnable, not noise-only), then one value per row: its `|log s_i|` where it
    measures noise (noise-only, non-empty), -1 elsewhere."""
    log_ratio = rows[:, 3].abs()
    clipped, learnable, noise = rows[:, first], rows[:, first + 1], rows[:, first + 2] > 0
    signal = present & ~noise & (learnable > 0)
    noisy = present & noise & (rows[:, 4] > 0)
    zero = torch.zeros(1, device=rows.device)
    return torch.cat([torch.stack([torch.where(signal, clipped, 0).sum(), torch.where(signal, learnable, 0).sum(),
                                   torch.cat([zero, log_ratio[signal]]).max()]), torch.where(noisy, log_ratio, -1.0)])


class AdaptiveClipBand:
    """The band's state: the lower range in use, the noise floor, and what the current optimizer step measured."""

    def __init__(self, epsilon_low: float, epsilon_high: float, target: float, epsilon_min: float,
                 epsilon_max: float):
        self.epsilon, self.ratio = epsilon_low, epsilon_high / epsilon_low
        self.target, self.epsilon_min, self.epsilon_max = target, epsilon_min, epsilon_max
        self.noise_floor = 0.0  # the narrowest lower range: 1.5x clear of the measured noise's 95th percentile
        self.last_fraction: float | None = None
        self._clipped = self._tokens = 0.0
        self._noise: list[float] = []  # this optimizer step's |log s_i| of sequences on their sampling weights

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
        clipped, tokens, largest_signal, *noise = stats
        if tokens > 0 and largest_signal > NO_SIGNAL_LOG_RATIO:
            self._clipped += clipped
            self._tokens += tokens
        self._noise.extend(value for value in noise if value >= 0)

    def end_step(self, skipped: bool = False) -> dict[str, float]:
        """At the end of an optimizer step: the next band, from this step's share and noise (unchanged on a skipped
        step, or without signal); returns the step's metrics (its clipped share, when it had one)."""
        fraction = None
        if not skipped:
            if self._noise:  # both edges clear the noise: 1 - eps <= e^-n and 1 + ratio * eps >= e^n
                noise = torch.tensor(self._noise, dtype=torch.float64).quantile(NOISE_QUANTILE).item()  # linear
                floor = max(-math.expm1(-noise), math.expm1(noise) / self.ratio)
                self.noise_floor = min(max(NOISE_MARGIN * floor, NOISE_DECAY * self.noise_floor), self.epsilon_max)
            lowest = max(self.epsilon_min, self.noise_floor)
            if self._tokens > 0:
                fraction = self._clipped / self._tokens
                self.epsilon = adaptive_clip_epsilon(self.epsilon, fraction, self.target, lowest, self.epsilon_max)
            else:
                self.epsilon = min(max(self.epsilon, lowest), self.epsilon_max)
        self._clipped = self._tokens = 0.0
        self._noise = []
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
