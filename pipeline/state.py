"""Run state: runs/<pipeline>/pipeline.json, and each stage's state as `status` shows it.

pipeline.json records, per stage, the job that runs it and its executor, its state
when last seen, how many times `run` submitted it and the spec hash it was submitted
with. `run` writes it after every submission; `status` and `cancel` refresh it, so it
still knows how a job ended after the scheduler has forgotten the job (without
accounting, Slurm forgets a job MinJobAge seconds after it ended). Whether a
stage finished is always read from the stage's own folder: result.json. What a
stage's job says of it comes from its executor (pipeline/executors/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, ValidationError

from core import metrics, runfolder, timeline
from core.checkpoints import newest_intact
from core.cluster_spec import UNNAMED_RECORD_EXECUTOR
from core.errors import InvalidInput, PipelineError
from core.task import StageTask
from pipeline import graph

# What `status` calls a stage; the first three are final.
FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
PENDING, RUNNING, NOT_FINISHED, NOT_STARTED = "pending", "running", "not finished", "not started"


class StageRecord(BaseModel):
    job_id: str  # the job, as its executor names it (a Slurm job id; a local job's pid on the run's host)
    executor: str = UNNAMED_RECORD_EXECUTOR  # which scheduler ran it (schedulers/)
    host: str = ""  # where a local job ran
    state: str  # what `status` last called it: pending, running, finished, failed, cancelled
    # The scheduler's own word for the job's state when last seen (Slurm's JobState); records written
    # before other schedulers came named it slurm_state.
    job_state: str = Field("", validation_alias=AliasChoices("job_state", "slurm_state"))
    detail: str = ""  # what `status` last said about it
    attempts: int = 1  # how many times `run` submitted this spec of the stage
    spec_hash: str
    submitted_at: str
    after: list[str] = []  # job ids this job waits for (afterok)
    logs: str  # folder of the job's logs: <job id>_<task>_log.out / .err


class RunState(BaseModel):
    pipeline: str
    config: str  # the pipeline file, as given to `run`
    stages: dict[str, StageRecord] = {}

    def job_stage(self, job_id: str) -> str | None:
        return next((name for name, r in self.stages.items() if r.job_id == job_id), None)


def load(pipeline_dir: Path) -> RunState | None:
    path = runfolder.state_file(pipeline_dir)
    if not path.is_file():
        return None
    try:
        return RunState.model_validate_json(path.read_text())
    except (ValidationError, OSError) as err:
        raise PipelineError(
            f"{path}: unreadable run state ({err}); remove it if no job of this pipeline is live") from None


def save(pipeline_dir: Path, run_state: RunState) -> None:
    """Write pipeline.json atomically: a reader never sees half a file."""
    path = runfolder.state_file(pipeline_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(run_state.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


class Holder(BaseModel):
    """Who holds the run folder's lock: a `run` running the chain here, or submitting it."""

    pid: int
    host: str
    started: str
    config: str
    doing: str  # what its executor does with the chain, e.g. "running it locally", "submitting it to Slurm"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.started}, {self.doing} (pipeline file {self.config})"


@contextlib.contextmanager
def hold(pipeline_dir: Path, config: str, doing: str, echo=print) -> Iterator[Holder]:
    """Hold the run folder's lock while a `run` works on it: for its whole length when it runs
    the chain locally, while it submits when the chain goes to Slurm. Another `run` of the
    same folder is refused (exit 2) with the holder's pid, host and start. The kernel frees the
    lock when its holder dies however it dies; a holder record left behind is taken over."""
    Path(pipeline_dir).mkdir(parents=True, exist_ok=True)
    me = Holder(pid=os.getpid(), host=socket.gethostname(), started=now(), config=config, doing=doing)
    with open(runfolder.lock_file(pipeline_dir), "a+") as handle:
        locked = _try_flock(handle, fcntl.LOCK_EX)
        left = _read_holder(handle)
        if locked is False or (locked is None and left is not None and holder_alive(left)):
            raise InvalidInput(
                f"another `run` of this pipeline is live on {pipeline_dir}: "
                + (left.describe() if left else "a process that has not said who it is yet")
                + ". Wait for it to end, or stop it (`python -m pipeline cancel` stops a local run it holds).")
        if left is not None and left.pid != me.pid:
            echo(f"note: took over the run folder's lock from a `run` that ended without releasing it "
                 f"({left.describe()})")
        _write_holder(handle, me)
        try:
            yield me
        finally:
            _write_holder(handle, None)
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def holder(pipeline_dir: Path) -> Holder | None:
    """The `run` holding the run folder's lock right now, or None."""
    path = runfolder.lock_file(pipeline_dir)
    if not path.is_file():
        return None
    with open(path, "a+") as handle:
        locked = _try_flock(handle, fcntl.LOCK_SH, tries=1)
        if locked:
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None
        left = _read_holder(handle)
        if locked is None:  # no locks on this file system: trust a live process on this host
            return left if left is not None and holder_alive(left) else None
        return left or Holder(pid=0, host="?", started="?", config="?", doing="starting")


