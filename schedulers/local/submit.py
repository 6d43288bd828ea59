"""The local scheduler's executor: the chain on this machine, one stage job at a time.

Each stage is a submitit LocalExecutor job (one process per task, each under
stages/supervise.py), its rank-0 log streamed to the console, the next stage submitted
when the previous one succeeded. The `run` holds the run folder's lock the whole time,
records each stage in pipeline.json for `status`, and takes its stage processes down
with it when it is interrupted (the stage saves at the signal first, as on Slurm:
`_Stops`) or killed. cluster.time does not apply: a local stage has no time limit.
A task that is to save and requeue exits with node.py's REQUEUE_EXIT_CODE, and
submitit starts it again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core import failure, timeline
from core.checkpoints import newest_intact
from core.config import PipelineSpec
from core.errors import Interrupted, InvalidInput, InvalidStageInput, PipelineError, StageFailed
from core.task import StageTask, is_finished
from pipeline import state
from pipeline.executors.base import Executor, announce, check_fits, exports, run_state_of
from pipeline.graph import PlannedStage
from pipeline.hfcache import hf_cache
from schedulers.local.node import LocalTask
from schedulers.submitit_tasks import SubmititJob

POLL_S = 0.5
# A local stage runs until it ends (submitit's LocalExecutor needs some limit: a year).
LOCAL_TIMEOUT_MIN = 365 * 24 * 60
# How long an interrupted local run waits for its stage processes to end.
STOP_WAIT_S = 30


class LocalExecutor(Executor):
    name = "local"
    doing = "running it locally"
    calibrate_help = "measure this machine, whatever cluster.executor says"
    runtime = LocalTask

    def check_validate(self, spec: PipelineSpec) -> None:
        check_gpus(spec)

    def check_before_run(self, spec, force, refuse_live, echo) -> list | None:
        plans = check_fits(spec, force)
        check_gpus(spec)
        refuse_live()  # a Slurm chain training into the same folders
        return plans

    def submit(self, spec, planned, config, echo) -> dict[str, str]:
        run_local(self, spec, planned, config, echo)
        return {}  # every stage ran to its end

    def say_done(self, spec, planned, jobs, target) -> None:
        print(f"\npipeline '{spec.name}' finished; outputs under {spec.run_dir.resolve()}:")
        for item in planned:
            summary = json.loads(item.task.folder.result.read_text())
            numbers = {k: v for k, v in summary.items() if isinstance(v, float)}
            print(f"  {item.task.name:<12} {item.task.folder.model}  "
                  + "  ".join(f"{k}={v:.4g}" for k, v in numbers.items()))

    def stage_status(self, task, record, seen, run_state, running) -> state.StageStatus:
        """A stage a local `run` started: running while that run holds the folder, else how it ended."""
        base = dict(name=task.name, run_dir=task.run_dir, job_id=record.job_id, source="record")
        if record.state == state.RUNNING and running is not None:
            doing, progress = state.activity(task.folder)
            detail = f"local job on {record.host}, {doing}"
            detail += state.interruptions(task)
            return state.StageStatus(state=state.RUNNING, detail=detail + f" (`run` {running.pid})",
                                     progress=state.as_dict(progress), **base)
        if record.state == state.RUNNING:  # the run that ran it is gone without saying how the stage ended
            detail = (f"the local `run` on {record.host} ended while the stage ran (killed?); "
                      f"{state.resume_point(task)}")
            return self.with_log(state.StageStatus(state=state.FAILED, detail=detail, **base), record)
        if record.state == state.FAILED:
            detail = record.detail + state.interruptions(task)
            return self.with_log(state.StageStatus(state=state.FAILED, detail=detail, **base), record)
        return state.StageStatus(state=record.state, detail=f"{record.detail}; {state.resume_point(task)}", **base)

    def stop_run(self, running: state.Holder, pipeline: str) -> int:
        """SIGTERM to the `run`, whose stage saves at the signal and stops, and which records
        the stage as interrupted; wait until it has let go of the run folder."""
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

    def measure_node(self, spec, measure, asked, echo) -> dict:
        return measure(asked)  # this machine, in this process


def run_local(executor: LocalExecutor, spec: PipelineSpec, planned: list[PlannedStage], config: str,
              echo=print) -> None:
    """Run the stages one after another on this machine, recording each in pipeline.json;
    raises StageFailed, or Interrupted when a signal stopped it (`_Stops`). The caller holds
    the run folder's lock."""
    from stages.runner import StageJob

    pipeline_dir = spec.run_dir.resolve()
    run_state = run_state_of(spec, config)
    with _Stops() as stops:
        for item in planned:
            task = announce(executor, spec, item, echo)
            if task is None:
                continue
            job = local_executor(spec, task).submit(SubmititJob(StageJob(task)))
            record = _record_local(run_state, pipeline_dir, task, job)
            verb = "resuming" if item.action == "resume" else "running"
            echo(f"[{task.name}] {verb} {task.stage.kind} as local job {job.job_id} "
                 f"({task.processes_per_node} processes); log: {job.paths.stdout}")
            _follow(job, echo, stops, task)
            if stops.received and not is_finished(task):
                detail, message = stopped(task, job, stops, config)
                _end_record(run_state, pipeline_dir, record, state.CANCELLED, detail)
                raise Interrupted(message, stops.received[0])
            # A recorded failure first: job.exception() waits for every task's result, and a
            # killed task never writes one.
            if failure.read(task.folder, job.job_id) or job.state != "FINISHED" or job.exception() is not None:
                error = stage_failure(task, job)
                _end_record(run_state, pipeline_dir, record, state.FAILED, error.message.splitlines()[0])
                raise error
            _end_record(run_state, pipeline_dir, record, state.FINISHED, "")
            echo(f"[{task.name}] done: {task.folder.result}")
            if stops.received:
                raise Interrupted(f"[{task.name}] finished as {stops.name} came; `python -m pipeline run {config}` "
                                  "goes on with the next stage", stops.received[0])


