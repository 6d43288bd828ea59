"""Preemption on a real Slurm cluster: USR2 mid-training of a DPO stage makes every rank save a checkpoint
at the same step (stages/preemption.py), the job requeues itself, and the requeued job
resumes from exactly that step: no step lost or repeated, the same per-step losses as an
uninterrupted run.

`scancel --signal=USR2` is what Slurm sends before a time limit (--signal=USR2@N)
and on preemption; sending it ourselves makes the moment deterministic. The same
stage also runs uninterrupted, beside it, as the reference. (tests/test_preemption.py
signals SFT and RL stages of a local run; a hang is tested here, at the end.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import processes_with, read_metrics, read_result, run_cli, write_pipeline
from tests.slurm_support import (
    job_ids,
    last_training_step,
    scontrol_job,
    sft_stage,
    slurm_cluster,  # noqa: F401 -- fixture
    slurm_pipeline,
    stage_on_digits,
    wait_for_file,
    wait_until_settled,
)

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY, LOG_EVERY = 120, 100, 1
SIGNAL_AFTER = 30  # steps; a periodic checkpoint only comes at 100: the one resumed from is the signal's
STAGE = "dpo"
LOSS_RTOL = 1e-5  # fp32 on CPU, same data order and generators: equal to float32 rounding


@pytest.fixture(scope="module")
def preempted(slurm_cluster, tmp_path_factory):  # noqa: F811 -- the imported slurm_cluster fixture
    spec = slurm_pipeline(
        stages=[stage_on_digits(STAGE, "dpo", STEPS)],
        defaults={"save_interval": SAVE_EVERY, "log_interval": LOG_EVERY},
    )
    runs = {}
    for name in ("uninterrupted", "preempted"):
        workdir = tmp_path_factory.mktemp(name)
        config = write_pipeline(workdir, spec)
        result = run_cli("run", config, cwd=workdir, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[name] = (workdir, config)

    workdir, config = runs["preempted"]
    job = job_ids(workdir)[STAGE]
    stage_dir = workdir / "runs" / "t" / STAGE
    wait_for_file(stage_dir / "metrics.jsonl")
    deadline = time.time() + 180
    while (signalled_at := last_training_step(stage_dir)) < SIGNAL_AFTER:
        assert time.time() < deadline, "the stage did not reach the step to signal at"
        time.sleep(0.2)
    signalled_time = time.time()
    subprocess.run(["scancel", "--signal=USR2", job], check=True)

    settled = {name: wait_until_settled(w, c) for name, (w, c) in runs.items()}
    return dict(
        job=job,
        stage_dir=stage_dir,
        reference_dir=runs["uninterrupted"][0] / "runs" / "t" / STAGE,
        settled=settled,
        signalled_at=signalled_at,
        signalled_time=signalled_time,
        log=(stage_dir / "logs" / f"{job}_0_log.out").read_text(),
    )


def processes_of_job(job: str) -> list[int]:
    """The pids of the job's processes on this machine (the batch script, srun, the ranks)."""
    found = list(processes_with("SLURM_JOB_ID", job))
    assert found, f"no process of job {job}"
    return found


def test_usr2_requeues_the_same_job(preempted):
    stage = preempted["settled"]["preempted"][STAGE]
    assert stage["state"] == "finished"
    assert stage["job_id"] == preempted["job"]
    assert stage["restarts"] == 1
    assert "requeueing; the job will resume from checkpoint step-" in preempted["log"]


def test_the_requeued_job_resumes_from_the_step_it_saved_at_the_signal(preempted):
    saved = re.findall(r"checkpoint at step (\d+) saved", preempted["log"])
    resumed = re.findall(r"resumed from checkpoint step-(\d+)", preempted["log"])
    assert len(saved) == 1 and len(resumed) == 1 and int(resumed[0]) == int(saved[0])  # 0 steps lost
    # Saved at the signal (the metrics said signalled_at when USR2 was sent), not at a periodic step.
    assert preempted["signalled_at"] <= int(saved[0]) < SAVE_EVERY
    assert len(re.findall(rf"stage {STAGE} \({STAGE}\): rank 0 of 2", preempted["log"])) == 2  # two starts
    # metrics.jsonl: every training step logged once, the evaluation before training once.
    metrics = read_metrics(preempted["stage_dir"])
    assert [m["step"] for m in metrics if "loss" in m] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert [m["step"] for m in metrics if "eval_loss" in m] == [0, STEPS]


def test_the_resumed_run_ends_where_an_uninterrupted_one_does(preempted):
    assert preempted["settled"]["uninterrupted"][STAGE]["state"] == "finished"
    resumed, reference = read_result(preempted["stage_dir"]), read_result(preempted["reference_dir"])
    assert resumed["steps"] == reference["steps"] == STEPS
    assert resumed["eval_loss"] < 0.5 * resumed["initial_eval_loss"]  # it did train
    for key in ("eval_loss", "eval_reward_accuracy", "eval_margin"):
        assert resumed[key] == pytest.approx(reference[key], rel=LOSS_RTOL), key