def save_unless_held(pipeline_dir: Path, run_state: RunState) -> None:
    """Save what `status` saw, unless a `run` holds the folder (it writes pipeline.json itself)."""
    with open(runfolder.lock_file(pipeline_dir), "a+") as handle:
        locked = _try_flock(handle, fcntl.LOCK_EX, tries=1)
        if locked is False:
            return
        try:
            save(pipeline_dir, run_state)
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _try_flock(handle, mode: int, tries: int = 10) -> bool | None:
    """True: locked; False: someone else holds it (after `tries` tries 0.1 s apart: `status`
    takes it for an instant); None: the file system has no locks (e.g. Lustre without -o flock)."""
    for attempt in range(tries):
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < tries:
                time.sleep(0.1)
        except OSError:
            return None
    return False


def _read_holder(handle) -> Holder | None:
    handle.seek(0)
    try:
        return Holder.model_validate_json(handle.read())
    except (ValidationError, ValueError):
        return None


def _write_holder(handle, who: Holder | None) -> None:
    handle.seek(0)
    handle.truncate()
    if who is not None:
        handle.write(who.model_dump_json())
    handle.flush()


def holder_alive(who: Holder) -> bool:
    """A holder process alive on this host (one on another host cannot be checked: assume alive)."""
    if who.host != socket.gethostname():
        return True
    try:
        os.kill(who.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


# --------------------------------------------------------------------------- status


@dataclass
class StageStatus:
    name: str
    state: str
    detail: str
    run_dir: str
    job_id: str | None = None
    job_state: str = ""  # the scheduler's own word for it (Slurm's JobState)
    restarts: int = 0
    log: str | None = None
    log_tail: list[str] = field(default_factory=list)
    source: str = "folder"  # where the state came from: folder, record, or the scheduler's name (e.g. slurm)
    progress: dict | None = None  # a running stage's last step, total_steps, eta_s and its time (metrics.jsonl)

    @property
    def failed(self) -> bool:
        return self.state == FAILED


def refresh(run_state: RunState, statuses: list[StageStatus]) -> None:
    """Remember what was seen, so the record outlives the scheduler's memory of the jobs."""
    for status in statuses:
        record = run_state.stages.get(status.name)
        if record is not None and status.job_id == record.job_id and status.source != "record":
            record.state = status.state
            record.job_state = status.job_state or record.job_state
            record.detail = status.detail


def from_folder(task: StageTask) -> StageStatus:
    """A stage no job is known for: what its folder says."""
    if not task.folder.spec.exists():
        return StageStatus(task.name, NOT_STARTED, "", task.run_dir)
    if graph.recorded_hash(task.folder.path) != task.spec_hash:
        if not task.folder.holds_outputs():  # an earlier spec's, submitted and never started
            return StageStatus(task.name, NOT_STARTED, "", task.run_dir)
        detail = "holds the outputs of an earlier spec: `run` moves them aside and starts over"
    else:
        detail = resume_point(task)
    return StageStatus(task.name, NOT_FINISHED, detail, task.run_dir)


def activity(folder: runfolder.StageFolder,
             now: float | None = None) -> tuple[str, metrics.Progress | None]:
    """What `status` says a running stage is doing, and its progress: its step of the total and ETA
    (its last training record), the age of its last record of any kind (an old one on a running
    stage points at a hang), and the phase its rank 0 is in once that has lasted half a minute
    (stages/watchdog.py), e.g. "step 40/200 (20%), ETA 1:20 as of 0:05 ago; in evaluation at step
    40 for 2:15", or "no record yet, started 2:19 ago; in evaluation > scoring at step 0 for 1:48"."""
    now = time.time() if now is None else now
    records = metrics.read(folder.metrics)
    progress = metrics.progress_of(records)
    said = [progress.text(now)] if progress is not None else []
    last = max(records, key=lambda r: r.get("time", 0.0), default=None)
    if last is not None and "time" in last and (progress is None or last["time"] > (progress.time or 0.0)):
        what = f" (evaluation at step {last['step']})" if metrics.is_eval(last) else ""
        said.append(f"last record{what} {metrics.duration_text(now - last['time'])} ago")
    if not records:
        history = timeline.attempts(folder)
        started = f", started {metrics.duration_text(now - history[-1].started)} ago" if history else ""
        said.append(f"no record yet{started}")
    note = timeline.phase_now(folder)
    doing = note.text(now) if note is not None else ""
    return ", ".join(said) + (f"; {doing}" if doing else ""), progress


def resume_point(task: StageTask) -> str:
    return newest_intact(task.folder).status(task.name)


def as_dict(progress: metrics.Progress | None) -> dict | None:
    return None if progress is None else dataclasses.asdict(progress)


def result_summary(task: StageTask) -> str:
    try:
        result = json.loads(task.folder.result.read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    numbers = {k: v for k, v in result.items() if isinstance(v, float) and k != "seconds"}
    return "  ".join(f"{k}={v:.4g}" for k, v in numbers.items()) + interruptions(task)


def interruptions(task: StageTask) -> str:
    """The stage job's requeues, why and where it resumed, e.g. "; requeued 1x: preempted
    (SIGTERM) at step 12, resumed from step 12"; "" if none."""
    said = timeline.interruptions(task.folder)
    return f"; {said}" if said else ""
