"""`python -m pipeline run`, one story for every executor: check, plan, lock, then run
the chain here or submit it, as jobs of its scheduler (schedulers/).

First what needs no executor (the stage names `--rerun` gives); then the executor's own
checks before the run folder is locked, in its own order (pipeline/executors/: the plan,
no live chain on the folder, what it needs here). Under the lock: no live chain still,
the content digests and plans saved, each stage's action decided (pipeline/graph.py), a
stage whose checkpoints are all damaged refused (core/checkpoints.py), and the chain
handed to the executor, which runs it here to its end or submits it and returns.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from core import measured
from core.checkpoints import newest_intact
from core.config import PipelineSpec
from core.errors import InvalidInput
from pipeline import executors, graph, plan, state
from pipeline.executors import Executor
from pipeline.graph import PlannedStage
from pipeline.identity import Digests


@dataclass
class Outcome:
    """What `run` did: its executor, the plan per stage and the jobs it left queued or running."""

    executor: Executor
    planned: list[PlannedStage]
    jobs: dict[str, str] = field(default_factory=dict)  # stage -> job id, this invocation


def run(spec: PipelineSpec, config: str, executor: str | None = None, force: bool = False,
        rerun: frozenset[str] = frozenset(), echo=None) -> Outcome:
    """Check what can be checked before anything is written, then run the chain here or
    submit it. `executor`: its name, overriding cluster.executor. `rerun`: stages to run
    again from scratch ("all": every one). Raises InvalidInput (2), DoesNotFit (3) or StageFailed (1)."""
    echo = echo or default_echo
    where = executors.executor_for(executor or spec.cluster.executor)
    pipeline_dir = spec.run_dir.resolve()
    unknown = sorted(set(rerun) - {s.name for s in spec.stages} - {"all"})
    if unknown:
        raise InvalidInput(f"--rerun {', '.join(unknown)}: no such stage; stages: "
                           f"{', '.join(s.name for s in spec.stages)} (or all)")
    digests = Digests(pipeline_dir)
    tasks = graph.build_tasks(spec, digests)
    plans = where.check_before_run(spec, force, lambda: executors.refuse_if_live(pipeline_dir, config, tasks), echo)
    with state.hold(pipeline_dir, config, where.doing, echo=echo):
        executors.refuse_if_live(pipeline_dir, config, tasks)  # again: someone may have submitted meanwhile
        digests.save()
        planned = graph.plan_actions(tasks, rerun=rerun)
        refuse_unresumable(planned)
        # each result.json compares itself with it
        measured.save_plans(planned, None if plans is None else plan.plan_to_json(plans))
        return Outcome(where, planned, where.submit(spec, planned, config, echo))


def refuse_unresumable(planned: list[PlannedStage]) -> None:
    """A stage to resume whose checkpoints are all damaged is refused before anything is submitted
    (here their files' sizes are checked; the stage checks every byte when it starts)."""
    for item in planned:
        if item.action != "resume":
            continue
        verdict = newest_intact(item.task.folder)
        if verdict.refused:
            raise InvalidInput(f"stage {item.task.name}: {verdict.refusal(item.task.folder)}")


def default_echo(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
