"""GSPO under staleness, in miniature: what GSPO's narrow clip band (3e-4 / 4e-4) does when every sample is k weight
versions old, as in asynchronous RL (`AsyncGSPOTrainer`), against TRL's asynchronous token-level loss (eps 0.2),
GSPO with a bound for negative advantages (`gspo_delta`: `delta=2`, two-sided clip) and GSPO with a band 10x wider
(`gspo_wide`: 3e-3 / 4e-3), and GSPO with R3 (`gspo_r3`: the sampler's routes, recorded in its own forward over
the sampled tokens, forced in the training forward), and TRL 1.16's sequence-level successors of GSPO as
`AsyncGSPOTrainer` runs them, each with `AsyncGSPOConfig`'s defaults (`luspo`, `vespo`, `sapo`, `cispo`; `LOSSES`),
with a float32 or a bfloat16 sampler.

Task: the quickstart's single-digit addition (exact-match reward) on its tiny Qwen3-MoE after the noisy SFT cold start
(600 steps, 50% correct answers; built once and cached, as benchmarks/sampler_likelihoods.py builds it). Its answers
differ in length: a sum of two digits 0-9 is 0-18, so 45% of the prompts' answers have two digits (3 tokens with
<eos>, against 2); the exact-match reward pays the right sum whatever its length, so it favours no length. The harder
task: the same with a weaker cold start (`--sft-correct-fraction 0.1`: 10% correct answers).

Each step: 4 prompts x 8 completions sampled by HF generate from the policy as it was k optimizer steps earlier (the
first k steps: the initial policy), in float32 or in bfloat16; pi_old = the sampler's own log-probs (never
recomputed, as TRL's asynchronous trainer takes them); group-normalized advantages (TRL's rollout worker's rule). The
samples are packed by TRL's packer into one row and trained once by `AsyncGSPOTrainer.compute_loss` (TRL's own
`compute_loss` for "grpo"), one optimizer step per batch, lr 5e-4 constant, grad norm clip 1. The benchmark drives the
trainer's loss step by step so every sample's age is exactly k: through `trainer.train()`, TRL's data loader reads a
batch ahead of the weight sync (measured, tests/test_async_trainer.py), so ages there are k or k + 1.

Per arm (loss x staleness x sampler dtype), over seeds:
- `clipped seq`: share of completions whose ratio was clipped (gspo, luspo: sequence ratio; grpo: any token clipped;
  cispo: any token's weight capped at epsilon_high; sapo, vespo: nan, no hard clip);
- `clipped tok`: share of completion tokens whose objective was the clipped term;
- `max|log s|`: the largest |sequence log-ratio| of a step (current policy vs the sampler), mean over steps;
- `R3 drift`: with R3, the share of (token, layer) routes whose natural top-k in the training forward differs from
  the sampler's (`routing/replay_drift`), mean over steps;
- `reward first / last`: mean reward over the first and the last 20% of steps (the sampler's samples: a stale
  sampler's reward lags the policy by k steps);
- `len first / last`: mean completion length over the first and the last 20% of steps, in tokens with the <eos>
  (TRL's `completions/mean_length`, which TRL's rollout worker logs and this benchmark, standing in for it, computes
  by the same rule; each step's figure is in the runs file as `mean_length`); `--loss-table` adds the last window's
  length over the correct answer's (`answer_length`, the same prompts for every arm at a seed).

    python benchmarks/async_staleness.py             # 3 seeds, 150 steps, staleness 0 1 2 4: ~25 min on 2 cores
    python benchmarks/async_staleness.py --quick     # 1 seed, 30 steps, staleness 0 and 4
    python benchmarks/async_staleness.py --summarize runs.json more_runs.json   # one table over earlier --out files
    python benchmarks/async_staleness.py --summarize runs.json --loss-table     # one row per loss, by staleness

The full loss table's commands (every sequence-level loss and TRL's token loss; `FULL_TABLE`) and its run count:
the end of `--help`, and the top of `--loss-table`'s output.

Last line, exactly: `async_staleness: <arm> <reward last> ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _band_table import difference_in_se  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER = dict(epsilon=3e-4, epsilon_high=4e-4)  # the GSPO paper's band
LOSSES = {"gspo": dict(loss_type="gspo", **PAPER), "gspo_delta": dict(loss_type="gspo", delta=2.0, **PAPER),
          "gspo_wide": dict(loss_type="gspo", epsilon=3e-3, epsilon_high=4e-3),
          "gspo_wide100": dict(loss_type="gspo", epsilon=3e-2, epsilon_high=4e-2),
          # The band set by the run (clip_band="adaptive"): starts at the paper's, moves toward 15% clipped tokens.
          "gspo_adaptive": dict(loss_type="gspo", clip_band="adaptive", **PAPER),
          "gspo_adaptive0.05": dict(loss_type="gspo", clip_band="adaptive", clip_band_target=0.05, **PAPER),
          "gspo_band0.2": dict(loss_type="gspo", epsilon=0.2, epsilon_high=0.2),  # TRL's token band, per sequence
          "gspo_r3": dict(loss_type="gspo", routing_replay="sampler", **PAPER), "grpo": dict(loss_type="grpo"),
          # The decoupled objective (docs/gspo.md): the band against the trainer's weights, the sampler-to-trainer gap
          # as a length-normalised sequence weight, truncated at C = 2 or 1.1, or masked outside [1/1.1, 1.1].
          "dec_trunc2": dict(loss_type="gspo", **PAPER, staleness_correction="truncate", staleness_weight_cap=2.0),
          "dec_trunc1.1": dict(loss_type="gspo", **PAPER, staleness_correction="truncate", staleness_weight_cap=1.1),
          "dec_mask1.1": dict(loss_type="gspo", **PAPER, staleness_correction="mask", staleness_weight_cap=1.1),
          "dec_trunc2_r3": dict(loss_type="gspo", **PAPER, staleness_correction="truncate", staleness_weight_cap=2.0,
                                routing_replay="sampler"),
          # TRL's token loss with a sequence-level truncated correction (`seq_tis_loss`): the token ratio against the
          # trainer's weights, each token weighed by min(prod_t pi_prox / mu, 2), the un-normalised product.
          "grpo_seq_tis": dict(loss_type="grpo"),
          # TRL 1.16's sequence-level successors of GSPO, each with AsyncGSPOConfig's defaults. LUSPO (GSPO's term
          # times the completion's length) clips GSPO's sequence ratio with GSPO's band, unset: the band set by the run
          # (clip_band="adaptive", from the paper's 3e-4 / 4e-4), as `gspo_adaptive`; `luspo_paper`: the paper's band,
          # fixed, as `gspo`. VESPO (a Gamma weight of the sequence ratio, k / lambda 2 / 3 and 3 / 2) and SAPO (a
          # sigmoid gate, temperatures 1.0 / 1.05) have no hard clip; CISPO caps each token's weight at 5.0.
          "luspo": dict(loss_type="luspo"), "luspo_paper": dict(loss_type="luspo", **PAPER),
          "vespo": dict(loss_type="vespo"), "sapo": dict(loss_type="sapo"), "cispo": dict(loss_type="cispo")}
SEQ_TIS_CAP = 2.0
PROMPTS, GROUP, MAX_NEW = 4, 8, 4
# The full loss table (`--loss-table`): every sequence-level loss (the paper's band, the band set by the run, TRL's
# successors) and TRL's token loss, in this order; at these stalenesses, seeds, learning rate and steps; per setting
# (cold start's correct fraction, sampler dtypes, runs file): float32 and bfloat16 samplers on the quickstart's task,
# float32 on the harder task (the cold start of the published harder-task runs: 10% correct).
LOSS_TABLE = ("gspo", "gspo_adaptive", "luspo", "vespo", "sapo", "cispo", "grpo")
FULL_TABLE = dict(staleness=(0, 1, 4, 16), seeds=4, lr=5e-4, steps=150,
                  settings=((0.5, "float32,bfloat16", "loss_table_quickstart.json"),
                            (0.1, "float32", "loss_table_harder.json")))
# Seconds a 150-step run took, two at a time on 2 cores: the mean over the 352 runs of
# benchmarks/clip_band_results/async_*.json (the clip band tables' runs).
SECONDS_PER_RUN = 47


def seq_tis_loss(trainer, model, inputs):
    """TRL's asynchronous token loss (eps 0.2, mean over the micro-batch's tokens) with the token ratio taken against
    the proximal policy (these weights: each sample trains once, so the ratio is 1 in value) and every token of
    completion i weighed by min(exp(sum_t log pi_prox(y_i,t) - log mu(y_i,t)), SEQ_TIS_CAP): a sequence-level
    truncated importance weight as TRL's synchronous `sequence_truncate` takes it (a product over the completion)."""
    import torch

    targets = inputs["token_index"] >= 0
    logps, _, _ = trainer._packed_forward(model, inputs)
    segment_id, behaviour = inputs["segment_id"][targets], inputs["old_log_probs"][targets]
    advantages = inputs["advantages"][targets]
    log_gap = torch.zeros(int(segment_id.max()) + 1).index_add_(0, segment_id, logps.detach() - behaviour)
    weight = log_gap.exp().clamp(max=SEQ_TIS_CAP)[segment_id]
    ratio = torch.exp(logps - logps.detach())
    clipped = ratio.clamp(1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages) * weight
    trainer._metrics["train"]["clip_ratio/region_mean"].append(float((log_gap.exp() > SEQ_TIS_CAP).float().mean()))
    trainer._metrics["train"]["gspo/log_ratio_abs_max"].append(
        float((log_gap / torch.bincount(segment_id)).abs().max()))
    return per_token.sum() / max(per_token.numel(), 1)


