"""The shapes of the models users name, from their published config.json files (MODELS.md), for
planning without a download (core/shapes.py's BUILTIN_SHAPES is built from these). The data is
core/published_shapes.json: `dense`, each dense decoder's sizes as core/shapes.py's ModelShape
names them; `experts`, each mixture of experts' config.json fields that size it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_TABLE = json.loads((Path(__file__).with_suffix(".json")).read_text())

DENSE: dict[str, dict[str, Any]] = _TABLE["dense"]
EXPERTS: dict[str, dict[str, Any]] = _TABLE["experts"]
