"""On-policy noise floor of GSPO's sequence ratio.

On the first mini-batch of each rollout batch the policy has not been updated since TRL's old-policy pass, so the
true ratio is exactly 1 and every `|log s_i|` measured there is numerical noise: the old pass and the training pass
run the same weights through different batch shapes and kernels (and, on MoE models, near-tied routers can flip).
This runs a short GSPO training (4 mini-batches per rollout batch) and compares `gspo/log_ratio_abs_max` on those
on-policy mini-batches with the 3e-4 clip band, and with the off-policy mini-batches that follow.

    python benchmarks/noise_floor.py                                   # float32 and bfloat16 on CPU
    python benchmarks/noise_floor.py --size gpu --device cuda           # Qwen3-30B-A3B layer shapes, one GPU

Last line: `noise_floor: <max on-policy |log s_i| in bf16 / 3e-4> (target < 0.1)`, the noise as a fraction of the
clip band. Ratio arithmetic is float32 whatever the model dtype (trl_gspo.losses), so this is the forward's noise.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402

BAND = 3e-4  # the paper's left clip width, the narrower side
STEPS_PER_GENERATION = 4


def measure(cli, dtype: torch.dtype) -> dict:
    model, tokenizer = _setup.build(cli.size, cli.device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _setup.trainer("gspo", model, tokenizer, tmp, cli.device, dtype, cli.completion_length, cli.batch,
                                 max_steps=cli.rollouts * STEPS_PER_GENERATION, learning_rate=cli.learning_rate)
        trainer.train()
    history = [h for h in trainer.state.log_history if "gspo/log_ratio_abs_max" in h]
    on_policy = [h["gspo/log_ratio_abs_max"] for h in history if (h["step"] - 1) % STEPS_PER_GENERATION == 0]
    off_policy = [h["gspo/log_ratio_abs_max"] for h in history if (h["step"] - 1) % STEPS_PER_GENERATION != 0]
    return {"on_policy": on_policy, "off_policy": off_policy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(_setup.SIZES), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rollouts", type=int, default=5, help="rollout batches (4 optimizer steps each)")
    parser.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    cli = parser.parse_args()

    _setup.header("noise_floor", cli.device, "/".join(cli.dtypes), _setup.size_kernel(cli.size))
    print(f"size={cli.size} device={cli.device} rollouts={cli.rollouts} batch={cli.batch} "
          f"completion_length={cli.completion_length}; clip band {BAND:g}")
    print(f"{'dtype':>9} | {'on-policy max |log s|':>22} {'median':>9} | {'off-policy max |log s|':>23} {'median':>9}")
    results = {}
    for name in cli.dtypes:
        run = measure(cli, getattr(torch, name))
        results[name] = run
        print(f"{name:>9} | {max(run['on_policy']):>22.3g} {statistics.median(run['on_policy']):>9.3g} | "
              f"{max(run['off_policy']):>23.3g} {statistics.median(run['off_policy']):>9.3g}")
    reported = "bfloat16" if "bfloat16" in results else cli.dtypes[-1]
    print(f"noise_floor: {max(results[reported]['on_policy']) / BAND:.4f} (target < 0.1; {reported} on-policy "
          f"max |log s_i| / {BAND:g})")


if __name__ == "__main__":
    main()
