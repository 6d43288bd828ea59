"""`status` and the refusal to start a second chain, against stand-in Slurm commands.

Real clusters forget finished jobs (scontrol keeps them MinJobAge seconds) and
some have no accounting (sacct answers nothing). These tests put small scripts
named scontrol / sacct / sbatch first on PATH to play each situation, and check
what `python -m pipeline status|run` make of it.
"""

from __future__ import annotations

import json
import os

import pytest

from core import config as config_module
from pipeline import graph, state
from tests.conftest import run_cli, tiny_pipeline, write_pipeline

FORGOTTEN = 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'
NO_ACCOUNTING = 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1'


@pytest.fixture
def slurm_world(workdir, monkeypatch):
    """A Slurm pipeline whose stage `sft` was submitted as job 12 (per pipeline.json)."""
    config = write_pipeline(workdir, tiny_pipeline(cluster={"executor": "slurm"}))
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def command(name, body):
        """A stand-in for a Slurm command; each call is appended to calls-<name>.txt."""
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "$@" >> "{workdir}/calls-{name}.txt"\n{body}\n')
        path.chmod(0o755)

    def calls(name):
        path = workdir / f"calls-{name}.txt"
        return path.read_text().splitlines() if path.exists() else []

    task = graph.build_tasks(config_module.load_pipeline(str(config)))[0]
    run_dir = workdir / "runs" / "t" / "sft"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps({"spec_hash": task.spec_hash}))
    record = state.RunState(pipeline="t", config=str(config), stages={"sft": state.StageRecord(
        job_id="12", state=state.RUNNING, job_state="RUNNING", spec_hash=task.spec_hash,
        submitted_at=state.now(), logs=str(run_dir / "logs"))})
    state.save(workdir / "runs" / "t", record)
    command("sbatch", "exit 1")
    command("srun", "exit 1")  # `run` checks that both are on PATH before anything else
    return dict(workdir=workdir, config=config, task=task, run_dir=run_dir, command=command, calls=calls)


def status_of(world):
    result = run_cli("status", world["config"], "--json", cwd=world["workdir"])
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)["stages"][0] if result.stdout else result.stderr


def write_failure_log(world):
    (world["run_dir"] / "logs" / "12_0_log.err").write_text(
        "Traceback (most recent call last):\n  File \"sft.py\"\nValueError: 3 training rows are too few\n")


def test_status_asks_scontrol_first_and_not_accounting(slurm_world):
    slurm_world["command"]("scontrol", 'echo "JobId=12 JobState=RUNNING Reason=None Restarts=1 NodeList=n[1-2]"')
    slurm_world["command"]("sacct", NO_ACCOUNTING)
    code, stage = status_of(slurm_world)
    assert code == 0
    assert (stage["state"], stage["job_id"], stage["restarts"]) == ("running", "12", 1)
    assert stage["detail"].startswith("on n[1-2]")
    assert slurm_world["calls"]("sacct") == []


def test_status_falls_back_to_accounting_when_scontrol_forgot_the_job(slurm_world):
    slurm_world["command"]("scontrol", FORGOTTEN)
    slurm_world["command"]("sacct", 'echo "12|OUT_OF_MEMORY|0:125|n1"')
    write_failure_log(slurm_world)
    code, stage = status_of(slurm_world)
    assert code == 1
    assert (stage["state"], stage["job_state"], stage["source"]) == ("failed", "OUT_OF_MEMORY", "slurm")
    assert stage["log"] == str(slurm_world["run_dir"] / "logs" / "12_0_log.err")
    assert stage["log_tail"][-1] == "ValueError: 3 training rows are too few"


def test_without_accounting_a_forgotten_job_that_left_no_result_failed(slurm_world):
    slurm_world["command"]("scontrol", FORGOTTEN)
    slurm_world["command"]("sacct", NO_ACCOUNTING)
    write_failure_log(slurm_world)
    code, stage = status_of(slurm_world)
    assert code == 1
    assert stage["state"] == "failed"
    assert "ended without writing result.json" in stage["detail"]
    assert stage["log_tail"][-1] == "ValueError: 3 training rows are too few"


def test_without_accounting_a_forgotten_job_whose_stage_wrote_its_result_finished(slurm_world):
    slurm_world["command"]("scontrol", FORGOTTEN)
    slurm_world["command"]("sacct", NO_ACCOUNTING)
    result = {"spec_hash": slurm_world["task"].spec_hash, "final_eval_loss": 0.25}
    (slurm_world["run_dir"] / "result.json").write_text(json.dumps(result))
    code, stage = status_of(slurm_world)
    assert code == 0
    assert stage["state"] == "finished" and "final_eval_loss=0.25" in stage["detail"]


