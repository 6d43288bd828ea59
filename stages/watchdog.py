"""The hang watchdog: a phase of a stage that goes far longer than it should without progress is a hang.

An NCCL collective that never completes (a dead peer, a rank stuck in I/O), a reward server
that never answers, a file system that stops: each blocks the stage until the collective
timeout, and on Slurm burns the allocation until the time limit. A stage's time is spent in
named phases, each marked where it happens with `phase(name)` (a context manager, or a
decorator): loading the models, DPO's reference precompute, evaluation, generation and scoring
(RL), the user's reward functions, a training step (in RL: a rollout and its update), saving a
checkpoint, the export, and inside them every forward pass. Phases nest, and the end of a phase
is progress of every phase around it, so that an evaluation or a precompute of any size is
judged by its parts, not its length. Each open phase is judged by its time since it started or
last made progress, against the earlier runs of the same phase in the same place (the same
phases around it), each run counting its longest such time:
- once it has run HANG_WARMUP times, it may go hang_factor x the median of its last RECENT runs,
  and at least hang_min_s;
- before that it may go hang_first_s: loading, the first evaluations and the first training steps
  (compilation, caches) have no history to be judged by.
A phase with a bound of its own (the reward functions: reward.timeout_s per call, which stops a
hung call itself: core/reward_process.py) may go at least that long, and while it runs the
phases around it are not judged; its time is not counted to them.

Each rank runs a thread that watches its own phases. A phase past its limit makes the rank write
every thread's Python stack to its log (faulthandler) and say where, e.g. "hang in evaluation >
generation at step 40: rank 1's generation has run 610 s, more than 600 s (...)". Rank 0 then
requeues the job through its scheduler (it resumes from its newest checkpoint) unless the stage has
already hung `cluster.max_retries` times, then it fails with a `Hang` record. The other ranks,
stuck behind the same collective, give rank 0 time to act (a requeue ends them), then record
the hang themselves and leave.

The thread also notes, on rank 0, the innermost phase that has lasted PHASE_NOTE_S (the stage
folder's phase.json: core/timeline.py), when that changes: `status` shows it. Nothing is
written per training step.

PIPELINE_TEST_HANG="RANK:STEP:SECONDS" (test-only) makes rank RANK sleep SECONDS inside
training step STEP, every attempt: tests/test_slurm_preemption.py uses it to hang a stage.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import schedulers
from core import failure, timeline

HANG_WARMUP = 5  # runs of a phase before its own history judges it
RECENT = 100  # the runs whose median counts
TEST_HANG_ENV = "PIPELINE_TEST_HANG"
POLL_S = 0.5
GRACE_S = 60.0  # the most a rank other than 0 waits past its own limit for rank 0 to act on the hang
PHASE_NOTE_S = 30.0  # a phase this long is noted for `status`

# The phases (a nested phase is named with the ones around it: "evaluation > generation").
LOADING, REFERENCE_PRECOMPUTE, EVALUATION = "loading", "reference precompute", "evaluation"
GENERATION, SCORING, REWARD_FUNCTIONS = "generation", "scoring", "reward functions"
TRAINING_STEP, FORWARD, SAVING, EXPORT = "training step", "forward pass", "saving", "export"

_active: Watchdog | None = None  # this process's, once `start`ed


class Hang(RuntimeError):
    """A stage that hung more often than cluster.max_retries (its failure record's cause)."""


class phase(contextlib.ContextDecorator):
    """Marks a phase where it happens: `with phase(EVALUATION, step=40):`, or `@phase(LOADING)`
    on a function. `step`: the optimizer step it belongs to (a nested phase takes the one around
    it). `at_least_s`: the bound of a phase that stops itself (see the module's doc). Costs a few
    list operations; nothing happens where no watchdog runs (stage code called by a test)."""

    def __init__(self, name: str, step: int | None = None, at_least_s: float = 0.0):
        self.name, self.step, self.at_least_s = name, step, at_least_s

    def __enter__(self) -> phase:
        if _active is not None:
            _active.enter(self.name, self.step, self.at_least_s)
        return self

    def __exit__(self, *exc) -> None:
        if _active is not None:
            _active.leave()


def start(ctx, stage, max_retries: int, runtime: schedulers.Runtime | None) -> Watchdog:
    """This process's watchdog, from now until it ends; `runtime`: who it is in its scheduler's
    job (schedulers/), whose handler of the requeue signal, in place now, rank 0 requeues with."""
    global _active
    _active = Watchdog(ctx, stage, max_retries, runtime)
    threading.Thread(target=_active.watch, name="hang-watchdog", daemon=True).start()
    return _active


@dataclass(eq=False)  # an open phase is itself, not any equal one
class Open:
    path: tuple[str, ...]  # its name, after the names of the phases around it
    step: int | None
    started: float  # time.monotonic()
    at_least_s: float = 0.0
    progress: float = field(init=False)  # its start, or when a phase inside it last ended
    longest: float = 0.0  # its longest time without progress so far

    def __post_init__(self) -> None:
        self.progress = self.started

    def without_progress(self, now: float) -> float:
        return now - self.progress

    def progressed(self, now: float, counts: bool = True) -> None:
        """A part of it ended at `now`; `counts`: the time since its last progress was its own."""
        if counts:
            self.longest = max(self.longest, now - self.progress)
        self.progress = now

    def where(self) -> str:
        """`evaluation > generation at step 40`."""
        return " > ".join(self.path) + ("" if self.step is None else f" at step {self.step}")


class Watchdog:
    """Times the phases of this rank; `watch` (a thread) acts on one that runs far too long."""

    def __init__(self, ctx, stage, max_retries: int, runtime: schedulers.Runtime | None):
        self.rank, self.folder = ctx.rank, ctx.folder
        self.factor, self.min_s, self.first_s = stage.hang_factor, stage.hang_min_s, stage.hang_first_s
        self.max_retries, self.runtime = max_retries, runtime
        self.requeue_signal = runtime.requeue_signal if runtime is not None else None
        self.requeue_handler = signal.getsignal(self.requeue_signal) if self.requeue_signal is not None else None
        self.history: dict[tuple[str, ...], deque[float]] = {}  # each run's longest time without progress
        self.open: list[Open] = []  # innermost last; the thread reads a copy
        self.noted: Open | None = None  # the phase phase.json names (rank 0)
        self.test_hang = _test_hang(ctx.rank)

    def enter(self, name: str, step: int | None, at_least_s: float) -> None:
        outer = self.open[-1] if self.open else None
        entry = Open(path=(outer.path if outer else ()) + (name,), started=time.monotonic(), at_least_s=at_least_s,
                     step=step if step is not None or outer is None else outer.step)
        if at_least_s:  # the phases around it stop counting until it ends
            for around in self.open:
                around.progressed(entry.started)
        self.open.append(entry)
        if self.test_hang and name == TRAINING_STEP and entry.step == self.test_hang[0]:
            time.sleep(self.test_hang[1])

    def leave(self) -> None:
        if not self.open:
            return
        entry = self.open.pop()
        now = time.monotonic()
        entry.progressed(now)
        self.history.setdefault(entry.path, deque(maxlen=RECENT)).append(entry.longest)
        for around in self.open:  # its end is progress of every phase around it
            around.progressed(now, counts=not entry.at_least_s)

    def limit_s(self, entry: Open) -> tuple[float, str]:
        """How long `entry` may go without progress, and why that long."""
        runs = self.history.get(entry.path, ())
        if len(runs) < HANG_WARMUP:
            limit = self.first_s
            times = f"{len(runs)} time{'' if len(runs) == 1 else 's'}"
            why = f"hang_first_s: it has run {times} before, fewer than {HANG_WARMUP}"
        else:
            median = statistics.median(runs)
            limit = max(self.min_s, self.factor * median)
            why = f"hang_factor {self.factor:g} x its median {median:.3g} s, at least hang_min_s {self.min_s:g} s"
        if entry.at_least_s > limit:
            return entry.at_least_s, "its own bound, reward.timeout_s per call"
        return limit, why

    def watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            now, open_ = time.monotonic(), list(self.open)
            if self.rank == 0:
                self._note(open_, now)
            if self.factor <= 0:
                continue
            bounded = next((k for k, entry in enumerate(open_) if entry.at_least_s), 0)
            for entry in open_[bounded:]:  # around a bounded phase, nothing is judged while it runs
                limit, why = self.limit_s(entry)
                if entry.without_progress(now) > limit:
                    self._hang(open_[-1], entry, now, limit, why)

    def _note(self, open_: list[Open], now: float) -> None:
        """phase.json: the innermost phase that has lasted PHASE_NOTE_S (not its short parts, such as
        forward passes), or none; written when that changes."""
        lasting = next((entry for entry in reversed(open_) if now - entry.started >= PHASE_NOTE_S), None)
        if lasting is self.noted:
            return
        self.noted = lasting
        if lasting is None:
            timeline.note_phase(self.folder, None, None, since=time.time())
        else:
            since = time.time() - (now - lasting.started)
            timeline.note_phase(self.folder, " > ".join(lasting.path), lasting.step, since=since)

    def _hang(self, inner: Open, entry: Open, now: float, limit: float, why: str) -> None:
        seconds = _seconds(entry.without_progress(now))
        how = (f"has run {seconds}" if entry.progress == entry.started
               else f"has gone {seconds} since a part of it ended")
        said = (f"hang in {inner.where()}: rank {self.rank}'s {entry.path[-1]} {how}, "
                f"more than {_seconds(limit)} ({why})")
        print(f"{said}; the Python stacks of its threads:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        print(said, flush=True)  # rank 0's stdout is what a local `run` shows
        stacks = "each rank's Python stacks are in its .err log"
        if self.rank != 0:
            # Rank 0 decides (requeue or fail), and a requeue ends this process. Leaving now would
            # break its collective with an error instead of letting it see the hang.
            time.sleep(min(limit, GRACE_S) + 10)
            _fail(self.folder, self.rank, f"{said}; {stacks}")
        hangs = sum(attempt.ended == timeline.HUNG for attempt in timeline.attempts(self.folder))
        timeline.record(self.folder, timeline.HANG, step=inner.step, phase=" > ".join(inner.path))
        if hangs >= self.max_retries:
            failing = (f"the stage hung {hangs + 1} time{'s' if hangs else ''}, more than cluster.max_retries "
                       f"({self.max_retries}): failing")
            print(f"hang in {inner.where()}: {failing}", file=sys.stderr, flush=True)
            _fail(self.folder, self.rank, f"{said}. {failing[0].upper()}{failing[1:]}; {stacks}{_advice(why)}")
        print(f"hang in {inner.where()}: requeueing ({hangs + 1} of cluster.max_retries {self.max_retries})",
              flush=True)
        if self.runtime is not None:
            self.runtime.hush_requeue()  # the lines above say what it is: not a preemption
        from stages import preemption

        try:
            preemption.requeue_through(self.requeue_handler, self.requeue_signal)
        except Exception as err:  # noqa: BLE001 -- e.g. scontrol refused: the job must still end, saying why
            _fail(self.folder, self.rank, f"{said}; requeueing failed ({type(err).__name__}: {err}). {stacks}")


def _advice(why: str) -> str:
    """What to change if the phase was only slow, by the limit it ran past."""
    if why.startswith("hang_first_s"):
        return ". If that phase is only slow, not stuck, raise hang_first_s"
    if why.startswith("hang_factor"):
        return ". If that phase is only slow, not stuck, raise hang_min_s or hang_factor"
    return ""


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 100 else f"{value:.1f} s"


def _fail(folder, rank: int, message: str) -> None:
    """Record the hang as this rank's failure (what `run` and `status` say), and leave."""
    failure.record_exception(folder, rank, Hang(message), log=None)
    sys.stdout.flush()
    os._exit(1)


def _test_hang(rank: int) -> tuple[int, float] | None:
    """(step, seconds) from PIPELINE_TEST_HANG="RANK:STEP:SECONDS" for this rank; test-only."""
    value = os.environ.get(TEST_HANG_ENV)
    if not value:
        return None
    who, step, seconds = value.split(":")
    return (int(step), float(seconds)) if int(who) == rank else None
