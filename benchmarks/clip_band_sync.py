"""GSPO's clip bands, synchronous, on the quickstart's setup (recipes/quickstart.yaml: GSPOTrainer, 4 mini-batches
per rollout, pi_old recomputed by the trainer, 600 steps, cosine schedule): the paper's fixed band, 10x and 100x
wider fixed bands, the band set by the run (`clip_band: adaptive`) and TRL's token loss (`loss_type: grpo`, eps 0.2,
the same 4 mini-batches per rollout), at two learning rates 10x apart, on the quickstart's task and on a harder one
(`--tasks`: the share of correct answers in the cold start's data; 0.1 leaves most groups with equal rewards), several
seeds per cell. Each run is the `trl-gspo` command on the recipe with `--seed`, `--learning_rate`,
`--sft_correct_fraction` and the arm's options changed; its trainer_state.json is read back.

    python benchmarks/clip_band_sync.py --out runs.json      # 2 lrs x 2 tasks x 5 arms x seeds 0-3: ~2 h, 2 cores
    python benchmarks/clip_band_sync.py --summarize runs.json more.json   # the table over earlier --out files
    python benchmarks/clip_band_sync.py --quick --steps 8 --sft-steps 20   # the test suite's smoke run

The table (benchmarks/_band_table.py): per task and learning rate, the reward in the last 20% of the logging windows
of each arm (mean ± standard error over seeds), the band set by the run against the best fixed band, the paper's
band and TRL's token loss, its clipped share of learnable tokens (`gspo/clip_band_clipped_fraction`, after the first
20% of windows) and the share of groups with equal rewards (TRL's `frac_reward_zero_std`). Last line, exactly:
`clip_band_sync: <task>:<lr>:<arm> <reward last> ...`.
"""

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _band_table  # noqa: E402
import _setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"paper": [], "10x": ["--epsilon", "3e-3", "--epsilon_high", "4e-3"],
        "100x": ["--epsilon", "3e-2", "--epsilon_high", "4e-2"], "adaptive": ["--clip_band", "adaptive"],
        "trl": ["--loss_type", "grpo", "--steps_per_generation", "4"]}


def run(task: float, lr: float, arm: str, seed: int, out: Path, max_steps: int | None,
        sft_steps: int | None = None) -> dict:
    command = [sys.executable, "-m", "trl_gspo.launch.cli", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
               "--output_dir", str(out), "--seed", str(seed), "--learning_rate", str(lr),
               "--sft_correct_fraction", str(task), "--plot", "false", *ARMS[arm]]
    if sft_steps is not None:
        command += ["--sft_steps", str(sft_steps)]
    # The cold start depends on the task and the seed only: the first run of a (task, seed) prepares it, the others
    # start from a copy (the launcher reuses a prepared model whose inputs match).
    prepared = out.parent / f"cold-start-{task:g}-{seed}-{sft_steps}"
    if prepared.is_dir():
        shutil.copytree(prepared, out / "initial_model")
    if max_steps:
        command += ["--max_steps", str(max_steps), "--logging_steps", "4"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{arm} lr {lr} task {task} seed {seed} failed:\n{result.stderr[-3000:]}")
    if not prepared.is_dir():
        shutil.copytree(out / "initial_model", prepared)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    windows = [h for h in history if "reward" in h]
    tail = windows[-max(1, len(windows) // 5):]

    def series(key):
        return [h.get(key, math.nan) for h in windows]

    return {"reward_last": statistics.mean(h["reward"] for h in tail), "band_share": series("gspo/clip_band_clipped_fraction"),
            "clipped": series("gspo/clipped_token_fraction"), "epsilon": series("gspo/clip_epsilon_low"),
            "equal_groups": series("frac_reward_zero_std")}


def print_tables(runs: dict) -> None:
    goals = _band_table.Goals()
    cells = {}
    for key, group in runs.items():
        task, lr, arm = key.split(":")
        cells.setdefault((float(task), float(lr)), {})[arm] = group
    for task in sorted({task for task, _ in cells}, reverse=True):
        name = "the quickstart's task" if task == 0.5 else f"the harder task (cold start {task:g} correct)"
        print(f"\n{name}\n")
        print(_band_table.header("learning rate"))
        for lr in sorted((lr for t, lr in cells if t == task), reverse=True):
            arms = cells[task, lr]
            rewards = {arm: [r["reward_last"] for r in group] for arm, group in arms.items()}
            shares = [s for r in arms.get("adaptive", []) for s in _band_table.settled(r["band_share"])]
            equal = [e for group in arms.values() for r in group for e in r["equal_groups"] if not math.isnan(e)]
            print(_band_table.row(f"{lr:g}", rewards, shares, equal, goals))
    print("\n" + goals.report())
    print("clip_band_sync: " + " ".join(f"{key} {statistics.mean(r['reward_last'] for r in group):.3f}"
                                        for key, group in runs.items()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 5e-5])
    parser.add_argument("--tasks", type=float, nargs="+", default=[0.5, 0.1],
                        help="share of correct answers in the cold start's data (the quickstart's 0.5; 0.1: harder)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--quick", action="store_true", help="lr 5e-4, the quickstart's task, seed 0, paper's band "
                        "and adaptive, 40 steps")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's; "
                        "--quick: 40)")
    parser.add_argument("--sft-steps", type=int, default=None, help="cold-start steps (default: the recipe's 600)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (the first run of each task and seed prepares "
                        "the cold start the others copy)")
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here (JSON)")
    parser.add_argument("--summarize", nargs="+", type=Path, help="print the table over earlier --out files, run "
                        "nothing")
    args = parser.parse_args()
    if args.summarize:
        runs = {}
        for path in args.summarize:
            for key, group in json.loads(path.read_text()).items():
                runs.setdefault(key, []).extend(group)
        print_tables(runs)
        return
    if args.quick:
        args.lrs, args.tasks, args.seeds, args.arms = [5e-4], [0.5], [0], ["paper", "adaptive"]
    import torch

    _setup.header("clip_band_sync", "cpu", torch.float32, "the quickstart's")
    specs = [(task, lr, arm, seed) for task in args.tasks for lr in args.lrs for seed in args.seeds for arm in args.arms]
    runs = {f"{task:g}:{lr:g}:{arm}": [] for task, lr, arm, _ in specs}
    with tempfile.TemporaryDirectory() as scratch:
        def launch(spec):
            task, lr, arm, seed = spec
            key = f"{task:g}:{lr:g}:{arm}"
            result = run(task, lr, arm, seed, Path(scratch) / f"{key}-{seed}", args.steps or (40 if args.quick else None),
                         args.sft_steps)
            runs[key].append(result)
            bands = [e for e in result["epsilon"] if not math.isnan(e)]  # the band each logging window trained with
            moved = f", epsilon {bands[0]:.3g} -> {bands[-1]:.3g}" if bands else ", fixed band"
            print(f"{key} seed {seed}: reward {result['reward_last']:.3f}{moved}", flush=True)
            if args.out:  # after every run, so an interrupted sweep keeps what finished
                args.out.write_text(json.dumps(runs, indent=1))

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(launch, specs))
    print_tables({key: group for key, group in runs.items() if group})


if __name__ == "__main__":
    main()
