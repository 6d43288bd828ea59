"""SFT whose weights stop being numbers at a chosen optimizer step, as a plug-in kind:
`sft_diverging`. Before that step, one of rank 0's master weights (the optimizer's fp32 copy, in
every ZeRO stage) becomes nan; the step's update carries it into the model, as a real divergence
does. Under ZeRO-3 only rank 0's share of the weights holds it, so a stage that stops on it must
decide with every process (tests/test_divergence.py)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from core import kinds
from core.kinds import StageKind
from core.schemas.sft import SFTStage


class DivergingSFTStage(SFTStage):
    kind: Literal["sft_diverging"] = Field(..., description="SFT whose weights become nan (a test).")
    diverge_at: int = Field(..., ge=1, description="The optimizer step that makes rank 0's weights nan.")


def run(task, ctx) -> dict:
    from stages import engine, sft

    advance = engine.OptimizerSteps.advance

    def diverging(self, unit: int, window) -> None:
        if unit + 1 == task.stage.diverge_at and ctx.rank == 0:
            optimizer = self.engine.optimizer  # ZeRO-3's master shares, or ZeRO-1/2's
            masters = (getattr(optimizer, "fp32_partitioned_groups_flat", None)
                       or optimizer.single_partition_of_fp32_groups)
            masters[0].data.view(-1)[0] = math.nan
        advance(self, unit, window)

    engine.OptimizerSteps.advance = diverging
    return sft.run(task, ctx)


KIND = kinds.register(StageKind("sft_diverging", DivergingSFTStage, rows="completion", headline="final_eval_loss",
                                run=run))
