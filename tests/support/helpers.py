"""Helpers shared by the tests and their subprocess scripts (tests/scripts/): a tiny config, a toy dataset and reward,
the smallest offline recipe, a subprocess environment without accelerators, a free loopback port.

Importing this module sets the test environment first (hub, transformers and datasets offline, wandb off, at most two
torch threads): tests/conftest.py imports it, and so does each script that imports a helper.
"""

import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

# At most two torch threads, and under pytest-xdist the cores shared among its workers (one thread each on 2 cores:
# two workers of two threads each on 2 cores spin against each other)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


# The smallest recipe that runs offline: CLI tests format it with `out=` and append or replace keys.
BASE_RECIPE = """
model_name_or_path: builtin:tiny-qwen3-moe
dataset_name: builtin:addition
reward_funcs: [digit_match_reward]
output_dir: {out}
use_cpu: true
bf16: false
report_to: none
"""


def cpu_env(**extra) -> dict:
    """The environment for a subprocess of a CPU test: the parent's, with every accelerator hidden (CUDA devices,
    DeepSpeed's accelerator choice) and the hub offline, so the child runs as on a machine without a GPU, whatever
    this machine has. Extra variables (OMP_NUM_THREADS, PYTHONPATH, ...) are added last."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", **extra)


def free_port() -> int:
    with socket.socket() as sock:  # a fixed default port can still be held by an earlier run's processes
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Third-party warnings a `trl-gspo` run filters (trl_gspo/launch/quiet.py), and DeepSpeed's accelerator line, which
# a CPU run (`use_cpu: true`) prevents by naming the CPU to DeepSpeed (trl_gspo/launch/cli.py).
RUN_NOISE = ("`gradient_checkpointing` is deprecated", "`is_gradient_checkpointing` is deprecated",
             "were not passed to `accelerate launch`", "`--num_processes` was set to a value of",
             "Setting accelerator to CPU. If you have GPU or other accelerator")


def check_run_output(output: str, cold_start: bool = True) -> str:
    """Check the whole output of a `trl-gspo` run (stdout and stderr in one stream, the child unbuffered:
    `cpu_env(PYTHONUNBUFFERED="1")` with `stderr=subprocess.STDOUT`): none of `RUN_NOISE`; the run summary is the last
    thing printed (no progress bar after it); its wall time is the whole command's, with the cold start's (when
    `cold_start`) and training's beside it. Returns the summary."""
    import re

    for noise in RUN_NOISE:
        assert noise not in output, f"{noise!r} in the run's output:\n{output[-3000:]}"
    assert output.count("trl-gspo run summary") == 1, output[-3000:]
    summary = "trl-gspo run summary" + output.split("trl-gspo run summary")[1]
    assert summary.rstrip().endswith("\n" + "=" * 60), f"printed after the summary:\n{summary}"
    phases = r"cold start (\d+s|reused), training \d+s" if cold_start else r"training \d+s"
    assert re.search(rf"\n  wall time: +\d+s for the whole command \({phases}\)\n", summary), summary
    return summary


def assert_no_line_per_step(stderr: str, steps: int) -> None:
    """No line of a run's `stderr` (progress-bar redraws aside) is printed once per optimizer step: each appears
    fewer than `steps` times, where a line printed once per process (2 processes) appears twice."""
    import collections
    import re

    # a progress bar's redraw ("Loading weights:  50%|#####     | 1/2 [00:01<00:01, ...]"); a warning may follow it
    bars = re.compile(r"(?:[\w ./-]+:)?\s*\d+%\|[^|]*\|[^\]]*\]")
    lines = (bars.sub("", line).strip() for line in re.split(r"[\r\n]", stderr))
    counts = collections.Counter(line for line in lines if line)
    repeated = {line: n for line, n in counts.items() if n >= steps}
    assert not repeated, f"printed at least once per step ({steps} steps):\n" + "\n".join(
        f"{n} x {line[:200]}" for line, n in repeated.items())


def skip_without_math_verify(reward_funcs) -> None:
    """TRL's `accuracy_reward` needs math-verify (the `math` extra, in the `test` extra too); a hand-made
    environment without it skips the tests that resolve it, saying so."""
    import importlib.util

    if "accuracy_reward" in reward_funcs and importlib.util.find_spec("math_verify") is None:
        pytest.skip('accuracy_reward needs math-verify: pip install -e ".[math]"')


def digit_reward(completions, **kwargs):
    """Toy reward: fraction of completion characters that are the digit 7 (learnable, varies within a group)."""
    return [sum(ch == "7" for ch in c) / max(len(c), 1) for c in completions]


def toy_dataset(n=16):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{i % 10}+{(3 * i) % 10}=" for i in range(n)]})


def tiny_config(output_dir, config_cls=None, **overrides):
    """A fast CPU GRPO/GSPO config: 4 prompts x 4 generations per step, short completions."""
    from trl_gspo import GSPOConfig

    config_cls = config_cls or GSPOConfig
    kwargs = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        max_steps=3,
        gradient_checkpointing=False,
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def hub_out_of_reach(monkeypatch, cache_dir) -> str:
    """The Hub as on a machine without it: online mode, its endpoint a closed local port, an empty cache; the checks'
    one probe asked afresh. Returns the endpoint."""
    import functools

    from huggingface_hub import constants

    from trl_gspo.trainer import model_checks

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    # a probe cache of the test's own, so that an answer about this endpoint outlives neither the test nor its setting
    monkeypatch.setattr(model_checks, "hub_unreachable_once",
                        functools.lru_cache(maxsize=None)(lambda endpoint: model_checks.hub_unreachable()))
    return endpoint


def save_tiny_moe(path):
    """The tiny Qwen3-MoE (`trl_gspo.quickstart.model.build_model`, seed 0) and its tokenizer saved in `path`, for
    trainers that load a model by path (TRL's asynchronous trainer); returns `path`."""
    from trl_gspo.quickstart.model import build_model
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