def one_run(spec: dict) -> dict:
    """One run in this process; returns its per-step figures."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    from support import async_stand_ins
    from support.async_stand_ins import NoWeightTransfer, QueueWorker  # no server: the benchmark samples itself

    async_stand_ins.install()
    from trl.experimental.async_grpo.packing import TreeRow

    from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer
    from trl_gspo.async_trainer.trainer import _VersionedRolloutCollator
    from trl_gspo.quickstart.addition import exact_match_reward, make_rl_dataset
    from trl_gspo.routing.replay import RoutingReplay
    from trl_gspo.trainer.clip_band import end_band_step

    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    model_dir, staleness, dtype = spec["model_dir"], spec["staleness"], getattr(torch, spec["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # bf16=False said, not left to TRL's default (True): the trainer computes in float32, as the tables say. The
    # steps are driven by hand (no `train()`, so accelerate never wraps the forward in autocast): the runs published
    # before this line was added also trained in float32 (on-policy, k = 0, no ratio moved).
    args = AsyncGSPOConfig(output_dir=spec["output_dir"], use_cpu=True, bf16=False, report_to="none",
                           disable_tqdm=True, save_strategy="no", seed=spec["seed"], learning_rate=spec.get("lr", 5e-4),
                           max_steps=spec["steps"],
                           max_staleness=staleness, token_budget=0, **LOSSES[spec["loss"]])
    trainer = AsyncGSPOTrainer(model=model_dir, args=args, train_dataset=make_rl_dataset(8, seed=0),
                               processing_class=tokenizer, rollout_worker=QueueWorker(),
                               weight_transfer=NoWeightTransfer())
    model = trainer.model
    if spec["loss"] == "grpo_seq_tis":
        trainer.compute_loss = lambda model, inputs, *a, **k: seq_tis_loss(trainer, model, inputs)
    trainer.create_optimizer_and_scheduler(num_training_steps=spec["steps"])
    trainer.current_gradient_accumulation_steps = 1
    routing = trainer._routing  # RoutingReplay on the policy with routing_replay="sampler", else None
    collator = _VersionedRolloutCollator(pad_token_id=tokenizer.pad_token_id, num_processes=1,
                                         route_shape=(len(routing.routers), routing.top_k) if routing else None)
    sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    sampler_routes = RoutingReplay(sampler) if routing else None
    versions = deque([{k: v.detach().clone() for k, v in model.state_dict().items()}], maxlen=staleness + 1)
    data = make_rl_dataset(spec["steps"] * PROMPTS, seed=spec["seed"])
    steps = []
    for step in range(spec["steps"]):
        sampler.load_state_dict(versions[0])  # the policy `staleness` steps ago (cast to the sampler's dtype)
        rows = data[step * PROMPTS:(step + 1) * PROMPTS]
        samples, rewards, equal_groups = [], [], 0
        lengths, answer_lengths, truncated = [], [], 0  # per completion, in tokens with the <eos>
        for group, (prompt, answer) in enumerate(zip(rows["prompt"], rows["answer"])):
            prompt_ids = tokenizer(prompt)["input_ids"]
            with torch.no_grad():
                out = sampler.generate(torch.tensor([prompt_ids] * GROUP), do_sample=True, temperature=1.0,
                                       top_k=0, top_p=1.0, max_new_tokens=MAX_NEW, pad_token_id=tokenizer.pad_token_id,
                                       eos_token_id=tokenizer.eos_token_id)
                if sampler_routes is None:
                    logits = sampler(out).logits.float()
                else:  # the sampler's own routes for the tokens it sampled (R3)
                    with sampler_routes.record() as recording:
                        logits = sampler(out).logits.float()
            logps = logits[:, :-1].log_softmax(-1).gather(-1, out[:, 1:, None])[..., 0]
            texts, completions = [], []
            for row in range(GROUP):
                completion = out[row, len(prompt_ids):].tolist()
                if tokenizer.eos_token_id in completion:
                    completion = completion[:completion.index(tokenizer.eos_token_id) + 1]
                completions.append(completion)
                texts.append(tokenizer.decode(completion))
            reward = np.array(exact_match_reward(texts, answer=[answer] * GROUP), dtype=float)
            # TRL's rollout worker's `completions/mean_length` (completion tokens, the <eos> included) and
            # `completions/clipped_ratio` (no <eos>: cut off at MAX_NEW); the correct answer's length, the same rule
            lengths.extend(len(completion) for completion in completions)
            truncated += sum(completion[-1:] != [tokenizer.eos_token_id] for completion in completions)
            answer_lengths.extend([len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1] * GROUP)
            advantages = (reward - reward.mean()) / (reward.std() + 1e-8)  # TRL's rollout worker's rule
            differ = bool(reward.max() > reward.min())  # what the trainer's rollout loop marks (GroupRewardsLoop)
            equal_groups += not differ  # every completion the same reward: nothing to learn
            rewards.extend(reward.tolist())
            for row, completion in enumerate(completions):
                n = len(completion)
                sampled = logps[row, len(prompt_ids) - 1:len(prompt_ids) - 1 + n].tolist()
                samples.append({"input_ids": np.array(prompt_ids + completion),
                                "completion_mask": np.array([0] * len(prompt_ids) + [1] * n),
                                "old_log_probs": np.array([0.0] * len(prompt_ids) + sampled, dtype=np.float32),
                                "advantage": float(advantages[row]), "group_id": group, "metrics": {},
                                "rewards_differ": differ,
                                "model_version": step + 1 - len(versions),
                                "routes": (recording.indices[row, :len(prompt_ids) + n - 1].numpy()
                                           if sampler_routes is not None else None)})
        row = TreeRow()
        for sample in samples:
            row.add(sample)
        batch = collator([[row]])
        trainer._policy_version = step
        # The sampler of a sample of the policy's own version held these weights (what a weight sync after every
        # step gives `trainer.train()`): its ratio measures the sampler's noise, which the adaptive band stays above.
        trainer._synced_at_step = trainer.state.global_step
        loss = trainer.training_step(model, batch)  # the loss and its backward (inside R3's replay block)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad()
        trainer.state.global_step += 1
        if trainer._adaptive_band is not None:  # the step's end, as its callback runs it in `trainer.train()`
            end_band_step(trainer, skipped=False)
        versions.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        logged = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
        logged = {name: (v[0] / v[1] if v[1] else float("nan")) if isinstance(v, tuple) and name != "routing/replay_drift"
                  else v for name, v in logged.items()}  # (sum, count) rates as values
        trainer._metrics["train"].clear()
        capped = float("nan")
        if spec["loss"] == "grpo":  # TRL's metrics: token shares
            clipped_seq, clipped_tok = float("nan"), logged["clip_ratio/region_mean"]
            log_ratio = float("nan")
        elif spec["loss"] == "grpo_seq_tis":  # no clip binds (ratio 1); "capped": weights the cap truncated
            clipped_seq, clipped_tok, capped = 0.0, 0.0, logged["clip_ratio/region_mean"]
            log_ratio = logged["gspo/log_ratio_abs_max"]
        elif "staleness_correction" in LOSSES[spec["loss"]]:  # |log w_i|: the sampler-to-trainer gap
            clipped_seq, clipped_tok = logged["clip_ratio/region_mean"], logged["gspo/clipped_token_fraction"]
            log_ratio = logged["gspo/behaviour_log_weight_abs_max"]
            capped = logged["gspo/behaviour_weight/capped_fraction"]
        else:  # gspo types and TRL's successors; sapo and vespo (no hard clip) log no clip metric: NaN
            clipped_seq = logged.get("clip_ratio/region_mean", float("nan"))
            clipped_tok = logged.get("gspo/clipped_token_fraction", float("nan"))
            log_ratio = logged["gspo/log_ratio_abs_max"]
        drift = logged.get("routing/replay_drift")
        steps.append({"reward": statistics.fmean(rewards), "clipped_seq": clipped_seq, "clipped_tok": clipped_tok,
                      "log_ratio_abs_max": log_ratio, "loss": float(loss), "capped": capped,
                      "replay_drift": drift[0] / drift[1] if drift else float("nan"),
                      "equal_groups": equal_groups / PROMPTS,
                      "mean_length": statistics.fmean(lengths), "answer_length": statistics.fmean(answer_lengths),
                      "truncated": truncated / len(lengths),
                      "phi_seq_mean": float(logged.get("vespo/phi_seq_mean", float("nan"))),  # vespo's Gamma weight
                      # the adaptive band: the epsilon this step trained with, the noise floor under it, and the
                      # share of learnable tokens it clipped (what the rule reads; NaN on a step without signal)
                      "epsilon": logged.get("gspo/clip_epsilon_low", trainer.epsilon_low),
                      "noise_floor": logged.get("gspo/clip_band_noise_floor", float("nan")),
                      "band_share": logged.get("gspo/clip_band_clipped_fraction", float("nan"))})
    return {"steps": steps}


def summarize(run: dict) -> dict:
    steps = run["steps"]
    fifth = max(len(steps) // 5, 1)

    def mean(key, part):
        values = [s.get(key, float("nan")) for s in part]
        values = [v for v in values if v == v]
        return statistics.fmean(values) if values else float("nan")

    excess = [{"excess": s["mean_length"] - s["answer_length"]} for s in steps[-fifth:] if "mean_length" in s]
    return {"reward_first": mean("reward", steps[:fifth]), "reward_last": mean("reward", steps[-fifth:]),
            "clipped_seq": mean("clipped_seq", steps), "clipped_tok": mean("clipped_tok", steps),
            "log_ratio_abs_max": mean("log_ratio_abs_max", steps), "replay_drift": mean("replay_drift", steps),
            "capped": mean("capped", steps),
            # completion length (runs files from before it was logged: NaN): the first and last 20% of steps, and
            # the last window's length over the correct answer's
            "length_first": mean("mean_length", steps[:fifth]), "length_last": mean("mean_length", steps[-fifth:]),
            "length_excess_last": mean("excess", excess), "truncated_last": mean("truncated", steps[-fifth:])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=full_table_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 30 steps, staleness 0 and 4")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=5e-4, help="the trainer's constant learning rate")
    parser.add_argument("--staleness", default="0,1,2,4")
    parser.add_argument("--losses", default="gspo,gspo_delta,grpo")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    parser.add_argument("--sft-steps", type=int, default=600, help="cold-start steps (the quickstart's 600)")
    parser.add_argument("--sft-correct-fraction", type=float, default=0.5,
                        help="share of correct answers in the cold start's data (the quickstart's 0.5); lower gives a "
                             "weaker policy whose groups mostly get equal rewards (0.1: the harder task of the "
                             "published tables)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trl_gspo_bench"))
    parser.add_argument("--out", help="write every run's per-step figures here (JSON)")
    parser.add_argument("--summarize", nargs="+", metavar="RUNS_JSON",
                        help="print the table over the runs of earlier --out files (their seeds together), run nothing")
    parser.add_argument("--markdown", action="store_true",
                        help="with --summarize: print the docs' tables (reward, clipped share) as markdown")
    parser.add_argument("--band-table", action="store_true",
                        help="with --summarize: the adaptive band against the fixed bands and TRL's token loss, per "
                             "learning rate, sampler and staleness (markdown)")
    parser.add_argument("--loss-table", action="store_true",
                        help="with --summarize: one row per loss, the last-window reward per staleness (mean ± "
                             "standard error, seeds) and the completion length, per task, learning rate and sampler "
                             "(markdown), under the full table's command")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run in this process
    options = parser.parse_args()
    if options.one:
        print("RESULT " + json.dumps(one_run(json.loads(options.one))), flush=True)
        return
    if options.summarize:
        runs = [(entry.pop("spec"), entry) for path in options.summarize for entry in json.loads(Path(path).read_text())]
        if options.band_table:
            print_band_table(runs)
        elif options.loss_table:
            print_loss_table(runs)
        elif options.markdown:
            print_markdown(runs)
        else:
            print_table(runs, ", ".join(sorted({f"{spec['steps']} steps" for spec, _ in runs})))
        return
    seeds, steps, stalenesses = ((1, 30, [0, 4]) if options.quick else
                                 (options.seeds, options.steps, [int(k) for k in options.staleness.split(",")]))
    import _setup
    import torch
    from sampler_likelihoods import build_cold_started

    _setup.header("async_staleness", "cpu", torch.float32, "trainer float32")
    suffix = "" if options.sft_correct_fraction == 0.5 else f"_correct{options.sft_correct_fraction:g}"
    model_dir = build_cold_started(Path(options.cache) / f"sampler_likelihoods_model_sft{options.sft_steps}{suffix}",
                                   options.sft_steps, options.sft_correct_fraction)
    specs = [dict(loss=loss, staleness=k, dtype=dtype, seed=seed, steps=steps, model_dir=str(model_dir), lr=options.lr,
                  sft_correct_fraction=options.sft_correct_fraction)
             for loss in options.losses.split(",") for dtype in options.dtypes.split(",") for k in stalenesses
             for seed in range(options.first_seed, options.first_seed + seeds)]

    finished, lock = [], threading.Lock()

    def launch(spec):
        with tempfile.TemporaryDirectory() as output_dir:
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
            started = time.perf_counter()
            done = subprocess.run([sys.executable, __file__, "--one", json.dumps({**spec, "output_dir": output_dir})],
                                  env=env, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{spec} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        run = json.loads(line[len("RESULT "):])
        run["seconds"] = time.perf_counter() - started
        if options.out:  # written after every run, so an interrupted sweep keeps what finished
            with lock:
                finished.append({"spec": spec, **run})
                Path(options.out).write_text(json.dumps(finished))
        print(f"  {spec['loss']:<10} k={spec['staleness']} {spec['dtype']:<8} seed {spec['seed']}: "
              f"{ {k: round(v, 4) for k, v in summarize(run).items()} } ({run['seconds']:.0f} s)", flush=True)
        return spec, run

    with ThreadPoolExecutor(options.jobs) as pool:
        runs = list(pool.map(launch, specs))
    print_table(runs, f"{steps} steps")


def print_table(runs, what, versus="grpo"):
    """The table over every run given (its seeds), one row per loss x sampler dtype x staleness; `vs grpo`: the
    difference of the last-window reward from TRL's token loss (`versus`) at the same sampler and staleness, in
    standard errors of the difference (sqrt(sd_a^2 / n_a + sd_b^2 / n_b)); `*` where it exceeds 2."""
    arms = {}
    for spec, run in sorted(runs, key=lambda r: (list(LOSSES).index(r[0]["loss"]), r[0]["dtype"] != "float32",
                                                 r[0]["staleness"])):
        arms.setdefault((spec["loss"], spec["dtype"], spec["staleness"]), []).append(summarize(run))

    def spread(summaries):
        last = [s["reward_last"] for s in summaries]
        return statistics.fmean(last), (statistics.stdev(last) if len(last) > 1 else float("nan")), len(last)

    print(f"\n{'loss':<13} {'sampler':<8} {'k':>2} {'clipped seq':>11} {'clipped tok':>11} {'max|log s|':>10} "
          f"{'capped':>6} {'R3 drift':>8} {'len first':>9} {'len last':>8} {'reward first':>12} {'reward last':>16} "
          f"seeds {'vs ' + versus:>16}   (means, +- standard deviation over seeds; {what}; len: completion tokens)")
    for (loss, dtype, k), summaries in arms.items():
        def mean(key):
            return statistics.fmean(s[key] for s in summaries)
        last, sd, n = spread(summaries)
        compare = ""
        if loss != versus and (versus, dtype, k) in arms:
            other = [s["reward_last"] for s in arms[versus, dtype, k]]
            z = difference_in_se([s["reward_last"] for s in summaries], other)
            if z == z:  # not NaN: two or more seeds on each side, and some spread
                compare = f"{last - statistics.fmean(other):+.3f} ({z:+.1f} SE){'*' if abs(z) > 2 else ' '}"
        spread_text = f" +-{sd:.3f}" if n > 1 else ""
        print(f"{loss:<13} {dtype:<8} {k:>2} {mean('clipped_seq'):>11.3f} {mean('clipped_tok'):>11.3f} "
              f"{mean('log_ratio_abs_max'):>10.2e} {mean('capped'):>6.3f} {mean('replay_drift'):>8.3f} "
              f"{mean('length_first'):>9.3f} {mean('length_last'):>8.3f} "
              f"{mean('reward_first'):>12.3f} {last:>10.3f}{spread_text:<7} {n:>4} {compare:>17}")
    print("async_staleness: " + " ".join(
        f"{loss}:{dtype}:k{k} {statistics.fmean(s['reward_last'] for s in summaries):.3f}"
        for (loss, dtype, k), summaries in arms.items()))


def print_markdown(runs, versus="grpo"):
    """Two markdown tables over the runs: last-window reward per arm x sampler (mean +- sd, seeds, and against
    `versus` in standard errors of the difference, bold past 2) by staleness; the share of completions clipped (for
    `versus`: of tokens) and, for the decoupled arms, capped."""
    cells = {}
    for spec, run in runs:
        cells.setdefault((spec["loss"], spec["dtype"], spec["staleness"]), []).append(summarize(run))
    stalenesses = sorted({k for _, _, k in cells})
    arms = sorted({(loss, dtype) for loss, dtype, _ in cells},
                  key=lambda a: (list(LOSSES).index(a[0]), a[1] != "float32"))

    def reward(loss, dtype, k):
        summaries = cells.get((loss, dtype, k))
        if not summaries:
            return "-"
        last = [s["reward_last"] for s in summaries]
        mean, sd = statistics.fmean(last), statistics.stdev(last) if len(last) > 1 else float("nan")
        text = f"{mean:.3f} ± {sd:.3f} ({len(last)})"
        other = cells.get((versus, dtype, k))
        if loss != versus and other and len(other) > 1 and len(last) > 1:
            z = difference_in_se(last, [s["reward_last"] for s in other])
            text += f" **{z:+.1f}**" if abs(z) > 2 else f" {z:+.1f}"
        return text

    def share(loss, dtype, k, key):
        summaries = cells.get((loss, dtype, k))
        return "-" if not summaries else f"{statistics.fmean(s[key] for s in summaries):.3f}"

    header = " | ".join(f"k = {k}" for k in stalenesses)
    print(f"| arm | sampler | {header} |\n|---|---|" + "---|" * len(stalenesses))
    for loss, dtype in arms:
        print(f"| {loss} | {dtype} | " + " | ".join(reward(loss, dtype, k) for k in stalenesses) + " |")
    print(f"\n| arm | sampler | " + " | ".join(f"clipped k = {k}" for k in stalenesses) + " | "
          + " | ".join(f"capped k = {k}" for k in stalenesses) + f" |\n|---|---|" + "---|" * 2 * len(stalenesses))
    for loss, dtype in arms:
        key = "clipped_tok" if loss == versus else "clipped_seq"
        print(f"| {loss} | {dtype} | " + " | ".join(share(loss, dtype, k, key) for k in stalenesses) + " | "
              + " | ".join(share(loss, dtype, k, "capped").replace("nan", "-") for k in stalenesses) + " |")


def full_table() -> tuple[list[str], int]:
    """The commands that run the full loss table (`FULL_TABLE`) and print it, and its number of runs."""
    staleness, seeds = ",".join(map(str, FULL_TABLE["staleness"])), FULL_TABLE["seeds"]
    commands, runs = [], 0
    for fraction, dtypes, out in FULL_TABLE["settings"]:
        task = "" if fraction == 0.5 else f" --sft-correct-fraction {fraction:g}"
        commands.append(f"python benchmarks/async_staleness.py --losses {','.join(LOSS_TABLE)} --staleness {staleness} "
                        f"--seeds {seeds} --lr {FULL_TABLE['lr']:g} --steps {FULL_TABLE['steps']} --dtypes {dtypes}"
                        f"{task} --out {out}")
        runs += len(LOSS_TABLE) * len(FULL_TABLE["staleness"]) * seeds * len(dtypes.split(","))
    outs = " ".join(out for *_, out in FULL_TABLE["settings"])
    commands.append(f"python benchmarks/async_staleness.py --summarize {outs} --loss-table")
    return commands, runs


def full_table_text() -> str:
    """The full loss table's command (one shell command over several lines) and its run count and time."""
    commands, runs = full_table()
    settings = sum(len(dtypes.split(",")) for _, dtypes, _ in FULL_TABLE["settings"])
    hours = runs * SECONDS_PER_RUN / 2 / 3600
    return (f"the full loss table: {len(LOSS_TABLE)} losses x k = {','.join(map(str, FULL_TABLE['staleness']))} x "
            f"{FULL_TABLE['seeds']} seeds x {settings} settings (float32 and bfloat16 samplers on the quickstart's "
            f"task, float32 on the harder task) = {runs} runs, about {hours:.1f} h with --jobs 2 on 2 cores "
            f"({SECONDS_PER_RUN} s a run) plus the cold starts (built once, cached):\n" + " && \\\n".join(commands))


