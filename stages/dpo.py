"""Direct preference optimisation: the policy learns to prefer chosen over rejected
relative to a frozen reference that starts from the same weights.

Implicit reward of a response: beta * (log pi(y|x) - log pi_ref(y|x)). Loss:
sigmoid (DPO), ipo, or conservative DPO (label smoothing) — see stages/losses.py.
Chosen and rejected go through the policy in one concatenated forward pass.
The reference is live, offloaded to host RAM between uses, or precomputed: its
log-probs for every row computed once before training and cached on disk
(reference_logps.pt), so no reference model is in memory while training.
result.json: eval_reward_accuracy (held-out pairs whose chosen implicit reward
is higher), eval_loss, eval_margin, and their values before training.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from core import kinds
from core.failure import saving
from core.flops import sequence_flops
from core.runfolder import temporary
from stages import collectives, data, engine, models, watchdog
from stages.losses import dpo_loss

log = logging.getLogger("stages")


@kinds.implements("dpo")
def run(task, ctx) -> dict:
    stage = task.stage

    # ---- data
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    tokenized = data.tokenized_splits(stage, tokenizer, ctx.builtin_root)
    tokens = {"train": tokenized.train.tokens, "eval": tokenized.eval.tokens}

    def pair_logps(forward, batch):
        """Summed response log-probs of each pair's chosen and rejected sequences, and the batch."""
        per_sequence = batch.per_sequence(models.next_token_logprobs(forward, batch, stage.logits_tile))
        return per_sequence[0::2], per_sequence[1::2], batch

    attention = models.attention_implementation(stage.attention, ctx.on_gpu, model_path)
    splits = {name: data.TokenRows(rows, stage, ctx, tokenizer.pad_token_id, attention, sequences_per_row=2)
              for name, rows in tokens.items()}

    # ---- the reference
    ds_config = ctx.deepspeed_config(stage, model_path)
    frozen_config = ctx.frozen_model_config(stage, model_path, offload=stage.reference == "offload")
    if stage.reference == "precompute":
        cached = _precomputed_reference(ctx, task, splits, pair_logps, model_path, frozen_config)

        def reference_logps(batch, micro, split):
            return tuple(cached[split][list(micro.rows)].to(ctx.device).unbind(1))
    else:
        reference = models.load_frozen(
            AutoModelForCausalLM, model_path, stage, frozen_config, ctx.device, stage.reference == "offload",
            drops_head=models.SCORE_HEAD,
        )

        def reference_logps(batch, micro, split):
            chosen, rejected, _ = pair_logps(reference, batch)
            return chosen, rejected

    # ---- the policy
    model = models.load_causal_lm(model_path, stage, ds_config, ctx.on_gpu)
    steps_per_epoch, total_steps = engine.step_counts(len(tokens["train"]), splits["train"].rows_per_step, stage)
    ds = engine.initialize(model, stage, ds_config, total_steps)

    def preference_terms(batch, micro, split):
        policy_chosen, policy_rejected, _ = pair_logps(ds, batch)
        ref_chosen, ref_rejected = reference_logps(batch, micro, split)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected,
            beta=stage.beta, label_smoothing=stage.label_smoothing, loss_type=stage.loss_type,
        )
        if stage.chosen_nll_coef:
            counts = batch.per_sequence(batch.loss_mask[:, 1:].to(policy_chosen.dtype))[0::2]
            losses = losses - stage.chosen_nll_coef * policy_chosen / counts.clamp(min=1)
        return losses, chosen_rewards, rejected_rewards

    # ---- loss and evaluation
    def loss(batch, micro, step):
        losses, chosen, rejected = preference_terms(batch, micro, "train")
        weight = micro.weight / len(step.rows)
        return losses.sum() * weight, {
            "loss": losses.detach().sum() * weight,
            "reward_accuracy": (chosen > rejected).float().sum() * weight,
            "reward_margin": (chosen - rejected).sum() * weight,
            "chosen_reward": chosen.sum() * weight,
            "rejected_reward": rejected.sum() * weight,
        }

    @torch.no_grad()
    def evaluate():
        ds.eval()
        sums = torch.zeros(6, dtype=torch.float64, device=ctx.device)  # loss, correct, margin, chosen, rejected, pairs
        for micro in splits["eval"].eval_micro_batches():
            losses, chosen, rejected = preference_terms(splits["eval"].batch(micro), micro, "eval")
            sums += micro.weight * torch.stack([
                losses.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                chosen.sum(), rejected.sum(), torch.tensor(float(len(chosen)), device=ctx.device),
            ]).double()
        loss_sum, correct, margin, chosen_sum, rejected_sum, count = collectives.sum_once_per_group(sums).tolist()
        return {
            "loss": loss_sum / count,
            "reward_accuracy": correct / count,
            "reward_margin": margin / count,
            "chosen_reward": chosen_sum / count,
            "rejected_reward": rejected_sum / count,
        }

    # ---- train, export
    shape, lora = models.shape_of(model_path), models.lora_params(model)
    live_reference = stage.reference != "precompute"

    def flops(batch):
        return sum(sequence_flops(shape, "lm", n, trained=True, lora_params=lora)
                   + (sequence_flops(shape, "lm", n, trained=False) if live_reference else 0.0)
                   for n in batch.lengths)

    loop = engine.Loop(
        batch=splits["train"].batch,
        loss=loss,
        evaluate=evaluate,
        steps=splits["train"].steps,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        flops=flops,
    )
    outcome = engine.train(ds, loop, stage, ctx)
    engine.export(ds, tokenizer, stage, ctx.folder.model, ctx.is_main)
    initial, final = outcome["initial"], outcome["final"]
    return {
        "initial_eval_loss": initial["loss"],
        "eval_loss": final["loss"],
        "initial_eval_reward_accuracy": initial["reward_accuracy"],
        "eval_reward_accuracy": final["reward_accuracy"],
        "eval_margin": final["reward_margin"],
        "steps": outcome["steps"],
        "train_pairs": len(splits["train"]),
        "eval_pairs": len(splits["eval"]),
        "truncation": tokenized.record(),
    }


