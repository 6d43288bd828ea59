"""Supervised fine-tuning: next-token cross-entropy on the response tokens only.

Rows are prompt/response pairs or chat `messages` (every assistant turn is
learned). The loss is the mean over every response token of the global batch,
so packing, micro batch size and process count do not change it.
result.json: initial_eval_loss (before training), final_eval_loss.
"""

from __future__ import annotations

import torch

from core import kinds
from core.flops import sequence_flops
from stages import collectives, data, engine, models


@kinds.implements("sft")
def run(task, ctx) -> dict:
    stage = task.stage

    # ---- data
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    tokenized = data.tokenized_splits(stage, tokenizer, ctx.builtin_root)
    train_tokens, eval_tokens = tokenized.train.tokens, tokenized.eval.tokens

    # ---- model
    ds_config = ctx.deepspeed_config(stage, model_path)
    model = models.load_causal_lm(model_path, stage, ds_config, ctx.on_gpu)
    attention = models.attention_implementation(stage.attention, ctx.on_gpu, model_path)
    train_set = data.TokenRows(train_tokens, stage, ctx, tokenizer.pad_token_id, attention, sequences_per_row=1)
    eval_set = data.TokenRows(eval_tokens, stage, ctx, tokenizer.pad_token_id, attention, sequences_per_row=1)
    steps_per_epoch, total_steps = engine.step_counts(len(train_tokens), train_set.rows_per_step, stage)
    ds = engine.initialize(model, stage, ds_config, total_steps)

    def summed_nll(batch):
        """(summed negative log-likelihood of the response tokens, their count)."""
        logps = models.next_token_logprobs(ds, batch, stage.logits_tile)
        return -logps.sum(), batch.loss_mask[:, 1:].sum()

    # ---- loss and evaluation
    def loss(batch, micro, step):
        nll, _ = summed_nll(batch)
        share = nll * (micro.weight / max(train_set.trained_in(step.rows), 1))
        return share, {"loss": share}

    @torch.no_grad()
    def evaluate():
        ds.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        count = torch.zeros((), dtype=torch.float64, device=ctx.device)
        for micro in eval_set.eval_micro_batches():
            nll, n = summed_nll(eval_set.batch(micro))
            loss_sum += nll * micro.weight
            count += n * micro.weight
        loss_sum, count = collectives.sum_once_per_group(torch.stack([loss_sum, count])).tolist()
        return {"loss": loss_sum / max(count, 1.0)}

    # ---- train, export
    shape, lora = models.shape_of(model_path), models.lora_params(model)
    loop = engine.Loop(
        batch=train_set.batch,
        loss=loss,
        evaluate=evaluate,
        steps=train_set.steps,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        flops=lambda batch: sum(sequence_flops(shape, "lm", n, trained=True, lora_params=lora) for n in batch.lengths),
    )
    outcome = engine.train(ds, loop, stage, ctx)
    engine.export(ds, tokenizer, stage, ctx.folder.model, ctx.is_main)
    return {
        "initial_eval_loss": outcome["initial"]["loss"],
        "final_eval_loss": outcome["final"]["loss"],
        "steps": outcome["steps"],
        "train_rows": len(train_set),
        "eval_rows": len(eval_set),
        "truncation": tokenized.record(),
    }
