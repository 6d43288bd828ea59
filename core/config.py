"""The pipeline file: its schema, loading and validation.

The sections every pipeline shares live here (a stage's common fields and defaults, tracking,
the whole file); each shipped stage kind's own fields are its schema in core/schemas/<kind>.py,
the cluster section is core/cluster_spec.py's, and reading YAML, naming errors and ordering the
stages are core/yaml_file.py's, core/validation_errors.py's and core/stage_graph.py's.

Every field is documented where it is declared; `python -m pipeline validate`
quotes that documentation back to a user who got the field wrong. Relative
paths in a pipeline file (runs_dir, data paths, local models, container) are
resolved against the directory you run the command from.

This module must stay importable on a login node: no torch, no transformers.
"""

from __future__ import annotations

import difflib
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, SerializeAsAny, ValidationError, WrapValidator, field_validator, model_validator

from core import kinds, validation_errors, yaml_file
from core.batching import accumulation_steps, data_parallel
from core.cluster_spec import ApptainerSpec, ClusterSpec, checked_by_schedulers
from core.errors import InvalidInput
from core.sequence_parallel import SHARDABLE_ATTENTION
from core.stage_graph import topological_order, upstream_cycle
from core.strict import Strict

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "pipeline" / "configs"  # the shipped pipeline files
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-llama",)
BUILTIN_DATASETS = ("digits",)


# --------------------------------------------------------------------------- tracking


class WandbSpec(Strict):
    """Weights & Biases logging of every stage (rank 0), beside TensorBoard. Needs the `wandb`
    package where the stages run (pip install wandb); the API key comes from WANDB_API_KEY in
    the environment only."""

    project: str = Field(..., min_length=1, description="W&B project the stages log to (one run per stage).")
    entity: str | None = Field(None, description="W&B team or user; default: the API key's own.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline writes the run under runs/<pipeline>/<stage>/wandb/ (compute nodes often have no "
        "internet; upload later with `wandb sync`); online streams it to W&B while the stage trains.",
    )


class TrackingSpec(Strict):
    """Experiment trackers besides metrics.jsonl and TensorBoard (always written)."""

    wandb: WandbSpec | None = Field(None, description="Log to Weights & Biases too (off when absent).")


# --------------------------------------------------------------------------- stages


class LoraSpec(Strict):
    """Low-rank adapters (peft) instead of full-parameter training."""

    rank: int = Field(16, ge=1, le=1024, description="Rank r of the adapter matrices.")
    alpha: float = Field(32.0, gt=0, description="Scaling numerator: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters.",
    )
    merge: bool = Field(
        True, description="Merge the adapters into the exported model; false keeps model/ as a peft adapter."
    )


class VllmSpec(Strict):
    """vLLM as the rollout engine (generation: vllm, or auto where it picks vLLM): one engine per
    process of the stage, in its job (core/rollout_engine.py)."""

    tensor_parallel: int = Field(
        1, ge=1,
        description="Processes of a node that share one engine's weights (1/N each while sampling) and sample "
        "their prompts together. Divides the processes per node.",
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1,
        description="Share of each GPU's memory the engine may take: its 1/N of the weights plus its KV cache (the "
        "rest of that share). The trained models need the remainder. On a CPU the KV cache is sized from the "
        "stage's sequences instead.",
    )
    sleep: bool = Field(
        False,
        description="Release the engine's weights and KV cache while the actor trains and bring them back for the "
        "next rollout (vLLM's sleep mode; a GPU feature, ignored on a CPU).",
    )


