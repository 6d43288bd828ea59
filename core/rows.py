"""Reading data rows from local files and checking they hold what a stage needs.

Torch-free, so `validate` can check a data file on a login node before anything
is submitted; the stages use the same functions on the node.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core import kinds
from core.errors import InvalidInput

ROW_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# What `datasets` writes with save_to_disk: a DatasetDict, or one Dataset.
DATASET_DICT_FILE = "dataset_dict.json"
DATASET_FILES = ("dataset_info.json", "state.json")
# Files `datasets.load_dataset(folder)` reads as rows.
FOLDER_DATA_SUFFIXES = ROW_FILE_SUFFIXES + (".arrow",)
SUPPORTED_DATA = (
    "a .jsonl, .json, .csv or .parquet file, a dataset folder (saved with datasets' save_to_disk, "
    "or holding .parquet/.jsonl/.json/.csv/.arrow files), a hub dataset id, or builtin:digits"
)


def is_row_file(path: str) -> bool:
    return path.endswith(ROW_FILE_SUFFIXES)


def read_rows(path: Path) -> list[dict]:
    """All rows of a .jsonl, .json (a list of objects), .csv or .parquet file (UTF-8 text)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path}: data file not found")
    if path.suffix == ".jsonl":
        rows = []
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                line = _utf8(raw, path, number)
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
            rows = json.loads(_utf8(path.read_bytes(), path))
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{path}: line {err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise InvalidInput(f"{path}: expected a JSON list of objects (or use .jsonl, one object per line)")
        return rows
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(_utf8(path.read_bytes(), path), newline="")))
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise InvalidInput(f"{path}: not a readable Parquet file ({err}); write it again, "
                               "e.g. with pandas' to_parquet") from None
    raise InvalidInput(f"{path}: unsupported data file type '{path.suffix}'; the data can be {SUPPORTED_DATA}")


def _utf8(data: bytes, path: Path, first_line: int = 1) -> str:
    """`data` decoded, a leading byte-order mark dropped; bytes that are not UTF-8 are
    reported by line (counted from first_line) and byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise InvalidInput(
            f"{path}: line {line}: not UTF-8 text (byte 0x{data[err.start]:02x} at byte {column} of the line); "
            f"save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}"
        ) from None
    return text.removeprefix("\ufeff") if first_line == 1 else text


# --------------------------------------------------------------------------- dataset folders


@dataclass(frozen=True)
class DatasetFolder:
    """A local folder of rows, laid out as `datasets` reads it.

    layout: 'splits' (save_to_disk of a DatasetDict: one subfolder per split), 'one'
    (save_to_disk of a Dataset: no splits), or 'files' (data files that
    `datasets.load_dataset(folder)` reads, splits named by their file names).
    """

    path: Path
    layout: str
    splits: tuple[str, ...] = ()

    def arrow_files(self, split: str | None = None) -> list[Path]:
        """The Arrow files of a split ('splits') or of the dataset ('one')."""
        folder = self.path / split if self.layout == "splits" and split else self.path
        return sorted(folder.glob("*.arrow"))

    def count(self, split: str | None = None) -> tuple[int, tuple[str, ...]]:
        """(rows, column names) of a split ('splits') or of the dataset ('one'), from its
        Arrow files' record batches; no row is decoded."""
        import pyarrow as pa

        rows, columns = 0, ()
        for file in self.arrow_files(split):
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(file)))
                columns = tuple(reader.schema.names)
                rows += sum(batch.num_rows for batch in reader)
            except (pa.ArrowException, OSError) as err:
                raise InvalidInput(f"{file}: not a readable Arrow file ({err}); save the dataset again "
                                   "(datasets' save_to_disk)") from None
        return rows, columns


def dataset_folder(path: Path) -> DatasetFolder:
    """What the folder `path` holds as a dataset; InvalidInput when it holds none."""
    path = Path(path)
    if (path / DATASET_DICT_FILE).is_file():
        try:
            splits = json.loads((path / DATASET_DICT_FILE).read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InvalidInput(f"{path / DATASET_DICT_FILE}: not readable ({err}); save the dataset "
                               "again (datasets' save_to_disk)") from None
        return DatasetFolder(path, "splits", tuple(map(str, splits)))
    if any((path / name).is_file() for name in DATASET_FILES):
        return DatasetFolder(path, "one")
    if (path / "config.json").is_file():
        raise InvalidInput(f"{path}: a model folder (config.json), not a dataset. The data can be {SUPPORTED_DATA}")
    if _data_files(path):
        return DatasetFolder(path, "files")
    found = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))[:8]
    raise InvalidInput(
        f"{path}: a folder that holds no dataset: no {DATASET_DICT_FILE} or {DATASET_FILES[0]} (what datasets' "
        f"save_to_disk writes) and no {'/'.join(FOLDER_DATA_SUFFIXES)} files (found: {', '.join(found) or 'nothing'}). "
        f"The data can be {SUPPORTED_DATA}"
    )


def _data_files(folder: Path, depth: int = 3) -> bool:
    """Whether data files lie in `folder` or its subfolders (a hub snapshot keeps them in data/)."""
    for entry in folder.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.name.endswith(FOLDER_DATA_SUFFIXES):
            return True
        if entry.is_dir() and depth > 1 and _data_files(entry, depth - 1):
            return True
    return False


def required_columns(kind: str, data) -> list[list[tuple[str, str]]]:
    """Alternative sets of (column, field that names it) a row of this stage kind must have:
    what its row format (core/kinds.py) reads."""
    rows = kinds.get(kind).rows
    if rows == "completion":
        return [
            [(data.prompt_key, "prompt_key"), (data.response_key, "response_key")],
            [(data.messages_key, "messages_key")],
        ]
    if rows == "prompt":
        return [[(data.prompt_key, "prompt_key")]]
    return [[(data.prompt_key, "prompt_key"), (data.chosen_key, "chosen_key"), (data.rejected_key, "rejected_key")]]


def select_rows(rows: Iterable[dict], kind: str, data, source: str) -> tuple[list[dict], int]:
    """(usable rows, how many were skipped); raises InvalidInput naming the bad rows (1-based)
    unless the pipeline file asks to skip them (data.invalid_rows: skip)."""
    alternatives = required_columns(kind, data)
    pairs = kinds.get(kind).rows == "preference"
    kept, problems = [], []
    for number, row in enumerate(rows, start=1):
        found = [_row_problem(row, columns) for columns in alternatives]
        problem = found[0] if all(found) else ""
        if not problem and pairs and row[data.chosen_key].strip() == row[data.rejected_key].strip():
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


def hold_out(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) of data without an eval split: `fraction` of the rows,
    at least one, drawn with the stage's seed."""
    shuffled = rows[:]
    random.Random(seed).shuffle(shuffled)
    n_eval = max(1, int(len(shuffled) * fraction))
    return shuffled[n_eval:], shuffled[:n_eval]


def eval_copies(train: list[dict], held_out: list[dict], kind: str, data) -> str | None:
    """What to warn of when evaluation rows are copies of training rows (the columns the stage
    reads are the same): its evaluation then measures memory; None when none is."""
    columns = sorted({column for needed in required_columns(kind, data) for column, _ in needed})

    def digest(row: dict) -> bytes:
        values = json.dumps([row.get(c) for c in columns], sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.blake2b(values.encode(), digest_size=16).digest()

    seen = {digest(row) for row in train}
    copies = sum(digest(row) in seen for row in held_out)
    if not copies:
        return None
    return (f"eval rows {copies} of {len(held_out)} also appear in the training rows: the eval metrics measure "
            "memory, not generalisation. Evaluate on rows the stage does not train on")
