"""GSPO's fixed paper band against `clip_band="adaptive"`, synchronous, on the quickstart's setup
(recipes/quickstart.yaml: GSPOTrainer, 4 mini-batches per rollout, pi_old recomputed by the trainer, 600 steps,
cosine schedule), at two learning rates 10x apart, several seeds per cell. Each run is the `trl-gspo` command on the
recipe with `--seed`, `--learning_rate` and `--clip_band` changed; its trainer_state.json is read back.

    python benchmarks/clip_band_sync.py                       # lr 5e-4 and 5e-5, seeds 0-3, both arms: ~20 min, 2 cores
    python benchmarks/clip_band_sync.py --quick               # lr 5e-4, seed 0, 40 steps: the code path only
    python benchmarks/clip_band_sync.py --quick --steps 8 --sft-steps 20   # the test suite's smoke run

Per cell, mean +- standard error over seeds: reward in the last 20% of the logging windows, the clipped-token share
(`gspo/clipped_token_fraction`, mean over the run) and the band at the end (`epsilon`). Last line, exactly:
`clip_band_sync: <lr>:<arm> <reward last> ...`.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("fixed", "adaptive")


def run(lr: float, arm: str, seed: int, out: Path, max_steps: int | None, sft_steps: int | None = None) -> dict:
    command = [sys.executable, "-m", "trl_gspo.launch.cli", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
               "--output_dir", str(out), "--seed", str(seed), "--learning_rate", str(lr), "--clip_band", arm,
               "--plot", "false"]
    if sft_steps is not None:
        command += ["--sft_steps", str(sft_steps)]
    if max_steps:
        command += ["--max_steps", str(max_steps), "--logging_steps", "4"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{arm} lr {lr} seed {seed} failed:\n{result.stderr[-3000:]}")
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    windows = [h for h in history if "reward" in h]
    tail = windows[-max(1, len(windows) // 5):]
    clipped = [h["gspo/clipped_token_fraction"] for h in windows if "gspo/clipped_token_fraction" in h]
    bands = [h["gspo/clip_epsilon_low"] for h in windows if "gspo/clip_epsilon_low" in h]
    return {"reward_last": statistics.mean(h["reward"] for h in tail), "clipped": statistics.mean(clipped),
            "epsilon": bands[-1] if bands else 3e-4}


def mean_se(values):
    mean = statistics.mean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return mean, se


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 5e-5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--quick", action="store_true", help="lr 5e-4, seed 0, 40 steps")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's; "
                        "--quick: 40)")
    parser.add_argument("--sft-steps", type=int, default=None, help="cold-start steps (default: the recipe's 600)")
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here (JSON)")
    args = parser.parse_args()
    if args.quick:
        args.lrs, args.seeds = [5e-4], [0]
    import torch

    _setup.header("clip_band_sync", "cpu", torch.float32, "the quickstart's")
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for lr in args.lrs:
            for seed in args.seeds:
                for arm in ARMS:
                    key = f"{lr:g}:{arm}"
                    runs.setdefault(key, []).append(run(lr, arm, seed, Path(scratch) / f"{key}-{seed}",
                                                        args.steps or (40 if args.quick else None), args.sft_steps))
                    print(f"{key} seed {seed}: {runs[key][-1]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    print(f"\n| lr | band | seeds | reward, last 20% | clipped tokens | epsilon at the end |\n|---|---|---|---|---|---|")
    for key, cell in runs.items():
        lr, arm = key.split(":")
        (reward, reward_se), (clipped, clipped_se), (epsilon, _) = (
            mean_se([r[name] for r in cell]) for name in ("reward_last", "clipped", "epsilon"))
        print(f"| {lr} | {arm} | {len(cell)} | {reward:.3f} +- {reward_se:.3f} | {clipped:.3f} +- {clipped_se:.3f} | "
              f"{epsilon:.3g} |")
    print("clip_band_sync: " + " ".join(f"{key} {statistics.mean(r['reward_last'] for r in cell):.3f}"
                                        for key, cell in runs.items()))


if __name__ == "__main__":
    main()