class DataSpec(Strict):
    """Where a stage's rows come from and which columns hold what."""

    path: str = Field(
        ...,
        min_length=1,
        description="A local .jsonl/.json/.parquet/.csv file, a local dataset folder, a Hugging Face "
        "hub id, or builtin:digits (the synthetic task that needs no network).",
    )
    split: str = Field("train", description="Split to train on (hub datasets and builtin:digits).")
    eval_split: str | None = Field(
        None,
        description="Split to evaluate on (hub datasets, dataset folders saved with splits, builtin:digits); "
        "with a data file, a second file of evaluation rows. When absent, eval_fraction of the rows is held out.",
    )
    eval_fraction: float = Field(
        0.05, gt=0, le=0.5, description="Fraction of the training rows held out for evaluation when no eval_split."
    )
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    response_key: str = Field("response", description="Column holding the response text (SFT).")
    messages_key: str = Field(
        "messages", description="Column holding chat messages [{role, content}, ...] (SFT, instead of prompt/response)."
    )
    chosen_key: str = Field("chosen", description="Column holding the preferred response (RM, DPO).")
    rejected_key: str = Field("rejected", description="Column holding the dispreferred response (RM, DPO).")
    chat_template: bool = Field(
        False, description="Format prompts with the tokenizer's chat template instead of plain concatenation."
    )
    max_rows: int | None = Field(None, ge=1, description="Use at most this many training rows.")
    invalid_rows: Literal["error", "skip"] = Field(
        "error",
        description="A row missing a column, with an empty response, or with chosen identical to rejected: "
        "error (stop and name the rows) or skip (leave them out and report how many).",
    )

    @property
    def is_builtin(self) -> bool:
        return self.path.startswith(BUILTIN_PREFIX)

    @field_validator("path")
    @classmethod
    def _check_builtin(cls, value: str) -> str:
        if value.startswith(BUILTIN_PREFIX) and value[len(BUILTIN_PREFIX):] not in BUILTIN_DATASETS:
            raise ValueError(f"no built-in dataset '{value}'; built-in: " + ", ".join(
                BUILTIN_PREFIX + n for n in BUILTIN_DATASETS))
        return value


