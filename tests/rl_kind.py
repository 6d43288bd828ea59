"""A second RL kind declared in one file, as a plug-in would be: its schema with field names of its
own, its rollouts declaration (core/kinds.py Rollouts: which of its fields says what), and its run,
registered with core/kinds.py on import.

`reinforce` trains as the shipped ppo kind does with no KL term: its run hands ppo's run the same
stage in ppo's field names. What the planner, validate and the data code know of it comes from its
declaration alone.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from core import estimators, kinds
from core.config import StageBase
from core.kinds import Rollouts, StageKind
from core.schemas.ppo import PPOStage
from core.schemas.reward import RewardSpec


class ReinforceStage(StageBase):
    """RL from a reward, without a KL term, in words of its own."""

    kind: Literal["reinforce"] = Field(..., description="Stage kind: reinforce (tests/rl_kind.py).")
    score: RewardSpec = Field(..., description="What a completion scores.")
    estimator: Annotated[str, AfterValidator(estimators.check_name)] = Field("rloo", description="Advantages.")
    prompts_per_rollout: int = Field(8, ge=1, description="Prompts sampled per rollout, over all processes.")
    completions_per_prompt: int = Field(2, ge=1, description="Completions sampled of each prompt.")
    completion_tokens: int = Field(4, ge=1, description="The longest completion.")
    sampling_batch: int = Field(16, ge=1, description="Sequences per process sampled or scored at once.")
    passes_per_rollout: int = Field(1, ge=1, description="Passes over each rollout's sequences.")
    answer_column: str = Field("label", description="The data column the rules compare completions with.")
    held_out_prompts: int = Field(8, ge=1, description="Held-out prompts scored before and after training.")


DECLARED = Rollouts(prompts="prompts_per_rollout", samples_per_prompt="completions_per_prompt",
                    new_tokens="completion_tokens", chunk="sampling_batch", passes="passes_per_rollout",
                    estimator="estimator", reward="score", label_key="answer_column")
OWN_FIELDS = ("score", "estimator", "prompts_per_rollout", "completions_per_prompt", "completion_tokens",
              "sampling_batch", "passes_per_rollout", "answer_column", "held_out_prompts")


def as_ppo(stage: ReinforceStage) -> PPOStage:
    """The same stage in ppo's field names (no KL term: no reference)."""
    common = stage.model_dump(by_alias=True, exclude={"kind", *OWN_FIELDS})
    return PPOStage.model_validate({
        **common, "kind": "ppo", "reward": stage.score.model_dump(), "advantage": stage.estimator,
        "rollout_batch_size": stage.prompts_per_rollout, "n_samples_per_prompt": stage.completions_per_prompt,
        "max_new_tokens": stage.completion_tokens, "micro_rollout_batch_size": stage.sampling_batch,
        "ppo_epochs": stage.passes_per_rollout, "label_key": stage.answer_column,
        "eval_prompts": stage.held_out_prompts, "kl_coef": 0.0})


def run(task, ctx) -> dict:
    from stages import ppo

    return ppo.run(task.model_copy(update={"stage": as_ppo(task.stage)}), ctx)


KIND = kinds.register(StageKind("reinforce", ReinforceStage, rows="prompt", headline="final_reward",
                                rollouts=DECLARED, run=run))
