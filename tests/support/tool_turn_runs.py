"""What the tests of TRL's tool loop share (tests/test_tool_turns.py with HF generate, tests/test_vllm.py with vLLM):
the hang bound of stock TRL's runs, the check of a rank-divergent run, and tool calls forced per sample."""

import re

HANG_BOUND = 90  # seconds a collective may wait (`ddp_timeout`) before it raises: bounds a hang of stock TRL


def assert_divergent_and_own(result):
    """The forced divergence happened (rank 0: two tool turns of 8 samples; rank 1: one turn of 4, then none; 16 samples
    per rank over two rounds), and
    every sample's segments continue its own history."""
    rank0, rank1 = result["turns"]
    assert result["world_size"] == 2
    # Which samples reach a tool result also depends on their length: a first turn that fills the context leaves the
    # loop without one (measured on one 2-core x86 machine: 3 of rank 1's 4, every run). The divergence is the point:
    # two tool turns on rank 0 while rank 1 runs one and then none.
    assert rank0[0][0] == 2 and 1 <= rank0[0][1] <= 8, result["turns"]  # [turns, samples that reached a result]
    assert rank1[0][0] == 1 and 1 <= rank1[0][1] <= 4 and rank1[1] == [0, 0], result["turns"]
    assert result["own_history_violations"] == [0, 0] and min(result["samples_checked"]) >= 16


def forced_calls(original, tool_turns):
    """TRL's `parse_response`, with the tool-call decision made by the test from the sample's prompt "add A B": a call
    of `add` in each of the first `tool_turns(A)` turns (the text stays the model's). A machine's cold-started tool
    model calls the tool at its own rate, which can leave no second turn to test."""
    def parse(tokenizer, ids, prefix=None, tools=None, **kwargs):
        message = dict(original(tokenizer, ids, prefix=prefix, tools=tools, **kwargs))
        history = tokenizer.decode(list(prefix or []))
        a = int(re.search(r"add (\d+) (\d+)", history).group(1))
        turn = history.count("<|tool|>")  # tool results so far
        message.pop("tool_calls", None)
        if turn < tool_turns(a):
            message["tool_calls"] = [{"type": "function", "function": {"name": "add",
                                                                       "arguments": {"a": a, "b": turn + 1}}}]
        return message
    return parse