class TrainingKnobs(Strict):
    """The settings every stage shares; `defaults:` sets them for all stages at once."""

    precision: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Training precision.")
    zero_stage: int = Field(
        2, ge=0, le=3, description="DeepSpeed ZeRO stage: 0 none, 1 optimizer, 2 + gradients, 3 + parameters sharded."
    )
    optimizer_offload: bool = Field(
        False, description="Keep optimizer states in host RAM and step on the CPU (ZeRO stage 1-3)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: far less memory, ~30% more compute."
    )
    checkpoint_offload: bool = Field(
        False, description="With gradient_checkpointing: keep each decoder layer's checkpointed input in pinned "
        "host memory instead of on the GPU, brought back when the backward recomputes the layer (as ALST does): "
        "layers x tokens x hidden x 2 bytes a process leave the GPU for host RAM (`plan` counts it), for two "
        "PCIe copies of each layer's input a micro batch. The same loss and gradients.",
    )
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="Attention kernel; auto = the fastest the model's family supports: "
        "flash_attention_2 when installed and on GPU, else sdpa, else eager (Gemma-2, gpt-oss). A kernel the "
        "model refuses is refused by validate."
    )
    sequence_parallel: int = Field(
        1, ge=1, le=1024,
        description="Processes that share each sequence (Ulysses sequence parallelism, DeepSpeed's ALST): each "
        "holds 1/N of every sequence's tokens and activations, and attention exchanges heads for sequence "
        "between them (all-to-alls of queries, keys and values in and of the output back, in every layer). "
        "The rows are split over processes / N. N must divide the processes and the model's attention heads, "
        "and its key-value heads (or they divide N); consecutive processes share, so N up to the GPUs per "
        "node keeps the exchange inside a node. sft, rm, dpo and ppo (its scoring and training passes; "
        "sampling stays whole-sequence, each process of a group sampling 1/N of the group's prompts); needs "
        "transformers >= 4.51.3 and DeepSpeed >= 0.18 (the current stack, not the pinned one).",
    )
    logits_tile: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Positions whose logits the LM head computes at once for the loss (in the forward, and "
        "again in the backward) instead of all of a micro batch's: memory for tile x vocabulary logits and "
        "their gradient instead of tokens x vocabulary (e.g. 1024 for a 128K vocabulary: 256 MiB in bf16). "
        "The same loss up to rounding; the head's matmul runs once more. sft and dpo (policy and "
        "reference); needs the current stack.",
    )
    mlp_tiles: int | None = Field(
        None, ge=2, le=65_536,
        description="How many tiles each decoder layer's MLP runs a micro batch's positions in (this "
        "process's positions, under sequence_parallel), in the forward and again in the backward, keeping only "
        "the MLP's input: memory for one tile's intermediates (gate, up, their product; positions x "
        "intermediate_size each) instead of all positions'. A count, not a size in positions: under ZeRO-3 "
        "every call of the MLP gathers its weights from all processes, so every process must make the same "
        "number of calls, whatever the width of its lines. The same loss up to rounding; the MLP's forward "
        "runs once more. sft, rm and dpo (policy and reference); needs the current stack.",
    )
    lora: LoraSpec | None = Field(None, description="Train LoRA adapters instead of all parameters.")
    max_len: int = Field(
        2048, ge=8,
        description="Longest tokenised sequence; longer ones lose their last tokens, and rows left with nothing "
        "to learn are dropped (see max_truncated_share).",
    )
    max_truncated_share: float = Field(
        0.1, ge=0, le=1,
        description="Largest share of a stage's rows (train and eval) that max_len may cut: rows that lose tokens, "
        "and rows left with nothing to learn, which are dropped (sft: no response token left; rm, dpo: no response "
        "token left, or chosen and rejected cut to the same tokens; ppo: a prompt with less than max_new_tokens of "
        "room loses tokens, one that fills max_len has nothing to learn). Above it validate, run and the stage "
        "refuse, with the numbers.",
    )
    micro_batch_size: int = Field(
        1, ge=1, le=4096,
        description="Rows per process per forward pass without packing; with packing it sets the default "
        "micro_batch_tokens.",
    )
    packing: bool = Field(
        True,
        description="sft, rm, dpo: pack rows into micro batches by a token budget (micro_batch_tokens), each "
        "sequence kept apart by its own positions and attention, so no compute goes to padding; false pads "
        "micro batches of micro_batch_size rows. Either way the loss is a mean over the whole global batch.",
    )
    micro_batch_tokens: int | None = Field(
        None, ge=8,
        description="With packing: tokens per process per forward pass. Default: micro_batch_size x max_len "
        "(x 2 for rm and dpo, whose rows are pairs). More fills a GPU better and costs activation memory "
        "(see `plan`).",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per optimizer step over all processes; gradient accumulation = "
        "global / (micro_batch_size x processes). Default: one micro batch per process.",
    )
    learning_rate: float = Field(1e-5, gt=0, le=1, description="Peak learning rate.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warm-up: cosine or linear to min_lr_ratio x peak, or constant."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up from 0 to the peak rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW beta1, beta2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 = no clipping).")
    epochs: int = Field(1, ge=1, le=1000, description="Passes over the training rows (unless max_steps is set).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    eval_interval: int = Field(
        0, ge=0, description="Evaluate every N optimizer steps (0 = only before and after training)."
    )
    save_interval: int = Field(
        100, ge=0, description="Write a resumable checkpoint every N optimizer steps and after the last one "
        "(0 = never)."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="How many of the newest checkpoints to keep. An older one is removed only once a newer "
        "one is written and checked against its manifest; a damaged one set aside at resume is never removed."
    )
    log_interval: int = Field(10, ge=1, description="Write a metrics.jsonl line every N optimizer steps.")
    seed: int = Field(42, ge=0, description="Seed for initialisation, data order and sampling.")
    nodes: int = Field(1, ge=1, le=1024, description="Nodes this stage runs on.")
    time: str | None = Field(None, description="Wall-clock limit for this stage's Slurm job; default cluster.time.")
    hang_factor: float = Field(
        20.0, ge=0, description="The hang watchdog. Every phase of a stage is timed (loading, the reference "
        "precompute, evaluation, generation, scoring, the reward functions, a training step (in RL: a rollout and "
        "its update), saving, the export, and the forward passes inside them) from its start or from the end of "
        "the last phase inside it. A phase that goes longer than this many times the median of its own earlier "
        "runs (once it has run 5 times), and at least hang_min_s, is a hang; before that, longer than "
        "hang_first_s. The process writes its Python stacks to its log and says where it hung (phase, step, rank); "
        "the job is requeued, up to cluster.max_retries, then fails. 0 turns the watchdog off.")
    hang_min_s: float = Field(300.0, gt=0, description="The least time a phase that has run 5 times may go "
                              "before it can count as a hang.")
    hang_first_s: float = Field(
        3600.0, gt=0, description="The longest a phase may go before it has run 5 times, with no history to "
        "judge it by: loading the models (a 70B model's 140 GB of bf16 weights read from a shared file system at "
        "40 MB/s), the first evaluations, the first training steps (compilation, caches). Longer is a hang, as "
        "for hang_factor. Raise it when a first phase is slower than that.")
    collective_timeout_s: int = Field(
        1800, ge=10, description="torch.distributed's timeout for one collective (NCCL/gloo): a rank waiting "
        "longer for the others fails.")

    @field_validator("time")
    @classmethod
    def _check_time(cls, value: str | None) -> str | None:
        return value if value is None else checked_by_schedulers("time", value)


