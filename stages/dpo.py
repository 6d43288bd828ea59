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
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from core.batching import MicroBatch, Step
from core.failure import saving
from core.flops import sequence_flops
from core.runfolder import temporary
from core.task import StageTask
from stages import collectives, data, models, watchdog
from stages.losses import dpo_loss
from stages.recipe import Recipe

if TYPE_CHECKING:
    from core.schemas.dpo import DPOStage
    from stages.runner import StageContext

log = logging.getLogger("stages")


class DPO(Recipe):
    stage: DPOStage

    def load_models(self):
        """The reference first (precomputed: its log-probs of every row, then freed), then the policy."""
        stage, ctx = self.stage, self.ctx
        frozen_config = ctx.frozen_model_config(stage, self.model_path, offload=stage.reference == "offload")
        if stage.reference == "precompute":
            splits = {"train": self.train_set, "eval": self.eval_set}
            self.cached = _precomputed_reference(ctx, self.task, splits, self.pair_logps, self.model_path,
                                                 frozen_config)
        else:
            self.reference = models.load_frozen(
                AutoModelForCausalLM, self.model_path, stage, frozen_config, ctx.device, stage.reference == "offload",
                drops_head=models.SCORE_HEAD,
            )
        return super().load_models()

    def pair_logps(self, forward, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed response log-probs of each pair's chosen and rejected sequences."""
        per_sequence = batch.per_sequence(models.next_token_logprobs(forward, batch, self.stage.logits_tile))
        return per_sequence[0::2], per_sequence[1::2]

    def reference_logps(self, batch, micro: MicroBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stage.reference == "precompute":
            return tuple(self.cached[split][list(micro.rows)].to(self.ctx.device).unbind(1))
        return self.pair_logps(self.reference, batch)

    def preference_terms(self, batch, micro: MicroBatch, split: str):
        """(per-pair losses, chosen implicit rewards, rejected implicit rewards)."""
        stage = self.stage
        policy_chosen, policy_rejected = self.pair_logps(self.ds, batch)
        ref_chosen, ref_rejected = self.reference_logps(batch, micro, split)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected,
            beta=stage.beta, label_smoothing=stage.label_smoothing, loss_type=stage.loss_type,
        )
        if stage.chosen_nll_coef:
            counts = batch.per_sequence(batch.loss_mask[:, 1:].to(policy_chosen.dtype))[0::2]
            losses = losses - stage.chosen_nll_coef * policy_chosen / counts.clamp(min=1)
        return losses, chosen_rewards, rejected_rewards

    def loss(self, batch, micro: MicroBatch, step: Step) -> tuple[torch.Tensor, dict]:
        losses, chosen, rejected = self.preference_terms(batch, micro, "train")
        return self.per_pair(step, micro, losses, reward_accuracy=(chosen > rejected).float(),
                             reward_margin=chosen - rejected, chosen_reward=chosen, rejected_reward=rejected)

    def evaluate(self) -> dict:
        def terms(batch, micro):
            losses, chosen, rejected = self.preference_terms(batch, micro, "eval")
            return [losses.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                    chosen.sum(), rejected.sum(), torch.tensor(float(len(chosen)), device=self.ctx.device)]

        loss_sum, correct, margin, chosen_sum, rejected_sum, count = self.eval_sums(terms, 6)
        return {
            "loss": loss_sum / count,
            "reward_accuracy": correct / count,
            "reward_margin": margin / count,
            "chosen_reward": chosen_sum / count,
            "rejected_reward": rejected_sum / count,
        }

    def flops(self, batch) -> float:
        """The policy's forward and backward, and a live reference's forward."""
        live_reference = self.stage.reference != "precompute"
        return super().flops(batch) + (sum(sequence_flops(self.shape, "lm", n, trained=False) for n in batch.lengths)
                                       if live_reference else 0.0)

    def result(self, outcome: dict) -> dict:
        initial, final = outcome["initial"], outcome["final"]
        return {
            "initial_eval_loss": initial["loss"],
            "eval_loss": final["loss"],
            "initial_eval_reward_accuracy": initial["reward_accuracy"],
            "eval_reward_accuracy": final["reward_accuracy"],
            "eval_margin": final["reward_margin"],
            "steps": outcome["steps"],
            "train_pairs": len(self.train_set),
            "eval_pairs": len(self.eval_set),
        }


run = DPO.run


@watchdog.phase(watchdog.REFERENCE_PRECOMPUTE)
def _precomputed_reference(ctx: StageContext, task: StageTask, splits: dict[str, data.TokenRows],
                           pair_logps: Callable, model_path: str, frozen_config: dict) -> dict:
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
                chosen, rejected = pair_logps(reference, rows.batch(micro))
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
