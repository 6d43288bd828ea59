"""From a validated pipeline to the list of stage tasks to submit, in order.

Each stage's outputs live in <runs_dir>/<pipeline>/<stage>/. A stage whose
result.json carries the same spec hash is finished and skipped; a stage whose
folder holds the outputs of a different spec has them moved aside (never
deleted) and starts over; anything else is (re)submitted, and the stage itself
resumes from its newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from pipeline.config import PipelineSpec, Stage, topological_order
from pipeline.runfolder import StageFolder

# Fields that change how a stage is run or logged, not what it produces.
OPERATIONAL_FIELDS = {"time", "log_interval", "save_interval", "keep_checkpoints", "eval_interval", "nodes"}


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
    spec_hash: str

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def folder(self) -> StageFolder:
        return StageFolder(Path(self.run_dir))


class PlannedStage(BaseModel):
    task: StageTask
    action: Literal["skip", "run", "resume"]
    moved_aside: Optional[str] = None


def stage_hash(stage, upstream_hashes: list[str], init_model: str) -> str:
    spec = stage.model_dump(mode="json", by_alias=True, exclude=OPERATIONAL_FIELDS)
    blob = json.dumps({"spec": spec, "upstream": upstream_hashes, "init": init_model}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tasks(spec: PipelineSpec) -> list[StageTask]:
    """Stage tasks in run order, upstream model folders filled in."""
    pipeline_dir = spec.run_dir.resolve()
    hashes: dict[str, str] = {}
    tasks = []
    for stage in topological_order(spec.stages):
        upstream_dirs = {up: str(StageFolder.of(pipeline_dir, up).model) for up in stage.upstream}
        if stage.from_:
            init_model = upstream_dirs[stage.from_]
        elif Path(stage.model).expanduser().exists():
            init_model = str(Path(stage.model).expanduser().resolve())
        else:
            init_model = stage.model  # a hub id or builtin:NAME
        digest = stage_hash(stage, [hashes[u] for u in stage.upstream], stage.model or "")
        hashes[stage.name] = digest
        tasks.append(
            StageTask(
                pipeline=spec.name,
                stage=stage,
                run_dir=str(pipeline_dir / stage.name),
                pipeline_dir=str(pipeline_dir),
                init_model=init_model,
                upstream_dirs=upstream_dirs,
                processes_per_node=spec.cluster.processes_per_node,
                gpus_per_node=spec.cluster.gpus_per_node,
                spec_hash=digest,
            )
        )
    return tasks


def is_finished(task: StageTask) -> bool:
    result = task.folder.result
    if not result.is_file():
        return False
    try:
        return json.loads(result.read_text()).get("spec_hash") == task.spec_hash
    except (json.JSONDecodeError, OSError):
        return False


def plan_actions(tasks: list[StageTask], dry_run: bool = False) -> list[PlannedStage]:
    """What to do with each stage; moves stale outputs aside unless dry_run."""
    planned = []
    rerun: set[str] = set()
    for task in tasks:
        upstream_rerun = any(u in rerun for u in task.upstream_dirs)
        if is_finished(task) and not upstream_rerun:
            planned.append(PlannedStage(task=task, action="skip"))
            continue
        rerun.add(task.name)
        run_dir = Path(task.run_dir)
        recorded = recorded_hash(run_dir)
        if recorded is None and not run_dir.exists():
            planned.append(PlannedStage(task=task, action="run"))
        elif recorded == task.spec_hash:
            planned.append(PlannedStage(task=task, action="resume"))
        else:
            aside = None if dry_run else str(_move_aside(run_dir))
            planned.append(PlannedStage(task=task, action="run", moved_aside=aside))
    return planned


def recorded_hash(run_dir: Path) -> Optional[str]:
    """The spec hash spec.json records for a stage folder; None without one."""
    try:
        return json.loads(StageFolder(run_dir).spec.read_text()).get("spec_hash")
    except (OSError, json.JSONDecodeError):
        return None


def _move_aside(run_dir: Path) -> Path:
    target = StageFolder(run_dir).superseded()
    run_dir.rename(target)
    return target
