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

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from stages import data, engine, models
from stages.losses import dpo_loss, sequence_logprobs


def run(task, ctx) -> dict:
    stage = task.stage

    # ---- data
    model_path = models.resolve(task.init_model, ctx.builtin_root)
    tokenizer = models.load_tokenizer(model_path)
    train_rows, eval_rows = data.load_splits(stage.data, "dpo", ctx.builtin_root, stage.seed)
    splits = {
        "train": [data.tokenize_pair(r, tokenizer, stage.data, stage.max_len) for r in train_rows],
        "eval": [data.tokenize_pair(r, tokenizer, stage.data, stage.max_len) for r in eval_rows],
    }

    def pair_logps(forward, indices, split):
        """Summed response log-probs (chosen, rejected) and the batch, for the pairs at indices."""
        batch = data.pad_pairs([splits[split][i] for i in indices], tokenizer.pad_token_id, ctx.device)
        logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logps = sequence_logprobs(logits, batch["input_ids"], batch["loss_mask"])
        return logps[: len(indices)], logps[len(indices):], logits, batch

    # ---- the reference
    ds_config = ctx.deepspeed_config(stage, model_path)
    frozen_config = ctx.frozen_model_config(stage, model_path, offload=stage.reference == "offload")
    if stage.reference == "precompute":
        cached = _precomputed_reference(ctx, task, splits, pair_logps, model_path, frozen_config)
        reference_logps = lambda indices, split: tuple(cached[split][indices].to(ctx.device).unbind(1))  # noqa: E731
    else:
        reference = models.load_frozen(
            AutoModelForCausalLM, model_path, stage, frozen_config, ctx.device, stage.reference == "offload"
        )
        reference_logps = lambda indices, split: pair_logps(reference, indices, split)[:2]  # noqa: E731

    # ---- the policy
    model = models.load_causal_lm(model_path, stage, ds_config, ctx.on_gpu)
    steps_per_epoch, total_steps = engine.step_counts(len(splits["train"]), stage, ds_config, ctx.world_size)
    ds = engine.initialize(model, stage, ds_config, total_steps)

    def preference_terms(indices, split):
        policy_chosen, policy_rejected, logits, batch = pair_logps(ds, indices, split)
        ref_chosen, ref_rejected = reference_logps(indices, split)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected,
            beta=stage.beta, label_smoothing=stage.label_smoothing, loss_type=stage.loss_type,
        )
        if stage.chosen_nll_coef:
            n = len(indices)
            chosen_nll = -sequence_logprobs(logits[:n], batch["input_ids"][:n], batch["loss_mask"][:n], average=True)
            losses = losses + stage.chosen_nll_coef * chosen_nll
        return losses, chosen_rewards, rejected_rewards

    # ---- loss and evaluation
    def loss(indices):
        losses, chosen, rejected = preference_terms(indices, "train")
        return losses.mean(), {
            "reward_accuracy": (chosen > rejected).float().mean().item(),
            "reward_margin": (chosen - rejected).mean().item(),
            "chosen_reward": chosen.mean().item(),
            "rejected_reward": rejected.mean().item(),
        }

    @torch.no_grad()
    def evaluate():
        ds.eval()
        sums = [0.0] * 6  # loss, correct, margin, chosen, rejected, count
        for indices, weights in data.eval_batches(len(splits["eval"]), stage.micro_batch_size, ctx.rank, ctx.world_size):
            losses, chosen, rejected = preference_terms(indices, "eval")
            w = torch.tensor(weights, device=losses.device)
            sums = [a + float(b) for a, b in zip(sums, (
                (losses * w).sum(), ((chosen > rejected).float() * w).sum(), ((chosen - rejected) * w).sum(),
                (chosen * w).sum(), (rejected * w).sum(), w.sum(),
            ))]
        loss_sum, correct, margin, chosen_sum, rejected_sum, count = engine.all_reduce_sums(sums)
        return {
            "loss": loss_sum / count,
            "reward_accuracy": correct / count,
            "reward_margin": margin / count,
            "chosen_reward": chosen_sum / count,
            "rejected_reward": rejected_sum / count,
        }

    # ---- train, export
    loop = engine.Loop(
        loss=loss,
        evaluate=evaluate,
        micro_batches=lambda epoch: data.micro_batches(
            len(splits["train"]), stage.micro_batch_size, ctx.rank, ctx.world_size, stage.seed, epoch
        ),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        tokens=lambda indices: sum(
            len(splits["train"][i]["chosen_input_ids"]) + len(splits["train"][i]["rejected_input_ids"]) for i in indices
        ),
    )
    outcome = engine.train(ds, loop, stage, ctx)
    engine.export(ds, tokenizer, stage, ctx.run_dir / "model", ctx.is_main)
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
    }


def _precomputed_reference(ctx, task, splits, pair_logps, model_path, frozen_config) -> dict:
    """Reference log-probs (chosen, rejected) of every row, per split, computed once.

    Every rank computes a share of the rows (equal batch counts, as ZeRO-3 needs),
    the shares are summed into full tables, and rank 0 caches them on disk, so a
    resumed stage does not recompute them.
    """
    stage = task.stage
    cache = ctx.run_dir / "reference_logps.pt"
    if cache.exists():
        saved = torch.load(cache)
        if saved.get("spec_hash") == task.spec_hash:
            return saved["logps"]
    reference = models.load_frozen(AutoModelForCausalLM, model_path, stage, frozen_config, ctx.device, offload=False)
    tables = {}
    for split, rows in splits.items():
        table = torch.zeros(len(rows), 2, dtype=torch.float64, device=ctx.device)
        for indices, weights in data.eval_batches(len(rows), stage.micro_batch_size, ctx.rank, ctx.world_size):
            chosen, rejected, _, _ = pair_logps(reference, indices, split)
            for i, w, c, r in zip(indices, weights, chosen.tolist(), rejected.tolist()):
                if w:
                    table[i, 0], table[i, 1] = c, r
        dist.all_reduce(table)
        tables[split] = table.float().cpu()
    reference.release()
    if ctx.is_main:
        tmp = cache.with_suffix(".tmp")
        torch.save({"spec_hash": task.spec_hash, "logps": tables}, tmp)
        tmp.replace(cache)
    dist.barrier()
    return tables
