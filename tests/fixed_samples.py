"""An RL stage whose completions are fixed, as a plug-in kind: `ppo_fixed_samples` is ppo (its own
code for everything else) whose sampler writes, for each prompt, the right answer in one of its
samples and the right answer with a stray '.' in the others; which sample is right depends on the
prompt, so a group's rewards differ. Sampling draws from each process's own generator, so what it
draws depends on how the prompts are split over processes; with these completions runs over
different layouts train on the same rollouts (tests/test_sequence_parallel_rl.py compares them).
Greedy (held-out) completions are right for even rows and stray for odd ones.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from core import kinds
from core.schemas.ppo import PPOStage


def fixed_completions(tokenizer, prompts, samples: int, greedy: bool) -> list[list[int]]:
    """Token ids of each prompt's completion; `prompts` hold each prompt's `samples` contiguous, from
    a whole group on."""
    out = []
    for position, prompt in enumerate(prompts):
        right = prompt.index % 2 == 0 if greedy else position % samples == prompt.index % samples
        text = " " + prompt.label + ("" if right else ".")
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return out


class FixedSamplesStage(PPOStage):
    kind: Literal["ppo_fixed_samples"] = Field(..., description="ppo with fixed completions (a test).")


def run(task, ctx) -> dict:
    from stages import ppo, rollout

    def generate(maker, prompts, greedy=False):
        return fixed_completions(maker.models.tokenizer, prompts, maker.stage.n_samples_per_prompt, greedy)

    rollout.RolloutMaker.generate = generate
    return ppo.run(task, ctx)


KIND = kinds.register(dataclasses.replace(kinds.get("ppo"), name="ppo_fixed_samples", schema=FixedSamplesStage,
                                          run=run))
