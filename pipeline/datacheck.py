"""Preflight checks of a stage's data (pipeline/preflight.py runs them): the file or
folder is one the stages read, its rows hold the stage's columns, eval_split means
what it says for that kind of data, one optimizer step (or PPO rollout) of training
rows remains after the evaluation rows are taken out, and label columns are there
where a reward rule compares with labels; evaluation rows that copy training rows are
warned of. Torch-free: rows are read with core/rows.py, Arrow files are counted without
decoding a row.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

from core import kinds
from core.batching import accumulation_steps, rows_per_step
from core.config import PipelineSpec
from core.errors import InvalidInput
from core.rows import (
    SUPPORTED_DATA,
    dataset_folder,
    eval_copies,
    hold_out,
    is_row_file,
    read_rows,
    required_columns,
    select_rows,
)
from core.schemas.reward import RULES_NEEDING_LABELS
from pipeline.hub import FILE_SUFFIXES, Hub, dataset_cached, looks_like_path


@dataclass
class DataFound:
    """What the checks learned of a stage's data, for the checks that follow."""

    rows: int | None = None  # usable rows of data.path (its split): None when not known here
    held_out: bool = False  # the evaluation rows are taken out of them (no eval_split)
    source: str = ""
    records: list = field(default_factory=list)  # (source, usable rows as dicts) read here
    columns: list = field(default_factory=list)  # (source, column names) of dataset folders
    chats: bool = False  # an SFT stage with chat (messages) rows


