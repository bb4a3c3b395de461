"""What the tests of TRL's tool loop on several processes share (tests/test_tool_turns.py with HF generate,
tests/test_vllm.py with vLLM): the hang bound of stock TRL's runs and the check of a rank-divergent run."""

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