def test_the_figures_of_a_preemption(preempted):
    """Printed for the record (pytest -s): the save's time, signal to saved, saved to the requeued
    job's start, steps lost."""
    events = [json.loads(line) for line in (preempted["stage_dir"] / "events.jsonl").read_text().splitlines()]
    saved = next(e for e in events if e["event"] == "saved at signal")
    restarted = [e for e in events if e["event"] == "started"][1]
    resumed = next(e for e in events if e["event"] == "resumed")
    save_s = float(re.search(r"checkpoint at SIGUSR2 took ([0-9.]+) s", preempted["log"]).group(1))
    figures = {"stage": STAGE, "steps_lost": saved["step"] - resumed["step"], "checkpoint_save_s": save_s,
               "signal_to_saved_s": round(saved["time"] - preempted["signalled_time"], 2),
               "saved_to_requeued_start_s": round(restarted["time"] - saved["time"], 2)}
    print("preemption figures:", json.dumps(figures))
    assert figures["steps_lost"] == 0 and 0 <= figures["signal_to_saved_s"] < 30


def test_every_step_has_the_loss_of_the_uninterrupted_run(preempted):
    mine = [m for m in read_metrics(preempted["stage_dir"]) if "loss" in m]
    theirs = [m for m in read_metrics(preempted["reference_dir"]) if "loss" in m]
    assert [m["step"] for m in mine] == [m["step"] for m in theirs] == list(range(1, STEPS + 1))
    for a, b in zip(mine, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9), a["step"]


# --------------------------------------------------------------------------- a hang

HANG_STEP, HANG_SAVE_EVERY = 12, 6  # the requeued attempt times 5 steps (7..11) before hanging again


def test_a_hung_stage_is_requeued_then_fails_after_max_retries_and_status_says_hang(slurm_cluster, tmp_path):  # noqa: F811 -- the imported slurm_cluster fixture
    # PIPELINE_TEST_HANG (test-only, stages/watchdog.py): rank 1 sleeps inside step HANG_STEP, every attempt.
    spec = slurm_pipeline(
        stages=[sft_stage("sft", HANG_STEP + 2)],
        cluster={"max_retries": 1, "env": {"PIPELINE_TEST_HANG": f"1:{HANG_STEP}:600"}},
        defaults={"save_interval": HANG_SAVE_EVERY, "log_interval": 1, "hang_factor": 5, "hang_min_s": 3},
    )
    config = write_pipeline(tmp_path, spec)
    result = run_cli("run", config, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    job = job_ids(tmp_path)["sft"]
    stage = wait_until_settled(tmp_path, config)["sft"]
    assert stage["state"] == "failed" and stage["job_id"] == job
    assert stage["restarts"] == 1  # one requeue (max_retries 1), then the second hang fails it
    hung = f"hang in training step at step {HANG_STEP}"
    assert f"requeued 1x: {hung}, resumed from step {HANG_SAVE_EVERY}; {hung}" in stage["detail"]
    logs = tmp_path / "runs" / "t" / "sft" / "logs"
    errors = (logs / f"{job}_0_log.err").read_text() + (logs / f"{job}_1_log.err").read_text()
    assert errors.count(f"{hung}: rank 0") == 2 and errors.count(f"{hung}: rank 1") == 2
    assert 'watchdog.py", line' in errors and "in enter" in errors  # rank 1's stack: asleep in the hook
    assert "more than cluster.max_retries (1): failing" in errors


# --------------------------------------------------------------------------- a node failure


def test_a_job_whose_node_fails_is_requeued_and_counts_against_max_retries(slurm_cluster, tmp_path):  # noqa: F811 -- the imported slurm_cluster fixture
    # A node that dies: the job's processes stop dead (SIGSTOP, so they cannot act on the SIGTERM
    # that marking the node down sends), the node is marked down, which makes Slurm requeue the job
    # (--requeue, JobRequeue=1), and the processes are killed. With max_retries 0 the requeued start
    # refuses to go on and says why; its dependants are cancelled.
    spec = slurm_pipeline(stages=[sft_stage("sft", 400), sft_stage("after", 5, **{"from": "sft"})],
                          cluster={"max_retries": 0}, defaults={"save_interval": 20, "log_interval": 1})
    config = write_pipeline(tmp_path, spec)
    result = run_cli("run", config, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    job = job_ids(tmp_path)["sft"]
    stage_dir = tmp_path / "runs" / "t" / "sft"
    wait_for_file(stage_dir / "metrics.jsonl")
    deadline = time.time() + 180
    while last_training_step(stage_dir) < 25:  # past the checkpoint at 20
        assert time.time() < deadline, "the stage did not reach step 25"
        time.sleep(0.2)
    node = scontrol_job(job)["NodeList"]
    frozen = processes_of_job(job)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=test-node-failure"], check=True)
    for pid in frozen:
        os.kill(pid, signal.SIGKILL)
    try:
        settled = wait_until_settled(tmp_path, config)
    finally:
        # Back in service (ReturnToService=2 may have done it already, which makes RESUME an error).
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
    stage = settled["sft"]
    assert stage["state"] == "failed" and stage["job_id"] == job and stage["restarts"] == 1, stage
    assert "ended without a word (node failure?)" in stage["detail"]
    assert "more than cluster.max_retries (0)" in stage["detail"]
    assert settled["after"]["state"] == "cancelled", settled["after"]
