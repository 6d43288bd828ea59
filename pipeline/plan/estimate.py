"""Memory and time of one stage: the models a stage of each kind holds, what it
computes, and the estimate of both (pipeline/plan/memory.py, timing.py)."""

from __future__ import annotations

from dataclasses import dataclass

from core.shapes import ModelShape
from pipeline.lengths import RowLengths
from pipeline.plan.batches import Batches, simulate
from pipeline.plan.inputs import (
    REFERENCE_PLACEMENTS,
    Generation,
    Hardware,
    Knobs,
    ModelUse,
    PPOWorkload,
    Workload,
    attention_kernel,
)
from pipeline.plan.memory import Memory, estimate_memory
from pipeline.plan.timing import TimeEstimate, estimate_time


@dataclass
class Estimate:
    knobs: Knobs
    memory: Memory
    time: TimeEstimate | None
    batches: Batches | None = None  # sft, rm, dpo: the simulated micro batches of a step

    @property
    def gpu_seconds_per_1000_rows(self) -> float | None:
        if self.time is None:
            return None
        return self.time.seconds_per_1000_rows * self.knobs.nodes

    @property
    def fits(self) -> bool | None:
        return self.memory.fits


def estimate_stage(knobs: Knobs, shape: ModelShape, hw: Hardware, rows: int | None = None,
                   ppo: PPOWorkload | None = None, lengths: RowLengths | None = None) -> Estimate:
    """A stage's memory and time with these settings; `lengths`: its rows' sampled
    token counts (pipeline/lengths.py), else every row is taken as max_len long."""
    models, workload = stage_models(knobs, shape, ppo)
    batches = None
    if workload.rows_per_rollout is None:
        flat = attention_kernel(knobs.attention, hw.on_gpu, shape).startswith("flash_attention")
        batches = simulate(knobs, knobs.nodes * hw.processes_per_node, workload.sequences_per_row, flat, lengths)
    return Estimate(knobs, estimate_memory(models, workload, knobs, hw),
                    estimate_time(models, workload, knobs, hw, rows, batches), batches)


def stage_models(knobs: Knobs, shape: ModelShape, ppo: PPOWorkload | None = None) -> tuple[list[ModelUse], Workload]:
    """The models a stage of this kind holds, and what it computes per row.
    A PPO stage's other models and rollout sizes come in `ppo`."""
    kind = knobs.stage_kind
    if kind.rollouts:
        ppo = ppo or PPOWorkload()
        reference = knobs.reference if kind.frozen_reference else None  # a kind that keeps none has none
        models = ppo_models(shape, ppo.critic_shape, ppo.reward_shape, reference, ppo.reward_placement)
        new_tokens = min(ppo.new_tokens or knobs.max_len // 2, knobs.max_len)
        scoring = ppo.scoring_batch or knobs.micro_batch_size
        return models, Workload(
            sequences_per_row=ppo.samples_per_prompt, seq_len=knobs.max_len,
            generation=Generation(scoring, knobs.max_len - new_tokens, new_tokens),
            micro_batch_in_sequences=True, train_passes=ppo.train_passes, scoring_batch=scoring,
            rows_per_rollout=ppo.rollout_rows or knobs.micro_batch_size,
        )
    models = [ModelUse(kind.trained_role, shape, kind.trained_head, trained=True)]
    if kind.frozen_reference:
        if knobs.reference not in REFERENCE_PLACEMENTS:
            raise ValueError(f"reference must be one of {', '.join(REFERENCE_PLACEMENTS)}, not '{knobs.reference}'")
        models.append(ModelUse("reference", shape, "lm", trained=False, placement=knobs.reference))
    return models, Workload(kind.sequences_per_row, knobs.max_len)


def ppo_models(actor: ModelShape, critic: ModelShape | None, reward: ModelShape | None,
               reference: str | None = "live", reward_placement: str = "live") -> list[ModelUse]:
    """PPO's models: actor and (for gae) critic trained; reference (None: none, no KL term) and
    reward model frozen."""
    models = [ModelUse("actor", actor, "lm", trained=True)]
    if critic is not None:
        models.append(ModelUse("critic", critic, "scalar", trained=True))
    if reference is not None:
        models.append(ModelUse("reference", actor, "lm", trained=False, placement=reference))
    if reward is not None:
        models.append(ModelUse("reward model", reward, "scalar", trained=False, placement=reward_placement))
    return models
