"""What an executor is, and the pieces every executor shares.

An executor is the submit half of a scheduler (schedulers/): where a pipeline's stages
run, e.g. this machine (schedulers/local/) or a Slurm cluster (schedulers/slurm/).
pipeline/executors/__init__.py maps the pipeline file's `cluster.executor` (and a
pipeline.json record's `executor`) to one; nothing else asks which one it is: it asks
the executor what it needs to know.

- Facts the checks need: does `run` fetch the hub's models before the stages run
  (`fetches_before_run`), do the stages run with this python (`runs_this_python`),
  is a job given the GPUs it asks for (`grants_asked_gpus`), a stage's time limit.
- Submit: the checks before `run` locks the run folder (each executor in its own
  order), then the chain (`submit`); `job_task` is the task as its job runs it.
- State: what the scheduler knows of recorded jobs now (`look`) and a stage's status
  from it (`stage_status`); live check: `is_live`; cancel: `stop_run` (a `run` that
  holds the folder), `cancel` and `wait_until_ended` (live jobs).
- Its jobs' tasks: `runtime`, the scheduler's node half, names their log files; what
  the scheduler says of a task that died without a word (`deaths`).
"""

from __future__ import annotations

import json
import shlex
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from core import failure, runfolder
from core.config import PipelineSpec
from core.errors import PipelineError
from core.failure import Failure
from core.task import StageTask
from pipeline import plan, state
from pipeline.graph import PlannedStage
from schedulers import Runtime

LOG_TAIL_LINES = 15


class Executor(ABC):
    """Where the stages run. What the scheduler knows of a job (`look`'s values) has at
    least `job_id`, `state` and `live`."""

    name: ClassVar[str]  # cluster.executor in the pipeline file; `executor` in pipeline.json's records
    doing: ClassVar[str]  # what a `run` of this executor holding the run folder's lock does (state.Holder.doing)
    calibrate_help: ClassVar[str]  # `calibrate --NAME`: measure where this executor runs the stages
    # `run` fetches the hub ids a pipeline names into the cache before any stage runs (the jobs read it offline),
    # so the checks need not refuse one the hub cannot give them now.
    fetches_before_run: ClassVar[bool] = False
    # A job is given the GPUs the cluster section asks for: one that finds none ran on the wrong nodes.
    grants_asked_gpus: ClassVar[bool] = False
    runtime: ClassVar[type[Runtime]]  # a task of its jobs, as the scheduler's node half sees it: its log files

    def runs_this_python(self, spec: PipelineSpec) -> bool:
        """The stages run with this python (so what they import can be checked here)."""
        return True

    def time_limit_min(self, spec: PipelineSpec, stage) -> int | None:
        """The stage job's time limit in minutes; None when it has none."""
        return None

    def job_task(self, spec: PipelineSpec, task: StageTask) -> StageTask:
        """The task as a job of this executor runs it: with its time limit (stages/preemption.py
        tells the signal of a time-out from a preemption by it)."""
        limit = self.time_limit_min(spec, task.stage)
        return task if limit is None else task.model_copy(update={"time_limit_min": limit})

    def check_validate(self, spec: PipelineSpec) -> None:  # noqa: B027 -- a hook: nothing to check by default
        """What `validate` can check here of where the stages will run; raises InvalidInput."""

    @abstractmethod
    def check_before_run(self, spec: PipelineSpec, force: bool, refuse_live: Callable[[], None],
                         echo) -> list | None:
        """The checks `run` makes before it locks the run folder, in this executor's order,
        `refuse_live` (a live chain on the folder) among them; returns the plan of every stage
        (None when `force` runs a pipeline the planner cannot estimate)."""

    @abstractmethod
    def submit(self, spec: PipelineSpec, planned: list[PlannedStage], config: str, echo) -> dict[str, str]:
        """Run or submit every planned stage that is not skipped, recording each in pipeline.json;
        returns stage -> job id of the jobs left queued or running. The caller holds the lock."""

    @abstractmethod
    def say_done(self, spec: PipelineSpec, planned: list[PlannedStage], jobs: dict[str, str], target: str) -> None:
        """What `run` prints last: the results, or the jobs submitted and how to follow them."""

    # What `look` found of a job is each executor's own type (a Slurm JobInfo, a local process's):
    # Any here, so each executor's methods take the type its `look` returns.
    def look(self, job_ids: list[str]) -> dict[str, Any]:
        """What the scheduler knows of each job now; a job it does not know is absent."""
        return {}

    def is_live(self, seen: Any) -> bool:
        """A job (as `look` saw it) that may still run."""
        return seen is not None and seen.live

    @abstractmethod
    def stage_status(self, task: StageTask, record: state.StageRecord, seen: Any,
                     run_state: state.RunState, running: state.Holder | None) -> state.StageStatus:
        """The status of an unfinished stage recorded as a job of this executor: `seen` is what
        `look` found of it, `running` the `run` holding the folder now."""

    def note_finished(self, status: state.StageStatus, seen: Any) -> None:  # noqa: B027 -- a hook
        """Add what the scheduler knows of a finished stage's job to its status."""

    def stop_run(self, running: state.Holder, pipeline: str) -> int | None:
        """`cancel` of a `run` of this executor that holds the run folder: its exit code once
        stopped; None when that run only submits (its live jobs are cancelled instead)."""
        return None

    def cancel(self, job_ids: list[str]) -> None:  # noqa: B027 -- a hook: no jobs to cancel by default
        """Cancel live jobs."""

    def wait_until_ended(self, job_ids: list[str], timeout_s: float) -> list[str]:
        """Wait until the jobs have ended; returns those still live at the deadline."""
        return []

    @abstractmethod
    def measure_node(self, spec: PipelineSpec, measure: Callable, asked, echo) -> dict:
        """`calibrate`: `measure(asked)` on a node where the stages would run; what it returns."""

    def deaths(self, record: state.StageRecord) -> list[Failure]:
        """What the scheduler says of the job's tasks that died without recording why (none here)."""
        return []

    def with_log(self, status: state.StageStatus, record: state.StageRecord) -> state.StageStatus:
        """Say why the job failed: the cause its ranks recorded (core/failure.py), or the
        scheduler's word on a task that died without one (`deaths`), and that rank's log. Without
        either, point at the first log that holds a traceback (else rank 0's) and show its last lines."""
        logs = Path(record.logs)
        records = failure.read(runfolder.StageFolder(Path(status.run_dir)), record.job_id)
        if all(r.secondary for r in records):
            recorded = {r.rank for r in records}
            records += [d for d in self.deaths(record) if d.rank not in recorded]
        cause = failure.summary(records)
        if cause is not None:
            if cause not in status.detail:  # a local run's record already says it
                status.detail = f"{status.detail}: {cause}" if status.detail else cause
            first = failure.explaining(records)
            assert first is not None  # there is a cause, so a record explains it
            status.log = first.log or _text(self.runtime.task_log(logs, record.job_id, first.rank))
            return status
        chosen = self.runtime.task_log(logs, record.job_id, 0)
        for path in self.runtime.task_logs(logs, record.job_id):
            if "Traceback" in path.read_text(errors="replace"):
                chosen = path
                break
        status.log = _text(chosen)
        if chosen is not None and chosen.is_file():
            lines = [line for line in chosen.read_text(errors="replace").splitlines() if line.strip()]
            status.log_tail = lines[-LOG_TAIL_LINES:]
        return status


