"""Run state: runs/<pipeline>/pipeline.json, and each stage's state as `status` shows it.

pipeline.json records, per stage, the Slurm job that runs it, its state when last
seen, how many times `run` submitted it and the spec hash it was submitted with.
`run` writes it after every submission; `status` and `cancel` refresh it, so it
still knows how a job ended after Slurm has forgotten the job (without
accounting, Slurm forgets a job MinJobAge seconds after it ended). Whether a
stage finished is always read from the stage's own folder: result.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from pydantic import BaseModel, ValidationError

from core import failure, metrics, runfolder, timeline
from core.errors import InvalidInput, PipelineError
from core.task import StageTask, is_finished
from pipeline import graph, slurm

LOG_TAIL_LINES = 15

# What `status` calls a stage; the first three are final.
FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
PENDING, RUNNING, NOT_FINISHED, NOT_STARTED = "pending", "running", "not finished", "not started"


class StageRecord(BaseModel):
    job_id: str  # the Slurm job, or the local job (submitit's, on the run's host)
    executor: str = "slurm"  # slurm | local
    host: str = ""  # where a local job ran
    state: str  # what `status` last called it: pending, running, finished, failed, cancelled
    slurm_state: str = ""  # Slurm's JobState when last seen
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

    def job_stage(self, job_id: str) -> Optional[str]:
        return next((name for name, r in self.stages.items() if r.job_id == job_id), None)


def load(pipeline_dir: Path) -> Optional[RunState]:
    path = runfolder.state_file(pipeline_dir)
    if not path.is_file():
        return None
    try:
        return RunState.model_validate_json(path.read_text())
    except (ValidationError, OSError) as err:
        raise PipelineError(f"{path}: unreadable run state ({err}); remove it if no job of this pipeline is live")


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
    doing: str  # "running it locally" | "submitting it to Slurm"

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


def holder(pipeline_dir: Path) -> Optional[Holder]:
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


def _try_flock(handle, mode: int, tries: int = 10) -> Optional[bool]:
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


def _read_holder(handle) -> Optional[Holder]:
    handle.seek(0)
    try:
        return Holder.model_validate_json(handle.read())
    except (ValidationError, ValueError):
        return None


def _write_holder(handle, who: Optional[Holder]) -> None:
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


# --------------------------------------------------------------------------- live chains


def live_jobs(run_state: Optional[RunState]) -> list[tuple[str, slurm.JobInfo]]:
    """(stage, job) for every recorded job that is still pending or running."""
    records = _slurm_records(run_state)
    if not records:
        return []
    infos = slurm.job_info([r.job_id for r in records.values()])
    return [(name, infos[r.job_id]) for name, r in records.items() if r.job_id in infos and infos[r.job_id].live]


def _slurm_records(run_state: Optional[RunState]) -> dict[str, StageRecord]:
    if run_state is None:
        return {}
    return {name: r for name, r in run_state.stages.items() if r.executor == "slurm"}


def refuse_if_live(pipeline_dir: Path, config: str, tasks: list[StageTask]) -> None:
    """A second chain on the same run folder would train two jobs into one folder.

    A job whose stage already wrote its result is only exiting: it does not count."""
    finished = {(t.name, t.spec_hash) for t in tasks if is_finished(t)}
    run_state = load(pipeline_dir)
    live = [(name, info) for name, info in live_jobs(run_state)
            if (name, run_state.stages[name].spec_hash) not in finished]
    if live:
        jobs = ", ".join(f"{name} (job {info.job_id}, {info.state})" for name, info in live)
        raise InvalidInput(
            f"a chain of this pipeline is still live on {pipeline_dir}: {jobs}. "
            f"Follow it with `python -m pipeline status {config}`, or stop it with "
            f"`python -m pipeline cancel {config}` before running again."
        )


# --------------------------------------------------------------------------- status


@dataclass
class StageStatus:
    name: str
    state: str
    detail: str
    run_dir: str
    job_id: Optional[str] = None
    slurm_state: str = ""
    restarts: int = 0
    log: Optional[str] = None
    log_tail: list[str] = field(default_factory=list)
    source: str = "folder"  # where the state came from: folder, slurm (or accounting), record
    progress: Optional[dict] = None  # a running stage's last step, total_steps, eta_s and its time (metrics.jsonl)

    @property
    def failed(self) -> bool:
        return self.state == FAILED


def stage_statuses(tasks: list[StageTask], run_state: Optional[RunState],
                   running: Optional[Holder] = None) -> list[StageStatus]:
    """Each stage's state: its folder first (finished?), then Slurm or the local run (`running`:
    the `run` holding the folder now), then the record."""
    records = run_state.stages if run_state else {}
    slurm_records = _slurm_records(run_state)
    infos = slurm.job_info([r.job_id for r in slurm_records.values()]) if slurm_records else {}
    statuses = []
    for task in tasks:
        record = records.get(task.name)
        if is_finished(task):
            status = StageStatus(task.name, FINISHED, _result_summary(task), task.run_dir)
            info = infos.get(record.job_id) if record is not None else None
            if info is not None and record.spec_hash == task.spec_hash:
                status.slurm_state, status.restarts, status.source = info.state, info.restarts, "slurm"
        elif record is None or (record.spec_hash != task.spec_hash and not _is_live(record, infos)):
            status = _from_folder(task)
        elif record.executor == "local":
            status = _from_local_run(task, record, running)
        else:
            status = _from_job(task, record, infos.get(record.job_id), run_state)
        if record is not None and status.job_id is None and record.spec_hash == task.spec_hash:
            status.job_id = record.job_id
        statuses.append(status)
    return statuses


def refresh(run_state: RunState, statuses: list[StageStatus]) -> None:
    """Remember what was seen, so the record outlives Slurm's memory of the jobs."""
    for status in statuses:
        record = run_state.stages.get(status.name)
        if record is not None and status.job_id == record.job_id and status.source != "record":
            record.state = status.state
            record.slurm_state = status.slurm_state or record.slurm_state
            record.detail = status.detail


