"""Checks on what a pipeline file points at, before anything is written or submitted:
whatever would make a stage fail, or train on nothing, and can be known without
training. `validate`, `run` and `prepare` call `check`; each refusal is an
InvalidInput (exit 2) naming the field, file or row, what is wrong and what to do.

- runs_dir: a folder that exists or can be created, writable (tried: a folder with a
  file is made there and removed).
- models: local folders hold a config.json, weights whose headers are whole
  (pipeline/modelfiles.py) and whose names and shapes config.json describes (as far as
  pipeline/weightnames.py can tell), and a tokenizer; hub ids are in the local cache, or
  the hub answers (local runs only: a Slurm `run` fetches them itself); max_len within
  the model's positions; an attention kernel the model's family supports; a chat
  template where the stage formats chats.
- `from:` and `reward.model`: an upstream export the stage can start from.
- data: a supported file (UTF-8, every row with the stage's columns), a dataset
  folder (its splits and columns), builtin:digits; eval_split as the data's kind
  means it; enough training rows for one optimizer step (or one PPO rollout);
  label columns where a reward rule compares with labels.
- reward functions: the file defines the function, and imports in a child process
  with a time limit (the child's python is the one the stages run with).
- reward models: one that has finished and ranked its held-out pairs no better than
  chance is refused unless the RL stage allows it (core/reward_quality.py).

Torch-free: files are read as plain files, the reward import runs in a child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from core import failure, kinds, reward_quality, rollout_engine, sequence_parallel
from core.config import BUILTIN_PREFIX, PipelineSpec
from core.errors import InvalidInput
from core.families import attention_kernel, attention_refusal, installed_transformers
from core.shapes import ShapeNotFound, cached_config, resolve_shape
from core.task import is_finished
from pipeline import graph, truncation, weightnames
from pipeline.datacheck import check_data, check_eval_copies, check_labels, check_step_rows
from pipeline.hfcache import HFCache, hf_cache
from pipeline.hub import Hub, looks_like_path
from pipeline.modelfiles import BadModelFile, has_chat_template, tokenizer_problem, weight_files, weights_in

REWARD_IMPORT_TIMEOUT_S = 30.0


def check(spec: PipelineSpec, executor, fetching: bool = False) -> None:
    """Refuse (InvalidInput) what would fail after training started. `executor`: where the
    stages run (pipeline/executors/): whether `run` fetches the hub ids first, whether the
    stages run with this python. `fetching`: called by `prepare`, which downloads the hub ids
    the cache lacks, so they are not refused."""
    check_runs_dir(spec)
    cache = hf_cache(spec)
    hub = Hub(offline_refused=not (fetching or executor.fetches_before_run), cache=cache)
    for i, stage in enumerate(spec.stages):
        where = f"stages[{i}] ({stage.name})"
        if stage.model is not None:
            check_model(stage.model, f"{where}.model", hub)
        check_upstream(spec, stage, where, cache)
        root = root_model(spec, stage)
        check_positions(stage, root, where, cache)
        check_attention(spec, stage, root, where, cache)
        check_sequence_parallel(spec, stage, root, where, cache, spec.cluster.processes_per_node * stage.nodes,
                                stack_is_here=executor.runs_this_python(spec))
        check_tiles(stage, where, stack_is_here=executor.runs_this_python(spec))
        check_rollout_engine(stage, where, stack_is_here=executor.runs_this_python(spec))
        found = check_data(stage, where, hub)
        check_chat_template(stage, root, where, found.chats, cache)
        check_step_rows(spec, stage, where, found)
        check_eval_copies(stage, where, found)
        if kinds.get(stage.kind).rollouts is not None:  # its rewards read labels and may call your functions
            check_labels(stage, where, found)
            check_reward_functions(stage, where, imported=executor.runs_this_python(spec))
            check_reward_model(spec, stage, where)
    truncation.check(spec, cache)  # last: it tokenises rows, in a subprocess


# --------------------------------------------------------------------------- runs_dir


def check_runs_dir(spec: PipelineSpec) -> None:
    """The pipeline's run folder exists as a writable folder or can be made in one: a folder with
    a file in it is made and removed where `run` will make its first one, so a read-only file
    system, a folder that is not ours, or one that takes no folders (/proc) is found as `run`
    would find it, for root too."""
    folder = spec.run_dir.resolve()  # as `run` makes it
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise InvalidInput(f"runs_dir: {existing} is a file, so the run folder {folder} cannot be made there; "
                           "set runs_dir to a folder (or move the file away)")
    code = failure.cannot_make_in(existing)
    if code is not None:
        made = "written in" if existing == folder else f"created in {existing}"
        raise InvalidInput(f"runs_dir: the run folder {folder} cannot be {made}: "
                           f"{failure.cannot_make_reason(code, existing)}; set runs_dir (now '{spec.runs_dir}') "
                           "to a folder you can write")


# --------------------------------------------------------------------------- models


def check_model(name: str, where: str, hub: Hub) -> None:
    if name.startswith(BUILTIN_PREFIX):
        return
    path = Path(name).expanduser()
    if not path.exists():
        if looks_like_path(name):
            raise InvalidInput(f"{where}: model folder {name} does not exist")
        if cached_config(name, hub.cache.hub) is None:
            hub.refuse_if_unreachable(where, f"model '{name}'", hub.cache.hub,
                                      offline_vars=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
        return
    config = path / "config.json"
    if not config.is_file():
        raise InvalidInput(f"{where}: {name} has no config.json; expected a model folder in Hugging Face format")
    try:
        described = json.loads(config.read_text())
    except (ValueError, OSError) as err:
        raise InvalidInput(f"{where}: {config} is not readable JSON ({err})") from None
    if not isinstance(described, dict) or not described.get("model_type"):
        raise InvalidInput(f"{where}: {config} has no model_type; is this a Hugging Face model folder?")
    try:
        if not weight_files(path):
            raise BadModelFile(f"{name} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")
        tensors = weights_in(path)
    except BadModelFile as err:
        raise InvalidInput(f"{where}: {err}") from None
    contradiction = tensors and weightnames.mismatch(described, tensors)
    if contradiction:
        raise InvalidInput(f"{where}: {config}: {contradiction}. The stage would train from random numbers where "
                           "they differ: put the config.json saved with these weights beside them, or point "
                           "`model:` at the folder you meant")
    problem = tokenizer_problem(path)
    if problem:
        raise InvalidInput(f"{where}: {problem}")


def root_model(spec: PipelineSpec, stage) -> str:
    """The model a chain of `from:` starts at: its tokenizer and shape are every export's."""
    while stage.model is None:
        stage = spec.stage(stage.from_)
    return stage.model


