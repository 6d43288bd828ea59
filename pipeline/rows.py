"""Reading data rows from local files and checking they hold what a stage needs.

Torch-free, so `validate` can check a data file on a login node before anything
is submitted; the stages use the same functions on the node.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Iterable

from pipeline.errors import InvalidInput

ROW_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def is_row_file(path: str) -> bool:
    return path.endswith(ROW_FILE_SUFFIXES)


def read_rows(path: Path) -> list[dict]:
    """All rows of a .jsonl, .json (a list of objects), .csv or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path}: data file not found")
    if path.suffix == ".jsonl":
        rows = []
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InvalidInput(f"{path}: line {number}: not valid JSON ({err.msg})") from None
                if not isinstance(row, dict):
                    raise InvalidInput(f"{path}: line {number}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{path}: line {err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise InvalidInput(f"{path}: expected a JSON list of objects (or use .jsonl, one object per line)")
        return rows
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise InvalidInput(f"{path}: unsupported data file type; use one of {', '.join(ROW_FILE_SUFFIXES)}")


def required_columns(kind: str, data) -> list[list[tuple[str, str]]]:
    """Alternative sets of (column, field that names it) a row of this stage kind must have."""
    if kind == "sft":
        return [
            [(data.prompt_key, "prompt_key"), (data.response_key, "response_key")],
            [(data.messages_key, "messages_key")],
        ]
    if kind == "ppo":
        return [[(data.prompt_key, "prompt_key")]]
    return [[(data.prompt_key, "prompt_key"), (data.chosen_key, "chosen_key"), (data.rejected_key, "rejected_key")]]


def select_rows(rows: Iterable[dict], kind: str, data, source: str) -> tuple[list[dict], int]:
    """(usable rows, how many were skipped); raises InvalidInput naming the bad rows (1-based)
    unless the pipeline file asks to skip them (data.invalid_rows: skip)."""
    alternatives = required_columns(kind, data)
    kept, problems = [], []
    for number, row in enumerate(rows, start=1):
        found = [_row_problem(row, columns) for columns in alternatives]
        problem = found[0] if all(found) else ""
        if not problem and kind in ("rm", "dpo") and row[data.chosen_key].strip() == row[data.rejected_key].strip():
            problem = f"chosen and rejected are identical ('{data.chosen_key}' = '{data.rejected_key}')"
        if problem:
            problems.append((number, problem))
        else:
            kept.append(row)
    if problems and data.invalid_rows == "error":
        shown = "\n".join(f"  row {n}: {p}" for n, p in problems[:5])
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise InvalidInput(
            f"{source}: {len(problems)} invalid row{'s' if len(problems) > 1 else ''}:\n{shown}{more}\n"
            "Fix them, or set data.invalid_rows: skip to leave such rows out."
        )
    if not kept:
        raise InvalidInput(f"{source}: no usable rows")
    return kept, len(problems)


def _row_problem(row: dict, columns: list[tuple[str, str]]) -> str:
    for column, field in columns:
        value = row.get(column)
        if value is None:
            present = ", ".join(sorted(map(str, row))) or "none"
            return f"missing column '{column}' (data.{field}); columns present: {present}"
        if field == "messages_key":
            if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in value
            ):
                return f"'{column}' must be a non-empty list of {{role, content}} messages"
            if value[-1].get("role") != "assistant":
                return f"'{column}' must end with an assistant message (the response to learn)"
        elif not isinstance(value, str) or not value.strip():
            return f"'{column}' (data.{field}) must be a non-empty string"
    return ""
