"""R3 in the asynchronous trainer (trl_gspo/async_trainer/routing.py): a sequence's routes stitched from its turns, laid
out in TRL's packed order, and forced in `AsyncGSPOTrainer`'s training step. Exactness: the packed step's loss and every
parameter's gradient equal a float64 reference that scores each sample on its own (no packing) with the same routes
forced; the routes are random, so a position given another sample's route, or none, would show."""

import numpy as np
import pytest
import torch
from support.helpers import toy_dataset

from support import async_stand_ins
from support.async_stand_ins import NoWeightTransfer, QueueWorker

async_stand_ins.install()

from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_gspo import AsyncGSPOConfig, AsyncGSPOTrainer  # noqa: E402
from trl_gspo.async_trainer.routing import packed_routes, stitch_turn_routes  # noqa: E402
from trl_gspo.async_trainer.trainer import _VersionedRolloutCollator  # noqa: E402
from trl_gspo.routing.replay import RoutingReplay  # noqa: E402

from support.async_reference import (EPISODES, PROMPTS, assert_matches_reference, episode_samples,  # noqa: E402
                                     reference_logps, token_budget_step)

LAYERS, TOP_K, EXPERTS = 2, 2, 4  # the tiny Qwen3-MoE (trl_gspo/quickstart/tiny_qwen3_moe.json)


