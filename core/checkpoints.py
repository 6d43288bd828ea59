"""Which checkpoint a stage may resume from, and the manifests that say so.

Every save (stages/checkpoints.py) ends with a manifest in its folder (core/runfolder.py
MANIFEST_FILE): each file of the checkpoint, its size and its checksum, and the step. It is
written last, after every process has written its files, so a checkpoint folder without one
is a save that did not finish, or one written before manifests existed: those are taken, as
then, when the `latest` marker had moved past them, after a look at their torch files' ends.

`judge` picks the newest checkpoint whose files match their manifest; the stage calls it with
a check of every byte, shared out over its processes, and sets aside (never deletes) the newer
ones that failed. Everyone else (`run` before it submits, `status`, the executors' "resumes
from" lines, the advice after a divergence) asks `newest_intact`, the same rule with sizes
only: a login node reads no hundreds of gigabytes.

The checksum is zlib's crc32 of each 64 MiB block of a file, the fastest in the standard
library. Measured on this project's shared 2-core EPYC (load average 8, so on the high side):
0.74 s per GiB in memory (sha256 1.3 s, blake2b 2.8 s), 0.7 to 1.9 s per GiB reading a 1 GiB
file. Blocks let the processes share out one large file, and the threads of each (zlib releases
the GIL): a 34B checkpoint (544 GB, 68 GB per process on 8 GPUs) costs about 68 x 0.74 / 4 = 13 s
of checksumming per save at 4 threads a process; reading the files back (from the page cache,
or the file system) is the larger part.

Torch-free: the login node reads it to show status.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from core.runfolder import MANIFEST_FILE, TEMPORARY_SUFFIX, StageFolder

BLOCK_BYTES = 64 << 20
READ_BYTES = 4 << 20
CHECKSUM = "crc32 of each 64 MiB block"
ZIP_MAGIC = b"PK\x03\x04"  # how a torch.save file starts (a zip archive)


# --------------------------------------------------------------------------- files and checksums


@dataclass(frozen=True)
class Block:
    file: str  # relative to the checkpoint folder
    index: int
    size: int

    @property
    def start(self) -> int:
        return self.index * BLOCK_BYTES


def files(folder: Path) -> dict[str, int]:
    """Every file of a checkpoint folder and its size, relative paths in order: what its manifest
    lists (not the manifest itself, nor a temporary)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE and not path.name.endswith(TEMPORARY_SUFFIX):
            found[path.relative_to(folder).as_posix()] = path.stat().st_size
    return found


