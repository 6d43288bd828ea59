"""Reinforcement learning from a reward: GRPO (the default), Dr. GRPO, GSPO, RLOO, REINFORCE++,
or PPO with a critic.

Each unit of the engine's loop (engine.run: resume, metrics, intervals, signals, the watchdog) is
one rollout and its update (`Rollouts`). A rollout (stages/rollout.py) samples completions
for a batch of prompts, scores them (rules and/or a reward model), takes the frozen models'
views of them and computes advantages over the whole rollout. The update makes ppo_epochs
passes over it in optimizer steps of global_batch_size sequences, each cut into micro batches of its
sequences shortest first (each pads only to its own longest); each micro batch adds its
share of the step's loss (losses.aggregate_loss with the step's token and sequence counts over
every process), so a step's gradient does not depend on how it is split over processes and
micro batches. The four models share every GPU of the job: actor and critic are trained by
DeepSpeed, the reference and reward model are frozen (optionally kept in host RAM between uses).
Without a KL term (kl_coef 0: PPOStage.needs_reference) there is no reference: it is neither
loaded nor run, and metrics.jsonl has no `kl`.

Each rollout's record says where its time went (stages/phases.py): generate_s, score_s, train_s and
other_s add up to rollout_s, with ZeRO-3 gathering (gather_s) and offloaded models' moves (offload_s)
inside them, the GPU's busy share in each and generation's share of the memory-bandwidth limit.

Outputs: model/ (the policy), critic/ (gae: the critic, a 1-label sequence classifier), and
result.json with initial_reward and final_reward, the mean held-out reward of greedy completions
before and after training, and reference (where it was kept; null: none loaded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from core import batching, estimators, hardware, reward_quality
from core import metrics as records
from core.errors import InvalidInput
from core.flops import rollout_sequence_flops
from core.rewards import RuleReward
from core.schemas.ppo import PPOStage
from core.schemas.reward import RULES_NEEDING_LABELS
from core.task import StageTask
from stages import collectives, data, engine, export, generation, models, phases, sequence_parallel
from stages import policy_losses as L
from stages.rollout import Models, Prompt, Rollout, RolloutMaker, TrainBatch, entropy_of, logprobs_of, values_of
from stages.vllm_engine import VllmEngine

if TYPE_CHECKING:
    from stages.runner import StageContext


def run(task: StageTask, ctx: StageContext) -> dict:
    stage = ppo_stage(task)
    weak = reward_quality.check(stage, task.pipeline_dir)  # refuses a reward model at chance, unless allowed
    if weak and ctx.is_main:
        logging.getLogger("stages").warning(weak)
    torch.manual_seed(stage.seed + ctx.rank)
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    prompts, eval_prompts, truncation = load_prompts(stage, ctx, tokenizer)
    ds_config = ctx.deepspeed_config(stage, model_path)
    schedule = schedule_of(stage, ctx.world_size, len(prompts))
    rl_models = load_models(task, ctx, model_path, tokenizer, ds_config, schedule.total_steps)
    sampler = generation.engine_for(stage, rl_models.actor.module, ctx.device)  # before anything trains
    vllm = VllmEngine(stage, ctx, model_path) if sampler == "vllm" else None
    rollouts = Rollouts(stage, ctx, rl_models, schedule, prompts, eval_prompts,
                        rollout_flop_models(task, model_path, rl_models), vllm)

    outcome = engine.run(rollouts, stage, ctx)
    rollouts.clock.close()
    rollouts.maker.rules.close()  # the reward functions' processes
    export.export(rl_models.actor, tokenizer, stage, ctx.folder.model, ctx.is_main)
    if rl_models.critic is not None:
        export.export(rl_models.critic, tokenizer, critic_stage(stage), ctx.folder.critic, ctx.is_main)
    return {
        "initial_reward": outcome["initial"]["reward"],
        "final_reward": outcome["final"]["reward"],
        "steps": outcome["steps"],
        "rollouts": schedule.total_rollouts,
        "train_prompts": len(prompts),
        "eval_prompts": len(eval_prompts),
        "truncation": truncation,
        "generation": sampler,
        "reference": None if rl_models.reference is None else stage.reference,  # null: none loaded (kl_coef 0)
    }


class Rollouts:
    """RL's unit of work on the engine's loop (engine.Work): one rollout and its update, which
    is steps_per_rollout optimizer steps. A checkpoint keeps the reward normaliser's statistics
    and the KL coefficient (every rank's generators, the sampler's: stages/checkpoints.py)."""

    log_interval = 1  # one metrics.jsonl line per rollout

    def __init__(self, stage: PPOStage, ctx: StageContext, rl_models: Models, schedule: batching.RolloutSchedule,
                 prompts: list[Prompt], eval_prompts: list[Prompt], flop_models: list,
                 vllm: VllmEngine | None = None):
        self.stage, self.ctx, self.models, self.schedule = stage, ctx, rl_models, schedule
        self.prompts, self.eval_prompts, self.flop_models = prompts, eval_prompts, flop_models
        self.engine = rl_models.actor
        self.group = sequence_parallel.layout().data_rank  # whose prompts this process's rollouts hold
        self.clock = phases.Clock(phases.nvml_reader(ctx.device) if ctx.on_gpu else None)
        self.decoding_limit = decoding_limit(stage, ctx, rl_models.actor.module, flop_models[0][0])
        self.others = {"critic": rl_models.critic} if rl_models.critic is not None else {}
        self.total_steps, self.steps_per_unit = schedule.total_steps, schedule.steps_per_rollout
        self.vllm = vllm  # the rollout engine, where it is vLLM (else transformers': stages/generation.py)
        rules = RuleReward.from_specs(stage.reward.rules, stage.reward.timeout_s)
        self.maker = RolloutMaker(stage, ctx, rl_models, rules,
                                  generate_fn=generation.generate if vllm is None else vllm, clock=self.clock)
        self.kl_control = (L.AdaptiveKLController(stage.kl_coef, stage.kl_target, 10_000) if stage.kl_target
                           else L.FixedKLController(stage.kl_coef))
        self.latest: dict = {}  # the last rollout's record

    def advance(self, index: int, window: engine.Window) -> None:
        stage, schedule, clock = self.stage, self.schedule, self.clock
        clock.take()  # evaluation and saving since the last rollout are not this rollout's time
        started = time.perf_counter()
        # Every moment of the rollout is in one phase: other_s, unless a named one runs (stages/phases.py).
        with clock.phase("other_s"):
            rollout = self.maker.make(
                lambda round_: [self.prompts[i] for i in schedule.prompt_rows(index, round_, self.group)],
                self.kl_control.value)
            window.add(rollout, {}, sum(rollout_sequence_flops(self.flop_models, len(s), stage.ppo_epochs)
                                        for s in rollout.sequences))
            with clock.phase("train_s"):
                trained = update(self.models, rollout, stage, self.ctx, self.kl_control.value, index)
            if self.vllm is not None:
                with clock.phase("sync_s"):
                    self.vllm.sync(self.engine)
                trained["sync_bytes"] = float(self.vllm.sync_bytes)
            kl_per_sequence = rollout_kl(rollout)
            if kl_per_sequence is not None:
                sampled = batching.rollout_sequences(stage.rollout_batch_size, stage.samples_per_prompt)
                self.kl_control.update(kl_per_sequence, sampled)
        rollout_s = time.perf_counter() - started
        seconds, busy = clock.take()
        timing = {**{key: seconds.get(key, 0.0) for key in (*records.ROLLOUT_PHASES, *records.ROLLOUT_PHASE_PARTS)},
                  "rollout_s": rollout_s}
        self.latest = rollout_record(index, rollout, trained, kl_per_sequence, self.kl_control.value, timing, busy,
                                     self.decoding_limit, self.engine.get_lr()[0], stage)

    def record(self) -> dict:
        return self.latest

    def evaluate(self) -> dict:
        return {"reward": self.maker.held_out_reward(self.eval_prompts)}

    def state(self) -> dict:
        return {"moments": self.maker.moments.state_dict(), "kl_coef": self.kl_control.value}

    def resume(self, state: dict) -> None:
        self.maker.moments.load_state_dict(state["moments"])
        self.kl_control.value = state["kl_coef"]


# --------------------------------------------------------------------------- set-up


def load_prompts(stage: PPOStage, ctx: StageContext, tokenizer) -> tuple[list[Prompt], list[Prompt], dict]:
    """The training prompts and the held-out ones, each with its whole data row, and what max_len
    did to them (prompts that leave no room for a completion are dropped)."""
    tokenized = data.tokenized_splits(stage, tokenizer, ctx.builtin_root)
    needs_label = any(r.rule in RULES_NEEDING_LABELS for r in stage.reward.rules)
    prompts = {}
    for split, part in (("train", tokenized.train), ("eval", tokenized.eval)):
        missing = next((i for i, r in enumerate(part.rows) if needs_label and stage.label_key not in r), None)
        if missing is not None:
            raise InvalidInput(f"{stage.data.path} ({split}) row {missing}: no '{stage.label_key}' column, which "
                               f"the {'/'.join(RULES_NEEDING_LABELS)} rules compare against (label_key)")
        prompts[split] = [
            Prompt(split, i, row[stage.data.prompt_key], tokens["input_ids"], row, row.get(stage.label_key))
            for i, (row, tokens) in enumerate(zip(part.rows, part.tokens))]
    return prompts["train"], prompts["eval"][: stage.eval_prompts], tokenized.record()


def ppo_stage(task: StageTask) -> PPOStage:
    """The task's stage, a PPOStage: ppo's run is handed ppo stages (the runner runs a stage's own
    kind's run; another RL kind hands it its stage in ppo's fields, as tests/rl_kind.py does)."""
    stage = task.stage
    assert isinstance(stage, PPOStage), f"ppo's run was handed a {stage.kind} stage"
    return stage


def critic_path(task: StageTask, model_path: str) -> str:
    """The critic starts from the reward model when there is one (it already reads rewards), else the policy."""
    return task.upstream_dirs.get(ppo_stage(task).reward.model or "", model_path)


def critic_stage(stage: PPOStage) -> PPOStage:
    return stage.model_copy(update={"learning_rate": stage.critic_learning_rate or stage.learning_rate})


def load_models(task: StageTask, ctx: StageContext, model_path: str, tokenizer, ds_config: dict,
                total_steps: int) -> Models:
    """Actor (and critic, for an estimator that trains one: gae) as DeepSpeed engines; reference (only
    with a KL term) and reward model frozen."""
    stage = ppo_stage(task)
    actor = engine.initialize(models.load_causal_lm(model_path, stage, ds_config, ctx.on_gpu), stage, ds_config,
                              total_steps)
    reference = None
    if stage.needs_reference:
        reference_offload = stage.reference == "offload"
        reference = models.load_frozen(AutoModelForCausalLM, model_path, stage,
                                       ctx.frozen_model_config(stage, model_path, offload=reference_offload),
                                       ctx.device, offload=reference_offload, drops_head=models.SCORE_HEAD)
    rl_models = Models(actor=actor, reference=reference, tokenizer=tokenizer)
    if estimators.get(stage.advantage).critic:
        critic = models.load_reward_model(critic_path(task, model_path), critic_stage(stage), ds_config, ctx.on_gpu,
                                          tokenizer.pad_token_id)
        rl_models.critic = engine.initialize(critic, critic_stage(stage), ds_config, total_steps)
    if stage.reward.model:
        rm_path = task.upstream_dirs[stage.reward.model]
        rl_models.reward_tokenizer = models.load_tokenizer(rm_path)
        rl_models.reward_model = models.load_frozen(
            AutoModelForSequenceClassification, rm_path, stage,
            ctx.frozen_model_config(stage, rm_path, offload=stage.reward_offload), ctx.device,
            offload=stage.reward_offload, num_labels=1)
    return rl_models


def rollout_flop_models(task: StageTask, model_path: str, rl_models: Models) -> list:
    """(shape, head, trained, LoRA parameters) of the actor, reference, critic and reward model: what
    core/flops.py counts per rollout sequence, for MFU."""
    stage = ppo_stage(task)
    shape = models.shape_of(model_path)
    out = [(shape, "lm", True, models.lora_params(rl_models.actor.module))]
    if rl_models.reference is not None:
        out.append((shape, "lm", False, None))
    if rl_models.critic is not None:
        out.append((models.shape_of(critic_path(task, model_path)), "scalar", True,
                    models.lora_params(rl_models.critic.module)))
    if rl_models.reward_model is not None:
        assert stage.reward.model, "load_models loads a reward model only where reward.model names one"
        out.append((models.shape_of(task.upstream_dirs[stage.reward.model]), "scalar", False, None))
    return out


def schedule_of(stage: PPOStage, world: int, n_prompts: int) -> batching.RolloutSchedule:
    """How the stage's prompts become rollouts and rollouts optimizer steps (core/batching.py)."""
    try:
        return batching.RolloutSchedule.of(
            n_prompts, prompts=stage.rollout_batch_size, samples_per_prompt=stage.samples_per_prompt,
            passes=stage.ppo_epochs, groups=stage.data_parallel(world),
            sequences_per_step=engine.sequences_per_step(stage, world), epochs=stage.epochs,
            max_steps=stage.max_steps, seed=stage.seed)
    except ValueError as err:
        raise InvalidInput(f"{stage.data.path}: {err} (rollout_batch_size {stage.rollout_batch_size})") from None


