"""A stage kind declared in one file, as a plug-in would be: its schema, its declaration (rows,
headline, what the planner counts) and its run, registered with core/kinds.py on import.

`echo` reads its rows (the completion format), tokenises them as every stage does, and exports
the model it started from unchanged: the smallest stage whose result can be checked by hand.
"""

from __future__ import annotations

import shutil
from typing import Literal

from pydantic import Field

from core import kinds
from core.config import StageBase
from core.kinds import StageKind


class EchoStage(StageBase):
    """Tokenise the rows, train nothing, hand the starting model on."""

    kind: Literal["echo"] = Field(..., description="Stage kind: echo (tests/toy_kind.py).")
    note: str = Field("", description="Written to result.json as given: a field only this kind has.")


def run(task, ctx) -> dict:
    from stages import data, models

    model_path = models.resolve(task.init_model, ctx.builtin_root)
    splits = data.tokenized_splits(task.stage, models.load_tokenizer(model_path), ctx.builtin_root, task.name)
    if ctx.is_main:
        shutil.copytree(model_path, ctx.folder.model)
    return {"rows_tokenised": len(splits.train.tokens) + len(splits.eval.tokens),
            "tokens": sum(len(t["input_ids"]) for t in splits.train.tokens), "note": task.stage.note}


KIND = kinds.register(StageKind("echo", EchoStage, rows="completion", headline="rows_tokenised", run=run))
