"""Per-turn advantages for multi-turn (tool-calling) rollouts, for ``loss_type="gspo_token"``.

Equation numbers refer to *Group Sequence Policy Optimization* (Zheng et al., arXiv 2507.18071). GSPO-token
(Eq. 13-14) gives every token the ratio ``s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]``, equal to
``s_i`` in value, so the ratio stays per sequence while each token has its own advantage ``A_i,t`` (and the clip
binds per token, by the sign of ``A_i,t``).
Unclipped, the gradient of token ``t`` of completion ``i`` (Eq. 13, over a batch of ``G`` completions) is::

    (1/G) * s_i * A_i,t / |y_i| * grad log pi_theta(y_i,t)

This module builds ``A_i,t`` per model turn of a tool-calling rollout. TRL's tool loop
(``GRPOTrainer._tool_call_loop``) writes ``completion_ids = c_1 | s_1 | c_2 | ... | c_K``, where ``c_k`` is the
model's ``k``-th turn and ``s_k`` the tokens of the tool results (and the next turn's header) that follow it.
``tool_mask`` is 1 on the model's tokens and 0 on ``s_k``; TRL right-pads it with **1**, so the policy's tokens are
``completion_mask * tool_mask`` (what `GSPOTrainer` passes to ``token_advantages`` as ``mask``).

- :func:`turn_index`: the 0-based model turn of every policy token (-1 elsewhere).
- :func:`tool_result_spans`: where each ``s_k`` lies and which turn it answers.
- :func:`per_turn_advantages`: ``A_i,t = A_i + credit[i, k]`` on the tokens of turn ``k``.
- :func:`failed_tool_turns`: the turns whose tool call failed (TRL writes ``{'error': ...}`` as the tool result).
- :class:`ToolCreditGSPOTrainer`: an example trainer that gives the turn of a failed tool call extra (negative)
  credit. Needs ``loss_type="gspo_token"`` (another loss type is refused at construction).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .trainer.gspo_trainer import GSPOTrainer

__all__ = [
    "ToolSpan",
    "turn_index",
    "tool_result_spans",
    "per_turn_advantages",
    "failed_tool_turns",
    "ToolCreditGSPOTrainer",
]


class ToolSpan(NamedTuple):
    """Tool-result tokens ``completion_ids[i, start:end]`` of one sample (``end`` exclusive); ``turn`` is the index of
    the model turn right before them (the one whose tool call they answer), -1 if the completion starts with them."""

    start: int
    end: int
    turn: int


def _check_masks(tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> None:
    if tool_mask.dim() != 2 or tool_mask.shape != completion_mask.shape:
        raise ValueError(f"`tool_mask` {tuple(tool_mask.shape)} and `completion_mask` {tuple(completion_mask.shape)} "
                         "must have the same (B, T) shape.")


def turn_index(tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` long: the 0-based index of the model turn each policy token belongs to, -1 elsewhere.

    A policy token is one with ``completion_mask == 1`` and ``tool_mask == 1``; a model turn is a maximal run of them.
    Tool-result tokens and padding get -1 (TRL pads ``tool_mask`` with 1, so ``completion_mask`` is what marks the
    padding). A completion without tool call is one turn (index 0); a row whose ``tool_mask`` is all 0 (TRL's
    ``mask_truncated_completions`` zeroes a truncated sample's) has no turn at all.
    """
    _check_masks(tool_mask, completion_mask)
    policy = completion_mask.bool() & tool_mask.bool()
    before = torch.nn.functional.pad(policy[:, :-1], (1, 0), value=False)  # policy[:, t-1], False at t = 0
    starts = policy & ~before
    return torch.where(policy, starts.long().cumsum(-1) - 1, torch.full_like(starts, -1, dtype=torch.long))


