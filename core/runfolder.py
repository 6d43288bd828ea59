"""The run folder's layout: every name under runs/<pipeline>/ (and runs/calibration/) is spelled here
and nowhere else.

    runs/<pipeline>/
      pipeline.json                 the chain's jobs and their states (pipeline/state.py)
      report.html                   plots and tables of the whole chain (pipeline/report.py)
      .pipeline.lock                held by the `run` that is running or submitting (pipeline/state.py)
      .input-digests.json           content digests of the files stages read (pipeline/identity.py)
      builtin/                      the built-in model and data, written once (core/tiny.py)
      scale-models/<model>-hd<D>/   a scale model's pipeline (<name>-scale): the narrowed models (pipeline/scale.py)
      <stage>/                      one folder per stage: StageFolder
        model/                      the exported model, Hugging Face format
        critic/                     PPO with a critic (advantage: gae): the critic, a 1-label sequence classifier
        checkpoints/                saved by stages/checkpoints.py; which one to resume from: core/checkpoints.py
          step-00000100/            DeepSpeed's files, rng-rankNNNNN.pt per rank, and manifest.json, written
                                    last: every file's size and checksum, and the step
          step-00000100.damaged-<time>/
                                    found damaged at resume and set aside (never deleted)
          latest                    names the newest complete checkpoint (replaced atomically; DeepSpeed reads it too)
        metrics.jsonl               one JSON object per logged step
        result.json                 final metrics and the spec hash that lets a re-run skip the stage
        spec.json                   the resolved stage as it was submitted
        plan.json                   the planner's prediction for the stage, saved at submission
        events.jsonl                when each attempt of the job started (a second one is a requeue or resume)
        phase.json                  the phase rank 0 is in (evaluation, a training step, ...) once it has lasted
                                    a while, and since when (stages/watchdog.py), for `status`
        tensorboard/                TensorBoard event files (rank 0)
        wandb/                      the W&B run's files, when tracking.wandb is set
        logs/                       the job's stdout/stderr, one file per process, named by its scheduler
                                    (schedulers/); before the job starts, only its submission
        failures/rank-<N>.json      why process N failed (core/failure.py); blank while it runs
        reference_logps.pt          DPO's precomputed reference log-probs
      <stage>.superseded-<time>/    a stage folder with outputs whose spec changed, moved aside (never deleted)
    runs/calibration/               beside the run folders, shared by every pipeline of that runs_dir
      <gpu>.json                    what `calibrate` measured on a node with that catalogue GPU; cpu.json
                                    without a GPU (core/calibration.py)
      logs/                         the calibration job's files and logs, where it runs as a job
    <name>.tmp                      a file or folder being written, renamed to <name> once complete

Torch-free: the login node reads it to submit and to show status.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import schedulers

STATE_FILE = "pipeline.json"
LOCK_FILE = ".pipeline.lock"
DIGESTS_FILE = ".input-digests.json"
BUILTIN_FOLDER = "builtin"
SCALE_MODELS_FOLDER = "scale-models"
DESCRIPTION_FILE = "scale_model.json"  # in a scale model's folder: what it was built from
SUPERSEDED = ".superseded-"
REPORT_FILE = "report.html"
CALIBRATION_FOLDER = "calibration"
TEMPORARY_SUFFIX = ".tmp"
MANIFEST_FILE = "manifest.json"  # in a checkpoint folder: what it holds (core/checkpoints.py)
DAMAGED = ".damaged-"
CHECKPOINT_TAG = re.compile(r"step-\d{8}")


def state_file(pipeline_dir: Path) -> Path:
    return Path(pipeline_dir) / STATE_FILE


def lock_file(pipeline_dir: Path) -> Path:
    return Path(pipeline_dir) / LOCK_FILE


def digests_file(pipeline_dir: Path) -> Path:
    return Path(pipeline_dir) / DIGESTS_FILE


def builtin_folder(pipeline_dir: str | Path) -> Path:
    return Path(pipeline_dir) / BUILTIN_FOLDER


def scale_model_folder(pipeline_dir: Path, source: str, head_dim: int) -> Path:
    """Where the scale model of `source` (a hub id or a folder) with head dimension head_dim is written."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", source.strip("/"))
    return Path(pipeline_dir) / SCALE_MODELS_FOLDER / f"{slug}-hd{head_dim}"


