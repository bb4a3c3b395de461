"""Every feature of ours with every loss type: each (feature, loss type) pair trains, or is refused in one line naming
the option and the fix. `EXPECTED` is the matrix; docs/trl_contract.md#our-features-with-every-loss-type shows it.

The loss types are read from TRL at collection time (its `loss_type` help, as tests/test_trl_contract.py reads it),
so a loss type a new TRL adds is a pair `EXPECTED` does not classify: its cases fail until someone decides it.

A working pair builds its own trainer from its own `GSPOConfig`, on the tiny MoE, in process: TRL's rollout with the
feature on (generation, old-policy pass), then one training micro-step (forward with the feature's replay or folding,
the loss type's loss, backward), and checks what the feature must have done there."""

import dataclasses
import math
import re

import pytest
import torch
from support.helpers import tiny_config, toy_dataset
from trl import GRPOConfig

from trl_gspo import GSPOTrainer
from trl_gspo.config import GSPO_LOSS_TYPES
from trl_gspo.quickstart.model import build_model
from trl_gspo.turn_advantages import ToolCreditGSPOTrainer

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")]

WORKS = "works"
W = WORKS  # a grid: W works; a name is the option its one-line refusal names
EXPECTED = {  # feature -> loss type -> WORKS, or the option a one-line refusal names (with its "Fix:")
    "R2": {"gspo": W, "gspo_token": W, "grpo": W, "dr_grpo": W, "dapo": W, "bnpo": W, "cispo": W, "sapo": W,
           "luspo": W, "vespo": W},
    "R3": {"gspo": W, "gspo_token": W, "grpo": W, "dr_grpo": W, "dapo": W, "bnpo": W, "cispo": W, "sapo": W,
           "luspo": W, "vespo": W},
    "adaptive_band": {"gspo": W, "gspo_token": W, "grpo": "clip_band", "dr_grpo": "clip_band", "dapo": "clip_band",
                      "bnpo": "clip_band", "cispo": "clip_band", "sapo": "clip_band", "luspo": "clip_band",
                      "vespo": "clip_band"},
    "lora_folding": {"gspo": W, "gspo_token": W, "grpo": W, "dr_grpo": W, "dapo": W, "bnpo": W, "cispo": W,
                     "sapo": W, "luspo": W, "vespo": W},
    "tool_turns": {"gspo": W, "gspo_token": W, "grpo": W, "dr_grpo": W, "dapo": W, "bnpo": W, "cispo": W, "sapo": W,
                   "luspo": W, "vespo": W},
    "sampler_logps": {"gspo": W, "gspo_token": W, "grpo": W, "dr_grpo": W, "dapo": W, "bnpo": W, "cispo": W,
                      "sapo": W, "luspo": W, "vespo": W},
    "per_turn_credit": {"gspo": "loss_type", "gspo_token": W, "grpo": "loss_type", "dr_grpo": "loss_type",
                        "dapo": "loss_type", "bnpo": "loss_type", "cispo": "loss_type", "sapo": "loss_type",
                        "luspo": "loss_type", "vespo": "loss_type"},
}
# Each feature's row label in docs/trl_contract.md.
DOC_ROWS = {
    "R2": 'R2, `routing_replay="old"`',
    "R3": 'R3, `routing_replay="sampler"`',
    "adaptive_band": '`clip_band="adaptive"`',
    "lora_folding": "LoRA folding, `merge_adapters_for_rollout`",
    "tool_turns": "tool turns",
    "sampler_logps": '`old_logps="sampler"`',
    "per_turn_credit": "per-turn credit, `token_advantages`",
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def trl_loss_types() -> list[str]:
    """TRL's loss types, in the order its `loss_type` help lists them."""
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    return re.findall(r"'(\w+)'", re.search(r"Supported values are (.*?)\. ", help_text).group(1))


LOSS_TYPES = [*GSPO_LOSS_TYPES, *trl_loss_types()]


def test_the_matrix_classifies_every_pair():
    """A loss type TRL adds (or a feature added to `EXPECTED` half-classified) fails here until each pair is decided."""
    assert set(EXPECTED) == set(FEATURES) == set(DOC_ROWS)
    for feature, row in EXPECTED.items():
        unclassified = [loss_type for loss_type in LOSS_TYPES if loss_type not in row]
        assert not unclassified, (f"{feature} with loss type(s) {unclassified}: classify each pair in EXPECTED (works, "
                                  "or refused at config time naming the option), and in docs/trl_contract.md")
        assert set(row) <= set(LOSS_TYPES), f"{feature}: loss type(s) {set(row) - set(LOSS_TYPES)} are gone"


# ------------------------------------------------------------------ each feature: its options and what it must do
def _reward(completions, **kwargs):  # differs within a group (samples differ), so advantages are not all 0
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def _tool_rollout(tokenizer):
    """A rollout_func of multi-turn samples: a model turn, a tool result (env_mask 0), a second model turn."""
    generator = torch.Generator().manual_seed(0)

    def rollout(prompts, trainer):
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        completions, masks = [], []
        for _sample in prompts:
            first, tool, second = (torch.randint(4, 14, (int(n),), generator=generator).tolist()
                                   for n in torch.randint(1, 4, (3,), generator=generator))
            completions.append(first + tool + second + [tokenizer.eos_token_id])
            masks.append([1] * len(first) + [0] * len(tool) + [1] * (len(second) + 1))
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "env_mask": masks,
                "logprobs": [[-1.0] * len(c) for c in completions]}

    return rollout


