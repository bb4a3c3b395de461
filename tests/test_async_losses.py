"""TRL 1.16's successors of GSPO in `AsyncGSPOTrainer`: "luspo", "sapo", "cispo", "vespo" on TRL's packed rows
(`trl_gspo.losses.packed_policy_loss`, normalised by `step_loss`), against TRL's own `GRPOTrainer._compute_loss`.

The reference is TRL's code itself, called unbound on a minimal object (`_TRLLoss`) that holds what `_compute_loss`
reads and returns the test's float64 log-probs from its forward: the same completions in TRL's padded
`[batch, length]` layout with a completion mask, as one batch on one process with no gradient accumulation. What
each loss type normalises by there, and what the asynchronous trainer takes over an optimizer step instead:

    luspo, sapo     a plain mean over the batch's completions (luspo: of each one's token sum, |y_i| x GSPO's term;
                    sapo: of each one's token mean)           -> the step's completions (`global_n_sequences`)
    cispo, vespo    `num_items_in_batch`, the batch's loss tokens, over processes x steps_per_generation / GA
                    (= this step's tokens)                  -> the step's trained tokens (`global_n_tokens`)

so the packed loss, summed over the rows (ranks, micro-batches) the completions were split into, each row's share
divided by the whole step's count (`step_loss`), is TRL's loss on the whole batch, however the completions were packed.
Value and gradient w.r.t. each token's log-prob, float64, to 1e-6 (`assert_same`). TRL's level per loss type is its
default: "token" ratios (sapo, cispo; vespo computes its own sequence weight), "sequence" for luspo (TRL warns
otherwise). The trainer's side of the wiring (`AsyncGSPOTrainer._loss_options`: config -> loss options) is the one the
parity runs through; its normalisation over unequal micro-batches and R3 run on the tiny MoE at the end."""

import copy
import dataclasses
import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import async_stand_ins
from support.async_stand_ins import NoWeightTransfer, QueueWorker
from support.helpers import toy_dataset

async_stand_ins.install()

from support.async_reference import episode_samples, token_budget_step
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.async_grpo.packing import TreeRow

from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer
from trl_gspo.async_trainer.trainer import (
    _VersionedRolloutCollator,
    async_setup_summary,
)
from trl_gspo.losses import packed_policy_loss, step_loss

NEW_LOSSES = ("luspo", "sapo", "cispo", "vespo")
TOLERANCE = 1e-6


def _options(**given):
    """The config fields the losses read (AsyncGSPOConfig's names, which are TRL's), TRL's defaults unless given."""
    names = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
             "vespo_lambda_neg")
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in names}
    return SimpleNamespace(**{**fields, **given})


