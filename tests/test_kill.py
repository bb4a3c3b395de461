"""Stopping `trl-gspo` (SIGINT / SIGTERM) stops every process it launched, and nothing writes `output_dir` after."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from support.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]

# A process that ignores SIGTERM (only SIGKILL stops it) and one that leaves the process group (setsid).
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
ESCAPER = "import os, time; os.setsid(); time.sleep(300)"


def _tree(pid, expected, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(pid).children(recursive=True)
        if len(children) >= expected:
            return children
        time.sleep(0.1)
    raise AssertionError(f"expected {expected} descendants of {pid}, got {children}")


def _alive(processes):
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_forwarded_signal_ends_the_whole_tree(signum):
    """A launcher with a grandchild, one child that ignores SIGTERM and one that left the group: all end."""
    launched = textwrap.dedent(f"""
        import subprocess, sys, time
        procs = [subprocess.Popen([sys.executable, "-c", code]) for code in
                 ["import time; time.sleep(300)", {STUBBORN!r}, {ESCAPER!r}]]
        for p in procs: p.wait()
    """)
    wrapper = subprocess.Popen([sys.executable, "-c",
                                "import sys; from trl_gspo.launch.launching import run_forwarding_signals; "
                                f"sys.exit(run_forwarding_signals([sys.executable, '-c', {launched!r}], "
                                "grace_seconds=2.0))"], cwd=ROOT, env=cpu_env())
    tree = _tree(wrapper.pid, expected=4)  # the launched command and its three children
    time.sleep(1.0)  # let the escaper's setsid() happen and the wrapper see the whole tree
    wrapper.send_signal(signum)
    assert wrapper.wait(timeout=30) == 128 + signum
    assert _alive(tree) == []


def test_exit_code_of_the_command_is_returned():
    from trl_gspo.launch.launching import run_forwarding_signals

    assert run_forwarding_signals([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert run_forwarding_signals([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]) \
        == 128 + signal.SIGTERM


def _snapshot(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.slow
@pytest.mark.one_process
def test_sigterm_during_training_leaves_no_process_and_no_writes(tmp_path):
    """A real `trl-gspo` run (tiny MoE, a checkpoint every step) gets SIGTERM after its first checkpoint."""
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""
        model_name_or_path: builtin:tiny-qwen3-moe
        dataset_name: builtin:addition
        reward_funcs: [digit_match_reward]
        builtin_num_examples: 4096
        per_device_train_batch_size: 8
        num_generations: 4
        max_completion_length: 4
        max_steps: 10000
        save_strategy: steps
        save_steps: 1
        logging_steps: 1
        output_dir: {out}
        report_to: none
        use_cpu: true
        bf16: false
        gradient_checkpointing: false
        plot: false
    """))
    # ROOT first, then whatever PYTHONPATH the run has (a GPU image with the dependencies on a --target path)
    env = cpu_env(TOKENIZERS_PARALLELISM="false",
                  PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = subprocess.Popen([sys.executable, "-m", "trl_gspo.launch.cli", "--config", str(recipe)], cwd=ROOT,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(out.glob("checkpoint-2/trainer_state.json")):
        assert command.poll() is None, command.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.2)
    tree = psutil.Process(command.pid).children(recursive=True)
    assert any("trl_gspo.launch.train" in " ".join(p.cmdline()) for p in tree)  # the training process is a descendant
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=60) == 128 + signal.SIGTERM
    assert _alive(tree) == []
    before = _snapshot(out)
    time.sleep(3.0)
    assert _snapshot(out) == before  # nothing is still writing checkpoints
