"""The docs' tables of defaults against what the configs resolve to, so docs and code cannot disagree: docs/own_task.md's
GRPO-to-GSPO table (TRL's `GRPOConfig` and `GSPOConfig` with gspo types, fields left unset) and docs/gspo.md's table of
the clip band's defaults (`GSPOConfig` and `AsyncGSPOConfig`). A cell is read from its start: a code span (a Python
literal), numbers separated by " / ", or "no such field"; the rest of the cell is prose."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from trl import GRPOConfig

from trl_gspo import AsyncGSPOConfig, GSPOConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
BASE = dict(use_cpu=True, bf16=False, report_to="none")
ABSENT = object()


def _table(page: str, heading: str) -> dict[str, list[str]]:
    """The first markdown table after `heading` in docs/`page`: the first column's text -> the other cells."""
    text = (DOCS / page).read_text()
    body = text[text.index(heading):]
    rows = [line for line in body.splitlines()[1:] if line.startswith("|")]
    start = body.splitlines()[1:].index(rows[0])
    lines = body.splitlines()[1:][start:]
    table = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        table[cells[0]] = cells[1:]
    return table


def _value(cell: str):
    """The value a cell starts with."""
    if cell.startswith("no such field"):
        return ABSENT
    if cell.startswith("`"):
        literal = cell[1:cell.index("`", 1)]
        try:
            return ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            return literal
    numbers = re.match(r"[0-9][0-9.e+-]*(?: / [0-9][0-9.e+-]*)*", cell)
    assert numbers, f"no value at the start of {cell!r}"
    values = tuple(float(x) for x in numbers.group(0).split(" / "))
    return values if len(values) > 1 else values[0]


def _resolved(config, fields: str):
    """The config's value(s) of a row's field(s): "`a` / `b`" -> (a, b); a field the config lacks -> ABSENT."""
    names = re.findall(r"`(\w+)`", fields)
    values = tuple(getattr(config, name, ABSENT) for name in names)
    return values if len(values) > 1 else values[0]


def _same(documented, resolved) -> bool:
    if isinstance(documented, tuple):
        return len(documented) == len(resolved) and all(_same(d, r) for d, r in zip(documented, resolved))
    if isinstance(documented, float) and isinstance(resolved, (int, float)) and not isinstance(resolved, bool):
        return documented == pytest.approx(resolved, rel=1e-12)
    return documented == resolved


def test_the_grpo_to_gspo_table_matches_both_configs(tmp_path):
    table = _table("own_task.md", "## What changes when you swap `GRPOConfig` for `GSPOConfig`")
    grpo = GRPOConfig(output_dir=str(tmp_path), **BASE)
    gspo = GSPOConfig(output_dir=str(tmp_path), **BASE)
    checked = []
    for fields, (trl_cell, gspo_cell, _) in table.items():
        if fields == "`epsilon` / `epsilon_high`":  # TRL: epsilon_high "same as epsilon" (None)
            assert _value(trl_cell) == 0.2 and (grpo.epsilon, grpo.epsilon_high) == (0.2, None)
        elif fields != "`steps_per_generation`":  # a multiple of another field, written in words
            assert _same(_value(trl_cell), _resolved(grpo, fields)), (fields, trl_cell)
            checked.append(fields)
        if fields != "`steps_per_generation`":
            assert _same(_value(gspo_cell), _resolved(gspo, fields)), (fields, gspo_cell)
    assert gspo.steps_per_generation == 4 * gspo.gradient_accumulation_steps  # the row in words
    assert {"`loss_type`", "`clip_band`", "`beta`", "`importance_sampling_level`"} <= set(checked)


def test_the_clip_band_defaults_table_matches_both_configs(tmp_path):
    table = _table("gspo.md", "## A clip band set by the run")
    configs = (GSPOConfig(output_dir=str(tmp_path), **BASE), AsyncGSPOConfig(output_dir=str(tmp_path), use_cpu=True))
    assert [config.loss_type for config in configs] == ["gspo", "gspo"]
    for fields, cells in table.items():
        for cell, config in zip(cells, configs):
            assert _same(_value(cell), _resolved(config, fields)), (fields, cell, type(config).__name__)
    assert {"`clip_band`", "`epsilon` / `epsilon_high`"} <= set(table)
    # every field the table names is a field of both configs
    for fields in table:
        for name in re.findall(r"`(\w+)`", fields):
            assert all(name in {f.name for f in dataclasses.fields(config)} for config in configs), name