def model_folder(name: str, cache: HFCache) -> Path | None:
    """The folder holding a model's files on this machine: a local folder or a cached hub snapshot."""
    if name.startswith(BUILTIN_PREFIX):
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    config = cached_config(name, cache.hub)
    return config.parent if config is not None else None


def shape_of(name: str, cache: HFCache):
    try:
        return resolve_shape(name, cache.hub)
    except (ShapeNotFound, ValueError):
        return None  # an unknown model: nothing to compare with


def check_positions(stage, root: str, where: str, cache: HFCache) -> None:
    shape = shape_of(root, cache)
    if shape is not None and shape.max_positions and stage.max_len > shape.max_positions:
        source = f" (max_position_embeddings in {shape.source})" if shape.source != root else ""
        raise InvalidInput(
            f"{where}.max_len: {stage.max_len} tokens is beyond the {shape.max_positions} positions of model "
            f"{root}{source}: positions past them were never trained. Set max_len to {shape.max_positions} or less"
        )


def check_sequence_parallel(spec: PipelineSpec, stage, root: str, where: str, cache: HFCache, processes: int,
                            stack_is_here: bool) -> None:
    """Processes can share the stage's sequences: the heads of every model it runs (its own, and
    the upstream ones it loads: ppo's reward model, which scores shared batches too) split over
    them, and the stack has Ulysses attention (checked here where the stages run with this python;
    a container's stack is checked by the stage itself when it starts)."""
    if stage.sequence_parallel == 1:
        return
    for model, which in loaded_models(spec, stage, root).items():
        shape = shape_of(model, cache)
        problem = shape and sequence_parallel.share_problem(shape.heads, shape.kv_heads, processes,
                                                            stage.sequence_parallel)
        if problem:
            raise InvalidInput(f"{where}.sequence_parallel: {problem} (model {model}{which})")
    problem = stack_is_here and sequence_parallel.stack_problem()
    if problem:
        raise InvalidInput(f"{where}.{problem}")


