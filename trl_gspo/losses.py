"""GSPO policy losses as pure tensor functions.

Equation numbers refer to *Group Sequence Policy Optimization* (Zheng et al., arXiv 2507.18071).
Shapes: ``B`` completions (a group of ``G`` per prompt, several groups per batch), ``T`` completion
positions. ``mask`` is 1 on valid completion tokens and 0 on padding. Nothing here knows about TRL, so any
framework that has per-token log-probabilities can call these functions (VESPO's Gamma weight is passed in:
`vespo_loss` takes TRL's `GRPOTrainer.get_gamma_weights` from its caller).

All ratio arithmetic is done in at least float32, whatever the dtype of the log-probabilities: GSPO's clip
band (3e-4) is far below bf16 resolution (7.8e-3 near 1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "PolicyLossOutput",
    "check_finite",
    "nonfinite_counts",
    "raise_if_nonfinite",
    "sequence_log_ratio",
    "gspo_loss",
    "gspo_token_loss",
    "unpack_segments",
    "gspo_packed_loss",
    "behaviour_weights",
    "decoupled_gspo_loss",
    "WEIGHT_MODES",
    "k3_kl",
    "masked_sequence_mean",
    "masked_token_mean",
    "applied_entropy_coef",
    "adaptive_entropy_coef",
    "entropy_window_stats",
    "adaptive_clip_epsilon",
    "LOSS_REDUCTIONS",
    "luspo_loss",
    "sapo_loss",
    "cispo_loss",
    "vespo_loss",
    "packed_policy_loss",
    "step_loss",
]


@dataclass
class PolicyLossOutput:
    """What a GSPO loss function returns.

    Attributes:
        per_token_loss: ``(B, T)`` loss at each valid token, 0 elsewhere. For ``gspo`` every valid token of
            sequence ``i`` holds the sequence's loss, so its token mean is the sequence loss; this common form
            lets callers apply token weights (KL, entropy masks, rollout corrections) the same way for both.
        per_sequence_loss: ``(B,)`` loss of each completion, the token mean of ``per_token_loss``; the objective
            is ``per_sequence_loss.mean()`` (Eq. 5 and 13 are plain means over sequences). Completions with no
            valid token contribute 0.
        log_ratio: ``(B,)`` ``log s_i`` (Eq. 7), detached, float32 or wider. 0 for empty completions.
        low_clipped: ``(B, T)`` tokens whose objective is the clipped term on the low side
            (``s < 1 - eps_low`` and advantage < 0), restricted to valid tokens.
        high_clipped: ``(B, T)`` same on the high side (``s > 1 + eps_high`` and advantage > 0).
        delta_clipped: ``(B, T)`` tokens whose objective was capped by two-sided clipping (``s > delta`` and
            advantage < 0); all False without ``delta``.
        behaviour_log_weight: decoupled objective only (:func:`decoupled_gspo_loss`): ``(B,)`` ``log w_i``, the
            length-normalised log weight of the proximal policy against the behaviour policy; else None.
        behaviour_weight: decoupled objective only: ``(B,)`` the weight applied (truncated, or 0 where masked).
        weight_capped: decoupled objective only: ``(B,)`` completions whose weight the cap truncated or masked.
        reduction: how a batch's objective is taken from the per-completion losses (`step_loss`): ``"sequence"``, a
            plain mean of ``per_sequence_loss`` over completions; ``"token"`` (CISPO, VESPO), a mean of
            ``per_token_loss`` over the batch's valid tokens, ``per_sequence_loss`` then being each completion's
            token sum. LUSPO's ``per_sequence_loss`` is its length times GSPO's term (the token sum).
        gamma_weight: VESPO only: ``(B,)`` the Gamma weight ``phi(w_i)`` applied (detached); else None.
    """

    per_token_loss: torch.Tensor
    per_sequence_loss: torch.Tensor
    log_ratio: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    delta_clipped: torch.Tensor
    behaviour_log_weight: torch.Tensor | None = None
    behaviour_weight: torch.Tensor | None = None
    weight_capped: torch.Tensor | None = None
    reduction: str = "sequence"
    gamma_weight: torch.Tensor | None = None

    @property
    def ratio(self) -> torch.Tensor:
        """``(B,)`` sequence importance ratio ``s_i`` (Eq. 7), detached."""
        return self.log_ratio.exp()


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


_NONFINITE_HELP = (
    "The policy or the rollout produced non-finite log-probabilities (diverged weights, an fp16 overflow, or a bad "
    "reward scale). Lower the learning rate, use bf16/fp32 instead of fp16, or check the reward functions."
)
LOSS_INPUT_NAMES = ("logps", "old_logps", "advantages")


def check_finite(name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` if ``values`` holds NaN or Inf where ``mask`` is set (everywhere if no mask)."""
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad = bad & mask.bool()
    count = int(bad.sum())  # one device-to-host sync
    if count:
        raise ValueError(f"`{name}` contains {count} NaN/Inf value(s) at valid completion positions. {_NONFINITE_HELP}")