def _is_live(record: StageRecord, infos: dict) -> bool:
    info = infos.get(record.job_id)
    return info is not None and info.live


def _from_folder(task: StageTask) -> StageStatus:
    """A stage no job is known for: what its folder says."""
    if not task.folder.spec.exists():
        return StageStatus(task.name, NOT_STARTED, "", task.run_dir)
    if graph.recorded_hash(task.folder.path) != task.spec_hash:
        detail = "holds the outputs of an earlier spec: `run` moves them aside and starts over"
    else:
        detail = _resume_point(task)
    return StageStatus(task.name, NOT_FINISHED, detail, task.run_dir)


def _resume_point(task: StageTask) -> str:
    latest = task.folder.latest_checkpoint()
    return f"newest checkpoint {latest}: `run` resumes from it" if latest else "no checkpoint yet: `run` starts it over"


def _from_local_run(task, record: StageRecord, running: Optional[Holder]) -> StageStatus:
    """A stage a local `run` started: running while that run holds the folder, else how it ended."""
    base = dict(name=task.name, run_dir=task.run_dir, job_id=record.job_id, source="record")
    if record.state == RUNNING and running is not None:
        progress = metrics.progress(task.folder.metrics)
        detail = f"local job on {record.host}" + (f", {progress.text()}" if progress is not None else "")
        detail += _interruptions(task)
        return StageStatus(state=RUNNING, detail=detail + f" (`run` {running.pid})", progress=_as_dict(progress),
                           **base)
    if record.state == RUNNING:  # the run that ran it is gone without saying how the stage ended
        detail = f"the local `run` on {record.host} ended while the stage ran (killed?); {_resume_point(task)}"
        return _with_log(StageStatus(state=FAILED, detail=detail, **base), record)
    if record.state == FAILED:
        return _with_log(StageStatus(state=FAILED, detail=record.detail + _interruptions(task), **base), record)
    return StageStatus(state=record.state, detail=f"{record.detail}; {_resume_point(task)}", **base)


