"""What a stage reads from disk, and a digest of its content: part of the stage's identity.

A stage is skipped only when its spec AND everything it reads are unchanged: its
data files (path and eval_split), its model folder when it starts from a local one,
and the .py files of its reward functions. (An upstream stage's model is covered by
that stage's own identity, which is part of this one; hub ids and built-ins are
named, not read here.)

A file's digest is the sha256 of its content, or, for files over SAMPLED_ABOVE bytes
(model weights), of its size and three SAMPLE-byte slices (start, middle, end): a
rewrite by training changes them all, and a 70B model is fingerprinted in a second,
not read whole. A folder's digest covers every file under it, by relative path.
Digests are remembered in runs/<pipeline>/ by (path, size, mtime), so an unchanged
file is not read again, and a file that was only touched keeps its digest.
Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from core.config import BUILTIN_PREFIX
from core.rows import is_row_file
from core.runfolder import digests_file

SAMPLED_ABOVE = 1 << 30  # 1 GiB
SAMPLE = 4 << 20  # 4 MiB
CHUNK = 8 << 20


@dataclass(frozen=True)
class Input:
    field: str  # the stage field that names it, e.g. data.path
    path: Path  # resolved


def stage_inputs(stage) -> list[Input]:
    """The files and folders a stage reads (of those that are on this machine)."""
    found: list[Input] = []

    def add(field: str, name: str | None) -> None:
        if not name or name.startswith(BUILTIN_PREFIX):
            return
        path = Path(name).expanduser()
        if path.exists():
            found.append(Input(field, path.resolve()))

    data = stage.data
    add("data.path", data.path)
    if data.eval_split and is_row_file(data.eval_split):
        add("data.eval_split", data.eval_split)
    if not stage.from_:
        add("model", stage.model)
    for field, path in stage.code_files():
        add(field, path)
    return found


class Digests:
    """Content digests, remembered by (path, size, mtime) in the run folder's digest file."""

    def __init__(self, pipeline_dir: Path):
        self.path = digests_file(pipeline_dir)
        try:
            self.known: dict = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def of(self, path: Path) -> str:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            listing = [(str(p.relative_to(path)), self._file(p)) for p in files]
            return hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return self._file(path)

    def _file(self, path: Path) -> str:
        stat = path.stat()
        key = str(path)
        seen = self.known.get(key)
        if seen and seen["size"] == stat.st_size and seen["mtime_ns"] == stat.st_mtime_ns:
            return seen["sha256"]
        digest = file_digest(path, stat.st_size)
        self.known[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        """Remember what was read (the `run` holding the run folder does this)."""
        if not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.known, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)
        self.changed = False


def file_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLED_ABOVE:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        else:
            digest.update(f"sampled {size}".encode())
            for offset in (0, size // 2 - SAMPLE // 2, size - SAMPLE):
                f.seek(offset)
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def input_digests(stage, digests: Digests) -> dict[str, dict]:
    """{field: {path, sha256}} of what the stage reads: recorded in spec.json, part of the spec hash."""
    return {item.field: {"path": str(item.path), "sha256": digests.of(item.path)} for item in stage_inputs(stage)}


def changed_inputs(recorded: dict, current: dict) -> list[str]:
    """What differs between two input records, in words (e.g. 'data.path (data/sft.jsonl) changed')."""
    said = []
    for field, now in current.items():
        before = recorded.get(field)
        if before is None or before.get("path") != now["path"]:
            said.append(f"{field} now names {now['path']}")
        elif before.get("sha256") != now["sha256"]:
            said.append(f"{field} ({now['path']}) changed")
    said += [f"{field} is no longer read" for field in recorded if field not in current]
    return said
