"""The rm kind's schema and declaration (its run: `run` in stages/rm.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core import kinds
from core.config import StageBase
from core.kinds import StageKind


class RMStage(StageBase):
    """Reward model: a 1-label sequence classifier trained on chosen/rejected pairs."""

    kind: Literal["rm"] = Field(..., description="Stage kind: sft, rm, dpo or ppo.")
    margin: float = Field(
        0.0, ge=0, description="Bradley-Terry margin: the loss is -log sigmoid(r_chosen - r_rejected - margin)."
    )


kinds.register(StageKind("rm", RMStage, rows="preference", headline="eval_accuracy", trained_head="scalar",
                         sequence_parallel=True, tiled_mlp=True))
