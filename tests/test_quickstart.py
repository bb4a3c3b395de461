"""The offline quickstart: its task and rewards, and the real `trl-gspo --config recipes/quickstart.yaml` run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import assert_no_line_per_step, check_run_output, cpu_env, free_port

from trl_gspo.quickstart.addition import digit_match_reward, exact_match_reward, make_rl_dataset, make_sft_dataset

ROOT = Path(__file__).resolve().parents[1]


def test_tokenizer_round_trip_and_left_padding(tokenizer):
    ids = tokenizer(["3+5=", "12+7="], padding=True)["input_ids"]
    assert tokenizer.padding_side == "left" and ids[0][0] == tokenizer.pad_token_id
    assert tokenizer.decode(tokenizer("3+5=8")["input_ids"], skip_special_tokens=True) == "3+5=8"
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_rewards_on_hand_written_completions():
    answers = ["12", "12", "12", "12", "7"]
    completions = ["12<eos>", " 12 ", "13", "", "7"]
    assert exact_match_reward(completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert digit_match_reward(completions, answers) == [1.0, 1.0, 0.5, 0.0, 1.0]


def test_datasets():
    rl = make_rl_dataset(64, seed=0)
    assert rl.column_names == ["prompt", "answer"]
    a, b = rl[0]["prompt"].rstrip("=").split("+")
    assert int(rl[0]["answer"]) == int(a) + int(b)
    sft = make_sft_dataset(2000, seed=0, correct_fraction=0.5)
    correct = [int(r["completion"].replace("<eos>", "")) == sum(map(int, r["prompt"].rstrip("=").split("+")))
               for r in sft]
    assert 0.45 < sum(correct) / len(correct) < 0.62  # half by construction, plus random hits
    assert all(r["completion"].endswith("<eos>") for r in sft)
    with pytest.raises(ValueError, match="correct_fraction"):
        make_sft_dataset(4, seed=0, correct_fraction=1.5)


SLEEP_BEFORE = 8  # seconds a shell spends before it hands its process to `trl-gspo` (over the 2 s margin below)


@pytest.mark.slow
@pytest.mark.one_process
def test_quickstart_recipe_learns(tmp_path):
    """The README's first command, end to end through `trl-gspo` and `accelerate launch`, as CI or a Dockerfile runs
    it: `bash -c "<something slow> && trl-gspo ..."`, where bash hands its own process (started before the sleep) to
    the last command. The run's reported wall time counts from the run's own start, leaving the sleep out."""
    import re
    import shlex
    import time

    out = tmp_path / "quickstart"
    env = cpu_env(PYTHONUNBUFFERED="1")
    del env["DS_ACCELERATOR"]  # as a user's shell has it: the run itself keeps DeepSpeed's accelerator line away
    command = shlex.join([sys.executable, "-m", "trl_gspo.launch.cli", "--config",
                          str(ROOT / "recipes" / "quickstart.yaml"), "--output_dir", str(out)])
    started = time.monotonic()
    result = subprocess.run(["bash", "-c", f"sleep {SLEEP_BEFORE} && {command}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:]
    summary = check_run_output(result.stdout)  # no third-party noise; the summary last, with the phases' times
    reported = int(re.search(r"wall time: +(\d+)s for the whole command", summary).group(1))
    assert reported <= elapsed - SLEEP_BEFORE + 2, (reported, elapsed)  # 2 s: rounding, and the summary's print
    assert "reward first -> last" in result.stdout
    state = json.loads((out / "trainer_state.json").read_text())
    rewards = [h["reward"] for h in state["log_history"] if "reward" in h]
    assert len(rewards) >= 10
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.15, rewards  # the measured seeds: docs/results.md, the addition quickstart
    assert any(h.get("clip_ratio/region_mean", 0) > 0 for h in state["log_history"])  # really off-policy
    png = (out / "training_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quickstart_on_two_ddp_processes_prints_nothing_per_step_or_process(tmp_path):
    """The README's DDP command, shortened (20 cold-start steps, 8 RL steps): every rank takes part in the SFT cold
    start (a rank-0-only cold start released the other rank from its barrier before the model existed), one summary
    is printed, the final model is saved, and stderr holds neither a line per step nor DDP's
    "find_unused_parameters=True ... did not find any unused parameters" (the cold start and the recipe turn the
    search off: every weight of the tiny model is used in every forward)."""
    steps = 8
    result = subprocess.run(
        [sys.executable, "-m", "trl_gspo.launch.cli", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
         "--accelerate_config", str(ROOT / "recipes" / "accelerate" / "cpu_ddp.yaml"),
         "--output_dir", str(tmp_path / "ddp"), "--main_process_port", str(free_port()), "--sft_steps", "20",
         "--max_steps", str(steps), "--logging_steps", "4", "--plot", "false"],
        capture_output=True, text=True, env=cpu_env(OMP_NUM_THREADS="1"), timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "find_unused_parameters" not in result.stderr, result.stderr[-3000:]
    assert_no_line_per_step(result.stderr, steps)
    assert json.loads((tmp_path / "ddp" / "trainer_state.json").read_text())["global_step"] == steps
    assert result.stdout.count("trl-gspo run summary") == 1
    assert f"optimizer steps:       {steps}" in result.stdout
    assert (tmp_path / "ddp" / "model.safetensors").is_file()
