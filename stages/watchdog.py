"""The hang watchdog: a training step far slower than the steps before it is a hang.

An NCCL collective that never completes (a dead peer, a rank stuck in I/O) blocks every
rank until the collective timeout, and on Slurm burns the allocation until the time
limit. Each rank runs a thread that watches the step in progress: once
HANG_WARMUP_STEPS steps have been timed, a step running longer than `hang_factor` x the
median of the steps before it (and at least `hang_min_s`) makes the rank write every
thread's Python stack to its log (faulthandler) and say "hang at step N"; rank 0 then
requeues the job through submitit (it resumes from its newest checkpoint) unless the
stage has already hung `cluster.max_retries` times, then it fails; the other ranks wait
for that (their step is stuck behind the same collective) and leave. Only the training
step is watched: evaluation, checkpoint saves and logging are not, and the first steps
(compilation, caches) are not.

PIPELINE_TEST_HANG="RANK:STEP:SECONDS" (test-only) makes rank RANK sleep SECONDS inside
step STEP, every attempt: tests/test_preemption.py uses it to hang a stage.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from typing import Optional

from core import failure, timeline
from stages import preemption

log = logging.getLogger("stages")

HANG_WARMUP_STEPS = 5
TEST_HANG_ENV = "PIPELINE_TEST_HANG"
POLL_S = 0.5


class Hang(RuntimeError):
    """A stage that hung more often than cluster.max_retries (its failure record's cause)."""


class Watchdog:
    """Times each training step of this rank; a thread acts on one that runs far too long."""

    def __init__(self, ctx, factor: float, min_s: float, max_retries: int, requeue_handler):
        self.rank, self.folder = ctx.rank, ctx.folder
        self.factor, self.min_s, self.max_retries = factor, min_s, max_retries
        self.requeue_handler = requeue_handler  # submitit's USR2 handler (rank 0 requeues with it)
        self.durations: list[float] = []
        self.step: Optional[int] = None  # the step in progress, None between steps
        self.started = 0.0
        self.test_hang = _test_hang(ctx.rank)

    def start(self) -> "Watchdog":
        if self.factor > 0:
            threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()
        return self

    def step_started(self, step: int) -> None:
        """Step `step` (1-based) begins; sleeps here when the test hook asks for it."""
        self.step, self.started = step, time.monotonic()
        if self.test_hang and self.test_hang[0] == step:
            time.sleep(self.test_hang[1])

    def step_ended(self) -> None:
        self.durations.append(time.monotonic() - self.started)
        self.step = None

    def limit_s(self) -> Optional[float]:
        """How long the step in progress may run; None while too few steps are timed."""
        if len(self.durations) < HANG_WARMUP_STEPS:
            return None
        return max(self.min_s, self.factor * statistics.median(self.durations[-100:]))

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            step, limit = self.step, self.limit_s()
            if step is not None and limit is not None and time.monotonic() - self.started > limit:
                self._hang(step, time.monotonic() - self.started, limit)

    def _hang(self, step: int, seconds: float, limit: float) -> None:
        print(f"hang at step {step}: rank {self.rank}'s step has run {seconds:.0f} s, more than {limit:.1f} s "
              f"({self.factor:g} x the median step, at least hang_min_s); the Python stacks of its threads:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        sys.stdout.flush()
        if self.rank != 0:
            # Rank 0 decides (requeue or fail). Leaving now would break its collective with an
            # error instead of letting it see the hang; a requeue ends this process anyway.
            time.sleep(limit + 10)
            os._exit(1)
        hangs = sum(attempt.ended == timeline.HUNG for attempt in timeline.attempts(self.folder))
        timeline.record(self.folder, timeline.HANG, step=step)
        if hangs >= self.max_retries:
            said = (f"hang at step {step}: the stage hung {hangs + 1} time{'s' if hangs else ''}, more than "
                    f"cluster.max_retries ({self.max_retries}): failing")
            print(said, file=sys.stderr, flush=True)
            # What `run` and `status` say: the hang, not "process died" (every rank's stacks are in its .err log).
            failure.record_exception(self.folder, self.rank, Hang(said + "; each rank's Python stacks are in its "
                                                                  ".err log"), log=None)
            os._exit(1)
        print(f"hang at step {step}: requeueing ({hangs + 1} of cluster.max_retries {self.max_retries})",
              file=sys.stderr, flush=True)
        preemption.requeue_through(self.requeue_handler)


def _test_hang(rank: int) -> Optional[tuple[int, float]]:
    """(step, seconds) from PIPELINE_TEST_HANG="RANK:STEP:SECONDS" for this rank; test-only."""
    value = os.environ.get(TEST_HANG_ENV)
    if not value:
        return None
    who, step, seconds = value.split(":")
    return (int(step), float(seconds)) if int(who) == rank else None
