"""`AsyncGSPOTrainer` (trl_gspo/async_trainer/trainer.py) without a server: TRL's asynchronous trainer on a CPU with the
test stand-ins of tests/support/async_stand_ins.py, a rollout worker that is a queue the test fills, and no weight
transfer.

The loss is checked on TRL's own packed rows (its trie packing, tree attention, fused LM head): value and gradient of
every parameter against a float64 reference written from the paper (one completion at a time, a plain forward, no
packing), and against the synchronous `GSPOTrainer`'s loss on the same samples unpadded-and-unpacked."""

import copy
import math

import numpy as np
import pytest
import torch
from support.helpers import tiny_config, toy_dataset

from support import async_stand_ins
from support.async_stand_ins import NoWeightTransfer, QueueWorker

async_stand_ins.install()

from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer, GSPOConfig, GSPOTrainer  # noqa: E402
from trl_gspo.async_trainer.trainer import _VersionedRolloutCollator  # noqa: E402

from support.async_reference import (EPISODES, OFFSETS, PROMPTS, assert_matches_reference,  # noqa: E402
                                     episode_samples, reference_logps, token_budget_step)

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def _trainer(tiny_moe_dir, tokenizer, tmp_path, samples=(), callbacks=None, **config):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"
    args = AsyncGSPOConfig(**{**dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                                     per_device_train_batch_size=6, num_generations=4, token_budget=0,
                                     logging_steps=1, save_strategy="no", router_aux_loss_coef=0.0,
                                     disable_tqdm=True, epsilon=EPS_LOW, epsilon_high=EPS_HIGH), **config})
    return AsyncGSPOTrainer(model=str(tiny_moe_dir), reward_funcs=[], args=args, train_dataset=toy_dataset(4),
                            processing_class=tokenizer, rollout_worker=QueueWorker(samples),
                            weight_transfer=NoWeightTransfer(), callbacks=callbacks)


def _reference_loss(model, sampled, token_level):
    """-J of Eq. 5 (or 13 with per-sequence advantages) with s_i of Eq. 7 over each completion's policy tokens,
    float64, from `model`'s plain forward, one completion at a time."""
    terms = []
    for (prompt, completion, mask, advantage), offset, sampled_logps in zip(EPISODES, OFFSETS, sampled):
        ids = torch.tensor([PROMPTS[prompt] + completion])
        logps = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        logps = logps[len(PROMPTS[prompt]) - 1:][torch.tensor(mask).bool()]
        old = sampled_logps[torch.tensor(mask).bool()] + offset
        log_s = (logps - old).mean()
        if token_level:  # s_i,t = sg[s_i] pi_t / sg[pi_t]
            ratio = torch.exp(log_s).detach() * torch.exp(logps - logps.detach())
        else:
            ratio = torch.exp(log_s)
        term = torch.minimum(ratio * advantage, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantage)
        terms.append(term.mean())
    return -torch.stack(terms).mean()


def _packed_batch(samples, rows=1):
    tree_rows = [TreeRow() for _ in range(rows)]
    for i, sample in enumerate(samples):
        tree_rows[i % rows].add(sample)
    return _VersionedRolloutCollator(pad_token_id=0, num_processes=rows)([tree_rows])


