"""The built-in model preparation (tiny model + SFT cold start) is reused when its inputs match, and redone after a
run that was interrupted before it finished."""

import json

import pytest
from trl import ModelConfig

import trl_gspo.quickstart.cold_start as cold_start_module
from trl_gspo import GSPOConfig
from trl_gspo.launch.recipe import GSPOScriptArguments
from trl_gspo.quickstart import reuse
from trl_gspo.launch.train import _prepare_builtin_model


@pytest.fixture
def sft_calls(monkeypatch):
    calls = []
    real = cold_start_module.sft_cold_start

    def counting(*args, **kwargs):
        calls.append(kwargs["learning_rate"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cold_start_module, "sft_cold_start", counting)
    return calls


def _prepare(out, **script):
    script_args = GSPOScriptArguments(dataset_name="builtin:addition", reward_funcs=["digit_match_reward"],
                                      **{"sft_steps": 2, **script})
    training_args = GSPOConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", seed=0)
    return _prepare_builtin_model(script_args, training_args, ModelConfig(model_name_or_path="builtin:tiny-qwen3"))


def _files(path):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()}


def test_cold_start_is_reused_when_inputs_match(tmp_path, sft_calls, capsys):
    path = tmp_path / "initial_model"
    assert _prepare(tmp_path) == str(path)
    assert sft_calls == [3e-3]
    mark = json.loads((path / reuse.MARK).read_text())
    assert mark["inputs"]["sft_steps"] == 2 and mark["files"]["model.safetensors"] > 0
    before = _files(path)

    assert _prepare(tmp_path) == str(path)
    assert sft_calls == [3e-3]  # not run again
    assert _files(path) == before  # nothing rewritten
    assert "reusing the prepared model" in capsys.readouterr().out

    _prepare(tmp_path, sft_learning_rate=1e-3)  # different inputs: prepared again
    assert sft_calls == [3e-3, 1e-3]
    assert json.loads((path / reuse.MARK).read_text())["inputs"]["sft_learning_rate"] == 1e-3


def test_interrupted_preparation_is_redone(tmp_path, sft_calls, monkeypatch):
    path = tmp_path / "initial_model"
    _prepare(tmp_path)

    # A run with other inputs is killed after rewriting the model files, before its mark: no mark is left, so
    # neither its inputs nor the previous ones count as prepared.
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(reuse, "write_mark", killed)
        _prepare(tmp_path, sft_steps=3)
    assert not (path / reuse.MARK).exists()
    _prepare(tmp_path)
    assert len(sft_calls) == 3  # first run, the killed run, and this one

    # A run killed during the cold start itself never reaches the files: the previous preparation stays usable.
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(cold_start_module, "sft_cold_start", killed)
        _prepare(tmp_path, sft_steps=3)
    assert reuse.reusable(str(path), json.loads((path / reuse.MARK).read_text())["inputs"])


def test_a_changed_or_truncated_file_is_not_reused(tmp_path, sft_calls):
    path = tmp_path / "initial_model"
    _prepare(tmp_path)
    inputs = json.loads((path / reuse.MARK).read_text())["inputs"]
    assert reuse.reusable(str(path), inputs)
    assert not reuse.reusable(str(path), {**inputs, "seed": 1})
    (path / "model.safetensors").write_bytes(b"")
    assert not reuse.reusable(str(path), inputs)
    _prepare(tmp_path)
    assert len(sft_calls) == 2
