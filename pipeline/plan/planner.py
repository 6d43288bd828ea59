"""A plan for every stage of a pipeline: which model each stage trains, what an RL
stage holds besides it, the estimate, the warnings, the fixes, and the refusal
(exit 3) of a pipeline with a stage that does not fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from core import calibration as calibration_file
from core import kinds
from core.errors import DoesNotFit, InvalidInput
from core.rows import is_row_file
from core.sequence_parallel import share_problem
from core.shapes import ModelShape, resolve_shape
from pipeline import lengths as row_lengths
from pipeline.hfcache import hf_cache
from pipeline.plan.estimate import Estimate, estimate_stage, stage_models
from pipeline.plan.fixes import Suggestion, settings_relaxed, suggest
from pipeline.plan.inputs import Hardware, Knobs, PPOWorkload
from pipeline.plan.memory import Memory, trainable_tensors
from pipeline.plan.report import shortfall_text
from pipeline.plan.timing import TimeEstimate, checkpoint_save_seconds, signal_lead_seconds


@dataclass
class StagePlan:
    stage: str
    kind: str
    model: str
    shape: ModelShape
    knobs: Knobs
    hardware: Hardware
    world: int  # processes
    trained_params: int
    total_params: int
    estimate: Estimate
    suggestions: list[Suggestion]
    warnings: list[str]
    # For a stage that fits: the stage re-estimated without each memory-saving
    # setting it has on, so the plan says why each one is there.
    without: list[Suggestion] = field(default_factory=list)

    @property
    def memory(self) -> Memory:
        return self.estimate.memory

    @property
    def time(self) -> TimeEstimate | None:
        return self.estimate.time

    @property
    def fits(self) -> bool | None:
        return self.estimate.fits

    @property
    def data_parallel(self) -> int:
        """Processes that train on rows of their own (the others share their sequences)."""
        return self.knobs.data_parallel(self.world)


def plan_stage(stage, shape: ModelShape, hw: Hardware, rows: int | None = None, ppo: PPOWorkload | None = None,
               model_name: str = "", lengths: row_lengths.RowLengths | None = None,
               where: str = "stage") -> StagePlan:
    """The plan of one stage; `lengths`: its rows' sampled token counts (else max_len each).
    InvalidInput (naming `where`) when its processes cannot share sequences as it asks."""
    knobs = Knobs.from_stage(stage)
    problem = share_problem(shape.heads, shape.kv_heads, knobs.nodes * hw.processes_per_node, knobs.sequence_parallel)
    if problem:
        raise InvalidInput(f"{where}.sequence_parallel: {problem} (model {model_name or shape.describe()})")
    models, _ = stage_models(knobs, shape, ppo)
    estimate = estimate_stage(knobs, shape, hw, rows, ppo, lengths)
    warnings: list[str] = []
    if not shape.is_counted:
        warnings.append(f"model_type '{shape.model_type}' is estimated, not counted: planned with the Llama layout "
                        f"(core/families.py has no transformers class of it to check against); sizes may differ")
    if shape.max_positions and knobs.max_len > shape.max_positions:
        warnings.append(f"max_len {knobs.max_len} exceeds the model's max_position_embeddings {shape.max_positions}")
    if knobs.optimizer_offload and not knobs.offloads:
        warnings.append("optimizer_offload needs zero_stage 1-3; with zero_stage 0 it is ignored")
    if hw.on_gpu and hw.gpu is None:
        warnings.append("cluster.gpu is not set: GPU memory and time cannot be checked")
    if not hw.on_gpu and hw.gpu is not None:
        warnings.append(f"cluster.gpu is {hw.gpu.name} but gpus_per_node is 0: planned as a CPU run")
    if hw.on_gpu and hw.processes_per_node != hw.gpus_per_node:
        warnings.append(f"{hw.processes_per_node} processes per node on {hw.gpus_per_node} GPUs")
    if estimate.time is not None:
        warnings += estimate.time.notes
    warnings += stage.plan_notes()
    suggestions = suggest(knobs, shape, hw, rows, ppo, lengths) if estimate.fits is False else []
    without = settings_relaxed(knobs, shape, hw, rows, ppo, lengths) if estimate.fits else []
    trained = sum(sum(trainable_tensors(m, knobs)[0]) for m in models if m.trained)
    total = sum(m.shape.params_with_head(m.head) for m in models)
    return StagePlan(stage.name, knobs.kind, model_name, shape, knobs, hw, knobs.nodes * hw.processes_per_node,
                     trained, total, estimate, suggestions, warnings, without)


def _stage_model_name(spec, stage) -> str:
    """The model a stage starts from, following `from` back to the first stage's `model`."""
    seen = set()
    while stage.model is None and stage.from_ and stage.from_ not in seen:
        seen.add(stage.name)
        stage = spec.stage(stage.from_)
    return stage.model


def ppo_workload(spec, stage) -> PPOWorkload | None:
    """What an RL stage holds besides its actor, read through its kind's declaration (core/kinds.py
    Rollouts): a reward model (an upstream rm stage), a critic where its estimator trains one
    (started from the reward model, else from the actor's model), rollout sizes. None for a
    kind that samples no rollouts."""
    rl = kinds.rollouts_of(stage)
    if rl is None:
        return None
    hub = hf_cache(spec).hub
    reward_shape = None
    if rl.reward_model:
        reward_shape = resolve_shape(_stage_model_name(spec, spec.stage(rl.reward_model)), hub)
    actor_shape = resolve_shape(_stage_model_name(spec, stage), hub)
    return PPOWorkload(
        reward_shape=reward_shape,
        critic_shape=(reward_shape or actor_shape) if rl.critic else None,
        reward_placement="offload" if rl.reward_offload else "live",
        samples_per_prompt=rl.samples_per_prompt,
        rollout_rows=rl.prompts,
        scoring_batch=rl.chunk,
        new_tokens=rl.new_tokens,
        train_passes=rl.passes,
    )


