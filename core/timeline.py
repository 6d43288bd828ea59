"""When each stage of a chain was queued, starting, running, requeued and done, from its
folder and pipeline.json: what the report draws as the chain's timeline.

Each start of a stage job (the first, and every requeue or resume) appends lines to the
stage's events.jsonl: "launched" as its processes begin, before they import anything,
"started" once they have joined up (imports and op builds done). Submission times come
from pipeline.json (Slurm) or from spec.json, written just before a stage is submitted.
A job is queued from its submission to its launch (waiting for the scheduler), starting
from its launch to its first metrics record (imports, op builds, loading the model and
data, its first evaluation), then running to its newest record; done is when result.json
was written. Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import schedulers
from core import metrics as records
from core.failure import task_job_id
from core.runfolder import StageFolder, temporary

QUEUED, STARTING, RUNNING, REQUEUED, DONE = "queued", "starting", "running", "requeued", "done"
# Rank 0 of a stage job records "launched" first thing, "started" once the processes are up.
LAUNCHED = "launched"
# A local `run` that got a signal (signal: its name, e.g. SIGTERM from `kill`) notes it before it
# asks its stage to stop, which it does with SIGINT: the stage's lines name the signal received.
STOP_ASKED = "stop asked"
# Events a stage's rank 0 records besides "started": the loop saved at a signal (signal, step,
# reason), a resume (step), a hang (phase, step: stages/watchdog.py), a requeue asked for by the
# scheduler's handler of its requeue signal (reason; stages/runner.py: after a save at the signal or a
# hang it adds nothing).
STARTED, SAVED_AT_SIGNAL, RESUMED, HANG, REQUEUE = "started", "saved at signal", "resumed", "hang", "requeue"
# Why an attempt of a stage's job ended and the job started again.
TIME_LIMIT, PREEMPTED, HUNG, UNEXPLAINED = "time limit", "preempted", "hang", "ended without a word (node failure?)"
STOPPED = "stopped"  # SIGINT: a user's Ctrl-C, or a local `run` stopping (stages/preemption.py)


def restart_count() -> int:
    """How many times the scheduler has started this job before (0 outside a scheduler's job), the
    same in every rank."""
    runtime = schedulers.runtime()
    return runtime.restart_count() if runtime is not None else 0


def record_start(folder: StageFolder) -> None:
    """Rank 0 of a stage job says it started (one line per attempt)."""
    record(folder, STARTED, host=socket.gethostname(), job_id=task_job_id(), restart_count=restart_count())


def record(folder: StageFolder, event: str, **fields) -> None:
    """Rank 0 of a stage job notes a moment (STARTED, SAVED_AT_SIGNAL, RESUMED, HANG, REQUEUE).
    The stage goes on when the line cannot be written (a full disk): it says so in the log."""
    line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n"
    try:
        with open(folder.events, "a") as f:
            f.write(line)
    except OSError as err:
        print(f"could not note '{event}' in {folder.events}: {err}", file=sys.stderr, flush=True)


def stop_signal(folder: StageFolder) -> str:
    """The signal a SIGINT to this attempt of the stage stands for: the one its local `run` got
    when that run asked it to stop (STOP_ASKED), else SIGINT itself (a Ctrl-C reaches the stage
    directly)."""
    name = "SIGINT"
    for event in _events(folder):
        if event.get("event") == LAUNCHED:
            name = "SIGINT"
        elif event.get("event") == STOP_ASKED:
            name = event.get("signal") or name
    return name


def signal_reason(signal_name: str, elapsed_s: float, time_limit_min: float | None,
                  requeue_signal: str | None) -> str:
    """Why the scheduler signalled a job `elapsed_s` into its attempt. SIGTERM is preemption (or a
    cancel). Its `requeue_signal` comes both ahead of the time limit (Slurm's --signal) and on
    preemption where the site sends it: judged as submitit does for its own requeue count
    (cluster.max_requeues), a time limit once the attempt has run 80% of its limit or is within 10
    minutes of it. SIGINT is a stop."""
    if signal_name == "SIGINT":
        return STOPPED
    if signal_name != requeue_signal or not time_limit_min:
        return PREEMPTED
    limit_s = 60.0 * time_limit_min
    return TIME_LIMIT if elapsed_s >= min(0.8 * limit_s, limit_s - 600) else PREEMPTED


@dataclass
class Attempt:
    """One start of a stage job and how it ended."""

    job_id: str | None
    started: float
    restart: int = 0  # the scheduler's restart count of this start
    resumed_from: int | None = None  # the step resumed from; None: from the start
    ended: str | None = None  # TIME_LIMIT, PREEMPTED, STOPPED, HUNG or UNEXPLAINED; None: the newest, or the job's last
    signal: str | None = None
    at_step: int | None = None  # the step saved at the signal, or the hung step
    phase: str | None = None  # where it hung, e.g. "evaluation > generation"

    def text(self) -> str:
        what = self.ended or ""
        if self.signal:
            what += f" ({self.signal})"
        if self.phase:
            what += f" in {self.phase}"
        if self.at_step is not None:
            what += f" at step {self.at_step}"
        return what


def attempts(folder: StageFolder) -> list[Attempt]:
    """Every start of the stage's newest job, oldest first, each with how it ended: an attempt
    followed by another start of the same job without a word of why ended UNEXPLAINED (the node
    failed, or the job was killed and Slurm requeued it). Earlier jobs (earlier `run`s) are left out."""
    found: list[Attempt] = []
    for event in _events(folder):
        kind = event.get("event")
        if kind == STARTED:
            job = event.get("job_id", event.get("slurm_job_id"))
            if found and found[-1].job_id != job:
                found = []  # a new submission: its history starts here
            if found and found[-1].ended is None:
                found[-1].ended = UNEXPLAINED
            restart = event.get("restart_count", event.get("slurm_restart_count"))  # the older name
            found.append(Attempt(job, float(event["time"]), int(restart or 0)))
        elif not found:
            continue
        elif kind == RESUMED:
            found[-1].resumed_from = event.get("step")
        elif found[-1].ended is not None:
            continue  # the first word of why counts (a requeue after a save at the signal says nothing new)
        elif kind == SAVED_AT_SIGNAL:
            found[-1].ended = event.get("reason") or PREEMPTED
            found[-1].signal, found[-1].at_step = event.get("signal"), event.get("step")
        elif kind == HANG:
            found[-1].ended, found[-1].at_step, found[-1].phase = HUNG, event.get("step"), event.get("phase")
        elif kind == REQUEUE:
            found[-1].ended = event.get("reason") or PREEMPTED
            found[-1].signal = event.get("signal")
    return found


def _events(folder: StageFolder) -> list[dict]:
    try:
        lines = folder.events.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


@dataclass
class PhaseNote:
    """The phase a stage's rank 0 is in, noted once it has lasted a while (stages/watchdog.py)."""

    phase: str | None  # e.g. "evaluation > generation"; None: between phases
    step: int | None
    since: float  # unix seconds

    def text(self, now: float | None = None) -> str:
        """`in evaluation > generation at step 40 for 2:15`; "" between phases."""
        if not self.phase:
            return ""
        age = max(0.0, (now if now is not None else time.time()) - self.since)
        step = "" if self.step is None else f" at step {self.step}"
        return f"in {self.phase}{step} for {records.duration_text(age)}"


def note_phase(folder: StageFolder, phase: str | None, step: int | None, since: float) -> None:
    """Rank 0's watchdog notes the phase it is in (None: it ended); a note that cannot be written
    is left out, said in the log."""
    tmp = temporary(folder.phase)
    try:
        tmp.write_text(json.dumps({"phase": phase, "step": step, "since": round(since, 3)}))
        os.replace(tmp, folder.phase)
    except OSError as err:
        print(f"could not note the phase in {folder.phase}: {err}", file=sys.stderr, flush=True)


def phase_now(folder: StageFolder) -> PhaseNote | None:
    """The phase the newest attempt of the stage's job noted (None: none noted since it started)."""
    try:
        note = PhaseNote(**json.loads(folder.phase.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    history = attempts(folder)
    return note if history and note.since >= history[-1].started else None


def starts(folder: StageFolder) -> list[float]:
    """When each attempt of the stage's job started, oldest first."""
    return sorted(float(e["time"]) for e in _events(folder) if e.get("event") == STARTED)


def interruptions(folder: StageFolder) -> str:
    """What status says of a stage job's requeues: how many, why each attempt ended and where
    the next one resumed, e.g. "requeued 1x: preempted (SIGTERM) at step 12, resumed from step
    12; hang at step 30" (the second attempt hung and failed); "" if nothing happened."""
    said = []
    history = attempts(folder)
    for k, attempt in enumerate(history):
        if attempt.ended is None:
            continue
        text = attempt.text()
        if k + 1 < len(history):
            after = history[k + 1].resumed_from
            text += f", resumed from step {after}" if after is not None else ""
        said.append(text)
    if not said:
        return ""
    return (f"requeued {len(history) - 1}x: " if len(history) > 1 else "") + "; ".join(said)


def attempt_seconds(folder: StageFolder) -> float:
    """How long the newest attempt of the stage job has run (from rank 0's start record)."""
    history = attempts(folder)
    return time.time() - history[-1].started if history else 0.0


def unexplained_endings(folder: StageFolder, job: str | None, restart: int) -> int:
    """How many attempts of job `job` before its start number `restart` ended without a word:
    what cluster.max_retries bounds besides hangs (every rank computes the same, whenever it
    reads the file, since it counts only earlier starts)."""
    history = [a for a in attempts(folder) if a.job_id == job and a.restart < restart]
    if history and history[-1].ended is None:  # the one before this start: it ended without a word too
        history[-1].ended = UNEXPLAINED
    return sum(a.ended == UNEXPLAINED for a in history)


@dataclass
class Segment:
    state: str  # queued, starting, running, requeued (between an attempt's last sign of life and the next launch)
    start: float
    end: float


@dataclass
class StageTimeline:
    stage: str
    segments: list[Segment]
    done: float | None  # when result.json was written; None if not (yet)


def segments(submitted: float | None, attempts: list[float], activity: list[float],
             done: float | None, launches: Sequence[float] = ()) -> list[Segment]:
    """The states of one stage over time. `attempts`: start times of its job's attempts;
    `activity`: times it was seen working (its metrics records); `done`: when it finished;
    `launches`: when each attempt's processes began (an attempt without one began at its start)."""
    attempts = sorted(attempts)
    began = []
    for k, start in enumerate(attempts):
        launched = [t for t in launches if (k == 0 or attempts[k - 1] < t) and t <= start]
        began.append(max(launched, default=start))
    out: list[Segment] = []
    if submitted is not None and began and submitted < began[0]:
        out.append(Segment(QUEUED, submitted, began[0]))
    for k, start in enumerate(attempts):
        following = began[k + 1] if k + 1 < len(began) else None
        seen = sorted(t for t in activity if start <= t and (following is None or t < following))
        end = done if following is None and done is not None else max([start] + seen)
        first = seen[0] if seen else end
        out.append(Segment(STARTING, began[k], first))
        if seen:
            out.append(Segment(RUNNING, first, end))
        if following is not None:
            out.append(Segment(REQUEUED, end, following))
    return out


def stage_timeline(folder: StageFolder, submitted_at: str | None = None) -> StageTimeline:
    """A stage's timeline from its folder; `submitted_at`: pipeline.json's submission time, if any."""
    submitted = _parse(submitted_at) if submitted_at else _mtime(folder.spec)
    activity = [float(r["time"]) for r in records.read(folder.metrics) if "time" in r]
    done = _mtime(folder.result)
    launches = [float(e["time"]) for e in _events(folder) if e.get("event") == LAUNCHED]
    return StageTimeline(folder.path.name, segments(submitted, starts(folder), activity, done, launches), done)


def _parse(stamp: str) -> float | None:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _mtime(path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
