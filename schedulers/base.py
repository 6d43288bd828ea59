"""What a scheduler declares, and what a task of one of its jobs asks it (its node half).

A scheduler is one package under schedulers/ with two halves, as submitit splits an executor
from its JobEnvironment:
- the node half, a `Runtime` (the package's node.py): who a process is as a task of one of
  the scheduler's jobs, read from what the scheduler put in its environment: its rank and the
  job's layout, the job's id and how often it was started before, the signal the scheduler
  sends a job that is to save, requeue and resume, and where a task's log goes. Torch-free, and
  it imports nothing of the project: core's failure records and timeline and the stages ask it.
- the submit half, an Executor (pipeline/executors/base.py) in the package's submit.py: the
  checks before a run, submission, a job's state, cancel. It stands above the orchestrator and
  is reached only through the declaration, by its module's name.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class Layout:
    """Where a task sits in its job, as torch's env:// rendezvous needs it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


class Runtime:
    """Who this process is as a task of a job of one scheduler. A subclass reads its scheduler's
    environment; `active` says whether this process is such a task."""

    via: ClassVar[str]  # how the stage's rank line names what started it, e.g. "submitit"
    # What the scheduler sends a job that is to save a checkpoint, requeue and resume: the stage's
    # training loop catches it (stages/preemption.py), and its processes' helpers leave it to the stage.
    requeue_signal: ClassVar[signal.Signals]
    # A task that exits with this code asks its scheduler to start it again (not a death); None: no such code.
    requeue_exit_code: ClassVar[int | None] = None

    @classmethod
    def active(cls) -> bool:
        """This process is a task of a job of this scheduler."""
        raise NotImplementedError

    def rank(self) -> int:
        """This task's global rank, before torch.distributed is up."""
        raise NotImplementedError

    def job_id(self) -> str | None:
        raise NotImplementedError

    def restart_count(self) -> int:
        """How many times the scheduler started this job before, the same in every task."""
        return 0

    def layout(self) -> Layout | None:
        """The job's layout; None when a launcher inside the job (torchrun) started this process
        and its variables say it."""
        raise NotImplementedError

    @classmethod
    def task_log(cls, logs: Path, job_id: str | None, rank: int) -> Path | None:
        """Where task `rank` of job `job_id` writes its stderr, in the stage's logs folder; None
        where the scheduler does not say (the person who submitted the job named it)."""
        return None

    @classmethod
    def task_logs(cls, logs: Path, job_id: str) -> list[Path]:
        """Every task's stderr log of job `job_id` in `logs`, by rank."""
        return []

    @classmethod
    def job_started(cls, logs: Path) -> bool:
        """Whether a task of a job of this scheduler ever started with `logs` as its logs folder
        (before that, the folder holds at most what submitting the job wrote)."""
        return False

    def leftovers(self, logs: Path) -> list[Path]:
        """Files the scheduler's wrapper of this task may leave half-written when the task ends
        without the interpreter's teardown (stages/runner.py removes them first)."""
        return []

    def hush_requeue(self) -> None:
        """Keep the scheduler's wrapper from calling the next requeue a preemption in the log (the
        hang watchdog says what it is)."""


@dataclass(frozen=True)
class Scheduler:
    """One scheduler, as its package declares it (schedulers.register)."""

    name: str  # cluster.executor in the pipeline file; `executor` in pipeline.json's records
    executor: str  # its submit half, "package.module:Class" (an Executor), imported when it is asked for
    runtimes: tuple[type[Runtime], ...]  # its node half: the first active one is who a task is
    # Checks of the cluster section's fields it reads, by field name: each raises ValueError on a
    # value it cannot use. They apply whichever executor the file names (`run --executor` picks another).
    cluster_rules: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
