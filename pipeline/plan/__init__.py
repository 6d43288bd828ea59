"""Will each stage fit its GPUs, by how much not, what would make it fit, and how long
will it take? Answered from the pipeline file alone, before anything is submitted.

Pure Python (no torch): `python -m pipeline plan` runs on login nodes.

  inputs.py        what an estimate is computed from: Knobs, Hardware, ModelUse, Workload, PPOWorkload
  memory.py        GPU and host memory of one stage, itemised per model role and phase
  activations.py   what a pass over one micro batch holds: activations, attention mask, logits
  batches.py       an optimizer step's micro batches, simulated over the data's sampled lengths
  timing.py        time per step and in total, MFU, tokens/s
  estimate.py      the models each stage kind holds; memory and time of one stage together
  fixes.py         the changes that would make a stage fit; what each memory setting buys
  planner.py       a plan per stage of a pipeline; the refusal (exit 3) of what does not fit
  report.py        the plan as text and as JSON

DeepSpeed's bucket sizes and thresholds come from core/deepspeed_settings.py
(the same numbers stages/engine.py configures DeepSpeed with); FLOPs per token from
core/flops.py (the formula the running stage reports its MFU with); the rows'
token lengths from pipeline/lengths.py (a sample of the stage's data).
"""

from core.deepspeed_settings import (
    CPU_BUCKET_ELEMENTS,
    FROZEN_PREFETCH_ELEMENTS,
    GPU_BUCKET_ELEMENTS,
    MAX_LIVE_PARAMETERS,
    SUB_GROUP_SIZE,
    persistence_threshold,
)
from pipeline.plan import batches, fixes
from pipeline.plan.estimate import Estimate, estimate_stage, ppo_models, stage_models
from pipeline.plan.fixes import Suggestion, settings_relaxed, suggest
from pipeline.plan.inputs import Generation, Hardware, Knobs, ModelUse, PPOWorkload, Workload
from pipeline.plan.memory import Item, Memory, estimate_memory
from pipeline.plan.planner import (
    StagePlan,
    known_rows,
    plan_pipeline,
    plan_stage,
    ppo_workload,
    raise_if_not_fits,
    signal_lead,
)
from pipeline.plan.report import format_plan, plan_to_json
from pipeline.plan.timing import TimeEstimate, estimate_time

__all__ = [
    "CPU_BUCKET_ELEMENTS", "FROZEN_PREFETCH_ELEMENTS", "GPU_BUCKET_ELEMENTS", "MAX_LIVE_PARAMETERS",
    "SUB_GROUP_SIZE", "persistence_threshold", "batches", "fixes", "Estimate", "estimate_stage", "ppo_models",
    "stage_models", "Suggestion", "settings_relaxed", "suggest", "Generation", "Hardware", "Knobs", "ModelUse",
    "PPOWorkload", "Workload", "Item", "Memory", "estimate_memory", "StagePlan", "known_rows", "plan_pipeline",
    "plan_stage",
    "ppo_workload", "raise_if_not_fits", "signal_lead", "format_plan", "plan_to_json", "TimeEstimate",
    "estimate_time",
]
