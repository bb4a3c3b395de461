"""GSPO's clip band set by the run (`clip_band="adaptive"`): after every optimizer step the band moves toward clipping
`clip_band_target` of the completion tokens (`trl_gspo.losses.adaptive_clip_epsilon`), within
`[clip_band_min, clip_band_max]`, the upper range keeping its ratio to the lower one. Derivation and measurements:
docs/gspo.md#a-clip-band-set-by-the-run.

Its input is the step's clipped-token share summed over every rank (the metrics' one reduce, already on the host), so
every rank computes the same band at every step; its state goes into each checkpoint, and a resumed run continues
with the band it had. Shared by GSPOTrainer and AsyncGSPOTrainer.
"""

from __future__ import annotations

import json
import os

from ..losses import adaptive_clip_epsilon

STATE_FILE = "clip_band_state.json"
METRICS = ("gspo/clip_epsilon_low", "gspo/clip_epsilon_high", "gspo/clip_band_clipped_fraction")


class AdaptiveClipBand:
    """The band's state: the lower range in use and the clipped and total tokens of the current optimizer step."""

    def __init__(self, epsilon_low: float, epsilon_high: float, target: float, epsilon_min: float,
                 epsilon_max: float):
        self.epsilon, self.ratio = epsilon_low, epsilon_high / epsilon_low
        self.target, self.epsilon_min, self.epsilon_max = target, epsilon_min, epsilon_max
        self.clipped = self.tokens = 0.0
        self.last_fraction: float | None = None

    @classmethod
    def build(cls, args, epsilon_low: float, epsilon_high: float) -> AdaptiveClipBand | None:
        if getattr(args, "clip_band", "fixed") != "adaptive":
            return None
        return cls(epsilon_low, epsilon_high, args.clip_band_target, args.clip_band_min, args.clip_band_max)

    @property
    def band(self) -> tuple[float, float]:
        return self.epsilon, self.epsilon * self.ratio

    def observe(self, clipped_fraction: float, tokens: float, largest_log_ratio: float) -> None:
        """One micro-batch's clipped-token share, token count and largest |log s_i|, all over every rank. A
        micro-batch whose ratios all lie within `epsilon_min` of 1 (the first mini-batch of a rollout, where
        pi_old = pi_theta up to kernel noise) says nothing about the band and is left out."""
        if largest_log_ratio > self.epsilon_min:
            self.clipped += clipped_fraction * tokens
            self.tokens += tokens

    def step(self) -> tuple[float, float]:
        """At the optimizer step: the next band, from this step's share (the band stays if no token moved)."""
        self.last_fraction = None
        if self.tokens > 0:
            self.last_fraction = self.clipped / self.tokens
            self.epsilon = adaptive_clip_epsilon(self.epsilon, self.last_fraction, self.target, self.epsilon_min,
                                                 self.epsilon_max)
        self.clipped = self.tokens = 0.0
        return self.band

    def after_micro_batch(self, read, optimizer_step: bool, metrics: dict) -> tuple[float, float] | None:
        """A training micro-batch's metrics (`metrics.read_to_host`'s `HostMetrics`, over every rank) observed; at the
        optimizer step (`optimizer_step`: accelerate's `sync_gradients`) the band moves, its metrics go into `metrics`
        (TRL's `_metrics["train"]`) and the next band is returned, else None."""
        self.observe(read.values["gspo/clipped_token_fraction"], read.tokens, read.values["gspo/log_ratio_abs_max"])
        if not optimizer_step:
            return None
        band = self.step()
        for name, value in self.metrics().items():
            metrics[name].append(value)
        return band

    def metrics(self) -> dict[str, float]:
        values = dict(zip(METRICS[:2], self.band))
        if self.last_fraction is not None:
            values[METRICS[2]] = self.last_fraction
        return values

    def save(self, checkpoint: str) -> None:
        with open(os.path.join(checkpoint, STATE_FILE), "w") as file:
            json.dump({"epsilon": self.epsilon, "ratio": self.ratio, "last_fraction": self.last_fraction}, file)

    def load(self, checkpoint: str) -> bool:
        """The band saved in `checkpoint`; False when it holds none (a checkpoint of a run with a fixed band)."""
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            return False
        with open(path) as file:
            state = json.load(file)
        self.epsilon, self.ratio, self.last_fraction = state["epsilon"], state["ratio"], state["last_fraction"]
        return True
