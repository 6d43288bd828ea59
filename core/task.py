"""What a stage job is handed: its task (the validated stage spec and where things are), and
the environment the run's own process names itself in. Built by pipeline/graph.py on the submit
host, handed to its scheduler (schedulers/), read by stages/runner.py on the node. No YAML, no torch."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from core.config import Stage, WandbSpec
from core.runfolder import StageFolder

# The local run's own process id, given to each stage job: the job's supervisor stops the stage
# when that process is gone (a run stopped hard leaves no orphaned training).
RUN_PID_ENV = "PIPELINE_RUN_PID"


class StageTask(BaseModel):
    """Everything a stage needs on the node: its spec and where things are. No YAML."""

    model_config = ConfigDict(frozen=True)

    pipeline: str
    stage: Stage
    run_dir: str
    pipeline_dir: str
    init_model: str
    upstream_dirs: dict[str, str]
    processes_per_node: int
    gpus_per_node: int  # asked for: a job that finds none fails rather than train on the CPU
    cpus_per_task: int | None = None  # cluster.cpus_per_task: a CPU stage's torch threads per process
    inputs: dict[str, dict] = {}  # field -> {path, sha256}: what it reads from disk (pipeline/identity.py)
    spec_hash: str
    wandb: WandbSpec | None = None  # the pipeline's tracking.wandb: how not what the stage trains
    max_retries: int = 2  # cluster.max_retries: requeues after a hang (stages/watchdog.py) or a node failure
    time_limit_min: int | None = None  # the job's time limit where its executor sets one (Slurm); else None

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def folder(self) -> StageFolder:
        return StageFolder(Path(self.run_dir))


def is_finished(task: StageTask) -> bool:
    """Its result.json carries this task's spec hash: the stage ran to the end with these inputs."""
    result = task.folder.result
    if not result.is_file():
        return False
    try:
        return json.loads(result.read_text()).get("spec_hash") == task.spec_hash
    except (json.JSONDecodeError, OSError):
        return False
