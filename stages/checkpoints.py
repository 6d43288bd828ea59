"""A stage's checkpoints: save them with a manifest, resume from the newest intact one.

A save writes a new folder checkpoints/<tag>/ (DeepSpeed's files, every rank's random number
generators, the engines saved beside it). Once every rank has written its files, the ranks
checksum the folder's files between them and rank 0 writes the manifest (core/checkpoints.py),
checks it against the files, and only then points `latest` at the new checkpoint and removes
the oldest beyond keep_checkpoints. A job killed anywhere in a save leaves the previous
checkpoint intact and named.

At resume the ranks check the newest checkpoint's every byte between them; a damaged one (or a
`latest` naming a folder that is gone) is named in the log and set aside, and the stage falls
back to the next intact one. With checkpoints present but none intact, the stage refuses
(InvalidInput: exit 2) rather than start over by itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from core import checkpoints as manifests
from core import timeline
from core.errors import InvalidInput
from core.failure import saving
from core.runfolder import StageFolder, remove, temporary

log = logging.getLogger("stages")

# Threads each rank checksums with: 8 ranks of a GPU node read 32 blocks at once.
CHECKSUM_THREADS = 4


class Checkpoints:
    """DeepSpeed checkpoints in the stage folder's checkpoints/, each with a manifest."""

    def __init__(self, stage_folder: StageFolder, keep: int, is_main: bool, rank: int = 0):
        self.stage_folder, self.keep, self.is_main, self.rank = stage_folder, keep, is_main, rank
        self.folder = stage_folder.checkpoints
        self.threads = min(CHECKSUM_THREADS, len(os.sched_getaffinity(0)))
        self.last: str | None = None  # the newest checkpoint resumed from or saved: what a save needs is its size

    def save(self, engine, step: int, client_state: dict, others: dict | None = None) -> None:
        """Save `engine` (and any `others`, e.g. a critic, inside the same tag folder).

        A save that fails on any rank (a full disk, a folder it may not write, a rank
        lost mid-save) removes its tag folder there, so `latest` keeps naming the
        previous checkpoint and nothing half-written stays; the error says why."""
        tag = self.stage_folder.checkpoint_tag(step)
        with saving(self.folder / tag, f"checkpoint {tag}", like=self.folder / self.last if self.last else None):
            engine.save_checkpoint(str(self.folder), tag=tag, client_state=client_state, save_latest=False)
            for name, other in (others or {}).items():
                other.save_checkpoint(str(self.folder / tag), tag=name, save_latest=False)
            own = self.stage_folder.rng_state(tag, self.rank)  # every rank its own generators
            own.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rng_states(), own)
            dist.barrier()  # every rank's files are written
            content = self._manifest(tag, step)
            if self.is_main:
                self._write_manifest(tag, content)
                self._verify(tag)
        if self.is_main:
            self._mark(tag)
            self._rotate(tag)
        dist.barrier()
        self.last = tag
        log.info("checkpoint %s saved", tag)

    def load(self, engine, others: dict | None = None) -> dict | None:
        """Client state of the newest intact checkpoint, after loading it; None if there is none."""
        tag = self._resume_tag()
        if tag is None:
            return None
        _, client_state = engine.load_checkpoint(str(self.folder), tag=tag)
        if client_state is None:  # DeepSpeed's answer to a file it did not find
            raise RuntimeError(f"DeepSpeed loaded nothing from checkpoint {self.folder / tag}")
        for name, other in (others or {}).items():
            other.load_checkpoint(str(self.folder / tag), tag=name)
        own = self.stage_folder.rng_state(tag, self.rank)
        if own.exists():
            set_rng_states(torch.load(own, weights_only=False))
        elif "rng" in client_state:  # a checkpoint from before per-rank states: rank 0's CPU state
            torch.set_rng_state(client_state["rng"])
        log.info("resumed from checkpoint %s", tag)
        if self.is_main:
            timeline.record(self.stage_folder, timeline.RESUMED, step=client_state["step"])
        self.last = tag
        return client_state

    # ----------------------------------------------------------------------- manifests

    def _manifest(self, tag: str, step: int) -> dict:
        """The manifest of checkpoint `tag`, its files checksummed by every rank in turn (a collective)."""
        sizes = _from_main(lambda: manifests.files(self.folder / tag))
        mine = manifests.share(manifests.blocks(sizes), dist.get_rank(), dist.get_world_size())
        crcs: dict = {}
        for part in _gathered(manifests.checksums(self.folder / tag, mine, self.threads)):
            crcs.update(part)
        return manifests.manifest(step, sizes, crcs)

    def _check(self, tag: str, content: dict) -> list[str]:
        """What is wrong with checkpoint `tag` against its manifest: every rank checks its share (a collective)."""
        listed = content["files"]
        mine = manifests.share(manifests.blocks({n: f["bytes"] for n, f in listed.items()}),
                               dist.get_rank(), dist.get_world_size())
        wrong: dict = {}
        for part in _gathered(manifests.content_problems(self.folder / tag, listed, mine, self.threads)):
            for name, said in part.items():
                wrong.setdefault(name, said)  # ranks hold blocks in order: the first is the earliest
        return [wrong[name] for name in sorted(wrong)]

    def _write_manifest(self, tag: str, content: dict) -> None:
        """Rank 0: checkpoint `tag`'s manifest, whole or not at all (a temporary renamed into place)."""
        path = self.stage_folder.manifest(tag)
        tmp = temporary(path)
        with saving(tmp, f"the manifest of checkpoint {tag}"):
            tmp.write_text(manifests.manifest_text(content))
        os.replace(tmp, path)

    def _verify(self, tag: str) -> None:
        """Rank 0, after writing checkpoint `tag`'s manifest: read it back and check the files' sizes against
        it (their checksums were taken from the files themselves, after every rank had written them)."""
        content = manifests.read_manifest(self.stage_folder.manifest(tag))
        check = manifests.sizes_check(self.stage_folder)
        wrong = check(tag, content) if isinstance(content, dict) else [str(content)]
        if wrong:
            raise RuntimeError(f"checkpoint {tag} does not match the manifest just written: {'; '.join(wrong)}")

    def _mark(self, tag: str) -> None:
        """Point `latest` at `tag` (rank 0), atomically."""
        marker = self.stage_folder.latest_marker
        tmp = temporary(marker)
        with saving(tmp, f"the marker naming checkpoint {tag}"):
            tmp.write_text(tag)
        os.replace(tmp, marker)

    def _rotate(self, newest: str) -> None:
        """Remove the oldest checkpoints beyond keep_checkpoints, once `newest` is verified: only older
        ones (set-aside folders are not checkpoints here). Each is renamed to a temporary first, so
        a removal cut short leaves what start-up removes, never a checkpoint missing files."""
        older = [tag for tag in self.stage_folder.checkpoint_tags() if tag < newest]
        for tag in older[:max(0, len(older) - (self.keep - 1))]:
            doomed = temporary(self.folder / tag)
            remove(doomed)
            os.replace(self.folder / tag, doomed)
            remove(doomed)

    # ----------------------------------------------------------------------- resume

    def _resume_tag(self) -> str | None:
        """The tag every rank resumes from, once the ranks have checked the checkpoints newest first
        (a collective). Rank 0 sets aside the damaged ones and removes what an unfinished save left."""
        found = _from_main(lambda: manifests.look(self.stage_folder))
        verdict = manifests.judge(found, self._check)
        if verdict.refused:
            raise InvalidInput(verdict.refusal(self.stage_folder))
        if self.is_main:
            self._tidy(verdict, found.latest)
        dist.barrier()
        return verdict.tag

    def _tidy(self, verdict: manifests.Verdict, latest: str | None) -> None:
        """Say what was found; set aside the damaged checkpoints, remove the unfinished ones, mark the one resumed."""
        if verdict.gone:
            log.warning("`latest` names checkpoint %s, whose folder %s is gone", verdict.gone,
                        self.folder / verdict.gone)
        for tag, wrong in verdict.damaged.items():
            aside = self.stage_folder.set_aside(tag)
            os.replace(self.folder / tag, aside)
            log.warning("checkpoint %s is damaged: %s; set aside as %s", tag, "; ".join(wrong), aside)
        if verdict.latest_intact:
            for tag in verdict.unfinished:
                remove(self.folder / tag)
                log.info("removed %s: a save that did not finish (no %s, newer than %s)", self.folder / tag,
                         manifests.MANIFEST_FILE, latest)
        if verdict.tag is None:
            if verdict.gone or verdict.damaged:
                log.warning("no intact checkpoint is left: the stage starts at step 0")
            return
        if verdict.unchecked:
            log.warning("checkpoint %s was written before checkpoints had manifests: resuming from it unchecked",
                        verdict.tag)
        if verdict.gone or verdict.damaged:
            log.warning("resuming from %s, the newest intact checkpoint: %d steps to train again", verdict.tag,
                        verdict.lost_steps)
        if latest != verdict.tag:
            self._mark(verdict.tag)


def _from_main(read: Callable):
    """What rank 0 reads, handed to every rank: they all judge the same folder."""
    held = [read() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(held, src=0)
    return held[0]


def _gathered(mine) -> list:
    """Every rank's `mine`, in rank order."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def rng_states() -> dict:
    """This process's random number generators: Python's, NumPy's, torch's CPU and CUDA."""
    import random

    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
