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
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from pydantic import BaseModel, ValidationError

from pipeline import graph, runfolder, slurm
from pipeline.errors import PipelineError

LOG_TAIL_LINES = 15

# What `status` calls a stage; the first three are final.
FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
PENDING, RUNNING, NOT_FINISHED, NOT_STARTED = "pending", "running", "not finished", "not started"


class StageRecord(BaseModel):
    job_id: str
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


@contextlib.contextmanager
def lock(pipeline_dir: Path) -> Iterator[bool]:
    """Take the run folder's lock (one `run` submitting at a time) if it is free:
    yields True, or False when another process holds it."""
    Path(pipeline_dir).mkdir(parents=True, exist_ok=True)
    with open(runfolder.lock_file(pipeline_dir), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:  # a file system without locks (e.g. Lustre without -o flock)
            yield True
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


# --------------------------------------------------------------------------- live chains


def live_jobs(run_state: Optional[RunState]) -> list[tuple[str, slurm.JobInfo]]:
    """(stage, job) for every recorded job that is still pending or running."""
    if run_state is None or not run_state.stages:
        return []
    infos = slurm.job_info([r.job_id for r in run_state.stages.values()])
    return [(name, infos[r.job_id]) for name, r in run_state.stages.items()
            if r.job_id in infos and infos[r.job_id].live]


def refuse_if_live(pipeline_dir: Path, config: str, tasks: list[graph.StageTask]) -> None:
    """A second chain on the same run folder would train two jobs into one folder.

    A job whose stage already wrote its result is only exiting: it does not count."""
    finished = {(t.name, t.spec_hash) for t in tasks if graph.is_finished(t)}
    run_state = load(pipeline_dir)
    live = [(name, info) for name, info in live_jobs(run_state)
            if (name, run_state.stages[name].spec_hash) not in finished]
    if live:
        jobs = ", ".join(f"{name} (job {info.job_id}, {info.state})" for name, info in live)
        raise PipelineError(
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

    @property
    def failed(self) -> bool:
        return self.state == FAILED


def stage_statuses(tasks: list[graph.StageTask], run_state: Optional[RunState]) -> list[StageStatus]:
    """Each stage's state: its folder first (finished?), then Slurm, then the record."""
    records = run_state.stages if run_state else {}
    infos = slurm.job_info([r.job_id for r in records.values()]) if records else {}
    statuses = []
    for task in tasks:
        record = records.get(task.name)
        if graph.is_finished(task):
            status = StageStatus(task.name, FINISHED, _result_summary(task), task.run_dir)
            info = infos.get(record.job_id) if record is not None else None
            if info is not None and record.spec_hash == task.spec_hash:
                status.slurm_state, status.restarts, status.source = info.state, info.restarts, "slurm"
        elif record is None or (record.spec_hash != task.spec_hash and not _is_live(record, infos)):
            status = _from_folder(task)
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


def _from_folder(task: graph.StageTask) -> StageStatus:
    """A stage no Slurm job is known for: what its folder says (the local executor's case)."""
    if not task.folder.spec.exists():
        return StageStatus(task.name, NOT_STARTED, "", task.run_dir)
    latest = task.folder.latest_checkpoint()
    if latest:
        detail = f"newest checkpoint {latest}: `run` resumes from it"
    else:
        detail = "started, no checkpoint yet"
    return StageStatus(task.name, NOT_FINISHED, detail, task.run_dir)


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
    requeued = f", requeued {info.restarts}x" if info.restarts else ""
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
        step = _last_step(task.folder)
        detail = f"on {info.nodes}" + (f", at step {step}" if step is not None else "") + requeued
        return StageStatus(state=RUNNING, detail=detail + older, **base)
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
    """Point at the log that explains the failure: the first rank whose stderr holds a
    traceback, else rank 0's."""
    logs = Path(record.logs)
    candidates = sorted(logs.glob(f"{record.job_id}_*_log.err"), key=lambda p: _task_index(p, record.job_id))
    chosen = logs / f"{record.job_id}_0_log.err"
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


def _last_step(folder: runfolder.StageFolder) -> Optional[int]:
    try:
        lines = folder.metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _result_summary(task: graph.StageTask) -> str:
    try:
        result = json.loads(task.folder.result.read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    numbers = {k: v for k, v in result.items() if isinstance(v, float) and k != "seconds"}
    return "  ".join(f"{k}={v:.4g}" for k, v in numbers.items())