def _loss_and_grads(trainer, batch):
    model = trainer.model
    model.train()
    model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    trainer._policy_version = 0
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
def test_packed_loss_and_gradients_match_the_float64_reference(tiny_moe_dir, tokenizer, tmp_path, loss_type):
    trainer = _trainer(tiny_moe_dir, tokenizer, tmp_path, loss_type=loss_type)
    batch = _packed_batch(episode_samples(tiny_moe_dir))
    assert batch["input_ids"].shape[1] < sum(len(PROMPTS[p]) + len(c) for p, c, _, _ in EPISODES)  # shared prefixes
    loss, grads = _loss_and_grads(trainer, batch)

    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")
    expected = _reference_loss(reference, reference_logps(tiny_moe_dir), token_level=loss_type == "gspo_token")
    assert set(grads) == set(assert_matches_reference(loss, grads, expected, reference))

    # The clip band acted: both clipped and unclipped completions, so a wrong |y_i| or band would show.
    logged = trainer._metrics["train"]
    clipped, completions = logged["clip_ratio/region_mean"][-1]  # a (sum, count) rate for TRL's logger
    assert completions == len(EPISODES) and 0 < clipped < completions
    assert logged["gspo/clipped_sequence_fraction/age_0"][-1] == pytest.approx((clipped, completions))


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
def test_a_step_of_unequal_micro_batches_is_the_plain_mean_over_its_completions(tiny_moe_dir, tokenizer, tmp_path,
                                                                                 loss_type):
    """Each completion of an optimizer step weighs 1 / (the step's completions) whatever the packer put in each
    micro-batch: three micro-batches of 2, 3 and 1 completions give the float64 reference's plain mean over all six
    (a per-micro-batch mean over the accumulation steps would weigh the lone completion 3x the others)."""
    trainer = _trainer(tiny_moe_dir, tokenizer, tmp_path, loss_type=loss_type, gradient_accumulation_steps=3)
    loss, grads, counts = token_budget_step(trainer, episode_samples(tiny_moe_dir), budget=21)
    assert counts == [2, 3, 1]

    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float64, attn_implementation="eager",
                                                     experts_implementation="eager")
    expected = _reference_loss(reference, reference_logps(tiny_moe_dir), token_level=loss_type == "gspo_token")
    assert_matches_reference(loss, grads, expected, reference)


