"""Submitting stages as submitit jobs.

Local executor: one job at a time on this machine (submitit's LocalExecutor,
one process per task), its rank-0 log streamed to the console, the next stage
submitted when the previous one succeeded.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from pipeline.config import PipelineSpec, slurm_time_to_minutes
from pipeline.errors import StageFailed
from pipeline.graph import SPEC_FILE, PlannedStage, StageTask

POLL_S = 0.5


def write_spec(task: StageTask) -> None:
    """spec.json: the resolved task, so a person (or slurm/stage.sbatch) can see and re-run it."""
    run_dir = Path(task.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"spec_hash": task.spec_hash, "task": task.model_dump(mode="json", by_alias=True)}
    (run_dir / SPEC_FILE).write_text(json.dumps(payload, indent=2) + "\n")


def job_setup_lines(spec: PipelineSpec) -> list[str]:
    return list(spec.cluster.setup) + [f"export {k}={shlex.quote(v)}" for k, v in spec.cluster.env.items()]


def run_local(spec: PipelineSpec, planned: list[PlannedStage], echo=print) -> None:
    """Run the stages one after another on this machine; raises StageFailed."""
    import submitit

    from stages.runner import StageJob

    for item in planned:
        task = item.task
        if item.action == "skip":
            echo(f"[{task.name}] finished earlier with the same spec: skipped ({task.run_dir})")
            continue
        if item.moved_aside:
            echo(f"[{task.name}] the spec changed: previous outputs moved to {item.moved_aside}")
        write_spec(task)
        executor = submitit.LocalExecutor(folder=Path(task.run_dir) / "logs")
        executor.update_parameters(
            timeout_min=slurm_time_to_minutes(task.stage.time or spec.cluster.time),
            tasks_per_node=task.processes_per_node,
            setup=job_setup_lines(spec),
        )
        job = executor.submit(StageJob(task))
        verb = "resuming" if item.action == "resume" else "running"
        echo(f"[{task.name}] {verb} {task.stage.kind} as local job {job.job_id} "
             f"({task.processes_per_node} processes); log: {job.paths.stdout}")
        try:
            _follow(job, echo)
        except KeyboardInterrupt:
            job.cancel()
            raise
        if job.state != "FINISHED" or job.exception() is not None:
            raise StageFailed(failure_message(task.name, job))
        echo(f"[{task.name}] done: {Path(task.run_dir) / 'result.json'}")


def _follow(job, echo) -> None:
    """Print rank 0's new log lines until the job ends."""
    position = 0
    while True:
        finished = job.done()
        path = Path(job.paths.stdout)
        if path.exists():
            with open(path) as f:
                f.seek(position)
                chunk = f.read()
                position = f.tell()
            for line in chunk.splitlines():
                echo(f"    {line}")
        if finished:
            return
        time.sleep(POLL_S)


def failure_message(stage: str, job) -> str:
    err_path = Path(job.paths.stderr)
    tail = ""
    if err_path.exists():
        lines = [line for line in err_path.read_text(errors="replace").splitlines() if line.strip()]
        tail = "\n".join("    " + line for line in lines[-15:])
    return f"stage {stage} failed (job {job.job_id}, state {job.state}); log: {err_path}\n{tail}"


def default_echo(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