def _free_name(path: Path, infix: str) -> Path:
    """<path><infix><time>[-n]: a name beside `path` that nothing has yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}{infix}{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{infix}{stamp}-{n}")
    return target


def superseded_folders(pipeline_dir: Path) -> list[Path]:
    """Stage folders moved aside (<stage>.superseded-<time>), oldest first."""
    found = [p for p in Path(pipeline_dir).glob(f"*{SUPERSEDED}*") if p.is_dir()]
    return sorted(found, key=lambda p: p.name.split(SUPERSEDED, 1)[1])


def report_file(pipeline_dir: Path) -> Path:
    return Path(pipeline_dir) / REPORT_FILE


def calibration_folder(runs_dir: Path) -> Path:
    """<runs_dir>/calibration/: what `calibrate` measured, for every pipeline of that runs_dir."""
    return Path(runs_dir) / CALIBRATION_FOLDER


def calibration_file(runs_dir: Path, name: str) -> Path:
    """Where `calibrate` writes what it measured on a node whose GPU is `name` (its catalogue
    name, or "cpu"): <runs_dir>/calibration/<name>.json."""
    return calibration_folder(runs_dir) / f"{name}.json"


def calibration_logs(runs_dir: Path) -> Path:
    """The calibration job's folder, where it runs as a job (its pickled call, result and logs)."""
    return calibration_folder(runs_dir) / "logs"


def temporary(path: Path) -> Path:
    """Where `path` is written before it is renamed into place, so no reader sees half of it."""
    return path.with_name(path.name + TEMPORARY_SUFFIX)


def remove(path: Path) -> None:
    """Remove a file or a folder, if it is there."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@dataclass(frozen=True)
class StageFolder:
    """runs/<pipeline>/<stage>/ and what lives in it."""

    path: Path

    @classmethod
    def of(cls, pipeline_dir, stage: str) -> StageFolder:
        return cls(Path(pipeline_dir) / stage)

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def critic(self) -> Path:
        """PPO's critic (gae), exported beside the policy in Hugging Face format."""
        return self.path / "critic"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def latest_marker(self) -> Path:
        """The file naming the newest complete checkpoint (replaced atomically)."""
        return self.checkpoints / "latest"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def result(self) -> Path:
        return self.path / "result.json"

    @property
    def spec(self) -> Path:
        return self.path / "spec.json"

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def phase(self) -> Path:
        return self.path / "phase.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def reference_logps(self) -> Path:
        return self.path / "reference_logps.pt"

    @property
    def failures(self) -> Path:
        return self.path / "failures"

    def failure_record(self, rank: int) -> Path:
        """Why process `rank` failed (core/failure.py); a blank reservation while it runs."""
        return self.failures / f"rank-{rank:05d}.json"

    @staticmethod
    def checkpoint_tag(step: int) -> str:
        return f"step-{step:08d}"

    def checkpoint_tags(self) -> list[str]:
        """The checkpoint folders present, oldest first (intact or not; not those set aside)."""
        found = self.checkpoints.glob("step-*")
        return sorted(p.name for p in found if p.is_dir() and CHECKPOINT_TAG.fullmatch(p.name))

    def manifest(self, tag: str) -> Path:
        """What checkpoint `tag` holds, written once the rest of it is (core/checkpoints.py)."""
        return self.checkpoints / tag / MANIFEST_FILE

    def rng_state(self, tag: str, rank: int) -> Path:
        """One rank's random number generators' states inside checkpoint `tag`."""
        return self.checkpoints / tag / f"rng-rank{rank:05d}.pt"

    def latest_named(self) -> str | None:
        """The tag the `latest` marker names, whether or not that folder is there (which checkpoint
        a stage resumes from is core/checkpoints.py's `newest_intact`)."""
        try:
            return self.latest_marker.read_text().strip() or None
        except OSError:
            return None

    def set_aside(self, tag: str) -> Path:
        """A free name to move a damaged checkpoint to: checkpoints/<tag>.damaged-<time>[-n]."""
        return _free_name(self.checkpoints / tag, DAMAGED)

    def temporaries(self) -> list[Path]:
        """What an interrupted write left in the stage folder and checkpoints/: <name>.tmp files and
        folders, never read (a checkpoint an interrupted save left is core/checkpoints.py's to judge)."""
        return [p for folder in (self.path, self.checkpoints) for p in folder.glob(f"*{TEMPORARY_SUFFIX}")]

    def holds_outputs(self) -> bool:
        """Whether the folder holds anything but what `run` writes before the stage starts
        (spec.json, plan.json, and in logs/ the scheduler's submission files): a never-started
        stage's folder is reused, not superseded. A job that started has written its log there."""
        before = {self.spec.name, self.plan.name}
        if not self.path.is_dir():
            return False
        return any(p.name not in before and not (p == self.logs and not self.job_started())
                   for p in self.path.iterdir())

    def job_started(self) -> bool:
        """Whether a job of this stage ever started: its scheduler tells a started task's files in
        logs/ from those its submission wrote (schedulers/)."""
        return schedulers.job_started(self.logs)

    def superseded(self) -> Path:
        """A free name to move this folder aside to: <stage>.superseded-<time>[-n]."""
        return _free_name(self.path, SUPERSEDED)
