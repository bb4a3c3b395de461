"""The asynchronous trainer's reference episodes and checks, shared by tests/test_async_trainer.py and
tests/test_async_routing.py: the episodes (prompts, completions with their tool-result masks, advantages), their
float64 log-probs and TRL queue samples, the comparison with the float64 reference, and one optimizer step as
transformers' loop runs it under TRL's token-budget batcher."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher

from trl_gspo.async_trainer.trainer import _VersionedRolloutCollator

# Two prompts; completions of the first share their first tokens (the trie forks inside the completion), one holds
# a tool result (context, mask 0) between its policy tokens, one is a single token. (prompt, completion, mask, A).
EPISODES = [
    (0, [11, 12, 13, 14, 15], [1, 1, 1, 1, 1], 1.0),
    (0, [11, 12, 20, 21, 22, 23], [1, 1, 1, 1, 1, 1], -0.8),
    (0, [30, 31, 40, 41, 32, 33], [1, 1, 0, 0, 1, 1], 0.6),
    (0, [17], [1], -1.1),
    (1, [25, 26, 27], [1, 1, 1], 0.9),
    (1, [25, 28, 29, 30], [1, 1, 1, 1], -0.4),
]
PROMPTS = [[5, 6, 7, 8, 9, 10], [6, 6, 7, 9]]
# Sampler log-prob offsets per completion: inside GSPO's band, below it, above it (log ratio ~ -offset).
OFFSETS = [0.0, 1e-3, -1e-3, 2e-3, -2e-3, 0.0]


@torch.no_grad()
def reference_logps(tiny_moe_dir):
    """log pi(y_t) of every completion token, float64, one episode at a time (a plain forward, eager attention)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")
    out = []
    for prompt, completion, _, _ in EPISODES:
        ids = torch.tensor([PROMPTS[prompt] + completion])
        logps = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(logps[len(PROMPTS[prompt]) - 1:])
    return out


def episode_samples(tiny_moe_dir):
    """The episodes as TRL's queue reader yields them (plus `model_version`); pi_old: the float64 log-probs plus the
    offsets."""
    samples = []
    for (prompt, completion, mask, advantage), logps, offset in zip(EPISODES, reference_logps(tiny_moe_dir), OFFSETS):
        ids = PROMPTS[prompt] + completion
        full_mask = [0] * len(PROMPTS[prompt]) + mask
        old = [0.0] * len(PROMPTS[prompt]) + [float(lp) + offset if m else 0.0 for lp, m in zip(logps, mask)]
        samples.append({"input_ids": np.array(ids), "completion_mask": np.array(full_mask),
                        "old_log_probs": np.array(old, dtype=np.float32), "advantage": advantage,
                        "group_id": prompt, "metrics": {}, "model_version": 0})
    return samples


def assert_matches_reference(loss, grads, expected, reference):
    """The trainer's loss and gradients `grads` (name -> tensor) equal the float64 reference's: `expected` (its loss,
    not yet backpropagated) and every gradient of `reference`, to float32 rounding scaled by the largest gradient.
    Returns the reference's gradients by name."""
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    expected_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    scale = max(g.abs().max().item() for g in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name].double(), grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    return expected_grads


def token_budget_step(trainer, samples, budget, route_shape=None):
    """One optimizer step's forward and backward as transformers' loop runs it: TRL's token-budget batcher plans the
    micro-batches (completions per micro-batch follow their lengths), `get_batch_samples` fetches them all, then one
    `training_step` each. Returns the summed loss, the accumulated gradients and the completions per micro-batch."""
    flush = {"input_ids": np.arange(100, 100 + budget), "completion_mask": np.ones(budget, dtype=int),
             "old_log_probs": np.zeros(budget, dtype=np.float32), "advantage": 0.0, "group_id": 99, "metrics": {},
             "model_version": 0}  # fits only alone: closes the last planned micro-batch, never trained itself
    planned = list(TokenBudgetBatcher([*samples, flush], 1, budget, defaultdict(list)))
    collator = _VersionedRolloutCollator(pad_token_id=0, num_processes=1, route_shape=route_shape)
    batches, _ = trainer.get_batch_samples(iter([collator([rows]) for rows in planned]), len(planned), "cpu")
    trainer.current_gradient_accumulation_steps = len(batches)
    trainer._policy_version = 0
    trainer.model.train()
    trainer.model.zero_grad()
    loss = sum(trainer.training_step(trainer.model, batch).detach() for batch in batches)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss, grads, [len(rows[0].samples) for rows in planned]