def test_pipeline_json_remembers_how_a_job_ended_after_slurm_forgets_it(slurm_world):
    slurm_world["command"]("scontrol", 'echo "JobId=12 JobState=CANCELLED Reason=None ExitCode=0:15"')
    slurm_world["command"]("sacct", NO_ACCOUNTING)
    assert status_of(slurm_world)[1]["state"] == "cancelled"
    slurm_world["command"]("scontrol", FORGOTTEN)
    code, stage = status_of(slurm_world)
    assert (stage["state"], stage["source"]) == ("cancelled", "record")
    assert stage["detail"] == "cancelled (as last seen)"


def test_run_refuses_a_second_chain_while_a_recorded_job_is_live(slurm_world):
    slurm_world["command"]("scontrol", 'echo "JobId=12 JobState=PENDING Reason=BeginTime Restarts=1"')
    result = run_cli("run", slurm_world["config"], cwd=slurm_world["workdir"])
    assert result.returncode == 2
    assert "still live" in result.stderr and "sft (job 12, PENDING)" in result.stderr
    assert slurm_world["calls"]("sbatch") == []


def test_a_local_run_also_refuses_while_a_slurm_chain_trains_into_the_same_folders(slurm_world):
    slurm_world["command"]("scontrol", 'echo "JobId=12 JobState=RUNNING Reason=None"')
    result = run_cli("run", slurm_world["config"], "--executor", "local", cwd=slurm_world["workdir"])
    assert result.returncode == 2 and "still live" in result.stderr


def test_a_slurm_controller_that_does_not_answer_is_reported_not_guessed(slurm_world):
    slurm_world["command"]("scontrol", 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    result = run_cli("status", slurm_world["config"], cwd=slurm_world["workdir"])
    assert result.returncode == 1
    assert "Unable to contact slurm controller" in result.stderr and "Traceback" not in result.stderr


def test_status_of_a_pipeline_never_sent_to_slurm_reads_only_the_run_folder(workdir, monkeypatch):
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\ntouch "{workdir}/scontrol-called"\nexit 1\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    config = write_pipeline(workdir, tiny_pipeline())
    checkpoints = workdir / "runs" / "t" / "sft" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (task,) = graph.build_tasks(config_module.load_pipeline(str(config)))
    (checkpoints.parent / "spec.json").write_text(json.dumps({"spec_hash": task.spec_hash}))
    (checkpoints / "latest").write_text("step-00000020")
    (checkpoints / "step-00000020").mkdir()  # a complete checkpoint: its folder is there
    result = run_cli("status", config, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "not finished" in result.stdout and "checkpoint step-00000020" in result.stdout
    assert not (workdir / "scontrol-called").exists()
    # The outputs of another spec are not resumed: `run` moves them aside, and status says so.
    (checkpoints.parent / "spec.json").write_text(json.dumps({"spec_hash": "another"}))
    result = run_cli("status", config, cwd=workdir)
    assert "moves them aside" in result.stdout and "resumes" not in result.stdout


def test_a_chain_sbatch_refuses_halfway_is_cancelled_not_left_half_submitted(workdir, monkeypatch):
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": "exit 0",
        # The first submission is accepted, the second refused.
        "sbatch": f'if [ -e "{workdir}/accepted" ]; then echo "sbatch: error: Invalid account" >&2; exit 1; fi\n'
                  f'touch "{workdir}/accepted"; echo "Submitted batch job 101"',
        "scancel": f'echo "$@" >> "{workdir}/scancel-calls"',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    stages = [{"name": "sft", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"}},
              {"name": "sft2", "kind": "sft", "from": "sft", "data": {"path": "builtin:digits"}}]
    config = write_pipeline(workdir, tiny_pipeline(stages=stages, cluster={"executor": "slurm"}))
    result = run_cli("run", config, cwd=workdir)
    assert result.returncode == 2
    assert "sbatch refused stage sft2: sbatch: error: Invalid account" in result.stderr
    assert "cancelled the jobs already submitted (101)" in result.stderr
    assert (workdir / "scancel-calls").read_text().split() == ["101"]
    record = state.load(workdir / "runs" / "t")
    assert (record.stages["sft"].job_id, record.stages["sft"].state) == ("101", "cancelled")
