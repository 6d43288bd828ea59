"""A local run holds its run folder, shows its stage in `status`, and takes its stage
processes down with it however it ends (SIGTERM, or a SIGKILL it cannot react to). Stopped
as a user stops it (Ctrl-C, `kill`), its stage saves at the signal as on Slurm, and the next
run resumes from that step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import processes_with, run_cli, states_in_report_and_status, tiny_pipeline, write_pipeline


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
@pytest.mark.stack_free
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
    assert first.wait(timeout=60) == 128 + signal.SIGTERM, first.stderr.read()
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


def start_in_terminal(config: Path, workdir: Path, out: Path) -> subprocess.Popen:
    """`run` as a terminal starts it: its own process group, which a Ctrl-C signals as a whole;
    what it prints goes to `out` (a file: a pipe nobody reads would fill up and block it)."""
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(config)], cwd=workdir,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def training_steps(path: Path) -> list[int]:
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            continue
        if "loss" in record:
            found.append(record["step"])
    return found


def ctrl_c(run: subprocess.Popen) -> None:
    os.killpg(run.pid, signal.SIGINT)  # what the terminal does: every process of its group


@pytest.mark.slow
# The local executor's signals and the save at them; tests/test_preemption.py saves and resumes at a
# signal on either stack.
@pytest.mark.stack_free
def test_ctrl_c_or_sigterm_saves_at_the_signal_and_the_next_run_resumes_from_that_step(workdir):
    spec = tiny_pipeline(cluster={"tasks_per_node": 1}, defaults={"log_interval": 1, "save_interval": 0})
    spec["stages"][0]["max_steps"] = 100_000  # trains until stopped; no periodic checkpoint
    config = write_pipeline(workdir, spec)
    metrics = workdir / "runs" / "t" / "sft" / "metrics.jsonl"
    out = workdir / "terminal.txt"

    def stop(send, expected_code: int) -> int:
        """Stop a run that trains; the step it saved at, as its last line says."""
        run = start_in_terminal(config, workdir, out)
        seen = len(training_steps(metrics))
        wait_until(lambda: len(training_steps(metrics)) >= seen + 2, 180, "two new training records")
        send(run)
        assert run.wait(timeout=120) == expected_code, out.read_text()
        shown = out.read_text()
        assert "Traceback" not in shown, shown
        last = shown.strip().splitlines()[-1]
        assert last.startswith("[sft] stopped (") and "saved a checkpoint at step" in last, shown
        assert f"python -m pipeline run {config}` resumes from it" in last, last
        step = int(last.split("saved a checkpoint at step ")[1].split()[0])
        assert (workdir / "runs" / "t" / "sft" / "checkpoints" / f"step-{step:08d}").is_dir(), last
        assert not processes_started_by(run.pid)
        return step

    saved = stop(ctrl_c, 128 + signal.SIGINT)
    assert training_steps(metrics)[-1] == saved  # the step it was at when the signal came
    stage = stage_status(config, workdir)
    assert stage["state"] == "cancelled" and f"saved at step {saved}" in stage["detail"], stage
    in_report, in_status = states_in_report_and_status(config, workdir)
    assert in_report["sft"].startswith(f"cancelled, step {saved}/") and "ETA" not in in_report["sft"], in_report
    assert in_status == {"sft": "cancelled"}

    # The next run resumes at the saved step (nothing redone), and stops at `kill` the same way.
    saved_again = stop(lambda run: run.send_signal(signal.SIGTERM), 128 + signal.SIGTERM)
    steps = training_steps(metrics)
    assert steps == list(range(1, saved_again + 1)), steps  # each step once: the resumed run began at saved + 1
    assert saved_again > saved
    assert "resuming sft" in out.read_text()
    # The stage's own lines name the signal `run` got, though `run` stops it with SIGINT.
    assert f"checkpoint at step {saved_again} saved" in out.read_text() and "stopping (SIGTERM)" in out.read_text()
    assert "SIGINT" not in out.read_text(), out.read_text()

    # A second Ctrl-C stops at once, still without a traceback. The tiny stage saves within
    # milliseconds of the first: frozen (SIGSTOP), it stands for a stage whose save takes long.
    run = start_in_terminal(config, workdir, out)
    seen = len(training_steps(metrics))
    wait_until(lambda: len(training_steps(metrics)) >= seen + 1, 180, "a new training record")
    for pid in processes_started_by(run.pid):
        os.kill(pid, signal.SIGSTOP)
    ctrl_c(run)
    time.sleep(1)  # `run` has asked the stage to save
    ctrl_c(run)
    assert run.wait(timeout=60) == 128 + signal.SIGINT, out.read_text()
    shown = out.read_text()
    assert "Traceback" not in shown and "stopped (SIGINT) at once, without saving" in shown, shown
    wait_until(lambda: not processes_started_by(run.pid), 30, "the killed stage processes to end")
