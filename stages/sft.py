"""Supervised fine-tuning: next-token cross-entropy on the response tokens only.

Rows are prompt/response pairs or chat `messages` (every assistant turn is
learned). The loss is the mean over every response token of the global batch,
so packing, micro batch size and process count do not change it.
result.json: initial_eval_loss (before training), final_eval_loss.
"""

from __future__ import annotations

import torch

from core.batching import MicroBatch, Step
from stages import models
from stages.recipe import Recipe


class SFT(Recipe):
    def summed_nll(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed negative log-likelihood of the response tokens, their count)."""
        logps = models.next_token_logprobs(self.ds, batch, self.stage.logits_tile)
        return -logps.sum(), batch.loss_mask[:, 1:].sum()

    def loss(self, batch, micro: MicroBatch, step: Step) -> tuple[torch.Tensor, dict]:
        nll, _ = self.summed_nll(batch)
        share = nll * (micro.weight / max(self.train_set.trained_in(step.rows), 1))
        return share, {"loss": share}

    def evaluate(self) -> dict:
        def terms(batch, micro):
            nll, count = self.summed_nll(batch)
            return [nll, count.to(nll.dtype)]

        loss_sum, count = self.eval_sums(terms, 2)
        return {"loss": loss_sum / max(count, 1.0)}

    def result(self, outcome: dict) -> dict:
        return {
            "initial_eval_loss": outcome["initial"]["loss"],
            "final_eval_loss": outcome["final"]["loss"],
            "steps": outcome["steps"],
            "train_rows": len(self.train_set),
            "eval_rows": len(self.eval_set),
        }


run = SFT.run
