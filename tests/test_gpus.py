"""GPUs: a stage gets the GPUs its pipeline asks for, or stops and says why; it never trains
on the CPU instead. (This machine has none: the GPU side of each rule is checked where a
GPU node runs the suite; here, the refusals and what reaches submitit.)"""

from __future__ import annotations

import pytest

from tests.conftest import run_cli, tiny_pipeline, write_pipeline


@pytest.mark.stack_free  # the task's own GPU check, before any model or DeepSpeed engine
def test_a_stage_task_that_asked_for_gpus_and_finds_none_fails_instead_of_training_on_the_cpu(workdir, monkeypatch):
    # `run-stage` is what a Slurm task runs: no pre-flight check, the task itself must refuse.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    path = write_pipeline(workdir, tiny_pipeline(cluster={"gpus_per_node": 1, "tasks_per_node": 1}))
    result = run_cli("run-stage", path, "sft", cwd=workdir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "asked for GPUs (cluster.gpus_per_node: 1)" in result.stderr
    assert "does not fall back to the CPU" in result.stderr
    assert not (workdir / "runs" / "t" / "sft" / "result.json").exists()


# --------------------------------------------------------------------------- the local executor


def local_executor_for(workdir, cluster: dict):
    from core.config import load_pipeline
    from pipeline import graph
    from schedulers.local import submit as local

    spec = load_pipeline(str(write_pipeline(workdir, tiny_pipeline(cluster=cluster))))
    return local.local_executor(spec, graph.build_tasks(spec)[0])


def test_the_gpus_asked_for_reach_submitit_one_process_each(workdir, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parameters = local_executor_for(workdir, {"gpus_per_node": 4, "tasks_per_node": None}).parameters
    assert parameters["gpus_per_node"] == 4
    assert parameters["tasks_per_node"] == 4
    assert parameters["visible_gpus"] == ()  # submitit then gives the job GPUs 0-3


def test_the_gpus_this_machine_was_given_are_the_ones_passed_on(workdir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    parameters = local_executor_for(workdir, {"gpus_per_node": 2, "tasks_per_node": None}).parameters
    assert parameters["gpus_per_node"] == 2
    assert parameters["visible_gpus"] == (4, 5, 6, 7)  # submitit takes the first 2, not GPUs 0 and 1


def test_gpu_uuids_which_submitit_cannot_carry_are_exported_in_the_job(workdir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5c4e,MIG-77a0")
    parameters = local_executor_for(workdir, {"gpus_per_node": 1, "tasks_per_node": None}).parameters
    assert parameters["setup"][-1] == "export CUDA_VISIBLE_DEVICES=MIG-5c4e"


def test_a_cpu_pipeline_asks_submitit_for_no_gpu(workdir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    parameters = local_executor_for(workdir, {"tasks_per_node": 2}).parameters
    assert "gpus_per_node" not in parameters  # submitit hides every GPU from the job
    assert parameters["tasks_per_node"] == 2
