"""python -m pipeline validate|plan|run|status|report|cancel|clean|prepare|calibrate|run-stage CONFIG

CONFIG is a path to a pipeline file or the name of one under pipeline/configs/.
Exit codes: 0 ok, 1 a stage failed, 2 invalid pipeline file or data, 3 does not fit,
130 / 143 stopped by Ctrl-C / SIGTERM (after saving at the signal).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from core import config as config_module
from core import failure, metrics, runfolder
from core.errors import Interrupted, InvalidInput, InvalidStageInput, PipelineError, StageFailed
from core.task import is_finished
from pipeline import calibrate, executors, graph, launch, plan, preflight, prepare, scale, state
from pipeline.executors.base import write_spec
from pipeline.hfcache import hf_cache

CANCEL_WAIT_S = 120


def load(args, build: bool = True):
    """The pipeline file, validated; with --scale-model its scale model (pipeline/scale.py),
    whose models are written first when `build` (commands that only read the run folder do not)."""
    if args.scale_head_dim != scale.DEFAULT_HEAD_DIM and not args.scale_model:
        raise InvalidInput("--scale-head-dim sets the width of a scale model: give it with --scale-model")
    spec = config_module.load_pipeline(args.config)
    if args.scale_model:
        spec = scale.scaled(spec, hf_cache(spec), args.scale_head_dim, build=build)
    return spec


def target(args) -> str:
    """The pipeline as the other commands name it: the file, and the scale-model flags if given."""
    if not args.scale_model:
        return args.config
    return f"{args.config} --scale-model" + (
        f" --scale-head-dim {args.scale_head_dim}" if args.scale_head_dim != scale.DEFAULT_HEAD_DIM else "")


def cmd_validate(args) -> int:
    spec = load(args)
    where = executors.executor_for(spec.cluster.executor)
    preflight.check(spec, where)
    metrics.check_trackers(spec, where.runs_this_python(spec))
    where.check_validate(spec)
    tasks = graph.build_tasks(spec)
    print(f"{config_module.resolve_config_path(args.config)}: valid pipeline '{spec.name}', "
          f"{len(tasks)} stage{'s' if len(tasks) > 1 else ''}:")
    for task in tasks:
        stage = task.stage
        start = f"from {stage.from_}" if stage.from_ else stage.model
        print(f"  {stage.name:<12} {stage.kind:<4} {start}  ->  {task.run_dir}")
    return 0


def cmd_plan(args) -> int:
    spec = load(args)
    plans = plan.plan_pipeline(spec, plan.known_rows(spec), calibration=args.calibration)
    if args.json:
        print(json.dumps(plan.plan_to_json(plans), indent=2))
    else:
        print(plan.format_plan(plans))
    return 3 if any(p.fits is False for p in plans) else 0


def cmd_run(args) -> int:
    spec = load(args)
    where = executors.executor_for(spec.cluster.executor)
    preflight.check(spec, where)
    metrics.check_trackers(spec, where.runs_this_python(spec))
    rerun = frozenset(name.strip() for value in args.rerun for name in value.split(",") if name.strip())
    try:
        outcome = launch.run(spec, target(args), executor=args.executor, force=args.force, rerun=rerun)
    except (StageFailed, InvalidStageInput):
        write_report_after_run(spec, target(args))  # what there is: the failed stage's state and curves
        raise
    outcome.executor.say_done(spec, outcome.planned, outcome.jobs, target(args))
    if not outcome.jobs:  # the stages ran here (or had finished): none is left waiting in a queue
        write_report_after_run(spec, target(args))
    return 0


def write_report_after_run(spec, config: str) -> None:
    """`run`'s last line: the report of what ran, where `report` writes it. One that cannot be
    written is said, and the run's outcome stands."""
    from pipeline import report

    try:
        path = report.write_report(spec)
    except Exception as err:  # noqa: BLE001 -- whatever the report meets, the stages' outcome is the run's
        print(f"report: not written ({type(err).__name__}: {err}); `python -m pipeline report {config}` "
              "tries again", flush=True)
        return
    print(f"report: {path}", flush=True)


