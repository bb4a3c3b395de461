"""docs/metrics.md against what the trainers log: a short GSPOTrainer run that logs every optional family at once
(off-policy mini-batches, the adaptive band, R3 with HF generate, LoRA on the experts, a delta cap) must log no name
of ours the page does not list; and every name the page lists must be one the code can log (written in its source),
so no row outlives its metric."""

import re
from pathlib import Path

from support.helpers import digit_reward, tiny_config, toy_dataset

ROOT = Path(__file__).resolve().parents[1]
# Namespaces and names this package logs (TRL's own `completions/*`, `rewards/*`, `loss`, ... are TRL's to document)
OURS = ("gspo/", "routing/", "sampling/", "lora/", "tools/", "clip_ratio/")
OURS_PLAIN = ("policy_loss",)


def documented() -> list[str]:
    """Every metric name in the first column of metrics.md's metric tables (first column `name`; `.../x` continues
    the row's previous name; `_K` stands for an age)."""
    names, header = [], None
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        if header is None:  # a table's first row: only the tables of metrics, whose first column is `name`
            header = line.split("|")[1].strip()
            continue
        if header != "name" or not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        previous = None
        for name in re.findall(r"`([^`]+)`", first):
            if name.endswith("*"):  # a family's heading (`sampling/*`): its names follow in the row
                continue
            if name.startswith(".../") and previous:
                name = previous.rsplit("/", 1)[0] + name[3:]
            names.append(name)
            previous = name
    return names


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace("_K", r"_\d+") + "$")


def test_the_page_lists_names_the_code_can_log():
    source = "\n".join(path.read_text() for path in (ROOT / "trl_gspo").rglob("*.py"))
    names = documented()
    assert len(names) > 40, names
    for name in names:
        stem = re.sub(r"_?age_K$", "", name)  # written as a prefix and the age (`f"...{suffix}"`, `f"...age_{k}"`)
        # a name is written whole in the source, or as its last part under a prefix built at run time
        assert stem in source or stem.rsplit("/", 1)[-1] in source, f"docs/metrics.md lists {name!r}: not in trl_gspo"


def test_a_run_logs_no_name_of_ours_the_page_leaves_out(tmp_path, tokenizer):
    from peft import LoraConfig

    from trl_gspo import GSPOTrainer
    from trl_gspo.quickstart.model import build_model

    args = tiny_config(tmp_path, max_steps=2, steps_per_generation=2, clip_band="adaptive", delta=1.5,
                       routing_replay="sampler")
    trainer = GSPOTrainer(build_model(tokenizer, seed=0), digit_reward, args=args, train_dataset=toy_dataset(),
                          processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj"]))
    trainer.train()
    logged = {key for entry in trainer.state.log_history for key in entry}
    ours = sorted(key for key in logged if key.startswith(OURS) or key in OURS_PLAIN)
    assert {"gspo/clip_epsilon_low", "routing/sampler_agreement", "sampling/k3_kl", "lora/folded_rollout_bytes",
            "gspo/delta_clipped_token_fraction"} <= set(ours), ours  # each optional family is in the run
    patterns = [_pattern(name) for name in documented()]
    missing = [key for key in ours if not any(p.match(key) for p in patterns)]
    assert not missing, f"logged but not in docs/metrics.md: {missing}"


def test_age_names_match_every_age():
    assert _pattern("gspo/clipped_sequence_fraction/age_K").match("gspo/clipped_sequence_fraction/age_12")
    assert _pattern("gspo/behaviour_weight/max_age_K").match("gspo/behaviour_weight/max_age_3")
    assert not _pattern("gspo/behaviour_weight/max_age_K").match("gspo/behaviour_weight/max")