def test_packed_loss_equals_the_synchronous_trainers_loss_on_the_same_samples(tiny_moe_dir, tokenizer, tmp_path):
    """Same samples, same weights: `GSPOTrainer._compute_loss` on TRL's synchronous (padded, unpacked) batch with the
    tool result masked by `tool_mask` gives AsyncGSPOTrainer's loss on the packed row, value and gradients."""
    samples = episode_samples(tiny_moe_dir)
    packed = _trainer(tiny_moe_dir, tokenizer, tmp_path / "async")
    loss, grads = _loss_and_grads(packed, _packed_batch(samples, rows=1))

    sync = GSPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_moe_dir), reward_funcs=lambda **k: [0.0],
                       args=tiny_config(tmp_path / "sync", router_aux_loss_coef=0.0), train_dataset=toy_dataset(),
                       processing_class=tokenizer)
    width_p = max(len(p) for p in PROMPTS)
    width_c = max(len(c) for _, c, _, _ in EPISODES)
    prompt_ids = torch.tensor([[0] * (width_p - len(PROMPTS[p])) + PROMPTS[p] for p, _, _, _ in EPISODES])
    prompt_mask = torch.tensor([[0] * (width_p - len(PROMPTS[p])) + [1] * len(PROMPTS[p]) for p, _, _, _ in EPISODES])
    completion_ids = torch.tensor([c + [0] * (width_c - len(c)) for _, c, _, _ in EPISODES])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c, _, _ in EPISODES])
    tool_mask = torch.tensor([m + [1] * (width_c - len(m)) for _, _, m, _ in EPISODES])
    old = torch.zeros(len(EPISODES), width_c)
    for i, sample in enumerate(samples):
        n = len(EPISODES[i][1])
        old[i, :n] = torch.from_numpy(sample["old_log_probs"][-n:])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "tool_mask": tool_mask, "old_per_token_logps": old,
              "advantages": torch.tensor([a for _, _, _, a in EPISODES])}
    sync.model.train()
    sync.model.zero_grad()
    sync.current_gradient_accumulation_steps = 1
    sync_loss = sync._compute_loss(sync.model, inputs)
    sync_loss.backward()
    assert loss.item() == pytest.approx(sync_loss.item(), rel=1e-5, abs=1e-7)
    for name, param in sync.model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def _rollout_samples(versions, group_size=4):
    """RolloutSamples (what TRL's worker queues), one group per entry of `versions` (the weight version it was
    sampled with), fixed random tokens."""
    rng = np.random.default_rng(0)
    samples = []
    for group, version in enumerate(versions):
        prompt = list(rng.integers(5, 40, 6))
        for k in range(group_size):
            ids = np.array(prompt + list(rng.integers(5, 40, 5)))
            mask = np.array([0] * 6 + [1] * 5)
            samples.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask,
                                         old_log_probs=np.where(mask, -3.9, 0.0).astype(np.float32),
                                         advantage=float(k) - 1.5, model_version=version, group_id=group,
                                         metrics={"reward": float(k)}))
    return samples


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token", "grpo"])
def test_trains_on_queued_samples_drops_stale_ones_and_logs_clipping_by_age(tiny_moe_dir, tokenizer, tmp_path,
                                                                              loss_type, capsys):
    """Two optimizer steps of 8 samples. The trainer is at weight version 1 after its start-up sync, 2 after step 1.
    Version -5 samples are past max_staleness=2 and dropped (TRL's rule). The version 0 ones are trained at age 1,
    then at age 2: the dataloader reads the second batch before step 1's weight sync, so age is taken when trained.
    The run ends with the synchronous trainer's run summary and curves (what `trainer: async` recipes get)."""
    from trl_gspo.launch.reporting import RunReportCallback

    versions = [-5, 0, 0, -5, 0, 0, 0, 0]
    trainer = _trainer(tiny_moe_dir, tokenizer, tmp_path, _rollout_samples(versions), loss_type=loss_type,
                       max_steps=2, per_device_train_batch_size=8, max_staleness=2, router_aux_loss_coef=None,
                       callbacks=[RunReportCallback(plot=True)])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(np.isfinite(h["loss"]) for h in logs)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert sum(h.get("sample/dropped_stale_total", 0) for h in logs) == 8
    if loss_type == "grpo":  # TRL's own loss and metrics, untouched
        assert "ratio" in logs[0] and not any(k.startswith("gspo/") for k in logs[0])
    else:
        ages = [sorted(k.rsplit("_", 1)[1] for k in h if k.startswith("gspo/clipped_sequence_fraction/")) for h in logs]
        assert ages == [["1"], ["2"]]
        assert {"gspo/ratio_mean", "gspo/clipped_token_fraction", "policy_loss", "aux_loss"} <= set(logs[0])
    summary = capsys.readouterr().out
    assert "trl-gspo run summary" in summary and "reward first -> last:  1.500 -> 1.500" in summary, summary
    assert ("clipped by age:        1 version(s) old" in summary) == (loss_type != "grpo")
    assert (tmp_path / "training_curves.png").stat().st_size > 0


