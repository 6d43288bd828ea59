"""The pipeline file reference in README.md, generated from the schema's own field docs.

`make docs` rewrites the part of README.md between the reference markers;
tests/test_docs.py fails when that part and the schema disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline import config as c

START, END = "<!-- reference:start -->", "<!-- reference:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None or field.default is None:
        return "—"
    value = list(field.default) if isinstance(field.default, tuple) else field.default
    return f"`{value}`"


def _table(title: str, model, prefix: str = "", skip=()) -> str:
    lines = [f"#### {title}", "", "| field | default | meaning |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        if name not in skip:
            lines.append(f"| `{prefix}{field.alias or name}` | {_default(field)} | {field.description} |")
    return "\n".join(lines)


def reference_markdown() -> str:
    knobs = set(c.TrainingKnobs.model_fields)
    common = set(c.StageBase.model_fields) | {"kind"}
    sections = [
        _table("Top level", c.PipelineSpec),
        _table("`cluster:`", c.ClusterSpec, "cluster."),
    ]
    if hasattr(c, "ApptainerSpec"):
        sections.append(_table("`apptainer:`", c.ApptainerSpec, "apptainer."))
    sections.append(_table("`tracking.wandb:`", c.WandbSpec, "tracking.wandb."))
    sections += [
        _table("Every stage", c.StageBase, skip=knobs),
        _table("`data:`", c.DataSpec, "data."),
        _table("Training knobs (in a stage, or under `defaults:` for all stages)", c.TrainingKnobs),
        _table("`lora:`", c.LoraSpec, "lora."),
    ]
    for kind, model in c.STAGE_KIND_MODELS.items():
        extra = [n for n in model.model_fields if n not in common]
        if extra:
            sections.append(_table(f"`kind: {kind}`", model, skip=common))
    return "\n\n".join(sections)


def rewrite_readme(path: Path = README) -> None:
    text = path.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{reference_markdown()}\n{END}{tail}")


if __name__ == "__main__":
    rewrite_readme(Path(sys.argv[1]) if len(sys.argv) > 1 else README)