class _TRLLoss:
    """What `GRPOTrainer._compute_loss` reads from `self`, no more: one process, no accumulation, no KL, no entropy
    mask or bonus, no vLLM correction; its forward returns the test's log-probs."""

    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

    def __init__(self, loss_type, logps, args, eps_low, eps_high):
        self.loss_type, self._logps, self.args = loss_type, logps, SimpleNamespace(**vars(args), steps_per_generation=1)
        self.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
        self.epsilon_low, self.epsilon_high = eps_low, eps_high
        self.beta, self.top_entropy_quantile, self.off_policy_mask_threshold, self.use_vllm = 0.0, 1.0, None, False
        self._entropy_bonus_enabled = self.aux_loss_enabled = False
        self.model, self.current_gradient_accumulation_steps = SimpleNamespace(training=True), 1
        self.accelerator = SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t)
        self._metrics = {"train": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self._logps, torch.zeros_like(self._logps), None


def _band(loss_type, eps_low, eps_high):
    """(epsilon_low, epsilon_high) as the trainer holds them: the band given for the losses with a hard clip, TRL's
    default 0.2 (unread) for the others."""
    return (eps_low, eps_high) if loss_type in ("luspo", "cispo") else (0.2, 0.2)


def trl_loss(loss_type, batch, args, eps_low, eps_high):
    """TRL's loss on the completions padded into `[batch, length]`, and its gradient per completion's token."""
    logps, old, advantages = batch
    width = max([len(seq) for seq in logps] + [1])
    padded = torch.zeros(len(logps), width, dtype=torch.float64)
    old_padded, mask = torch.zeros_like(padded), torch.zeros(len(logps), width, dtype=torch.long)
    for i, (seq, old_seq) in enumerate(zip(logps, old)):
        padded[i, :len(seq)] = torch.tensor(seq, dtype=torch.float64)
        old_padded[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(old_seq, dtype=torch.float64), 1
    leaf = padded.requires_grad_()
    host = _TRLLoss(loss_type, leaf, args, *_band(loss_type, eps_low, eps_high))
    inputs = {"prompt_ids": torch.zeros(len(logps), 1, dtype=torch.long), "prompt_mask": torch.ones(len(logps), 1),
              "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "old_per_token_logps": old_padded,
              "advantages": torch.tensor(advantages, dtype=torch.float64), "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(host, None, inputs)
    loss.backward()
    return loss.detach(), [leaf.grad[i, :len(seq)] for i, seq in enumerate(logps)]


def packed_loss(loss_type, batch, args, eps_low, eps_high, rows, orders):
    """Ours: completion i in packed row `rows[i]`, each row's targets in the order `orders[row]` (a permutation of its
    targets, completions interleaved); each row's `step_loss` share of the whole batch's counts, summed. Options from
    the config through the trainer's own `_loss_options`."""
    logps, old, advantages = batch
    low, high = _band(loss_type, eps_low, eps_high)
    trainer = SimpleNamespace(loss_type=loss_type, args=args, epsilon_low=low, epsilon_high=high)
    options = AsyncGSPOTrainer._loss_options(trainer)
    completions, tokens = len(logps), sum(len(seq) for seq in logps)
    total, grads = 0.0, [torch.zeros(len(seq), dtype=torch.float64) for seq in logps]
    for row in sorted(set(rows)):
        members = [i for i in range(len(logps)) if rows[i] == row]
        targets = [(segment, i, t) for segment, i in enumerate(members) for t in range(len(logps[i]))]
        targets = [targets[k] for k in orders[row]]
        leaf = torch.tensor([logps[i][t] for _, i, t in targets], dtype=torch.float64).requires_grad_()
        out = packed_policy_loss(
            loss_type, leaf, torch.tensor([old[i][t] for _, i, t in targets], dtype=torch.float64),
            torch.tensor([advantages[i] for _, i, _ in targets], dtype=torch.float64),
            torch.tensor([segment for segment, _, _ in targets], dtype=torch.long), num_segments=len(members),
            **options)
        share = step_loss(out, completions, tokens)
        share.backward()
        total = total + share.detach()
        for (_, i, t), grad in zip(targets, leaf.grad if leaf.grad is not None else []):
            grads[i][t] = grad
    return torch.as_tensor(total, dtype=torch.float64), grads, out


def assert_same(ours, theirs):
    (loss, grads), (ref_loss, ref_grads) = ours, theirs
    torch.testing.assert_close(loss, ref_loss, rtol=TOLERANCE, atol=TOLERANCE)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=TOLERANCE, atol=TOLERANCE)


def _fixed_batch():
    """Six completions (one empty, one of a single token); per completion a log-ratio shift (sequence ratios inside,
    below and above LUSPO's band [0.95, 1.08]) plus per-token noise (token ratios on both sides of CISPO's cap 1.1)."""
    generator = torch.Generator().manual_seed(0)
    lengths, shifts = [5, 1, 7, 0, 3, 4], [0.0, -0.2, 0.15, 0.0, 0.3, -0.02]
    advantages = [1.0, -0.5, 0.7, 0.3, -1.2, 0.9]
    logps, old = [], []
    for length, shift in zip(lengths, shifts):
        new = -torch.rand(length, generator=generator, dtype=torch.float64) * 3
        noise = (torch.rand(length, generator=generator, dtype=torch.float64) - 0.5) * 0.5
        logps.append(new.tolist())
        old.append((new - shift - noise).tolist())
    return logps, old, advantages


def _packings(n, seed=0):
    """Row assignments and per-row target orders: one row in completion order, one row interleaved, a row per
    completion, and two / three rows interleaved."""
    generator = np.random.default_rng(seed)
    return {"one row": [0] * n, "one row, interleaved": [0] * n, "a row each": list(range(n)),
            "two rows": [i % 2 for i in range(n)], "three rows": [(i * 2) % 3 for i in range(n)]}, generator


@pytest.mark.parametrize("loss_type,delta", [("luspo", None), ("luspo", 1.2), ("sapo", None), ("cispo", None),
                                             ("vespo", None)])
def test_each_loss_equals_trls_on_every_packing(loss_type, delta):
    """TRL's defaults for each option (LUSPO's band 0.05 / 0.08, without and with a cap delta; CISPO's cap 1.1): the
    same batch packed five ways gives TRL's loss and gradients; the clip acts on both sides where there is one."""
    batch = _fixed_batch()
    eps_low, eps_high = (0.05, 0.08) if loss_type == "luspo" else (0.2, 1.1)
    args = _options(delta=delta)
    reference = trl_loss(loss_type, batch, args, eps_low, eps_high)
    rows_by_name, generator = _packings(len(batch[0]))
    for name, rows in rows_by_name.items():
        sizes = {row: sum(len(batch[0][i]) for i in range(len(rows)) if rows[i] == row) for row in set(rows)}
        orders = {row: (list(range(size)) if name == "one row" else generator.permutation(size).tolist())
                  for row, size in sizes.items()}
        loss, grads, out = packed_loss(loss_type, batch, args, eps_low, eps_high, rows, orders)
        assert_same((loss, grads), reference)
    if loss_type in ("luspo", "cispo"):  # one row holds every completion: its clip indicators cover the batch
        out = packed_loss(loss_type, batch, args, eps_low, eps_high, [0] * 6, {0: list(range(20))})[2]
        clipped = out.low_clipped | out.high_clipped
        assert 0 < int(clipped.any(-1).sum()) < 5  # some completions clipped, some not
        assert loss_type == "cispo" or (out.low_clipped.any() and out.high_clipped.any())
        assert bool(out.delta_clipped.any()) == (delta is not None)  # the cap binds on the fifth completion


def _float32_exact(low, high):
    """Values TRL keeps exactly: it builds the per-sign temperatures / k / lambda as float32 tensors (`torch.where` on
    Python floats), and a float64 value off the float32 grid would differ there by its rounding, not by the loss."""
    return st.integers(int(low * 16), int(high * 16)).map(lambda k: k / 16)


@st.composite
def _cases(draw):
    loss_type = draw(st.sampled_from(NEW_LOSSES))
    n = draw(st.integers(1, 6))
    lengths = [draw(st.integers(0, 6)) for _ in range(n)]
    logps = [[draw(st.floats(-5.0, -1e-3)) for _ in range(length)] for length in lengths]
    shift = [draw(st.floats(-0.4, 0.4)) for _ in range(n)]
    old = [[lp - shift[i] - draw(st.floats(-0.4, 0.4)) for lp in seq] for i, seq in enumerate(logps)]
    advantages = [draw(st.one_of(st.just(0.0), st.floats(-3.0, 3.0))) for _ in range(n)]
    eps_low, eps_high = draw(st.floats(1e-3, 0.5)), draw(st.floats(1e-3, 0.5))
    if loss_type == "cispo":
        eps_high = draw(st.floats(0.5, 2.0))
    delta = None
    if loss_type == "luspo" and draw(st.booleans()):
        delta = 1.0 + eps_high + draw(st.floats(1e-3, 0.3))
    args = _options(delta=delta, sapo_temperature_pos=draw(_float32_exact(0.0625, 4)),
                    sapo_temperature_neg=draw(_float32_exact(0.0625, 4)), vespo_k_pos=draw(_float32_exact(0, 5)),
                    vespo_lambda_pos=draw(_float32_exact(0.0625, 5)), vespo_k_neg=draw(_float32_exact(0, 5)),
                    vespo_lambda_neg=draw(_float32_exact(0.0625, 5)))
    rows = [draw(st.integers(0, n - 1)) for _ in range(n)]
    orders = {row: draw(st.permutations(range(sum(lengths[i] for i in range(n) if rows[i] == row))))
              for row in set(rows)}
    return loss_type, (logps, old, advantages), args, eps_low, eps_high, rows, orders


@given(case=_cases())
def test_any_packing_of_any_batch_gives_trls_loss_and_gradients(case):
    loss_type, batch, args, eps_low, eps_high, rows, orders = case
    loss, grads, _ = packed_loss(loss_type, batch, args, eps_low, eps_high, rows, orders)
    assert_same((loss, grads), trl_loss(loss_type, batch, args, eps_low, eps_high))


# ---------------------------------------------------------------- the config: options, presets, refusals
def test_trls_options_are_accepted_with_grpo_configs_defaults_and_help(tmp_path):
    trl_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    ours = {f.name: f for f in dataclasses.fields(AsyncGSPOConfig)}
    for name in _options().__dict__:
        if name != "delta":
            assert (ours[name].default, ours[name].metadata["help"]) == (trl_fields[name].default,
                                                                         trl_fields[name].metadata["help"])
    config = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vespo_k_neg=2.5)
    assert config.vespo_k_neg == 2.5
    for loss_type in ("luspo", "sapo", "cispo", "vespo"):
        config = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type=loss_type)
        expected = {"luspo": (3e-4, 4e-4, "adaptive"), "cispo": (0.2, 5.0, "fixed")}.get(loss_type,
                                                                                        (0.2, None, "fixed"))
        assert (config.epsilon, config.epsilon_high, config.clip_band) == expected, loss_type
    assert AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="cispo").presets == {"epsilon_high": 5.0}
    assert AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="cispo", epsilon_high=2.0).presets == {}
    band = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="luspo", epsilon=0.01, delta=1.5)
    assert (band.epsilon, band.epsilon_high, band.delta, band.clip_band) == (0.01, 4e-4, 1.5, "fixed")  # as gspo's