class StageDefaults(TrainingKnobs):
    """`defaults:` holds training knobs only; they are merged into every stage."""


class StageBase(TrainingKnobs):
    if TYPE_CHECKING:
        # Every stage has a kind, the registry's key (core/kinds.py). Each kind's schema declares it as
        # its own field, `kind: Literal["<name>"]`, which is what validates it; declared here for the type
        # checker alone, as a field here would add `kind` to every schema as a plain string.
        kind: str

    name: str = Field(..., pattern=NAME_PATTERN,
                      description="Unique stage name; its outputs go to runs/<pipeline>/<name>/.")
    from_: str | None = Field(
        None, alias="from", description="Name of the upstream stage whose exported model this stage starts from."
    )
    model: str | None = Field(
        None,
        description="Model to start from when there is no `from`: a local folder in Hugging Face format, "
        "a hub id, or builtin:tiny-llama.",
    )
    data: DataSpec = Field(..., description="The stage's training (and evaluation) rows.")

    @field_validator("model")
    @classmethod
    def _check_builtin_model(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"is empty ({json.dumps(value)}): give a model folder in Hugging Face format, a hub id or "
                             f"{BUILTIN_PREFIX}{next(iter(BUILTIN_MODELS))}; or leave `model` out and give `from`")
        if value and value.startswith(BUILTIN_PREFIX) and value[len(BUILTIN_PREFIX):] not in BUILTIN_MODELS:
            raise ValueError(f"no built-in model '{value}'; built-in: " + ", ".join(
                BUILTIN_PREFIX + n for n in BUILTIN_MODELS))
        return value

    @model_validator(mode="after")
    def _one_starting_point(self):
        if (self.model is None) == (self.from_ is None):
            raise ValueError("give exactly one of `model` (a model to start from) or `from` (an upstream stage)")
        return self

    @model_validator(mode="after")
    def _shared_sequences_need_a_shardable_attention(self):
        if self.sequence_parallel > 1 and self.attention not in SHARDABLE_ATTENTION:
            raise ValueError(f"sequence_parallel {self.sequence_parallel} needs attention: "
                             f"{' or '.join(SHARDABLE_ATTENTION)}, not {self.attention} (eager attention builds a "
                             f"full mask of its own that the sequence exchange cannot use)")
        return self

    @model_validator(mode="after")
    def _offloads_only_checkpoints(self):
        if self.checkpoint_offload and not self.gradient_checkpointing:
            raise ValueError("checkpoint_offload keeps the checkpointed layer inputs in host memory: it needs "
                             "gradient_checkpointing: true")
        return self

    @model_validator(mode="after")
    def _tiles_only_what_its_kind_tiles(self):
        for name, declared, what in (("logits_tile", "tiled_logits", "logits"), ("mlp_tiles", "tiled_mlp", "MLPs")):
            if getattr(self, name) is not None and not getattr(kinds.get(self.kind), declared):
                able = [k.name for k in kinds.all_kinds() if getattr(k, declared)]
                raise ValueError(f"{name}: a {self.kind} stage does not tile its {what} (kinds that do: "
                                 f"{', '.join(able)}); leave it out")
        return self

    @model_validator(mode="after")
    def _a_row_fits_a_micro_batch(self):
        per_row = kinds.get(self.kind).sequences_per_row
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < self.max_len * per_row:
            raise ValueError(f"micro_batch_tokens {self.micro_batch_tokens} cannot hold one row of max_len "
                             f"{self.max_len} tokens{' x 2 (a pair)' if per_row == 2 else ''}: give at least "
                             f"{self.max_len * per_row}, or lower max_len")
        return self

    @property
    def upstream_references(self) -> list[tuple[str, str]]:
        """(field, stage name) of each upstream stage this stage names: the one it starts from, and an
        RL kind's reward model (core/kinds.py Rollouts)."""
        named = [("from", self.from_)] if self.from_ else []
        rl = kinds.rollouts_of(self)
        if rl is not None and rl.reward_model:
            named.append((f"{rl.fields.reward}.model", rl.reward_model))
        return named

    @property
    def needs_reference(self) -> bool:
        """Does the stage hold a frozen copy of its starting model? Its kind says (core/kinds.py)."""
        return kinds.get(self.kind).frozen_reference

    def plan_notes(self) -> list[str]:
        """What the planner's time for this stage does not cover (a kind adds its own)."""
        return []

    def code_files(self) -> list[tuple[str, str]]:
        """(field, file) of the user's code the stage runs (an RL kind's reward functions): part of its
        inputs."""
        rl = kinds.rollouts_of(self)
        if rl is None:
            return []
        return [(f"{rl.fields.reward}.rules[{j}].function", rule.function.rpartition(":")[0])
                for j, rule in enumerate(rl.reward.rules) if rule.function]

    def check_layout(self, where: str, processes: int) -> None:
        """Raise ValueError (naming `where`.field) when the stage's batches cannot be laid out over
        `processes`; what is common to every kind, then what a kind adds (override and call super)."""
        if self.sequence_parallel > 1 and not kinds.get(self.kind).sequence_parallel:
            able = [k.name for k in kinds.all_kinds() if k.sequence_parallel]
            raise ValueError(f"{where}.sequence_parallel: a {self.kind} stage cannot share its sequences over "
                             f"processes yet (kinds that can: {', '.join(able)}); leave it at 1")
        try:
            dp = data_parallel(processes, self.sequence_parallel)
        except ValueError as err:
            raise ValueError(f"{where}.sequence_parallel: {err}") from None
        try:
            accumulation_steps(self.global_batch_size, self.micro_batch_size, dp)
        except ValueError as err:
            raise ValueError(f"{where}.global_batch_size: {err}") from None
        rollouts = kinds.get(self.kind).rollouts
        if rollouts is not None:
            rollouts.check_layout(self, where, processes)

    def data_parallel(self, processes: int) -> int:
        """Of the stage's processes, how many train on different rows (the others share sequences)."""
        return data_parallel(processes, self.sequence_parallel)

    @property
    def upstream(self) -> list[str]:
        """Stages whose outputs this stage needs."""
        return [name for _, name in self.upstream_references]