def test_config_presets_and_refusals(tmp_path):
    gspo = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True)  # the band set by the run, from the paper's
    assert (gspo.loss_type, gspo.epsilon, gspo.epsilon_high, gspo.clip_band, gspo.staleness_correction) == (
        "gspo", EPS_LOW, EPS_HIGH, "adaptive", "none")
    assert gspo.presets == {"clip_band": "adaptive", "epsilon": EPS_LOW, "epsilon_high": EPS_HIGH}
    kept = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, epsilon=3e-2, epsilon_high=4e-2)
    assert (kept.epsilon, kept.epsilon_high, kept.clip_band) == (3e-2, 4e-2, "fixed")  # a band given is kept
    assert kept.presets == {"clip_band": "fixed"}
    paper = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, clip_band="fixed")  # the paper's, by name
    assert (paper.epsilon, paper.epsilon_high, paper.clip_band) == (EPS_LOW, EPS_HIGH, "fixed")
    trl = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="grpo")
    assert (trl.epsilon, trl.epsilon_high, trl.clip_band, trl.presets) == (0.2, None, "fixed", {})
    # the decoupled objective bounds a ratio that is 1 by construction: the band stays fixed, and 'adaptive' is refused
    decoupled = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, staleness_correction="truncate")
    assert (decoupled.clip_band, decoupled.epsilon, decoupled.epsilon_high) == ("fixed", EPS_LOW, EPS_HIGH)
    # a cap delta is set against a band the user knows: the paper's, fixed (the adaptive band could widen past it)
    capped = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, delta=1.1)
    assert (capped.clip_band, capped.epsilon, capped.epsilon_high, capped.delta) == ("fixed", EPS_LOW, EPS_HIGH, 1.1)
    with pytest.raises(ValueError, match="`delta`.*Fix: set clip_band='fixed'"):  # asked for: the fix names both
        AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, clip_band="adaptive", delta=1.1)
    refusals = [(dict(loss_type="dapo"), "loss_type"), (dict(loss_type="grpo", delta=1.5), "delta"),
                (dict(delta=1.0001), "delta"), (dict(epsilon=1.5), "epsilon"), (dict(epsilon_high=-1.0), "epsilon_high"),
                (dict(max_staleness=-1), "max_staleness"), (dict(staleness_correction="clip"), "staleness_correction"),
                (dict(loss_type="grpo", staleness_correction="truncate"), "staleness_correction"),
                (dict(staleness_weight_cap=1.0), "staleness_weight_cap"),
                (dict(loss_type="grpo", clip_band="adaptive"), "clip_band"),
                (dict(staleness_correction="mask", clip_band="adaptive"), "clip_band"),
                (dict(clip_band="adaptive", delta=1.1), "delta")]
    for options, option in refusals:
        with pytest.raises(ValueError, match=f"`{option}`.*Fix"):
            AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, **options)
    # a wrong type is a TypeError naming the field, as in GSPOConfig (trl_gspo/config.py `_check_types`)
    for options, option in [(dict(epsilon="3e-4"), "epsilon"), (dict(staleness_weight_cap="2"), "staleness_weight_cap"),
                            (dict(delta=True), "delta")]:
        with pytest.raises(TypeError, match=f"`{option}` must be .*Fix"):
            AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, **options)
        if option != "staleness_weight_cap":  # the synchronous config has no such field
            with pytest.raises(TypeError, match=f"`{option}` must be .*Fix"):
                GSPOConfig(output_dir=str(tmp_path), use_cpu=True, **options)


ASYNC_RECIPE = """trainer: async
model_name_or_path: {model}
dataset_name: {dataset}
reward_funcs: [think_format_reward]
vllm_server_base_url: {url}
output_dir: {out}
"""


@pytest.mark.parametrize("change,option", [
    (dict(), None),
    (dict(url="gen:8000"), "vllm_server_base_url"),
    (dict(model="builtin:tiny-qwen3-moe"), "trainer: async"),
    (dict(extra="failed_tool_credit: -0.5\n"), "failed_tool_credit"),
    (dict(extra="trainer: later\n"), "trainer"),
    (dict(extra="steps_per_generation: 4\n"), "steps_per_generation"),  # a GSPOConfig key, not AsyncGSPOConfig's
])
def test_async_recipes_resolve_into_async_gspo_config_or_are_refused(tmp_path, capsys, monkeypatch, change, option):
    from trl_gspo.launch.cli import main

    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: None)
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    fields = dict(model="Qwen/Qwen3-0.6B", dataset="trl-lib/DeepMath-103K", url="http://gen:8000",
                  out=tmp_path / "o", extra="")
    fields.update(change)
    text = ASYNC_RECIPE.format(**fields) + fields["extra"]
    if "trainer: later" in text:
        text = text.replace("trainer: async\n", "")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    code = main(["--config", str(recipe), "--dry_run", "true"])
    out, err = capsys.readouterr()
    if option is None:
        assert code == 0 and "AsyncGSPOTrainer" in out and "max_staleness=4" in out and "recipe is valid" in out
    else:
        assert code == 2 and f"`{option}" in err and ("Fix" in err or "unknown key" in err), err


