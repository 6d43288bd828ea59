"""Stage kinds: what each kind is, in one declaration, found through one registry.

A kind declares its schema (the pipeline file's section, a core.config.StageBase subclass whose
`kind` is the literal name), the rows it reads (which says how rows are checked, counted and
tokenised, and how many sequences a row makes), the model roles the planner counts (the head it
trains, whether it keeps a frozen reference, whether it samples its own sequences), its headline
result, and its `run` (the stage job's body, on the node). A shipped kind (sft, rm, dpo, ppo) is
declared beside its schema in core/schemas/<kind>.py, torch-free, with no run: its run is `run` in
stages/<kind>.py, which the node's runner finds from the kind's name (core never imports stages); a
kind from elsewhere (a plug-in, a test's toy kind) declares everything in one file:
`register(StageKind(..., run=run))`. A name is declared once: a second declaration from another
source is refused.

An RL kind (its unit of work is a rollout it samples) declares its `Rollouts`: which of its
schema's fields say how many prompts a rollout takes, how many completions each, how long, how it is
rewarded, and so on. The planner, validate and the data code read an RL stage through that
declaration (`Rollouts.of`), whatever the kind calls its fields.

Everything that differs by kind asks its declaration; no module switches on a kind's name.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from core import estimators, rollout_engine
from core.batching import rollout_sequences, rows_per_step

if TYPE_CHECKING:
    from core.config import StageBase  # core.config imports this module: a kind's schema is its subclass

# The row formats a kind can read. Each says which columns a row needs (core/rows.py), how its
# tokens are counted (pipeline/lengths.py) and tokenised (stages/data.py), and how many
# sequences one row makes.
RowFormat = Literal["completion", "preference", "prompt"]
SEQUENCES_PER_ROW: dict[str, int] = {"completion": 1, "preference": 2, "prompt": 1}


@dataclass(frozen=True)
class Rollouts:
    """An RL kind's rollouts, as the names of its schema's fields that hold each setting."""

    prompts: str  # prompts per rollout, over all processes
    samples_per_prompt: str  # completions sampled per prompt
    new_tokens: str  # the longest completion: each prompt's room within max_len
    chunk: str  # sequences per process per generation chunk and per scoring pass
    passes: str  # passes of the update over each rollout's sequences
    estimator: str  # the advantage estimator's name (core/estimators.py: whether a critic trains)
    reward: str  # the reward (core.schemas.reward.RewardSpec): a reward model stage, rules
    label_key: str  # the data column that rules needing a label compare completions with
    reward_offload: str | None = None  # the reward model waits in host RAM between uses (None: never)
    allow_weak_reward_model: str | None = None  # train against a reward model at chance (None: refused)
    engine: str | None = None  # how rollouts are sampled: auto, padded, continuous, vllm (None: auto)
    vllm: str | None = None  # the vLLM engine's settings (core.config.VllmSpec)

    def of(self, stage) -> RolloutSettings:
        """The stage's rollout settings under the names every RL kind shares (`fields`: its own)."""
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return RolloutSettings(self, **{key: getattr(stage, name) for key, name in named.items() if name})

    def check_layout(self, stage, where: str, processes: int) -> None:
        """ValueError (naming `where`.field) when the stage's vLLM engines do not fit a node's
        processes, or a rollout does not split over `processes` into whole optimizer steps."""
        rl = self.of(stage)
        per_node = processes // stage.nodes
        if rl.engine in ("vllm", "auto") and rl.vllm is not None and per_node % rl.vllm.tensor_parallel:
            raise ValueError(
                f"{where}.{self.vllm}.tensor_parallel: {rl.vllm.tensor_parallel} does not divide the {per_node} "
                f"processes of a node (an engine's processes share a node); "
                f"use one of {', '.join(map(str, rollout_engine.tensor_parallel_sizes(per_node)))}")
        if rl.prompts % processes:
            raise ValueError(f"{where}.{self.prompts}: {rl.prompts} prompts do not split evenly over {processes} "
                             "processes")
        per_step = rows_per_step(stage.global_batch_size, stage.micro_batch_size, stage.data_parallel(processes))
        if rl.sequences % per_step:
            raise ValueError(f"{where}.{self.prompts}: a rollout of {rl.sequences} sequences ({self.prompts} x "
                             f"{self.samples_per_prompt}) is not a multiple of the {per_step} sequences of one "
                             "optimizer step")


