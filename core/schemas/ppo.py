"""The ppo kind's schema and declaration (its run: `run` in stages/ppo.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from core import estimators, kinds
from core.config import StageBase, VllmSpec
from core.kinds import Rollouts, StageKind
from core.schemas.reward import RewardSpec

# The objective a PPO stage runs when the pipeline file does not choose: TRL's GRPOTrainer defaults
# (loss_type "dapo" = token_mean, scale_rewards "group", token-level ratios, 8 samples per prompt:
# core/estimators.py) with DAPO's clip-higher bound (Yu et al. 2025, arXiv 2503.14476: eps_low 0.2,
# eps_high 0.28).


class PPOStage(StageBase):
    """Reinforcement learning from a reward: critic-free GRPO (the default, with DAPO's loss),
    Dr. GRPO, GSPO, RLOO and REINFORCE++, or PPO with a critic (gae). max_steps counts optimizer
    steps of the policy."""

    kind: Literal["ppo"] = Field(..., description="Stage kind: sft, rm, dpo or ppo.")
    reward: RewardSpec = Field(..., description="The reward to maximise.")
    advantage: Annotated[str, AfterValidator(estimators.check_name)] = Field(
        "grpo",
        description=f"Advantage estimator: {estimators.described()}. Statistics span the whole rollout over all "
        "processes.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="grpo: divide each sample's reward minus its group's mean by the group's std (group, "
        "GRPO), by the whole rollout's std (batch), or by nothing (none, Dr. GRPO: no bias towards prompts "
        "that are too easy or too hard).",
    )
    n_samples_per_prompt: int | None = Field(
        None, ge=1, le=64,
        description=f"Completions sampled per prompt {estimators.samples_described()}.",
    )
    rollout_batch_size: int = Field(64, ge=1, description="Prompts per rollout, over all processes.")
    micro_rollout_batch_size: int = Field(
        16, ge=1, description="Sequences per process per generation chunk (continuous: in flight at once) and "
        "per scoring pass."
    )
    max_new_tokens: int = Field(256, ge=1, description="Longest completion sampled.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts (1 = off).")
    generation: Literal["auto", "continuous", "padded", "vllm"] = Field(
        "auto",
        description="How rollouts are sampled: vllm (a vLLM engine in each process, weights synced from the actor "
        "after every update: see vllm; the current stack only), continuous (transformers' continuous batching, "
        "5.x only: a paged KV cache, each completion leaves the batch at its eos), padded (generate on padded "
        "chunks of micro_rollout_batch_size; every stack; on a GPU with transformers 5.x a static KV cache and a "
        "compiled step), or auto (what the benchmark records decided per device: padded on CPUs and GPUs so far; "
        "stages/generation.py AUTO_ENGINE; on a GPU where vLLM is installed, vllm). Greedy output is the same; "
        "sampled output differs, so it is part of the spec hash.",
    )
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="The vLLM engine's settings (generation: vllm).")
    sampler_ratio_cap: float | None = Field(
        2.0, ge=1,
        description="With vLLM sampling: truncated importance sampling. Each token's policy loss is weighted by the "
        "trainer's probability of it over the sampler's (vLLM's kernels and precision differ from the trainer's), "
        "capped at this (as TRL, verl and OpenRLHF do); per sequence with importance_sampling: sequence. null: no "
        "correction. The difference is logged either way (sampler_logprob_diff_mean, _max).",
    )
    ppo_epochs: int = Field(1, ge=1, le=16, description="Passes over each rollout's sequences.")
    clip_eps: float | None = Field(
        None, gt=0, lt=1,
        description="Symmetric shorthand: clip the probability ratio to [1 - clip_eps, 1 + clip_eps]. "
        "Give it or clip_eps_low / clip_eps_high, not both.",
    )
    clip_eps_low: float = Field(
        0.2, gt=0, lt=1, description="Lower clip range of the probability ratio: it is kept >= 1 - clip_eps_low."
    )
    clip_eps_high: float = Field(
        0.28, gt=0,
        description="Upper clip range: the ratio is kept <= 1 + clip_eps_high. Above clip_eps_low, rare tokens "
        "with a positive advantage can grow more (DAPO's clip-higher, 0.28).",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean", "sequence_sum_normalized"] = Field(
        "token_mean",
        description="How per-token losses become the step's loss: token_mean (every token of the step weighs "
        "the same; DAPO, TRL's default), sequence_mean (each sequence's token mean, averaged; the GRPO paper, "
        "GSPO), sequence_sum_normalized (token sums over sequences x max_new_tokens, a fixed normaliser; Dr. "
        "GRPO). Normalisers count the whole optimizer step over all processes.",
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token",
        description="Probability ratio per token (PPO, GRPO, DAPO), or per sequence (GSPO: the geometric mean "
        "of its token ratios, clipped as one; GSPO's paper pairs it with sequence_mean and clip ranges of "
        "about 3e-4 / 4e-4).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: drop prompts whose samples all got the same reward (they teach "
        "nothing) and sample more prompts until the rollout is full or dynamic_sampling_max_rounds is reached "
        "(then the remaining places hold dropped prompts, left out of the loss). Metrics: groups_kept, "
        "groups_dropped, groups_filled, sampling_rounds.",
    )
    dynamic_sampling_max_rounds: int = Field(
        4, ge=1, le=100, description="With dynamic_sampling: most rounds of sampling per rollout, the first included."
    )
    value_clip_eps: float = Field(0.2, gt=0, description="Clip range of the critic's value updates.")
    critic_learning_rate: float | None = Field(
        None, gt=0, description="Peak learning rate of the critic (gae only); default learning_rate."
    )
    kl_coef: float = Field(
        0.05, ge=0,
        description="Weight of the KL penalty to the reference model. 0 (as in DAPO): no KL term, and no "
        "reference model is loaded or run.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="KL estimator per token: k1 = log ratio, k2 = half squared, k3 = (r - 1) - log r."
    )
    kl_in_reward: bool = Field(
        True, description="Subtract the KL from the per-token reward (true), or add it to the policy loss (false)."
    )
    kl_target: float | None = Field(
        None, gt=0,
        description="Adapt kl_coef so the KL per sequence approaches this (null = fixed kl_coef). The controller "
        "scales kl_coef, so it needs kl_coef > 0 to start from.",
    )
    gamma: float = Field(1.0, gt=0, le=1, description="Discount per token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda.")
    reference: Literal["live", "offload"] = Field(
        "live", description="The frozen reference: live on the device, or offload (host RAM between uses)."
    )
    reward_offload: bool = Field(False, description="Keep the reward model in host RAM between uses.")
    allow_weak_reward_model: bool = Field(
        False,
        description="Train against reward.model even when it ranked its own held-out pairs no better than chance "
        "(eval_accuracy at most 0.55, or not significantly above 0.5 for its eval count: core/reward_quality.py). "
        "Without it such a stage is refused before it loads anything; with it, the stage warns before its first "
        "rollout.",
    )
    eval_prompts: int = Field(200, ge=1, description="Held-out prompts scored (greedy) before and after training.")
    label_key: str = Field("label", description="Data column with the reference answer passed to rule rewards.")

    @model_validator(mode="before")
    @classmethod
    def _resolve_shorthands(cls, data: Any) -> Any:
        """clip_eps sets both clip bounds; n_samples_per_prompt's default follows the estimator."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("clip_eps") is not None:
            both = [k for k in ("clip_eps_low", "clip_eps_high") if k in data]
            if both:
                raise ValueError(f"clip_eps is the symmetric shorthand for clip_eps_low and clip_eps_high; "
                                 f"give it or {' / '.join(both)}, not both")
            # Resolved into the two bounds (and not kept), so equal objectives have equal spec hashes.
            data["clip_eps_low"] = data["clip_eps_high"] = data.pop("clip_eps")
        if data.get("n_samples_per_prompt") is None:
            advantage = data.get("advantage", cls.model_fields["advantage"].default)
            if advantage in estimators.names():  # an unknown one is named by the field's own check
                data["n_samples_per_prompt"] = estimators.get(advantage).samples_per_prompt
        return data

    @model_validator(mode="after")
    def _groups_need_samples(self):
        estimator = estimators.get(self.advantage)
        if estimator.group_relative and self.samples_per_prompt < 2:
            raise ValueError(f"advantage {self.advantage} compares samples of one prompt: "
                             "set n_samples_per_prompt to 2 or more")
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ValueError("dynamic_sampling drops prompts whose samples all got the same reward: "
                             "set n_samples_per_prompt to 2 or more")
        if self.scale_rewards != "group" and not estimator.scales_rewards:
            scaling = " or ".join(e for e in estimators.names() if estimators.get(e).scales_rewards)
            raise ValueError(f"scale_rewards applies to advantage {scaling}, not {self.advantage}")
        return self

    @model_validator(mode="after")
    def _vllm_settings_need_vllm(self):
        if "vllm" in self.model_fields_set and self.generation not in ("vllm", "auto"):
            raise ValueError(f"vllm: settings for generation: vllm, and this stage samples with generation: "
                             f"{self.generation}; remove them, or set generation: vllm")
        if self.generation == "vllm" and self.sequence_parallel > 1:
            raise ValueError("generation: vllm samples whole sequences in each process's engine; with "
                             "sequence_parallel > 1 use generation: padded")
        return self

    @model_validator(mode="after")
    def _weak_reward_model_needs_a_reward_model(self):
        if self.allow_weak_reward_model and self.reward.model is None:
            raise ValueError("allow_weak_reward_model applies to a reward model (reward.model), and this stage "
                             "names none: remove it")
        return self

    @model_validator(mode="after")
    def _kl_target_needs_a_coefficient(self):
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef by scaling it, so from kl_coef 0 it stays 0: set kl_coef "
                             "> 0 to start from, or remove kl_target for no KL term")
        return self

    @property
    def samples_per_prompt(self) -> int:
        """n_samples_per_prompt as validation resolved it: an int once the stage is valid (left out or
        null, _resolve_shorthands sets its estimator's default before the fields are checked)."""
        assert self.n_samples_per_prompt is not None, "n_samples_per_prompt is resolved when the stage is validated"
        return self.n_samples_per_prompt

    @property
    def needs_reference(self) -> bool:
        """Does the stage hold the frozen reference model? Only the KL term reads it: with kl_coef 0
        there is none (kl_target, which could change the coefficient, needs kl_coef > 0). The one
        rule for stages/ppo.py (what it loads and runs) and pipeline/plan (what it counts)."""
        return self.kl_coef > 0

    def plan_notes(self) -> list[str]:
        if not self.dynamic_sampling:
            return []
        # How many groups come out uniform depends on the rewards, unknown before the run.
        return [f"dynamic_sampling: the time is for one sampling round per rollout; each round that "
                f"refills dropped groups adds its generation and scoring again (at most "
                f"{self.dynamic_sampling_max_rounds} rounds; metrics.jsonl's sampling_rounds shows them)"]


kinds.register(StageKind("ppo", PPOStage, rows="prompt", headline="final_reward", frozen_reference=True,
                         sequence_parallel=True, rollouts=Rollouts(
                             prompts="rollout_batch_size", samples_per_prompt="n_samples_per_prompt",
                             new_tokens="max_new_tokens", chunk="micro_rollout_batch_size", passes="ppo_epochs",
                             estimator="advantage", reward="reward", label_key="label_key",
                             reward_offload="reward_offload", allow_weak_reward_model="allow_weak_reward_model",
                             engine="generation", vllm="vllm")))
