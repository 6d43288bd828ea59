"""The entry point of a stage job: set up the process, run stages/<kind>.py, write result.json.

`StageJob` is what the pipeline hands its scheduler to run (schedulers/: locally, on Slurm, ...).
Who this process is in the job (rank, job id, restarts, its log) its scheduler's node half says.
Importing this module must stay cheap and torch-free: the login node imports it to submit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import schedulers
from core import failure, kinds, measured, timeline
from core.checkpoints import newest_intact
from core.failure import saving
from core.runfolder import StageFolder, builtin_folder, remove, temporary
from core.task import RUN_PID_ENV, StageTask

log = logging.getLogger("stages")

WATCH_RUN_S = 2.0


@dataclass
class StageContext:
    """Where a running stage is and who it is in the job."""

    task: StageTask
    folder: StageFolder  # this stage's run folder
    builtin_root: Path
    rank: int
    world_size: int
    device: object
    on_gpu: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def hidden_size(self, model_path: str) -> int:
        return _hidden_size(model_path)

    def deepspeed_config(self, stage, model_path: str) -> dict:
        """DeepSpeed config of the model this stage trains (gradient buckets of what it trains)."""
        from stages import engine

        return engine.deepspeed_config(stage, self.world_size, self.hidden_size(model_path), self.on_gpu,
                                       trained_params(stage, model_path))

    def frozen_model_config(self, stage, model_path: str, offload: bool) -> dict:
        """DeepSpeed config of a model this stage only consults (reference, reward model)."""
        from stages import engine

        return engine.frozen_model_config(stage, self.world_size, self.hidden_size(model_path), self.on_gpu, offload)


@functools.cache
def _hidden_size(model_path: str) -> int:
    """From the model's config.json, read once per path (the trained and the frozen models' configs ask too)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "hidden_size", 4096)


def trained_params(stage, model_path: str) -> int | None:
    """Parameters the stage trains of the model at `model_path`, as the planner counts them
    (core/shapes.py); None for a model the planner cannot count."""
    shape = _shape(model_path)
    if shape is None:
        return None
    lora = stage.lora
    head = kinds.get(stage.kind).trained_head
    return sum(shape.trained_tensors(head, lora.rank if lora else None, tuple(lora.target_modules) if lora else ()))


@functools.cache
def _shape(model_path: str):
    """The model's shape (core/shapes.py) from its config.json, read once per path; None for a family
    the planner cannot count."""
    from transformers import AutoConfig

    from core.shapes import from_config_json

    try:
        return from_config_json(AutoConfig.from_pretrained(model_path).to_dict(), model_path)
    except ValueError:
        return None


class StageJob:
    """One stage as a job: every task of the job calls it. At its scheduler's requeue signal the
    scheduler starts the same job again, which resumes from the stage's newest checkpoint."""

    def __init__(self, task: StageTask):
        self.task = task

    def __call__(self) -> dict:
        return run_stage(self.task)

    def requeueing(self, signal_name: str) -> None:
        """Said on rank 0 by the scheduler's handler of its requeue signal `signal_name`, as it
        requeues the job.

        No save here: during training the loop has already saved at the signal's step
        (stages/preemption.py) before handing the signal on; outside it (loading, the
        final evaluation, export) the requeued job resumes from the newest complete
        checkpoint, which the atomic `latest` file names."""
        folder = self.task.folder
        timeline.record(folder, timeline.REQUEUE, signal=signal_name, reason=timeline.signal_reason(
            signal_name, timeline.attempt_seconds(folder), self.task.time_limit_min, signal_name))
        latest = newest_intact(folder).tag
        start = f"checkpoint {latest}" if latest else "the start (no checkpoint yet)"
        log.warning("stage %s: requeueing; the job will resume from %s", self.task.name, start)


def run_stage(task: StageTask) -> dict:
    """Run the stage as this process (one rank of the job).

    If it fails, this rank records why in its failure record (core/failure.py:
    the cause, the place, what to do) and re-raises, so the job fails with the full
    traceback in this rank's log; `run` and `status` print the record instead."""
    rank = failure.task_rank()
    log_path = _task_log(task.folder)
    try:
        failure.reserve(task.folder, rank)
        result = _run_stage(task)
    except Exception as err:
        try:
            failure.record_exception(task.folder, rank, err, log=str(log_path) if log_path else None)
        except Exception as unrecorded:  # noqa: BLE001 -- the log still has the traceback
            print(f"could not record the failure in {task.folder.failure_record(rank)}: {unrecorded}",
                  file=sys.stderr, flush=True)
        if log_path is not None:  # a scheduler's job, which exits 1 after this error anyway
            _exit_hard_at_interpreter_exit(task.folder, 1)
        raise
    failure.release(task.folder, rank)
    _exit_hard_at_interpreter_exit(task.folder, 0)
    return result


