"""A deliberately broken sequence-parallel stage, as plug-in kinds: `sft_misaligned` is SFT whose
processes all run their part of each line at the first part's positions (the offset every shard
needs, left out), and `ppo_misaligned` the same for RL (ppo with tests/fixed_samples.py's
completions). tests/test_sequence_parallel.py and tests/test_sequence_parallel_rl.py show that
their figures no longer match one process's: the comparisons there can fail."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from core import kinds
from core.kinds import StageKind
from core.schemas.ppo import PPOStage
from core.schemas.sft import SFTStage
from tests import fixed_samples


class MisalignedSFTStage(SFTStage):
    kind: Literal["sft_misaligned"] = Field(..., description="SFT with shards at the wrong positions (a test).")


class MisalignedPPOStage(PPOStage):
    kind: Literal["ppo_misaligned"] = Field(..., description="ppo_fixed_samples with shards at the wrong positions "
                                                             "(a test).")


def misaligned(run):
    """`run` with every shard of a line at the first shard's positions."""

    def misaligned_run(task, ctx) -> dict:
        from stages import sequence_parallel

        def forward(batch, model):
            width = batch.stop - batch.start
            with batch.apart():
                return model(input_ids=batch.input_ids[:, batch.start:batch.stop],
                             position_ids=batch.position_ids[:, :width], use_cache=False)

        sequence_parallel.ShardedBatch.forward = forward
        return run(task, ctx)

    return misaligned_run


def sft_run(task, ctx) -> dict:
    from stages import sft

    return sft.run(task, ctx)


KIND = kinds.register(StageKind("sft_misaligned", MisalignedSFTStage, rows="completion", headline="final_eval_loss",
                                sequence_parallel=True, run=misaligned(sft_run)))
PPO_KIND = kinds.register(dataclasses.replace(fixed_samples.KIND, name="ppo_misaligned", schema=MisalignedPPOStage,
                                              run=misaligned(fixed_samples.run)))