SOFT = {"sapo": ("a temperature-controlled sigmoid gate", "sapo_temperature_pos / sapo_temperature_neg"),
        "vespo": ("a Gamma weight of the sequence ratio",
                  "vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg")}
CISPO_WHY = ("loss_type='cispo' has one hard clip, a cap on each token's importance weight at epsilon_high (TRL's "
             "CISPO): no lower edge, no sequence band, no two-sided cap.")


def _no_hard_clip(loss_type, option):
    bound, tune = SOFT[loss_type]
    return (f"`{option}`: loss_type={loss_type!r} has no hard clip ({bound} bounds the update instead), so {option} "
            f"would be ignored. Fix: leave clip_band, epsilon, epsilon_high and delta unset; tune {tune}.")


REFUSALS = [
    ({"loss_type": "sapo", "clip_band": "adaptive"}, _no_hard_clip("sapo", "clip_band")),
    ({"loss_type": "sapo", "epsilon": 0.1}, _no_hard_clip("sapo", "epsilon")),
    ({"loss_type": "vespo", "epsilon_high": 0.3}, _no_hard_clip("vespo", "epsilon_high")),
    ({"loss_type": "vespo", "clip_band": "adaptive"}, _no_hard_clip("vespo", "clip_band")),
    ({"loss_type": "vespo", "delta": 2.0}, _no_hard_clip("vespo", "delta")),
    ({"loss_type": "cispo", "epsilon": 0.1},
     f"`epsilon`: {CISPO_WHY} Fix: leave epsilon unset; set the cap with epsilon_high (unset: 5.0)."),
    ({"loss_type": "cispo", "clip_band": "adaptive"},
     f"`clip_band`: {CISPO_WHY} Fix: leave clip_band unset or fixed; set the cap with epsilon_high (unset: 5.0)."),
    ({"loss_type": "sapo", "sapo_temperature_neg": 0.0},
     "`sapo_temperature_neg` must be > 0, got 0.0. Fix: e.g. sapo_temperature_neg=1.05."),
    ({"loss_type": "vespo", "vespo_k_pos": -1.0}, "`vespo_k_pos` must be >= 0, got -1.0. Fix: e.g. vespo_k_pos=2.0."),
    ({"loss_type": "vespo", "vespo_lambda_neg": math.inf},
     "`vespo_lambda_neg` must be > 0, got inf. Fix: e.g. vespo_lambda_neg=2.0."),
    ({"loss_type": "luspo", "staleness_correction": "truncate"},
     ("`staleness_correction`: loss_type='luspo' has no decoupled form here. Fix: leave "
      "staleness_correction='none', or use loss_type='gspo'.")),
]


