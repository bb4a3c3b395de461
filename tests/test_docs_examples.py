"""Every ```python block of README.md and docs/*.md compiles, and runs as written on a CPU, offline, each in a fresh
namespace in a scratch directory, unless it says what it needs in a comment line of its own:

    # needs: gpu, vllm-server, hub  (why, in words)

`gpu`: a CUDA GPU (bf16, FSDP2, FlashAttention-3); `vllm-server`: a running vLLM server (`trl-gspo vllm-serve`);
`hub`: a model or dataset from the Hugging Face Hub (so also anything that trains a real model). A marked block is
only compiled. Blocks that train use the built-in tiny models and a few steps. A block another test already runs
(`RUN_ELSEWHERE`) is only compiled here."""

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS = ("gpu", "vllm-server", "hub")
# Blocks a test of their own runs and checks further: page -> that test (its file must exist and read the page).
RUN_ELSEWHERE = {"docs/own_task.md": "tests/test_own_task.py"}
FENCE = re.compile(r"^( *)```python[ \t]*\n(.*?)^\1```", flags=re.S | re.M)
MARKER = re.compile(r"^# needs: ([a-z, -]+?)(?:\s+\(.*\))?\s*$", flags=re.M)


def _blocks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            where = path.relative_to(ROOT).as_posix()
            first_line = text[:match.start(2)].count("\n") + 1
            yield pytest.param(where, first_line, textwrap.dedent(match.group(2)), id=f"{where}:{first_line}")


BLOCKS = list(_blocks())


def test_the_blocks_are_found():
    pages = {block.values[0] for block in BLOCKS}
    assert {"README.md", "docs/own_task.md", "docs/routing.md"} <= pages and len(BLOCKS) >= 9


@pytest.mark.parametrize("where,first_line,code", BLOCKS)
def test_python_block_runs_on_cpu_or_is_marked(where, first_line, code, tmp_path, monkeypatch):
    # Line numbers of errors and tracebacks are the page's.
    compiled = compile("\n" * (first_line - 1) + code, where, "exec")
    needs = {need.strip() for marker in MARKER.findall(code) for need in marker.split(",")}
    assert needs <= set(NEEDS), f"{where}:{first_line}: unknown `# needs:` {sorted(needs - set(NEEDS))}; use {NEEDS}"
    if needs:
        return  # compiled only
    if where in RUN_ELSEWHERE:
        test = ROOT / RUN_ELSEWHERE[where]
        assert Path(where).name in test.read_text(), f"{test} does not read {where}"
        return
    monkeypatch.chdir(tmp_path)  # a block may write (outputs/, ...) where it runs
    exec(compiled, {"__name__": "__main__"})
