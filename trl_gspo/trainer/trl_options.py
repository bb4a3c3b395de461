"""TRL's loss options, applied to the gspo per-token loss exactly as TRL's `loss_type="grpo"` applies them:
the off-policy sequence mask, the top-entropy token mask, vLLM importance-sampling correction and the KL term
(docs/trl_contract.md lists each and its parity test). Reads the options from the trainer's TRL state."""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from ..losses import k3_kl, sequence_log_ratio


def apply_trl_options(trainer, inputs: dict, per_token_loss, logps, old_logps, entropies, mask):
    """`(per_token_loss, entropy_mask or None, per_token_kl or None)` with every enabled option applied."""
    if trainer.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_keep(inputs, logps, old_logps, mask,
                                                          trainer.off_policy_mask_threshold)
    entropy_mask = None
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        per_token_loss = per_token_loss * entropy_mask
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
    per_token_kl = None
    if trainer.beta != 0.0:
        per_token_kl = k3_kl(logps, inputs["ref_per_token_logps"])
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * torch.exp(sequence_log_ratio(logps, old_logps, mask))[:, None]
        per_token_loss = per_token_loss + trainer.beta * per_token_kl
    return per_token_loss, entropy_mask, per_token_kl


def off_policy_keep(inputs: dict, logps, old_logps, mask, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2), `(B, 1)`: drop negative-advantage sequences whose sampling
    policy drifted more than `threshold` (mean per-token KL), measured against the sampler's log-probs when the
    batch has them, else the old policy's."""
    advantages = inputs["advantages"]
    if advantages.dim() == 2 and advantages.shape[1] > 1:
        raise ValueError(
            "`off_policy_mask_threshold` keeps or drops whole sequences by the sign of their advantage, which "
            "per-token advantages do not define. Fix: unset `off_policy_mask_threshold`."
        )
    return GRPOTrainer.get_off_policy_mask(
        advantages=advantages.reshape(-1, 1), per_token_logps=logps,
        sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logps), mask=mask,
        off_policy_threshold=threshold,
    )