@pytest.mark.parametrize("options,message", REFUSALS,
                         ids=["-".join(f"{k}={v}" for k, v in options.items()) for options, _ in REFUSALS])
def test_options_a_loss_cannot_apply_are_refused_in_one_line(tmp_path, options, message):
    with pytest.raises(ValueError) as raised:
        AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, **options)
    assert str(raised.value) == message


def test_a_wrong_type_of_trls_options_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"^`sapo_temperature_pos` must be a number, got '1' \(str\)\. Fix"):
        AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="sapo", sapo_temperature_pos="1")


def test_luspo_takes_gspos_band_and_sapo_a_fixed_clip_band(tmp_path):
    adaptive = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="luspo", clip_band="adaptive")
    assert adaptive.clip_band == "adaptive"
    with pytest.raises(ValueError, match="^`delta`: 1.1 caps the sequence ratio"):  # as for gspo
        AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="luspo", clip_band="adaptive", delta=1.1)
    assert AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type="sapo", clip_band="fixed").clip_band == (
        "fixed")  # the only value TRL's types take: nothing to refuse


def test_the_startup_line_describes_each_loss(tmp_path):
    def line(**options):
        return async_setup_summary(AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, **options))

    assert ("GSPO's sequence term times the completion's length, one ratio per sequence, clipped to a band set by "
            "the run (clip_band='adaptive'): from [0.9997, 1.0004]") in line(loss_type="luspo")
    cispo = line(loss_type="cispo")
    assert "importance weight capped at epsilon_high=5 and detached" in cispo and "filled in" in cispo
    assert "epsilon_high=5.0" in cispo and "a mean over the step's tokens" in cispo
    sapo = line(loss_type="sapo", sapo_temperature_pos=0.5)
    assert "no hard clip" in sapo and "tau=0.5 for A > 0, 1.05 otherwise" in sapo and "epsilon" not in sapo
    vespo = line(loss_type="vespo")
    assert "no hard clip" in vespo and "k, lambda = 2, 3 for A >= 0; 3, 2 otherwise" in vespo
    assert all("pi_old is the sampler's log-probs" in text for text in (cispo, sapo, vespo))


