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

from typing import TYPE_CHECKING

import torch

from core.batching import MicroBatch, Step
from stages import models
from stages.losses import reward_pair_loss
from stages.recipe import Recipe

if TYPE_CHECKING:
    from core.schemas.rm import RMStage


class RewardModel(Recipe):
    stage: RMStage

    def load_models(self):
        return models.load_reward_model(self.model_path, self.stage, self.ds_config, self.ctx.on_gpu,
                                        self.tokenizer.pad_token_id)

    def rewards(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen rewards, rejected rewards) of the batch's pairs."""
        read = models.sequence_scores(self.ds, batch, self.tokenizer.pad_token_id)
        return read[0::2], read[1::2]

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return reward_pair_loss(chosen, rejected, margin=self.stage.margin or None)

    def loss(self, batch, micro: MicroBatch, step: Step) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.rewards(batch)
        return self.per_pair(step, micro, self.pair_losses(chosen, rejected),
                             accuracy=(chosen > rejected).float(), margin=chosen - rejected)

    def evaluate(self) -> dict:
        def terms(batch, micro):
            chosen, rejected = self.rewards(batch)
            both = torch.cat([chosen, rejected])
            return [self.pair_losses(chosen, rejected).sum(), (chosen > rejected).float().sum(),
                    (chosen - rejected).sum(), torch.tensor(float(len(chosen)), device=self.ctx.device),
                    both.sum(), both.square().sum()]

        loss_sum, correct, margin, count, r_sum, r_sq = self.eval_sums(terms, 6)
        mean = r_sum / (2 * count)
        return {
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "margin": margin / count,
            "reward_mean": mean,
            "reward_std": max(r_sq / (2 * count) - mean * mean, 0.0) ** 0.5,
        }

    def export_files(self, outcome: dict) -> dict:
        final = outcome["final"]
        return {"reward_stats.json": {"mean": final["reward_mean"], "std": final["reward_std"]}}

    def result(self, outcome: dict) -> dict:
        final = outcome["final"]
        return {
            "initial_eval_accuracy": outcome["initial"]["accuracy"],
            "eval_accuracy": final["accuracy"],
            "eval_margin": final["margin"],
            "eval_loss": final["loss"],
            "reward_mean": final["reward_mean"],
            "reward_std": final["reward_std"],
            "steps": outcome["steps"],
            "train_pairs": len(self.train_set),
            "eval_pairs": len(self.eval_set),
        }


run = RewardModel.run
