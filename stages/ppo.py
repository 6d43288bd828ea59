"""Reinforcement learning from a reward: PPO with a critic, or GRPO / RLOO / REINFORCE++.

Each iteration: sample completions for a batch of prompts (rollout), score them
(reward model and/or rules), compute advantages, then update the policy (and
the critic, for gae) for ppo_epochs passes over the rollout. The four models
share every GPU of the job: actor and critic are trained by DeepSpeed, the
reference and reward model are frozen (optionally kept in host RAM between
uses). Under ZeRO-3 the actor's parameters are gathered once per rollout for
generation, not once per token.

result.json: initial_reward and final_reward, the mean held-out reward of
greedy completions before and after training (rule rewards are on a 0-1 scale
for the built-in task).
"""

from __future__ import annotations

import contextlib
import time

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from pipeline.flops import rollout_sequence_flops
from stages import batching, data, engine, models
from stages import losses as L
from stages.rewards import RuleReward, RunningMoments


def run(task, ctx) -> dict:
    stage = task.stage
    torch.manual_seed(stage.seed + ctx.rank)

    # ---- data: prompts (and labels for rule rewards)
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    tokenized = data.tokenized_splits(stage, tokenizer, ctx.builtin_root)  # prompts that fill max_len dropped
    train_rows, eval_rows = tokenized.train.rows, tokenized.eval.rows
    needs_label = any(r.rule in ("exact_match", "numeric_match") for r in stage.reward.rules)
    for source, rows in (("train", train_rows), ("eval", eval_rows)):
        missing = next((i for i, r in enumerate(rows, 1) if needs_label and stage.label_key not in r), None)
        if missing:
            raise ValueError(f"{stage.data.path} ({source}) row {missing}: no '{stage.label_key}' column, "
                             "which the exact_match/numeric_match rules compare against (label_key)")

    def prompt_of(row, tokens):
        return {"text": row[stage.data.prompt_key], "ids": tokens["input_ids"], "label": row.get(stage.label_key)}

    prompts = [prompt_of(r, t) for r, t in zip(train_rows, tokenized.train.tokens)]
    eval_prompts = [prompt_of(r, t) for r, t in zip(eval_rows, tokenized.eval.tokens)][: stage.eval_prompts]

    # ---- models: actor, critic (gae), reference, reward model
    ds_config = ctx.deepspeed_config(stage, model_path)
    world = ctx.world_size
    per_rank_prompts = stage.rollout_batch_size // world
    sequences_per_rank = per_rank_prompts * stage.n_samples_per_prompt
    steps_per_rollout = stage.ppo_epochs * sequences_per_rank // (stage.micro_batch_size * ds_config["gradient_accumulation_steps"])
    rollouts_per_epoch = len(prompts) // stage.rollout_batch_size
    if rollouts_per_epoch == 0:
        raise ValueError(f"{len(prompts)} prompts are fewer than one rollout ({stage.rollout_batch_size})")
    total_steps = stage.max_steps or stage.epochs * rollouts_per_epoch * steps_per_rollout
    total_rollouts = -(-total_steps // steps_per_rollout)

    actor = engine.initialize(models.load_causal_lm(model_path, stage, ds_config, ctx.on_gpu), stage, ds_config, total_steps)
    frozen_config = ctx.frozen_model_config(stage, model_path, offload=stage.reference == "offload")
    reference = models.load_frozen(AutoModelForCausalLM, model_path, stage, frozen_config, ctx.device,
                                   offload=stage.reference == "offload")
    critic = None
    if stage.advantage == "gae":
        critic_stage = stage.model_copy(update={"learning_rate": stage.critic_learning_rate or stage.learning_rate})
        # The critic starts from the reward model when there is one (it already reads rewards), else the policy.
        critic_path = task.upstream_dirs.get(stage.reward.model or "", model_path)
        critic_model = models.load_reward_model(critic_path, critic_stage, ds_config, ctx.on_gpu, tokenizer.pad_token_id)
        critic = engine.initialize(critic_model, critic_stage, ds_config, total_steps)
    reward_model = reward_tokenizer = None
    if stage.reward.model:
        rm_path = task.upstream_dirs[stage.reward.model]
        reward_tokenizer = models.load_tokenizer(rm_path)
        rm_config = ctx.frozen_model_config(stage, rm_path, offload=stage.reward_offload)
        reward_model = models.load_frozen(AutoModelForSequenceClassification, rm_path, stage, rm_config, ctx.device,
                                          offload=stage.reward_offload, num_labels=1)
    # model FLOPs of a rollout's sequences, for MFU: actor, reference, critic, reward model
    flop_models = [(models.shape_of(model_path), "lm", True, models.lora_params(actor.module)),
                   (models.shape_of(model_path), "lm", False, None)]
    if critic is not None:
        flop_models.append((models.shape_of(critic_path), "scalar", True, models.lora_params(critic.module)))
    if reward_model is not None:
        flop_models.append((models.shape_of(rm_path), "scalar", False, None))
    window = engine.Window(ctx)  # a rollout's tokens, FLOPs, time and memory
    rules = RuleReward.from_specs(stage.reward.rules)
    moments = RunningMoments()
    kl_control = (L.AdaptiveKLController(stage.kl_coef, stage.kl_target, 10_000) if stage.kl_target
                  else L.FixedKLController(stage.kl_coef))

    # ---- rollout pieces
    def generate(batch_prompts, greedy=False):
        """Response token ids (cut after eos) for each prompt."""
        module = actor.module
        module.eval()
        responses = []
        gather = (deepspeed.zero.GatheredParameters(list(module.parameters()))
                  if stage.zero_stage == 3 else contextlib.nullcontext())
        with torch.no_grad(), gather:
            for start in range(0, len(batch_prompts), stage.micro_rollout_batch_size):
                chunk = batch_prompts[start : start + stage.micro_rollout_batch_size]
                width = max(len(p["ids"]) for p in chunk)
                ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p["ids"])) + p["ids"] for p in chunk])
                mask = torch.tensor([[0] * (width - len(p["ids"])) + [1] * len(p["ids"]) for p in chunk])
                sampling = {} if greedy else {"temperature": stage.temperature, "top_p": stage.top_p, "top_k": 0}
                out = module.generate(
                    input_ids=ids.to(ctx.device), attention_mask=mask.to(ctx.device), max_new_tokens=stage.max_new_tokens,
                    do_sample=not greedy, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    use_cache=True, **sampling,
                )
                for row in out[:, width:].tolist():
                    cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
                    responses.append(row[:cut])
        return responses

    def score(batch_prompts, responses):
        """Summed reward per completion, before normalisation, and each term's mean."""
        completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
        texts = [p["text"] for p in batch_prompts]
        total, terms = (rules(texts, completions, [p["label"] for p in batch_prompts]) if rules.terms
                        else ([0.0] * len(responses), {}))
        if reward_model is not None:
            # Re-tokenised with the reward model's tokenizer, formatted as it was trained.
            rows = []
            for text, completion in zip(texts, completions):
                ids = (data.encode_prompt(reward_tokenizer, text, stage.data)
                       + data.encode_response(reward_tokenizer, text, completion, stage.data))[: stage.max_len]
                rows.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
            scores = []
            for start in range(0, len(rows), stage.micro_rollout_batch_size):
                batch = data.padded_batch(rows[start : start + stage.micro_rollout_batch_size],
                                          reward_tokenizer.pad_token_id).to(ctx.device)
                scores += batch.forward(reward_model).logits.squeeze(-1).float().tolist()
            total = [t + stage.reward.model_weight * s for t, s in zip(total, scores)]
            terms["reward_model"] = sum(scores) / len(scores)
        return total, terms

    def sequences(batch_prompts, responses):
        rows = [{"input_ids": (p["ids"] + r)[: stage.max_len],
                 "loss_mask": ([0] * len(p["ids"]) + [1] * len(r))[: stage.max_len]}
                for p, r in zip(batch_prompts, responses)]
        return data.padded_batch(rows, tokenizer.pad_token_id).to(ctx.device)

    def logprobs_of(model, batch):
        logits = batch.forward(model).logits
        return L.token_logprobs(logits.float() / stage.temperature, batch.input_ids, batch.loss_mask), logits

    def values_of(model, batch):
        """The critic's value per position, aligned with token_logprobs (predicting token t+1)."""
        base = model.module.get_base_model() if hasattr(model.module, "get_base_model") else model.module
        hidden = getattr(base, base.base_model_prefix)(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        return base.score(hidden).squeeze(-1).float()[:, :-1]

    def gathered_mean(values):
        total, count = engine.all_reduce_sums([float(sum(values)), float(len(values))])
        return total / max(count, 1.0)

    @torch.no_grad()
    def held_out_reward():
        share = eval_prompts[ctx.rank :: world]
        # Equal generate calls on every rank: ZeRO-3 generation needs all ranks in step.
        calls = -(-len(eval_prompts) // world)
        share = share + (share or eval_prompts)[:1] * (calls - len(share))
        responses = generate(share, greedy=True)
        rewards, _ = score(share, responses)
        own = len(eval_prompts[ctx.rank :: world])
        return gathered_mean(rewards[:own])

    # ---- resume
    checkpoints = engine.Checkpoints(ctx.folder, stage.keep_checkpoints, ctx.is_main)
    metrics = engine.Metrics(ctx, total_steps)
    others = {"critic": critic} if critic is not None else None
    state = checkpoints.load(actor, others)
    if state is None:
        start_rollout, step, initial_reward = 0, 0, held_out_reward()
        metrics.truncate_after(-1)
        metrics.write({"step": 0, "eval_reward": initial_reward})
    else:
        start_rollout, step, initial_reward = state["rollout"], state["step"], state["initial_reward"]
        moments.load_state_dict(state["moments"])
        kl_control.value = state["kl_coef"]
        torch.set_rng_state(state["rng"])
        metrics.truncate_after(step)

    # ---- the loop
    for rollout in range(start_rollout, total_rollouts):
        epoch, position = divmod(rollout, rollouts_per_epoch)
        order = batching.epoch_steps(len(prompts), rows_per_step=stage.rollout_batch_size,
                                     micro_batch_size=per_rank_prompts, rank=ctx.rank, world_size=world,
                                     seed=stage.seed, epoch=epoch)[position].micro_batches[0].rows
        batch_prompts = [prompts[i] for i in order for _ in range(stage.n_samples_per_prompt)]

        # rollout: sample, score, and the frozen models' views of the samples
        t0 = time.time()
        window.restart()
        responses = generate(batch_prompts)
        t_generate = time.time() - t0
        rewards, terms = score(batch_prompts, responses)
        raw_mean = gathered_mean(rewards)
        if stage.reward.normalize:
            everyone = [None] * world
            dist.all_gather_object(everyone, rewards)
            moments.update([r for part in everyone for r in part])
            rewards = moments.normalize(rewards, stage.reward.clip)
        elif stage.reward.clip:
            rewards = [max(-stage.reward.clip, min(stage.reward.clip, r)) for r in rewards]

        actor.eval()
        experience = []
        with torch.no_grad():
            for start in range(0, len(batch_prompts), stage.micro_batch_size):
                sl = slice(start, start + stage.micro_batch_size)
                batch = sequences(batch_prompts[sl], responses[sl])
                window.add(batch, {}, sum(rollout_sequence_flops(flop_models, n, stage.ppo_epochs) for n in batch.lengths))
                mask = batch.loss_mask[:, 1:].float()
                old, _ = logprobs_of(actor, batch)
                ref, _ = logprobs_of(reference, batch)
                kl = L.kl_penalty(old, ref, stage.kl_estimator) * mask
                token_rewards = torch.zeros_like(old)
                last = mask.cumsum(1).argmax(1)  # the last response token of each row
                token_rewards[torch.arange(len(last)), last] = torch.tensor(rewards[sl], device=old.device)
                if stage.kl_in_reward:
                    token_rewards = token_rewards - kl_control.value * kl
                exp = {"batch": batch, "mask": mask, "old": old, "ref": ref, "kl": kl, "rewards": token_rewards}
                if critic is not None:
                    critic.eval()
                    exp["values"] = values_of(critic, batch) * mask
                experience.append(exp)

        # advantages
        if stage.advantage in ("grpo", "rloo"):
            scalar = torch.tensor(rewards, dtype=torch.float32)
            if stage.kl_in_reward:  # critic-free: the KL enters as a per-sequence penalty
                scalar -= kl_control.value * torch.cat([e["kl"].sum(1).cpu() for e in experience])
            per_sample = (L.grpo_advantages(scalar, stage.n_samples_per_prompt) if stage.advantage == "grpo"
                          else L.rloo_advantages(scalar, stage.n_samples_per_prompt))
        for i, exp in enumerate(experience):
            if stage.advantage == "gae":
                exp["advantages"], exp["returns"] = L.gae(exp["values"], exp["rewards"], exp["mask"], stage.gamma, stage.lam)
            elif stage.advantage == "reinforce_pp":
                exp["advantages"] = L.reinforce_pp_returns(exp["rewards"], exp["mask"], stage.gamma)
            else:
                n = exp["mask"].shape[0]
                start = i * stage.micro_batch_size
                exp["advantages"] = per_sample[start : start + n].to(exp["mask"].device).unsqueeze(1) * exp["mask"]
        if stage.advantage == "gae":  # whiten over the whole rollout (every rank)
            flat = torch.cat([e["advantages"][e["mask"] > 0] for e in experience])
            mean, sq, count = engine.all_reduce_sums([flat.sum().item(), flat.square().sum().item(), flat.numel()])
            std = max(sq / count - (mean / count) ** 2, 0.0) ** 0.5
            for exp in experience:
                exp["advantages"] = (exp["advantages"] - mean / count) / (std + 1e-8) * exp["mask"]

        # updates
        t1 = time.time()
        actor.train()
        if critic is not None:
            critic.train()
        sums: dict[str, float] = {}
        order_generator = torch.Generator().manual_seed(stage.seed * 7919 + rollout)
        for _ in range(stage.ppo_epochs):
            for k in torch.randperm(len(experience), generator=order_generator).tolist():
                exp = experience[k]
                new, logits = logprobs_of(actor, exp["batch"])
                loss, stats = L.policy_loss(new, exp["old"], exp["advantages"], exp["mask"], stage.clip_eps)
                if not stage.kl_in_reward:
                    loss = loss + kl_control.value * L.masked_mean(L.kl_penalty(new, exp["ref"], stage.kl_estimator), exp["mask"])
                actor.backward(loss)
                actor.step()
                entropy = L.masked_mean(L.entropy_from_logits(logits[:, :-1].detach().float()), exp["mask"])
                record = {"policy_loss": loss.item(), "clip_fraction": stats["clip_fraction"].item(),
                          "approx_kl": stats["approx_kl"].item(), "entropy": entropy.item()}
                if critic is not None:
                    values = values_of(critic, exp["batch"])
                    vloss, vclip = L.value_loss(values, exp["values"], exp["returns"], exp["mask"], stage.value_clip_eps)
                    critic.backward(vloss)
                    critic.step()
                    record.update(value_loss=vloss.item(), value_clip_fraction=float(vclip))
                for key, value in record.items():
                    sums[key] = sums.get(key, 0.0) + value
        t_train = time.time() - t1
        previous_step, step = step, min(total_steps, (rollout + 1) * steps_per_rollout)

        kl_per_sequence = gathered_mean([float(e["kl"].sum(1).mean()) for e in experience])
        kl_control.update(kl_per_sequence, stage.rollout_batch_size * stage.n_samples_per_prompt)
        updates = stage.ppo_epochs * len(experience)
        averaged = engine.all_reduce_sums([v / updates for v in sums.values()])
        response_tokens = sum(len(r) for r in responses)
        gen_tokens = engine.all_reduce_sums([float(response_tokens)])[0]
        record = {
            "step": step,
            "rollout": rollout + 1,
            "reward": raw_mean,
            **{f"reward_{k}": v for k, v in terms.items()},
            "kl": kl_per_sequence,
            "kl_coef": kl_control.value,
            **{k: v / world for k, v in zip(sums, averaged)},
            "response_length": gen_tokens / (len(responses) * world),
            "generate_s": t_generate,
            "score_s": t1 - t0 - t_generate,  # rewards, and the frozen models' and critic's passes
            "train_s": t_train,
            "rollout_s": time.time() - t0,
            "generate_tokens_per_s": gen_tokens / max(t_generate, 1e-9),
            "lr": actor.get_lr()[0],
            **window.close(step - previous_step),
        }
        metrics.write(record)  # one line per rollout: each is already a mean over its updates
        crossed = lambda interval: interval and step // interval > previous_step // interval  # noqa: E731
        if crossed(stage.eval_interval) and rollout + 1 < total_rollouts:
            metrics.write({"step": step, "eval_reward": held_out_reward()})
        if crossed(stage.save_interval) and rollout + 1 < total_rollouts:
            checkpoints.save(actor, step, {
                "rollout": rollout + 1, "step": step, "initial_reward": initial_reward,
                "moments": moments.state_dict(), "kl_coef": kl_control.value, "rng": torch.get_rng_state(),
            }, others)

    final_reward = held_out_reward()
    metrics.write({"step": step, "eval_reward": final_reward})
    metrics.close()
    engine.export(actor, tokenizer, stage, ctx.folder.model, ctx.is_main)
    return {
        "initial_reward": initial_reward,
        "final_reward": final_reward,
        "steps": step,
        "rollouts": total_rollouts,
        "train_prompts": len(prompts),
        "eval_prompts": len(eval_prompts),
        "truncation": tokenized.record(),
    }
