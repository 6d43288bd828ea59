"""Where the Hugging Face cache is: the one place that decides it.

`prepare` downloads into it on the submit host, the planner reads model configs
and dataset files from it, and every stage job (local or Slurm) gets it in its
environment, so all of them look in the same folders whatever the caller's own
environment says. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = "~/.cache/huggingface"


@dataclass(frozen=True)
class HFCache:
    home: Path  # HF_HOME
    hub: Path  # HF_HUB_CACHE: models (and the files datasets download)
    datasets: Path  # HF_DATASETS_CACHE: prepared datasets

    def env(self) -> dict[str, str]:
        """The variables that point the hub libraries at this cache."""
        return {"HF_HOME": str(self.home), "HF_HUB_CACHE": str(self.hub), "HF_DATASETS_CACHE": str(self.datasets)}


def hf_cache(spec=None, environ: Mapping[str, str] | None = None) -> HFCache:
    """The pipeline's cluster.hf_home (its hub/ and datasets/ inside it); without one, what
    this environment says, as the hub libraries read it: $HF_HOME (default ~/.cache/huggingface),
    $HF_HUB_CACHE and $HF_DATASETS_CACHE overriding their folders."""
    environ = os.environ if environ is None else environ
    configured = spec.cluster.hf_home if spec is not None else None
    if configured:
        home = _path(configured)
        return HFCache(home, home / "hub", home / "datasets")
    home = _path(environ.get("HF_HOME") or DEFAULT_HOME)
    hub = _path(environ["HF_HUB_CACHE"]) if environ.get("HF_HUB_CACHE") else home / "hub"
    datasets = _path(environ["HF_DATASETS_CACHE"]) if environ.get("HF_DATASETS_CACHE") else home / "datasets"
    return HFCache(home, hub, datasets)


def _path(name: str) -> Path:
    return Path(name).expanduser().resolve()