def known_rows(spec) -> dict:
    """Training rows per stage where counting is cheap (jsonl lines, the built-in task), for total times."""
    from core.tiny import DIGITS_SPLITS  # torch-free constants

    rows = {}
    for stage in spec.stages:
        path = stage.data.path
        if stage.data.is_builtin:
            rows[stage.name] = DIGITS_SPLITS.get(stage.data.split)
        elif is_row_file(path) and path.endswith(".jsonl") and Path(path).is_file():
            with open(path, "rb") as f:
                rows[stage.name] = sum(1 for line in f if line.strip())
    return {k: v for k, v in rows.items() if v}


def hardware_of(spec, calibration: Path | None = None) -> Hardware:
    """What the pipeline's stages run on, with the rates measured on such a node where a
    calibration file is given, or sits at its default place (<runs_dir>/calibration/<gpu>.json).
    InvalidInput (exit 2) for an unknown GPU, or a file given that is unreadable or was measured
    on another GPU than the pipeline's (or on none, or on one for a CPU pipeline)."""
    try:
        hw = Hardware.from_cluster(spec.cluster)
    except ValueError as err:
        raise InvalidInput(f"cluster.gpu: {err}") from None
    if calibration is None:
        if not hw.on_gpu or hw.gpu is None or not calibration_file.default_path(spec).is_file():
            return hw
        calibration = calibration_file.default_path(spec)
    path = Path(calibration)
    measured = calibration_file.load(path)
    if hw.on_gpu:
        fits = measured.gpu is not None and hw.gpu is not None and measured.gpu.catalogue == hw.gpu.name
    else:
        fits = measured.gpu is None
    if not fits:
        on = (f"on {measured.gpu.device_name} ({measured.gpu.catalogue or 'not in the catalogue'})"
              if measured.gpu is not None else "without a GPU")
        pipeline = (f"cluster.gpu is {hw.gpu.name}" if hw.on_gpu and hw.gpu is not None
                    else "cluster.gpu is not set" if hw.on_gpu
                    else "this pipeline runs on the CPU (cluster.gpus_per_node: 0)")
        raise InvalidInput(f"{path}: measured {on}, but {pipeline}: calibrate a node like the pipeline's, "
                           "or name the file that was")
    return dataclasses.replace(hw, calibration=measured)


def signal_lead(spec, stage) -> int:
    """Seconds before its time limit at which a stage job is signalled to save and requeue:
    cluster.requeue_signal_s when set, else from the estimated checkpoint save time and step
    time (pipeline/plan/timing.py signal_lead_seconds)."""
    if spec.cluster.requeue_signal_s is not None:
        return spec.cluster.requeue_signal_s
    knobs = Knobs.from_stage(stage)
    shape = resolve_shape(_stage_model_name(spec, stage), hf_cache(spec).hub)
    ppo = ppo_workload(spec, stage)
    models, _ = stage_models(knobs, shape, ppo)
    try:
        estimated = estimate_stage(knobs, shape, hardware_of(spec), ppo=ppo).time
    except (ValueError, InvalidInput):  # an unknown GPU or a bad calibration file: the plan has said so already
        estimated = None
    return signal_lead_seconds(checkpoint_save_seconds(models, knobs), estimated.step_s if estimated else None)


def plan_pipeline(spec, rows_by_stage: dict | None = None, calibration: Path | None = None) -> list[StagePlan]:
    """A plan for every stage of a validated pipeline (PipelineSpec).

    rows_by_stage: training rows per stage name, when known, for total times;
    otherwise each plan gives the time per 1000 rows. calibration: a calibration
    file to take the node's rates from (else its default place, if there is one).
    Raises InvalidInput (exit 2) for an unknown GPU, a bad calibration file or a
    model whose size cannot be found.
    """
    rows_by_stage = rows_by_stage or {}
    hw = hardware_of(spec, calibration)
    cache = hf_cache(spec)
    sampled: dict = {}  # stages that read the same data with the same tokenizer share a sample
    plans = []
    for index, stage in enumerate(spec.stages):
        where = f"stages[{index}] ({stage.name})"
        model = _stage_model_name(spec, stage)
        try:
            shape = resolve_shape(model, cache.hub)
            rows = rows_by_stage.get(stage.name)
            if rows is not None and stage.data.max_rows is not None:
                rows = min(rows, stage.data.max_rows)
            ppo = ppo_workload(spec, stage)
            lengths = None
            if ppo is None:  # rollouts are generated: their lengths are not in the data
                key = (stage.data.model_dump_json(), stage.kind, model)
                if key not in sampled:
                    sampled[key] = row_lengths.sample(stage.data, stage.kind, model, cache)
                lengths = sampled[key]
            plans.append(plan_stage(stage, shape, hw, rows, ppo=ppo, model_name=model, lengths=lengths, where=where))
        except ValueError as err:
            field_name = "model" if stage.model else "from"
            raise InvalidInput(f"{where}.{field_name}: {err}") from None
    return plans


def raise_if_not_fits(plans: list[StagePlan]) -> None:
    """DoesNotFit (exit 3) naming each stage that does not fit, by how much, and the best fix."""
    failing = [p for p in plans if p.fits is False]
    if not failing:
        return
    lines = []
    for plan in failing:
        lines.append(f"stage '{plan.stage}' does not fit: {shortfall_text(plan.memory)}")
        if plan.suggestions:
            best = plan.suggestions[0]
            verdict = "fits" if best.estimate.fits else "comes closest"
            lines.append(f"  {verdict} with: {best.description}")
    raise DoesNotFit("\n".join(lines))
