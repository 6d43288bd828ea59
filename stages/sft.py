"""Supervised fine-tuning: next-token cross-entropy on the response tokens only.

Rows are prompt/response pairs or chat `messages` (every assistant turn is
learned). result.json: initial_eval_loss (before training), final_eval_loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages import data, engine, models


def run(task, ctx) -> dict:
    stage = task.stage

    # ---- data
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    train_rows, eval_rows = data.load_splits(stage.data, "sft", ctx.builtin_root, stage.seed)
    train_set = [data.tokenize_sft(r, tokenizer, stage.data, stage.max_len) for r in train_rows]
    eval_set = [data.tokenize_sft(r, tokenizer, stage.data, stage.max_len) for r in eval_rows]

    # ---- model
    ds_config = ctx.deepspeed_config(stage, model_path)
    model = models.load_causal_lm(model_path, stage, ds_config, ctx.on_gpu)
    steps_per_epoch, total_steps = engine.step_counts(len(train_set), stage, ds_config, ctx.world_size)
    ds = engine.initialize(model, stage, ds_config, total_steps)

    def batch_of(indices, rows):
        return {k: v.to(ctx.device) for k, v in data.pad_batch([rows[i] for i in indices], tokenizer.pad_token_id).items()}

    def token_losses(batch):
        """Per-token loss on response positions: (sum, count) over the micro batch."""
        logits = ds(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["input_ids"][:, 1:]
        mask = batch["loss_mask"][:, 1:].float()
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, reduction="none")
        return (nll * mask).sum(dim=1), mask.sum(dim=1)

    # ---- loss and evaluation
    def loss(indices):
        total, count = token_losses(batch_of(indices, train_set))
        return total.sum() / count.sum().clamp(min=1), {}

    @torch.no_grad()
    def evaluate():
        ds.eval()
        loss_sum, token_count = 0.0, 0.0
        for indices, weights in data.eval_batches(len(eval_set), stage.micro_batch_size, ctx.rank, ctx.world_size):
            total, count = token_losses(batch_of(indices, eval_set))
            w = torch.tensor(weights, device=total.device)
            loss_sum += float((total * w).sum())
            token_count += float((count * w).sum())
        loss_sum, token_count = engine.all_reduce_sums([loss_sum, token_count])
        return {"loss": loss_sum / max(token_count, 1.0)}

    # ---- train, export
    loop = engine.Loop(
        loss=loss,
        evaluate=evaluate,
        micro_batches=lambda epoch: data.micro_batches(
            len(train_set), stage.micro_batch_size, ctx.rank, ctx.world_size, stage.seed, epoch
        ),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        tokens=lambda indices: sum(len(train_set[i]["input_ids"]) for i in indices),
    )
    outcome = engine.train(ds, loop, stage, ctx)
    engine.export(ds, tokenizer, stage, ctx.run_dir / "model", ctx.is_main)
    return {
        "initial_eval_loss": outcome["initial"]["loss"],
        "final_eval_loss": outcome["final"]["loss"],
        "steps": outcome["steps"],
        "train_rows": len(train_set),
        "eval_rows": len(eval_set),
    }
