"""A task of a fake job: who it is, from the variables the fake executor sets (submit.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from schedulers.base import Layout, Runtime

RANK, TASKS, JOB, STARTS, PORT = ("FAKE_SCHEDULER_RANK", "FAKE_SCHEDULER_TASKS", "FAKE_SCHEDULER_JOB",
                                  "FAKE_SCHEDULER_STARTS", "FAKE_SCHEDULER_PORT")
REQUEUE_EXIT_CODE = 75  # rank 0 exits with it to have the job started again


class FakeTask(Runtime):
    via = "fake"
    requeue_signal = signal.SIGXCPU
    requeue_exit_code = REQUEUE_EXIT_CODE

    @classmethod
    def active(cls) -> bool:
        return JOB in os.environ

    def rank(self) -> int:
        return int(os.environ[RANK])

    def job_id(self) -> str | None:
        return os.environ[JOB]

    def restart_count(self) -> int:
        return int(os.environ[STARTS])

    def layout(self) -> Layout:
        tasks = int(os.environ[TASKS])
        return Layout(self.rank(), tasks, self.rank(), tasks, "127.0.0.1", int(os.environ[PORT]))

    @classmethod
    def task_log(cls, logs: Path, job_id: str | None, rank: int) -> Path | None:
        return logs / f"fake-{job_id}.rank{rank}.err"

    @classmethod
    def task_logs(cls, logs: Path, job_id: str) -> list[Path]:
        return sorted(logs.glob(f"fake-{job_id}.rank*.err"))

    @classmethod
    def job_started(cls, logs: Path) -> bool:
        return any(logs.glob("fake-*.rank*.err"))
