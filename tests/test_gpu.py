"""GPU acceptance: what a GPU user runs first, and what only a GPU can show. Run: `pytest -m gpu` (the default
`pytest` leaves it out).

Each test skips, with the reason, where no CUDA device is visible. Needs only the package and its dependencies
(deepspeed for the ZeRO-3 test: `pip install -e ".[test]"`), no network; under 10 minutes on one H100. A short
summary of the figures measured is printed at the end: copy it into docs/results.md with the device, versions and
commit.

Developer aid (not a GPU check): `TRL_GSPO_GPU_TESTS_DEVICE=cpu pytest -m gpu` runs the same test bodies on the
CPU (float32 where a CPU cannot do the GPU's bf16 path), so a machine without a GPU can catch a broken test.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
GSPO_BAND = 3e-4  # the paper's left clip range on s_i


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _model(tokenizer, **overrides):
    """The tiny Qwen3-MoE with transformers' default experts kernel (grouped_mm), as a real checkpoint gets it."""
    from trl_gspo.quickstart.model import build_model

    return build_model(tokenizer, config_overrides=dict(experts_implementation=None, **overrides), seed=0)


def _hardware_args(device: str) -> dict:
    return dict(use_cpu=device == "cpu", bf16=device == "cuda")


def _cli(device: str, *args, timeout=600) -> subprocess.CompletedProcess:
    hardware = ["--use_cpu", "false", "--bf16", "true"] if device == "cuda" else ["--use_cpu", "true", "--bf16",
                                                                                 "false"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-m", "trl_gspo.launch.cli", *args, *hardware], capture_output=True,
                            text=True, env=env, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _rewards(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["reward"] for h in state["log_history"] if "reward" in h]


def test_quickstart_end_to_end(device, tmp_path, record_figure):
    """The README's GPU quickstart command: cold start and GSPO on the accelerator, reward rising."""
    out = tmp_path / "quickstart"
    _cli(device, "--config", str(ROOT / "recipes" / "quickstart.yaml"), "--output_dir", str(out))
    rewards = _rewards(out)
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    record_figure("quickstart reward first -> last", f"{first:.3f} -> {last:.3f}")
    assert last > first + 0.15, rewards


@pytest.mark.parametrize("arm", ["gspo", "gspo_token", "grpo_routing_replay"])
def test_losses_train_in_bf16_with_the_default_experts_kernel(arm, device, tmp_path, tokenizer, record_figure):
    from trl_gspo import GSPOTrainer

    settings = {"gspo": dict(loss_type="gspo"), "gspo_token": dict(loss_type="gspo_token"),
                "grpo_routing_replay": dict(loss_type="grpo", epsilon=0.2, epsilon_high=0.27,
                                            routing_replay="old")}[arm]
    model = _model(tokenizer)
    args = tiny_config(tmp_path, steps_per_generation=2, max_steps=4, **_hardware_args(device), **settings)
    trainer = GSPOTrainer(model, digit_reward, args=args, train_dataset=toy_dataset(), processing_class=tokenizer)
    assert trainer.model.config._experts_implementation != "eager"
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 4 and all(math.isfinite(h["loss"]) for h in logged)
    expected = "routing/drift_mean" if arm == "grpo_routing_replay" else "gspo/ratio_mean"
    assert all(expected in h for h in logged), logged[-1].keys()
    record_figure(f"{arm}: 4 steps, kernel {trainer.model.config._experts_implementation}",
                  f"last loss {logged[-1]['loss']:.4g}, {expected} {logged[-1][expected]:.4g}")


@pytest.mark.parametrize("offload", [False, True])
def test_replay_reproduces_the_recorded_forward_exactly(offload, device, tokenizer, record_figure):
    """Also with the recording offloaded to pinned host memory (`routing_replay_offload`): the copy must be complete
    before the host reads it, and the copy back must give the same experts."""
    from trl_gspo.routing import RoutingReplay

    model = _model(tokenizer, num_experts=32, num_experts_per_tok=4).to(device, _dtype(device)).eval()
    replay, on_device = RoutingReplay(model, offload_to_cpu=offload), RoutingReplay(model)
    ids = torch.randint(3, tokenizer.vocab_size, (64, 256), device=device)  # big enough for a slow copy to show
    with torch.no_grad():
        with replay.record() as recording, on_device.record() as reference:
            recorded = model(input_ids=ids).logits.float().log_softmax(-1)
        if offload and torch.device(device).type == "cuda":
            assert recording.indices.device.type == "cpu" and recording.indices.is_pinned()
        assert torch.equal(recording.indices.cpu(), reference.indices.cpu())  # read on the host right away
        with replay.replay(recording.indices):
            replayed = model(input_ids=ids).logits.float().log_softmax(-1)
    difference = (recorded - replayed).abs().max().item()
    record_figure(f"replay of a recording{' offloaded to host' if offload else ''}, max |log-prob diff|",
                  f"{difference:.3g} ({_dtype(device)})")
    assert difference == 0.0


def _token_logps(model, sequences: list[torch.Tensor], order: list[int], micro_batch: int, pad_id: int, device):
    """Per-token log-probs of each sequence, scored `micro_batch` sequences at a time in `order`, each micro-batch
    right-padded to its own longest sequence (so composition and padding differ between orders)."""
    out = {}
    for start in range(0, len(order), micro_batch):
        rows = order[start:start + micro_batch]
        width = max(len(sequences[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, device=device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for r, i in enumerate(rows):
            ids[r, :len(sequences[i])] = sequences[i]
            mask[r, :len(sequences[i])] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logps = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        for r, i in enumerate(rows):
            out[i] = logps[r, :len(sequences[i]) - 1]
    return out


def test_on_policy_noise_floor_with_differently_batched_passes(device, tokenizer, record_figure):
    """The old-policy pass and the training pass see the same weights but, after TRL's shuffle, other micro-batch
    neighbours and other padding. GSPO's band is 3e-4 on mean log ratio: the kernel noise must be far below it."""
    model = _model(tokenizer, num_experts=32, num_experts_per_tok=4, num_hidden_layers=4,
                   hidden_size=256, head_dim=32).to(device, _dtype(device)).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, 64, (32,), generator=generator).tolist()  # prompts + completions of varied length
    sequences = [torch.randint(3, tokenizer.vocab_size, (n,), generator=generator).to(device) for n in lengths]
    first = _token_logps(model, sequences, list(range(32)), 8, tokenizer.pad_token_id, device)
    shuffled = torch.randperm(32, generator=generator).tolist()
    second = _token_logps(model, sequences, shuffled, 4, tokenizer.pad_token_id, device)
    completion = 8  # the last tokens of each sequence play the completion
    log_s = torch.stack([(first[i][-completion:] - second[i][-completion:]).mean() for i in range(32)])
    worst = log_s.abs().max().item()
    record_figure("on-policy noise, differently batched, max |log s_i|",
                  f"{worst:.3g} = {worst / GSPO_BAND:.3f} of GSPO's band ({_dtype(device)})")
    assert math.isfinite(worst) and worst < 0.05  # a sanity bound; the figure itself is the result


def test_zero3_one_process_with_replay_checkpoint_and_resume(device, tmp_path, record_figure):
    pytest.importorskip("deepspeed", reason='ZeRO-3 needs deepspeed: pip install -e ".[deepspeed]"')
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "out"
    recipe.write_text(f"""
model_name_or_path: builtin:tiny-qwen3-moe
dataset_name: builtin:addition
reward_funcs: [digit_match_reward]
sft_steps: 0
loss_type: grpo
epsilon: 0.2
epsilon_high: 0.27
routing_replay: old
per_device_train_batch_size: 8
num_generations: 4
steps_per_generation: 2
max_completion_length: 4
logging_steps: 1
save_strategy: steps
save_steps: 2
output_dir: {out}
report_to: none
gradient_checkpointing: false
plot: false
""")
    config = "zero3.yaml" if device == "cuda" else "cpu_zero3.yaml"
    launch = ["--accelerate_config", str(ROOT / "recipes" / "accelerate" / config), "--num_processes", "1"]
    _cli(device, "--config", str(recipe), *launch, "--max_steps", "3")
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    _cli(device, "--config", str(recipe), *launch, "--max_steps", "5", "--resume_from_checkpoint", "latest")
    state = json.loads((out / "trainer_state.json").read_text())
    drift = [h["routing/drift_mean"] for h in state["log_history"] if "routing/drift_mean" in h]
    assert state["global_step"] == 5 and drift and all(math.isfinite(d) for d in drift)
    record_figure("ZeRO-3, 1 process, replay + checkpoint + resume", f"5 steps, drift {drift[-1]:.3g}")


def test_lora_on_expert_weights(device, tmp_path, tokenizer, record_figure):
    from peft import LoraConfig

    from trl_gspo import GSPOTrainer

    trainer = GSPOTrainer(_model(tokenizer), digit_reward,
                          args=tiny_config(tmp_path, max_steps=2, **_hardware_args(device)),
                          train_dataset=toy_dataset(), processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj",
                                                                    "mlp.experts.down_proj"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    experts = {n for n in changed if "experts" in n}
    assert experts and changed <= trainable and all("lora_" in n for n in trainable)
    record_figure("LoRA on expert weights", f"{len(experts)} expert adapter tensors updated")
