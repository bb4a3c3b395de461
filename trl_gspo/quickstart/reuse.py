"""Reuse a finished built-in model preparation (tiny model + SFT cold start) when its inputs have not changed.

`trl-gspo` saves the prepared model to `<output_dir>/initial_model` and writes `cold_start.json` there *last*:
the inputs it was built from (options, process count, versions, a hash of the quickstart's own sources) and the
size of every file saved. A run killed before that leaves no mark, so the next run prepares the model again; a run
with the same inputs finds a complete mark and skips the cold start.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MARK = "cold_start.json"
_SOURCES = ("model.py", "addition.py", "cold_start.py", "tokenizer.py", "tiny_qwen3_moe.json")
# The tool-calling model is built and cold-started by tools.py as well (the other models' marks do not depend on it).
_TOOL_SOURCES = ("tools.py",)
_TOOL_MODELS = ("tiny-qwen3-moe-tools",)


def cold_start_inputs(model_name: str, script_args, seed: int, num_processes: int) -> dict:
    """Everything the prepared model depends on. The process count matters: it sets the SFT per-device batch."""
    import torch
    import transformers
    import trl

    sources = hashlib.sha256()
    for name in _SOURCES + (_TOOL_SOURCES if model_name in _TOOL_MODELS else ()):
        sources.update((Path(__file__).with_name(name)).read_bytes())
    return {
        "model": model_name,
        "sft_steps": script_args.sft_steps,
        "sft_learning_rate": script_args.sft_learning_rate,
        "sft_correct_fraction": script_args.sft_correct_fraction,
        "seed": seed,
        "num_processes": num_processes,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "quickstart_sources_sha256": sources.hexdigest(),
    }


def reusable(path: str, inputs: dict) -> bool:
    """Whether `path` holds a complete preparation made from exactly `inputs`."""
    try:
        with open(os.path.join(path, MARK)) as handle:
            mark = json.load(handle)
    except (OSError, ValueError):
        return False
    if mark.get("inputs") != inputs:
        return False
    files = mark.get("files") or {}
    return bool(files) and all(
        os.path.isfile(os.path.join(path, name)) and os.path.getsize(os.path.join(path, name)) == size
        for name, size in files.items()
    )


def clear_mark(path: str) -> None:
    """Before rewriting `path`: a kill in the middle of the rewrite must not leave the old mark behind."""
    try:
        os.remove(os.path.join(path, MARK))
    except FileNotFoundError:
        pass


def write_mark(path: str, inputs: dict) -> None:
    """Mark `path` complete: called after every file is saved. Written to a temporary name and renamed (atomic)."""
    files = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))
             if name != MARK and os.path.isfile(os.path.join(path, name))}
    temporary = os.path.join(path, MARK + ".tmp")
    with open(temporary, "w") as handle:
        json.dump({"inputs": inputs, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(path, MARK))
