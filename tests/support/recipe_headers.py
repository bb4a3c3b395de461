"""The launch commands written in a recipe's header, as the recipe tests read them (tests/test_recipes_vllm.py,
tests/test_recipes_agentic.py)."""

import re
from pathlib import Path


def header_commands(path: Path) -> list[str]:
    """The shell commands in a recipe's header: comment lines indented by three spaces, `\\` continuations joined."""
    commands, pending = [], None
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if pending is not None:
            pending += " " + text.strip()
        elif text.startswith("   ") and text.strip():
            pending = text.strip()
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
        else:
            commands.append(pending)
            pending = None
    return commands


def command_gpus(command: str) -> list[int]:
    match = re.match(r"CUDA_VISIBLE_DEVICES=([\d,]+) ", command)
    assert match, f"no CUDA_VISIBLE_DEVICES in {command!r}"
    return [int(gpu) for gpu in match.group(1).split(",")]