@dataclass(frozen=True)
class RolloutSettings:
    """One RL stage's rollout settings, read through its kind's declaration (`fields` names them)."""

    fields: Rollouts
    prompts: int
    samples_per_prompt: int
    new_tokens: int
    chunk: int
    passes: int
    estimator: str
    reward: Any  # core.schemas.reward.RewardSpec
    label_key: str
    reward_offload: bool = False
    allow_weak_reward_model: bool = False
    engine: str = "auto"
    vllm: Any = None  # core.config.VllmSpec

    @property
    def sequences(self) -> int:
        """Sequences one rollout samples, over all processes."""
        return rollout_sequences(self.prompts, self.samples_per_prompt)

    @property
    def critic(self) -> bool:
        """Its advantage estimator trains a critic."""
        return estimators.get(self.estimator).critic

    @property
    def reward_model(self) -> str | None:
        """The upstream reward model stage that scores completions, if any."""
        return self.reward.model


@dataclass
class StageKind:
    name: str
    schema: type[StageBase]  # the pipeline file's section for this kind
    rows: RowFormat
    headline: str  # the result.json key that says whether the stage worked
    trained_head: Literal["lm", "scalar"] = "lm"  # a language model, or a 1-label sequence classifier
    frozen_reference: bool = False  # keeps a frozen copy of its starting model (stage.reference says where)
    rollouts: Rollouts | None = None  # an RL kind: samples its own training sequences, a rollout at a time
    sequence_parallel: bool = False  # its passes can share a sequence over processes (stages/sequence_parallel.py)
    tiled_logits: bool = False  # its language-model passes can run the LM head a tile of positions at a time
    tiled_mlp: bool = False  # its passes can run each decoder layer's MLP over positions in tiles (mlp_tiles)
    # run(task, ctx) -> result dict; None for a shipped kind (its run is `run` in stages/<name>.py)
    run: Callable | None = field(default=None, repr=False)

    @property
    def sequences_per_row(self) -> int:
        return SEQUENCES_PER_ROW[self.rows]

    @property
    def unit(self) -> str:
        """What one step of its metrics.jsonl and its plan's time count."""
        return "rollout" if self.rollouts is not None else "optimizer step"

    @property
    def packs(self) -> bool:
        """Its micro batches are packed by a token budget from the data's rows (a rollout's
        sequences are generated: they are batched by length instead)."""
        return self.rollouts is None

    @property
    def trained_role(self) -> str:
        return "policy" if self.trained_head == "lm" else "reward model"


_KINDS: dict[str, StageKind] = {}


def register(kind: StageKind) -> StageKind:
    """Add a kind. A name is declared once: a second declaration is accepted only from the same
    schema (its module imported again), else it is refused, naming both sources."""
    known = _KINDS.get(kind.name)
    if known is not None and _source(known) != _source(kind):
        raise ValueError(f"stage kind '{kind.name}' is already declared by {_source(known)}; {_source(kind)} "
                         f"cannot declare it too (give its kind another name)")
    _KINDS[kind.name] = kind
    return kind


def _source(kind: StageKind) -> str:
    return f"{kind.schema.__module__}.{kind.schema.__qualname__}"


def unregister(name: str) -> None:
    """Forget a kind (a plug-in's, e.g. a test's toy kind, when it is done)."""
    _KINDS.pop(name, None)


def get(name: str) -> StageKind:
    _load_shipped()
    try:
        return _KINDS[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), _KINDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise KeyError(f"no stage kind '{name}'{hint}; kinds: {', '.join(names())}") from None


def names() -> list[str]:
    _load_shipped()
    return list(_KINDS)


def all_kinds() -> list[StageKind]:
    _load_shipped()
    return list(_KINDS.values())


def rollouts_of(stage) -> RolloutSettings | None:
    """An RL stage's rollout settings (its kind's `Rollouts` read on it); None for another kind."""
    declared = get(stage.kind).rollouts
    return None if declared is None else declared.of(stage)


def _load_shipped() -> None:
    import core.schemas  # noqa: F401  declares the shipped kinds beside their schemas, as a plug-in's module would
