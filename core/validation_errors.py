"""A pipeline file's validation errors for people: each at `stages[1] (dpo).beta`, with the field's
documentation quoted back (a stage's fields are its kind's schema's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from core import kinds


def described(path: Path, raw: dict, err: ValidationError, top: type[BaseModel], stage_base: type[BaseModel]) -> str:
    """The errors of validating `raw` (the file at `path`) as `top`, one line each with its field's documentation;
    a stage's fields are looked up in its kind's schema (`stage_base` where its kind is unknown)."""
    lines = [f"{path}: {err.error_count()} problem{'s' if err.error_count() > 1 else ''}"]
    for item in err.errors():
        loc, doc = _describe_location(raw, item["loc"], top, stage_base)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "required but missing"
        elif "input" in item and item["type"] not in ("value_error", "assertion_error"):
            message += f" (got {item['input']!r})"
        lines.append(f"  {loc or '<top>'}: {message}")
        if doc:
            lines.append(f"      {loc.rsplit('.', 1)[-1]}: {doc}")
    return "\n".join(lines)


def _describe_location(raw: dict, loc: tuple, top: type[BaseModel],
                       stage_base: type[BaseModel]) -> tuple[str, str | None]:
    """Turn pydantic's loc into `stages[1] (dpo).beta` and find the field's documentation."""
    parts: list[str] = []
    model: Any = top
    node: Any = raw
    doc = None
    for key in loc:
        if isinstance(key, int):
            parts[-1] = f"{parts[-1]}[{key}]" if parts else f"[{key}]"
            node = node[key] if isinstance(node, list) and key < len(node) else None
            if isinstance(node, dict) and "name" in node:
                parts[-1] += f" ({node['name']})"
            continue
        if model is top and parts and parts[-1].startswith("stages["):
            kind = node.get("kind") if isinstance(node, dict) else None
            model = kinds.get(kind).schema if kind in kinds.names() else stage_base  # the stage's own schema
        field = _field(model, key)
        if field is None:
            break
        parts.append("from" if key == "from_" else key)
        doc = field.description
        node = node.get(field.alias or key) if isinstance(node, dict) else None
        model = _model_of(field.annotation)
        if key == "stages":
            model = top  # stays here until the kind tag selects the stage class
    return ".".join(parts), doc


def _field(model: Any, key: str):
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    if key in model.model_fields:
        return model.model_fields[key]
    for field in model.model_fields.values():
        if field.alias == key:
            return field
    return None


def _model_of(annotation: Any) -> Any:
    """The BaseModel inside Optional[...] / list[...] annotations, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None
