"""The Slurm scheduler: each stage one Slurm job, the chain submitted at once, chained by afterok.

node.py: who a task is (a submitit job's, or a task of a plain srun: slurm/stage.sbatch);
submit.py: the executor; jobs.py: what Slurm says of its jobs (scontrol, sacct, srun's lines).
Here: its declaration, and its rules for the pipeline file's cluster section: `time` in Slurm's
syntax, and no `sbatch` option the executor sets itself.
"""

from __future__ import annotations

import re

import schedulers
from schedulers.base import Scheduler
from schedulers.slurm.node import SlurmSubmititTask, SrunTask

TIME_SYNTAX = re.compile(r"^(?:(\d+)-)?(\d+(?::\d+){0,2})$")

# The sbatch options the executor sets itself (submit.py), and the pipeline file's field for each.
SET_BY_PIPELINE = {
    "partition": "use cluster.partition",
    "account": "use cluster.account",
    "qos": "use cluster.qos",
    "constraint": "use cluster.constraint",
    "time": "use cluster.time or the stage's time",
    "nodes": "use the stage's nodes",
    "ntasks-per-node": "use cluster.tasks_per_node or cluster.gpus_per_node",
    "gpus-per-node": "use cluster.gpus_per_node",
    "cpus-per-task": "use cluster.cpus_per_task",
    "mem": "use cluster.mem",
    "signal": "use cluster.requeue_signal_s",
    "dependency": "each stage waits for the stages it starts from",
    "kill-on-invalid-dep": "a stage whose upstream failed is always cancelled",
    "job-name": "jobs are named <pipeline>.<stage>",
    "ntasks": "use cluster.tasks_per_node or cluster.gpus_per_node",
    "requeue": "stage jobs are always requeueable: they resume from their newest checkpoint",
    "no-requeue": "stage jobs are always requeueable: they resume from their newest checkpoint",
    "array": "each stage is one job",
    "output": "logs go to runs/<pipeline>/<stage>/logs/",
    "error": "logs go to runs/<pipeline>/<stage>/logs/",
    "open-mode": "logs are appended to, so a requeued job keeps its earlier lines",
}


def time_to_minutes(value: str) -> int:
    """Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (rounded up to minutes)."""
    match = TIME_SYNTAX.match(str(value).strip())
    if not match:
        raise ValueError(f"'{value}' is not a Slurm time (e.g. 90, 4:00:00, 2-00:00:00)")
    days = int(match.group(1) or 0)
    parts = [int(p) for p in match.group(2).split(":")]
    if match.group(1) is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:  # M, M:S, H:M:S
        hours, minutes, seconds = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    total = days * 24 * 60 + hours * 60 + minutes + (1 if seconds else 0)
    if total <= 0:
        raise ValueError(f"'{value}' is no time at all")
    return total


def check_sbatch_options(options: dict) -> None:
    """cluster.sbatch: long option names, none that the executor sets itself."""
    for key in options:
        if not re.match(r"^[a-z][a-z0-9-]*$", key):
            raise ValueError(f"'{key}' is not an sbatch long option name (e.g. exclusive, reservation)")
        if key in SET_BY_PIPELINE:
            raise ValueError(f"'{key}' is set by the pipeline itself; {SET_BY_PIPELINE[key]}")


SCHEDULER = schedulers.register(Scheduler(
    "slurm", executor="schedulers.slurm.submit:SlurmExecutor", runtimes=(SlurmSubmititTask, SrunTask),
    cluster_rules={"time": time_to_minutes, "sbatch": check_sbatch_options}))
