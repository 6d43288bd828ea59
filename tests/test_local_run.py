"""A local run holds its run folder, shows its stage in `status`, and takes its stage
processes down with it however it ends (SIGTERM, or a SIGKILL it cannot react to)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import processes_with, run_cli, tiny_pipeline, write_pipeline


def processes_started_by(run_pid: int) -> list[int]:
    """Processes of this machine whose environment names `run_pid` as their local `run`."""
    return list(processes_with("PIPELINE_RUN_PID", run_pid))


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.5)


def records(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def start_run(config: Path, workdir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(config)], cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stage_status(config: Path, workdir: Path) -> dict:
    result = run_cli("status", config, "--json", cwd=workdir)
    return json.loads(result.stdout)["stages"][0]


@pytest.mark.slow
def test_a_local_run_holds_its_folder_and_its_stage_processes_end_with_it(workdir):
    spec = tiny_pipeline(cluster={"tasks_per_node": 1}, defaults={"log_interval": 1})
    spec["stages"][0]["max_steps"] = 100_000  # trains until stopped
    config = write_pipeline(workdir, spec)
    metrics = workdir / "runs" / "t" / "sft" / "metrics.jsonl"

    first = start_run(config, workdir)
    wait_until(lambda: records(metrics) >= 2, 180, "the first training record")
    second = run_cli("run", config, cwd=workdir)
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    stage = stage_status(config, workdir)
    assert stage["state"] == "running" and "step " in stage["detail"] and stage["progress"]["step"] >= 1, stage
    assert processes_started_by(first.pid)

    first.send_signal(signal.SIGTERM)  # `kill`
    assert first.wait(timeout=60) == 130, first.stderr.read()
    assert processes_started_by(first.pid) == []  # `run` waited for them
    stage = stage_status(config, workdir)
    assert stage["state"] == "cancelled" and "interrupted" in stage["detail"], stage

    # A SIGKILLed run cannot stop anything itself: its stage processes notice it is gone.
    before = metrics.stat().st_mtime_ns
    again = start_run(config, workdir)
    wait_until(lambda: metrics.stat().st_mtime_ns != before and records(metrics) >= 2, 180,
               "the second run's first training record")
    assert processes_started_by(again.pid)
    again.kill()
    again.wait(timeout=10)
    wait_until(lambda: not processes_started_by(again.pid), 30, "the orphaned stage processes to end")
    stage = stage_status(config, workdir)
    assert stage["state"] == "failed" and "ended while the stage ran" in stage["detail"], stage
