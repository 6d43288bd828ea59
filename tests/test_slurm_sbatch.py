"""What gets submitted to Slurm, without a cluster: the batch script, the container
command and the sbatch options.

The golden file pins the whole batch script of a representative stage (DPO on 2
nodes x 8 GPUs, in a container, after its upstream job): a change to what gets
submitted shows up as a diff here. After an intended change, regenerate it with
    PIPELINE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_slurm_sbatch.py
and review the diff.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from core import config as config_module
from pipeline import graph
from schedulers.slurm import submit as slurm
from tests.conftest import REPO, run_cli, tiny_pipeline, write_pipeline

GOLDEN = REPO / "tests" / "golden" / "dpo-2n8g-container.sbatch"

REPRESENTATIVE = {
    "name": "llama34b-dpo",
    "container": "images/pinned.sif",
    "apptainer": {"binds": ["/scratch/shared:/shared:ro"], "options": ["--writable-tmpfs"]},
    "cluster": {
        "executor": "slurm",
        "partition": "gpu",
        "account": "my-lab",
        "qos": "high",
        "constraint": "a100-80gb",
        "gpu": "a100-80gb",
        "gpus_per_node": 8,
        "cpus_per_task": 12,
        "mem": "900G",
        "time": "2-00:00:00",
        "setup": ["module load cuda/12.1"],
        "env": {"NCCL_DEBUG": "WARN"},
        "sbatch": {"exclusive": True, "reservation": "dpo-week"},
        "hf_home": "/shared/hf-cache",
    },
    "defaults": {"precision": "bf16", "zero_stage": 3, "gradient_checkpointing": True, "max_len": 2048},
    "stages": [
        {"name": "sft", "kind": "sft", "model": "codellama/CodeLlama-34b-hf",
         "data": {"path": "data/instructions.jsonl"}, "global_batch_size": 128},
        {"name": "dpo", "kind": "dpo", "from": "sft", "data": {"path": "data/preferences.jsonl"},
         "nodes": 2, "beta": 0.1, "reference": "offload", "optimizer_offload": True},
    ],
}


@pytest.fixture
def login_node(workdir, monkeypatch):
    """A folder to submit from, with data and image files, and srun/sbatch on PATH."""
    (workdir / "data").mkdir()
    for name in ("instructions.jsonl", "preferences.jsonl"):
        (workdir / "data" / name).write_text("")
    (workdir / "images").mkdir()
    (workdir / "images" / "pinned.sif").write_text("")
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "sbatch"):  # never called here: a fresh CI machine may have no Slurm yet
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    return workdir


def tasks_of(spec_dict):
    spec = config_module.PipelineSpec.model_validate(spec_dict)
    return spec, {t.name: t for t in graph.build_tasks(spec)}


def batch_script(spec, task, after):
    return slurm.sbatch_script(slurm.slurm_executor(spec, task, after))


def test_the_batch_script_of_a_two_node_container_stage_matches_the_golden_file(login_node):
    spec, tasks = tasks_of(REPRESENTATIVE)
    text = batch_script(spec, tasks["dpo"], after=["1234"])
    text = text.replace(str(login_node), "/home/me/project").replace(str(REPO), "/opt/post-train")
    if os.environ.get("PIPELINE_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_a_container_stage_runs_python_inside_apptainer_with_gpus_and_binds(login_node):
    spec, tasks = tasks_of(REPRESENTATIVE)
    command = shlex.split(slurm.job_python(spec, tasks["dpo"]))
    assert command[:3] == ["apptainer", "exec", "--nv"]
    assert command[-2:] == [str(login_node / "images" / "pinned.sif"), "python"]
    binds = command[command.index("--bind") + 1].split(",")
    assert binds == [
        str(login_node),  # where `run` ran: relative paths, runs/ (upstream models, outputs), data/
        "/shared/hf-cache",  # what `prepare` fetched
        str(REPO),  # this code, also on PYTHONPATH
        "/scratch/shared:/shared:ro",  # the pipeline file's own
    ]
    assert f"PYTHONPATH={REPO}" in command
    assert "--writable-tmpfs" in command


def test_data_and_runs_outside_the_submit_folder_are_bound_too(login_node, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "prefs.jsonl").write_text("")
    spec_dict = {**REPRESENTATIVE, "runs_dir": str(elsewhere / "runs")}
    spec_dict["stages"] = [REPRESENTATIVE["stages"][0],
                           {**REPRESENTATIVE["stages"][1], "data": {"path": str(elsewhere / "data" / "prefs.jsonl")}}]
    spec, tasks = tasks_of(spec_dict)
    command = shlex.split(slurm.job_python(spec, tasks["dpo"]))
    binds = command[command.index("--bind") + 1].split(",")
    assert binds[:4] == [str(login_node), str(elsewhere / "runs" / "llama34b-dpo"), "/shared/hf-cache",
                         str(elsewhere / "data")]


def test_without_gpus_the_container_gets_no_nv(login_node):
    spec_dict = {**REPRESENTATIVE, "cluster": {**REPRESENTATIVE["cluster"], "gpus_per_node": 0}}
    spec, tasks = tasks_of(spec_dict)
    assert "--nv" not in shlex.split(slurm.job_python(spec, tasks["dpo"]))


def test_without_a_container_the_job_runs_this_python(login_node):
    spec_dict = {k: v for k, v in REPRESENTATIVE.items() if k != "container"}
    spec, tasks = tasks_of(spec_dict)
    assert slurm.job_python(spec, tasks["dpo"]) == shlex.quote(sys.executable)
    assert "apptainer" not in batch_script(spec, tasks["dpo"], after=[])


def test_only_a_downstream_job_waits_and_is_killed_when_its_upstream_fails(login_node):
    spec, tasks = tasks_of(REPRESENTATIVE)
    first = batch_script(spec, tasks["sft"], after=[])
    second = batch_script(spec, tasks["dpo"], after=["1234", "1235"])
    assert "--dependency" not in first and "--kill-on-invalid-dep" not in first
    assert "#SBATCH --dependency=afterok:1234:1235\n" in second
    assert "#SBATCH --kill-on-invalid-dep=yes\n" in second


def test_jobs_run_offline_from_the_cache_prepare_filled(login_node):
    spec, tasks = tasks_of(REPRESENTATIVE)
    text = batch_script(spec, tasks["sft"], after=[])
    for line in ("export HF_HOME=/shared/hf-cache", "export HF_HUB_OFFLINE=1",
                 "export HF_DATASETS_OFFLINE=1"):
        assert line + "\n" in text


def test_a_stage_job_is_requeueable_and_warned_in_time_to_save_before_its_time_limit(login_node):
    spec, tasks = tasks_of(REPRESENTATIVE)
    text = batch_script(spec, tasks["sft"], after=[])
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --time=2880\n" in text
    # CodeLlama-34B full fine-tuning in bf16 on one node: 33.7e9 params x 14 B (weights, fp32 master,
    # Adam m and v) = 472 GB at 1 GB/s = 472 s; the lead is twice that, a step and a margin.
    lead = int(re.search(r"#SBATCH --signal=USR2@(\d+)\n", text).group(1))
    assert 2 * 470 + 60 < lead < 1400, lead
    # cluster.requeue_signal_s, when set, is taken as it is.
    fixed = {**REPRESENTATIVE, "cluster": {**REPRESENTATIVE["cluster"], "requeue_signal_s": 300}}
    spec, tasks = tasks_of(fixed)
    assert "#SBATCH --signal=USR2@300\n" in batch_script(spec, tasks["sft"], after=[])


def test_the_local_python_gets_the_deepspeed_op_cache_passed_on(login_node, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/opt/ops")
    spec_dict = {k: v for k, v in REPRESENTATIVE.items() if k != "container"}
    spec, tasks = tasks_of(spec_dict)
    assert "export TORCH_EXTENSIONS_DIR=/opt/ops\n" in batch_script(spec, tasks["sft"], after=[])


def test_an_sbatch_option_the_pipeline_sets_itself_is_refused_with_the_field_to_use(workdir):
    spec = tiny_pipeline(cluster={"executor": "slurm", "sbatch": {"partition": "gpu"}})
    result = run_cli("validate", write_pipeline(workdir, spec), cwd=workdir)
    assert result.returncode == 2
    assert "cluster.sbatch" in result.stderr and "use cluster.partition" in result.stderr


def test_a_missing_container_image_is_refused_before_anything_is_submitted(login_node):
    spec = tiny_pipeline(cluster={"executor": "slurm"}, container="images/missing.sif")
    result = run_cli("run", write_pipeline(login_node, spec), cwd=login_node)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "container: image images/missing.sif not found" in result.stderr
    assert not (login_node / "runs").exists()
