"""A deliberately broken sequence-parallel stage, as a plug-in kind: `sft_misaligned` is SFT whose
processes all run their part of each line at the first part's positions (the offset every shard
needs, left out). tests/test_sequence_parallel.py shows that its figures no longer match one
process's: the comparison there can fail."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core import kinds
from core.config import SFTStage
from core.kinds import StageKind


class MisalignedSFTStage(SFTStage):
    kind: Literal["sft_misaligned"] = Field(..., description="SFT with shards at the wrong positions (a test).")


def run(task, ctx) -> dict:
    from stages import sequence_parallel, sft

    def forward(batch, model):
        width = batch.stop - batch.start
        with batch.apart():
            return model(input_ids=batch.input_ids[:, batch.start:batch.stop],
                         position_ids=batch.position_ids[:, :width], use_cache=False)

    sequence_parallel.ShardedBatch.forward = forward
    return kinds.get("sft").run(task, ctx)


KIND = kinds.register(StageKind("sft_misaligned", MisalignedSFTStage, rows="completion", headline="final_eval_loss",
                                sequence_parallel=True, run=run))