# --------------------------------------------------------------------------- update


def update(rl_models: Models, rollout: Rollout, stage: PPOStage, ctx: StageContext, kl_coef: float,
           index: int) -> dict[str, float]:
    """ppo_epochs passes over the rollout in optimizer steps; the means over steps of what to log
    (grad_norm, critic_grad_norm: the gradient norm of every process's step, before clipping)."""
    actor, critic = rl_models.actor, rl_models.critic
    actor.train()
    if critic is not None:
        critic.train()
    per_step = engine.sequences_per_step(stage, ctx.world_size)
    order_generator = torch.Generator().manual_seed(stage.seed * 7919 + index)
    lengths = [len(s) for s in rollout.sequences]
    sums: dict[str, float] = {}
    norms: dict[str, list[float]] = {}
    steps = processed = 0
    for _ in range(stage.ppo_epochs):
        order = torch.randperm(len(rollout), generator=order_generator).tolist()
        for first in range(0, len(order), per_step):
            rows = order[first : first + per_step]
            tokens, sequences = collectives.sum_once_per_group([float(rollout.mask[rows].sum()),
                                                                float(rollout.mask[rows].any(dim=1).sum())])
            # The step's rows, shortest first: each micro batch pads to its own longest (batching.by_length).
            micro = batching.by_length(rows, lengths, stage.micro_batch_size)
            for j, part in enumerate(micro):
                batch = rollout.train_batch(part, rl_models.tokenizer.pad_token_id, ctx.device)
                processed += batch.tokens.processed_tokens
                shares = train_micro_batch(rl_models, batch, stage, ctx.world_size, kl_coef, tokens, sequences,
                                           boundary=j == len(micro) - 1)
                for key, value in shares.items():
                    sums[key] = sums.get(key, 0.0) + value
            for key, model in (("grad_norm", actor), ("critic_grad_norm", critic)):
                norm = engine.grad_norm(model) if model is not None else None
                if norm is not None:
                    norms.setdefault(key, []).append(norm)
            steps += 1
    *totals, processed_all, real_all = collectives.sum_once_per_group(
        list(sums.values()) + [float(processed), float(stage.ppo_epochs * rollout.real_tokens)])
    means = {key: total / steps for key, total in zip(sums, totals)}
    means.update({key: sum(values) / len(values) for key, values in norms.items()})
    return {**means, "train_token_efficiency": real_all / max(processed_all, 1.0)}