@dataclasses.dataclass
class Feature:
    options: dict  # the GSPOConfig options that turn it on
    trainer: dict = dataclasses.field(default_factory=dict)  # what the trainer is built with besides (by name)
    refused_when_built: bool = False  # the refusal comes from the trainer (a subclass the config cannot see)


FEATURES = {
    "R2": Feature({"routing_replay": "old"}),
    "R3": Feature({"routing_replay": "sampler"}),
    "adaptive_band": Feature({"clip_band": "adaptive"}),
    "lora_folding": Feature({"merge_adapters_for_rollout": True, "exact_lora_merge": True}, {"peft": True}),
    "tool_turns": Feature({}, {"rollout_func": True}),
    "sampler_logps": Feature({"old_logps": "sampler", "routing_replay": "sampler"}),
    "per_turn_credit": Feature({}, {"rollout_func": True, "trainer_cls": ToolCreditGSPOTrainer},
                               refused_when_built=True),
}
# luspo is defined per sequence (TRL warns otherwise); every other type keeps the level GSPOConfig resolves for it.
LEVELS = {"luspo": "sequence"}


def _config(out, feature, loss_type):
    return tiny_config(out, loss_type=loss_type, per_device_train_batch_size=4, steps_per_generation=2, max_steps=1,
                       **({"importance_sampling_level": LEVELS[loss_type]} if loss_type in LEVELS else {}),
                       **FEATURES[feature].options)


def _build(feature, args, tokenizer):
    spec = FEATURES[feature].trainer
    kwargs = {"processing_class": tokenizer, "train_dataset": toy_dataset()}
    if spec.get("rollout_func"):
        kwargs["rollout_func"] = _tool_rollout(tokenizer)
    if spec.get("peft"):
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           target_parameters=EXPERTS)
    if spec.get("trainer_cls") is ToolCreditGSPOTrainer:
        kwargs["failure_marker"] = ""  # every tool result counts as failed: each turn but the last gets credit
    torch.manual_seed(0)
    return spec.get("trainer_cls", GSPOTrainer)(build_model(tokenizer), _reward, args=args, **kwargs)


@dataclasses.dataclass
class Run:
    """A pair's trainer, the first training micro-batch of the rollout it generated, and what its training passes
    computed (("logps", log-probs) or ("advantages", the token advantages gspo_token used))."""

    trainer: GSPOTrainer
    inputs: dict
    passes: list
    folded_bytes: float = 0.0


def _generate(feature, args, tokenizer) -> Run:
    trainer = _build(feature, args, tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which this runs a step of
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))  # TRL's rollout, our hooks in it
    trainer._prepare_inputs = lambda batch: batch  # later steps train this micro-batch as it is
    run = Run(trainer, inputs, [], sum(trainer._metrics["train"].get("lora/folded_rollout_bytes", [])))
    scoring, advantages = trainer._get_per_token_logps_and_entropies, trainer.token_advantages

    def kept_logps(model, *args, **kwargs):
        result = scoring(model, *args, **kwargs)
        if torch.is_grad_enabled():
            run.passes.append(("logps", result[0].detach()))
        return result

    def kept_advantages(inputs_, mask):
        result = advantages(inputs_, mask)
        run.passes.append(("advantages", result.detach()))
        return result

    trainer._get_per_token_logps_and_entropies = kept_logps
    trainer.token_advantages = kept_advantages
    return run


