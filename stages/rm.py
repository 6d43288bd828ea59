"""Reward model: a scalar head on a language model, trained so chosen outscores rejected.

Loss (Bradley-Terry): -log sigmoid(r_chosen - r_rejected - margin), averaged over
the pairs of the global batch. A sequence's reward is the head's score at the
token transformers' sequence classifier reads (its last token that is not the pad
id), so the exported model scores as it was trained, packed or padded.
result.json: eval_accuracy (held-out pairs where r_chosen > r_rejected),
eval_margin, and the mean/std of rewards over the eval set, also saved beside
the model as reward_stats.json.
"""

from __future__ import annotations

import torch

from core import kinds
from core.flops import sequence_flops
from stages import collectives, data, engine, models
from stages.losses import reward_pair_loss


@kinds.implements("rm")
def run(task, ctx) -> dict:
    stage = task.stage

    # ---- data
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    tokenized = data.tokenized_splits(stage, tokenizer, ctx.builtin_root)
    train_tokens, eval_tokens = tokenized.train.tokens, tokenized.eval.tokens

    # ---- model
    ds_config = ctx.deepspeed_config(stage, model_path)
    model = models.load_reward_model(model_path, stage, ds_config, ctx.on_gpu, tokenizer.pad_token_id)
    attention = models.attention_implementation(stage.attention, ctx.on_gpu, model_path)
    train_set = data.TokenRows(train_tokens, stage, ctx, tokenizer.pad_token_id, attention, sequences_per_row=2)
    eval_set = data.TokenRows(eval_tokens, stage, ctx, tokenizer.pad_token_id, attention, sequences_per_row=2)
    steps_per_epoch, total_steps = engine.step_counts(len(train_tokens), train_set.rows_per_step, stage)
    ds = engine.initialize(model, stage, ds_config, total_steps)

    def rewards(batch):
        """(chosen rewards, rejected rewards) of the batch's pairs."""
        read = models.sequence_scores(ds, batch, tokenizer.pad_token_id)
        return read[0::2], read[1::2]

    # ---- loss and evaluation
    def loss(batch, micro, step):
        chosen, rejected = rewards(batch)
        weight = micro.weight / len(step.rows)
        losses = reward_pair_loss(chosen, rejected, margin=stage.margin or None)
        return losses.sum() * weight, {
            "loss": losses.detach().sum() * weight,
            "accuracy": (chosen > rejected).float().sum() * weight,
            "margin": (chosen - rejected).detach().sum() * weight,
        }

    @torch.no_grad()
    def evaluate():
        ds.eval()
        sums = torch.zeros(6, dtype=torch.float64, device=ctx.device)  # loss, correct, margin, pairs, r, r^2
        for micro in eval_set.eval_micro_batches():
            chosen, rejected = rewards(eval_set.batch(micro))
            both = torch.cat([chosen, rejected])
            sums += micro.weight * torch.stack([
                reward_pair_loss(chosen, rejected, margin=stage.margin or None).sum(),
                (chosen > rejected).float().sum(),
                (chosen - rejected).sum(),
                torch.tensor(float(len(chosen)), device=ctx.device),
                both.sum(),
                both.square().sum(),
            ]).double()
        loss_sum, correct, margin, count, r_sum, r_sq = collectives.sum_once_per_group(sums).tolist()
        mean = r_sum / (2 * count)
        return {
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "margin": margin / count,
            "reward_mean": mean,
            "reward_std": max(r_sq / (2 * count) - mean * mean, 0.0) ** 0.5,
        }

    # ---- train, export
    shape, lora = models.shape_of(model_path), models.lora_params(model)
    loop = engine.Loop(
        batch=train_set.batch,
        loss=loss,
        evaluate=evaluate,
        steps=train_set.steps,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        flops=lambda batch: sum(sequence_flops(shape, "scalar", n, trained=True, lora_params=lora)
                                for n in batch.lengths),
    )
    outcome = engine.train(ds, loop, stage, ctx)
    final = outcome["final"]
    stats = {"mean": final["reward_mean"], "std": final["reward_std"]}
    engine.export(ds, tokenizer, stage, ctx.folder.model, ctx.is_main, extra_files={"reward_stats.json": stats})
    return {
        "initial_eval_accuracy": outcome["initial"]["accuracy"],
        "eval_accuracy": final["accuracy"],
        "eval_margin": final["margin"],
        "eval_loss": final["loss"],
        "reward_mean": final["reward_mean"],
        "reward_std": final["reward_std"],
        "steps": outcome["steps"],
        "train_pairs": len(train_set),
        "eval_pairs": len(eval_set),
        "truncation": tokenized.record(),
    }