class TooManyRestarts(RuntimeError):
    """The job ended without a word (a node failure, a kill) more often than cluster.max_retries."""


def _refuse_after_too_many_silent_endings(task: StageTask) -> None:
    """A scheduler requeues a job whose node failed; each such start counts against cluster.max_retries,
    like a hang. Every rank decides alike, before any collective of the stage (they count earlier
    starts only, whether or not rank 0 has recorded this one yet)."""
    silent = timeline.unexplained_endings(task.folder, failure.task_job_id(), timeline.restart_count())
    if silent > task.max_retries:
        raise TooManyRestarts(
            f"job {failure.task_job_id()} of stage {task.name} ended without saving or saying why {silent} "
            f"time{'s' if silent > 1 else ''} (a node failure, or its processes killed), more than "
            f"cluster.max_retries ({task.max_retries}): failing. "
            f"The earlier attempts' logs are in {task.folder.logs}")


def _note_sigterm(folder: StageFolder) -> None:
    """Outside the training loop (loading, evaluation, export) a SIGTERM cannot be saved at: the
    scheduler preempts the job, kills it and requeues it. Noting it keeps that start from counting as a
    silent ending (a node failure) against cluster.max_retries. The scheduler's own handler runs after."""
    previous = signal.getsignal(signal.SIGTERM)

    def note(signum, frame):
        timeline.record(folder, timeline.REQUEUE, signal="SIGTERM", reason=timeline.PREEMPTED)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, note)


def _run_stage(task: StageTask) -> dict:
    if failure.task_rank() == 0:  # before the imports: the report's timeline tells starting from queued
        timeline.record(task.folder, timeline.LAUNCHED)
    from stages import distributed

    env = distributed.detect()
    _configure_logging(env.rank)
    # The seconds before the rank line below (imports, joining the other processes) say what they are.
    log.info("stage %s (%s): importing torch and DeepSpeed, then starting %d process(es)", task.name,
             task.stage.kind, env.world_size)
    _end_with_the_run(task.folder, env.rank)
    device = distributed.init(env, task.gpus_per_node, task.stage.collective_timeout_s,
                              threads=distributed.cpu_threads(task.cpus_per_task, env.local_world_size))
    devices = distributed.devices(device, env.world_size)
    ctx = StageContext(task=task, folder=task.folder, builtin_root=builtin_folder(task.pipeline_dir), rank=env.rank,
                       world_size=env.world_size, device=device, on_gpu=device.type == "cuda")
    _prepare(task, ctx)
    # Every rank says where it is (each task has its own log): multi-node problems show here.
    print(
        f"stage {task.name} ({task.stage.kind}): rank {env.rank} of {env.world_size} on {socket.gethostname()} "
        f"(local rank {env.local_rank} of {env.local_world_size}) via {env.source}, "
        f"master {env.master_addr}:{env.master_port}, device {device} ({devices['name']})",
        flush=True,
    )
    started = time.time()
    import torch

    torch.manual_seed(task.stage.seed)  # e.g. a reward head new on top of a causal LM starts the same every run
    from stages import sequence_parallel

    sequence_parallel.setup(task.stage, env.rank, env.world_size)
    metrics = run_of(kinds.get(task.stage.kind))(task, ctx)
    result = {
        "stage": task.name,
        "kind": task.stage.kind,
        "spec_hash": task.spec_hash,
        "model": str(ctx.folder.model),
        "world_size": env.world_size,
        "devices": devices,
        "seconds": round(time.time() - started, 1),
        **metrics,
    }
    if ctx.is_main:
        _write_result(ctx, task, result, metrics)
    distributed.shutdown()
    return result


def _prepare(task: StageTask, ctx: StageContext) -> None:
    """The run folder made and cleared of a killed attempt's leftovers, the attempt recorded, the hang
    watchdog started and the built-in model and data written, before anything loads."""
    ctx.folder.path.mkdir(parents=True, exist_ok=True)
    if ctx.is_main:
        for leftover in ctx.folder.temporaries():  # of an attempt killed mid-write (checkpoints: stages/checkpoints.py)
            remove(leftover)
        timeline.record_start(ctx.folder)  # every attempt: the report's timeline shows requeues
        _note_sigterm(ctx.folder)
    _refuse_after_too_many_silent_endings(task)
    from stages import watchdog

    # From here every phase is watched (loading, evaluation, ...); rank 0 requeues a hang through the scheduler.
    watchdog.start(ctx, task.stage, task.max_retries, schedulers.runtime())
    _materialize_builtins(task, ctx)


