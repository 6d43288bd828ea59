"""SFT whose evaluations sleep, as a plug-in kind: `sft_sleeping_eval`. Rank 0 sleeps at the start of
every evaluation, every attempt, as an evaluation waiting on something that never answers would: a
hang outside the training steps, which the watchdog must catch (tests/test_watchdog.py). Rank 1
waits for it in the evaluation's all-reduce."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from core import kinds
from core.kinds import StageKind
from core.schemas.sft import SFTStage


class SleepingEvalSFTStage(SFTStage):
    kind: Literal["sft_sleeping_eval"] = Field(..., description="SFT whose evaluations sleep (a test).")
    sleep_s: float = Field(..., gt=0, description="How long rank 0 sleeps at the start of each evaluation.")


def run(task, ctx) -> dict:
    from stages import engine, sft

    evaluate = engine.OptimizerSteps.evaluate

    def sleeping(self) -> dict:
        if ctx.rank == 0:
            time.sleep(task.stage.sleep_s)
        return evaluate(self)

    engine.OptimizerSteps.evaluate = sleeping
    return sft.run(task, ctx)


KIND = kinds.register(StageKind("sft_sleeping_eval", SleepingEvalSFTStage, rows="completion",
                                headline="final_eval_loss", run=run))