def blocks(sizes: dict[str, int]) -> list[Block]:
    """Every file's blocks, in order; an empty file has one empty block, so each file is some process's to check."""
    return [Block(name, i, min(BLOCK_BYTES, size - i * BLOCK_BYTES))
            for name, size in sorted(sizes.items()) for i in range(max(1, -(-size // BLOCK_BYTES)))]


def share(items: list, rank: int, world: int) -> list:
    """Process `rank`'s share of `items`: a contiguous run, as even as whole items allow."""
    return items[len(items) * rank // world: len(items) * (rank + 1) // world]


class Changed(OSError):
    """A file ended before one of its blocks did: it changed since it was listed."""


def checksums(folder: Path, mine: list[Block], threads: int) -> dict[tuple[str, int], str]:
    """{(file, block index): crc32 as 8 hex digits} of the blocks `mine`, `threads` blocks at a time."""

    def one(block: Block) -> str:
        crc, left = 0, block.size
        buffer = memoryview(bytearray(min(READ_BYTES, max(left, 1))))
        with open(folder / block.file, "rb", buffering=0) as f:
            f.seek(block.start)
            while left:
                n = f.readinto(buffer[:min(len(buffer), left)])
                if not n:
                    raise Changed(f"{block.file} ended at byte {block.start + block.size - left}, before its "
                                  f"listed size")
                crc = zlib.crc32(buffer[:n], crc)
                left -= n
        return f"{crc:08x}"

    with ThreadPoolExecutor(max(1, threads)) as pool:
        return dict(zip([(b.file, b.index) for b in mine], pool.map(one, mine)))


# --------------------------------------------------------------------------- manifests


def manifest(step: int, sizes: dict[str, int], crcs: dict[tuple[str, int], str]) -> dict:
    """A checkpoint's manifest: its step, and each file's size and block checksums."""
    listed: dict[str, dict] = {name: {"bytes": size, "crc32": []} for name, size in sorted(sizes.items())}
    for block in blocks(sizes):
        listed[block.file]["crc32"].append(crcs[block.file, block.index])
    return {"step": step, "checksum": CHECKSUM, "files": listed}


def manifest_text(content: dict) -> str:
    """A manifest as JSON with one line per file, for a person to read."""
    listed = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in content["files"].items())
    return f'{{"step": {content["step"]}, "checksum": {json.dumps(content["checksum"])}, "files": {{\n{listed}\n}}}}\n'


def read_manifest(path: Path) -> dict | str | None:
    """The manifest at `path`; None if there is none; why it cannot be used (a str) if it is damaged."""
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        return f"{MANIFEST_FILE} cannot be read ({err})"
    listed = content.get("files") if isinstance(content, dict) else None
    sound = isinstance(listed, dict) and all(
        isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("crc32"), list)
        and len(f["crc32"]) == max(1, -(-f["bytes"] // BLOCK_BYTES)) for f in listed.values())
    return content if sound else f"{MANIFEST_FILE} is not a manifest of this version ({CHECKSUM})"


# --------------------------------------------------------------------------- checking


def size_problems(folder: Path, listed: dict, names) -> dict[str, str]:
    """{file: what is wrong} of the files `names` of a checkpoint folder whose sizes are not as its
    manifest's `files` lists them."""
    wrong = {}
    for name in names:
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            wrong[name] = f"{name} is missing"
            continue
        except OSError as err:
            wrong[name] = f"{name} cannot be read ({err})"
            continue
        if size != listed[name]["bytes"]:
            wrong[name] = f"{name} is {size} bytes, its manifest says {listed[name]['bytes']}"
    return wrong


def content_problems(folder: Path, listed: dict, mine: list[Block], threads: int) -> dict[str, str]:
    """{file: what is wrong} of the files the blocks `mine` belong to: a size, or else the first of
    those blocks whose checksum is not the manifest's."""
    wrong = size_problems(folder, listed, sorted({b.file for b in mine}))
    sized = [b for b in mine if b.file not in wrong]
    try:
        got = checksums(folder, sized, threads)
    except OSError as err:  # changed or gone while it was read
        return {**wrong, str(err): str(err)}
    for block in sized:
        if got[block.file, block.index] != listed[block.file]["crc32"][block.index]:
            wrong.setdefault(block.file, f"{block.file}: bytes {block.start}-{block.start + block.size} differ from "
                                         "what was saved (checksum)")
    return wrong


def torch_file_problems(folder: Path) -> list[str]:
    """A checkpoint without a manifest, looked at cheaply: a torch.save file (a zip archive) cut
    short has lost its end, the archive's directory; an empty file holds nothing."""
    wrong = []
    for name in files(folder):
        path = folder / name
        try:
            with open(path, "rb") as f:
                head = f.read(len(ZIP_MAGIC))
            if not head:
                wrong.append(f"{name} is empty")
            elif head == ZIP_MAGIC:
                zipfile.ZipFile(path).close()
        except (OSError, zipfile.BadZipFile) as err:
            wrong.append(f"{name} is cut short or damaged ({err})")
    return wrong


# --------------------------------------------------------------------------- which one to resume from


def step_of(tag: str) -> int:
    return int(tag.removeprefix("step-"))


@dataclass
class Found:
    """What checkpoints/ holds, read once (the stage's rank 0 reads it and hands it to the others)."""

    latest: str | None  # the tag the `latest` marker names
    tags: list[str]  # the checkpoint folders, oldest first
    manifests: dict = field(default_factory=dict)  # tag -> its manifest, or why it cannot be used; none: absent
    unmanifested: dict = field(default_factory=dict)  # tag -> torch_file_problems, for the older ones without one


def look(folder: StageFolder) -> Found:
    latest = folder.latest_named()
    found = Found(latest, folder.checkpoint_tags())
    for tag in found.tags:
        content = read_manifest(folder.manifest(tag))
        if content is not None:
            found.manifests[tag] = content
        elif latest is not None and tag <= latest:
            found.unmanifested[tag] = torch_file_problems(folder.checkpoints / tag)
    return found


@dataclass
class Verdict:
    """Where a stage resumes, and what it found on the way."""

    tag: str | None = None  # the newest intact checkpoint; None: none
    unchecked: bool = False  # written before manifests: taken as the `latest` marker made it complete
    gone: str | None = None  # the tag `latest` names, whose folder is not there
    damaged: dict = field(default_factory=dict)  # tag -> what is wrong with it, newest first (all newer than `tag`)
    unfinished: list = field(default_factory=list)  # saves that did not finish: no manifest, newer than `latest`
    latest_intact: bool = False  # `tag` is as new as what `latest` names or newer: the unfinished ones are leftovers

    @property
    def refused(self) -> bool:
        """Checkpoints that were complete once are there, and none is intact: a stage does not start over by itself."""
        return self.tag is None and any(tag not in self.unfinished for tag in self.damaged)

    @property
    def lost_steps(self) -> int:
        """The steps between the newest checkpoint that was complete and the one resumed from."""
        newest = max([t for t in self.damaged if t not in self.unfinished] + [self.gone or ""])
        return step_of(newest) - step_of(self.tag or "step-0") if newest else 0

    def status(self, stage: str) -> str:
        """What `status` says of a stage that has not finished."""
        if self.refused:
            return f"no intact checkpoint ({self.problems()}): `run` refuses; `run --rerun {stage}` starts it over"
        if self.tag is None:
            return "no checkpoint yet: `run` starts it over"
        said = f"newest intact checkpoint {self.tag}: `run` resumes from it"
        if self.lost_steps:
            said += f" ({self.problems()}: {self.lost_steps} steps to train again)"
        return said

    def refusal(self, folder: StageFolder) -> str:
        """Why a stage does not resume (`refused`), and how to start it over."""
        stage = folder.path.name
        return (f"no intact checkpoint to resume from in {folder.checkpoints}: {self.problems()}. Nothing was moved "
                f"or deleted. Put back an intact copy, or start the stage over from step 0 with `python -m pipeline "
                f"run <pipeline file> --rerun {stage}`, which moves its folder aside")

    def problems(self) -> str:
        found = [f"`latest` names {self.gone}, which is gone"] if self.gone else []
        found += [f"{tag}: {'; '.join(wrong)}" for tag, wrong in self.damaged.items() if tag not in self.unfinished]
        return "; ".join(found)


Check = Callable[[str, dict], list]


def judge(found: Found, check: Check) -> Verdict:
    """The newest checkpoint to resume from: one whose files `check` finds as its manifest lists
    them (newest first, until one is), or one without a manifest at or before the tag `latest`
    names and older than every manifest (written before manifests existed)."""
    verdict = Verdict(gone=found.latest if found.latest and found.latest not in found.tags else None)
    manifested = [tag for tag in found.tags if tag in found.manifests]
    for tag in reversed(found.tags):
        content = found.manifests.get(tag)
        if content is None and (found.latest is None or tag > found.latest):
            verdict.unfinished.append(tag)
            continue
        if content is None and manifested and tag > manifested[0]:
            wrong = [f"its {MANIFEST_FILE} is missing"]
        elif content is None:
            wrong = found.unmanifested.get(tag, [])
        else:
            wrong = [content] if isinstance(content, str) else check(tag, content)
        if not wrong:
            verdict.tag = tag
            break
        verdict.damaged[tag] = wrong
    verdict.unchecked = verdict.tag is not None and verdict.tag not in found.manifests
    verdict.latest_intact = verdict.tag is not None and found.latest is not None and verdict.tag >= found.latest
    if not verdict.latest_intact:
        for tag in verdict.unfinished:  # not provably an interrupted save's: set aside with the damaged ones
            verdict.damaged[tag] = [f"no {MANIFEST_FILE}: a save that did not finish, or written before manifests"]
    verdict.damaged = dict(sorted(verdict.damaged.items(), reverse=True))
    return verdict


def sizes_check(folder: StageFolder) -> Check:
    def check(tag: str, content: dict) -> list[str]:
        return list(size_problems(folder.checkpoints / tag, content["files"], content["files"]).values())

    return check


def newest_intact(folder: StageFolder) -> Verdict:
    """The checkpoint a stage would resume from, its files' sizes checked against their manifests
    (the stage checks their checksums too when it starts)."""
    return judge(look(folder), sizes_check(folder))
