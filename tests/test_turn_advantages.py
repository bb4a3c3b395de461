"""Per-turn advantages with GSPO-token (trl_gspo/turn_advantages.py): turn indices and tool spans on hand-written masks,
the per-turn advantage reaching each turn's gradient exactly (against a float64 reference written from the paper,
arXiv 2507.18071 Eq. 13-14), failed tool calls found in the tool results, and the example trainer, by hand and inside
TRL's own tool loop."""

import re
from itertools import count

import pytest
import torch
from support.helpers import digit_reward, tiny_config, toy_dataset

from trl_gspo.losses import gspo_loss, gspo_token_loss, masked_sequence_mean
from trl_gspo.turn_advantages import (ToolCreditGSPOTrainer, ToolSpan, failed_tool_turns, per_turn_advantages,
                                 tool_result_spans, turn_index)
from trl_gspo.quickstart.model import build_dense_model, build_model
from trl_gspo.quickstart.tools import add, build_tool_tokenizer, make_tool_rl_dataset, tool_answer_reward

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def _masks(rows, length):
    """`tool_mask` and `completion_mask` from strings: 'P' a policy token, 'T' a tool-result token; padded on the
    right to `length` as TRL pads them (tool_mask with 1, completion_mask with 0)."""
    tool = [[0 if c == "T" else 1 for c in row] + [1] * (length - len(row)) for row in rows]
    valid = [[1] * len(row) + [0] * (length - len(row)) for row in rows]
    return torch.tensor(tool), torch.tensor(valid)


def _expected_turns(row, length):
    """The turn of each position, by reading the string left to right (-1 on 'T' and padding)."""
    out, turn, previous = [], -1, "T"
    for c in row:
        if c == "P" and previous != "P":
            turn += 1
        out.append(turn if c == "P" else -1)
        previous = c
    return out + [-1] * (length - len(row))


# ------------------------------------------------------------------ (a) turns and tool spans
ROWS = [
    "PPTTPPTPPP",  # three turns, tool results in the middle
    "PPPPPP",      # no tool call: one turn, then padding
    "PTTP",        # the last turn truncated to one token, then padding
    "PPPTTT",      # ends with tool results: the next turn was cut to nothing
]


def test_turn_index_on_hand_written_masks():
    tool_mask, completion_mask = _masks(ROWS, 10)
    expected = torch.tensor([_expected_turns(row, 10) for row in ROWS])
    assert expected[0].tolist() == [0, 0, -1, -1, 1, 1, -1, 2, 2, 2]  # the reading itself, spelled out once
    assert torch.equal(turn_index(tool_mask, completion_mask), expected)
    assert turn_index(tool_mask, completion_mask).dtype == torch.long


def test_tool_result_spans_on_hand_written_masks():
    tool_mask, completion_mask = _masks(ROWS, 10)
    assert tool_result_spans(tool_mask, completion_mask) == [
        [ToolSpan(2, 4, 0), ToolSpan(6, 7, 1)],
        [],
        [ToolSpan(1, 3, 0)],
        [ToolSpan(3, 6, 0)],
    ]


def test_a_row_masked_whole_has_no_turn_and_no_span():
    """TRL's mask_truncated_completions multiplies both masks of a truncated sample by 0."""
    tool_mask, completion_mask = _masks(["PPTTPP"], 8)
    tool_mask, completion_mask = tool_mask * 0, completion_mask * 0
    assert torch.equal(turn_index(tool_mask, completion_mask), torch.full((1, 8), -1))
    assert tool_result_spans(tool_mask, completion_mask) == [[]]


def test_a_completion_starting_with_tool_tokens():
    """An env_mask of a rollout_func may start with environment tokens: that span answers no turn (-1)."""
    tool_mask, completion_mask = _masks(["TTPPTP"], 6)
    assert turn_index(tool_mask, completion_mask).tolist() == [[-1, -1, 0, 0, -1, 1]]
    assert tool_result_spans(tool_mask, completion_mask) == [[ToolSpan(0, 2, -1), ToolSpan(4, 5, 0)]]


