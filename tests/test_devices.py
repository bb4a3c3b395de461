"""Device decisions, tested on CPU: the cold start leaves the run's device alone (a GPU quickstart once stayed on
CPU), and both branches of every "is there an accelerator?" decision run here with the probe faked."""

import pytest
from accelerate.state import PartialState
from trl import ModelConfig

import trl_gspo.quickstart.cold_start as cold_start_module
from trl_gspo import GSPOConfig
from trl_gspo.launch.recipe import GSPOScriptArguments
from trl_gspo.launch.train import _prepare_builtin_model


def _accelerate_cpu_flag():
    return PartialState._shared_state.get("_cpu")


def test_cold_start_runs_where_the_run_runs_and_leaves_its_device(tmp_path, monkeypatch):
    """The H100 defect: the cold start's SFT arguments (use_cpu=True) rebuilt accelerate's process-wide state for
    CPU, and the GSPO trainer built next inherited it, so generation ran with the model on CPU and inputs on CUDA.
    Here the run asks for the accelerator (use_cpu=False; on this CPU machine accelerate then picks the CPU, but
    the flag it keeps is what a GPU machine would act on)."""
    seen = {}
    real = cold_start_module.sft_cold_start

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(cold_start_module, "sft_cold_start", spy)
    training_args = GSPOConfig(output_dir=str(tmp_path), use_cpu=False, bf16=False, report_to="none", seed=0)
    training_args.device  # builds accelerate's state for this run, as TRL's parser does
    assert _accelerate_cpu_flag() is False
    script_args = GSPOScriptArguments(dataset_name="builtin:addition", reward_funcs=["digit_match_reward"],
                                      sft_steps=1)
    _prepare_builtin_model(script_args, training_args, ModelConfig(model_name_or_path="builtin:tiny-qwen3"))
    assert seen["use_cpu"] is False  # the cold start trains where the run trains
    assert _accelerate_cpu_flag() is False  # and leaves the run's process state as it found it


def test_cold_start_restores_accelerate_state_it_found(tokenizer, tmp_path):
    """Called directly (its default is CPU), the cold start still leaves no device state behind."""
    from trl_gspo.quickstart.model import build_dense_model

    GSPOConfig(output_dir=str(tmp_path), use_cpu=False, bf16=False, report_to="none").device
    before = dict(PartialState._shared_state)
    cold_start_module.sft_cold_start(build_dense_model(tokenizer, seed=0), tokenizer, str(tmp_path / "sft"),
                                     max_steps=1, per_device_train_batch_size=4)
    assert dict(PartialState._shared_state) == before
    assert _accelerate_cpu_flag() is False


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test starts and ends without accelerate process state, so no other test inherits a device choice."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("cuda_visible", [False, True])
def test_offloaded_recording_of_a_cpu_run_is_not_copied_or_pinned(tokenizer, monkeypatch, cuda_visible):
    """`routing_replay_offload` moves recordings of accelerator tensors to pinned host memory; a CPU run's
    recordings are already there, whether or not the machine has a GPU (faked here: pinning needs CUDA)."""
    import torch

    from trl_gspo.quickstart.model import build_model
    from trl_gspo.routing import RoutingReplay

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_visible)

    def no_pinning(self, *args, **kwargs):
        raise AssertionError("a CPU tensor was pinned")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    model = build_model(tokenizer, seed=0)
    replay = RoutingReplay(model, offload_to_cpu=True)
    ids = torch.randint(3, 20, (2, 5))
    with replay.record() as recording:
        model(input_ids=ids)
    assert recording.indices.device.type == "cpu" and recording.indices.shape[:2] == (2, 5)


@pytest.mark.parametrize("available,kind,expected", [(False, None, False), (True, "cuda", True), (True, "xpu", True),
                                                     (True, "mps", False)])
def test_has_accelerator_answers_for_the_probed_device(monkeypatch, available, kind, expected):
    """Both branches of the FSDP decision's probe, whatever this machine has: torch's answer is faked."""
    import torch

    from trl_gspo.launch.checks import has_accelerator

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: available)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda: torch.device(kind) if kind else pytest.fail("asked for the device of none"))
    assert has_accelerator() is expected


def test_every_python_subprocess_of_the_suite_is_pinned_to_cpu():
    """A subprocess that inherits this environment sees the machine's GPU; on an H100 that moved the multi-process,
    kill and CLI tests onto CUDA. Every `subprocess.run` / `Popen` in the CPU tests passes
    `env=cpu_env(...)` (directly or through a variable assigned from it); the GPU suite (test_gpu.py) is exempt."""
    import ast
    from pathlib import Path

    def is_cpu_env(node):
        return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cpu_env"

    unpinned = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.name == "test_gpu.py":
            continue
        tree = ast.parse(path.read_text())
        pinned = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and is_cpu_env(node.value)
                  for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr in ("run", "Popen") \
                    and isinstance(func.value, ast.Name) and func.value.id == "subprocess":
                env = next((k.value for k in node.keywords if k.arg == "env"), None)
                if not (env is not None and (is_cpu_env(env) or isinstance(env, ast.Name) and env.id in pinned)):
                    unpinned.append(f"{path.name}:{node.lineno}")
    assert unpinned == [], f"pass env=cpu_env() (tests/support/helpers.py) at {unpinned}"
