"""Helpers for the Slurm tests: the cluster fixture, Slurm pipelines, polling `status`.

The cluster is the one `make test-slurm` brings up (slurm/testcluster/cluster.sh,
two nodes). Without one these tests skip, unless PIPELINE_REQUIRE_SLURM=1 (set by
`make test-slurm`) says a cluster must be there.

No sacct stand-in: a recording fake answers like a cluster without accounting,
so the tests prove the product never needs accounting while Slurm still knows
its jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_pipeline, written_metrics

FINAL_STATES = {"finished", "failed", "cancelled"}
NO_ACCOUNTING_SACCT = """#!/bin/sh
echo "$@" >> "{calls}"
echo "sacct: error: Slurm accounting storage is disabled" >&2
exit 1
"""


def idle_nodes() -> list[str]:
    """Names of the idle nodes of the cluster SLURM_CONF points at; [] when none answers."""
    if not os.environ.get("SLURM_CONF"):
        return []
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({line.split()[0] for line in out.stdout.splitlines() if line.endswith(" idle")})


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The test cluster's node names, with a no-accounting sacct first on PATH."""
    nodes = idle_nodes()
    if not nodes:
        message = "no Slurm test cluster (run `make test-slurm`)"
        if os.environ.get("PIPELINE_REQUIRE_SLURM") == "1":
            pytest.fail(message + ", but PIPELINE_REQUIRE_SLURM=1")
        pytest.skip(message)
    fake_bin = tmp_path_factory.mktemp("no-accounting")
    calls = fake_bin / "sacct-calls.txt"
    (fake_bin / "sacct").write_text(NO_ACCOUNTING_SACCT.format(calls=calls))
    (fake_bin / "sacct").chmod(0o755)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{fake_bin}:{old_path}"
    yield {"nodes": nodes, "sacct_calls": calls}
    os.environ["PATH"] = old_path


def slurm_pipeline(stages=None, **overrides) -> dict:
    """tiny_pipeline on the Slurm executor: 2 tasks per job, CPU, a generous time limit."""
    cluster = {"executor": "slurm", "tasks_per_node": 2, "time": "0:20:00", **overrides.pop("cluster", {})}
    return tiny_pipeline(stages=stages, cluster=cluster, **overrides)


def stage_on_digits(name: str, kind: str, steps=30, **fields) -> dict:
    """A stage of `kind` on the built-in task, from the tiny model or `from` an upstream stage."""
    start = {"from": fields.pop("from")} if "from" in fields else {"model": "builtin:tiny-llama"}
    return {"name": name, "kind": kind, **start, "data": {"path": "builtin:digits", "eval_split": "eval"},
            "max_steps": steps, **fields}


def sft_stage(name="sft", steps=30, **fields) -> dict:
    return stage_on_digits(name, "sft", steps, **fields)


def last_training_step(stage_dir: Path) -> int:
    """The newest training record's step so far (0 before the first)."""
    return max([0] + [record["step"] for record in written_metrics(stage_dir) if "loss" in record])


def status(workdir: Path, config: Path, *args) -> dict:
    """`status --json` by stage name; `args`: what else the pipeline's commands take (--scale-model ...)."""
    result = run_cli("status", config, *args, "--json", cwd=workdir, timeout=120)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return {s["name"]: s for s in json.loads(result.stdout)["stages"]}


def wait_until_settled(workdir: Path, config: Path, timeout_s=300, poll_s=2.0, pipeline="t", args=()) -> dict:
    """Poll `python -m pipeline status --json` until every stage is finished, failed or cancelled.
    While the pipeline's jobs are still queued it waits on squeue instead: each `status` is a
    Python start-up (~1 s of CPU on 2 cores), taken from the stage processes it waits for."""
    deadline = time.time() + timeout_s
    jobs = set(job_ids(workdir, pipeline).values())
    while jobs & set(queued_jobs()) and time.time() < deadline:
        time.sleep(1)
    while True:
        stages = status(workdir, config, *args)
        if all(s["state"] in FINAL_STATES for s in stages.values()):
            return stages
        if time.time() > deadline:
            pytest.fail(f"pipeline did not settle in {timeout_s} s: {json.dumps(stages, indent=1)}\n"
                        + run_cli("status", config, *args, cwd=workdir).stdout)
        time.sleep(poll_s)


def job_ids(workdir: Path, pipeline="t") -> dict[str, str]:
    record = json.loads((workdir / "runs" / pipeline / "pipeline.json").read_text())
    return {name: stage["job_id"] for name, stage in record["stages"].items()}


def scontrol_job(job_id: str) -> dict[str, str]:
    from schedulers.slurm.jobs import parse_scontrol_line

    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True)
    return parse_scontrol_line(out.stdout.strip())


def queued_jobs() -> list[str]:
    """Pending, running and completing jobs."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def newest_job_id() -> int:
    """The highest job id Slurm knows (ids only grow): unchanged = nothing was submitted."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True, check=True)
    return max((int(j) for j in out.stdout.split()), default=0)


def wait_for_file(path: Path, timeout_s=180) -> None:
    deadline = time.time() + timeout_s
    while not path.exists():
        if time.time() > deadline:
            pytest.fail(f"{path} did not appear in {timeout_s} s")
        time.sleep(0.2)
