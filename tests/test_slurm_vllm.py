"""An RL stage sampled by vLLM on the real Slurm test cluster: one job of 2 tasks on one node, a
vLLM engine in each task, their weights split over both (tensor_parallel 2), synced after every
update (`make test-slurm`)."""

from __future__ import annotations

import pytest

from core import rollout_engine
from tests.conftest import read_metrics, read_result, run_cli, write_pipeline
from tests.slurm_support import (
    slurm_cluster,  # noqa: F401 -- fixture
    slurm_pipeline,
    stage_on_digits,
    wait_until_settled,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(rollout_engine.installed() is None,
                                                   reason="vLLM is not installed (the pinned stack has none)")]

ROLLOUTS = 3


def test_a_vllm_rl_stage_runs_in_its_slurm_job_one_engine_per_task(slurm_cluster, tmp_path):  # noqa: F811 -- the imported slurm_cluster fixture
    rl = stage_on_digits("rl", "ppo", ROLLOUTS, generation="vllm", vllm={"tensor_parallel": 2},
                         reward={"rules": [{"rule": "exact_match"}], "normalize": False}, rollout_batch_size=8,
                         n_samples_per_prompt=4, micro_rollout_batch_size=32, max_new_tokens=6,
                         micro_batch_size=16, global_batch_size=32, eval_prompts=16)
    config = write_pipeline(tmp_path, slurm_pipeline(stages=[rl]))
    submitted = run_cli("run", config, cwd=tmp_path, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    settled = wait_until_settled(tmp_path, config, timeout_s=900)
    folder = tmp_path / "runs" / "t" / "rl"
    logs = "".join(p.read_text() for p in (folder / "logs").glob("*_log.out"))
    assert settled["rl"]["state"] == "finished", logs[-5000:]
    assert read_result(folder)["generation"] == "vllm"
    records = [r for r in read_metrics(folder) if "rollout" in r]
    assert [r["rollout"] for r in records] == list(range(1, ROLLOUTS + 1))
    assert all(r["sync_bytes"] > 0 for r in records)
    # rank 0 says so (rank 1 logs warnings only); its engine cannot start without rank 1's half
    assert "tensor_parallel 2) built" in logs, logs[-5000:]
