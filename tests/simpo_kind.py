"""A supervised kind added in one file, as a plug-in would be: SimPO (Meng et al. 2024, arXiv
2405.14734), preference learning with no reference model. Its schema, its recipe (stages/recipe.py:
only its loss, evaluation and result) and its declaration, registered with core/kinds.py on import.

The implicit reward of a response is its mean log-prob per token; the loss is
-log sigmoid(beta * (r_chosen - r_rejected) - gamma). A pair makes two sequences because the
declaration says its rows are `preference` rows: nothing here counts them.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from core import kinds
from core.batching import MicroBatch, Step
from core.config import StageBase
from core.kinds import StageKind
from stages import models
from stages.recipe import Recipe


class SimPOStage(StageBase):
    """Prefer chosen over rejected by length-normalised log-probs, with a target margin."""

    kind: Literal["simpo"] = Field(..., description="Stage kind: simpo (tests/simpo_kind.py).")
    beta: float = Field(2.0, gt=0, description="Scale of the length-normalised reward margin.")
    gamma: float = Field(0.5, ge=0, description="Target reward margin.")


class SimPO(Recipe):
    def terms(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen rewards, rejected rewards): rewards are mean log-probs per response token."""
        summed = batch.per_sequence(models.next_token_logprobs(self.ds, batch, self.stage.logits_tile))
        counts = batch.per_sequence(batch.loss_mask[:, 1:].to(summed.dtype)).clamp(min=1)
        reward = summed / counts
        chosen, rejected = reward[0::2], reward[1::2]
        losses = -F.logsigmoid(self.stage.beta * (chosen - rejected) - self.stage.gamma)
        return losses, chosen.detach(), rejected.detach()

    def loss(self, batch, micro: MicroBatch, step: Step) -> tuple[torch.Tensor, dict]:
        losses, chosen, rejected = self.terms(batch)
        return self.per_pair(step, micro, losses, reward_accuracy=(chosen > rejected).float())

    def evaluate(self) -> dict:
        def sums(batch, micro):
            losses, chosen, rejected = self.terms(batch)
            return [losses.sum(), (chosen > rejected).float().sum(), torch.tensor(float(len(chosen)),
                                                                                  device=self.ctx.device)]

        loss_sum, correct, count = self.eval_sums(sums, 3)
        return {"loss": loss_sum / count, "reward_accuracy": correct / count}

    def result(self, outcome: dict) -> dict:
        initial, final = outcome["initial"], outcome["final"]
        return {"initial_eval_loss": initial["loss"], "eval_loss": final["loss"],
                "initial_eval_reward_accuracy": initial["reward_accuracy"],
                "eval_reward_accuracy": final["reward_accuracy"], "steps": outcome["steps"],
                "train_pairs": len(self.train_set), "eval_pairs": len(self.eval_set)}


KIND = kinds.register(StageKind("simpo", SimPOStage, rows="preference", headline="eval_reward_accuracy",
                                run=SimPO.run))