def _from_job(task, record: StageRecord, info: Optional[slurm.JobInfo], run_state: RunState) -> StageStatus:
    base = dict(name=task.name, run_dir=task.run_dir, job_id=record.job_id)
    older = "" if record.spec_hash == task.spec_hash else " (an older spec of this stage)"
    if info is None:
        # Slurm (and accounting, if any) no longer knows the job, and it left no result.
        if record.state in (FAILED, CANCELLED):
            state, detail = record.state, f"{record.detail or record.slurm_state} (as last seen)"
        else:
            state, detail = FAILED, f"the job ended without writing result.json (last seen {record.state})"
        status = StageStatus(state=state, detail=detail + older, slurm_state=record.slurm_state,
                             source="record", **base)
        return _with_log(status, record) if state == FAILED else status
    base.update(slurm_state=info.state, restarts=info.restarts, source="slurm")
    requeued = _interruptions(task) or (f", requeued {info.restarts}x" if info.restarts else "")
    if info.waiting:
        if info.reason == "Dependency":
            upstream = [run_state.job_stage(j) or f"job {j}" for j in record.after]
            detail = "waiting for " + ", ".join(upstream)
        else:
            detail = f"waiting ({info.reason})" if info.reason else "waiting"
        return StageStatus(state=PENDING, detail=detail + requeued + older, **base)
    if info.state == "COMPLETING" and record.state == CANCELLED:
        return StageStatus(state=CANCELLED, detail=record.detail or "cancelled", **base)
    if info.state == "COMPLETING":
        return StageStatus(state=RUNNING, detail="ending: Slurm is cleaning up its processes" + older, **base)
    if info.live:
        progress = metrics.progress(task.folder.metrics)
        detail = f"on {info.nodes}" + (f", {progress.text()}" if progress is not None else "") + requeued
        return StageStatus(state=RUNNING, detail=detail + older, progress=_as_dict(progress), **base)
    if info.state == "CANCELLED":
        if info.reason == "DependencyNeverSatisfied":
            upstream = [run_state.job_stage(j) or f"job {j}" for j in record.after]
            detail = "not run: upstream " + ", ".join(upstream) + " did not finish"
        else:
            detail = "cancelled"
        return StageStatus(state=CANCELLED, detail=detail + older, **base)
    if info.state == "COMPLETED":
        detail = "the job completed but wrote no result.json for this spec"
    else:
        detail = f"{info.state}" + (f", exit code {info.exit_code}" if info.exit_code else "")
        detail += f" ({info.reason})" if info.reason and info.reason != "NonZeroExitCode" else ""
    return _with_log(StageStatus(state=FAILED, detail=detail + requeued + older, **base), record)


def _with_log(status: StageStatus, record: StageRecord) -> StageStatus:
    """Say why the job failed: the cause its ranks recorded (core/failure.py), or srun's
    word on a task that died without one, and that rank's log. Without either, point at the
    first log that holds a traceback (else rank 0's) and show its last lines."""
    logs = Path(record.logs)
    batch_err = logs / f"{record.job_id}_0_log.err"  # the batch script's stderr: srun writes there too
    records = failure.read(runfolder.StageFolder(Path(status.run_dir)), record.job_id)
    if all(r.secondary for r in records) and batch_err.is_file():
        recorded = {r.rank for r in records}
        died = failure.srun_deaths(batch_err.read_text(errors="replace"))
        records += [d for d in died if d.rank not in recorded]
    cause = failure.summary(records)
    if cause is not None:
        if cause not in status.detail:  # a local run's record already says it
            status.detail = f"{status.detail}: {cause}" if status.detail else cause
        first = failure.explaining(records)
        status.log = first.log or str(logs / f"{record.job_id}_{first.rank}_log.err")
        return status
    candidates = sorted(logs.glob(f"{record.job_id}_*_log.err"), key=lambda p: _task_index(p, record.job_id))
    chosen = batch_err
    for path in candidates:
        if "Traceback" in path.read_text(errors="replace"):
            chosen = path
            break
    status.log = str(chosen)
    if chosen.is_file():
        lines = [line for line in chosen.read_text(errors="replace").splitlines() if line.strip()]
        status.log_tail = lines[-LOG_TAIL_LINES:]
    return status


def _task_index(path: Path, job_id: str) -> int:
    try:
        return int(path.name[len(job_id) + 1:].split("_")[0])
    except ValueError:
        return 1 << 30


def _as_dict(progress: Optional[metrics.Progress]) -> Optional[dict]:
    return None if progress is None else dataclasses.asdict(progress)


def _result_summary(task: StageTask) -> str:
    try:
        result = json.loads(task.folder.result.read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    numbers = {k: v for k, v in result.items() if isinstance(v, float) and k != "seconds"}
    return "  ".join(f"{k}={v:.4g}" for k, v in numbers.items()) + _interruptions(task)


def _interruptions(task: StageTask) -> str:
    """The stage job's requeues, why and where it resumed, e.g. "; requeued 1x: time limit
    (SIGUSR2) at step 12, resumed from step 12"; "" if none."""
    said = timeline.interruptions(task.folder)
    return f"; {said}" if said else ""
