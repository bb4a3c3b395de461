"""Peak memory of one training step (loss forward + backward on one micro-batch) with gspo vs TRL's sequence-level
and token-level GRPO: same model and rollout batch; with `--replay`, also GSPOTrainer's token-level GRPO with plain
routing, R2 (replaying the old-policy pass's routes) and R3 (replaying the sampler's routes), each on the rollout
batch of its own generation round (same seed, same shapes; the replay arms' batch holds the routes).

On CUDA: `max_memory_allocated` above the memory held before the step, every arm in one process (the peak counter
is reset before each step and the allocator's cache does not count; an unmeasured warm-up step first, so lazily
allocated workspaces count in no arm), arms interleaved. On CPU: the resident-set peak above the resident set
before the step, sampled every millisecond, each arm in fresh processes (the allocator's cache would hide a second
step), median of repeats, arms interleaved. `--processes fresh|shared` overrides that choice.

The model is built on the target device in the target dtype (its random initialisation runs there, fast on a GPU);
the figure does not depend on the weights' values. Seconds per phase are printed (`# time ...`); `--budget S` stops
adding repeats once the next would end past S seconds (every arm is measured at least once).

    python benchmarks/memory.py
    python benchmarks/memory.py --size gpu --device cuda --dtype bfloat16 --replay

Last line: `memory: <gspo / trl_sequence_grpo peak> (target <= 1.0)`.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STARTED = time.perf_counter()
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _setup  # noqa: E402

ARMS = ["gspo", "trl_sequence_grpo", "trl_token_grpo"]
# --replay: GSPOTrainer, token-level GRPO, natural routing / R2 / R3 -> (arm of _setup.ARMS, config overrides)
REPLAY_ARMS = {"plain": ("grpo", {}), "R2": ("grpo_routing_replay", {}),
               "R3": ("grpo", dict(routing_replay="sampler", routing_replay_min_agreement=0.0))}
TIMES = {}  # phase -> seconds, in order


@contextlib.contextmanager
def _phase(name):
    started = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        TIMES[name] = TIMES.get(name, 0.0) + seconds
        print(f"# time {name}: {seconds:.1f}s (total {time.perf_counter() - STARTED:.1f}s)", flush=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build(cli):
    """`_setup.build`, but the parameters are created (and randomly initialised) on the target device in the target
    dtype: no float32 initialisation of billions of expert weights on the host, no host-to-device copy."""
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    dtype = getattr(torch, cli.dtype)
    tokenizer = build_tokenizer()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(cli.device):
            model = build_model(tokenizer, config_overrides=_setup.SIZES[cli.size], seed=0)
    finally:
        torch.set_default_dtype(default)
    return model.to(cli.device, dtype), tokenizer  # buffers too, as `_setup.build` does


def _trainer(cli, arm, model, tokenizer, tmp):
    name, overrides = REPLAY_ARMS.get(arm, (arm, {}))
    return _setup.trainer(name, model, tokenizer, tmp, cli.device, getattr(torch, cli.dtype), cli.completion_length,
                          cli.batch, **overrides)


def _make_inputs(cli, model, tokenizer, arm):
    """One training micro-batch of a generation round of `arm`'s trainer (the loss arms share the one of TRL's
    sequence-level GRPO; each replay arm uses its own, which holds the routes it replays)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(cli, arm, model, tokenizer, tmp)
        data = _setup.dataset()
        raw = [data[i // trainer.num_generations] for i in range(cli.batch * trainer.args.steps_per_generation)]
        trainer.model.train()
        inputs = trainer._prepare_inputs(raw)
    del trainer
    gc.collect()
    return inputs


def _step_peak(cli, arm, model, tokenizer, inputs) -> float:
    """Peak memory of one loss forward + backward of `arm` above the level before it (bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(cli, arm, model, tokenizer, tmp)
        trainer.model.train()
        if cli.device == "cuda":
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, inputs))
            torch.cuda.synchronize()
            peak = float(torch.cuda.max_memory_allocated() - before)
        else:
            before, high, done = _rss_bytes(), [0], threading.Event()

            def sample():
                while not done.is_set():
                    high[0] = max(high[0], _rss_bytes())
                    time.sleep(0.001)

            sampler = threading.Thread(target=sample)
            sampler.start()
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, inputs))
            done.set()
            sampler.join()
            peak = float(max(high[0], _rss_bytes()) - before)
    del trainer  # its model copy and gradients
    gc.collect()
    return peak


def _worker(cli, arm, inputs_path):
    model, tokenizer = _build(cli)
    inputs = {k: v.to(cli.device) if torch.is_tensor(v) else v
              for k, v in torch.load(inputs_path, weights_only=False).items()}
    return _step_peak(cli, arm, model, tokenizer, inputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=_setup.SIZES, default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replay", action="store_true",
                        help="also measure GSPOTrainer's grpo with plain routing, R2 and R3 (three more arms)")
    parser.add_argument("--processes", choices=["auto", "fresh", "shared"], default="auto",
                        help="fresh: each arm's step in a new process; shared: all in this one (CUDA only); "
                             "auto: shared on CUDA, fresh on CPU")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds: start no further repeat that would end past this (0: no limit)")
    parser.add_argument("--worker", nargs=2, metavar=("ARM", "INPUTS"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        print("PEAK " + json.dumps(_worker(cli, *cli.worker)))
        return
    shared = cli.processes == "shared" or (cli.processes == "auto" and cli.device == "cuda")
    if shared and cli.device != "cuda":
        parser.error("--processes shared needs --device cuda (the CPU resident set keeps the allocator's cache)")

    _setup.header("memory", cli.device, cli.dtype, _setup.size_kernel(cli.size))
    TIMES["imports"] = time.perf_counter() - STARTED
    print(f"# time imports: {TIMES['imports']:.1f}s", flush=True)
    arms = ARMS + (list(REPLAY_ARMS) if cli.replay else [])
    peaks = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        with _phase("build model"):
            model, tokenizer = _build(cli)
        inputs = {}
        for arm in ["trl_sequence_grpo"] + (list(REPLAY_ARMS) if cli.replay else []):
            with _phase(f"rollout batch ({arm})"):
                inputs[arm] = _make_inputs(cli, model, tokenizer, arm)
        if shared:
            with _phase("warm-up step (unmeasured)"):
                _step_peak(cli, "gspo", model, tokenizer, inputs["trl_sequence_grpo"])
        else:
            paths = {}
            for key, batch in inputs.items():
                paths[key] = f"{tmp}/inputs_{key}.pt"
                torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}, paths[key])
            del model, inputs
            gc.collect()
            base = [sys.executable, __file__, "--size", cli.size, "--device", cli.device, "--dtype", cli.dtype,
                    "--batch", str(cli.batch), "--completion-length", str(cli.completion_length)]
        for repeat in range(cli.repeats):
            started = time.perf_counter()
            order = arms[repeat % len(arms):] + arms[:repeat % len(arms)]
            with _phase(f"repeat {repeat + 1} ({len(arms)} steps{'' if shared else ', fresh processes'})"):
                for arm in order:
                    key = arm if arm in REPLAY_ARMS else "trl_sequence_grpo"
                    if shared:
                        peaks[arm].append(_step_peak(cli, arm, model, tokenizer, inputs[key]))
                        continue
                    out = subprocess.run(base + ["--worker", arm, paths[key]], capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"memory: worker {arm} failed:\n{out.stderr[-3000:]}")
                    peaks[arm].append(json.loads(next(l for l in out.stdout.splitlines() if l.startswith("PEAK "))[5:]))
            took = time.perf_counter() - started
            if cli.budget and repeat + 1 < cli.repeats and time.perf_counter() - STARTED + took > cli.budget:
                print(f"# budget {cli.budget:.0f}s: stopping after {repeat + 1} of {cli.repeats} repeats", flush=True)
                break
    done = len(peaks[arms[0]])
    print("# time report: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMES.items())
          + f"; total {time.perf_counter() - STARTED:.1f}s", flush=True)
    median = {arm: statistics.median(v) for arm, v in peaks.items()}
    kind = "CUDA max_memory_allocated" if cli.device == "cuda" else "CPU resident-set"
    where = "in one process after a warm-up step" if shared else "fresh processes"
    print(f"{kind} peak above the pre-step level, one micro-batch of {cli.batch} completions x "
          f"{cli.completion_length} tokens, size {cli.size}, {cli.dtype}, median of {done} ({where})")
    for arm in arms:
        print(f"  {arm:20s} {median[arm] / 2**20:8.1f} MiB   (runs: "
              + ", ".join(f"{p / 2**20:.1f}" for p in peaks[arm]) + ")")
    if cli.replay:
        print(f"  R2 / plain: {median['R2'] / median['plain']:.3f}   R3 / plain: {median['R3'] / median['plain']:.3f}")
    print(f"  gspo / trl_token_grpo: {median['gspo'] / median['trl_token_grpo']:.3f}")
    print(f"memory: {median['gspo'] / median['trl_sequence_grpo']:.3f} (target <= 1.0)")


if __name__ == "__main__":
    main()
