"""Reward model: a scalar head on a language model, trained so chosen outscores rejected.

Loss (Bradley-Terry): -log sigmoid(r_chosen - r_rejected - margin), per pair.
Chosen and rejected go through the model in one batch of 2B rows.
result.json: eval_accuracy (held-out pairs where r_chosen > r_rejected),
eval_margin, and the mean/std of rewards over the eval set, also saved beside
the model as reward_stats.json (PPO normalises rewards with them).
"""

from __future__ import annotations

import torch

from stages import data, engine, models
from stages.losses import reward_pair_loss


def run(task, ctx) -> dict:
    stage = task.stage

    # ---- data
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    train_rows, eval_rows = data.load_splits(stage.data, "rm", ctx.builtin_root, stage.seed)
    train_set = [data.tokenize_pair(r, tokenizer, stage.data, stage.max_len) for r in train_rows]
    eval_set = [data.tokenize_pair(r, tokenizer, stage.data, stage.max_len) for r in eval_rows]

    # ---- model
    ds_config = ctx.deepspeed_config(stage, model_path)
    model = models.load_reward_model(model_path, stage, ds_config, ctx.on_gpu, tokenizer.pad_token_id)
    steps_per_epoch, total_steps = engine.step_counts(len(train_set), stage, ds_config, ctx.world_size)
    ds = engine.initialize(model, stage, ds_config, total_steps)

    def rewards(indices, rows):
        """(chosen rewards, rejected rewards) for the pairs at `indices`."""
        pairs = [rows[i] for i in indices]
        batch = data.pad_pairs(pairs, tokenizer.pad_token_id, ctx.device)
        scores = ds(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()
        return scores[: len(pairs)], scores[len(pairs):]

    # ---- loss and evaluation
    def loss(indices):
        chosen, rejected = rewards(indices, train_set)
        losses = reward_pair_loss(chosen, rejected, margin=stage.margin or None)
        return losses.mean(), {
            "accuracy": (chosen > rejected).float().mean().item(),
            "margin": (chosen - rejected).mean().item(),
        }

    @torch.no_grad()
    def evaluate():
        ds.eval()
        sums = [0.0] * 6  # loss, correct, margin, count, reward sum, reward square sum
        for indices, weights in data.eval_batches(len(eval_set), stage.micro_batch_size, ctx.rank, ctx.world_size):
            chosen, rejected = rewards(indices, eval_set)
            w = torch.tensor(weights, device=chosen.device)
            both = torch.cat([chosen, rejected])
            sums = [a + float(b) for a, b in zip(sums, (
                (reward_pair_loss(chosen, rejected, margin=stage.margin or None) * w).sum(),
                ((chosen > rejected).float() * w).sum(),
                ((chosen - rejected) * w).sum(),
                w.sum(),
                (both * w.repeat(2)).sum(),
                (both.square() * w.repeat(2)).sum(),
            ))]
        loss_sum, correct, margin, count, r_sum, r_sq = engine.all_reduce_sums(sums)
        mean = r_sum / (2 * count)
        return {
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "margin": margin / count,
            "reward_mean": mean,
            "reward_std": max(r_sq / (2 * count) - mean * mean, 0.0) ** 0.5,
        }

    # ---- train, export
    loop = engine.Loop(
        loss=loss,
        evaluate=evaluate,
        micro_batches=lambda epoch: data.micro_batches(
            len(train_set), stage.micro_batch_size, ctx.rank, ctx.world_size, stage.seed, epoch
        ),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        tokens=lambda indices: sum(len(train_set[i]["chosen_input_ids"]) + len(train_set[i]["rejected_input_ids"])
                                   for i in indices),
    )
    outcome = engine.train(ds, loop, stage, ctx)
    final = outcome["final"]
    stats = {"mean": final["reward_mean"], "std": final["reward_std"]}
    engine.export(ds, tokenizer, stage, ctx.run_dir / "model", ctx.is_main, extra_files={"reward_stats.json": stats})
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
    }
