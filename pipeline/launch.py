"""`python -m pipeline run`, one story for both executors: check, plan, lock, then run
the chain here or submit it to Slurm, as submitit jobs.

Local executor: one job at a time on this machine (submitit's LocalExecutor,
one process per task), its rank-0 log streamed to the console, the next stage
submitted when the previous one succeeded. The `run` holds the run folder's lock
the whole time, records each stage in pipeline.json for `status`, and takes its
stage processes down with it when it is interrupted or killed. cluster.time does
not apply: a local stage has no time limit.

Slurm executor: the whole chain at once, one job per stage, each downstream job
with `afterok` on its upstream jobs and `--kill-on-invalid-dep=yes`; then `run`
returns, and nothing stays alive on the login node. A job's tasks (one per GPU)
run `PYTHON -m submitit.core._submit`, where PYTHON is this python, or
`apptainer exec ... IMAGE python` when the pipeline names a container. Slurm
sends USR2 `cluster.requeue_signal_s` before the time limit (and on
preemption); submitit then requeues the job, which resumes from the stage's
newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from core import failure, measured
from core.config import PipelineSpec, slurm_time_to_minutes
from core.errors import InvalidInput, PipelineError, StageFailed
from core.rows import is_row_file
from core.task import StageTask
from pipeline import graph, plan, prepare, slurm, state
from pipeline.graph import PlannedStage
from pipeline.hfcache import hf_cache
from pipeline.identity import Digests

POLL_S = 0.5
# A local stage runs until it ends (submitit's LocalExecutor needs some limit: a year).
LOCAL_TIMEOUT_MIN = 365 * 24 * 60
# How long an interrupted local run waits for its stage processes to end.
STOP_WAIT_S = 30
# What the `run` holding the run folder's lock is doing (state.Holder.doing).
RUNNING_LOCALLY, SUBMITTING = "running it locally", "submitting it to Slurm"


@dataclass
class Outcome:
    """What `run` did: the plan per stage and, on Slurm, the jobs it submitted."""

    executor: str
    planned: list[PlannedStage]
    jobs: dict[str, str] = field(default_factory=dict)  # stage -> Slurm job id, this invocation


def run(spec: PipelineSpec, config: str, executor: Optional[str] = None, force: bool = False,
        rerun: frozenset[str] = frozenset(), echo=None) -> Outcome:
    """Check what can be checked before anything is written, then run the chain here or
    submit it to Slurm. `rerun`: stages to run again from scratch ("all": every one).
    Raises InvalidInput (2), DoesNotFit (3) or StageFailed (1)."""
    echo = echo or default_echo
    executor = executor or spec.cluster.executor
    pipeline_dir = spec.run_dir.resolve()
    cache = hf_cache(spec)
    unknown = sorted(set(rerun) - {s.name for s in spec.stages} - {"all"})
    if unknown:
        raise InvalidInput(f"--rerun {', '.join(unknown)}: no such stage; stages: "
                           f"{', '.join(s.name for s in spec.stages)} (or all)")
    digests = Digests(pipeline_dir)
    tasks = graph.build_tasks(spec, digests)
    if executor == "slurm":
        check_slurm_ready(spec)
        state.refuse_if_live(pipeline_dir, config, tasks)  # before the download, which may take long
        try:
            plans = check_fits(spec, force)  # refuse before downloading tens of GB, when the shapes are known
        except InvalidInput:  # a model outside the built-in table: its shape comes with prepare
            plans = None
        prepare.fetch(spec, cache, echo=echo)
        if plans is None:
            plans = check_fits(spec, force)
    else:
        plans = check_fits(spec, force)
        check_local_gpus(spec)
        state.refuse_if_live(pipeline_dir, config, tasks)  # a Slurm chain training into the same folders
    doing = SUBMITTING if executor == "slurm" else RUNNING_LOCALLY
    with state.hold(pipeline_dir, config, doing, echo=echo):
        state.refuse_if_live(pipeline_dir, config, tasks)  # again: someone may have submitted meanwhile
        digests.save()
        planned = graph.plan_actions(tasks, rerun=rerun)
        measured.save_plans(planned, None if plans is None else plan.plan_to_json(plans))  # each result.json compares itself with it
        if executor == "slurm":
            run_state = submit_slurm(spec, planned, config, echo=echo)
            jobs = {i.task.name: run_state.stages[i.task.name].job_id for i in planned if i.action != "skip"}
            return Outcome(executor, planned, jobs)
        run_local(spec, planned, config, echo=echo)
        return Outcome(executor, planned)


def check_fits(spec: PipelineSpec, force: bool) -> Optional[list]:
    """The plan of every stage; refuses (exit 3) a stage that does not fit, before anything is
    written or queued. With `force` nothing is refused: a pipeline the planner cannot estimate
    gives None."""
    try:
        plans = plan.plan_pipeline(spec, plan.known_rows(spec))
    except PipelineError:
        if force:
            return None
        raise
    if not force:
        plan.raise_if_not_fits(plans)
    return plans


def write_spec(task: StageTask) -> None:
    """spec.json: the resolved task, so a person (or slurm/stage.sbatch) can see and re-run it."""
    task.folder.path.mkdir(parents=True, exist_ok=True)
    payload = {"spec_hash": task.spec_hash, "task": task.model_dump(mode="json", by_alias=True)}
    task.folder.spec.write_text(json.dumps(payload, indent=2) + "\n")


def _exports(env: dict) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def announce(item: PlannedStage, echo) -> bool:
    """Say what happens to a stage; False when it is skipped. Writes spec.json for the others."""
    task = item.task
    if item.action == "skip":
        echo(f"[{task.name}] finished earlier with the same spec: skipped ({task.run_dir})")
        return False
    if item.moved_aside:
        echo(f"[{task.name}] runs again: {item.reason}; previous outputs moved to {item.moved_aside}")
    write_spec(task)
    return True


def run_local(spec: PipelineSpec, planned: list[PlannedStage], config: str, echo=print) -> None:
    """Run the stages one after another on this machine, recording each in pipeline.json;
    raises StageFailed. The caller holds the run folder's lock."""
    from stages.runner import StageJob

    pipeline_dir = spec.run_dir.resolve()
    run_state = state.load(pipeline_dir) or state.RunState(pipeline=spec.name, config=config)
    for item in planned:
        task = item.task
        if not announce(item, echo):
            continue
        job = local_executor(spec, task).submit(StageJob(task))
        record = _record_local(run_state, pipeline_dir, task, job)
        verb = "resuming" if item.action == "resume" else "running"
        echo(f"[{task.name}] {verb} {task.stage.kind} as local job {job.job_id} "
             f"({task.processes_per_node} processes); log: {job.paths.stdout}")
        try:
            with _signals_as_interrupts():
                _follow(job, echo)
        except KeyboardInterrupt:
            _stop(job)
            _end_record(run_state, pipeline_dir, record, state.CANCELLED, "interrupted")
            raise
        # A recorded failure first: job.exception() waits for every task's result, and a
        # killed task never writes one.
        if failure.read(task.folder, job.job_id) or job.state != "FINISHED" or job.exception() is not None:
            error = stage_failure(task, job)
            _end_record(run_state, pipeline_dir, record, state.FAILED, error.message.splitlines()[0])
            raise error
        _end_record(run_state, pipeline_dir, record, state.FINISHED, "")
        echo(f"[{task.name}] done: {task.folder.result}")


