"""When each stage of a chain was queued, running, requeued and done, from its folder
and pipeline.json: what the report draws as the chain's timeline.

Each start of a stage job (the first, and every requeue or resume) appends a line to
the stage's events.jsonl; submission times come from pipeline.json (Slurm) or from
spec.json, written just before a stage is submitted; the last activity is the newest
metrics record; done is when result.json was written. Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from pipeline import metrics as records
from pipeline.runfolder import StageFolder

QUEUED, RUNNING, REQUEUED, DONE = "queued", "running", "requeued", "done"
SAVED_AT_SIGNAL, RESUMED, HANG = "saved at signal", "resumed", "hang"  # events a stage's rank 0 records


def record_start(folder: StageFolder) -> None:
    """Rank 0 of a stage job says it started (one line per attempt)."""
    event = {"event": "started", "time": round(time.time(), 3), "host": socket.gethostname(),
             "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
             "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
    with open(folder.events, "a") as f:
        f.write(json.dumps(event) + "\n")


def record(folder: StageFolder, event: str, **fields) -> None:
    """Rank 0 of a stage job notes a moment: `saved at signal` (signal, step), `resumed` (step),
    `hang` (step: stages/watchdog.py)."""
    with open(folder.events, "a") as f:
        f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


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


def starts(folder: StageFolder) -> list[float]:
    """When each attempt of the stage's job started, oldest first."""
    return sorted(float(e["time"]) for e in _events(folder) if e.get("event") == "started")


def count(folder: StageFolder, event: str) -> int:
    return sum(1 for e in _events(folder) if e.get("event") == event)


def interruptions(folder: StageFolder) -> str:
    """What status says of a stage's requeues: each signal, the step saved at it, the step
    resumed from (e.g. "SIGUSR2 at step 12, resumed from step 12"); "" if none."""
    said = []
    for event in _events(folder):
        if event.get("event") == SAVED_AT_SIGNAL:
            said.append(f"{event['signal']} at step {event['step']}")
        elif event.get("event") == RESUMED:
            said.append(f"resumed from step {event['step']}")
        elif event.get("event") == HANG:
            said.append(f"hang at step {event['step']}")
    return ", ".join(said)


@dataclass
class Segment:
    state: str  # queued, running, requeued (between an attempt's last sign of life and the next start)
    start: float
    end: float


@dataclass
class StageTimeline:
    stage: str
    segments: list[Segment]
    done: Optional[float]  # when result.json was written; None if not (yet)


def segments(submitted: Optional[float], attempts: list[float], activity: list[float],
             done: Optional[float]) -> list[Segment]:
    """The states of one stage over time. `attempts`: start times of its job's attempts;
    `activity`: times it was seen working (its metrics records); `done`: when it finished."""
    out: list[Segment] = []
    attempts = sorted(attempts)
    if submitted is not None and attempts and submitted < attempts[0]:
        out.append(Segment(QUEUED, submitted, attempts[0]))
    for k, start in enumerate(attempts):
        following = attempts[k + 1] if k + 1 < len(attempts) else None
        if following is None:
            end = done if done is not None else max([start] + [t for t in activity if t >= start])
            out.append(Segment(RUNNING, start, end))
            continue
        seen = [t for t in activity if start <= t < following]
        last = max(seen) if seen else start
        out.append(Segment(RUNNING, start, last))
        out.append(Segment(REQUEUED, last, following))
    return out


def stage_timeline(folder: StageFolder, submitted_at: Optional[str] = None) -> StageTimeline:
    """A stage's timeline from its folder; `submitted_at`: pipeline.json's submission time, if any."""
    submitted = _parse(submitted_at) if submitted_at else _mtime(folder.spec)
    activity = [float(r["time"]) for r in records.read(folder.metrics) if "time" in r]
    done = _mtime(folder.result)
    return StageTimeline(folder.path.name, segments(submitted, starts(folder), activity, done), done)


def _parse(stamp: str) -> Optional[float]:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _mtime(path) -> Optional[float]:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
