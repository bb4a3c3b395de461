"""The quickstart's built-in task: single-digit addition with a verifiable answer, and a noisy cold start.

Prompts are plain strings such as ``"3+5="``; the answer is the decimal sum (``"8"``) followed by ``<eos>``.

The supervised cold start is deliberately *noisy*: only ``correct_fraction`` of its completions are the right
sum, the others are random numbers in the same range. The cold-started policy therefore knows the output format
and has the right answer in its support, but samples it only part of the time: a weak starting policy that RL
with a verifiable reward can sharpen within a couple of minutes on a CPU (the same dynamic as RL on a reasoning
model after a small SFT stage).
"""

from __future__ import annotations

import random

from datasets import Dataset

from .tokenizer import EOS_TOKEN

MAX_OPERAND = 9


def make_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def _pairs(num_examples: int, seed: int, max_operand: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(num_examples)]


def make_rl_dataset(num_examples: int, seed: int, max_operand: int = MAX_OPERAND) -> Dataset:
    """Prompts plus the ``answer`` column the rewards receive."""
    pairs = _pairs(num_examples, seed, max_operand)
    return Dataset.from_dict({"prompt": [make_prompt(a, b) for a, b in pairs],
                              "answer": [str(a + b) for a, b in pairs]})


def make_sft_dataset(num_examples: int, seed: int, correct_fraction: float = 0.5,
                     max_operand: int = MAX_OPERAND) -> Dataset:
    """Prompt-completion pairs; a ``correct_fraction`` of completions are the true sum, the rest random."""
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"`correct_fraction` must be in [0, 1], got {correct_fraction}.")
    rng = random.Random(seed + 1)
    prompts, completions = [], []
    for a, b in _pairs(num_examples, seed, max_operand):
        answer = a + b if rng.random() < correct_fraction else rng.randint(0, 2 * max_operand)
        prompts.append(make_prompt(a, b))
        completions.append(f"{answer}{EOS_TOKEN}")
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational format
        completion = completion[-1]["content"] if completion else ""
    return completion.replace(EOS_TOKEN, "").strip()


def exact_match_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 if the completion is exactly the answer (surrounding spaces ignored), else 0.0."""
    return [float(_text(c) == str(a).strip()) for c, a in zip(completions, answer)]


def digit_match_reward(completions, answer, **kwargs) -> list[float]:
    """Partial credit in [0, 1]: positions where completion and answer agree, over the longer of the two."""
    scores = []
    for completion, expected in zip(completions, answer):
        predicted, expected = _text(completion), str(expected).strip()
        length = max(len(predicted), len(expected))
        scores.append(1.0 if length == 0 else sum(p == e for p, e in zip(predicted, expected)) / length)
    return scores
