"""The sft kind's schema and declaration (its run: `run` in stages/sft.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core import kinds
from core.config import StageBase
from core.kinds import StageKind


class SFTStage(StageBase):
    """Supervised fine-tuning: next-token loss on the response tokens only."""

    kind: Literal["sft"] = Field(..., description="Stage kind: sft, rm, dpo or ppo.")


kinds.register(StageKind("sft", SFTStage, rows="completion", headline="final_eval_loss",
                         sequence_parallel=True, tiled_logits=True, tiled_mlp=True))
