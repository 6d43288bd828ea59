"""slurm/stage.sbatch, for people who sbatch by hand: one stage, srun, one task per process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, read_metrics, read_result, write_pipeline
from tests.slurm_support import (
    last_training_step,
    scontrol_job,
    sft_stage,
    slurm_cluster,  # noqa: F401 -- fixture
    slurm_pipeline,
)

pytestmark = pytest.mark.slow


STEPS, SIGNAL_AFTER = 60, 10


def test_stage_sbatch_runs_one_stage_under_srun_and_saves_at_the_signal(slurm_cluster, tmp_path):  # noqa: F811 -- the imported slurm_cluster fixture
    config = write_pipeline(tmp_path, slurm_pipeline(stages=[sft_stage("sft", STEPS)], defaults={"log_interval": 1}))
    stage = tmp_path / "runs" / "t" / "sft"
    # The script's #SBATCH lines ask for 8 GPUs; the command line overrides them, as documented.
    submit = subprocess.run(
        ["sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15",
         str(REPO / "slurm" / "stage.sbatch"), config.name, "sft"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    # USR2 to the batch script only, as --signal=B:USR2 sends it: the tasks save at their step, it requeues.
    deadline = time.time() + 180
    while last_training_step(stage) < SIGNAL_AFTER:
        assert time.time() < deadline, f"job {job} did not reach step {SIGNAL_AFTER}"
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True)
    deadline = time.time() + 240
    while (state := scontrol_job(job)["JobState"]) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.time() < deadline, f"job {job} still {state}"
        time.sleep(2)
    log = (tmp_path / f"stage-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "rank 0 of 2" in log and "rank 1 of 2" in log and "via srun" in log
    saved = set(re.findall(r"checkpoint at step (\d+) saved", log))  # every rank says so, in one log
    assert len(saved) == 1 and int(min(saved)) >= SIGNAL_AFTER, log[-3000:]
    assert f"resumed from checkpoint step-{int(min(saved)):08d}" in log  # 0 steps lost
    assert [r["step"] for r in read_metrics(stage) if "loss" in r] == list(range(1, STEPS + 1))
    result = read_result(stage)
    assert result["world_size"] == 2
    assert result["final_eval_loss"] < result["initial_eval_loss"]