# --------------------------------------------------------------------------- shared pieces


def check_fits(spec: PipelineSpec, force: bool) -> list | None:
    """The plan of every stage; refuses (exit 3) a stage that does not fit, before anything is
    written or queued. With `force` nothing is refused: a pipeline the planner cannot estimate
    gives None."""
    try:
        plans = plan.plan_pipeline(spec, plan.known_rows(spec))
    except PipelineError:
        if force:
            return None
        raise
    if not force:
        plan.raise_if_not_fits(plans)
    return plans


def write_spec(task: StageTask) -> None:
    """spec.json: the resolved task, so a person (or slurm/stage.sbatch) can see and re-run it."""
    task.folder.path.mkdir(parents=True, exist_ok=True)
    payload = {"spec_hash": task.spec_hash, "task": task.model_dump(mode="json", by_alias=True)}
    task.folder.spec.write_text(json.dumps(payload, indent=2) + "\n")


def announce(executor: Executor, spec: PipelineSpec, item: PlannedStage, echo) -> StageTask | None:
    """Say what happens to a stage; None when it is skipped. Writes spec.json for the others:
    the task as the executor's job runs it, which is returned."""
    task = item.task
    if item.action == "skip":
        echo(f"[{task.name}] finished earlier with the same spec: skipped ({task.run_dir})")
        return None
    if item.moved_aside:
        echo(f"[{task.name}] runs again: {item.reason}; previous outputs moved to {item.moved_aside}")
    task = executor.job_task(spec, task)
    write_spec(task)
    return task


def run_state_of(spec: PipelineSpec, config: str) -> state.RunState:
    """pipeline.json as it is, or a new one."""
    return state.load(spec.run_dir.resolve()) or state.RunState(pipeline=spec.name, config=config)


def exports(env: dict) -> list[str]:
    """Shell lines that export `env` (the setup lines of a job)."""
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)
