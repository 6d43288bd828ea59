"""The base of every pipeline file section: unknown keys are errors that suggest the nearest name."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Strict(BaseModel):
    """Base for every section: unknown keys are errors that suggest the nearest name."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        known |= {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = [k for k in data if k not in known]
        if unknown:
            key = str(unknown[0])
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            valid = ", ".join(sorted(k for k in known if not k.endswith("_") and k != "kind"))
            raise ValueError(f"unknown key '{key}'{hint}; valid keys here: {valid}")
        return data