def _write_result(ctx: StageContext, task: StageTask, result: dict, metrics: dict) -> None:
    """result.json (with the plan's figures beside the measured ones), written atomically."""
    result.update(measured.plan_vs_measured(ctx.folder, task.stage.kind))  # beside the plan.json
    tmp = temporary(ctx.folder.result)
    with saving(tmp, "result.json"):
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, ctx.folder.result)
    log.info("stage %s finished: %s", task.name, json.dumps(metrics))


def run_of(kind: kinds.StageKind) -> Callable[[StageTask, StageContext], dict]:
    """A kind's run: a plug-in's declaration carries it; a shipped kind's is `run` in stages/<its name>.py."""
    if kind.run is not None:
        return kind.run
    module = f"{__package__}.{kind.name}"
    try:
        return importlib.import_module(module).run
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise RuntimeError(f"stage kind '{kind.name}' ({kind.schema.__module__}) is declared without a run") from None


def _end_with_the_run(folder: StageFolder, rank: int) -> None:
    """A stage process of a local run ends when the `run` that started it is gone, however
    it went (a SIGKILL leaves it no time to stop its stages): no orphan keeps training.
    Its failure record says so."""
    pid = os.environ.get(RUN_PID_ENV)
    if not pid:
        return

    def watch():
        while True:
            time.sleep(WATCH_RUN_S)
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                message = f"the local `run` that started it (pid {pid}) is gone, so it stopped"
                log.error("stage process: %s", message)
                with contextlib.suppress(OSError):
                    failure.write(folder, failure.Failure(
                        rank=rank, host=socket.gethostname(), kind=failure.STOPPED, message=message,
                        log=str(_task_log(folder) or "") or None, job_id=failure.task_job_id(), time=time.time()))
                sys.stdout.flush()
                os._exit(1)
            except (PermissionError, ValueError):
                return

    threading.Thread(target=watch, name="end-with-run", daemon=True).start()


def _materialize_builtins(task: StageTask, ctx: StageContext) -> None:
    """Write the built-in model/data once, on rank 0, before any rank reads them.

    Only rank 0 may do it: with torch.distributed up, transformers' save_pretrained
    silently writes nothing on the other ranks.
    """
    import torch.distributed as dist

    from core import tiny
    from core.config import BUILTIN_PREFIX

    if ctx.is_main:
        for name in (task.init_model, task.stage.data.path):
            if name.startswith(BUILTIN_PREFIX):
                if not tiny.is_materialized(name[len(BUILTIN_PREFIX):], ctx.builtin_root):
                    log.info("writing the built-in %s to %s (once for the pipeline)", name, ctx.builtin_root)
                tiny.materialize(name[len(BUILTIN_PREFIX):], ctx.builtin_root)
    elif task.init_model.startswith(BUILTIN_PREFIX):
        # Writing the model, rank 0 imports transformers' model code (seconds on a CPU); the
        # others need it next to load the model: they import it now instead of idling here.
        tiny.import_model_code()
    dist.barrier()


def _exit_hard_at_interpreter_exit(folder: StageFolder, code: int) -> None:
    """Once the stage has succeeded (0) or recorded its failure (1), leave with os._exit(code)
    when everything is flushed, after removing what the scheduler's wrapper of this task may have
    left half-written.

    DeepSpeed's ZeRO-3 leaves C++ threads behind that sometimes abort the
    interpreter's own teardown ("terminate called without an active exception"),
    turning a finished stage into a failed job, or keeping a failed rank alive while
    the others wait for it. The wrapper (submitit's) has written the job's result (or error)
    before the interpreter exits, so nothing is lost by skipping teardown; if that write failed
    (a full disk), its temporary file would make the next attempt's write fail too.
    """
    runtime = schedulers.runtime()
    leftovers = runtime.leftovers(folder.logs) if runtime is not None else []

    def hard_exit():
        for leftover in leftovers:
            remove(leftover)
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)

    atexit.register(hard_exit)


def _task_log(folder: StageFolder) -> Path | None:
    """This task's stderr log, when its scheduler names it (a hand-written batch script names
    its own)."""
    runtime = schedulers.runtime()
    return None if runtime is None else runtime.task_log(folder.logs, runtime.job_id(), runtime.rank())


def _configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_warning()
    except ImportError:
        pass
