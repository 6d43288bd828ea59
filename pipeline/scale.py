"""A scale model of a pipeline: the same file, run for real, with every model it starts from
replaced by a random-init model of the same architecture, only narrower.

`python -m pipeline run FILE --scale-model [--scale-head-dim D]` (and validate, plan, status,
report, cancel, clean, prepare, run-stage with the same flags) runs FILE as written — its cluster,
GPUs and nodes, ZeRO stage, offload, checkpointing, reference mode, batch sizes, save interval,
data — on a model that keeps the real one's layers, attention and key-value heads, vocabulary,
positions and rope settings, with a head dimension of D (default 8) instead of 128: hidden size
heads x D, the MLP narrowed in proportion. A 34B Llama becomes ~0.16B parameters: the job's
real layout (ranks, nodes, 48 layers gathered one by one under ZeRO-3, the reference pass,
checkpoints, preemption, export) runs in minutes before the real one queues for days.

Outputs go to runs/<name>-scale/, apart from the real run's. The scale models are written there
once (core/runfolder.py: scale_model_folder), by `python -m stages.scale_model` in a child
process of this python, which needs torch and transformers (pipeline/ itself stays torch-free).
The tokenizer is the real model's when its files are on this machine (a local folder or the
Hugging Face cache); otherwise a byte-level stand-in, so every text tokenises, though into more
tokens than the real tokenizer makes (`max_len` then cuts sooner; the message says so).
Torch-free.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from core.config import BUILTIN_PREFIX, PipelineSpec
from core.errors import InvalidInput
from core.runfolder import DESCRIPTION_FILE, scale_model_folder
from core.shapes import builtin_config
from pipeline.hfcache import HFCache
from pipeline.preflight import model_folder

DEFAULT_HEAD_DIM = 8  # flash-attention's kernels and tensor cores want a multiple of 8
NAME_SUFFIX = "-scale"
SEED = 0  # the same weights every time: runs of one scale model at different layouts compare
BUILD_TIMEOUT_S = 600
REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # either is a tokenizer transformers loads


def scaled(spec: PipelineSpec, cache: HFCache, head_dim: int = DEFAULT_HEAD_DIM, build: bool = True,
           echo=None) -> PipelineSpec:
    """The pipeline with its name suffixed and each stage's `model:` replaced by its scale model's
    folder, written first when `build` (commands that only read the run folder pass False). What
    was written is said on stderr (`echo`), so `plan --json` keeps stdout for its JSON."""
    echo = echo or (lambda line: print(line, file=sys.stderr))
    if head_dim < 2 or head_dim % 2:
        raise InvalidInput(f"--scale-head-dim {head_dim}: rotary embeddings need an even head dimension of at least 2")
    name = spec.name + NAME_SUFFIX
    pipeline_dir = (Path(spec.runs_dir) / name).resolve()
    stages = []
    for i, stage in enumerate(spec.stages):
        if stage.model is None or stage.model.startswith(BUILTIN_PREFIX):
            stages.append(stage)  # starts from an upstream stage, or from the built-in tiny model
            continue
        where = f"stages[{i}] ({stage.name}).model"
        description = describe(stage.model, cache, head_dim, where)
        folder = scale_model_folder(pipeline_dir, stage.model, head_dim)
        if build:
            write(folder, description, echo)
        stages.append(stage.model_copy(update={"model": str(folder)}))
    return spec.model_copy(update={"name": name, "stages": stages})


def describe(model: str, cache: HFCache, head_dim: int, where: str) -> dict:
    """What the scale model of `model` is built from: the narrowed config.json and the folder
    holding the real tokenizer (None: the byte-level stand-in)."""
    folder = model_folder(model, cache)
    folder = folder.resolve() if folder is not None else None
    if folder is not None and (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise InvalidInput(f"{where}: {folder / 'config.json'} is not readable JSON ({err})") from None
    elif builtin_config(model) is not None:
        config = builtin_config(model)
    else:
        raise InvalidInput(
            f"{where}: a scale model keeps {model}'s architecture, but its config.json is not on this machine "
            f"(not a local folder, not in the Hugging Face cache {cache.hub}, not a built-in shape). Fetch it "
            f"first: huggingface-cli download {model} config.json tokenizer.json tokenizer_config.json")
    tokenizer = folder if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES) else None
    return {"source": model, "head_dim": head_dim, "seed": SEED,
            "config": narrowed(config, head_dim, where),
            "tokenizer": str(tokenizer) if tokenizer is not None else None}


def narrowed(config: dict, head_dim: int, where: str) -> dict:
    """config.json with head dimension `head_dim`: hidden = heads x head_dim, the MLP in the same
    proportion to it as in the real model; every other field as it was."""
    if "text_config" in config:
        raise InvalidInput(f"{where}: a scale model of a multimodal model (text_config) is not supported")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size") if k not in config]
    if missing:
        raise InvalidInput(f"{where}: its config.json has no {', '.join(missing)}; is it a decoder language model?")
    heads, real_hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    hidden = heads * head_dim
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "_name_or_path")}
    out["hidden_size"] = hidden
    for width in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(width):
            out[width] = max(1, round(int(config[width]) * hidden / real_hidden))
    if "head_dim" in config:
        out["head_dim"] = head_dim
    return out


def write(folder: Path, description: dict, echo) -> None:
    """Write the scale model (weights, config, tokenizer) into `folder`, unless it already holds
    this description's model; a folder built from another description is replaced."""
    recorded = folder / DESCRIPTION_FILE
    if recorded.is_file() and (folder / ".complete").exists():
        try:
            if json.loads(recorded.read_text()) == description:
                return
        except (OSError, json.JSONDecodeError):
            pass
    shutil.rmtree(folder, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    request = json.dumps({"folder": str(folder), "description": description})
    try:
        done = subprocess.run([sys.executable, "-m", "stages.scale_model"], input=request, capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise InvalidInput(f"writing the scale model of {description['source']} into {folder} took longer than "
                           f"{BUILD_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise InvalidInput(f"cannot write the scale model of {description['source']} into {folder}: {last}. It is "
                           f"built with this python ({sys.executable}), which needs torch and transformers")
    echo(done.stdout.strip().splitlines()[-1])


