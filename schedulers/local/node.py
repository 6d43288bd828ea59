"""A task of a local stage job: submitit's LocalExecutor names it in SUBMITIT_LOCAL_* variables.

Each task runs under stages/supervise.py, which records a task that dies without a word; one
that exits with REQUEUE_EXIT_CODE has asked to be started again (submitit's handler on rank 0,
at the requeue signal), and submitit starts every task of the job again."""

from __future__ import annotations

import os

from schedulers.submitit_tasks import SubmititTask

REQUEUE_EXIT_CODE = 144  # submitit's LocalExecutor: the task asks to be started again


class LocalTask(SubmititTask):
    requeue_exit_code = REQUEUE_EXIT_CODE

    @classmethod
    def active(cls) -> bool:
        return "SUBMITIT_LOCAL_JOB_ID" in os.environ

    def rank(self) -> int:
        value = os.environ.get("SUBMITIT_LOCAL_GLOBALID", "")
        return int(value) if value.isdigit() else 0

    def job_id(self) -> str | None:
        return os.environ.get("SUBMITIT_LOCAL_JOB_ID") or None
