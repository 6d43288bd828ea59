"""A task of a Slurm job: Slurm names it in SLURM_* variables.

Two ways a stage's tasks start on Slurm: as a submitit job (`run` submits those; submitit knows
the layout and requeues at USR2), or under a plain srun of a batch script a person wrote
(slurm/stage.sbatch: its trap passes USR2 on to the tasks and requeues the job itself).
"""

from __future__ import annotations

import os
import re
import signal

from schedulers.base import Layout, Runtime
from schedulers.submitit_tasks import SubmititTask


class SlurmTask(Runtime):
    """What Slurm tells every task of a job."""

    def rank(self) -> int:
        value = os.environ.get("SLURM_PROCID", "")
        return int(value) if value.isdigit() else 0

    def job_id(self) -> str | None:
        return os.environ.get("SLURM_JOB_ID") or None

    def restart_count(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


class SlurmSubmititTask(SlurmTask, SubmititTask):
    """A task of a submitit job on Slurm: what `run` submits."""

    @classmethod
    def active(cls) -> bool:
        return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


class SrunTask(SlurmTask):
    """A task of a plain srun: the master is the job's first host, the port follows the job id."""

    via = "srun"
    requeue_signal = signal.SIGUSR2  # what slurm/stage.sbatch's trap passes on to its tasks

    @classmethod
    def active(cls) -> bool:
        return "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ

    def layout(self) -> Layout | None:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return None  # srun started a launcher (torchrun), which said who this process is
        world = int(os.environ["SLURM_NTASKS"])
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", 1)))
        return Layout(
            int(os.environ["SLURM_PROCID"]),
            world,
            int(os.environ.get("SLURM_LOCALID", 0)),
            world // nodes,
            os.environ.get("MASTER_ADDR") or first_host(os.environ["SLURM_JOB_NODELIST"]),
            int(os.environ.get("MASTER_PORT", 20000 + int(os.environ["SLURM_JOB_ID"]) % 40000)),
        )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: gpu[003-004,007],cpu1 -> gpu003."""
    match = re.match(r"([^,\[]+)(?:\[([^\]\-,]+))?", nodelist)
    if match is None:
        raise ValueError(f"cannot read the Slurm node list '{nodelist}'")
    return match.group(1) + (match.group(2) or "")