def test_per_turn_advantages_by_hand():
    tool_mask, completion_mask = _masks(["PPTPTP", "PPP"], 6)
    idx = turn_index(tool_mask, completion_mask)
    advantages = torch.tensor([1.0, -2.0])
    credit = torch.tensor([[0.5, -1.0, 2.0], [0.25, 9.0, 9.0]])
    assert per_turn_advantages(advantages, credit, idx).tolist() == [
        [1.5, 1.5, 0.0, 0.0, 0.0, 3.0],
        [-1.75, -1.75, -1.75, 0.0, 0.0, 0.0],
    ]
    assert per_turn_advantages(advantages[:, None], credit, idx).tolist() == (
        per_turn_advantages(advantages, credit, idx).tolist())  # (B, 1) as TRL may hand it


def test_per_turn_advantages_refuses_what_does_not_fit():
    tool_mask, completion_mask = _masks(["PPTPTP", "PPP"], 6)
    idx = turn_index(tool_mask, completion_mask)
    with pytest.raises(ValueError, match=r"turn index 2 .* only 2 column.*Fix: give `turn_credit` at least 3"):
        per_turn_advantages(torch.zeros(2), torch.zeros(2, 2), idx)
    with pytest.raises(ValueError, match="shapes do not fit.*Fix"):
        per_turn_advantages(torch.zeros(3), torch.zeros(2, 3), idx)
    with pytest.raises(ValueError, match="shapes do not fit.*Fix"):
        per_turn_advantages(torch.zeros(2, 6), torch.zeros(2, 3), idx)  # already per token
    with pytest.raises(ValueError, match="shapes do not fit.*Fix"):
        per_turn_advantages(torch.zeros(2), torch.zeros(2), idx)


# ------------------------------------------------------------------ (b) the gradient of each turn's tokens
GRAD_ROWS = [
    "PPPTTPPTTPPP",  # inside the band
    "PPTTTPPPTPP",   # s > 1 + eps_high: the clip binds on its tokens with A > 0
    "PPPPTTPTTPP",   # s < 1 - eps_low: the clip binds on its tokens with A < 0
    "PPTTPPTTPP",    # inside the band
]
ADVANTAGES = [0.7, 0.3, -0.4, 1.1]
CREDIT = [[0.0, -1.2, 0.5], [0.0, -1.0, 0.5], [0.0, 0.9, -0.2], [-0.3, 0.0, 0.4]]  # mixed signs in rows 1 and 2
TARGET_LOG_RATIO = [5e-5, 2e-3, -2e-3, -1e-4]  # log s_i of each row


def _rollout(seed=0, length=12):
    """Random float64 log-probs with garbage on tool tokens (a log-ratio of +-5) and NaN on padding; old log-probs
    chosen so that the mean log-ratio over each row's policy tokens is TARGET_LOG_RATIO."""
    gen = torch.Generator().manual_seed(seed)
    tool_mask, completion_mask = _masks(GRAD_ROWS, length)
    policy = (tool_mask * completion_mask).bool()
    logps = -torch.rand(len(GRAD_ROWS), length, generator=gen, dtype=torch.float64) * 3 - 0.05
    noise = torch.randn(len(GRAD_ROWS), length, generator=gen, dtype=torch.float64) * 1e-3
    noise = torch.where(policy, noise, 0.0)
    noise = noise - noise.sum(-1, keepdim=True) / policy.sum(-1, keepdim=True)  # zero mean over policy tokens
    log_ratio = torch.where(policy, noise + torch.tensor(TARGET_LOG_RATIO, dtype=torch.float64)[:, None], 5.0)
    old_logps = logps - log_ratio
    logps = torch.where(completion_mask.bool(), logps, float("nan"))
    return logps, old_logps, tool_mask, completion_mask


def _reference(logps, old_logps, rows):
    """GSPO-token from the paper in float64 (Eq. 13-14), every quantity from the row strings: |y_i| and s_i over the
    policy's tokens only, A_i,t = A_i + credit[i, turn]. Returns the loss -J and d(-J)/d logps: per token
    -(1/G) s_i A_i,t / |y_i|, 0 where the clip binds (s > 1+eps_high with A > 0, s < 1-eps_low with A < 0), on tool
    tokens and on padding."""
    G = len(rows)
    grad = torch.zeros(logps.shape, dtype=torch.float64)
    objective = 0.0
    for i, row in enumerate(rows):
        turns = _expected_turns(row, logps.shape[1])
        tokens = [t for t, k in enumerate(turns) if k >= 0]
        length = len(tokens)
        s = torch.exp(sum(logps[i, t] - old_logps[i, t] for t in tokens) / length).item()
        for t in tokens:
            a = ADVANTAGES[i] + CREDIT[i][turns[t]]
            clipped = (s > 1 + EPS_HIGH and a > 0) or (s < 1 - EPS_LOW and a < 0)
            objective += min(s * a, min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH) * a) / length / G
            grad[i, t] = 0.0 if clipped else -s * a / length / G
    return -objective, grad


