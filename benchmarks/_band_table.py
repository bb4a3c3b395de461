"""The clip band tables of benchmarks/async_staleness.py and benchmarks/clip_band_sync.py: one row per cell (a
learning rate, sampler, staleness or task), the last-window reward of each arm over seeds, the band set by the run
against the best fixed band, the paper's band and TRL's token loss in standard errors of the difference, its clipped
share of learnable tokens against its target, and the share of groups with equal rewards; then the goals, counted
over the cells."""

from __future__ import annotations

import math
import statistics

FIXED = ("paper", "10x", "100x")  # the paper's band (3e-4 / 4e-4), 10x and 100x wider, fixed
ARMS = (*FIXED, "adaptive", "trl")
NAMES = {"paper": "paper's band", "10x": "10x band", "100x": "100x band", "adaptive": "adaptive",
         "trl": "TRL token loss"}
TARGET = 0.15  # clip_band_target's default
SHARE_TOLERANCE = 0.2  # the goal: the settled share within +-20% of the target
HEADER = ("| adaptive - best fixed | adaptive - paper's | adaptive - TRL token | adaptive clipped (learnable) "
          "| equal-reward groups |")


def difference_in_se(a: list[float], b: list[float]) -> float:
    """(mean a - mean b) in standard errors of the difference, sqrt(sd_a^2 / n_a + sd_b^2 / n_b); NaN with fewer than
    two values on a side or no spread at all."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    error = (statistics.stdev(a) ** 2 / len(a) + statistics.stdev(b) ** 2 / len(b)) ** 0.5
    return (statistics.fmean(a) - statistics.fmean(b)) / error if error > 0 else float("nan")


def mean_se(values: list[float], fmt: str = ".3f", sep: str = " ± ", count: bool = True) -> str:
    """Mean and standard error of `values` (NaN for one value): `mean ± se (n)`; `fmt` formats the mean, `count`
    appends the number of values."""
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):{fmt}}{sep}{se:.3f}" + (f" ({len(values)})" if count else "")


class Goals:
    """The three goals, counted over the cells printed."""

    def __init__(self):
        self.cells = self.near_best = self.not_below_paper = self.moved = self.share_on_target = 0

    def report(self) -> str:
        return (f"goals: within 1 SE of the best fixed band in {self.near_best} of {self.cells} cells; not below the "
                f"paper's band by more than 1 SE in {self.not_below_paper} of {self.cells}; clipped share within "
                f"+-{SHARE_TOLERANCE:.0%} of {TARGET:g} in {self.share_on_target} of {self.moved} cells where a "
                "ratio moved")


def row(label: str, rewards: dict[str, list[float]], shares: list[float], equal: list[float], goals: Goals,
        marks: dict[str, str] | None = None) -> str:
    """One markdown row. `rewards`: arm -> last-window reward per seed; `shares`: the adaptive band's clipped share of
    learnable tokens, per step with signal, after each run's first 20% of steps (empty: no ratio moved); `equal`: the
    share of groups with equal rewards per step, over the cell's runs; `marks`: a prefix per arm (`= `)."""
    marks = marks or {}
    cells = [f"{marks.get(arm, '')}{mean_se(rewards[arm])}" if rewards.get(arm) else "-" for arm in ARMS]
    means = {arm: statistics.fmean(values) for arm, values in rewards.items() if values}
    adaptive = rewards.get("adaptive")

    def versus(arm, name=None):
        if not adaptive or arm not in means:
            return "-", float("nan")
        z = difference_in_se(adaptive, rewards[arm])
        return f"{means['adaptive'] - means[arm]:+.3f} ({z:+.1f} SE{', vs ' + name if name else ''})", z

    best = max((arm for arm in FIXED if arm in means), key=means.get, default=None)
    against_best, z_best = versus(best, NAMES.get(best)) if best else ("-", float("nan"))
    against_paper, z_paper = versus("paper")
    against_trl, _ = versus("trl")
    share = statistics.fmean(shares) if shares else float("nan")
    share_text = f"{share:.3f} ({share / TARGET - 1:+.0%})" if shares else "nothing moved"
    if adaptive:
        goals.cells += 1
        goals.near_best += not z_best < -1  # NaN (one seed, or no spread) counts as met
        goals.not_below_paper += not z_paper < -1
        if shares:
            goals.moved += 1
            goals.share_on_target += abs(share / TARGET - 1) <= SHARE_TOLERANCE
    equal_text = f"{statistics.fmean(equal):.2f}" if equal else "-"
    return f"| {label} | " + " | ".join([*cells, against_best, against_paper, against_trl, share_text,
                                         equal_text]) + " |"


def header(first: str) -> str:
    return (f"| {first} | " + " | ".join(NAMES[arm] for arm in ARMS) + " " + HEADER + "\n"
            + "|---" * (len(ARMS) + 6) + "|")


def settled(values: list[float]) -> list[float]:
    """The values after a run's first 20% of steps, NaN (a step without signal) left out."""
    return [v for v in values[len(values) // 5:] if not math.isnan(v)]
