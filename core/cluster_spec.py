"""The pipeline file's `cluster:` and `apptainer:` sections: where and how the stages run. What a
scheduler accepts (Slurm's time syntax, the sbatch options it sets itself) is its own (schedulers/)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

import schedulers
from core.strict import Strict

# Environment variables that hold credentials (HF_TOKEN, WANDB_API_KEY, ...): read from the
# environment only, never written into a file the pipeline makes.
SECRET_NAME = re.compile(r"TOKEN|API_KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def checked_by_schedulers(field: str, value: Any) -> Any:
    """`value` of the cluster section's `field` (a stage's `time` too), checked by every scheduler
    that reads it (schedulers/: Slurm's time syntax, the sbatch options it sets itself), whichever
    executor the file names: `run --executor` may pick another."""
    for scheduler in schedulers.declared():
        rule = scheduler.cluster_rules.get(field)
        if rule is not None:
            rule(value)
    return value


# The executor of a pipeline.json record that names none: records were all Slurm jobs before local
# runs were recorded.
UNNAMED_RECORD_EXECUTOR = "slurm"


class ClusterSpec(Strict):
    """Where and how the stages run."""

    executor: str = Field(
        "local",
        description="'local' runs each stage on this machine (as submitit local jobs); "
        "'slurm' submits each stage as a Slurm job; a scheduler a plug-in declares runs them its way "
        "(schedulers/).",
    )
    partition: str | None = Field(None, description="Slurm partition (sbatch --partition).")
    account: str | None = Field(None, description="Slurm account (sbatch --account).")
    qos: str | None = Field(None, description="Slurm quality of service (sbatch --qos).")
    constraint: str | None = Field(None, description="Slurm node features (sbatch --constraint).")
    gpu: str | None = Field(
        None, description="GPU type of the nodes (e.g. a100-80gb, h100-80gb, rtx4090), used to plan memory."
    )
    gpus_per_node: int = Field(
        0,
        ge=0,
        le=16,
        description="GPUs per node; each stage runs one process (task) per GPU, each on its own GPU. The local "
        "executor takes them from this machine (from CUDA_VISIBLE_DEVICES when it is set); validate and run "
        "refuse more than torch sees here.",
    )
    tasks_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Processes per node. Defaults to gpus_per_node, or 1 without GPUs; "
        "set it to run several CPU processes (e.g. 2, so ZeRO really shards on CPU).",
    )
    cpus_per_task: int | None = Field(
        None, ge=1, description="CPU cores per process (sbatch --cpus-per-task). A stage on the CPU computes with this "
        "many torch threads per process (1 when unset), whatever the machine's core count: the thread count changes "
        "its numbers.")
    mem: str | None = Field(
        None, pattern=r"^\d+[KMGT]?$", description="Host memory per node, Slurm syntax (e.g. 500G, 0 = all)."
    )
    time: str = Field("4:00:00", description="Wall-clock limit per stage job on Slurm, Slurm syntax (e.g. "
                      "2-00:00:00). Local runs have no time limit.")
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run in the job before the stage starts (e.g. module load ...)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables set for every stage job.")
    sbatch: dict[str, str | int | bool] = Field(
        default_factory=dict,
        description="Extra sbatch options for every stage job, by long name without dashes "
        "(e.g. {exclusive: true, reservation: my-res, gres: 'gpu:8'}); true writes a bare flag.",
    )
    requeue_signal_s: int | None = Field(
        None,
        ge=10,
        le=3600,
        description="Seconds before a stage job's time limit at which Slurm sends it USR2: the job saves "
        "a checkpoint at the end of its current step, requeues itself and resumes from there. Default: "
        "from the plan's estimated checkpoint save and step times, plus a margin (at least 90).",
    )
    max_requeues: int = Field(
        3,
        ge=0,
        le=100,
        description="How many times a stage job that reaches its time limit is requeued before it counts "
        "as failed (preemptions do not count, except in jobs shorter than 10 minutes).",
    )
    max_retries: int = Field(
        2, ge=0, le=100, description="How many times a stage job that hangs (see hang_factor), or that Slurm "
        "requeues after its node failed, is started again before it fails.")
    hf_home: str | None = Field(
        None,
        description="Hugging Face cache folder shared by the submit host and the compute nodes: `prepare` "
        "downloads hub models and datasets into it, Slurm jobs read it offline. Default: $HF_HOME, "
        "else ~/.cache/huggingface.",
    )

    @field_validator("executor")
    @classmethod
    def _known_executor(cls, value: str) -> str:
        """One of the schedulers (schedulers/: the shipped ones, and those plug-ins declare)."""
        try:
            schedulers.get(value)
        except KeyError as err:
            raise ValueError(err.args[0]) from None
        return value

    @field_validator("time", "sbatch")
    @classmethod
    def _check_for_schedulers(cls, value, info):
        return checked_by_schedulers(info.field_name, value)

    @field_validator("env")
    @classmethod
    def _no_secrets_in_env(cls, value: dict) -> dict:
        for key in value:
            if SECRET_NAME.search(key):
                raise ValueError(
                    f"'{key}' looks like a secret, and cluster.env is written into every job's batch script: "
                    f"export {key} in your shell instead (stage jobs inherit the environment they are submitted from)"
                )
        return value

    @property
    def processes_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node or 1


class ApptainerSpec(Strict):
    """How a Slurm stage job runs inside `container`."""

    command: str = Field("apptainer", min_length=1, description="The container runtime: apptainer, or singularity.")
    binds: list[str] = Field(
        default_factory=list,
        description="Extra folders to bind (apptainer --bind syntax, SRC[:DEST[:ro]]). Already bound: the "
        "folder you run from, the run folder, local data and model folders, the Hugging Face cache and this code.",
    )
    options: list[str] = Field(
        default_factory=list,
        description="Extra `apptainer exec` options, e.g. [--writable-tmpfs]. Avoid --cleanenv: "
        "the job needs Slurm's environment variables. --nv is added when GPUs are requested.",
    )
