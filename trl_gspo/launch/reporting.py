"""End-of-run report: a short summary on stdout and a PNG of the reward and clip-fraction curves."""

from __future__ import annotations

import os
import time

from transformers import TrainerCallback

from .recipe import command_started

CLIP_KEYS = ("clip_ratio/region_mean", "gspo/clipped_token_fraction")
# TRL's tool-loop metrics (`tools/call_frequency`: tool calls per completion, `tools/failure_frequency`: share of
# calls that failed) and GSPOTrainer's model turns per completion; logged only by a run with tools.
TOOL_KEYS = ("tools/call_frequency", "tools/failure_frequency", "tools/turns_mean")
# AsyncGSPOTrainer's: clipped completions per sample age (`..._age_K`), and the share of completions whose decoupled
# weight the cap truncated or masked (`staleness_correction`).
AGE_PREFIX = "gspo/clipped_sequence_fraction/age_"
WEIGHT_CAPPED_KEY = "gspo/behaviour_weight/capped_fraction"
BAND_KEY = "gspo/clip_epsilon_low"  # clip_band="adaptive": the band in use (trl_gspo/trainer/clip_band.py)
FOLDED_KEY = "lora/folded_rollout_bytes"  # LoRA: the folded expert weights a rollout held (trl_gspo/trainer/lora.py)