# ---------------------------------------------------------------- the trainer: step normalisation and R3
LAYERS, TOP_K, EXPERTS = 2, 2, 4  # the tiny Qwen3-MoE (trl_gspo/quickstart/tiny_qwen3_moe.json)


def _prefix_routes(ids):
    """Routes of a sample's tokens, each a function of its prefix: samples sharing a prefix (the packed trie's shared
    positions) share its routes, so any split into micro-batches forces the same experts."""
    routes = np.zeros((len(ids) - 1, LAYERS, TOP_K), dtype=np.uint8)
    for p in range(len(ids) - 1):
        generator = np.random.default_rng(hash(tuple(ids[:p + 1])) % 2**32)
        routes[p] = [generator.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)]
    return routes


ROUTED = {"use_cpu": True, "report_to": "none", "max_steps": 1, "per_device_train_batch_size": 6,
          "num_generations": 4, "token_budget": 0, "logging_steps": 1, "save_strategy": "no",
          "router_aux_loss_coef": 0.0, "disable_tqdm": True, "routing_replay": "sampler"}


@pytest.fixture(scope="module")
def routed_trainer(tiny_moe_dir, tokenizer, tmp_path_factory):
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=str(tmp_path_factory.mktemp("r3")), loss_type="luspo", clip_band="fixed",
                           **ROUTED)
    return AsyncGSPOTrainer(model=str(tiny_moe_dir), args=args, train_dataset=toy_dataset(4), processing_class=tok,
                            rollout_worker=QueueWorker(), weight_transfer=NoWeightTransfer())


