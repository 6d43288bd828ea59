"""Where the stages run: the one place that maps a name to an executor.

An executor is the submit half of a scheduler (schedulers/: local/ runs the chain on this
machine, slurm/ submits it to Slurm; a plug-in may declare more); base.py says what one
answers. `executor_for` turns the pipeline file's cluster.executor, or a pipeline.json
record's executor, into an executor; `holding` finds the executor of the `run` that holds
a run folder; the functions below go over a run's records, each asking the executor of its
record. Nothing outside the schedulers' packages asks which executor it is.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import schedulers
from core.errors import InvalidInput
from core.task import StageTask, is_finished
from pipeline import state
from pipeline.executors.base import Executor


def executor_class(name: str) -> type[Executor]:
    """The executor of scheduler `name`: its submit half, imported now."""
    try:
        module, _, attribute = schedulers.get(name).executor.partition(":")
    except KeyError as err:
        raise InvalidInput(err.args[0]) from None
    return getattr(importlib.import_module(module), attribute)


def executors() -> dict[str, type[Executor]]:
    """Every executor known now, by its name; the shipped ones first (`calibrate` lists their flags)."""
    return {name: executor_class(name) for name in schedulers.names()}


def executor_for(name: str) -> Executor:
    """The executor the schema's (or a record's) name stands for."""
    return executor_class(name)()


def holding(running: state.Holder | None) -> Executor | None:
    """The executor of the `run` holding the run folder's lock, by what it says it is doing;
    None when no `run` holds it (or one that has not said yet)."""
    if running is None:
        return None
    return next((cls() for cls in executors().values() if cls.doing == running.doing), None)


@dataclass(frozen=True)
class LiveJob:
    """A recorded job that may still run."""

    stage: str
    job_id: str
    state: str  # as its scheduler calls it (e.g. PENDING, RUNNING)
    executor: Executor


def _seen(run_state: state.RunState | None) -> dict[str, Any]:
    """stage -> what the executor of its recorded job knows of that job now (absent: nothing),
    one question per executor."""
    if run_state is None:
        return {}
    jobs: dict[str, dict[str, str]] = {}  # executor -> stage -> job id
    for name, record in run_state.stages.items():
        jobs.setdefault(record.executor, {})[name] = record.job_id
    seen: dict[str, Any] = {}
    for executor, stages in jobs.items():
        found = executor_for(executor).look(list(stages.values()))
        seen.update({name: found[job] for name, job in stages.items() if job in found})
    return seen


def live_jobs(run_state: state.RunState | None) -> list[LiveJob]:
    """Every recorded job that is still pending or running."""
    if run_state is None:
        return []
    seen = _seen(run_state)
    live = []
    for name, info in seen.items():
        executor = executor_for(run_state.stages[name].executor)
        if executor.is_live(info):
            live.append(LiveJob(name, info.job_id, info.state, executor))
    return live


def refuse_if_live(pipeline_dir: Path, config: str, tasks: list[StageTask]) -> None:
    """A second chain on the same run folder would train two jobs into one folder.

    A job whose stage already wrote its result is only exiting: it does not count."""
    finished = {(t.name, t.spec_hash) for t in tasks if is_finished(t)}
    run_state = state.load(pipeline_dir)
    if run_state is None:  # nothing recorded: nothing live
        return
    live = [job for job in live_jobs(run_state) if (job.stage, run_state.stages[job.stage].spec_hash) not in finished]
    if live:
        jobs = ", ".join(f"{job.stage} (job {job.job_id}, {job.state})" for job in live)
        raise InvalidInput(
            f"a chain of this pipeline is still live on {pipeline_dir}: {jobs}. "
            f"Follow it with `python -m pipeline status {config}`, or stop it with "
            f"`python -m pipeline cancel {config}` before running again."
        )


def cancel(live: list[LiveJob]) -> None:
    for executor, ids in _by_executor(live):
        executor.cancel(ids)


def wait_until_ended(live: list[LiveJob], timeout_s: float) -> list[str]:
    """Wait until the jobs have ended; returns the ids of those still live after `timeout_s`."""
    return [job for executor, ids in _by_executor(live) for job in executor.wait_until_ended(ids, timeout_s)]


def _by_executor(live: list[LiveJob]) -> list[tuple[Executor, list[str]]]:
    groups: dict[str, tuple[Executor, list[str]]] = {}
    for job in live:
        groups.setdefault(job.executor.name, (job.executor, []))[1].append(job.job_id)
    return list(groups.values())


def stage_statuses(tasks: list[StageTask], run_state: state.RunState | None,
                   running: state.Holder | None = None) -> list[state.StageStatus]:
    """Each stage's state: its folder first (finished?), then what the executor of its recorded
    job says (`running`: the `run` holding the folder now), then the record."""
    records = run_state.stages if run_state else {}
    seen = _seen(run_state)
    statuses = []
    for task in tasks:
        record = records.get(task.name)
        executor = executor_for(record.executor) if record is not None else None
        info = seen.get(task.name)
        if is_finished(task):
            status = state.StageStatus(task.name, state.FINISHED, state.result_summary(task), task.run_dir)
            if executor is not None and record is not None and record.spec_hash == task.spec_hash:
                executor.note_finished(status, info)
        elif record is None or executor is None or (record.spec_hash != task.spec_hash
                                                    and not executor.is_live(info)):
            status = state.from_folder(task)
        else:
            assert run_state is not None  # it holds the record
            status = executor.stage_status(task, record, info, run_state, running)
        if record is not None and status.job_id is None and record.spec_hash == task.spec_hash:
            status.job_id = record.job_id
        statuses.append(status)
    return statuses
