"""The one-GPU MoE preset (recipes/granite_3b_a800m): the gspo / grpo / grpo_replay trio resolves, differs only in
the loss, its clip range and routing replay, and its model settings train on the same architecture (a tiny
GraniteMoe built from a config, offline; the real 3B checkpoint cannot be downloaded here)."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import cpu_env, skip_without_math_verify
import yaml

from trl_gspo.launch.cli import main

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "recipes" / "granite_3b_a800m"
TRIO = ("gspo", "grpo", "grpo_replay")
# What the arms are allowed to differ in: the loss, its clip range and how it is set, replay, and where they write.
ARM_KEYS = {"loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "clip_band", "routing_replay",
            "output_dir"}


def _load(name):
    return yaml.safe_load((FOLDER / f"{name}.yaml").read_text())


def _tiny_granite(path: Path) -> None:
    import torch
    import transformers

    from trl_gspo.quickstart.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = transformers.GraniteMoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.GraniteMoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_trio_differs_only_in_loss_clip_range_and_replay():
    gspo, grpo, replay = (_load(n) for n in TRIO)
    assert (gspo["loss_type"], gspo["epsilon"], gspo["epsilon_high"]) == ("gspo", 3e-4, 4e-4)
    assert (grpo["loss_type"], grpo["importance_sampling_level"], grpo["epsilon"], grpo["epsilon_high"]) == \
        ("grpo", "token", 0.2, 0.27)
    assert {k: replay[k] for k in ("loss_type", "importance_sampling_level", "epsilon", "epsilon_high")} == \
        {k: grpo[k] for k in ("loss_type", "importance_sampling_level", "epsilon", "epsilon_high")}
    assert replay["routing_replay"] == "old" and "routing_replay" not in grpo and "routing_replay" not in gspo
    assert len({r["output_dir"] for r in (gspo, grpo, replay)}) == 3
    shared = (set(gspo) | set(grpo) | set(replay)) - ARM_KEYS
    assert shared and all(gspo.get(k) == grpo.get(k) == replay.get(k) for k in shared), \
        [k for k in shared if not gspo.get(k) == grpo.get(k) == replay.get(k)]
    assert gspo["model_name_or_path"] == "ibm-granite/granite-3.0-3b-a800m-base"
    assert gspo["steps_per_generation"] == 4 * gspo["gradient_accumulation_steps"] and gspo["beta"] == 0
    assert gspo["router_aux_loss_coef"] == 0.0  # TRL 1.16's aux loss needs config.num_experts; Granite has none


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
@pytest.mark.parametrize("name", TRIO)
def test_trio_resolves_with_dry_run(name, gpu, capsys, monkeypatch, fake_accelerator):
    skip_without_math_verify(_load(name)["reward_funcs"])
    fake_accelerator(gpu)  # both branches of the dry run's "is there a GPU?" decision, on any machine
    probed = []  # the hub dataset is not cached offline; the probe only records what it was asked (as test_cli)
    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: probed.append((key, path)))
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    assert main(["--config", str(FOLDER / f"{name}.yaml"), "--dry_run", "true"]) == 0
    assert probed == [("dataset_name", "trl-lib/DeepMath-103K")]
    out = capsys.readouterr().out
    assert "recipe is valid" in out and "granite-3.0-3b-a800m" in out
    assert ("no GPU here" in out) == (not gpu)


def test_preset_model_settings_train_a_tiny_granite_moe_with_replay(tmp_path):
    """grpo_replay.yaml with only data, size and hardware swapped for CPU: routing replay on Granite's router."""
    _tiny_granite(tmp_path / "model")
    recipe = _load("grpo_replay")
    recipe.update(model_name_or_path=str(tmp_path / "model"), dtype="float32", attn_implementation="eager",
                  dataset_name="builtin:addition", reward_funcs=["exact_match_reward"], per_device_train_batch_size=8,
                  gradient_accumulation_steps=1, num_generations=4, steps_per_generation=2,
                  max_completion_length=4, max_steps=2, logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, bf16=False, gradient_checkpointing=False, output_dir=str(tmp_path / "out"))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = subprocess.run([sys.executable, "-m", "trl_gspo.launch.train", "--config", str(path)], capture_output=True,
                            text=True, timeout=600, env=cpu_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    state = yaml.safe_load((tmp_path / "out" / "trainer_state.json").read_text())  # JSON is YAML
    logged = [h for h in state["log_history"] if "loss" in h]
    assert state["global_step"] == 2 and logged
    assert any("routing/drift_mean" in h for h in logged)  # replay ran on Granite's routers
