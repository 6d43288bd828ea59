"""Save on the signal: a stage that its scheduler is about to stop saves at the next optimizer step.

A scheduler's wrapper of each task installs its own handler on the scheduler's requeue signal
(schedulers/: submitit's USR2, locally and on Slurm) before the stage starts: on rank 0 it calls
StageJob.requeueing, requeues the job (`scontrol requeue`; locally, exit code 144) and exits; on
the other ranks it only logs. SIGTERM it only logs. Alone that loses every step since the last
periodic checkpoint, since no rank can save while the others are mid-step.

While the training loop runs, `Signals` takes over the requeue signal and SIGTERM in every rank:
the handler only notes the signal. Once per optimizer step the loop asks `requested()`, a
one-number all-reduce (MAX) of every rank's note, so a signal that reached any rank is
known to all at the same step; they all save that step's checkpoint and then `requeue`:
rank 0 hands the signal to the scheduler's own handler (requeue and exit), the others exit.
Resume is therefore only ever at an optimizer-step boundary, never inside gradient
accumulation. SIGINT is a user's stop (Ctrl-C, or a local `run` stopping:
schedulers/local/submit.py): the same save at the step, then every rank exits with
STOPPED_EXIT_CODE instead of requeueing, and the next `run` resumes from that step. A local
`run` stops its stage with SIGINT whatever it got itself; the stage's lines name what it got
(SIGTERM from `kill`: core/timeline.py `stop_signal`).
Outside the loop (loading, the final evaluation, export) the scheduler's handlers are in
place as before: the job requeues at once (or, at SIGINT, stops) and resumes from the
newest checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import schedulers
from core import timeline
from stages.supervise import STOPPED_EXIT_CODE

log = logging.getLogger("stages")

STOP = "SIGINT"  # the one caught signal that stops the stage instead of requeueing it
CHECK_BUDGET = 0.01  # the check may cost at most this share of a step ...
MOST_STEPS_BETWEEN_CHECKS = 16  # ... but a signal waits at most this many steps to be seen


def steps_between_checks(check_s: float, step_s: float) -> int:
    """Check every k steps, k the smallest that keeps the check within CHECK_BUDGET of the
    steps' time (1 for any real model: a one-number all-reduce is tens of microseconds)."""
    if step_s <= 0:
        return 1
    return max(1, min(MOST_STEPS_BETWEEN_CHECKS, math.ceil(check_s / (CHECK_BUDGET * step_s))))


def requeue_signal() -> signal.Signals | None:
    """What this process's scheduler sends a job that is to save, requeue and resume
    (schedulers/); None outside a scheduler's job."""
    runtime = schedulers.runtime()
    return runtime.requeue_signal if runtime is not None else None


def caught(requeue: signal.Signals | None) -> tuple[signal.Signals, ...]:
    """The signals the training loop notes: the requeue signal, SIGTERM and SIGINT."""
    return ((requeue,) if requeue is not None else ()) + (signal.SIGTERM, signal.SIGINT)


