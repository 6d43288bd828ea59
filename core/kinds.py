"""Stage kinds: what each kind is, in one declaration, found through one registry.

A kind declares its schema (the pipeline file's section, a core.config.StageBase subclass whose
`kind` is the literal name), the rows it reads (which says how rows are checked, counted and
tokenised, and how many sequences a row makes), the model roles the planner counts (the head it
trains, whether it keeps a frozen reference, whether it samples its own sequences), its headline
result, and its `run` (the stage job's body, on the node). The torch-free part is declared here
and in core/config.py for the shipped kinds (sft, rm, dpo, ppo); each stages/<kind>.py binds its
run with `@implements("<kind>")`. A kind from elsewhere (a plug-in, a test's toy kind) declares
everything in one file: `register(StageKind(..., run=run))`.

Everything that differs by kind asks its declaration; no module switches on a kind's name.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

# The row formats a kind can read. Each says which columns a row needs (core/rows.py), how its
# tokens are counted (pipeline/lengths.py) and tokenised (stages/data.py), and how many
# sequences one row makes.
RowFormat = Literal["completion", "preference", "prompt"]
SEQUENCES_PER_ROW: dict[str, int] = {"completion": 1, "preference": 2, "prompt": 1}


@dataclass
class StageKind:
    name: str
    schema: type  # the pipeline file's section for this kind (core.config.StageBase subclass)
    rows: RowFormat
    headline: str  # the result.json key that says whether the stage worked
    trained_head: Literal["lm", "scalar"] = "lm"  # a language model, or a 1-label sequence classifier
    frozen_reference: bool = False  # keeps a frozen copy of its starting model (stage.reference says where)
    rollouts: bool = False  # samples its own training sequences (its unit of work is a rollout)
    sequence_parallel: bool = False  # its passes can share a sequence over processes (stages/sequence_parallel.py)
    tiled_logits: bool = False  # its language-model passes can run the LM head a tile of positions at a time
    tiled_mlp: bool = False  # its passes can run each decoder layer's MLP over positions in tiles (mlp_tiles)
    run: Optional[Callable] = field(default=None, repr=False)  # run(task, ctx) -> result dict

    @property
    def sequences_per_row(self) -> int:
        return SEQUENCES_PER_ROW[self.rows]

    @property
    def unit(self) -> str:
        """What one step of its metrics.jsonl and its plan's time count."""
        return "rollout" if self.rollouts else "optimizer step"

    @property
    def packs(self) -> bool:
        """Its micro batches are packed by a token budget from the data's rows (a rollout's
        sequences are generated: they are batched by length instead)."""
        return not self.rollouts

    @property
    def trained_role(self) -> str:
        return "policy" if self.trained_head == "lm" else "reward model"


_KINDS: dict[str, StageKind] = {}


def register(kind: StageKind) -> StageKind:
    """Add a kind; a second declaration of the same name replaces the first only when it is the
    same schema (a module imported twice), else it is refused."""
    known = _KINDS.get(kind.name)
    if known is not None and known.schema.__qualname__ != kind.schema.__qualname__:
        raise ValueError(f"stage kind '{kind.name}' is declared twice ({known.schema.__module__} and "
                         f"{kind.schema.__module__})")
    if known is not None and kind.run is None:
        kind.run = known.run
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget a kind (a plug-in's, e.g. a test's toy kind, when it is done)."""
    _KINDS.pop(name, None)


def implements(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the stage job's body for the kind declared as `name`."""
    def bind(run: Callable) -> Callable:
        get(name).run = run
        return run
    return bind


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


def _load_shipped() -> None:
    import core.config  # noqa: F401  declares the shipped kinds beside their schemas