def nonfinite_counts(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """``(3,)`` number of NaN/Inf values in ``logps``, ``old_logps`` (at valid tokens) and ``advantages`` (at
    valid tokens if per-token, else all), as a device tensor: computing it does not wait for the device, so a
    trainer can read it together with values it reads anyway (see :func:`raise_if_nonfinite`)."""
    valid = mask.bool()
    per_token = advantages.shape == mask.shape
    counts = [
        (~torch.isfinite(logps) & valid).sum(),
        (~torch.isfinite(old_logps) & valid).sum(),
        ((~torch.isfinite(advantages)) & valid).sum() if per_token else (~torch.isfinite(advantages)).sum(),
    ]
    return torch.stack(counts)


def raise_if_nonfinite(counts) -> None:
    """Raise ``ValueError`` naming the first loss input with a non-zero count (host numbers, in the order of
    :func:`nonfinite_counts`)."""
    for name, count in zip(LOSS_INPUT_NAMES, counts):
        if count:
            raise ValueError(
                f"`{name}` contains {int(count)} NaN/Inf value(s) at valid completion positions. {_NONFINITE_HELP}"
            )


def _check_shapes(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> None:
    if logps.dim() != 2:
        raise ValueError(f"`logps` must have shape (B, T), got {tuple(logps.shape)}.")
    if old_logps.shape != logps.shape or mask.shape != logps.shape:
        raise ValueError(
            f"`logps` {tuple(logps.shape)}, `old_logps` {tuple(old_logps.shape)} and `mask` {tuple(mask.shape)} "
            "must have the same (B, T) shape."
        )


def _check_clip_range(eps_low: float, eps_high: float, delta: float | None = None) -> None:
    if not eps_low > 0 or not eps_high > 0:
        raise ValueError(f"clip ranges must be positive, got eps_low={eps_low}, eps_high={eps_high}.")
    if eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 so that 1 - eps_low > 0, got {eps_low}.")
    if delta is not None and not delta > 1.0 + eps_high:
        raise ValueError(
            f"delta must be > 1 + eps_high = {1.0 + eps_high} (it caps the ratio above the clip band), got {delta}."
        )


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` mean of ``values`` over each row's valid tokens; 0 for a row with none."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar mean of ``values`` over all valid tokens of the batch (every token weighs the same); 0 if none."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalized sequence log importance ratio, Eq. 7.

    ``log s_i = (1/|y_i|) * sum_t [log pi_theta(y_i,t | x, y_i,<t) - log pi_old(y_i,t | x, y_i,<t)]``

    Differentiable in ``logps``. Returns ``(B,)`` in float32 (or float64 for float64 inputs); 0 for a completion
    with no valid token.
    """
    _check_shapes(logps, old_logps, mask)
    dtype = _compute_dtype(logps, old_logps)
    token_log_ratio = logps.to(dtype) - old_logps.to(dtype)
    # Masked positions may hold anything (even NaN from padding): select instead of multiplying.
    token_log_ratio = torch.where(mask.bool(), token_log_ratio, torch.zeros_like(token_log_ratio))
    return masked_sequence_mean(token_log_ratio, mask)


def _clipped_surrogate(ratio, advantages, eps_low, eps_high, delta=None):
    """``-min(min(r, delta) A, clip(r, 1-eps_low, 1+eps_high) A)`` and the low/high/delta clip indicators.

    The min picks the clipped term only where the clip binds against the advantage's sign (``r > 1+eps_high`` with
    ``A > 0``, or ``r < 1-eps_low`` with ``A < 0``); there the term is a constant. ``delta`` (two-sided clipping,
    ``None`` = off) caps the unclipped ratio, which binds only where ``r > delta`` with ``A < 0`` (for ``A > 0`` the
    clipped term ``1+eps_high < delta`` is already the smaller): there the term is the constant ``-delta A``.
    Written as that selection, not with ``torch.minimum`` and ``torch.clamp``, so the gradient at a tie or exactly
    on a band edge does not depend on torch's subgradient conventions (torch 2.14 changed ``clamp``'s gradient at
    the bound from 1 to 0, which halved the gradient of ``min(r, clamp(r))`` at ``r = 1+eps``). Same value
    everywhere; the gradient is zero exactly where a clip indicator is set.
    """
    ratio_detached = ratio.detach()
    low = (ratio_detached < 1.0 - eps_low) & (advantages < 0)
    high = (ratio_detached > 1.0 + eps_high) & (advantages > 0)
    capped = torch.zeros_like(low) if delta is None else (ratio_detached > delta) & (advantages < 0)

    def constant(value):  # in the ratio's dtype: a float32 1 + 4e-4 would be off by 7e-9 in float64 arithmetic
        return torch.tensor(value, dtype=ratio.dtype, device=ratio.device)

    bound = torch.where(high, constant(1.0 + eps_high), constant(1.0 - eps_low))
    if delta is not None:
        bound = torch.where(capped, constant(delta), bound)
    loss = -torch.where(low | high | capped, bound * advantages, ratio * advantages)
    return loss, low, high, capped


def gspo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    check_inputs: bool = True,
    delta: float | None = None,
) -> PolicyLossOutput:
    """GSPO sequence-level clipped objective, Eq. 5 with the ratio of Eq. 7.

    ``J(theta) = E[ (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) ]``

    The loss is ``-J``, one value per sequence: the objective is a plain mean over sequences, never weighted by
    length. Gradients flow through ``logps`` only; ``old_logps`` and ``advantages`` are constants.

    With ``delta`` (two-sided clipping, INTELLECT-2, arXiv 2505.07291; TRL's ``GRPOConfig.delta``) the unclipped
    ratio is capped at ``delta``, applied here to the sequence ratio:

    ``J_delta(theta) = E[ (1/G) sum_i min(min(s_i, delta) A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) ]``

    which differs from Eq. 5 only for ``A_i < 0`` and ``s_i > delta``: there the term is the constant
    ``delta A_i`` (zero gradient), so a sequence the policy has made much more likely can no longer push an
    unbounded negative update. Not part of the GSPO paper.

    Args:
        logps: ``(B, T)`` log pi_theta of the sampled completion tokens (requires grad).
        old_logps: ``(B, T)`` log pi_old of the same tokens (the policy that sampled them).
        advantages: ``(B,)`` group-normalized advantages ``A_i`` (Eq. 6), or ``(B, 1)``.
        mask: ``(B, T)`` 1 for valid completion tokens.
        eps_low: left clip width: ``s_i`` is clipped below at ``1 - eps_low`` (paper: 3e-4).
        eps_high: right clip width: ``s_i`` is clipped above at ``1 + eps_high`` (paper: 4e-4).
        check_inputs: raise ``ValueError`` on NaN/Inf at valid positions (one device-to-host sync; a trainer can
            pass False and check :func:`nonfinite_counts` with values it reads anyway, as `GSPOTrainer` does).
        delta: optional cap on the unclipped ratio, ``> 1 + eps_high`` (``None``: off, the paper's objective).
    """
    _check_clip_range(eps_low, eps_high, delta)
    _check_shapes(logps, old_logps, mask)
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages[:, 0]
    if advantages.dim() != 1 or advantages.shape[0] != logps.shape[0]:
        raise ValueError(
            f"`advantages` must have one value per sequence ({logps.shape[0]}), got shape {tuple(advantages.shape)}. "
            "Per-token advantages need `gspo_token_loss`."
        )
    if check_inputs:  # one device-to-host sync for the three checks
        raise_if_nonfinite(nonfinite_counts(logps, old_logps, advantages, mask).tolist())
    log_ratio = sequence_log_ratio(logps, old_logps, mask)
    ratio = torch.exp(log_ratio)
    advantages = advantages.to(log_ratio.dtype)
    loss, low, high, capped = _clipped_surrogate(ratio, advantages, eps_low, eps_high, delta)
    valid = mask.bool()
    # An empty completion has no tokens to reinforce: zero value, zero gradient.
    per_token_loss = torch.where(valid, loss[:, None], torch.zeros((), dtype=loss.dtype, device=loss.device))
    return PolicyLossOutput(
        per_token_loss=per_token_loss,
        per_sequence_loss=torch.where(valid.any(-1), loss, torch.zeros_like(loss)),
        log_ratio=log_ratio.detach(),
        low_clipped=low[:, None] & valid,
        high_clipped=high[:, None] & valid,
        delta_clipped=capped[:, None] & valid,
    )


def gspo_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    check_inputs: bool = True,
    delta: float | None = None,
) -> PolicyLossOutput:
    """GSPO-token objective, Eq. 13 with the token ratio of Eq. 14.

    ``s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]``

    ``J(theta) = E[ (1/G) sum_i (1/|y_i|) sum_t min(s_i,t A_i,t, clip(s_i,t, 1 - eps_low, 1 + eps_high) A_i,t) ]``

    ``s_i,t`` equals ``s_i`` in value, so the ratio is per sequence, but each token has its own advantage, and the
    clip binds per token by its sign. With ``A_i,t = A_i`` for every token this equals :func:`gspo_loss` in value
    and gradient.

    ``delta`` caps the unclipped term as in :func:`gspo_loss`, per token: ``min(min(s_i,t, delta) A_i,t, ...)``,
    which binds on the tokens with ``A_i,t < 0`` of a sequence with ``s_i > delta``.

    The other arguments are as in `gspo_loss`.

    Args:
        advantages: ``(B, T)`` per-token advantages, or ``(B,)`` / ``(B, 1)`` per-sequence advantages
            (broadcast over tokens).
    """
    _check_clip_range(eps_low, eps_high, delta)
    _check_shapes(logps, old_logps, mask)
    batch, length = logps.shape
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if advantages.dim() != 2 or advantages.shape[0] != batch or advantages.shape[1] not in (1, length):
        raise ValueError(
            f"`advantages` must have shape (B,), (B, 1) or (B, T) = ({batch}, {length}); got {tuple(advantages.shape)}."
        )
    if check_inputs:  # one device-to-host sync for the three checks
        raise_if_nonfinite(nonfinite_counts(logps, old_logps, advantages, mask).tolist())
    log_ratio = sequence_log_ratio(logps, old_logps, mask)
    dtype = log_ratio.dtype
    valid = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    # Padding may hold NaN/Inf: zero it before it enters any product, or backward computes 0 * NaN.
    token_logps = torch.where(valid, logps.to(dtype), zero)
    advantages = torch.where(valid, advantages.to(dtype).expand(-1, length), zero)
    # Eq. 14: s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]. The second factor is exactly 1 in value (exp(0)), so every
    # token of a sequence has the same ratio, bit for bit (the clip still binds by each token's advantage sign).
    token_ratio = torch.exp(log_ratio).detach()[:, None] * torch.exp(token_logps - token_logps.detach())
    token_loss, low, high, capped = _clipped_surrogate(token_ratio, advantages, eps_low, eps_high, delta)
    token_loss = torch.where(valid, token_loss, zero)
    return PolicyLossOutput(
        per_token_loss=token_loss,
        per_sequence_loss=masked_sequence_mean(token_loss, mask),
        log_ratio=log_ratio.detach(),
        low_clipped=low & valid,
        high_clipped=high & valid,
        delta_clipped=capped & valid,
    )


def unpack_segments(segment_id: torch.Tensor, *values: torch.Tensor, num_segments: int | None = None):
    """Packed rows to one row per completion: ``segment_id`` ``(M,)`` names the completion (0..S-1) each of ``M``
    packed targets belongs to (TRL's asynchronous trainer packs several completions into a row this way); each
    ``values`` tensor ``(M,)`` comes back as ``(S, T)``, ``T`` the longest completion, the targets of a completion in
    their packed order, followed by the ``(S, T)`` mask of real targets. Differentiable (an index copy), so a loss on
    the padded form has the packed form's gradient. ``num_segments`` (default ``max(segment_id) + 1``) keeps
    completions with no target as empty rows."""
    if segment_id.dim() != 1 or any(v.shape != segment_id.shape for v in values):
        raise ValueError(f"`segment_id` and the packed values must be (M,) alike, got {tuple(segment_id.shape)} and "
                         f"{[tuple(v.shape) for v in values]}.")
    if segment_id.numel() and int(segment_id.min()) < 0:
        raise ValueError("`segment_id` holds a negative id: strip padding targets (TRL pads with -1) first.")
    segments = num_segments if num_segments is not None else (int(segment_id.max()) + 1 if segment_id.numel() else 0)
    counts = torch.bincount(segment_id, minlength=segments)
    if counts.numel() > segments:
        raise ValueError(f"`segment_id` names segment {int(segment_id.max())} but num_segments is {segments}.")
    order = torch.argsort(segment_id, stable=True)  # each completion's targets together, in packed order
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id[order]]
    width = int(counts.max()) if counts.numel() else 0
    rows, columns = segment_id[order], positions
    padded = []
    for value in values:
        out = value.new_zeros((segments, width))
        padded.append(out.index_put((rows, columns), value[order]))
    mask = torch.zeros((segments, width), dtype=torch.bool, device=segment_id.device)
    mask[rows, columns] = True
    return (*padded, mask)


def gspo_packed_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    segment_id: torch.Tensor,
    token_level: bool = False,
    num_segments: int | None = None,
    proximal_logps: torch.Tensor | None = None,
    weight_cap: float = 2.0,
    weight_mode: str = "truncate",
    **clip,
) -> PolicyLossOutput:
    """:func:`gspo_loss` (Eq. 5, 7) or, with ``token_level``, :func:`gspo_token_loss` (Eq. 13, 14) on packed rows:
    ``logps``, ``old_logps`` and ``advantages`` ``(M,)`` per packed target, ``segment_id`` ``(M,)`` the completion of
    each (:func:`unpack_segments`). ``s_i`` is the mean log ratio over completion ``i``'s targets only, ``|y_i|`` its
    target count (mask tool tokens out of the packed targets beforehand). For ``gspo`` every target of a completion
    must hold the completion's advantage (TRL's asynchronous trainer repeats it per token); per-token advantages need
    ``token_level``; with ``check_inputs=False`` that is not checked (it costs a host read). With ``proximal_logps``
    ``(M,)``: :func:`decoupled_gspo_loss`, ``old_logps`` being the behaviour policy's. Returns the padded form, one row
    per completion; ``clip``: ``eps_low``, ``eps_high``, ``delta``, ``check_inputs`` as for the unpacked losses."""
    packed = [logps, old_logps, advantages] + ([proximal_logps] if proximal_logps is not None else [])
    logps_rows, old_rows, advantage_rows, *proximal_rows, mask = unpack_segments(segment_id, *packed,
                                                                                 num_segments=num_segments)
    if not token_level:
        # (S, 1): the advantage each completion's first target holds; zero for a completion with no target (an empty
        # row, loss 0), also when no completion has one
        first = (advantage_rows[:, :1] if advantage_rows.shape[1]
                 else advantage_rows.new_zeros((len(advantage_rows), 1)))
        if clip.get("check_inputs", True) and mask.any() and bool(((advantage_rows - first).abs() * mask).amax() > 0):
            raise ValueError("`advantages` differ within a completion: gspo takes one advantage per sequence. Fix: "
                             "use token_level=True (gspo_token) for per-token advantages.")
        advantage_rows = first[:, 0]
    if proximal_logps is not None:
        return decoupled_gspo_loss(logps_rows, proximal_rows[0], old_rows, advantage_rows, mask,
                                   token_level=token_level, weight_cap=weight_cap, weight_mode=weight_mode, **clip)
    loss = gspo_token_loss if token_level else gspo_loss
    return loss(logps_rows, old_rows, advantage_rows, mask, **clip)


# How TRL 1.16's `GRPOTrainer._compute_loss` normalises each loss type, as `step_loss` applies it: "sequence", a plain
# mean over the batch's completions ("grpo" and "sapo": of each completion's token mean; "luspo": of its token sum);
# "token", a mean over the batch's valid tokens (`num_items_in_batch`: "cispo", "vespo"). GSPO's is Eq. 5's mean.
LOSS_REDUCTIONS = {"gspo": "sequence", "gspo_token": "sequence", "luspo": "sequence", "sapo": "sequence",
                   "cispo": "token", "vespo": "token"}


def _no_clip(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


def _loss_inputs(logps, old_logps, advantages, mask, check_inputs, per_token: bool):
    """Shared checks of the losses below: shapes, NaN/Inf, and the advantages as ``(B, T)`` (``per_token``) or
    ``(B,)``; returns (compute dtype, valid mask, padding-zeroed log-probs, token log ratios, advantages)."""
    _check_shapes(logps, old_logps, mask)
    batch, length = logps.shape
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages[:, 0]
    if per_token and advantages.dim() == 1:
        advantages = advantages[:, None].expand(-1, length)
    wanted = (batch, length) if per_token else (batch,)
    if tuple(advantages.shape) != wanted:
        raise ValueError(f"`advantages` must have shape {wanted} (or (B,) / (B, 1)), got {tuple(advantages.shape)}.")
    if check_inputs:  # one device-to-host sync for the three checks
        raise_if_nonfinite(nonfinite_counts(logps, old_logps, advantages, mask).tolist())
    dtype = _compute_dtype(logps, old_logps)
    valid = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    # Padding may hold NaN/Inf: select, never multiply, so backward never computes 0 * NaN.
    token_logps = torch.where(valid, logps.to(dtype), zero)
    token_log_ratio = torch.where(valid, logps.to(dtype) - old_logps.to(dtype), zero)
    advantages = advantages.to(dtype)
    if per_token:
        advantages = torch.where(valid, advantages, zero)
    return dtype, valid, token_logps, token_log_ratio, advantages


def luspo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    check_inputs: bool = True,
    delta: float | None = None,
) -> PolicyLossOutput:
    """LUSPO (arXiv 2602.05261; TRL's ``loss_type="luspo"`` with ``importance_sampling_level="sequence"``): GSPO's
    clipped sequence term (:func:`gspo_loss`, same ratio, band and ``delta``) weighted by the completion's length:

    ``J(theta) = (1/G) sum_i |y_i| min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``

    ``per_token_loss`` is :func:`gspo_loss`'s (the term at each valid token); ``per_sequence_loss`` its token sum."""
    out = gspo_loss(logps, old_logps, advantages, mask, eps_low=eps_low, eps_high=eps_high, check_inputs=check_inputs,
                    delta=delta)
    out.per_sequence_loss = out.per_sequence_loss * mask.sum(-1).to(out.per_sequence_loss.dtype)
    return out


def sapo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    check_inputs: bool = True,
) -> PolicyLossOutput:
    """SAPO (arXiv 2511.20347; TRL's ``loss_type="sapo"``, token ratios as TRL's default level): no hard clip; each
    token's ratio ``r_i,t = pi_theta(y_i,t) / pi_old(y_i,t)`` passes a soft gate,

    ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau = temperature_pos`` where ``A_i,t > 0``, else ``temperature_neg``

    ``J(theta) = (1/G) sum_i (1/|y_i|) sum_t f(r_i,t) A_i,t``

    ``f'(1) = 1`` (on-policy: the policy gradient), decaying as ``r`` leaves 1. Advantages ``(B,)`` or ``(B, T)``;
    nothing is marked clipped."""
    dtype, valid, _, token_log_ratio, advantages = _loss_inputs(logps, old_logps, advantages, mask, check_inputs,
                                                                per_token=True)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    ratio = torch.exp(token_log_ratio)
    temperature = torch.where(advantages > 0, torch.tensor(temperature_pos, dtype=dtype, device=logps.device),
                              torch.tensor(temperature_neg, dtype=dtype, device=logps.device))
    gate = torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature
    token_loss = torch.where(valid, -gate * advantages, zero)
    none = _no_clip(mask)
    return PolicyLossOutput(per_token_loss=token_loss, per_sequence_loss=masked_sequence_mean(token_loss, mask),
                            log_ratio=masked_sequence_mean(token_log_ratio, mask).detach(), low_clipped=none,
                            high_clipped=none, delta_clipped=none)


def cispo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_high: float = 5.0,
    check_inputs: bool = True,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv 2506.13585; TRL's ``loss_type="cispo"``, token ratios as TRL's default level): the
    token's importance weight, capped at ``eps_high`` (TRL's ``epsilon_high``, an absolute cap: ScaleRL's
    ``eps_max``) and detached, times its log-probability, a mean over the batch's ``N`` valid tokens:

    ``J(theta) = (1/N) sum_i sum_t sg[min(r_i,t, eps_high)] A_i,t log pi_theta(y_i,t)``

    Every token keeps a gradient; the cap bounds its weight. ``high_clipped``: the tokens whose weight the cap bound
    (``r_i,t > eps_high``, any advantage sign; TRL's ``cispo_clip_ratio`` counts those with ``A > 0`` only).
    ``reduction="token"``: ``per_sequence_loss`` is each completion's token sum."""
    if not eps_high > 0:
        raise ValueError(f"CISPO's weight cap eps_high must be > 0, got {eps_high}.")
    dtype, valid, token_logps, token_log_ratio, advantages = _loss_inputs(logps, old_logps, advantages, mask,
                                                                           check_inputs, per_token=True)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    ratio = torch.exp(token_log_ratio).detach()
    weight = torch.clamp(ratio, max=eps_high)
    token_loss = torch.where(valid, -weight * advantages * token_logps, zero)
    return PolicyLossOutput(per_token_loss=token_loss, per_sequence_loss=token_loss.sum(-1),
                            log_ratio=masked_sequence_mean(token_log_ratio, mask).detach(), low_clipped=_no_clip(mask),
                            high_clipped=(ratio > eps_high) & valid, delta_clipped=_no_clip(mask), reduction="token")


def vespo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    gamma_weights,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    check_inputs: bool = True,
) -> PolicyLossOutput:
    """VESPO (arXiv 2602.10693; TRL's ``loss_type="vespo"``): no hard clip; each completion's log-probability gradient
    weighted by a Gamma function of its sequence ratio ``w_i = exp(sum_t log r_i,t)`` (a product, not GSPO's
    length-normalised mean), a mean over the batch's ``N`` valid tokens:

    ``phi(w) = e^lambda w^k e^(-lambda w)`` (``phi(1) = 1``), ``k, lambda = k_pos, lambda_pos`` where ``A_i >= 0``
    else ``k_neg, lambda_neg``

    ``J(theta) = (1/N) sum_i sum_t sg[phi(w_i)] A_i log pi_theta(y_i,t)``

    ``gamma_weights``: TRL's ``GRPOTrainer.get_gamma_weights`` (its clamps of the log ratio included), which computes
    ``phi``; this module imports no TRL. Advantages one per sequence. ``reduction="token"``; ``gamma_weight`` holds
    ``phi(w_i)``; nothing is marked clipped."""
    dtype, valid, token_logps, token_log_ratio, advantages = _loss_inputs(logps, old_logps, advantages, mask,
                                                                           check_inputs, per_token=False)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    phi = gamma_weights(advantages=advantages[:, None], log_ratio_per_token=token_log_ratio.detach(),
                        mask=mask.to(dtype), importance_sampling_ratio=None, k_pos=k_pos, lambda_pos=lambda_pos,
                        k_neg=k_neg, lambda_neg=lambda_neg)[:, 0].detach().to(dtype)
    token_loss = torch.where(valid, -(phi * advantages)[:, None] * token_logps, zero)
    none = _no_clip(mask)
    return PolicyLossOutput(per_token_loss=token_loss, per_sequence_loss=token_loss.sum(-1),
                            log_ratio=masked_sequence_mean(token_log_ratio, mask).detach(), low_clipped=none,
                            high_clipped=none, delta_clipped=none, reduction="token", gamma_weight=phi)


def packed_policy_loss(
    loss_type: str,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    segment_id: torch.Tensor,
    num_segments: int | None = None,
    check_inputs: bool = True,
    **options,
) -> PolicyLossOutput:
    """The loss ``loss_type`` (a key of `LOSS_REDUCTIONS`) on packed rows, as :func:`gspo_packed_loss` lays them out
    (``logps``, ``old_logps``, ``advantages``, ``segment_id`` ``(M,)``, one entry per packed target): "gspo" /
    "gspo_token" are :func:`gspo_packed_loss` (``options`` its own); the others unpack the completions and call
    :func:`luspo_loss`, :func:`sapo_loss`, :func:`cispo_loss` or :func:`vespo_loss` with ``options``. LUSPO and VESPO
    take one advantage per completion (checked as :func:`gspo_packed_loss` checks gspo's, unless ``check_inputs`` is
    False); SAPO and CISPO take them per target. Returns the padded form, one row per completion."""
    if loss_type not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_type {loss_type!r} is not one of {tuple(LOSS_REDUCTIONS)}.")
    if loss_type in ("gspo", "gspo_token"):
        return gspo_packed_loss(logps, old_logps, advantages, segment_id, token_level=loss_type == "gspo_token",
                                num_segments=num_segments, check_inputs=check_inputs, **options)
    logps_rows, old_rows, advantage_rows, mask = unpack_segments(segment_id, logps, old_logps, advantages,
                                                                 num_segments=num_segments)
    if loss_type in ("luspo", "vespo"):
        first = advantage_rows[:, :1]
        if check_inputs and mask.any() and bool(((advantage_rows - first).abs() * mask).amax() > 0):
            raise ValueError(f"`advantages` differ within a completion: {loss_type} takes one advantage per sequence.")
        # a row holding only empty completions (no target) has width 0: their advantage is never read
        advantage_rows = first[:, 0] if first.shape[1] else advantage_rows.new_zeros(advantage_rows.shape[0])
    loss = {"luspo": luspo_loss, "sapo": sapo_loss, "cispo": cispo_loss, "vespo": vespo_loss}[loss_type]
    return loss(logps_rows, old_rows, advantage_rows, mask, check_inputs=check_inputs, **options)


def step_loss(out: PolicyLossOutput, completions, tokens):
    """This batch's share of an optimizer step's objective, the step holding ``completions`` completions and
    ``tokens`` valid tokens over all its batches (every micro-batch, every rank): ``per_sequence_loss.sum() /
    completions`` (``out.reduction == "sequence"``) or ``per_token_loss.sum() / tokens`` ("token"), each count at least
    1. Summed over the step's batches: TRL's `GRPOTrainer` loss on the step's completions padded into one batch (its
    mean over the batch's completions for grpo / sapo / luspo, over ``num_items_in_batch`` tokens for cispo / vespo),
    however the completions were split into batches or packed into rows."""
    if out.reduction == "token":
        return out.per_token_loss.sum() / torch.as_tensor(tokens, dtype=out.per_token_loss.dtype).clamp(min=1.0)
    return out.per_sequence_loss.sum() / torch.as_tensor(completions, dtype=out.per_sequence_loss.dtype).clamp(min=1.0)


WEIGHT_MODES = ("truncate", "mask")


def behaviour_weights(proximal_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor,
                      cap: float, mode: str = "truncate"):
    """Sequence-level importance weight of the proximal policy against the behaviour policy, length-normalised as
    GSPO's ``s_i`` (Eq. 7):

    ``w_i = exp( (1/|y_i|) sum_t [log pi_prox(y_i,t) - log mu(y_i,t)] )``

    ``mode="truncate"``: ``min(w_i, cap)`` (truncated importance sampling); ``mode="mask"``: ``w_i`` where
    ``1/cap <= w_i <= cap``, else 0 (the completion is dropped). Returns ``(log w_i, applied weight, capped)``, each
    ``(B,)``, detached: the weight is a constant of the objective. 0 / 1 / False for an empty completion."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weight mode must be one of {WEIGHT_MODES}, got {mode!r}.")
    if not cap > 1.0:
        raise ValueError(f"the weight cap must be > 1 (the weights of an unchanged policy are 1), got {cap}.")
    log_weight = sequence_log_ratio(proximal_logps.detach(), behaviour_logps.detach(), mask)
    weight = log_weight.exp()
    if mode == "truncate":
        capped = weight > cap
        applied = torch.clamp(weight, max=cap)
    else:
        capped = (weight > cap) | (weight < 1.0 / cap)
        applied = torch.where(capped, torch.zeros_like(weight), weight)
    return log_weight, applied, capped


def decoupled_gspo_loss(
    logps: torch.Tensor,
    proximal_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_level: bool = False,
    weight_cap: float = 2.0,
    weight_mode: str = "truncate",
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    check_inputs: bool = True,
    delta: float | None = None,
) -> PolicyLossOutput:
    """GSPO's objective decoupled for stale samples (decoupled PPO, Hilton et al., arXiv 2110.00641, on GSPO's
    sequence ratio): the clip band bounds the update against the proximal policy ``pi_prox``, and the gap between the
    behaviour policy ``mu`` (the sampler, possibly several weight versions old) and ``pi_prox`` enters as a
    sequence-level importance weight (:func:`behaviour_weights`):

    ``r_i = exp( (1/|y_i|) sum_t log pi_theta(y_i,t) / pi_prox(y_i,t) )``

    ``J(theta) = (1/N) sum_i sg[w~_i] min(r_i A_i, clip(r_i, 1 - eps_low, 1 + eps_high) A_i)``

    ``w~_i`` truncated at ``weight_cap`` or masked outside ``[1/weight_cap, weight_cap]``. With ``token_level``,
    ``r_i`` becomes Eq. 14's ``r_i,t = sg[r_i] pi_theta(y_i,t) / sg[pi_theta(y_i,t)]`` and the term the token mean of
    Eq. 13's, per-token advantages allowed. Untruncated, ``w_i r_i = s_i`` (Eq. 7 against ``mu``). When
    ``pi_prox = sg[pi_theta]`` (each sample trained once, as in TRL's asynchronous trainer), ``r_i = 1``: no clip
    binds, and the gradient is ``(1/N) sum_i w~_i A_i grad (1/|y_i|) sum_t log pi_theta(y_i,t)``.

    Args as :func:`gspo_loss`; ``proximal_logps`` / ``behaviour_logps`` ``(B, T)`` constants. The returned
    ``per_token_loss`` / ``per_sequence_loss`` hold the weight; ``log_ratio`` is ``log r_i`` (against ``pi_prox``),
    and ``behaviour_log_weight``, ``behaviour_weight``, ``weight_capped`` are set."""
    _check_shapes(logps, behaviour_logps, mask)
    if check_inputs:  # the behaviour policy's log-probs stand where gspo_loss would check old_logps
        raise_if_nonfinite(nonfinite_counts(logps, behaviour_logps, advantages, mask).tolist())
    log_weight, weight, capped = behaviour_weights(proximal_logps, behaviour_logps, mask, weight_cap, weight_mode)
    loss = gspo_token_loss if token_level else gspo_loss
    out = loss(logps, proximal_logps.detach(), advantages, mask, eps_low=eps_low, eps_high=eps_high,
               check_inputs=False, delta=delta)
    valid = mask.bool().any(-1)
    weight = torch.where(valid, weight, torch.ones_like(weight)).to(out.per_sequence_loss.dtype)
    out.per_token_loss = out.per_token_loss * weight[:, None]
    out.per_sequence_loss = out.per_sequence_loss * weight
    out.behaviour_log_weight, out.behaviour_weight, out.weight_capped = log_weight, weight, capped & valid
    return out


def applied_entropy_coef(coef: float, last_entropy: float, target: float, adaptive: bool) -> float:
    """Coefficient of the entropy bonus ``L = L_policy - coef * H`` for the current optimizer step.

    A fixed ``coef`` always applies. The adaptive controller (Skywork-OR1, arXiv 2505.22312, as TRL's
    ``use_adaptive_entropy`` runs it) applies it only while the entropy measured at the end of the previous
    optimizer step is at or below ``target`` (``last_entropy = inf`` before the first measurement: no bonus).
    """
    if not adaptive:
        return coef
    return coef if last_entropy <= target else 0.0


def adaptive_entropy_coef(coef: float, entropy: float, target: float, step: float, coef_min: float,
                          coef_max: float) -> float:
    """Next coefficient of the adaptive entropy controller after an optimizer step whose mean token entropy over
    all ranks was ``entropy``: ``min(coef + step, coef_max)`` if ``entropy <= target`` (entropy collapsing: push
    harder), else ``max(coef - step, coef_min)``."""
    if entropy <= target:
        return min(coef + step, coef_max)
    return max(coef - step, coef_min)


def entropy_window_stats(window: torch.Tensor | None, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[entropy sum, token count]` of an accumulation window, with this micro-batch's masked tokens added; the
    adaptive controller takes the mean over all ranks' window at the optimizer step (`adaptive_entropy_coef`)."""
    stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach().float()
    return stats if window is None else window + stats


def adaptive_clip_epsilon(epsilon: float, clipped_fraction: float, target: float, epsilon_min: float,
                          epsilon_max: float, gain: float = 0.15, max_step: float = 2.0) -> float:
    """Next lower clip range of the adaptive GSPO band (`clip_band="adaptive"`), after an optimizer step whose share
    of clipped tokens among the tokens that could be clipped was ``clipped_fraction`` (Eq. 5's clip applied to
    ``s_i``; only tokens of groups whose rewards differ count: trl_gspo/trainer/clip_band.py):

        ``epsilon' = clamp(epsilon * exp(clamp(gain * (c - target) / target, -log max_step, log max_step)),
                           epsilon_min, epsilon_max)``

    A controller on the clipped share whose step in ``log epsilon`` is linear in the share: more clipped than
    ``target`` widens the band, less narrows it, by at most ``max_step`` per step, and the band never leaves
    ``[epsilon_min, epsilon_max]``. Linear in ``c``, its fixed point is a mean share equal to ``target`` on a noisy
    stream too (a step in ``log c`` would settle where the mean of ``log c`` is ``log target``, above it). The upper
    range keeps its ratio to the lower one (the caller scales it)."""
    step = gain * (clipped_fraction - target) / target
    step = min(max(step, -math.log(max_step)), math.log(max_step))
    return min(max(epsilon * math.exp(step), epsilon_min), epsilon_max)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimator to the reference policy (Schulman's k3, as in GRPO):

    ``KL_t = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1``, non-negative, unbiased for KL(pi_theta || pi_ref).
    """
    dtype = _compute_dtype(logps, ref_logps)
    delta = ref_logps.to(dtype) - logps.to(dtype)
    return torch.exp(delta) - delta - 1.0