@pytest.mark.parametrize("loss_type,banded", [("gspo", True), ("luspo", True), ("sapo", False), ("grpo", False)])
def test_an_async_recipes_dry_run_names_the_band_of_every_loss_that_clips_the_sequence_ratio(
        tmp_path, capsys, monkeypatch, loss_type, banded):
    """LUSPO clips GSPO's sequence ratio under AsyncGSPOTrainer, with GSPO's band: its dry run says which band runs,
    as a gspo recipe's does; a loss without that clip gets no band line."""
    from trl_gspo.launch.cli import main

    monkeypatch.setattr("trl_gspo.launch.checks._probe_dataset", lambda key, path, config: None)
    monkeypatch.setattr("trl_gspo.launch.checks._probe_model", lambda key, name: None)  # hub model, offline
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(ASYNC_RECIPE.format(model="Qwen/Qwen3-0.6B", dataset="trl-lib/DeepMath-103K",
                                          url="http://gen:8000", out=tmp_path / "o") + f"loss_type: {loss_type}\n")
    assert main(["--config", str(recipe), "--dry_run", "true"]) == 0
    band = [line for line in capsys.readouterr().out.splitlines() if line.startswith("clip band:")]
    assert len(band) == banded
    if banded:
        assert "clipped to" in band[0]


def test_async_recipes_end_with_the_run_summary_and_curves(monkeypatch, tmp_path):
    """`trainer: async` builds AsyncGSPOTrainer with the synchronous trainer's RunReportCallback (`plot` as set)."""
    import trl_gspo.async_trainer
    from trl_gspo.launch import train
    from trl_gspo.launch.reporting import RunReportCallback

    built = {}

    class Recorded:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def train(self, resume_from_checkpoint=None):
            pass

        save_model = save_state = lambda self, *args: None

    monkeypatch.setattr(trl_gspo.async_trainer, "AsyncGSPOTrainer", Recorded)
    args = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    model_args = type("ModelArgs", (), {"model_revision": "main", "use_peft": False})()
    train._run_async("some/model", [], args, model_args, toy_dataset(4), {}, plot=False)
    (callback,) = built["callbacks"]
    assert isinstance(callback, RunReportCallback) and callback.plot is False


class _KeptWeights(NoWeightTransfer):
    """Keeps a copy of every tensor a weight sync sends."""

    def __init__(self):
        self.syncs = []

    def send_weights(self, weights):
        self.syncs.append({name: tensor.clone() for name, tensor in weights})


@pytest.mark.parametrize("exact", [True, False])
def test_lora_weight_syncs_keep_a_bf16_base_bitwise_frozen(tiny_moe_dir, tokenizer, tmp_path, exact):
    """TRL's merged weight sync with LoRA on attention and experts over a bf16 base, the adapters moving between
    syncs: with `exact_lora_merge` the base is bit for bit unchanged after 10 syncs and each sync sends the folded
    weights; with TRL's in-place merge and unmerge (False) the base drifts."""
    from peft import LoraConfig

    from trl_gspo.lora_merge import merged_adapters

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, token_budget=0,
                           per_device_train_batch_size=6, num_generations=4, save_strategy="no", disable_tqdm=True,
                           exact_lora_merge=exact, model_init_kwargs={"dtype": torch.bfloat16})
    transfer = _KeptWeights()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = AsyncGSPOTrainer(model=str(tiny_moe_dir), reward_funcs=[], args=args, train_dataset=toy_dataset(4),
                               processing_class=tokenizer, rollout_worker=QueueWorker(), weight_transfer=transfer,
                               peft_config=lora)
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        with torch.no_grad():
            for param in adapters:
                param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 1e-2)
        trainer._sync_weight()
    changed = [n for n, p in model.named_parameters() if n in base and not torch.equal(p, base[n])]
    if not exact:
        assert len(changed) >= 4  # TRL 1.16 + PEFT: the frozen base moves
        return
    assert changed == [] and trainer.model_version == 10
    with merged_adapters(model):
        folded = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach().clone()
                  for n, p in model.named_parameters() if "lora_" not in n}
    last = transfer.syncs[-1]
    assert last.keys() == folded.keys()
    assert all(torch.equal(last[name], folded[name]) for name in last)


