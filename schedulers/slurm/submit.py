"""The Slurm scheduler's executor: the whole chain submitted at once, one job per stage.

Each downstream job has `afterok` on its upstream jobs and `--kill-on-invalid-dep=yes`;
then `run` returns, and nothing stays alive on the login node. A job's tasks (one per
GPU) run `PYTHON -m submitit.core._submit`, where PYTHON is this python, or
`apptainer exec ... IMAGE python` when the pipeline names a container. Slurm sends
USR2 `cluster.requeue_signal_s` before the time limit (and on preemption); submitit
then requeues the job, which resumes from the stage's newest complete checkpoint.
`run` fetches the hub's models and datasets into the shared cache first: the jobs
read it offline. What Slurm knows of a job (scontrol, then sacct) is jobs.py's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from core import runfolder
from core.checkpoints import newest_intact
from core.config import PipelineSpec
from core.errors import InvalidInput, PipelineError
from core.failure import Failure
from core.rows import is_row_file
from core.task import StageTask
from pipeline import plan, prepare, state
from pipeline.executors.base import Executor, announce, check_fits, exports, run_state_of
from pipeline.graph import PlannedStage
from pipeline.hfcache import hf_cache
from schedulers.slurm import jobs as slurm_jobs
from schedulers.slurm import time_to_minutes
from schedulers.slurm.node import SlurmSubmititTask
from schedulers.submitit_tasks import SubmititJob

# The calibration job's time limit: the measurements take a few minutes (CPU Adam's first JIT
# build ~1 minute of it); a shorter cluster.time wins.
CALIBRATION_TIME_MIN = 30


class SlurmExecutor(Executor):
    name = "slurm"
    doing = "submitting it to Slurm"
    calibrate_help = ("measure in one Slurm job with the file's cluster section (default when "
                      "cluster.executor is slurm)")
    fetches_before_run = True
    grants_asked_gpus = True
    runtime = SlurmSubmititTask

    def runs_this_python(self, spec: PipelineSpec) -> bool:
        return not spec.container

    def time_limit_min(self, spec: PipelineSpec, stage) -> int | None:
        return time_to_minutes(stage.time or spec.cluster.time)

    def check_before_run(self, spec, force, refuse_live, echo) -> list | None:
        check_ready(spec)
        refuse_live()  # before the download, which may take long
        try:
            plans = check_fits(spec, force)  # refuse before downloading tens of GB, when the shapes are known
        except InvalidInput:  # a model outside the built-in table: its shape comes with prepare
            plans = None
        prepare.fetch(spec, hf_cache(spec), echo=echo)
        return plans if plans is not None else check_fits(spec, force)

    def submit(self, spec, planned, config, echo) -> dict[str, str]:
        run_state = submit_chain(self, spec, planned, config, echo=echo)
        return {i.task.name: run_state.stages[i.task.name].job_id for i in planned if i.action != "skip"}

    def say_done(self, spec, planned, jobs, target) -> None:
        pipeline_dir = spec.run_dir.resolve()
        if not jobs:
            print(f"\npipeline '{spec.name}': every stage finished earlier; nothing submitted. "
                  f"Run folder: {pipeline_dir}")
            return
        listed = ", ".join(f"{name}={job}" for name, job in jobs.items())
        count = len(jobs)
        print(f"\npipeline '{spec.name}': submitted {count} Slurm job{'s' if count > 1 else ''} ({listed}); "
              f"run folder: {pipeline_dir}")
        print(f"  follow: python -m pipeline status {target}    stop: python -m pipeline cancel {target}")

    def look(self, job_ids: list[str]) -> dict[str, slurm_jobs.JobInfo]:
        return slurm_jobs.job_info(job_ids) if job_ids else {}

    def stage_status(self, task, record, seen: slurm_jobs.JobInfo | None, run_state, running):
        return _job_status(self, task, record, seen, run_state)

    def note_finished(self, status: state.StageStatus, seen: slurm_jobs.JobInfo | None) -> None:
        if seen is not None:
            status.job_state, status.restarts, status.source = seen.state, seen.restarts, self.name

    def deaths(self, record: state.StageRecord) -> list[Failure]:
        """The tasks srun says died, in the batch script's stderr (rank 0's log: srun writes there too)."""
        batch_err = self.runtime.task_log(Path(record.logs), record.job_id, 0)
        if batch_err is None or not batch_err.is_file():  # Slurm's runtime always names it
            return []
        return slurm_jobs.srun_deaths(batch_err.read_text(errors="replace"))

    def cancel(self, job_ids: list[str]) -> None:
        slurm_jobs.cancel(job_ids)

    def wait_until_ended(self, job_ids: list[str], timeout_s: float) -> list[str]:
        return slurm_jobs.wait_until_ended(job_ids, timeout_s=timeout_s)

    def measure_node(self, spec, measure, asked, echo) -> dict:
        """Submit the calibration job, wait for it and return what it measured."""
        check_ready(spec)
        try:
            job = calibration_executor(spec).submit(measure, asked)
        except Exception as err:  # noqa: BLE001 -- sbatch's refusal, reported to the user
            raise InvalidInput(f"sbatch refused the calibration job: {first_lines(err)}") from None
        echo(f"submitted calibration job {job.job_id}; waiting for it (log: {job.paths.stdout})")
        try:
            return job.result()
        except KeyboardInterrupt:
            job.cancel(check=False)
            echo(f"cancelled calibration job {job.job_id}")
            raise
        except Exception as err:  # noqa: BLE001 -- the job failed: its log says why
            raise PipelineError(f"calibration job {job.job_id} failed: {first_lines(err)}\n"
                                f"  log: {job.paths.stderr}") from None


def check_ready(spec: PipelineSpec) -> None:
    """What must hold before anything is submitted; raises InvalidInput."""
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise InvalidInput(
            "cluster.executor: slurm, but sbatch/srun are not on PATH here: run from a Slurm login node, "
            "or pass --executor local"
        )
    if spec.container and not Path(spec.container).expanduser().is_file():
        raise InvalidInput(f"container: image {spec.container} not found")


def submit_chain(executor: SlurmExecutor, spec: PipelineSpec, planned: list[PlannedStage], config: str,
                 echo=print) -> state.RunState:
    """Submit every stage that is not finished, chained by afterok; record them in pipeline.json.

    The caller holds the run folder's lock and has checked that no chain is live.
    """
    from stages.runner import StageJob

    pipeline_dir = spec.run_dir.resolve()
    run_state = run_state_of(spec, config)
    run_state.config = config
    submitted: dict[str, str] = {}  # stage -> job id, this invocation
    for item in planned:
        task = announce(executor, spec, item, echo)
        if task is None:
            continue
        after = [submitted[up] for up in task.stage.upstream if up in submitted]
        try:
            job = slurm_executor(spec, task, after).submit(SubmititJob(StageJob(task)))
        except Exception as err:  # noqa: BLE001 -- sbatch's refusal, reported to the user
            slurm_jobs.cancel(list(submitted.values()))
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
            executor=executor.name,
            state=state.PENDING,
            attempts=attempts,
            spec_hash=task.spec_hash,
            submitted_at=state.now(),
            after=after,
            logs=str(Path(job.paths.folder)),
        )
        state.save(pipeline_dir, run_state)
        waits = f", after job {' and '.join(after)}" if after else ""
        latest = newest_intact(task.folder).tag
        start = f" from checkpoint {latest}" if latest else ""
        echo(f"[{task.name}] submitted job {job.job_id}: {task.stage.kind}{start} on {task.stage.nodes} node(s) "
             f"x {task.processes_per_node} task(s){waits}; log: {job.paths.stdout}")
    return run_state


def _job_status(executor: SlurmExecutor, task: StageTask, record: state.StageRecord,
                info: slurm_jobs.JobInfo | None, run_state: state.RunState) -> state.StageStatus:
    """An unfinished stage's status from what Slurm knows of its job, else from its record."""
    base: dict[str, Any] = dict(name=task.name, run_dir=task.run_dir, job_id=record.job_id)
    older = "" if record.spec_hash == task.spec_hash else " (an older spec of this stage)"
    if info is None:
        # Slurm (and accounting, if any) no longer knows the job, and it left no result.
        if record.state in (state.FAILED, state.CANCELLED):
            ended, detail = record.state, f"{record.detail or record.job_state} (as last seen)"
        else:
            ended, detail = state.FAILED, f"the job ended without writing result.json (last seen {record.state})"
        status = state.StageStatus(state=ended, detail=detail + older, job_state=record.job_state,
                                   source="record", **base)
        return executor.with_log(status, record) if ended == state.FAILED else status
    base.update(job_state=info.state, restarts=info.restarts, source=executor.name)
    requeued = state.interruptions(task) or (f", requeued {info.restarts}x" if info.restarts else "")
    if info.waiting:
        if info.reason == "Dependency":
            upstream = [run_state.job_stage(j) or f"job {j}" for j in record.after]
            detail = "waiting for " + ", ".join(upstream)
        else:
            detail = f"waiting ({info.reason})" if info.reason else "waiting"
        return state.StageStatus(state=state.PENDING, detail=detail + requeued + older, **base)
    if info.state == "COMPLETING" and record.state == state.CANCELLED:
        return state.StageStatus(state=state.CANCELLED, detail=record.detail or "cancelled", **base)
    if info.state == "COMPLETING":
        return state.StageStatus(state=state.RUNNING, detail="ending: Slurm is cleaning up its processes" + older,
                                 **base)
    if info.live:
        doing, progress = state.activity(task.folder)
        detail = f"on {info.nodes}, {doing}" + requeued
        return state.StageStatus(state=state.RUNNING, detail=detail + older, progress=state.as_dict(progress),
                                 **base)
    if info.state == "CANCELLED":
        if info.reason == "DependencyNeverSatisfied":
            upstream = [run_state.job_stage(j) or f"job {j}" for j in record.after]
            detail = "not run: upstream " + ", ".join(upstream) + " did not finish"
        else:
            detail = "cancelled"
        return state.StageStatus(state=state.CANCELLED, detail=detail + older, **base)
    if info.state == "COMPLETED":
        detail = "the job completed but wrote no result.json for this spec"
    else:
        detail = f"{info.state}" + (f", exit code {info.exit_code}" if info.exit_code else "")
        detail += f" ({info.reason})" if info.reason and info.reason != "NonZeroExitCode" else ""
    return executor.with_log(state.StageStatus(state=state.FAILED, detail=detail + requeued + older, **base), record)