def cmd_status(args) -> int:
    spec = load(args, build=False)
    pipeline_dir = spec.run_dir.resolve()
    run_state = state.load(pipeline_dir)
    running = state.holder(pipeline_dir)
    statuses = executors.stage_statuses(graph.build_tasks(spec), run_state, running)
    if run_state is not None:
        state.refresh(run_state, statuses)
        state.save_unless_held(pipeline_dir, run_state)
    superseded = [(p, _size(p)) for p in runfolder.superseded_folders(pipeline_dir)]
    if args.json:
        print(json.dumps({"pipeline": spec.name, "run_dir": str(pipeline_dir),
                          "stages": [dataclasses.asdict(s) for s in statuses],
                          "superseded": [{"path": str(p), "bytes": n} for p, n in superseded]}, indent=2))
    else:
        print(f"pipeline '{spec.name}', run folder {pipeline_dir}")
        if running is not None:
            print(f"  held by a `run`: {running.describe()}")
        for s in statuses:
            job = f"job {s.job_id}" if s.job_id else ""
            print(f"  {s.name:<12} {s.state:<12} {job:<10} {s.detail}")
            if s.log:
                print(f"      log: {s.log}")
                for line in s.log_tail:
                    print(f"      | {line}")
        if superseded:
            total = sum(n for _, n in superseded)
            print(f"  superseded outputs, kept ({_gib(total)}; "
                  f"`python -m pipeline clean {target(args)}` removes them):")
            for path, n in superseded:
                print(f"    {path.name:<40} {_gib(n)}")
    return 1 if any(s.failed for s in statuses) else 0


def cmd_report(args) -> int:
    from pipeline import report

    spec = load(args, build=False)
    path = report.write_report(spec, Path(args.plots) if args.plots else None)
    print(f"pipeline '{spec.name}': report written to {path}")
    return 0


def cmd_cancel(args) -> int:
    spec = load(args, build=False)
    pipeline_dir = spec.run_dir.resolve()
    running = state.holder(pipeline_dir)
    holder = executors.holding(running)
    stopped = holder.stop_run(running, spec.name) if holder is not None and running is not None else None
    if stopped is not None:  # a `run` that runs the chain itself, stopped
        return stopped
    run_state = state.load(pipeline_dir)
    live = executors.live_jobs(run_state)
    if run_state is None or not live:
        print(f"pipeline '{spec.name}': no live Slurm job or local run to cancel ({pipeline_dir})")
        return 0
    executors.cancel(live)
    for job in live:
        run_state.stages[job.stage].state = state.CANCELLED
        run_state.stages[job.stage].detail = "cancelled by `pipeline cancel`"
        print(f"  {job.stage:<12} cancelled job {job.job_id} (was {job.state})")
    state.save(pipeline_dir, run_state)
    # Wait for the scheduler to stop the processes, so a `run` right after is not refused.
    ending = executors.wait_until_ended(live, timeout_s=CANCEL_WAIT_S)
    if ending:
        print(f"  jobs {', '.join(ending)} are still ending after {CANCEL_WAIT_S} s; `status` shows when they are gone")
    return 0


def cmd_clean(args) -> int:
    """Remove the stage folders `run` moved aside (superseded outputs); nothing else."""
    spec = load(args, build=False)
    folders = runfolder.superseded_folders(spec.run_dir.resolve())
    if not folders:
        print(f"pipeline '{spec.name}': no superseded outputs under {spec.run_dir.resolve()}")
        return 0
    total = 0
    for path in folders:
        size = _size(path)
        total += size
        if not args.dry_run:
            shutil.rmtree(path)
        print(f"  {'would remove' if args.dry_run else 'removed'} {path} ({_gib(size)})")
    print(f"pipeline '{spec.name}': {'would free' if args.dry_run else 'freed'} {_gib(total)}")
    return 0


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_prepare(args) -> int:
    spec = load(args)
    preflight.check(spec, executors.executor_for(spec.cluster.executor), fetching=True)
    prepare.fetch(spec, hf_cache(spec), echo=launch.default_echo)
    return 0


def cmd_calibrate(args) -> int:
    """Measure this node (or, on Slurm, one node of the cluster) and write the calibration file."""
    if args.scale_model:
        raise InvalidInput("calibrate measures the node at the real models' shapes: leave out --scale-model")
    spec = load(args)
    where = executors.executor_for(next((name for name in executors.executors() if getattr(args, name, False)),
                                        spec.cluster.executor))
    out = Path(args.out) if args.out else None
    result, path = calibrate.calibrate(spec, where, quick=args.quick, require_gpu=args.require_gpu, out=out,
                                       echo=launch.default_echo)
    print(calibrate.summary(result, path, spec))
    return 0