def train_micro_batch(rl_models: Models, batch: TrainBatch, stage: PPOStage, world: int, kl_coef: float, tokens: float,
                      sequences: float, boundary: bool) -> dict[str, float]:
    """Forward, backward and (at the step's last micro batch) step of the actor and critic; returns
    this micro batch's shares of the step's logged means."""
    actor, critic = rl_models.actor, rl_models.critic
    share = step_share(batch, stage, tokens, sequences)
    loss, new, logits, clipped = engine.train_on(actor, batch.tokens,
                                                 lambda: policy_objective(actor, batch, stage, kl_coef, share),
                                                 boundary, world)
    with torch.no_grad():
        record = {
            "policy_loss": loss.item(),
            "clip_fraction": share(clipped.float()).item(),
            "approx_kl": share(L.kl_penalty(batch.old_logprobs, new.detach(), "k3")).item(),
            "entropy": share(entropy_of(batch.tokens, logits.detach())).item(),
        }
    if critic is not None:
        def value_objective():
            value_losses, value_clipped = L.value_loss(values_of(critic, batch.tokens), batch.values, batch.returns,
                                                       batch.mask, stage.value_clip_eps)
            return share(value_losses), value_clipped

        value_loss, value_clipped = engine.train_on(critic, batch.tokens, value_objective, boundary, world)
        record.update(value_loss=value_loss.item(), value_clip_fraction=share(value_clipped.float()).item())
    return record