# --------------------------------------------------------------------------- what is submitted


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
        "time": time_to_minutes(stage.time or cluster.time),
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


def calibration_executor(spec: PipelineSpec):
    """A submitit SlurmExecutor for the calibration job: the pipeline's python (or its image,
    binding the folder we run in, the job's submitit folder and this code) and calibration_parameters."""
    import submitit

    logs = runfolder.calibration_logs(Path(spec.runs_dir))
    code = code_root()
    binds = bind_list(spec, [Path.cwd().resolve(), logs.resolve()] + ([code] if code else []))
    executor = submitit.SlurmExecutor(folder=logs, python=python_command(spec, binds))
    executor.update_parameters(**calibration_parameters(spec))
    return executor


def calibration_parameters(spec: PipelineSpec) -> dict:
    """submitit parameters of the calibration job: the cluster section a stage job gets
    (cluster_parameters), on one node, as one task holding every core the stage's
    processes would hold (so cores // processes_per_node is one stage process's share)."""
    cluster = spec.cluster
    params = cluster_parameters(spec)
    params.update(job_name=f"{spec.name}.calibrate", nodes=1, ntasks_per_node=1,
                  time=min(CALIBRATION_TIME_MIN, time_to_minutes(cluster.time)))
    if cluster.cpus_per_task is not None:
        params["cpus_per_task"] = cluster.cpus_per_task * cluster.processes_per_node
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
    return list(spec.cluster.setup) + exports(env)


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
    assert spec.container is not None, "a container stage's command"
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


def code_root() -> Path | None:
    """This project's source checkout, when it runs from one (not from an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "stages").is_dir() else None


def first_lines(err: Exception, count: int = 3) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:count]) or type(err).__name__
