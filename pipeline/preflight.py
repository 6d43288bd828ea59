"""Checks on what a pipeline file points at, before anything is written or submitted:
the models exist and look loadable, the data files exist and hold the columns
each stage needs. Torch-free: it reads config.json and data files as plain files.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import BUILTIN_PREFIX, PipelineSpec
from pipeline.errors import InvalidInput
from pipeline.rows import is_row_file, read_rows, select_rows

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "adapter_model.*")


def check(spec: PipelineSpec) -> None:
    for i, stage in enumerate(spec.stages):
        where = f"stages[{i}] ({stage.name})"
        if stage.model is not None:
            check_model(stage.model, f"{where}.model")
        check_data(stage, where)
        if stage.kind == "ppo":
            check_reward_functions(stage, where)


def looks_like_path(name: str) -> bool:
    """A hub id is `org/name` or `name`; anything else that is not on disk is a missing path."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).suffix in (".json", ".bin")


def check_model(name: str, where: str) -> None:
    if name.startswith(BUILTIN_PREFIX):
        return
    path = Path(name).expanduser()
    if not path.exists():
        if looks_like_path(name):
            raise InvalidInput(f"{where}: model folder {name} does not exist")
        return  # a hub id: fetched by `prepare` on the submit host
    config = path / "config.json"
    if not config.is_file():
        raise InvalidInput(f"{where}: {name} has no config.json; expected a model folder in Hugging Face format")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, OSError) as err:
        raise InvalidInput(f"{where}: {config} is not readable JSON ({err})") from None
    if not model_type:
        raise InvalidInput(f"{where}: {config} has no model_type; is this a Hugging Face model folder?")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise InvalidInput(f"{where}: {name} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")


def check_data(stage, where: str) -> None:
    data = stage.data
    if data.is_builtin:
        return
    files = [("path", data.path)]
    if is_row_file(data.path) and data.eval_split:
        files.append(("eval_split", data.eval_split))
    for field, name in files:
        path = Path(name).expanduser()
        if is_row_file(name):
            if not path.is_file():
                raise InvalidInput(f"{where}.data.{field}: data file {name} not found")
            select_rows(read_rows(path), stage.kind, data, f"{where}.data.{field}: {name}")
        elif not path.exists() and looks_like_path(name):
            raise InvalidInput(f"{where}.data.{field}: {name} not found")


def check_reward_functions(stage, where: str) -> None:
    """Each user reward function's file exists and defines it (read, not run)."""
    from stages.rewards import RewardError, check_function

    for j, rule in enumerate(stage.reward.rules):
        if rule.function:
            try:
                check_function(rule.function)
            except RewardError as err:
                raise InvalidInput(f"{where}.reward.rules[{j}].function: {err}") from None