def step_share(batch: TrainBatch, stage: PPOStage, tokens: float, sequences: float) -> Callable:
    """per-token tensor (B, W-1), aggregation -> this micro batch's share of the step's mean."""

    def share(per_token, mode="token_mean"):
        return L.aggregate_loss(per_token, batch.mask, mode, tokens=tokens, sequences=sequences,
                                max_len=stage.max_new_tokens)

    return share


def policy_objective(actor, batch: TrainBatch, stage: PPOStage, kl_coef: float, share: Callable):
    """The policy's loss share on a micro batch (with the KL term when it is not in the reward), its
    new log-probs, logits and which tokens were clipped."""
    new, logits = logprobs_of(actor, batch.tokens, stage.temperature)
    losses, clipped = L.policy_loss(new, batch.old_logprobs, batch.advantages, batch.mask,
                                    clip_eps_low=stage.clip_eps_low, clip_eps_high=stage.clip_eps_high,
                                    importance_sampling=stage.importance_sampling,
                                    sampler_weights=batch.sampler_weights)
    loss = share(losses, stage.loss_aggregation)
    if not stage.kl_in_reward and batch.ref_logprobs is not None:
        loss = loss + kl_coef * share(L.kl_penalty(new, batch.ref_logprobs, stage.kl_estimator), stage.loss_aggregation)
    return loss, new, logits, clipped