def check_data(stage, where: str, hub: Hub) -> DataFound:
    data = stage.data
    if data.is_builtin:
        return _check_builtin(stage, where)
    found = DataFound(held_out=data.eval_split is None)
    path = Path(data.path).expanduser()
    if is_row_file(data.path):
        found.records.append(_read_usable(stage, path, f"{where}.data.path", data.path))
        if data.eval_split:
            _check_eval_file(stage, where, found)
    elif path.is_file() or (not path.exists() and Path(data.path).suffix.lower() in FILE_SUFFIXES):
        state = "a" if path.is_file() else "not found; besides, a"
        raise InvalidInput(f"{where}.data.path: {data.path}: {state} {path.suffix} file, which no reader here "
                           f"supports; the data can be {SUPPORTED_DATA}")
    elif path.is_dir():
        _check_dataset_folder(stage, path, where, found)
    elif looks_like_path(data.path):
        raise InvalidInput(f"{where}.data.path: {data.path} not found")
    elif not dataset_cached(data.path, hub.cache):
        hub.refuse_if_unreachable(f"{where}.data.path", f"dataset '{data.path}'", hub.cache.datasets,
                                  offline_vars=("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if found.records:
        source, rows = found.records[0]
        found.rows, found.source = len(rows), source
        found.chats = kinds.get(stage.kind).rows == "completion" and any(
            data.prompt_key not in r or data.response_key not in r for r in rows)
    return found


@contextlib.contextmanager
def _about(where: str):
    """Messages of core/rows.py name the file; these name the field too."""
    try:
        yield
    except InvalidInput as err:
        raise InvalidInput(f"{where}: {err.message}") from None


def _read_usable(stage, path: Path, where: str, name: str) -> tuple[str, list]:
    if not path.is_file():
        raise InvalidInput(f"{where}: data file {name} not found")
    with _about(where):
        rows = read_rows(path)
    rows, _ = select_rows(rows, stage.kind, stage.data, f"{where}: {name}")
    return name, rows


def _check_eval_file(stage, where: str, found: DataFound) -> None:
    """With a data file, eval_split names a second file of evaluation rows."""
    name = stage.data.eval_split
    if not is_row_file(name):
        kind = f"a {Path(name).suffix} file, which no reader here supports" if Path(name).suffix else "a split name"
        raise InvalidInput(
            f"{where}.data.eval_split: '{name}' is {kind}, but data.path is a file, which has no splits: with a "
            f"data file, eval_split names a second file of evaluation rows (e.g. eval.jsonl). Give one, or leave "
            f"eval_split out to hold out eval_fraction ({stage.data.eval_fraction}) of the rows"
        )
    found.records.append(_read_usable(stage, Path(name).expanduser(), f"{where}.data.eval_split", name))


@functools.lru_cache(maxsize=1)
def _digits_splits() -> dict:
    from core import tiny  # torch-free: generates the rows core/tiny.py writes

    return dict(tiny.digits_splits())


def _check_builtin(stage, where: str) -> DataFound:
    data = stage.data
    splits = _digits_splits()
    found = DataFound()
    for field_name, split in (("split", data.split), ("eval_split", data.eval_split or "eval")):
        if split not in splits:
            raise InvalidInput(f"{where}.data.{field_name}: {data.path} has no split '{split}'; "
                               f"its splits: {', '.join(splits)}")
        source = f"{data.path} ({split})"
        rows, _ = select_rows(splits[split], stage.kind, data, f"{where}.data: {source}")
        found.records.append((source, rows))
    found.rows, found.source = len(found.records[0][1]), found.records[0][0]
    return found


def _check_dataset_folder(stage, path: Path, where: str, found: DataFound) -> None:
    data = stage.data
    with _about(f"{where}.data.path"):
        folder = dataset_folder(path)
    if folder.layout == "files":
        return  # datasets names the splits after the files; it reads them at run time
    if folder.layout == "one":
        if data.eval_split:
            raise InvalidInput(
                f"{where}.data.eval_split: {data.path} holds one dataset without splits (saved from a Dataset, "
                f"not a DatasetDict), so split '{data.eval_split}' would be its training rows again. Leave "
                f"eval_split out to hold out eval_fraction ({data.eval_fraction}) of the rows"
            )
        splits = [None]
    else:
        splits = [data.split] + ([data.eval_split] if data.eval_split else [])
        for field_name, split in zip(("split", "eval_split"), splits):
            if split not in folder.splits:
                raise InvalidInput(f"{where}.data.{field_name}: {data.path} has no split '{split}'; "
                                   f"its splits: {', '.join(folder.splits)}")
    for split in splits:
        with _about(f"{where}.data.path"):
            count, columns = folder.count(split)
        source = f"{data.path} ({split})" if split else data.path
        alternatives = required_columns(stage.kind, data)
        if not any(all(column in columns for column, _ in needed) for needed in alternatives):
            wanted = " or ".join("+".join(f"'{c}' (data.{f})" for c, f in needed) for needed in alternatives)
            raise InvalidInput(f"{where}.data: {source} has no column {wanted}; its columns: "
                               f"{', '.join(columns) or 'none'}. Name the right ones under data:")
        found.columns.append((source, columns))
        if found.rows is None:
            found.rows, found.source = count, source
            found.chats = (kinds.get(stage.kind).rows == "completion"
                           and not {data.prompt_key, data.response_key} <= set(columns))


def check_step_rows(spec: PipelineSpec, stage, where: str, found: DataFound) -> None:
    """At least one optimizer step's rows (an RL kind: one rollout's prompts) remain for training."""
    if found.rows is None:
        return
    data = stage.data
    held = max(1, int(found.rows * data.eval_fraction)) if found.held_out else 0
    train = found.rows - held
    detail = f"{found.rows} usable in {found.source}"
    if held:
        detail += f", less {held} held out for evaluation (eval_fraction {data.eval_fraction})"
    if data.max_rows is not None and data.max_rows < train:
        train, detail = data.max_rows, detail + f", cut to max_rows {data.max_rows}"
    processes = spec.cluster.processes_per_node * stage.nodes
    rl = kinds.rollouts_of(stage)
    if rl is not None:
        field = rl.fields.prompts
        needed, unit = rl.prompts, f"one rollout takes: {field} {rl.prompts}"
        fix = f"lower {field} (a multiple of the processes)"
    else:
        dp = stage.data_parallel(processes)
        needed = rows_per_step(stage.global_batch_size, stage.micro_batch_size, dp)
        accumulation = accumulation_steps(stage.global_batch_size, stage.micro_batch_size, dp)
        sharing = f" / sequence_parallel {stage.sequence_parallel}" if stage.sequence_parallel > 1 else ""
        unit = (f"one optimizer step takes: {needed} = micro_batch_size {stage.micro_batch_size} x gradient "
                f"accumulation {accumulation} x {processes} processes{sharing}")
        fix = "lower micro_batch_size or global_batch_size"
    if train < needed:
        raise InvalidInput(f"{where}.data: {train} training rows ({detail}) are fewer than {unit}. "
                           f"Give more rows, or {fix}")


def check_eval_copies(stage, where: str, found: DataFound) -> None:
    """Warn (on stderr; the stage warns again in its log) when evaluation rows are copies of the
    training rows the stage will use: its eval metrics would measure memory. Rows read here
    only: a dataset folder's are compared by the stage."""
    if not found.records or (len(found.records) == 1 and not found.held_out):
        return
    train = found.records[0][1]
    if len(found.records) > 1:
        held_out = found.records[1][1]
    else:
        train, held_out = hold_out(train, stage.data.eval_fraction, stage.seed)
    if stage.data.max_rows:
        train = train[: stage.data.max_rows]
    copies = eval_copies(train, held_out, stage.kind, stage.data)
    if copies:
        print(f"warning: {where}.data: {copies}", file=sys.stderr)


def check_labels(stage, where: str, found: DataFound) -> None:
    """An RL stage's rules that compare with a label need the label column in every row."""
    rl = kinds.rollouts_of(stage)
    if rl is None:
        return
    rules = [r.rule for r in rl.reward.rules if r.rule in RULES_NEEDING_LABELS]
    if not rules:
        return
    key = rl.label_key
    problem = None
    for source, rows in found.records:
        missing = next((n for n, row in enumerate(rows, 1) if key not in row), None)
        if missing is not None:
            problem = f"{source}: usable row {missing} has no '{key}' column"
            break
    for source, columns in found.columns:
        if key not in columns:
            problem = f"{source} has no '{key}' column (its columns: {', '.join(columns)})"
    if problem:
        raise InvalidInput(f"{where}.{rl.fields.label_key}: {problem}, which the {' and '.join(rules)} rule "
                           f"compares completions with. Add the reference answers as that column, or set "
                           f"{rl.fields.label_key} to the column holding them")
