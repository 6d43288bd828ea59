"""slurm/stage.sbatch, for people who sbatch by hand: one stage, srun, one task per process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, read_result, write_pipeline
from tests.slurm_support import (
    scontrol_job,
    sft_stage,
    slurm_cluster,  # noqa: F401 -- fixture
    slurm_pipeline,
)

pytestmark = pytest.mark.slow


def test_stage_sbatch_runs_one_stage_under_srun(slurm_cluster, tmp_path):
    config = write_pipeline(tmp_path, slurm_pipeline(stages=[sft_stage("sft", 20)]))
    # The script's #SBATCH lines ask for 8 GPUs; the command line overrides them, as documented.
    submit = subprocess.run(
        ["sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15",
         str(REPO / "slurm" / "stage.sbatch"), config.name, "sft"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    deadline = time.time() + 240
    while (state := scontrol_job(job)["JobState"]) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.time() < deadline, f"job {job} still {state}"
        time.sleep(2)
    log = (tmp_path / f"stage-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "rank 0 of 2" in log and "rank 1 of 2" in log and "via srun" in log
    result = read_result(tmp_path / "runs" / "t" / "sft")
    assert result["world_size"] == 2
    assert result["final_eval_loss"] < result["initial_eval_loss"]