def _series(log_history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(entry["step"], float(entry[key])) for entry in log_history if entry.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def summarize(log_history: list[dict]) -> dict:
    """Reward of the first and last logging windows, mean clip fractions; with tools, the tool-call rate, failure
    share and turns of the first and last windows (`<key>_first` / `<key>_last`, None without tools)."""
    _, rewards = _series(log_history, "reward")
    summary = {"reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None}
    for key in CLIP_KEYS:
        summary[key] = _mean(log_history, key)
    for key in TOOL_KEYS:  # first and last logging windows, as the reward
        _, values = _series(log_history, key)
        summary[f"{key}_first"], summary[f"{key}_last"] = (values[0], values[-1]) if values else (None, None)
    # Asynchronous runs: clipped completions by the age they were trained at, and the decoupled objective's weights.
    ages = sorted({key for entry in log_history for key in entry if key.startswith(AGE_PREFIX)},
                  key=lambda key: int(key[len(AGE_PREFIX):]))
    summary["clipped_by_age"] = {int(key[len(AGE_PREFIX):]): _mean(log_history, key) for key in ages}
    summary[WEIGHT_CAPPED_KEY] = _mean(log_history, WEIGHT_CAPPED_KEY)
    _, band = _series(log_history, BAND_KEY)
    summary[f"{BAND_KEY}_first"], summary[f"{BAND_KEY}_last"] = (band[0], band[-1]) if band else (None, None)
    _, held = _series(log_history, FOLDED_KEY)
    summary[FOLDED_KEY] = max(held) if held else None
    return summary


def _mean(log_history: list[dict], key: str) -> float | None:
    _, values = _series(log_history, key)
    return sum(values) / len(values) if values else None


def plot_training_curves(log_history: list[dict], path: str, title: str = "") -> str:
    """Write reward (left) and clip fractions (right) per optimizer step to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps, rewards = _series(log_history, "reward")
    left.plot(steps, rewards, marker="o", markersize=3)
    left.set(xlabel="optimizer step", ylabel="mean reward", title="reward")
    left.grid(alpha=0.3)
    for key in CLIP_KEYS + ("clip_ratio/low_mean", "clip_ratio/high_mean"):
        steps, values = _series(log_history, key)
        if values:
            right.plot(steps, values, label=key, linewidth=1.2)
    right.set(xlabel="optimizer step", ylabel="fraction", title="clipping")
    steps, band = _series(log_history, BAND_KEY)
    if band:  # clip_band="adaptive": the band it clipped with, on its own log axis
        axis = right.twinx()
        axis.plot(steps, band, color="black", linestyle="--", linewidth=1.0, label="epsilon (adaptive band)")
        axis.set(yscale="log", ylabel="epsilon")
        axis.legend(fontsize=7, loc="lower right")
    if right.get_legend_handles_labels()[0]:  # a history without clip metrics draws none
        right.legend(fontsize=7)
    right.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_WALL_TIME = object()  # where the wall-time line goes: filled in when the summary is printed


class RunReportCallback(TrainerCallback):
    """Prints a summary at the end of training and writes `training_curves.png` to `output_dir`; `notes` are lines
    about how the run was prepared (e.g. a cold start run before the launch), printed with it.

    The summary's wall time is the whole command's (from `command_started()`), with the cold start's (`cold_start`, a
    phrase such as "cold start 12s", or None when there was none) and training's (`trainer.train`) beside it. With
    `deferred=True` the summary is printed by `print_summary()`, called once everything else (saving the model, the
    progress bar's last line) is printed, so that it is the last thing the run prints; otherwise at the end of
    training."""

    def __init__(self, plot: bool = True, notes: list[str] | None = None, cold_start: str | None = None,
                 deferred: bool = False):
        self.plot = plot
        self.notes = list(notes or [])
        self.cold_start = cold_start
        self.deferred = deferred
        self._started = None
        self._training_seconds = None
        self._lines = None  # the summary, on the main process, once training has ended

    def on_train_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._training_seconds = time.perf_counter() - (self._started or time.perf_counter())
        self._lines = self._summary_lines(args, state)
        if not self.deferred:
            self.print_summary()

    def wall_time(self) -> str:
        """The whole command's wall time up to now, and the cold start's and training's within it."""
        parts = [self.cold_start] if self.cold_start else []
        parts.append(f"training {self._training_seconds or 0:.0f}s")
        return f"{time.time() - command_started():.0f}s for the whole command ({', '.join(parts)})"

    def print_summary(self) -> None:
        """Print the summary (once; nothing on processes other than the main one, or before training ended)."""
        if self._lines is None:
            return
        lines, self._lines = self._lines, None
        wall_time = f"  wall time:             {self.wall_time()}"
        print("\n".join(wall_time if line is _WALL_TIME else line for line in lines), flush=True)

    def _summary_lines(self, args, state) -> list[str]:
        summary = summarize(state.log_history)
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines = [
            "",
            "=" * 60,
            f"trl-gspo run summary ({getattr(args, 'loss_type', '?')})",
            f"  optimizer steps:       {state.global_step}",
            f"  reward first -> last:  {fmt(summary['reward_first'])} -> {fmt(summary['reward_last'])}"
            "  (mean reward of the first and last logging windows)",
            f"  sequences clipped:     {fmt(summary['clip_ratio/region_mean'])} (mean clip_ratio/region_mean)",
            f"  tokens clipped:        {fmt(summary['gspo/clipped_token_fraction'])} "
            "(mean gspo/clipped_token_fraction)",
            _WALL_TIME,
        ]
        if summary["tools/call_frequency_first"] is not None:  # a run with tools (TRL's tool loop)
            lines[-1:-1] = [
                f"  tool calls first -> last: {fmt(summary['tools/call_frequency_first'])} -> "
                f"{fmt(summary['tools/call_frequency_last'])}  (tool-call rate: tools/call_frequency, calls per "
                "completion)",
                f"  failed calls first -> last: {fmt(summary['tools/failure_frequency_first'])} -> "
                f"{fmt(summary['tools/failure_frequency_last'])}  (tools/failure_frequency)",
                f"  turns first -> last:   {fmt(summary['tools/turns_mean_first'])} -> "
                f"{fmt(summary['tools/turns_mean_last'])}  (tools/turns_mean, model turns per completion)",
            ]
        if summary["clipped_by_age"]:  # an asynchronous run
            lines[-1:-1] = [
                "  clipped by age:        " + ", ".join(f"{age} version(s) old {fmt(value)}" for age, value
                                                       in summary["clipped_by_age"].items())
                + "  (gspo/clipped_sequence_fraction/age_K)"]
        if summary[WEIGHT_CAPPED_KEY] is not None:
            lines[-1:-1] = [f"  weights capped:        {fmt(summary[WEIGHT_CAPPED_KEY])}  (mean {WEIGHT_CAPPED_KEY})"]
        if summary[f"{BAND_KEY}_first"] is not None:
            lines[-1:-1] = [f"  clip band (adaptive):  epsilon {summary[f'{BAND_KEY}_first']:.3g} -> "
                            f"{summary[f'{BAND_KEY}_last']:.3g}  ({BAND_KEY}, first and last logging windows)"]
        if summary[FOLDED_KEY]:
            lines[-1:-1] = [f"  LoRA folded rollout:   {summary[FOLDED_KEY] / 2**30:.3f} GiB of expert weights held per "
                            f"rank (max {FOLDED_KEY}; merge_adapters_for_rollout: false saves it)"]
        lines += [f"  {note}" for note in self.notes]
        if self.plot:
            os.makedirs(args.output_dir, exist_ok=True)
            path = plot_training_curves(state.log_history, os.path.join(args.output_dir, "training_curves.png"),
                                        title=f"{getattr(args, 'loss_type', '')} - {args.output_dir}")
            lines.append(f"  curves:                {path}")
        lines.append(f"  trainer state:         {os.path.join(args.output_dir, 'trainer_state.json')}")
        lines.append("=" * 60)
        return lines