def _policy_mask(inputs):
    return (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()


def _logps(run):
    return [value for kind, value in run.passes if kind == "logps"][-1]


def _on_the_sampling_weights(run, exact=False):
    """No update since the rollout: the training pass scores what the old-policy pass (or the sampler) scored."""
    mask = _policy_mask(run.inputs)
    gap = (_logps(run) - run.inputs["old_per_token_logps"])[mask].abs().max().item()
    assert gap == 0.0 if exact else gap < 1e-4, gap


def _check_replay(run, metrics):
    assert run.trainer._replay_opened and "routing_indices" in run.inputs  # replayed through backward
    _on_the_sampling_weights(run)


def _check_band(run, metrics):
    assert metrics["gspo/clip_epsilon_low"] == 1  # the band in use, logged by this micro-step's loss
    assert run.trainer._adaptive_band._noise  # which gave the band what it reads (here: noise, on sampling weights)


def _check_lora(run, metrics):
    assert run.folded_bytes > 0  # the rollout (generate, old-policy pass) ran with the experts folded
    _on_the_sampling_weights(run, exact=True)  # folded: bit for bit the active forward
    grads = {n: p.grad for n, p in run.trainer.model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in name for name in grads)


def _check_tool_turns(run, metrics):
    inputs, trainer = run.inputs, run.trainer
    tool = inputs["completion_mask"].bool() & (inputs["tool_mask"] == 0)
    assert tool.any()
    with torch.no_grad():  # the loss ignores the tool's tokens: pi_old moved there changes nothing
        moved = dict(inputs, old_per_token_logps=inputs["old_per_token_logps"].masked_fill(tool, -30.0))
        losses = [trainer.compute_loss(trainer.model, batch).item() for batch in (inputs, moved)]
    assert losses[0] == losses[1] and math.isfinite(losses[0])


def _check_sampler_logps(run, metrics):
    assert run.trainer._sampler_logps.skipped_passes == 1  # TRL's old-policy pass answered without a forward
    assert torch.equal(run.inputs["old_per_token_logps"], run.inputs["sampling_per_token_logps"])
    _on_the_sampling_weights(run)  # HF generate in float32: the trainer's log-probs to rounding


def _check_credit(run, metrics):
    advantages = [value for kind, value in run.passes if kind == "advantages"][-1]
    mask, sequence = _policy_mask(run.inputs), run.inputs["advantages"][:, None].expand_as(advantages)
    assert not torch.equal(advantages[mask], sequence[mask])  # per-turn credit, not the broadcast advantage


CHECKS = {"R2": _check_replay, "R3": _check_replay, "adaptive_band": _check_band, "lora_folding": _check_lora,
          "tool_turns": _check_tool_turns, "sampler_logps": _check_sampler_logps, "per_turn_credit": _check_credit}


# ------------------------------------------------------------------ every pair
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("feature", list(EXPECTED))
def test_every_pair_trains_or_is_refused_in_one_line(feature, loss_type, tmp_path, tokenizer):
    expected = EXPECTED[feature].get(loss_type)
    assert expected is not None, f"{feature} with loss_type={loss_type!r} is not classified in EXPECTED"
    try:  # before the trainer: a `TrainingArguments` built later would reset the accelerate state it set up
        args = _config(tmp_path, feature, loss_type)
    except ValueError as refusal:
        args = refusal
    if expected != WORKS:
        if FEATURES[feature].refused_when_built and not isinstance(args, ValueError):
            with pytest.raises(ValueError) as refusal:
                _build(feature, args, tokenizer)
            args = refusal.value
        assert isinstance(args, ValueError), f"{feature} with loss_type={loss_type!r} was not refused"
        message = str(args)
        assert message.startswith(f"`{expected}`: ") and " Fix: " in message and "\n" not in message, message
        return

    assert not isinstance(args, ValueError), args
    run = _generate(feature, args, tokenizer)
    trainer = run.trainer
    loss = trainer.training_step(trainer.model, dict(run.inputs), None)
    metrics = {name: len(values) for name, values in trainer._metrics["train"].items()}
    assert math.isfinite(loss.item())
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    CHECKS[feature](run, metrics)


# ------------------------------------------------------------------ the docs' table
def _doc_table():
    """docs/trl_contract.md's matrix: (header loss types, {row label: cells}, {footnote mark: text})."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "trl_contract.md").read_text()
    section = text.split("\n## Our features with every loss type\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    header, body = rows[0], rows[2:]
    notes = dict(re.findall(r"^([¹²³⁴⁵⁶⁷⁸⁹]) (.*)$", section, re.MULTILINE))
    return header[1:], {row[0]: row[1:] for row in body}, notes


def test_the_docs_table_is_the_matrix():
    header, table, notes = _doc_table()
    assert header == [f"`{loss_type}`" for loss_type in LOSS_TYPES]
    assert set(table) == set(DOC_ROWS.values())
    for feature, label in DOC_ROWS.items():
        for loss_type, cell in zip(LOSS_TYPES, table[label], strict=True):
            expected = EXPECTED[feature][loss_type]
            if expected == WORKS:
                assert cell == "✓", (label, loss_type, cell)
            else:  # "refused" and a mark whose note names the option
                assert cell.startswith("refused") and f"`{expected}`" in notes[cell[-1]], (label, loss_type, cell)