@pytest.fixture(scope="module")
def routed_samples(tiny_moe_dir):
    samples = episode_samples(tiny_moe_dir)
    for sample in samples:
        sample["routes"] = _prefix_routes(sample["input_ids"].tolist())
    return samples


# (loss type, band as the trainer holds it, whether to split the step): one loss of each normalisation is split
@pytest.mark.parametrize("loss_type,band,split", [("luspo", (1e-3, 2e-3), True), ("cispo", (0.2, 1.0005), True),
                                                  ("sapo", (0.2, 0.2), False), ("vespo", (0.2, 0.2), False)])
def test_r3_trains_each_loss_and_a_step_of_unequal_micro_batches_is_one_batch(routed_trainer, routed_samples,
                                                                            loss_type, band, split):
    """A tiny MoE trains with routing_replay="sampler" (R3: the sampler's routes forced) under each loss. For luspo
    (a mean over completions) and cispo (over tokens), one optimizer step of three micro-batches (2, 3 and 1
    completions, TRL's token-budget batcher) gives the loss and gradients of the same completions in one
    micro-batch: each micro-batch's share is taken over the step's completions or tokens, not its own (sapo and vespo
    share those two paths). One trainer for the four (building one takes seconds): its loss type and band are
    swapped as `__init__` sets them from a config of that loss type (TRL's defaults for the others)."""
    trainer, samples = routed_trainer, copy.deepcopy(routed_samples)
    trainer.args.loss_type, trainer.loss_type = loss_type, loss_type  # as `__init__` sets them (building a config
    trainer.epsilon_low, trainer.epsilon_high = band  # here would reset accelerate's state under the trainer)
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    batch = _VersionedRolloutCollator(pad_token_id=0, num_processes=1, route_shape=(LAYERS, TOP_K))([[row]])
    trainer._policy_version, trainer.current_gradient_accumulation_steps = 0, 1
    trainer._step_completions = trainer._step_tokens = None
    trainer._metrics["train"].clear()
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.training_step(trainer.model, batch)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    logged = trainer._metrics["train"]
    drifted, counted = logged["routing/replay_drift"][-1]
    assert counted > 0 and drifted > 0  # the sampler's routes replaced natural ones
    assert math.isfinite(loss.item()) and max(g.abs().max().item() for g in grads.values()) > 0
    clip_logged = "gspo/clipped_token_fraction" in logged
    assert clip_logged == (loss_type in ("luspo", "cispo"))  # the metrics of a hard clip, where there is one
    if clip_logged:
        clipped, tokens = logged["gspo/clipped_token_fraction"][-1]
        assert 0 < clipped < tokens  # the band / cap acted on some tokens, not all
    assert ("vespo/phi_seq_mean" in logged) == (loss_type == "vespo")
    if not split:
        return
    split_loss, split_grads, counts = token_budget_step(trainer, samples, budget=21, route_shape=(LAYERS, TOP_K))
    assert counts == [2, 3, 1]
    assert split_loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    scale = max(g.abs().max().item() for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