def loaded_models(spec: PipelineSpec, stage, root: str) -> dict[str, str]:
    """The models a stage loads (its own, and the upstream ones: ppo's reward model), each with
    what to call it in a message ("" for its own)."""
    models = {root: ""}
    for field, name in stage.upstream_references:
        models.setdefault(root_model(spec, spec.stage(name)), f", the {field}")
    return models


def check_attention(spec: PipelineSpec, stage, root: str, where: str, cache: HFCache) -> None:
    """Every model the stage loads supports its attention kernel in the transformers installed here
    (transformers refuses, e.g., sdpa for Gemma-2 from 5.21 on only when the stage loads the model:
    core/families.py attention_refusal), and one that shares sequences (sequence_parallel) by the
    kernel it runs where the stage runs."""
    on_gpu, version = bool(spec.cluster.gpus_per_node), installed_transformers()
    for model, which in loaded_models(spec, stage, root).items():
        shape = shape_of(model, cache)
        if shape is None:
            continue
        refusal = attention_refusal(stage.attention, shape.model_type, version)
        if refusal:
            raise InvalidInput(f"{where}.attention: model {model}{which}: {refusal}")
        kernel = attention_kernel(stage.attention, shape.model_type, on_gpu, transformers_version=version)
        if stage.sequence_parallel > 1 and kernel not in sequence_parallel.SHARDABLE_ATTENTION:
            raise InvalidInput(f"{where}.sequence_parallel: model {model}{which} runs {kernel} attention "
                               f"{'on GPUs' if on_gpu else 'on CPU'} (the fastest its family supports there), "
                               "which cannot share sequences: sequence_parallel needs sdpa or flash_attention_2")


def check_tiles(stage, where: str, stack_is_here: bool) -> None:
    """The stack can tile the LM head's logits and the MLPs as the stage asks (checked where the
    stages run with this python; a container's stack is checked by the stage itself when it starts)."""
    problem = stack_is_here and sequence_parallel.tiles_problem(stage)
    if problem:
        raise InvalidInput(f"{where}.{problem}")


def check_rollout_engine(stage, where: str, stack_is_here: bool) -> None:
    """The stack has vLLM where the stage samples with it (checked where the stages run with this
    python; a container's stack is checked by the stage itself when it starts)."""
    rl = kinds.rollouts_of(stage)
    if rl is None or rl.engine != "vllm" or not stack_is_here:
        return
    assert rl.fields.engine is not None  # a kind whose rollouts name an engine has the field
    problem = rollout_engine.stack_problem(rl.fields.engine)
    if problem:
        raise InvalidInput(f"{where}.{problem}")


def check_upstream(spec: PipelineSpec, stage, where: str, cache: HFCache) -> None:
    """The upstream exports this stage loads are models it can load (stages/engine.py export)."""
    for field_name, name in stage.upstream_references:
        upstream = spec.stage(name)
        if upstream.lora is not None and not upstream.lora.merge:
            raise InvalidInput(
                f"{where}.{field_name}: stage '{name}' has lora.merge: false, so its model/ is a peft adapter "
                f"without the model it adapts, which transformers cannot load as the model this stage starts "
                f"from. Set lora.merge: true in stage '{name}' (the default: adapters merged into the model)"
            )
        if (field_name == "from" and kinds.get(upstream.kind).trained_head == "scalar"
                and kinds.get(stage.kind).trained_head == "lm"):
            shape = shape_of(root_model(spec, upstream), cache)
            if shape is None or not shape.tied_embeddings:
                raise InvalidInput(
                    f"{where}.from: stage '{name}' trains a reward model: its model/ is a sequence classifier "
                    f"(a score head and no language-model head), so this {stage.kind} stage would start with an "
                    f"untrained output layer. Start it from the stage '{name}' starts from, and name '{name}' "
                    "under reward.model where a reward is wanted"
                )