@watchdog.phase(watchdog.REFERENCE_PRECOMPUTE)
def _precomputed_reference(ctx, task, splits, pair_logps, model_path, frozen_config) -> dict:
    """Reference log-probs (chosen, rejected) of every row, per split, computed once.

    Every rank computes a share of the rows (equal pass counts, as ZeRO-3 needs),
    the shares are summed into full tables, and rank 0 caches them on disk, so a
    resumed stage does not recompute them.
    """
    stage = task.stage
    cache = ctx.folder.reference_logps
    if cache.exists():
        saved = torch.load(cache)
        if saved.get("spec_hash") == task.spec_hash:
            return saved["logps"]
    log.info("stage %s: computing the reference model's log-probs of %s pairs once (cached in %s)", stage.name,
             " and ".join(f"{len(rows)} {split}" for split, rows in splits.items()), cache)
    reference = models.load_frozen(AutoModelForCausalLM, model_path, stage, frozen_config, ctx.device, offload=False,
                                   drops_head=models.SCORE_HEAD)
    tables = {}
    with torch.no_grad():
        for split, rows in splits.items():
            table = torch.zeros(len(rows), 2, dtype=torch.float64, device=ctx.device)
            for micro in rows.eval_micro_batches():
                chosen, rejected, _ = pair_logps(reference, rows.batch(micro))
                if micro.weight:
                    index = torch.tensor(micro.rows, device=ctx.device)
                    table[index] = torch.stack([chosen, rejected], dim=1).double()
            collectives.sum_once_per_group(table)
            tables[split] = table.float().cpu()
    reference.release()
    if ctx.is_main:
        tmp = temporary(cache)
        with saving(tmp, "the reference log-probs"):
            torch.save({"spec_hash": task.spec_hash, "logps": tables}, tmp)
        tmp.replace(cache)
    dist.barrier()
    return tables
