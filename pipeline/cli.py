"""python -m pipeline validate|run|status CONFIG

CONFIG is a path to a pipeline file or the name of one under pipeline/configs/.
Exit codes: 0 ok, 1 a stage failed, 2 invalid pipeline file or data, 3 does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline import config as config_module
from pipeline import graph, launch, preflight
from pipeline.errors import PipelineError


def cmd_validate(args) -> int:
    spec = config_module.load_pipeline(args.config)
    preflight.check(spec)
    tasks = graph.build_tasks(spec)
    print(f"{config_module.resolve_config_path(args.config)}: valid pipeline '{spec.name}', "
          f"{len(tasks)} stage{'s' if len(tasks) > 1 else ''}:")
    for task in tasks:
        stage = task.stage
        start = f"from {stage.from_}" if stage.from_ else stage.model
        print(f"  {stage.name:<12} {stage.kind:<4} {start}  ->  {task.run_dir}")
    return 0


def cmd_run(args) -> int:
    spec = config_module.load_pipeline(args.config)
    preflight.check(spec)
    executor = args.executor or spec.cluster.executor
    if executor != "local":
        raise PipelineError(f"executor '{executor}' is not available yet; run with --executor local")
    planned = graph.plan_actions(graph.build_tasks(spec))
    launch.run_local(spec, planned, echo=launch.default_echo)
    print(f"\npipeline '{spec.name}' finished; outputs under {spec.run_dir.resolve()}:")
    for item in planned:
        result = Path(item.task.run_dir) / graph.RESULT_FILE
        summary = json.loads(result.read_text())
        numbers = {k: v for k, v in summary.items() if isinstance(v, float)}
        print(f"  {item.task.name:<12} {Path(item.task.run_dir) / 'model'}  "
              + "  ".join(f"{k}={v:.4g}" for k, v in numbers.items()))
    return 0


def cmd_status(args) -> int:
    spec = config_module.load_pipeline(args.config)
    for task in graph.build_tasks(spec):
        run_dir = Path(task.run_dir)
        if graph.is_finished(task):
            state = "finished"
        elif (run_dir / graph.SPEC_FILE).exists():
            state = "started, not finished" if (run_dir / "checkpoints" / "latest").exists() else "submitted or failed"
        else:
            state = "not started"
        print(f"  {task.name:<12} {state:<24} {run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_text in (
        ("validate", cmd_validate, "check a pipeline file, its models and data; submit nothing"),
        ("run", cmd_run, "run (or resume) every stage that is not finished"),
        ("status", cmd_status, "show each stage's state"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="pipeline file, or a name under pipeline/configs/")
        p.set_defaults(func=func)
        if name == "run":
            p.add_argument("--executor", choices=["local", "slurm"], help="override cluster.executor")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PipelineError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