def tool_result_spans(tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> list[list[ToolSpan]]:
    """Per sample, the :class:`ToolSpan` of each maximal run of tool-result tokens (``completion_mask == 1`` and
    ``tool_mask == 0``), in order. Host lists (one device-to-host copy of the masks)."""
    _check_masks(tool_mask, completion_mask)
    valid = completion_mask.bool().cpu().tolist()
    policy = (completion_mask.bool() & tool_mask.bool()).cpu().tolist()
    spans = []
    for row_valid, row_policy in zip(valid, policy):
        row, turn, start, previous_policy = [], -1, None, False
        for t, (is_valid, is_policy) in enumerate(zip(row_valid, row_policy)):
            is_tool = is_valid and not is_policy
            if not is_tool and start is not None:  # a span ends before any new turn is counted
                row.append(ToolSpan(start, t, turn))
                start = None
            if is_policy and not previous_policy:
                turn += 1
            if is_tool and start is None:
                start = t
            previous_policy = is_policy
        if start is not None:  # the completion ends with tool results (the next turn was cut to nothing)
            row.append(ToolSpan(start, len(row_valid), turn))
        spans.append(row)
    return spans


def per_turn_advantages(advantages: torch.Tensor, turn_credit: torch.Tensor, turn_idx: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` per-token advantages for Eq. 13: ``A_i,t = advantages[i] + turn_credit[i, k]`` on the tokens of model
    turn ``k = turn_idx[i, t]``, 0 where ``turn_idx`` is -1 (tool results, padding).

    Args:
        advantages: ``(B,)`` or ``(B, 1)`` sequence advantages (TRL's ``inputs["advantages"]``, Eq. 6).
        turn_credit: ``(B, K)`` extra credit of each sample's turns; ``K`` must exceed every turn index.
        turn_idx: ``(B, T)`` from :func:`turn_index`.

    With ``turn_credit`` all zero the result is ``advantages`` broadcast over the policy's tokens, which makes
    ``gspo_token`` equal to ``gspo`` (Eq. 5).
    """
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages[:, 0]
    batch = turn_idx.shape[0] if turn_idx.dim() == 2 else None
    if advantages.dim() != 1 or turn_credit.dim() != 2 or batch is None or not (
            advantages.shape[0] == turn_credit.shape[0] == batch):
        raise ValueError(
            f"shapes do not fit: `advantages` {tuple(advantages.shape)} must be (B,), `turn_credit` "
            f"{tuple(turn_credit.shape)} (B, K) and `turn_idx` {tuple(turn_idx.shape)} (B, T), with one B. Fix: pass "
            "one advantage per sequence, one row of turn credit per sequence and `turn_index(tool_mask, "
            "completion_mask)`.")
    highest = int(turn_idx.max()) if turn_idx.numel() else -1  # one device-to-host read
    if highest >= turn_credit.shape[1]:
        raise ValueError(
            f"`turn_idx` has turn index {highest} but `turn_credit` has only {turn_credit.shape[1]} column(s). Fix: "
            f"give `turn_credit` at least {highest + 1} columns (one per model turn: `turn_idx.max() + 1`).")
    dtype = torch.promote_types(advantages.dtype, turn_credit.dtype)
    credit = turn_credit.to(dtype).gather(1, turn_idx.clamp(min=0)) if turn_credit.shape[1] else 0.0
    token_advantages = advantages.to(dtype)[:, None] + credit
    return torch.where(turn_idx >= 0, token_advantages, torch.zeros((), dtype=dtype, device=token_advantages.device))


def failed_tool_turns(completion_ids: torch.Tensor, tool_mask: torch.Tensor, completion_mask: torch.Tensor,
                      tokenizer, marker: str = "error") -> torch.Tensor:
    """``(B, K)`` bool, on ``completion_ids``' device: ``[i, k]`` is True when the tool results right after model turn
    ``k`` of sample ``i`` decode (``skip_special_tokens=True``) to text containing ``marker``.

    TRL turns a tool that raises (or an unknown tool) into a tool message with content ``{'error': '...'}`` (the
    ``str`` of a dict), which the chat template renders into those tokens. The test is textual: a successful result
    whose text contains ``marker`` counts as a failure too; pass a stricter ``marker`` if your tools can return it.
    ``K = max(turn_index) + 1`` (at least 1), the column count :func:`per_turn_advantages` needs.
    """
    if completion_ids.shape != tool_mask.shape:
        raise ValueError(f"`completion_ids` {tuple(completion_ids.shape)} and `tool_mask` {tuple(tool_mask.shape)} "
                         "must have the same (B, T) shape.")
    spans = tool_result_spans(tool_mask, completion_mask)
    num_turns = int(turn_index(tool_mask, completion_mask).max().clamp(min=0)) + 1 if completion_ids.numel() else 1
    failed = torch.zeros(len(spans), num_turns, dtype=torch.bool)
    rows = completion_ids.cpu().tolist()
    for i, row_spans in enumerate(spans):
        for span in row_spans:
            if span.turn >= 0 and marker in tokenizer.decode(rows[i][span.start:span.end], skip_special_tokens=True):
                failed[i, span.turn] = True
    return failed.to(completion_ids.device)


class ToolCreditGSPOTrainer(GSPOTrainer):
    """Example: `GSPOTrainer` whose tool-calling turns pay for failed tool calls. Copy it and change the credit rule.

    Token ``t`` of model turn ``k`` of completion ``i`` gets ``A_i,t = A_i + failed_tool_credit`` when the tool call
    of turn ``k`` failed (:func:`failed_tool_turns`), else ``A_i`` (TRL's sequence advantage, Eq. 6); tool results and
    padding get 0. With GSPO-token (Eq. 13-14) that credit reaches exactly the failing turn's tokens: their gradient
    is ``(1/G) * s_i * (A_i + failed_tool_credit) / |y_i|`` times ``grad log pi`` inside the clip band.

    Requires ``loss_type="gspo_token"``: only that loss calls ``token_advantages``, and `GSPOTrainer` refuses this
    subclass with any other loss type at construction. A batch without ``tool_mask`` (no tools, no ``env_mask``)
    falls back to the broadcast sequence advantages.

    Args (keyword, besides `GSPOTrainer`'s):
        failed_tool_credit: added to the advantage of a turn whose tool call failed (default -0.5).
        failure_marker: the text that marks a failed tool result (default ``"error"``).
    """

    failed_tool_credit: float = -0.5
    failure_marker: str = "error"

    def __init__(self, *args, failed_tool_credit: float | None = None, failure_marker: str | None = None, **kwargs):
        if failed_tool_credit is not None:
            self.failed_tool_credit = float(failed_tool_credit)
        if failure_marker is not None:
            self.failure_marker = failure_marker
        super().__init__(*args, **kwargs)

    def token_advantages(self, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        if "tool_mask" not in inputs:
            return super().token_advantages(inputs, mask)
        tool_mask, completion_mask = inputs["tool_mask"], inputs["completion_mask"]
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)  # a processor's tokenizer
        failed = failed_tool_turns(inputs["completion_ids"], tool_mask, completion_mask, tokenizer,
                                   self.failure_marker)
        credit = failed.to(inputs["advantages"].dtype) * self.failed_tool_credit
        return per_turn_advantages(inputs["advantages"], credit, turn_index(tool_mask, completion_mask))
