"""The dpo kind's schema and declaration (its run: `run` in stages/dpo.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core import kinds
from core.config import StageBase
from core.kinds import StageKind


class DPOStage(StageBase):
    """Direct preference optimisation against a frozen copy of the starting model."""

    kind: Literal["dpo"] = Field(..., description="Stage kind: sft, rm, dpo or ppo.")
    beta: float = Field(0.1, gt=0, le=10, description="Strength of the KL tie to the reference (DPO's beta).")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid (the DPO paper's loss) or ipo (squared, bounded margins)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Assumed fraction of flipped preference labels (conservative DPO, sigmoid only)."
    )
    reference: Literal["live", "offload", "precompute"] = Field(
        "live",
        description="The frozen reference model: live (in GPU memory, sharded like the policy under ZeRO-3), "
        "offload (kept in host RAM, brought in for its forward passes), or precompute (its log-probs "
        "computed in a first pass and cached on disk; no reference in memory while training).",
    )
    chosen_nll_coef: float = Field(
        0.0, ge=0, description="Weight of an extra NLL (SFT) loss on the chosen responses; 0 = none."
    )

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self):
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing (conservative DPO) applies to loss_type sigmoid only")
        return self


kinds.register(StageKind("dpo", DPOStage, rows="preference", headline="eval_reward_accuracy", frozen_reference=True,
                         sequence_parallel=True, tiled_logits=True, tiled_mlp=True))
