"""Whether a reward model is worth an RL stage: better than chance on its own held-out pairs.

A reward model (an `rm` stage) writes eval_accuracy, the share of its held-out preference pairs
where it scores the chosen answer above the rejected one, and eval_pairs, how many there were
(result.json). A model that ranks them no better than a coin gives RL a reward that says nothing
about the answers; the policy then learns whatever that reward happens to like (reward hacking),
while every real measure of the answers falls.

The rule: the reward model is weak when its accuracy is at most CHANCE_FLOOR (0.55), or when it is
not significantly above 0.5 on its eval count: the one-sided exact binomial test of "right at
random" (each pair right with probability 1/2) gives P(X >= right) > SIGNIFICANCE (0.05). The
test makes a small eval set prove more (20 pairs: 15 right, 0.75); the floor keeps a large one from
passing a model that is barely better than a coin (10,000 pairs: 0.51 is significant, and useless).

An RL stage whose reward model is weak is refused (exit 2, before it loads anything) unless its
pipeline file sets allow_weak_reward_model: true; then the stage says so in its log before the
first rollout. `validate` and `run` refuse it earlier when the reward model has already finished.

Torch-free: the login node checks it too (pipeline/preflight.py).
"""

from __future__ import annotations

import json
import math

from core import kinds
from core.errors import InvalidInput
from core.runfolder import StageFolder

CHANCE_FLOOR = 0.55
SIGNIFICANCE = 0.05


def chance_tail(right: int, pairs: int) -> float:
    """P(X >= right) for X ~ Binomial(pairs, 1/2): how often a coin gets at least that many right."""
    if right <= 0:
        return 1.0
    log_half = pairs * math.log(0.5)
    terms = [math.lgamma(pairs + 1) - math.lgamma(k + 1) - math.lgamma(pairs - k + 1) + log_half
             for k in range(right, pairs + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def right_needed(pairs: int) -> int | None:
    """The fewest right of `pairs` that pass: above the floor and significant; None if none can."""
    least = math.floor(CHANCE_FLOOR * pairs) + 1
    for right in range(least, pairs + 1):
        if chance_tail(right, pairs) <= SIGNIFICANCE:
            return right
    return None


def weakness(result: dict) -> str | None:
    """Why the reward model whose result.json is `result` is no better than chance; None when it
    is better, or when it recorded no held-out pairs to judge by."""
    accuracy, pairs = result.get("eval_accuracy"), result.get("eval_pairs")
    if not isinstance(accuracy, (int, float)) or not isinstance(pairs, int) or pairs <= 0:
        return None
    right = round(accuracy * pairs)
    tail = chance_tail(right, pairs)
    if accuracy > CHANCE_FLOOR and tail <= SIGNIFICANCE:
        return None
    needed = right_needed(pairs)
    bar = (f"at least {needed} of {pairs} ({needed / pairs:.2f})" if needed is not None else
           f"more than {pairs} pairs can show: give it a larger eval split")
    why = (f"no better than chance: a coin gets as many right with probability {tail:.2g}" if tail > SIGNIFICANCE
           else f"too close to chance to be a reward (accuracy at most {CHANCE_FLOOR})")
    return (f"it ranked {right} of its {pairs} held-out pairs right (eval_accuracy {accuracy:.3f}), {why}; "
            f"better than chance here is {bar} (accuracy above {CHANCE_FLOOR}, and P <= {SIGNIFICANCE} that a "
            "coin does as well)")


def check(stage, pipeline_dir, where: str = "") -> str | None:
    """For an RL stage scored by a reward model stage that has finished: refuse (InvalidInput) a
    weak one, or return the warning to print when the stage allows it. None when there is nothing
    to say (no reward model, not finished yet, better than chance). `where` names the stage in
    the pipeline file (validate's "stages[3] (rl)"); a stage job names itself already."""
    rl = kinds.rollouts_of(stage)
    if rl is None or rl.reward_model is None:
        return None
    name = rl.reward_model
    result_file = StageFolder.of(pipeline_dir, name).result
    try:
        result = json.loads(result_file.read_text())
    except (OSError, ValueError):
        return None
    why = weakness(result)
    if why is None:
        return None
    field = f"{where + '.' if where else ''}{rl.fields.reward}.model"
    said = f"{field}: reward model stage '{name}' ({result_file}): {why}"
    allowing = rl.fields.allow_weak_reward_model  # the kind's field that allows it, if it has one
    if rl.allow_weak_reward_model:
        return (f"warning: {said}. Training against it anyway ({allowing}: true): watch a measure "
                "of the answers other than this reward")
    anyway = f", or set {allowing}: true in stage '{stage.name}' to train against it anyway" if allowing else ""
    raise InvalidInput(
        f"{said}. RL against it would learn what this reward happens to like, not better answers. Improve the "
        f"reward model (more or cleaner preference pairs, more steps){anyway}")