def print_loss_table(runs):
    """One markdown table per task, learning rate, sampler and step count over the runs given (their seeds
    together): one row per loss (`LOSS_TABLE`'s first, in its order, then the others run), per staleness k the
    last-window reward (mean±standard error over seeds), then the mean completion length in the first and the last
    20% of steps over the row's runs (every k) and the last window's length over the correct answer's (mean±standard
    error over those runs); then the same lengths per staleness. The seeds a cell (the runs a row) are named once above
    a table where every cell has as many, in brackets in each cell otherwise. Printed first: the full table's command
    (`full_table_text`) and what the columns hold."""
    import _band_table

    print(full_table_text())
    print("\nreward: last 20% of steps, mean±standard error over seeds; length: completion tokens with <eos>, first → "
          "last 20% of steps over a row's runs; over answer: the last 20%'s length minus the correct answer's")
    cells = {}
    for spec, run in runs:
        key = (spec.get("sft_correct_fraction", 0.5), spec.get("lr", 5e-4), spec["dtype"], spec["steps"])
        cells.setdefault(key, {}).setdefault(spec["loss"], {}).setdefault(spec["staleness"], []).append(summarize(run))

    def order(loss):
        return (LOSS_TABLE.index(loss) if loss in LOSS_TABLE else len(LOSS_TABLE),
                list(LOSSES).index(loss) if loss in LOSSES else len(LOSSES), loss)

    def known(summaries, key):
        return [s[key] for s in summaries if s[key] == s[key]]  # NaN: a runs file from before lengths were logged

    def mean_se(values, fmt, uniform):  # compact: the seeds named above the table when every cell has as many
        return _band_table.mean_se(values, fmt, sep="±", count=not uniform)

    def lengths(summaries, uniform):
        first, last = known(summaries, "length_first"), known(summaries, "length_last")
        return "-" if not last else (f"{statistics.fmean(first):.2f} → {statistics.fmean(last):.2f}"
                                     + ("" if uniform else f" ({len(last)})"))

    def excess(summaries, uniform):
        values = known(summaries, "length_excess_last")
        return mean_se(values, "+.3f", uniform) if values else "-"

    for key in sorted(cells, key=lambda c: (-c[0], -c[1], c[2] != "float32", c[3])):
        task, lr, dtype, steps = key
        losses = cells[key]
        ks = sorted({k for by_k in losses.values() for k in by_k})
        seeds = {len(by_k.get(k, [])) for by_k in losses.values() for k in ks}
        uniform = len(seeds) == 1
        name = "the quickstart's task" if task == 0.5 else f"the harder task (cold start {task:g} correct)"
        count = f", {min(seeds)} seeds a cell ({len(ks) * min(seeds)} runs a row)" if uniform \
            else ", seeds (runs) in brackets"
        print(f"\n{name}, learning rate {lr:g}, {dtype} sampler, {steps} steps{count}\n")
        print("| loss | " + " | ".join(f"k = {k}" for k in ks) + " | length | over answer |")
        print("|---" * (len(ks) + 3) + "|")
        for loss in sorted(losses, key=order):
            by_k = losses[loss]
            rewards = [mean_se([s["reward_last"] for s in by_k[k]], ".3f", uniform) if k in by_k else "-" for k in ks]
            every = [s for k in ks for s in by_k.get(k, [])]
            print(f"| {loss} | " + " | ".join([*rewards, lengths(every, uniform), excess(every, uniform)]) + " |")
        print("\n| loss | " + " | ".join(f"length k = {k}" for k in ks) + " |")
        print("|---" * (len(ks) + 1) + "|")
        for loss in sorted(losses, key=order):
            print(f"| {loss} | " + " | ".join(lengths(losses[loss][k], uniform) if k in losses[loss] else "-"
                                              for k in ks) + " |")