def check_chat_template(stage, root: str, where: str, chats: bool, cache: HFCache) -> None:
    """Prompts formatted with the chat template (data.chat_template, or chat rows of an SFT
    stage) need a tokenizer that has one."""
    if not (stage.data.chat_template or chats):
        return
    folder = model_folder(root, cache)
    if folder is None or has_chat_template(folder):
        return
    if stage.data.chat_template:
        field_name = "data.chat_template"
        fix = "set data.chat_template: false to join prompt and response as plain text"
    else:
        field_name, fix = "data.messages_key", "give prompt/response rows instead"
    raise InvalidInput(
        f"{where}.{field_name}: the tokenizer of {root} has no chat template (no chat_template in "
        f"{folder / 'tokenizer_config.json'}, no chat_template.jinja), and this stage formats chats with it. "
        f"Add one (tokenizer.chat_template = ...; tokenizer.save_pretrained(folder)), or {fix}"
    )


# --------------------------------------------------------------------------- rewards


def check_reward_functions(stage, where: str, imported: bool = True) -> None:
    """Each user reward function's file exists and defines it (read, not run); then, where
    the stage runs with this python, it imports in a child process with a time limit."""
    from core.rewards import RewardError, check_function, split_reference

    rl = kinds.rollouts_of(stage)
    assert rl is not None, "checked for RL stages only"
    imported_files = set()
    for j, rule in enumerate(rl.reward.rules):
        if not rule.function:
            continue
        field_name = f"{where}.{rl.fields.reward}.rules[{j}].function"
        try:
            check_function(rule.function)
        except RewardError as err:
            raise InvalidInput(f"{field_name}: {err}") from None
        path = split_reference(rule.function)[0]
        if imported and path not in imported_files:
            imported_files.add(path)
            problem = import_problem(rule.function)
            if problem:
                raise InvalidInput(f"{field_name}: {problem}")


def check_reward_model(spec: PipelineSpec, stage, where: str) -> None:
    """A reward model stage that has already finished with this spec, and ranked its held-out pairs no
    better than chance, is refused here rather than when the RL stage starts (core/reward_quality.py)."""
    rl = kinds.rollouts_of(stage)
    assert rl is not None, "checked for RL stages only"
    name = rl.reward_model
    if name is None:
        return
    tasks = {t.name: t for t in graph.build_tasks(spec)}
    if is_finished(tasks[name]):
        reward_quality.check(stage, spec.run_dir.resolve(), where)


IMPORT_CODE = "import sys; from core.rewards import load_function; load_function(sys.argv[1])"


def import_problem(reference: str, timeout_s: float = REWARD_IMPORT_TIMEOUT_S) -> str | None:
    """Why `path.py:function` does not import as the stage imports it (None when it does),
    found in a child process that is killed after timeout_s."""
    from core.rewards import split_reference

    path = split_reference(reference)[0]
    code_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code_root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", IMPORT_CODE, reference], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)  # its own process group: a timeout ends all of it
    try:
        _, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        child.communicate()
        return (f"importing {path} did not finish within {timeout_s:.0f} s; code at the top level of the file "
                "runs at import: move what waits (downloads, input, servers) into the function")
    if child.returncode == 0:
        return None
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit code {child.returncode}"
    frames = [line for line in lines if line.startswith('File "') and ", line " in line]
    at = [f.split(", line ")[1].split(",")[0] for f in frames if Path(f[6:f.index('"', 6)]).resolve() == path.resolve()]
    place = f" (line {at[-1]})" if at else ""
    return (f"importing {path} fails{place}: {last}. The stage imports it with this python "
            f"({sys.executable}): fix the file, or install what it imports")