def cmd_run_stage(args) -> int:
    """One stage in this process, as one task of a job (e.g. slurm/stage.sbatch's tasks)."""
    spec = load(args)
    tasks = {t.name: t for t in graph.build_tasks(spec)}
    if args.stage not in tasks:
        raise InvalidInput(f"{args.config}: no stage named '{args.stage}'; stages: {', '.join(tasks)}")
    task = tasks[args.stage]
    for up in task.stage.upstream:
        if not is_finished(tasks[up]):
            raise InvalidInput(f"stage {task.name} starts from stage {up}, which has not finished "
                               f"({tasks[up].run_dir})")
    if is_finished(task):
        print(f"[{task.name}] finished earlier with the same spec: skipped ({task.run_dir})")
        return 0
    recorded = graph.recorded_hash(Path(task.run_dir))
    if recorded not in (None, task.spec_hash):
        raise InvalidInput(f"{task.run_dir} holds the outputs of a different spec of stage {task.name}; "
                           "move it aside, or use `python -m pipeline run`, which does")
    task = executors.executor_for(spec.cluster.executor).job_task(spec, task)
    if failure.task_rank() == 0:
        write_spec(task)
    from stages.runner import run_stage

    run_stage(task)
    return 0


COMMANDS = {
    "validate": (cmd_validate, "check a pipeline file, its models and data; submit nothing"),
    "plan": (cmd_plan, "estimate each stage's GPU and host memory and time; say what would make it fit"),
    "run": (cmd_run, "run (locally) or submit (to Slurm) every stage that is not finished"),
    "status": (cmd_status, "show each stage's state; for a failed stage, its log"),
    "report": (cmd_report, "write runs/<pipeline>/report.html: curves, throughput, memory, plan vs measured"),
    "cancel": (cmd_cancel, "cancel the pipeline's pending and running Slurm jobs, or its local run"),
    "clean": (cmd_clean, "remove the superseded outputs `run` moved aside (status lists them)"),
    "prepare": (cmd_prepare, "download the models and datasets named by hub id into the shared cache"),
    "calibrate": (cmd_calibrate, "measure a node's matmul, memory, copy, CPU Adam and collective rates for `plan`"),
    "run-stage": (cmd_run_stage, "run one stage in this process (one task per GPU, e.g. of slurm/stage.sbatch)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    for name, (func, help_text) in COMMANDS.items():
        commands[name] = p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="pipeline file, or a name under pipeline/configs/")
        p.add_argument("--scale-model", action="store_true",
                       help="the same pipeline on a scale model of each model it starts from: the real layers, "
                       "heads, vocabulary and positions, random weights, a narrow head dimension; outputs under "
                       "runs/<name>-scale/")
        p.add_argument("--scale-head-dim", type=int, default=scale.DEFAULT_HEAD_DIM, metavar="D",
                       help=f"with --scale-model: the head dimension (hidden size = heads x D; default "
                       f"{scale.DEFAULT_HEAD_DIM})")
        p.set_defaults(func=func)
    commands["run"].add_argument("--executor", help="override cluster.executor (local, slurm, or a plug-in's)")
    commands["run"].add_argument("--force", action="store_true",
                                 help="run even where the plan says a stage does not fit")
    commands["run"].add_argument("--rerun", action="append", default=[], metavar="STAGE",
                                 help="run STAGE (and what starts from it) again from scratch even if finished; "
                                 "repeat or comma-separate; `all` for every stage")
    commands["plan"].add_argument("--json", action="store_true", help="machine-readable output")
    commands["plan"].add_argument("--calibration", metavar="FILE",
                                  help="take the node's rates from this calibration file (default: "
                                  "<runs_dir>/calibration/<GPU>.json when `calibrate` wrote one)")
    commands["status"].add_argument("--json", action="store_true", help="machine-readable output")
    commands["clean"].add_argument("--dry-run", action="store_true", help="list what would be removed")
    commands["run-stage"].add_argument("stage", help="name of the stage to run")
    commands["calibrate"].add_argument("--out", metavar="FILE",
                                       help="write the calibration file here (default: "
                                       "<runs_dir>/calibration/<GPU>.json, cpu.json without a GPU)")
    where = commands["calibrate"].add_mutually_exclusive_group()
    for name, executor in executors.executors().items():
        where.add_argument(f"--{name}", action="store_true", help=executor.calibrate_help)
    commands["calibrate"].add_argument("--quick", action="store_true",
                                       help="smaller copies and CPU Adam, fewer repeats: under a minute, noisier")
    commands["calibrate"].add_argument("--require-gpu", action="store_true",
                                       help="refuse (exit 2) on a machine without a GPU instead of measuring "
                                       "only the CPU Adam rate")
    commands["report"].add_argument("--plots", metavar="DIR", help="also save each plot there as a PNG file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Interrupted as err:  # a stop the user asked for: no "error"
        print(err.message, file=sys.stderr)
        return err.exit_code
    except PipelineError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
