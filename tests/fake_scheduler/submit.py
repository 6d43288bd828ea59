"""The fake scheduler's executor: each stage's tasks as plain subprocesses of the `run`, one stage
after another, the job started again while its rank 0 asks for it (REQUEUE_EXIT_CODE).

With FAKE_SCHEDULER_PREEMPT_AFTER_STEP=N in the `run`'s environment it preempts each job once,
as a scheduler would before a time limit: its requeue signal to every task once the stage has
logged training step N."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

from core.errors import InvalidInput, StageFailed
from core.task import StageTask
from pipeline import state
from pipeline.executors.base import Executor, announce, check_fits, run_state_of
from tests.fake_scheduler import node

PREEMPT_ENV = "FAKE_SCHEDULER_PREEMPT_AFTER_STEP"
MOST_STARTS = 3
POLL_S = 0.05


class FakeExecutor(Executor):
    name = "fake"
    doing = "running it on the fake scheduler"
    calibrate_help = "the fake scheduler measures nothing"
    runtime = node.FakeTask

    def check_before_run(self, spec, force, refuse_live, echo) -> list | None:
        plans = check_fits(spec, force)
        refuse_live()
        return plans

    def submit(self, spec, planned, config, echo) -> dict[str, str]:
        from stages.runner import StageJob

        run_state = run_state_of(spec, config)
        for item in planned:
            task = announce(self, spec, item, echo)
            if task is None:
                continue
            job_id = f"{os.getpid()}-{task.name}"
            record = state.StageRecord(job_id=job_id, executor=self.name, state=state.RUNNING, spec_hash=task.spec_hash,
                                       submitted_at=state.now(), logs=str(task.folder.logs))
            run_state.stages[task.name] = record
            state.save(spec.run_dir.resolve(), run_state)
            echo(f"[{task.name}] running {task.stage.kind} as fake job {job_id}")
            codes = run_job(StageJob(task), task, job_id)
            record.state = state.FINISHED if codes == [0] * len(codes) else state.FAILED
            record.detail = "" if record.state == state.FINISHED else f"exit codes {codes}"
            state.save(spec.run_dir.resolve(), run_state)
            if record.state == state.FAILED:
                raise StageFailed(f"stage {task.name} failed on the fake scheduler ({record.detail})")
        return {}

    def say_done(self, spec, planned, jobs, target) -> None:
        print(f"pipeline '{spec.name}' finished on the fake scheduler")

    def stage_status(self, task, record, seen, run_state, running) -> state.StageStatus:
        return state.StageStatus(name=task.name, state=record.state, detail=record.detail, run_dir=task.run_dir,
                                 job_id=record.job_id, source="record")

    def measure_node(self, spec, measure, asked, echo) -> dict:
        raise InvalidInput(self.calibrate_help)


def run_job(job, task: StageTask, job_id: str) -> list[int]:
    """Start the job's tasks until they end other than by rank 0's requeue; their exit codes."""
    logs = task.folder.logs
    logs.mkdir(parents=True, exist_ok=True)
    job_file = logs / f"fake-{job_id}.job.pkl"
    job_file.write_bytes(pickle.dumps(job))
    preempt_after = os.environ.get(PREEMPT_ENV)
    for start in range(MOST_STARTS):
        port = _free_port()
        tasks = [_start_task(task, job_id, rank, start, port, job_file) for rank in range(task.processes_per_node)]
        codes = _wait(tasks, task.folder.metrics, int(preempt_after) if preempt_after and start == 0 else None)
        if codes[0] != node.REQUEUE_EXIT_CODE:
            return codes
    return codes


def _start_task(task: StageTask, job_id: str, rank: int, start: int, port: int, job_file: Path) -> subprocess.Popen:
    env = {**os.environ, node.RANK: str(rank), node.TASKS: str(task.processes_per_node), node.JOB: job_id,
           node.STARTS: str(start), node.PORT: str(port)}
    err = node.FakeTask.task_log(task.folder.logs, job_id, rank)
    with open(err.with_suffix(".out"), "a") as out, open(err, "a") as errors:
        return subprocess.Popen([sys.executable, "-m", "tests.fake_scheduler.task", str(job_file)], env=env,
                                stdout=out, stderr=errors)


def _wait(tasks: list[subprocess.Popen], metrics: Path, preempt_after: int | None) -> list[int]:
    """Wait for every task; a task that fails takes the others down; the requeue signal to each
    once training has passed step `preempt_after`."""
    while any(t.poll() is None for t in tasks):
        if any(t.returncode not in (None, 0, node.REQUEUE_EXIT_CODE) for t in tasks):
            for t in tasks:
                t.kill()
        if preempt_after is not None and _trained_past(metrics, preempt_after):
            for t in tasks:
                t.send_signal(node.FakeTask.requeue_signal)
            preempt_after = None
        time.sleep(POLL_S)
    return [t.returncode for t in tasks]


def _trained_past(metrics: Path, step: int) -> bool:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "lr" in record and record.get("step", 0) >= step:
            return True
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