def _loss_and_grad(loss_fn, logps, old_logps, advantages, mask):
    logps = logps.detach().clone().requires_grad_(True)
    out = loss_fn(logps, old_logps, advantages, mask, EPS_LOW, EPS_HIGH)
    loss = masked_sequence_mean(out.per_token_loss, mask).mean()  # GSPOTrainer._compute_loss's aggregation
    loss.backward()
    return loss.detach(), logps.grad, out


def test_each_turns_advantage_reaches_its_tokens_gradient_exactly():
    logps, old_logps, tool_mask, completion_mask = _rollout()
    mask = completion_mask * tool_mask
    idx = turn_index(tool_mask, completion_mask)
    advantages = per_turn_advantages(torch.tensor(ADVANTAGES, dtype=torch.float64),
                                     torch.tensor(CREDIT, dtype=torch.float64), idx)
    loss, grad, out = _loss_and_grad(gspo_token_loss, logps, old_logps, advantages, mask)
    ref_loss, ref_grad = _reference(logps.detach(), old_logps, GRAD_ROWS)

    s = out.ratio
    assert s[0] < 1 + EPS_HIGH and s[0] > 1 - EPS_LOW and s[3] < 1 + EPS_HIGH and s[3] > 1 - EPS_LOW
    assert s[1] > 1 + EPS_HIGH and s[2] < 1 - EPS_LOW  # the two clipped rows are outside the band
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-15)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-15)
    # The clip is per token: the clipped rows keep the gradient of the tokens whose advantage sign does not bind.
    for i in (1, 2):
        policy_grad = grad[i][mask[i].bool()]
        assert (policy_grad == 0).any() and (policy_grad != 0).any()
    # Tool tokens (garbage log-ratio +5) and padding (NaN log-probs) get exactly 0.
    assert torch.all(grad[~mask.bool()] == 0)


def test_a_turns_credit_changes_only_that_turns_gradient():
    logps, old_logps, tool_mask, completion_mask = _rollout(seed=1)
    mask = completion_mask * tool_mask
    idx = turn_index(tool_mask, completion_mask)
    base = torch.tensor(ADVANTAGES, dtype=torch.float64)
    credit = torch.zeros(4, 3, dtype=torch.float64)
    _, plain, out = _loss_and_grad(gspo_token_loss, logps, old_logps, per_turn_advantages(base, credit, idx), mask)
    credit[0, 1] = -0.5
    _, steered, _ = _loss_and_grad(gspo_token_loss, logps, old_logps, per_turn_advantages(base, credit, idx), mask)
    changed = steered != plain
    assert torch.equal(changed, idx.eq(1) & torch.tensor([True, False, False, False])[:, None])
    length = mask[0].sum()
    expected = -(out.ratio[0] * -0.5 / length / 4)  # the paper's per-token gradient, for the credit alone
    torch.testing.assert_close((steered - plain)[0][idx[0] == 1],
                               expected.expand(int(idx[0].eq(1).sum())), rtol=1e-10, atol=1e-15)


