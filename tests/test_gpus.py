"""GPUs: a stage gets the GPUs its pipeline asks for, or stops and says why; it never trains
on the CPU instead. (This machine has none: the GPU side of each rule is checked where a
GPU node runs the suite; here, the refusals and what reaches submitit.)"""

from __future__ import annotations

from tests.conftest import run_cli, tiny_pipeline, write_pipeline


def test_a_stage_task_that_asked_for_gpus_and_finds_none_fails_instead_of_training_on_the_cpu(workdir, monkeypatch):
    # `run-stage` is what a Slurm task runs: no pre-flight check, the task itself must refuse.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    path = write_pipeline(workdir, tiny_pipeline(cluster={"gpus_per_node": 1, "tasks_per_node": 1}))
    result = run_cli("run-stage", path, "sft", cwd=workdir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "asked for GPUs (cluster.gpus_per_node: 1)" in result.stderr
    assert "does not fall back to the CPU" in result.stderr
    assert not (workdir / "runs" / "t" / "sft" / "result.json").exists()