# The band table's arms (benchmarks/_band_table.py) by this benchmark's loss names.
BAND_ARMS = {"gspo": "paper", "gspo_wide": "10x", "gspo_wide100": "100x", "gspo_adaptive": "adaptive", "grpo": "trl"}


def print_band_table(runs):
    """One markdown table per task, learning rate and sampler (benchmarks/_band_table.py): per staleness k, the
    last-window reward of each fixed band, the band set by the run and TRL's token loss (mean ± standard error over
    seeds, seeds in brackets), the band set by the run against the best fixed band, the paper's band and TRL's token
    loss in standard errors of the difference, its clipped share of learnable tokens after each run's first 20% of
    steps (against its 0.15 target), and the share of groups whose completions all got the same reward; then the
    goals, counted over the cells.

    A fixed band with no runs in a cell where the paper's band never met a sequence ratio further than 1e-5 from 1
    (`max|log s|` < 1e-5 at every step of every seed: a float32 sampler at k = 0, where the sampler's and the
    trainer's log-probs differ by rounding only) clips nothing, since every fixed band here is at least the paper's
    3e-4 wide, so it trains the paper's band's runs bit for bit; the cell shows those runs, marked `=`."""
    import _band_table

    moved_by = 1e-5
    cells = {}
    for spec, run in runs:
        if spec["loss"] in BAND_ARMS:
            key = (spec.get("sft_correct_fraction", 0.5), spec.get("lr", 5e-4), spec["dtype"], spec["staleness"])
            cells.setdefault(key, {}).setdefault(BAND_ARMS[spec["loss"]], []).append(run)
    goals = _band_table.Goals()
    for task, lr, dtype in sorted({key[:3] for key in cells}, key=lambda c: (-c[0], -c[1], c[2] != "float32")):
        name = "the quickstart's task" if task == 0.5 else f"the harder task (cold start {task:g} correct)"
        print(f"\n{name}, learning rate {lr:g}, {dtype} sampler\n")
        print(_band_table.header("k"))
        for k in sorted(key[3] for key in cells if key[:3] == (task, lr, dtype)):
            arms = dict(cells[task, lr, dtype, k])
            marks = {}
            paper = arms.get("paper", [])
            if paper and all(step["log_ratio_abs_max"] < moved_by for run in paper for step in run["steps"]):
                for arm in ("10x", "100x"):
                    if arm not in arms:
                        arms[arm], marks[arm] = paper, "= "
            rewards = {arm: [summarize(run)["reward_last"] for run in group] for arm, group in arms.items()}
            shares = [share for run in arms.get("adaptive", [])
                      for share in _band_table.settled([step.get("band_share", float("nan")) for step in run["steps"]])]
            equal = [step["equal_groups"] for group in arms.values() for run in group for step in run["steps"]
                     if "equal_groups" in step]
            print(_band_table.row(str(k), rewards, shares, equal, goals, marks))
    print("\n" + goals.report())


if __name__ == "__main__":
    main()