# --------------------------------------------------------------------------- log


def rollout_kl(rollout: Rollout) -> float | None:
    """Mean KL to the reference per trained sequence, over every process; None without a reference."""
    if rollout.kl is None:
        return None
    total, count = collectives.sum_once_per_group([float(rollout.kl.sum()), float(rollout.mask.any(dim=1).sum())])
    return total / max(count, 1.0)


def rollout_record(index: int, rollout: Rollout, trained: dict, kl: float | None, kl_coef: float, timing: dict,
                   busy: dict, decoding_limit: float | None, lr: float, stage) -> dict:
    """One metrics.jsonl line per rollout: each number already a mean over its updates. Without a
    reference there is no KL to it: no `kl` (approx_kl, the update's KL to the sampling policy, stays).
    The phases' seconds (core/metrics.py ROLLOUT_PHASES) add up to rollout_s; the GPU busy shares and
    the bandwidth fraction are null without a GPU (or NVML, or a catalogued GPU)."""
    stats = rollout.stats
    assert stats is not None, "RolloutMaker.make gives every rollout its stats"
    sampled = batching.rollout_sequences(stage.rollout_batch_size, stage.samples_per_prompt)
    generate_tokens_per_s = stats.response_tokens / max(timing["generate_s"], 1e-9)  # tokens sampled
    return {
        "rollout": index + 1,
        "reward": stats.reward,
        **{f"reward_{k}": v for k, v in stats.terms.items()},
        **({} if kl is None else {"kl": kl}),
        "kl_coef": kl_coef,
        **trained,
        **stats.sampling,
        **stats.sampler,  # vLLM: sampler_logprob_diff_mean, _max
        "response_length": stats.response_tokens / max(sampled * stats.sampling.get("sampling_rounds", 1), 1),
        # generate_s (of which gather_s), score_s (rewards, the frozen models' and the critic's passes,
        # advantages; of which offload_s), train_s, other_s; rollout_s
        **timing,
        "generate_tokens_per_s": generate_tokens_per_s,
        "generate_bandwidth_fraction": generate_tokens_per_s / decoding_limit if decoding_limit else None,
        # core/metrics.py GPU_BUSY_KEYS: NVML's utilisation in each phase and over the whole rollout
        "gpu_busy_generate": busy.get("generate_s"),
        "gpu_busy_score": busy.get("score_s"),
        "gpu_busy_train": busy.get("train_s"),
        "gpu_busy_rollout": busy.get("overall"),
        "score_tokens_per_s": stats.tokens / max(timing["score_s"], 1e-9),  # prompt + response tokens scored
        "train_tokens_per_s": stage.ppo_epochs * stats.tokens / max(timing["train_s"], 1e-9),
        "lr": lr,
    }


def decoding_limit(stage: PPOStage, ctx: StageContext, actor_module, actor_shape) -> float | None:
    """Response tokens/s every process together could sample at its GPU's memory-bandwidth limit
    for the actor's size (core/hardware.py decoding_tokens_per_s_limit), with as many sequences
    decoded at once as the stage does (micro_rollout_batch_size, or fewer when a process has
    fewer); None on a CPU or a GPU the catalogue does not hold."""
    gpu = hardware.gpu_for_device(torch.cuda.get_device_name(ctx.device)) if ctx.on_gpu else None
    if gpu is None:
        return None
    weight_bytes = actor_shape.n_params * next(actor_module.parameters()).element_size()
    sampled = batching.sampled_per_process(stage.rollout_batch_size, stage.samples_per_prompt, ctx.world_size)
    together = min(stage.micro_rollout_batch_size, sampled)
    return ctx.world_size * hardware.decoding_tokens_per_s_limit(gpu, weight_bytes, together)