def _record_local(run_state: state.RunState, pipeline_dir: Path, task: StageTask, job) -> state.StageRecord:
    record = state.StageRecord(
        job_id=str(job.job_id), executor="local", host=socket.gethostname(), state=state.RUNNING,
        spec_hash=task.spec_hash, submitted_at=state.now(), logs=str(Path(job.paths.folder)),
    )
    run_state.stages[task.name] = record
    state.save(pipeline_dir, run_state)
    return record


def _end_record(run_state, pipeline_dir: Path, record: state.StageRecord, ended: str, detail: str) -> None:
    record.state, record.detail = ended, detail
    state.save(pipeline_dir, run_state)


@contextlib.contextmanager
def _signals_as_interrupts():
    """SIGTERM (`kill`) and SIGHUP (a closed terminal) stop a local run as Ctrl-C does:
    its stage processes are stopped before it exits."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_local_run(running: state.Holder, pipeline: str) -> int:
    """`cancel` of a local run: SIGTERM to its `run`, which stops its stage processes and
    records the stage as interrupted; wait until it has let go of the run folder."""
    if running.host != socket.gethostname():
        raise InvalidInput(f"pipeline '{pipeline}' is running locally on {running.host} (pid {running.pid}): "
                           "cancel it there")
    os.kill(running.pid, signal.SIGTERM)
    deadline = time.time() + STOP_WAIT_S + 10
    while time.time() < deadline and state.holder_alive(running):
        time.sleep(POLL_S)
    ending = f"; it is still ending after {STOP_WAIT_S + 10} s" if state.holder_alive(running) else ""
    print(f"pipeline '{pipeline}': stopped the local run (pid {running.pid}){ending}")
    return 0


def _stop(job) -> None:
    """Stop a local job's processes and wait (a while) until they are gone. The job's process
    is a shell when there are setup lines, and a shell does not pass SIGINT on: every process
    of the job gets it (submitit's controller then stops its tasks), and SIGKILL if it lingers."""
    family = [int(job.job_id)] + _descendants(int(job.job_id))
    job.cancel()
    _signal_all(family, signal.SIGINT)
    deadline = time.time() + STOP_WAIT_S
    while _living(family) and time.time() < deadline:
        job.done()  # reaps the job's own process once it ends
        time.sleep(POLL_S)
    _signal_all(_living(family), signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _living(pids: list[int]) -> list[int]:
    """The processes among `pids` that still run (not ended, not zombies)."""
    living = []
    for pid in pids:
        try:
            state_letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state_letter != "Z":
            living.append(pid)
    return living


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def local_executor(spec: PipelineSpec, task: StageTask):
    """A submitit LocalExecutor set up for one stage job: one process per task, and the GPUs."""
    import submitit

    executor = submitit.LocalExecutor(folder=task.folder.logs, python=supervised_python(task))
    executor.update_parameters(**local_parameters(spec, task))
    return executor


def supervised_python(task: StageTask) -> str:
    """How each task's python starts: under stages/supervise.py, which records a task that dies
    without a word (a signal, an exit code) so the failure names it."""
    python = shlex.quote(sys.executable)
    return f"{python} -m stages.supervise {shlex.quote(task.run_dir)} {python}"


def local_parameters(spec: PipelineSpec, task: StageTask) -> dict:
    """submitit LocalExecutor parameters. Every task of the job sees the job's GPUs and takes
    the one of its local rank (stages/distributed.py), as on Slurm. submitit sets the job's
    CUDA_VISIBLE_DEVICES to the first gpus_per_node of `visible_gpus`, or to 0..n-1 without
    them, and to "" when no GPU is asked for: this machine's own CUDA_VISIBLE_DEVICES (e.g.
    4,5,6,7 of a shared node) is passed on, or the job would take GPUs not given to us."""
    from core.task import RUN_PID_ENV

    env = {**hf_cache(spec).env(), RUN_PID_ENV: str(os.getpid()), **spec.cluster.env}
    params = {
        "timeout_min": LOCAL_TIMEOUT_MIN,
        "tasks_per_node": task.processes_per_node,
        "setup": list(spec.cluster.setup) + _exports(env),
    }
    gpus = spec.cluster.gpus_per_node
    if gpus:
        params["gpus_per_node"] = gpus
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if all(d.isdigit() for d in visible):
            params["visible_gpus"] = tuple(int(d) for d in visible)
        else:  # GPU or MIG UUIDs, which submitit's integer visible_gpus cannot carry
            params["setup"].append(f"export CUDA_VISIBLE_DEVICES={shlex.quote(','.join(visible[:gpus]))}")
    return params


def check_local_gpus(spec: PipelineSpec) -> None:
    """Refuse (exit 2) a local run that asks for more GPUs than this machine shows, before
    anything runs or is written. torch answers, in a child process of the python the stages
    run with: what it sees is what training would see, and this process stays torch-free."""
    asked = spec.cluster.gpus_per_node
    if not asked:
        return
    stages_root = Path(importlib.util.find_spec("stages").origin).parent.parent
    code = (f"import sys; sys.path.insert(0, {str(stages_root)!r}); "
            f"from stages.distributed import missing_gpus; print(missing_gpus({asked}) or '')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    problem = lines[-1] if lines else ""
    if done.returncode != 0:
        problem = f"torch could not say how many GPUs it sees here: {problem or f'exit code {done.returncode}'}"
    if problem:
        raise InvalidInput(
            f"cluster.gpus_per_node: {asked} GPU{'s' if asked > 1 else ''} asked of this machine (local executor), "
            f"but {problem}. "
            "To train on this machine's CPU, set gpus_per_node: 0 (and tasks_per_node: N for N processes); "
            "to train on GPUs, run on a GPU node, or with cluster.executor: slurm."
        )


def _follow(job, echo) -> None:
    """Print rank 0's new log lines until the job ends."""
    position = 0
    while True:
        finished = job.done()
        path = Path(job.paths.stdout)
        if path.exists():
            with open(path) as f:
                f.seek(position)
                chunk = f.read()
                position = f.tell()
            for line in chunk.splitlines():
                echo(f"    {line}")
        if finished:
            return
        time.sleep(POLL_S)


def stage_failure(task: StageTask, job) -> PipelineError:
    """What `run` ends with when a local stage job failed: the ranks' recorded cause
    (core/failure.py; bad input found at stage time is exit 2, like any bad input),
    else the last lines of the first log with a traceback."""
    records = failure.read(task.folder, job.job_id)
    explained = failure.explain(task.name, records)
    if explained is not None:
        invalid = failure.explaining(records).kind == failure.INVALID_INPUT
        return (InvalidInput if invalid else StageFailed)(explained)
    err_path = Path(job.paths.stderr)
    tail = ""
    if err_path.exists():
        lines = [line for line in err_path.read_text(errors="replace").splitlines() if line.strip()]
        tail = "\n".join("    " + line for line in lines[-15:])
    return StageFailed(f"stage {task.name} failed (job {job.job_id}, state {job.state}); log: {err_path}\n{tail}")


def default_echo(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()


# --------------------------------------------------------------------------- Slurm


def check_slurm_ready(spec: PipelineSpec) -> None:
    """What must hold before anything is submitted; raises InvalidInput."""
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise InvalidInput(
            "cluster.executor: slurm, but sbatch/srun are not on PATH here: run from a Slurm login node, "
            "or pass --executor local"
        )
    if spec.container and not Path(spec.container).expanduser().is_file():
        raise InvalidInput(f"container: image {spec.container} not found")


def submit_slurm(spec: PipelineSpec, planned: list[PlannedStage], config: str, echo=print) -> state.RunState:
    """Submit every stage that is not finished, chained by afterok; record them in pipeline.json.

    The caller holds the run folder's lock and has checked that no chain is live.
    """
    from stages.runner import StageJob

    pipeline_dir = spec.run_dir.resolve()
    run_state = state.load(pipeline_dir) or state.RunState(pipeline=spec.name, config=config)
    run_state.config = config
    submitted: dict[str, str] = {}  # stage -> job id, this invocation
    for item in planned:
        task = item.task
        if not announce(item, echo):
            continue
        after = [submitted[up] for up in task.stage.upstream if up in submitted]
        try:
            job = slurm_executor(spec, task, after).submit(StageJob(task))
        except Exception as err:  # noqa: BLE001 -- sbatch's refusal, reported to the user
            slurm.cancel(list(submitted.values()))
            for name in submitted:
                run_state.stages[name].state = state.CANCELLED
            state.save(pipeline_dir, run_state)
            undone = f"; cancelled the jobs already submitted ({', '.join(submitted.values())})" if submitted else ""
            raise InvalidInput(f"sbatch refused stage {task.name}: {first_lines(err)}{undone}") from None
        submitted[task.name] = job.job_id
        previous = run_state.stages.get(task.name)
        attempts = previous.attempts + 1 if previous and previous.spec_hash == task.spec_hash else 1
        run_state.stages[task.name] = state.StageRecord(
            job_id=job.job_id,
            state=state.PENDING,
            attempts=attempts,
            spec_hash=task.spec_hash,
            submitted_at=state.now(),
            after=after,
            logs=str(Path(job.paths.folder)),
        )
        state.save(pipeline_dir, run_state)
        waits = f", after job {' and '.join(after)}" if after else ""
        latest = task.folder.latest_checkpoint()
        start = f" from checkpoint {latest}" if latest else ""
        echo(f"[{task.name}] submitted job {job.job_id}: {task.stage.kind}{start} on {task.stage.nodes} node(s) "
             f"x {task.processes_per_node} task(s){waits}; log: {job.paths.stdout}")
    return run_state


def slurm_executor(spec: PipelineSpec, task: StageTask, after: list[str]):
    """A submitit SlurmExecutor set up for one stage job."""
    import submitit

    executor = submitit.SlurmExecutor(
        folder=task.folder.logs,
        python=job_python(spec, task),
        max_num_timeout=spec.cluster.max_requeues,
    )
    executor.update_parameters(**slurm_parameters(spec, task, after))
    return executor


def sbatch_script(executor) -> str:
    """The batch script the executor submits (what the golden test pins down)."""
    return executor._make_submission_file_text(executor._submitit_command_str, "")


def slurm_parameters(spec: PipelineSpec, task: StageTask, after: list[str]) -> dict:
    """submitit SlurmExecutor parameters: resources from the cluster block and the stage."""
    cluster, stage = spec.cluster, task.stage
    params = cluster_parameters(spec)
    params.update({
        "job_name": f"{spec.name}.{task.name}",
        "time": slurm_time_to_minutes(stage.time or cluster.time),
        "nodes": stage.nodes,
        "ntasks_per_node": task.processes_per_node,
        "signal_delay_s": plan.signal_lead(spec, stage),
    })
    if cluster.cpus_per_task is not None:
        params["cpus_per_task"] = cluster.cpus_per_task
    extra = params["additional_parameters"]
    extra["requeue"] = True  # the job requeues itself on USR2, whatever the site's default
    if after:
        extra["dependency"] = "afterok:" + ":".join(after)
        extra["kill-on-invalid-dep"] = "yes"
    return params


def cluster_parameters(spec: PipelineSpec) -> dict:
    """submitit SlurmExecutor parameters every job of the pipeline shares (stage jobs, the
    calibration job): the cluster block's partition, account, qos, constraint, GPUs per node,
    memory and extra sbatch options, and the setup lines."""
    cluster = spec.cluster
    params: dict = {"setup": slurm_setup_lines(spec)}
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(cluster, name) is not None:
            params[name] = getattr(cluster, name)
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    extra: dict = {}
    if cluster.mem is not None:
        extra["mem"] = cluster.mem
    extra.update({k: v for k, v in cluster.sbatch.items() if v is not False})
    params["additional_parameters"] = extra
    return params


def slurm_setup_lines(spec: PipelineSpec) -> list[str]:
    """Shell lines of the batch script before srun: the user's setup, then the environment."""
    env = {
        **hf_cache(spec).env(),
        # prepare fetched everything on the submit host; compute nodes may have no internet.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    if spec.container is None and os.environ.get("TORCH_EXTENSIONS_DIR"):
        # DeepSpeed's JIT-built ops, compiled once per machine image, not once per job.
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    env.update(spec.cluster.env)  # the pipeline file has the last word
    return list(spec.cluster.setup) + _exports(env)


def job_python(spec: PipelineSpec, task: StageTask) -> str:
    """The command that runs python for a stage job: this interpreter, or python inside the container."""
    return python_command(spec, container_binds(spec, task))


def python_command(spec: PipelineSpec, binds: list[str]) -> str:
    """The command that runs python for a job of this pipeline: this interpreter, or python inside
    its container with `binds` bound."""
    if spec.container is None:
        return shlex.quote(sys.executable)
    return " ".join(shlex.quote(part) for part in container_command(spec, binds)) + " python"


def container_command(spec: PipelineSpec, binds: list[str]) -> list[str]:
    """`apptainer exec [--nv] --bind ... [--env PYTHONPATH=CODE] [options] IMAGE`."""
    command = [spec.apptainer.command, "exec"]
    if spec.cluster.gpus_per_node:
        command.append("--nv")
    command += ["--bind", ",".join(binds)]
    code = code_root()
    if code is not None:
        # The job unpickles the stage with the same code that submitted it.
        command += ["--env", f"PYTHONPATH={code}"]
    command += list(spec.apptainer.options)
    command.append(str(Path(spec.container).expanduser().resolve()))
    return command


def container_binds(spec: PipelineSpec, task: StageTask) -> list[str]:
    """Folders the job reads or writes: the folder `run` ran in (the pipeline file's relative
    paths start there), the run folder, local data and model, HF cache, code; then the user's."""
    cache = hf_cache(spec)
    paths = [Path.cwd().resolve(), Path(task.pipeline_dir), cache.home, cache.hub, cache.datasets]
    data = task.stage.data
    for name in (data.path, data.eval_split if data.eval_split and is_row_file(data.eval_split) else None,
                 task.init_model):
        path = Path(name).expanduser() if name else None
        if path is not None and path.exists():
            path = path.resolve()
            paths.append(path if path.is_dir() else path.parent)
    code = code_root()
    if code is not None:
        paths.append(code)
    return bind_list(spec, paths)


def bind_list(spec: PipelineSpec, paths: list[Path]) -> list[str]:
    """The container's --bind entries: `paths` without those inside another, then the pipeline file's own."""
    kept: list[Path] = []
    for path in paths:
        if not any(path == k or k in path.parents for k in kept):
            kept = [k for k in kept if path not in k.parents] + [path]
    return [str(p) for p in kept] + list(spec.apptainer.binds)


def code_root() -> Optional[Path]:
    """This project's source checkout, when it runs from one (not from an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "stages").is_dir() else None


def first_lines(err: Exception, count: int = 3) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:count]) or type(err).__name__
