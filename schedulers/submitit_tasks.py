"""What the shipped schedulers share because each runs its jobs through submitit.

Both the local and the Slurm scheduler hand a stage job to a submitit executor, which pickles
it, starts one process per task through `python -m submitit.core._submit`, and installs its own
handler on USR2 in each: on rank 0 it asks the job what to run again (`checkpoint`), saves that,
requeues the job (`scontrol requeue`; locally, exit code 144) and exits; on the other ranks it
only logs. submitit names each task's files in the job's folder <job>_<task>_log.out / _log.err
/ _result.pkl, and knows the job's layout (one task per GPU, the first host the master).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from schedulers.base import Layout, Runtime

TASK_FILES = ("_log.out", "_log.err", "_result.pkl")  # what a started task writes; submitting writes others


class SubmititTask(Runtime):
    """A task of a submitit job (the local or the Slurm executor's)."""

    via = "submitit"
    requeue_signal = signal.SIGUSR2  # submitit's preemption signal

    def layout(self) -> Layout:
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return Layout(env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_addr,
                      env.master_port)

    @classmethod
    def task_log(cls, logs: Path, job_id: str | None, rank: int) -> Path | None:
        if job_id is None:
            return None
        from submitit.core.utils import JobPaths

        return Path(JobPaths(logs, job_id, rank).stderr)

    @classmethod
    def task_logs(cls, logs: Path, job_id: str) -> list[Path]:
        return sorted(logs.glob(f"{job_id}_*_log.err"), key=lambda path: _task_index(path, job_id))

    @classmethod
    def job_started(cls, logs: Path) -> bool:
        return any(p.name.endswith(TASK_FILES) for p in logs.iterdir())

    def leftovers(self, logs: Path) -> list[Path]:
        from submitit.core.utils import JobPaths

        result = JobPaths(logs, self.job_id(), self.rank()).result_pickle
        return [Path(f"{result}.save_tmp")]  # submitit's temporary name, renamed once written

    def hush_requeue(self) -> None:
        logging.getLogger("submitit").disabled = True  # it would log "this job is preempted"


def _task_index(path: Path, job_id: str) -> int:
    try:
        return int(path.name[len(job_id) + 1:].split("_")[0])
    except ValueError:
        return 1 << 30


class SubmititJob:
    """A stage job as submitit runs it: called in every task. At the requeue signal submitit's
    handler on rank 0 asks `checkpoint` what to run again: the same job, which resumes from the
    stage's newest checkpoint; the job notes why first (`requeueing`)."""

    def __init__(self, job: Any):
        self.job = job

    def __call__(self) -> Any:
        return self.job()

    def checkpoint(self, *args, **kwargs):
        from submitit.helpers import DelayedSubmission

        self.job.requeueing(SubmititTask.requeue_signal.name)
        return DelayedSubmission(SubmititJob(self.job))
