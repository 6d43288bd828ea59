"""The chain on a real Slurm cluster: dependent jobs, failures, re-runs, cancel.

Each stage is a real job of 2 tasks (2 gloo processes) training the tiny model.
The tests wait by polling `python -m pipeline status --json`, as a user would.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import read_result, run_cli, write_pipeline
from tests.slurm_support import (
    job_ids,
    newest_job_id,
    queued_jobs,
    scontrol_job,
    sft_stage,
    slurm_cluster,  # noqa: F401 -- fixture
    slurm_pipeline,
    status,
    wait_until_settled,
)

pytestmark = pytest.mark.slow


def submit(workdir, spec):
    config = write_pipeline(workdir, spec)
    result = run_cli("run", config, cwd=workdir, timeout=120)
    return config, result


# --------------------------------------------------------------------------- a chain that succeeds


@pytest.fixture(scope="module")
def chain(slurm_cluster, tmp_path_factory):  # noqa: F811 -- the imported slurm_cluster fixture
    """sft -> sft2 (starts from sft's model), run to the end."""
    workdir = tmp_path_factory.mktemp("chain")
    spec = slurm_pipeline(stages=[sft_stage("sft", 30), sft_stage("sft2", 10, **{"from": "sft"})])
    config, run = submit(workdir, spec)
    ids = job_ids(workdir) if run.returncode == 0 else {}
    downstream_at_submit = scontrol_job(ids["sft2"]) if ids else {}
    settled = wait_until_settled(workdir, config) if ids else {}
    return dict(workdir=workdir, config=config, run=run, ids=ids, downstream_at_submit=downstream_at_submit,
                settled=settled)


def test_run_submits_the_whole_chain_and_returns(chain):
    run = chain["run"]
    assert run.returncode == 0, run.stdout + run.stderr
    ids = chain["ids"]
    assert set(ids) == {"sft", "sft2"}
    assert f"sft={ids['sft']}" in run.stdout and f"sft2={ids['sft2']}" in run.stdout
    assert str(chain["workdir"] / "runs" / "t") in run.stdout
    # `run` was back before the first stage could have finished: the downstream job was still waiting.
    assert chain["downstream_at_submit"]["JobState"] == "PENDING"


def test_the_downstream_job_waits_for_its_upstream_with_afterok(chain):
    job = chain["downstream_at_submit"]
    assert job["Dependency"] == f"afterok:{chain['ids']['sft']}(unfulfilled)"
    assert job["KillOInInvalidDependent"] == "Yes"  # sic: Slurm's spelling


def test_both_stages_finish_and_the_second_starts_from_the_first(chain):
    assert {name: s["state"] for name, s in chain["settled"].items()} == {"sft": "finished", "sft2": "finished"}
    first, second = (read_result(chain["workdir"] / "runs" / "t" / n) for n in ("sft", "sft2"))
    assert first["world_size"] == second["world_size"] == 2
    # Same eval rows: the second stage's loss before training is the first one's after.
    assert second["initial_eval_loss"] == pytest.approx(first["final_eval_loss"], rel=1e-3)
    assert second["final_eval_loss"] < second["initial_eval_loss"]


def test_running_again_after_success_submits_nothing(chain):
    newest = newest_job_id()
    again = run_cli("run", chain["config"], cwd=chain["workdir"], timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing submitted" in again.stdout
    assert again.stdout.count("skipped") == 2
    assert job_ids(chain["workdir"]) == chain["ids"]
    assert newest_job_id() == newest


def test_the_chain_never_needed_accounting(chain, slurm_cluster):  # noqa: F811 -- the imported slurm_cluster fixture
    # sacct here answers like a cluster without accounting, and records every call.
    assert chain["settled"]
    calls = slurm_cluster["sacct_calls"]
    assert not calls.exists(), calls.read_text()


# --------------------------------------------------------------------------- a chain whose first stage fails


@pytest.fixture(scope="module")
def failed_chain(slurm_cluster, tmp_path_factory):  # noqa: F811 -- the imported slurm_cluster fixture
    """rl fails at run time: its reward function (it imports, so validate passes) raises when
    called; sft2 depends on it."""
    workdir = tmp_path_factory.mktemp("failing")
    (workdir / "reward.py").write_text("def score(prompts, completions, labels):\n"
                                       "    raise ValueError('no score for these rows')\n")
    rl = {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama",
          "data": {"path": "builtin:digits", "eval_split": "eval"}, "advantage": "grpo", "n_samples_per_prompt": 2,
          "rollout_batch_size": 8, "micro_rollout_batch_size": 16, "max_new_tokens": 4, "max_steps": 2,
          "reward": {"rules": [{"function": "reward.py:score"}]}}
    spec = slurm_pipeline(stages=[rl, sft_stage("sft2", 10, **{"from": "rl"})])
    config, run = submit(workdir, spec)
    assert run.returncode == 0, run.stdout + run.stderr
    settled = wait_until_settled(workdir, config)
    text = run_cli("status", config, cwd=workdir)
    return dict(workdir=workdir, settled=settled, text=text, ids=job_ids(workdir))


def test_a_failed_stage_leaves_its_dependants_cancelled(failed_chain):
    settled = failed_chain["settled"]
    assert settled["rl"]["state"] == "failed"
    assert settled["sft2"]["state"] == "cancelled"
    assert settled["sft2"]["detail"] == "not run: upstream rl did not finish"
    assert failed_chain["ids"]["sft2"] not in queued_jobs()


def test_status_names_the_failed_stage_its_log_and_why(failed_chain):
    text = failed_chain["text"]
    assert text.returncode == 1
    job = failed_chain["ids"]["rl"]
    logs = failed_chain["workdir"] / "runs" / "t" / "rl" / "logs"
    assert re.search(rf"log: {re.escape(str(logs))}/{job}_\d+_log\.err", text.stdout), text.stdout
    assert "reward function reward.py:score failed" in text.stdout  # the cause, from the failing rank's record
    assert "no score for these rows" in text.stdout


# --------------------------------------------------------------------------- one chain at a time, cancel


@pytest.fixture(scope="module")
def live_chain(slurm_cluster, tmp_path_factory):  # noqa: F811 -- the imported slurm_cluster fixture
    workdir = tmp_path_factory.mktemp("live")
    spec = slurm_pipeline(stages=[sft_stage("sft", 200), sft_stage("sft2", 10, **{"from": "sft"})])
    config, run = submit(workdir, spec)
    assert run.returncode == 0, run.stdout + run.stderr
    return dict(workdir=workdir, config=config, ids=job_ids(workdir))


def test_a_second_run_is_refused_while_the_chain_is_live(live_chain):
    again = run_cli("run", live_chain["config"], cwd=live_chain["workdir"], timeout=120)
    assert again.returncode == 2
    assert "still live" in again.stderr and "pipeline cancel" in again.stderr
    assert "Traceback" not in again.stderr
    assert job_ids(live_chain["workdir"]) == live_chain["ids"]
    assert newest_job_id() == max(int(j) for j in live_chain["ids"].values())


def test_cancel_stops_every_job_of_the_chain(live_chain):
    result = run_cli("cancel", live_chain["config"], cwd=live_chain["workdir"], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for job in live_chain["ids"].values():
        assert f"cancelled job {job}" in result.stdout
    stages = status(live_chain["workdir"], live_chain["config"])
    assert {name: s["state"] for name, s in stages.items()} == {"sft": "cancelled", "sft2": "cancelled"}
    for job in live_chain["ids"].values():
        assert scontrol_job(job)["JobState"] == "CANCELLED"
        assert job not in queued_jobs()


# --------------------------------------------------------------------------- what sbatch refuses


def test_a_partition_slurm_refuses_exits_2_and_submits_nothing(slurm_cluster, tmp_path):  # noqa: F811 -- the imported slurm_cluster fixture
    spec = slurm_pipeline(stages=[sft_stage("sft", 10), sft_stage("sft2", 10, **{"from": "sft"})],
                          cluster={"partition": "no-such-partition"})
    newest = newest_job_id()
    _, run = submit(tmp_path, spec)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "sbatch refused stage sft" in run.stderr and "partition" in run.stderr
    assert "Traceback" not in run.stderr
    assert newest_job_id() == newest

