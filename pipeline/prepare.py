"""Fetch the models and datasets a pipeline names by hub id, on the submit host.

Compute nodes often have no internet, so `prepare` (which `run` does before it
submits to Slurm) downloads them into the Hugging Face cache the jobs share
(pipeline/hfcache.py says where), and the jobs run with HF_HUB_OFFLINE=1 and
HF_DATASETS_OFFLINE=1: they read the cache and never try the network.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from core.config import PipelineSpec
from core.errors import InvalidInput
from core.rows import is_row_file
from pipeline.hfcache import HFCache

# Weights in formats transformers does not load for PyTorch, and the duplicate
# checkpoints some repositories ship for other code bases (Llama's original/).
IGNORED_MODEL_FILES = ["original/*", "*.pth", "*.msgpack", "*.h5", "*.ot", "*.onnx", "onnx/*", "*.gguf", "*.tflite"]


@dataclass(frozen=True)
class HubInput:
    where: str  # the pipeline field that names it, e.g. stages[0] (sft).model
    kind: str  # model | dataset
    name: str  # the hub id
    splits: tuple[str, ...] = ()


def hub_inputs(spec: PipelineSpec) -> list[HubInput]:
    """Models and datasets that are neither built in nor on disk: hub ids."""
    found: dict[tuple[str, str], HubInput] = {}
    for i, stage in enumerate(spec.stages):
        where = f"stages[{i}] ({stage.name})"
        if stage.model and _is_hub_id(stage.model):
            found.setdefault(("model", stage.model), HubInput(f"{where}.model", "model", stage.model))
        data = stage.data
        if _is_hub_id(data.path) and not is_row_file(data.path):
            splits = tuple(s for s in (data.split, data.eval_split) if s)
            key = ("dataset", data.path)
            if key in found:
                splits = tuple(dict.fromkeys(found[key].splits + splits))
            found[key] = HubInput(f"{where}.data.path", "dataset", data.path, splits)
    return list(found.values())


def _is_hub_id(name: str) -> bool:
    return not name.startswith("builtin:") and not Path(name).expanduser().exists()


def fetch(spec: PipelineSpec, cache: HFCache, echo=print) -> list[HubInput]:
    """Download every hub input into `cache`; raises InvalidInput naming the field."""
    inputs = hub_inputs(spec)
    home = cache.home
    if not inputs:
        echo("prepare: nothing to fetch (every model and dataset is local or built in)")
        return inputs
    home.mkdir(parents=True, exist_ok=True)
    # The hub libraries read these when first imported (datasets downloads through the hub
    # cache, and keeps its modules under HF_HOME): make them the jobs' cache, as the jobs see it.
    os.environ.update(cache.env())
    for item in inputs:
        echo(f"prepare: fetching {item.kind} {item.name} into {home}")
        try:
            if item.kind == "model":
                download_model(item.name, cache.hub)
            else:
                download_dataset(item.name, item.splits, cache.datasets)
        except Exception as err:  # noqa: BLE001 -- any failure is reported against the field
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise InvalidInput(
                f"{item.where}: cannot fetch {item.kind} '{item.name}' from the Hugging Face hub into {home}: "
                f"{type(err).__name__}: {reason}"
            ) from None
    return inputs


def download_model(repo_id: str, hub: Path) -> None:
    from huggingface_hub import HfApi, snapshot_download

    ignored = list(IGNORED_MODEL_FILES)
    if any(f.endswith(".safetensors") for f in HfApi().list_repo_files(repo_id)):
        ignored.append("*.bin")  # transformers loads the safetensors copy
    snapshot_download(repo_id, cache_dir=str(hub), ignore_patterns=ignored)


def download_dataset(name: str, splits: tuple[str, ...], datasets_cache: Path) -> None:
    import datasets

    for split in splits:
        datasets.load_dataset(name, split=split, cache_dir=str(datasets_cache))
