"""The reward of the agentic Qwen3-30B-A3B recipes: TRL's math-verify answer check on the model's last turn.

With tools, a TRL completion is the list of messages after the prompt (`assistant` with a tool call, `tool`,
`assistant`, ...). TRL 1.16's `accuracy_reward` reads only `completion[0]["content"]`, the first turn, which under a
tool call is the text before the call, not the answer. This passes it the last assistant turn instead.
(`think_format_reward` is left out: TRL's parser moves `<think>` blocks into `reasoning_content`, so `content` never
has one, and the recipes run Qwen3 without thinking.)
"""

from __future__ import annotations

import importlib.util

# Refused at import, so `trl-gspo --dry_run` names the fix before any model is loaded.
if importlib.util.find_spec("math_verify") is None:
    raise ImportError('final_answer_accuracy checks answers with math-verify: pip install -e ".[math]" in the '
                      "trl-gspo checkout")


def final_answer_accuracy(completions: list[list[dict]], solution: list[str], **kwargs) -> list[float | None]:
    """1.0 when the last assistant message's answer equals `solution` by math-verify, else 0.0; None where the
    reference itself cannot be parsed (TRL then leaves the sample out of that reward's mean), as TRL's
    `accuracy_reward`, which does the checking."""
    from trl.rewards import accuracy_reward

    last_turns = []
    for messages in completions:
        turns = [m for m in messages if m.get("role") == "assistant"]
        last_turns.append([{"role": "assistant", "content": (turns[-1].get("content") or "") if turns else ""}])
    return accuracy_reward(last_turns, solution, **kwargs)
