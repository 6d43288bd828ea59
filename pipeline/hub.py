"""The Hugging Face hub as a pipeline file's names meet it: whether a name is a hub
id or a path, whether a hub id is in the local cache, and whether the hub answers.

Torch-free and quick: the hub is asked (one HEAD request, HUB_TIMEOUT_S at most)
only when a local run names a hub id the cache lacks.
"""

from __future__ import annotations

import os
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

from core.errors import InvalidInput
from pipeline.hfcache import HFCache

HUB_TIMEOUT_S = 3.0  # an answer within this says the hub is reachable
# Suffixes that say a name is a file, not a hub id (hub ids may hold dots: Llama-3.2-1B).
FILE_SUFFIXES = {".txt", ".tsv", ".xlsx", ".xls", ".zip", ".gz", ".bz2", ".xz", ".zst", ".tar", ".arrow",
                 ".xml", ".html", ".md", ".yaml", ".yml", ".pkl", ".pickle", ".npy", ".npz", ".pt", ".bin",
                 ".json", ".jsonl", ".csv", ".parquet"}
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # how huggingface_hub reads HF_HUB_OFFLINE


def looks_like_path(name: str) -> bool:
    """A hub id is `org/name` or `name`; anything else that is not on disk is a missing path."""
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or Path(name).suffix.lower() in FILE_SUFFIXES)


def dataset_cached(name: str, cache: HFCache) -> bool:
    """Whether hub dataset `name` was fetched into the cache (prepared or raw)."""
    return ((cache.datasets / name.replace("/", "___")).exists()
            or (cache.hub / ("datasets--" + name.replace("/", "--"))).exists())


class Hub:
    """Refuses hub ids the cache lacks when the hub cannot be reached; asks it once."""

    def __init__(self, offline_refused: bool, cache: HFCache):
        self.offline_refused = offline_refused
        self.cache = cache
        self._asked = False
        self._reason: str | None = None

    def refuse_if_unreachable(self, where: str, what: str, cache: Path, offline_vars: tuple[str, ...]) -> None:
        """InvalidInput when the hub cannot be reached (an offline_vars variable set, or no answer)."""
        if not self.offline_refused:
            return
        offline = [f"{v}={os.environ[v]}" for v in offline_vars if os.environ.get(v, "").upper() in TRUE_VALUES]
        reason = offline[0] if offline else self.unreachable()
        if reason is not None:
            raise InvalidInput(
                f"{where}: {what} is not a folder here, nor in the local cache ({cache}), and the hub cannot be "
                f"reached ({reason}). "
                "Fetch it where the hub can be reached, into the cache this machine reads (HF_HOME): "
                "python -m pipeline prepare PIPELINE_FILE; or give a local folder"
            )

    def unreachable(self) -> str | None:
        """None when the hub answers within HUB_TIMEOUT_S, else why not."""
        if not self._asked:
            self._reason = probe(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
            self._asked = True
        return self._reason


def probe(endpoint: str, timeout_s: float = HUB_TIMEOUT_S) -> str | None:
    """None when `endpoint` answers (any HTTP status) within timeout_s, else why not."""
    outcome: dict = {}

    def ask():
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
        except urllib.error.HTTPError:
            pass  # an answer all the same
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", None) or err
            if not isinstance(reason, ssl.SSLError):  # it answered; whom to trust is the hub client's affair
                outcome["error"] = reason
                return
        outcome["ok"] = True

    thread = threading.Thread(target=ask, daemon=True)  # name resolution has no timeout of its own
    thread.start()
    thread.join(timeout_s + 0.5)
    if "ok" in outcome:
        return None
    if "error" in outcome:
        return f"{endpoint} cannot be reached: {outcome['error']}"
    return f"{endpoint} did not answer within {timeout_s:g} s"