def test_zero_turn_credit_is_gspo():
    logps, old_logps, tool_mask, completion_mask = _rollout(seed=2)
    mask = completion_mask * tool_mask
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)
    token_advantages = per_turn_advantages(advantages, torch.zeros(4, 3, dtype=torch.float64),
                                           turn_index(tool_mask, completion_mask))
    token_loss, token_grad, _ = _loss_and_grad(gspo_token_loss, logps, old_logps, token_advantages, mask)
    seq_loss, seq_grad, out = _loss_and_grad(gspo_loss, logps, old_logps, advantages, mask)
    assert out.low_clipped.any() or out.high_clipped.any()  # a clipped sequence is part of the comparison
    torch.testing.assert_close(token_grad, seq_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(token_loss, seq_loss, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------ (c) failed tool calls
def _completion(tokenizer, pieces, length):
    """completion_ids, tool_mask, completion_mask from (text, is_tool) pieces, right-padded as TRL pads."""
    ids, tool = [], []
    for text, is_tool in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        tool += [0 if is_tool else 1] * len(piece)
    assert len(ids) <= length
    pad = length - len(ids)
    return ids + [tokenizer.pad_token_id] * pad, tool + [1] * pad, [1] * len(ids) + [0] * pad


def _batch(tokenizer, samples, length=64):
    rows = [_completion(tokenizer, pieces, length) for pieces in samples]
    return tuple(torch.tensor([row[j] for row in rows]) for j in range(3))


M, S = False, True  # a model turn, tool results
FAILURE_SAMPLES = [
    [("call add 1 2", M), (" error: bad args ", S), ("call add 1 3", M), (" 4 ", S), ("answer 4", M)],
    [("answer 5", M)],                                                      # no tool call
    [("call a", M), (" 7 ", S), ("call b", M), (" error: timeout ", S), ("answ", M)],  # last turn truncated
    [("call add", M), (" error: unknown tool ", S)],                       # ends with the failed result
]


def test_failed_tool_turns_with_the_character_tokenizer(tokenizer):
    completion_ids, tool_mask, completion_mask = _batch(tokenizer, FAILURE_SAMPLES)
    failed = failed_tool_turns(completion_ids, tool_mask, completion_mask, tokenizer)
    assert failed.dtype == torch.bool
    assert failed.tolist() == [[True, False, False], [False, False, False], [False, True, False],
                               [True, False, False]]
    assert failed_tool_turns(completion_ids, tool_mask, completion_mask, tokenizer, marker="7").tolist() == [
        [False, False, False], [False, False, False], [True, False, False], [False, False, False]]
    # "error" in the model's own text is not a failed tool call
    ids, tool, valid = _batch(tokenizer, [[("error error", M), (" 3 ", S), ("ok", M)]], length=20)
    assert failed_tool_turns(ids, tool, valid, tokenizer).tolist() == [[False, False]]


# ------------------------------------------------------------------ (d) the example trainer
def _bare_trainer(tokenizer, **attributes):
    """A ToolCreditGSPOTrainer instance without Trainer.__init__: enough for `token_advantages`."""
    trainer = ToolCreditGSPOTrainer.__new__(ToolCreditGSPOTrainer)
    trainer.processing_class = tokenizer
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def test_tool_credit_trainer_token_advantages_by_hand(tokenizer):
    completion_ids, tool_mask, completion_mask = _batch(tokenizer, FAILURE_SAMPLES)
    inputs = {"completion_ids": completion_ids, "tool_mask": tool_mask, "completion_mask": completion_mask,
              "advantages": torch.tensor([1.0, -1.0, 0.5, 2.0])}
    mask = completion_mask * tool_mask
    out = ToolCreditGSPOTrainer.token_advantages(_bare_trainer(tokenizer), inputs, mask)
    idx = turn_index(tool_mask, completion_mask)
    assert ToolCreditGSPOTrainer.failed_tool_credit == -0.5
    expected = torch.zeros_like(out)
    credit = {(0, 0): -0.5, (2, 1): -0.5, (3, 0): -0.5}  # the turns whose tool result says "error"
    for i in range(4):
        for t in range(mask.shape[1]):
            if idx[i, t] >= 0:
                expected[i, t] = inputs["advantages"][i] + credit.get((i, int(idx[i, t])), 0.0)
    assert torch.equal(out, expected)
    assert torch.all(out[~mask.bool()] == 0)
    # Another credit, and the fallback without tool_mask: the broadcast sequence advantages.
    harsher = ToolCreditGSPOTrainer.token_advantages(_bare_trainer(tokenizer, failed_tool_credit=-2.0), inputs, mask)
    assert harsher[0, 0].item() == -1.0 and harsher[2, idx[2].tolist().index(1)].item() == -1.5
    no_tools = {k: v for k, v in inputs.items() if k != "tool_mask"}
    plain = ToolCreditGSPOTrainer.token_advantages(_bare_trainer(tokenizer), no_tools, completion_mask)
    assert torch.equal(plain, inputs["advantages"][:, None].expand_as(completion_mask))


def test_tool_credit_trainer_needs_gspo_token(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="overrides `token_advantages`.*Fix: set loss_type='gspo_token'"):
        ToolCreditGSPOTrainer(build_model(tokenizer), digit_reward, args=tiny_config(tmp_path, loss_type="gspo"),
                              train_dataset=toy_dataset(), processing_class=tokenizer)
    trainer = ToolCreditGSPOTrainer(build_model(tokenizer), digit_reward,
                                    args=tiny_config(tmp_path, loss_type="gspo_token"), train_dataset=toy_dataset(),
                                    processing_class=tokenizer, failed_tool_credit=-1.0, failure_marker="fail")
    assert (trainer.failed_tool_credit, trainer.failure_marker) == (-1.0, "fail")
    assert ToolCreditGSPOTrainer.failed_tool_credit == -0.5  # the class default is untouched


@pytest.mark.slow
def test_tool_credit_trainer_in_trls_tool_loop(tmp_path):
    """TRL's own tool loop with scripted turns: a first turn that calls `add` with a wrong argument name (TRL turns
    the TypeError into `{'error': ...}`) or a right one, then an answer (some cut by max_completion_length). The
    advantages the trainer computes are checked against the token ids: turn 1 = up to the first <eos>, then the tool
    result up to <|assistant|>, then turn 2."""
    tokenizer = build_tool_tokenizer()
    eos, assistant = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|assistant|>")
    model = build_dense_model(tokenizer, seed=0, config_overrides={"max_position_embeddings": 256})
    args = tiny_config(tmp_path, loss_type="gspo_token", max_completion_length=160, max_steps=1, steps_per_generation=1,
                       max_tool_calling_iterations=2)
    trainer = ToolCreditGSPOTrainer(model, tool_answer_reward, args=args, processing_class=tokenizer,
                                    train_dataset=make_tool_rl_dataset(8, seed=1), tools=[add])
    calls = count()

    def scripted(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text, n = tokenizer.decode(ids), next(calls)
            a, b = map(int, re.search(r"add (\d+) (\d+)", text).groups())
            if "<|tool|>" not in text:
                key = "c" if n % 2 else "b"  # `add(a=.., c=..)` raises TypeError
                body = f'<tool_call>{{"name":"add","arguments":{{"a":{a},"{key}":{b}}}}}</tool_call><eos>'
            else:
                body = f"{a + b}<eos>" if n % 3 else "9" * 200  # the long one is cut by TRL
            out.append(tokenizer(body, add_special_tokens=False)["input_ids"])
        return out, None

    seen = []

    def spy(inputs, mask):
        advantages = ToolCreditGSPOTrainer.token_advantages(trainer, inputs, mask)
        seen.append((inputs, mask, advantages))
        return advantages

    trainer._generate_single_turn, trainer.token_advantages = scripted, spy
    trainer.train()

    assert seen and any(h.get("tools/failure_frequency", 0) > 0 for h in trainer.state.log_history)
    kinds = set()
    for inputs, mask, advantages in seen:
        for i in range(mask.shape[0]):
            ids = inputs["completion_ids"][i].tolist()
            valid = int(inputs["completion_mask"][i].sum())
            first_eos = ids.index(eos)
            next_turn = ids.index(assistant, first_eos) + 1
            failed = '"c":' in tokenizer.decode(ids[:first_eos])
            a = inputs["advantages"][i].item()
            expected = [a - 0.5 * failed] * (first_eos + 1) + [0.0] * (next_turn - first_eos - 1)
            expected += [a] * (valid - next_turn) + [0.0] * (len(ids) - valid)
            assert advantages[i].tolist() == pytest.approx(expected), (i, tokenizer.decode(ids))
            policy = [j <= first_eos or next_turn <= j < valid for j in range(len(ids))]
            assert inputs["tool_mask"][i].bool().tolist()[:valid] == policy[:valid]  # TRL's mask, as read above
            assert mask[i].bool().tolist() == policy
            kinds.add((failed, ids[valid - 1] == eos))
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}  # failed or not, cut or not