def test_the_adaptive_clip_band_moves_with_the_clipped_share(tiny_moe_dir, tokenizer, tmp_path):
    """clip_band="adaptive" in AsyncGSPOTrainer: samples a version old and far from the trainer (the queued log-probs
    are a constant) clip every sequence whose advantage makes the clip bind, so the band widens after each step by the
    rule (docs/gspo.md: log epsilon moves by 0.15 (c - 0.15) / 0.15, at most log 2), and each step logs the band it
    trained with and the share it read."""
    trainer = _trainer(tiny_moe_dir, tokenizer, tmp_path, _rollout_samples([0] * 8), max_steps=2,
                       per_device_train_batch_size=8, max_staleness=4, clip_band="adaptive")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    bands = [h["gspo/clip_epsilon_low"] for h in logs]
    shares = [h["gspo/clip_band_clipped_fraction"] for h in logs]
    assert len(bands) == 2 and all(share > 0.15 for share in shares)

    def documented(epsilon, share):
        return epsilon * math.exp(min(0.15 * (share - 0.15) / 0.15, math.log(2)))

    assert bands == pytest.approx([EPS_LOW, documented(EPS_LOW, shares[0])], rel=1e-6)  # step 1: the starting band
    expected = documented(bands[1], shares[1])
    assert (trainer.epsilon_low, trainer.epsilon_high) == pytest.approx((expected, expected * 4 / 3), rel=1e-6)


def test_samples_of_the_weights_held_set_the_noise_floor(tiny_moe_dir, tokenizer, tmp_path):
    """Step 1 trains samples of the version the trainer holds, synced to the sampler at start (age 0): their ratio is
    the sampler's gap, not movement. The band reads no share from them and rises above that gap (the floor, logged);
    samples older than the weights held count as movement."""
    trainer = _trainer(tiny_moe_dir, tokenizer, tmp_path, _rollout_samples([1] * 4), max_steps=1,
                       per_device_train_batch_size=8, max_staleness=4, clip_band="adaptive")
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert "gspo/clip_band_clipped_fraction" not in log and log["gspo/clip_epsilon_low"] == EPS_LOW
    assert log["gspo/clip_band_noise_floor"] == 0.0  # the floor step 1 trained with; measured in it
    assert trainer._adaptive_band.noise_floor > 0.01 and trainer.epsilon_low == trainer._adaptive_band.noise_floor


def test_the_startup_line_names_the_band(tiny_moe_dir, tokenizer, tmp_path, caplog):
    """AsyncGSPOTrainer says at start which clip band it trains with, as GSPOTrainer does."""
    import logging

    with caplog.at_level(logging.INFO, logger="trl_gspo.async_trainer"):
        _trainer(tiny_moe_dir, tokenizer, tmp_path / "fixed")
        _trainer(tiny_moe_dir, tokenizer, tmp_path / "adaptive", clip_band="adaptive")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AsyncGSPOTrainer, loss_type=")]
    assert len(lines) == 2
    assert "clipped to [0.9997, 1.0004] (clip_band='fixed': the GSPO paper's band)" in lines[0]
    assert "a band set by the run (clip_band='adaptive'): from [0.9997, 1.0004]" in lines[1]
    assert all("pi_old is the sampler's log-probs" in line and "max_staleness=" in line for line in lines)