def _routes(length, seed):
    """Random routes `[length, layers, top_k]`: distinct experts per token and layer, as a router picks them."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(length * LAYERS)])
    return picks.reshape(length, LAYERS, TOP_K).to(torch.uint8).numpy()


def test_stitching_takes_each_position_from_the_first_turn_that_computed_it():
    turn1 = ([1, 2, 3], [4, 5], _routes(4, 0))  # prompt 1 2 3, sampled 4 5
    turn2 = ([1, 2, 3, 4, 5, 9, 9], [6], _routes(7, 1))  # + tool result 9 9, sampled 6
    sequence = [1, 2, 3, 4, 5, 9, 9, 6]
    stitched = stitch_turn_routes(sequence, [turn1, turn2])
    assert stitched.shape == (7, LAYERS, TOP_K)
    assert (stitched[:4] == turn1[2]).all()  # the prompt and turn 1's sampled tokens: turn 1's computation
    assert (stitched[4:] == turn2[2][4:]).all()  # turn 1's last token, the tool result: turn 2's prefill
    # A turn rewritten before the next (TRL's realign: a re-tokenized answer) covers only its matching prefix.
    realigned = [1, 2, 3, 7, 5, 9, 9, 6]
    turn2b = (realigned[:7], [6], _routes(7, 2))
    stitched = stitch_turn_routes(realigned, [turn1, turn2b])
    assert (stitched[:3] == turn1[2][:3]).all() and (stitched[3:] == turn2b[2][3:]).all()
    assert stitch_turn_routes(sequence, [turn1, (turn2[0], turn2[1], None)]) is None  # a turn without routes
    assert stitch_turn_routes(sequence, [turn1]) is None  # positions no turn computed
    with pytest.raises(ValueError, match="rows for"):
        stitch_turn_routes(sequence, [([1, 2, 3], [4, 5], _routes(3, 0))])


def test_packed_routes_follow_trls_packed_order():
    """Checked against TRL's own layout: with every token trained, TRL's `token_index` names, for sample i's target
    p, the packed position of its token p - 1; that position must hold sample i's route p - 1, or, where the
    position is shared, the route of the first sample through it."""
    samples = _samples_with_routes()
    for sample in samples:
        sample["completion_mask"] = np.array([0] + [1] * (len(sample["input_ids"]) - 1))
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    packed = row.pack()
    routes, routed = packed_routes(row, [s["routes"] for s in samples], LAYERS, TOP_K)
    assert routes.shape == (len(packed["input_ids"]), LAYERS, TOP_K)
    assert len(packed["input_ids"]) < sum(len(s["input_ids"]) for s in samples)  # some positions are shared
    for i, sample in enumerate(samples):
        positions = packed["token_index"][packed["segment_id"] == i]
        nodes = row.sample_nodes[i]
        assert len(positions) == len(nodes) - 1
        for p, position in enumerate(positions.tolist()):
            owner = min(j for j in range(len(samples)) if nodes[p] in row.sample_nodes[j][:-1])
            assert (routes[position].numpy() == samples[owner]["routes"][p]).all()
            assert routed[position]
    assert int(routed.sum()) == len({n for nodes in row.sample_nodes for n in nodes[:-1]})  # last tokens: unrouted


def _samples_with_routes():
    """The shared reference episodes (support.async_reference) with random routes per sample (prompts shared, first
    tokens shared)."""
    samples = []
    for i, (prompt, completion, mask, advantage) in enumerate(EPISODES):
        ids = PROMPTS[prompt] + completion
        samples.append({"input_ids": np.array(ids), "completion_mask": np.array([0] * len(PROMPTS[prompt]) + mask),
                        "old_log_probs": np.zeros(len(ids), dtype=np.float32), "advantage": advantage,
                        "group_id": prompt, "metrics": {}, "model_version": 0, "routes": _routes(len(ids) - 1, 10 + i)})
    return samples


@pytest.mark.parametrize("loss_type,budget", [("gspo", None), ("grpo", None), ("gspo", 21)])
def test_replayed_packed_step_matches_a_float64_reference_per_sample(tiny_moe_dir, tokenizer, tmp_path, loss_type,
                                                                     budget):
    """Routes forced at the right packed positions: loss and gradients of the packed training step equal a float64
    reference that forwards each sample alone with its own routes forced (shared prompt positions: the first
    sample's, which the reference also forces, as one prefix computation on the server would give them). With a
    token budget, the step is three micro-batches of 2, 3 and 1 completions, and the reference still the plain mean
    over all six."""
    import copy

    samples = episode_samples(tiny_moe_dir)
    for sample, routed in zip(samples, _samples_with_routes()):
        sample["routes"] = routed["routes"]
    # Shared positions must hold one route: give every sample the first owner's route for a shared prefix.
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    for i, sample in enumerate(samples):
        for j in range(i):
            shared = 0
            while (shared < len(row.sample_nodes[i]) - 1 and shared < len(row.sample_nodes[j]) - 1
                   and row.sample_nodes[i][shared] == row.sample_nodes[j][shared]):
                shared += 1
            sample["routes"][:shared] = samples[j]["routes"][:shared]

    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                           per_device_train_batch_size=6, num_generations=4, token_budget=0, logging_steps=1,
                           save_strategy="no", router_aux_loss_coef=0.0, disable_tqdm=True, loss_type=loss_type,
                           routing_replay="sampler", gradient_accumulation_steps=3 if budget else 1,
                           **(dict(epsilon=3e-4, epsilon_high=4e-4) if loss_type == "gspo" else {}))
    trainer = AsyncGSPOTrainer(model=str(tiny_moe_dir), args=args, train_dataset=toy_dataset(4), processing_class=tok,
                               rollout_worker=QueueWorker(), weight_transfer=NoWeightTransfer())
    if budget:
        for sample in samples:
            sample["routes"] = sample["routes"].copy()
        loss, grads, counts = token_budget_step(trainer, samples, budget, route_shape=(LAYERS, TOP_K))
        assert counts == [2, 3, 1]
    else:
        batch = _VersionedRolloutCollator(pad_token_id=0, num_processes=1, route_shape=(LAYERS, TOP_K))([[row]])
        trainer._policy_version = 0
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.zero_grad()
        loss = trainer.training_step(trainer.model, batch)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    logged = trainer._metrics["train"]
    drifted, counted = logged["routing/replay_drift"][-1]
    assert counted > 0 and drifted / counted > 0.3  # random routes: replay changed many of the natural ones

    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float64, attn_implementation="eager",
                                                     experts_implementation="eager")
    replay = RoutingReplay(reference)
    sampled = reference_logps(tiny_moe_dir)
    eps_low, eps_high = (3e-4, 4e-4) if loss_type == "gspo" else (0.2, 0.2)
    terms, token_terms = [], []
    for sample, (prompt, completion, mask, advantage), sampled_logps in zip(samples, EPISODES, sampled):
        ids = torch.tensor(sample["input_ids"])[None]
        routes = torch.cat([torch.from_numpy(sample["routes"]), torch.zeros(1, LAYERS, TOP_K, dtype=torch.uint8)])
        forced = torch.ones(1, ids.shape[1], dtype=torch.bool)
        forced[0, -1] = False
        with replay.replay(routes[None], forced):
            logits = reference(ids).logits
        logps = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0][len(PROMPTS[prompt]) - 1:]
        keep = torch.tensor(mask).bool()
        old = torch.from_numpy(sample["old_log_probs"][len(PROMPTS[prompt]):]).double()[keep]
        log_ratio = logps[keep] - old
        if loss_type == "gspo":
            ratio = torch.exp(log_ratio.mean())
            terms.append(torch.minimum(ratio * advantage, ratio.clamp(1 - eps_low, 1 + eps_high) * advantage))
        else:  # TRL's token loss: per-token clipped ratio, summed over all trained tokens / their count
            ratio = torch.exp(log_ratio)
            token_terms.append(torch.minimum(ratio * advantage, ratio.clamp(1 - eps_low, 1 + eps_high) * advantage))
    expected = -torch.stack(terms).mean() if terms else -torch.cat(token_terms).mean()
    assert_matches_reference(loss, grads, expected, reference)


def test_routing_replay_refuses_a_micro_batch_without_routes(tiny_moe_dir, tokenizer, tmp_path):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    args = AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, token_budget=0,
                           per_device_train_batch_size=6, num_generations=4, routing_replay="sampler",
                           disable_tqdm=True)
    trainer = AsyncGSPOTrainer(model=str(tiny_moe_dir), args=args, train_dataset=toy_dataset(4), processing_class=tok,
                               rollout_worker=QueueWorker(), weight_transfer=NoWeightTransfer())
    samples = episode_samples(tiny_moe_dir)
    for sample in samples:
        sample["routes"] = None
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    batch = _VersionedRolloutCollator(pad_token_id=0, num_processes=1, route_shape=(LAYERS, TOP_K))([[row]])
    trainer._policy_version = 0
    with pytest.raises(ValueError, match="trl-gspo vllm-serve"):
        trainer.training_step(trainer.model, batch)