def _stage_of_its_kind(value: Any, handler, info) -> Any:
    """A stage is validated by its kind's schema (core/kinds.py): errors point into that schema's
    fields, and a kind nobody declared is named with the ones there are."""
    if isinstance(value, StageBase):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"a stage is a mapping with name, kind and its settings, not {type(value).__name__}")
    if "kind" not in value:
        raise ValueError(f"kind: required but missing; one of {', '.join(kinds.names())}")
    try:
        kind = kinds.get(value["kind"])
    except KeyError as err:
        raise ValueError(f"kind: {err.args[0]}") from None
    return kind.schema.model_validate(value)


# A stage of any registered kind, validated by that kind's schema and saved with all its fields.
Stage = Annotated[SerializeAsAny[StageBase], WrapValidator(_stage_of_its_kind)]


class PipelineSpec(Strict):
    """A pipeline file: stages run in order, each starting from the one it names."""

    name: str = Field(..., pattern=NAME_PATTERN, description="Pipeline name; outputs go to <runs_dir>/<name>/.")
    runs_dir: str = Field("runs", description="Folder that holds every pipeline's run folder.")
    container: str | None = Field(
        None,
        description="Apptainer image (.sif) the Slurm stage jobs run in; absent = the host python. "
        "The local executor always runs the host python.",
    )
    apptainer: ApptainerSpec = Field(
        default_factory=ApptainerSpec, description="How stage jobs run inside `container`."
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Where and how stages run.")
    plugins: list[str] = Field(
        [],
        description="Python modules (dotted names) that declare more stage kinds (core/kinds.py: a schema, "
        "rows, headline, run), imported before the stages are read; they must be importable here and where "
        "the stages run.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment tracking besides metrics.jsonl and TensorBoard, e.g. {wandb: {project: my-lab}}.",
    )
    defaults: StageDefaults = Field(
        default_factory=StageDefaults, description="Training knobs merged into every stage (a stage's own value wins)."
    )
    stages: list[Stage] = Field(..., min_length=1, description="The stages, in the order they run.")

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        """Copy each key set under `defaults:` into every stage that does not set it."""
        if not isinstance(data, dict):
            return data
        defaults = data.get("defaults") or {}
        stages = data.get("stages")
        if not isinstance(defaults, dict) or not isinstance(stages, list):
            return data
        knobs = set(TrainingKnobs.model_fields)
        merged = []
        for stage in stages:
            if isinstance(stage, dict):
                stage = {**{k: v for k, v in defaults.items() if k in knobs}, **stage}
            merged.append(stage)
        return {**data, "stages": merged}

    @model_validator(mode="after")
    def _check_graph(self):
        names = [s.name for s in self.stages]
        seen: set[str] = set()
        for i, stage in enumerate(self.stages):
            if stage.name in seen:
                raise ValueError(f"stages[{i}]: stage name '{stage.name}' is used twice")
            seen.add(stage.name)
        kind_of = {s.name: s.kind for s in self.stages}
        for i, stage in enumerate(self.stages):
            for field, up in stage.upstream_references:
                if up not in names:
                    close = difflib.get_close_matches(up, names, n=1)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    raise ValueError(
                        f"stages[{i}] ({stage.name}).{field}: no stage named '{up}'{hint}; stages: {', '.join(names)}"
                    )
                if field == "reward.model" and kinds.get(kind_of[up]).trained_head != "scalar":
                    raise ValueError(f"stages[{i}] ({stage.name}).reward.model: '{up}' is a {kind_of[up]} stage, "
                                     "not a reward model (kind: rm)")
        order = topological_order(self.stages)
        if order is None:
            around = upstream_cycle(self.stages)
            raise ValueError(f"the stages' `from` references form a cycle: {' -> '.join(around)} (each starts from "
                             f"the next); one of them must start from a `model` instead")
        world = self.cluster.processes_per_node
        for i, stage in enumerate(self.stages):
            stage.check_layout(f"stages[{i}] ({stage.name})", world * stage.nodes)
        return self

    def stage(self, name: str):
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name


# --------------------------------------------------------------------------- loading


def resolve_config_path(config: str) -> Path:
    """CONFIG is a path, or a name under pipeline/configs/ with or without .yaml."""
    candidates = [Path(config)]
    if not config.endswith((".yaml", ".yml")):
        candidates.append(Path(config + ".yaml"))
    candidates += [CONFIGS_DIR / c.name for c in list(candidates)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
    raise InvalidInput(f"{config}: no such pipeline file (shipped pipelines: {shipped})")


def load_pipeline(config: str) -> PipelineSpec:
    """Read and validate a pipeline file; raises InvalidInput with a message for people."""
    path = resolve_config_path(config)
    raw = yaml_file.read(path)
    if not isinstance(raw, dict):
        raise InvalidInput(f"{path}: expected a mapping with name, cluster, defaults and stages at the top")
    import_plugins(path, raw.get("plugins"))
    try:
        return PipelineSpec.model_validate(raw)
    except ValidationError as err:
        raise InvalidInput(validation_errors.described(path, raw, err, PipelineSpec, StageBase)) from None


def import_plugins(path: Path, plugins: Any) -> None:
    """Import the modules `plugins:` names, so the stage kinds they declare are known."""
    if not plugins:
        return
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise InvalidInput(f"{path}: plugins: a list of Python module names, e.g. [my_lab.kto_stage]")
    for i, name in enumerate(plugins):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001  whatever the module raises, the user's message says where
            raise InvalidInput(f"{path}: plugins[{i}]: cannot import '{name}' ({type(err).__name__}: {err}). "
                               "Put its folder on PYTHONPATH, here and where the stages run") from None