def _record_local(run_state: state.RunState, pipeline_dir: Path, task: StageTask, job) -> state.StageRecord:
    record = state.StageRecord(
        job_id=str(job.job_id), executor=LocalExecutor.name, host=socket.gethostname(), state=state.RUNNING,
        spec_hash=task.spec_hash, submitted_at=state.now(), logs=str(Path(job.paths.folder)),
    )
    run_state.stages[task.name] = record
    state.save(pipeline_dir, run_state)
    return record


def _end_record(run_state, pipeline_dir: Path, record: state.StageRecord, ended: str, detail: str) -> None:
    record.state, record.detail = ended, detail
    state.save(pipeline_dir, run_state)


class _Stops:
    """How a local run stops, as a Slurm job does (a context manager around the chain).

    Ctrl-C (SIGINT, to the terminal's whole process group), SIGTERM (`kill`, `pipeline
    cancel`) and SIGHUP (a closed terminal) are noted here, not raised. At the first, every
    process of the running stage's job gets SIGINT: the training loop saves at that step and
    the stage exits without requeueing (stages/preemption.py); outside the loop it stops and
    resumes from its newest checkpoint. At a second signal, the job is killed at once. The job's
    shell and submitit's controller ignore SIGINT (`trap` in `local_parameters`): a Ctrl-C
    reaches them too, and they must neither print a traceback nor kill a stage that is saving."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self.acted = 0  # how many of them `act` has acted on
        self.at_once = False  # a second signal killed the job

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name

    def __enter__(self) -> _Stops:
        self.previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        self.received.append(signum)

    def act(self, job, echo, task: StageTask) -> None:
        """On the signals noted since the last call: ask the job to save and stop, or kill it."""
        if self.acted == len(self.received):
            return
        family = [int(job.job_id)] + _descendants(int(job.job_id))
        first = self.acted == 0 and len(self.received) == 1
        self.acted = len(self.received)
        if first:
            timeline.record(task.folder, timeline.STOP_ASKED, signal=self.name)  # what its SIGINT stands for
            _signal_all(family, signal.SIGINT)  # before the line: after SIGHUP the terminal may not take it
            echo(f"[{task.name}] stopping ({self.name}): the stage saves a checkpoint at the end of this training "
                 "step; Ctrl-C again stops at once without saving")
            return
        self.at_once = True
        _signal_all(family, signal.SIGKILL)
        deadline = time.time() + STOP_WAIT_S
        while _living(family) and time.time() < deadline:
            job.done()  # reaps the job's own process
            time.sleep(0.1)


def stopped(task: StageTask, job, stops: _Stops, config: str) -> tuple[str, str]:
    """What pipeline.json records of a stage a signal stopped, and the line `run` ends with."""
    rerun = f"`python -m pipeline run {config}`"
    latest = newest_intact(task.folder).tag
    resumes = f"{rerun} resumes from checkpoint {latest}" if latest else f"{rerun} starts it over (no checkpoint yet)"
    history = timeline.attempts(task.folder)
    last = history[-1] if history else None
    if (not stops.at_once and last is not None and last.job_id == str(job.job_id)
            and last.ended == timeline.STOPPED and last.at_step is not None):
        where = task.folder.checkpoints / task.folder.checkpoint_tag(last.at_step)
        return (f"interrupted ({stops.name}): saved at step {last.at_step}",
                f"[{task.name}] stopped ({stops.name}): saved a checkpoint at step {last.at_step} in {where}; "
                f"{rerun} resumes from it")
    how = "at once, without saving" if stops.at_once else "outside its training loop"
    return (f"interrupted ({stops.name}) {how}",
            f"[{task.name}] stopped ({stops.name}) {how}; {resumes}")


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
    params: dict[str, Any] = {
        "timeout_min": LOCAL_TIMEOUT_MIN,
        "tasks_per_node": task.processes_per_node,
        # SIGINT ignored by the job's shell and submitit's controller (see _Stops); the tasks
        # take it back (stages/supervise.py).
        "setup": ["trap '' INT"] + list(spec.cluster.setup) + exports(env),
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


def check_gpus(spec: PipelineSpec) -> None:
    """Refuse (exit 2) a local run that asks for more GPUs than this machine shows, before
    anything runs or is written. torch answers, in a child process of the python the stages
    run with: what it sees is what training would see, and this process stays torch-free."""
    asked = spec.cluster.gpus_per_node
    if not asked:
        return
    found = importlib.util.find_spec("stages")
    assert found is not None and found.origin is not None  # this project's own package
    stages_root = Path(found.origin).parent.parent
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


def _follow(job, echo, stops: _Stops, task: StageTask) -> None:
    """Print rank 0's new log lines until the job ends; act on the signals `stops` notes."""
    position = 0
    while True:
        stops.act(job, echo, task)
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
        first = failure.explaining(records)
        assert first is not None  # explained, so a record explains it
        invalid = first.kind == failure.INVALID_INPUT
        return (InvalidStageInput if invalid else StageFailed)(explained)
    err_path = Path(job.paths.stderr)
    tail = ""
    if err_path.exists():
        lines = [line for line in err_path.read_text(errors="replace").splitlines() if line.strip()]
        tail = "\n".join("    " + line for line in lines[-15:])
    return StageFailed(f"stage {task.name} failed (job {job.job_id}, state {job.state}); log: {err_path}\n{tail}")
