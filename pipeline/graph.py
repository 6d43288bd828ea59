"""From a validated pipeline to the list of stage tasks to submit, in order.

Each stage's outputs live in <runs_dir>/<pipeline>/<stage>/. A stage's spec
hash covers its spec, the content of what it reads (pipeline/identity.py) and its
upstream stages' hashes. A stage whose result.json carries the same spec hash is
finished and skipped; a stage whose folder holds the outputs of a different spec
has them moved aside (never deleted; a folder with nothing but the spec.json and plan.json
of a stage that never started is reused) and starts over, and so does every stage
downstream of one that runs again, or that `run --rerun` names; anything else is
(re)submitted, and the stage itself resumes from its newest checkpoint. Each
decision comes with its reason, which `run` prints.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from core import kinds
from core.config import PipelineSpec
from core.runfolder import StageFolder, remove
from core.stage_graph import topological_order
from core.task import StageTask, is_finished
from pipeline.identity import Digests, changed_inputs, input_digests

# Fields that change how a stage is run or logged, not what it produces (nodes and sequence_parallel
# lay the same work out over other processes, logits_tile and mlp_tiles compute the same loss in pieces;
# tests/test_sequence_parallel.py shows the figures equal).
OPERATIONAL_FIELDS = {"time", "log_interval", "save_interval", "keep_checkpoints", "eval_interval", "nodes",
                      "sequence_parallel", "logits_tile", "mlp_tiles",
                      "max_truncated_share", "hang_factor", "hang_min_s", "hang_first_s",
                      "collective_timeout_s"}
OPERATIONAL_REWARD_FIELDS = {"timeout_s"}  # of an RL stage's reward block (core.schemas.reward.RewardSpec)


class PlannedStage(BaseModel):
    task: StageTask
    action: Literal["skip", "run", "resume"]
    moved_aside: str | None = None
    reason: str = ""  # why it runs again, when it had outputs


def stage_hash(stage, upstream_hashes: list[str], init_model: str, inputs: dict[str, dict]) -> str:
    operational: dict = dict.fromkeys(OPERATIONAL_FIELDS, True)
    rl = kinds.rollouts_of(stage)
    if rl is not None:  # an RL kind's, whatever it calls them (core/kinds.py Rollouts)
        operational[rl.fields.reward] = OPERATIONAL_REWARD_FIELDS
        if rl.fields.allow_weak_reward_model:
            operational[rl.fields.allow_weak_reward_model] = True
    spec = stage.model_dump(mode="json", by_alias=True, exclude=operational)
    content = {field: item["sha256"] for field, item in inputs.items()}
    blob = json.dumps({"spec": spec, "upstream": upstream_hashes, "init": init_model, "inputs": content},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tasks(spec: PipelineSpec, digests: Digests | None = None) -> list[StageTask]:
    """Stage tasks in run order, upstream model folders filled in. `digests` remembers the
    content digests of the inputs (the caller saves it, or not)."""
    pipeline_dir = spec.run_dir.resolve()
    digests = digests or Digests(pipeline_dir)
    hashes: dict[str, str] = {}
    tasks = []
    ordered = topological_order(spec.stages)
    assert ordered is not None, "a validated pipeline has no cycle"
    for stage in ordered:
        upstream_dirs = {up: str(StageFolder.of(pipeline_dir, up).model) for up in stage.upstream}
        if stage.from_:
            init_model = upstream_dirs[stage.from_]
        elif Path(stage.model).expanduser().exists():
            init_model = str(Path(stage.model).expanduser().resolve())
        else:
            init_model = stage.model  # a hub id or builtin:NAME
        inputs = input_digests(stage, digests)
        digest = stage_hash(stage, [hashes[u] for u in stage.upstream], stage.model or "", inputs)
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
                cpus_per_task=spec.cluster.cpus_per_task,
                inputs=inputs,
                spec_hash=digest,
                wandb=spec.tracking.wandb,
                max_retries=spec.cluster.max_retries,
            )
        )
    return tasks


def plan_actions(tasks: list[StageTask], dry_run: bool = False,
                 rerun: frozenset[str] = frozenset()) -> list[PlannedStage]:
    """What to do with each stage, and why; moves stale outputs aside unless dry_run.
    `rerun`: stage names to run again from scratch even if finished ("all": every stage)."""
    planned = []
    again: set[str] = set()  # stages that run (their downstream cannot be skipped)
    fresh: set[str] = set()  # stages that start over (their downstream must too)
    for task in tasks:
        upstream_again = [u for u in task.upstream_dirs if u in again]
        upstream_fresh = [u for u in task.upstream_dirs if u in fresh]
        asked = "all" in rerun or task.name in rerun
        if is_finished(task) and not upstream_again and not asked:
            planned.append(PlannedStage(task=task, action="skip"))
            continue
        again.add(task.name)
        run_dir = Path(task.run_dir)
        recorded = recorded_hash(run_dir)
        if recorded is None and not run_dir.exists():
            fresh.add(task.name)
            planned.append(PlannedStage(task=task, action="run"))
        elif recorded == task.spec_hash and not asked and not upstream_fresh:
            planned.append(PlannedStage(task=task, action="resume"))
        else:
            if asked:
                reason = "asked for (--rerun)"
            elif upstream_fresh:
                reason = f"upstream {', '.join(upstream_fresh)} starts over"
            else:
                reason = _why_changed(task)
            fresh.add(task.name)
            if not task.folder.holds_outputs():  # never started: nothing to keep, the folder is reused
                if not dry_run:
                    remove(task.folder.spec)  # an earlier spec's, never run
                planned.append(PlannedStage(task=task, action="run"))
                continue
            aside = None if dry_run else str(_move_aside(run_dir))
            planned.append(PlannedStage(task=task, action="run", moved_aside=aside, reason=reason))
    return planned


def _why_changed(task: StageTask) -> str:
    """Why a stage's folder holds another spec's outputs: which input changed, or its settings."""
    try:
        recorded = json.loads(task.folder.spec.read_text())
    except (OSError, ValueError):
        return "its folder holds outputs of an unknown spec"
    changed = changed_inputs(recorded.get("task", {}).get("inputs", {}), task.inputs)
    return "; ".join(changed) if changed else "its settings changed"


def recorded_hash(run_dir: Path) -> str | None:
    """The spec hash spec.json records for a stage folder; None without one."""
    try:
        return json.loads(StageFolder(run_dir).spec.read_text()).get("spec_hash")
    except (OSError, json.JSONDecodeError):
        return None


def _move_aside(run_dir: Path) -> Path:
    target = StageFolder(run_dir).superseded()
    run_dir.rename(target)
    return target
