"""Plan versus measured: the planner's prediction for each stage, saved into the stage's
folder when it is submitted (plan.json), and the run's own numbers beside it in result.json.

Torch-free: `run` saves the plans on the submit host; the stage job (rank 0) adds the
comparison to result.json from its metrics.jsonl; `report` and `docs` read both back.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from statistics import fmean

from core import kinds
from core import metrics as records
from core.runfolder import StageFolder
from core.task import is_finished

GiB = 1024**3
# The numbers compared, in the units metrics.jsonl uses.
COMPARED = ("gpu_mem_peak_gib", "host_mem_gib", "step_s", "tokens_per_s", "mfu", "token_efficiency")


def save_plans(planned, plan_json: dict | None) -> None:
    """Write each submitted stage's plan (`plan_json`: the planner's JSON, as `plan --json` prints
    it) into its folder. A pipeline the planner could not estimate (`plan_json` None, e.g. a model
    whose shape is not known) gets no plan.json: the run goes on, and its result.json says `planned: null`."""
    if plan_json is None:
        return
    entries = {e["stage"]: e for e in plan_json["stages"]}
    saved_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    for item in planned:
        if item.action == "skip" or item.task.name not in entries:
            continue
        folder = item.task.folder
        folder.path.mkdir(parents=True, exist_ok=True)
        _write_atomically(folder.plan, {"saved_at": saved_at, **entries[item.task.name]})


def planned_numbers(plan_entry: dict) -> dict:
    """The prediction of one stage's plan.json, in metrics.jsonl's units (GiB, seconds).
    Time, tokens/s and MFU are null where the planner gives no time (a CPU run, an unknown GPU)."""
    time_ = plan_entry.get("time") or {}
    gpu, host = plan_entry.get("gpu") or {}, plan_entry.get("host") or {}
    gib = lambda n: None if n is None else n / GiB  # noqa: E731
    return {
        "unit": time_.get("unit", kinds.get(plan_entry.get("kind", "sft")).unit),
        "gpu_mem_peak_gib": gib(gpu.get("peak_bytes")),  # null for a CPU run
        "host_mem_gib": gib(host.get("peak_bytes")),
        "step_s": time_.get("step_s"),
        "tokens_per_s": time_.get("tokens_per_s"),
        "mfu": time_.get("mfu"),
        "token_efficiency": time_.get("token_efficiency") or _simulated_efficiency(plan_entry.get("batches")),
    }


def _simulated_efficiency(batches: dict | None) -> float | None:
    """Real / processed tokens of the planner's simulated micro batches (known without a GPU)."""
    if not batches or not batches.get("processed_tokens_per_step"):
        return None
    return batches["real_tokens_per_step"] / batches["processed_tokens_per_step"]


def measured_numbers(training: list[dict], kind: str) -> dict:
    """The run's numbers: peaks are the largest over its records (GPU: the largest process;
    host: per node), rates the mean over its records after the first, which also holds
    start-up costs (when there is only one, that one). A PPO stage's unit is the rollout."""
    steady = training[1:] or training

    def mean(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return fmean(values) if values else None

    def peak(key):
        values = [r[key] for r in training if r.get(key) is not None]
        return max(values) if values else None

    rollout = kinds.get(kind).rollouts
    return {
        "unit": kinds.get(kind).unit,
        "gpu_mem_peak_gib": peak("gpu_mem_peak_gib"),
        "gpu_mem_reserved_gib": peak("gpu_mem_reserved_gib"),
        "host_mem_gib": peak("host_rss_gib"),
        "step_s": mean("rollout_s" if rollout else "step_s"),
        "tokens_per_s": mean("tokens_per_s"),
        "mfu": mean("mfu"),
        "token_efficiency": mean("token_efficiency"),
        "records": len(training),
    }


def plan_vs_measured(folder: StageFolder, kind: str) -> dict:
    """What result.json records beside the stage's own metrics: {"measured": ..., "planned": ...}."""
    plan_entry = read_json(folder.plan)
    training = records.training(records.read(folder.metrics))
    return {
        "measured": measured_numbers(training, kind),
        "planned": planned_numbers(plan_entry) if plan_entry else None,
    }


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _write_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- a whole run, in one table row

def run_summary(tasks) -> dict | None:
    """A finished chain in a few words, from its stages' result.json (the README's measured
    columns): hardware, wall time of its stages, peak memory, each stage's headline result.
    None unless every stage finished."""
    if not all(is_finished(t) for t in tasks):
        return None
    # every stage finished, so each has its result.json
    results = [(t, read_json(t.folder.result) or {}) for t in tasks]
    devices = results[0][1].get("devices") or {}
    world = results[0][1].get("world_size")
    if devices.get("type") == "cuda":
        hardware = f"{world} x {devices.get('name')}"
    else:
        hardware = f"CPU ({devices.get('name') or 'unknown'}), {world} processes"
    peaks = [(r.get("measured") or {}) for _, r in results]
    gpu = [p["gpu_mem_peak_gib"] for p in peaks if p.get("gpu_mem_peak_gib") is not None]
    host = [p["host_mem_gib"] for p in peaks if p.get("host_mem_gib") is not None]
    memory = [f"{max(gpu):.1f} GiB GPU per process"] if gpu else []
    memory += [f"{max(host):.1f} GiB host per node"] if host else []
    headline = []
    for task, result in results:
        key = kinds.get(task.stage.kind).headline
        if key in result:
            headline.append(f"{task.name} {key}={records.number_text(result[key])}")
    finished = max(t.folder.result.stat().st_mtime for t in tasks)
    return {
        "hardware": hardware,
        "seconds": round(sum(r.get("seconds", 0.0) for _, r in results), 1),
        "peak_memory": ", ".join(memory) or None,
        "result": ", ".join(headline),
        "date": time.strftime("%Y-%m-%d", time.localtime(finished)),
    }