class Signals:
    """The requeue signal, SIGTERM and SIGINT noted (not acted on) while the training loop runs;
    a context manager."""

    def __init__(self, ctx):
        self.device, self.rank, self.folder = ctx.device, ctx.rank, ctx.folder
        self.time_limit_min = ctx.task.time_limit_min
        self.requeue_signal = requeue_signal()
        self.caught = caught(self.requeue_signal)
        self.received: int | None = None  # the signal this rank got, if any
        self.received_at: float | None = None
        self.previous: dict = {}
        self.checks, self.check_s = 0, 0.0  # what the checks cost, for the log and the interval
        self.every = 1  # steps between checks: the same on every rank (from all-reduced timings)

    def start(self) -> Signals:
        for sig in self.caught:
            self.previous[sig] = signal.signal(sig, self._note)
        return self

    def stop(self) -> None:
        """Back to the scheduler's handlers; one that arrived after the loop's last check acts now
        (the job resumes from its newest checkpoint)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.received == signal.SIGINT:
            self._stop_after(None)
        if self.received is not None and self.requeue_signal is not None:
            _call(self.previous.get(self.requeue_signal), self.requeue_signal)

    def __enter__(self) -> Signals:
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.stop()
        else:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.time()
        # A log call in a signal handler can deadlock on the handler's lock: write directly.
        said = self.said(signal.Signals(signum).name)
        os.write(2, f"caught {said}: saving a checkpoint at the end of this step\n".encode())

    def said(self, name: str) -> str:
        """A signal's name as the lines say it: a SIGINT by a local `run` that was stopped is that
        run's signal (SIGTERM from `kill`, SIGHUP from a closed terminal)."""
        return timeline.stop_signal(self.folder) if name == STOP else name

    def requested(self, step: int, step_s: float, last: bool) -> str | None:
        """After optimizer step `step` (which took `step_s`): the name of a signal some rank
        got, the same on every rank, or None. A collective every `every` steps and at the
        `last`; it also carries the ranks' timings, so every rank picks the same next interval."""
        if step % self.every and not last:
            return None
        started = time.perf_counter()
        # A rank's check time includes waiting for the last rank to arrive; the last one's does
        # not: its (the least) is the check's own cost. MAX of the negated value is that MIN.
        mean_check_s = self.check_s / max(self.checks, 1)
        values = torch.tensor([float(self.received or 0), -mean_check_s, step_s], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        signum, least_check_s, slowest_step_s = values.tolist()
        check_s = -least_check_s
        self.checks += 1
        self.check_s += time.perf_counter() - started
        if self.checks > 1:  # the first check's time includes the ranks catching up with each other
            self.every = steps_between_checks(check_s, slowest_step_s)
        return signal.Signals(int(signum)).name if signum else None

    def cost_line(self, loop_s: float) -> str:
        mean_ms = 1e3 * self.check_s / max(self.checks, 1)
        share = 100 * self.check_s / max(loop_s, 1e-9)
        return (f"signal checks: {self.checks}, {mean_ms:.3f} ms each, {share:.2f}% of the training loop's time, "
                f"every {self.every} steps at the end")

    def save_and_requeue(self, name: str, step: int, save: Callable[[], None] | None) -> None:
        """At the step every rank learnt of signal `name`: `save` (None: this step is saved
        already), then requeue, or stop at SIGINT. Never returns."""
        if save is not None:
            started = time.time()
            save()
            log.info("checkpoint at %s took %.2f s", self.said(name), time.time() - started)
        if self.rank == 0:
            timeline.record(self.folder, timeline.SAVED_AT_SIGNAL, signal=self.said(name), step=step,
                            reason=timeline.signal_reason(name, timeline.attempt_seconds(self.folder),
                                                          self.time_limit_min, self.requeue_signal_name))
        if name == STOP:
            self._stop_after(step)
        self.requeue(self.rank, step)

    def _stop_after(self, step: int | None) -> None:
        """A user's stop: every rank exits with STOPPED_EXIT_CODE, no requeue."""
        since = (f"{time.time() - self.received_at:.1f} s after the signal" if self.received_at
                 else "on another rank's signal")
        if step is not None:
            log.warning("checkpoint at step %d saved %s: stopping (%s); the next run resumes from it", step, since,
                        self.said(STOP))
        else:
            log.warning("%s after the last step: stopping; the next run resumes from the newest checkpoint",
                        self.said(STOP))
        _leave(STOPPED_EXIT_CODE)

    @property
    def requeue_signal_name(self) -> str | None:
        return self.requeue_signal.name if self.requeue_signal is not None else None

    def requeue(self, rank: int, step: int) -> None:
        """After the checkpoint: rank 0 requeues through its scheduler and exits; the others exit."""
        since = (f"{time.time() - self.received_at:.1f} s after the signal" if self.received_at
                 else "on another rank's signal")
        log.warning("checkpoint at step %d saved %s: requeueing", step, since)
        sys.stdout.flush()
        sys.stderr.flush()
        if rank == 0:
            requeue_through(self.previous.get(self.requeue_signal), self.requeue_signal)
        _leave(0)


def requeue_through(handler, requeue_signal: signal.Signals | None) -> None:
    """Rank 0 hands the job to its scheduler's handler of `requeue_signal`, which requeues it
    (`scontrol requeue`; locally, exit code 144) and exits; leaves at once with that exit code.
    Never returns (no handler: not a scheduler's job, exit 1). The hang watchdog requeues
    through it too."""
    try:
        _call(handler, requeue_signal)
    except SystemExit as done:  # the scheduler's own exit after requeueing
        _leave((done.code if isinstance(done.code, int) else 1) & 0xFF)
    _leave(1)


def _call(handler, signum) -> None:
    if callable(handler):
        handler(signum, None)


def _leave(code: int) -> None:
    """Exit now, without the interpreter's teardown (DeepSpeed's threads can abort it and
    change the exit code, which may be the scheduler's requeue code)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
