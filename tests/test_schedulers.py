"""A scheduler is one package (schedulers/): its declaration, its node half and its executor.

Only a scheduler's package reads its environment, names its signals and commands, or imports
submitit; a scheduler declared in one package outside the project (tests/fake_scheduler/: plain
subprocesses, its own variables for rank, job and restarts, its own requeue signal and exit code)
runs a stage, requeued once, with no other file knowing it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import schedulers
from core import failure, timeline
from core.runfolder import StageFolder
from schedulers.base import Scheduler
from tests.conftest import (
    PACKAGES,
    REPO,
    copy_of_the_code,
    plugins_importable,
    read_result,
    run_cli,
    tiny_pipeline,
    write_pipeline,
)

# What only one scheduler's package may name, and which: Slurm's variables and its task launcher,
# submitit's variables and its requeue signal (both shipped schedulers run their jobs through it).
OWNED = {
    r"SLURM_|\bsrun\b": "schedulers/slurm/",
    r"SUBMITIT_|SIGUSR2|^\s*(?:import|from) submitit\b": "schedulers/",
}


def named_outside_their_scheduler(root: Path) -> list[str]:
    """`path:line: what` for each scheduler-owned name in a module outside its owner."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for pattern, owner in OWNED.items():
                    match = re.search(pattern, line)
                    if match and not relative.startswith(owner):
                        found.append(f"{relative}:{number}: {match.group(0).strip()}")
    return found


def test_only_a_schedulers_package_names_its_variables_signals_and_commands():
    found = named_outside_their_scheduler(REPO)
    assert not found, ("a scheduler's environment, signal or command named outside its package: ask its node "
                       "half (schedulers.runtime()) or its executor instead:\n  " + "\n  ".join(found))


def test_the_scan_finds_a_planted_name(tmp_path):
    copy_of_the_code(tmp_path)
    assert named_outside_their_scheduler(tmp_path) == []
    planted = tmp_path / "stages" / "runner.py"
    lines = len(planted.read_text().splitlines())
    planted.write_text(planted.read_text() + "import submitit\nRESTARTS = 'SLURM_RESTART_COUNT'\n")
    moved = tmp_path / "schedulers" / "local" / "node.py"
    moved.write_text(moved.read_text() + "LAUNCHER = 'srun'\n")
    assert named_outside_their_scheduler(tmp_path) == [
        f"schedulers/local/node.py:{len(moved.read_text().splitlines())}: srun",
        f"stages/runner.py:{lines + 1}: import submitit", f"stages/runner.py:{lines + 2}: SLURM_"]


def test_a_scheduler_name_declared_twice_is_refused():
    known = schedulers.get("slurm")
    assert schedulers.register(known) is known  # its package imported again
    with pytest.raises(ValueError, match="scheduler 'slurm' is declared twice"):
        schedulers.register(Scheduler("slurm", executor="my_lab.scheduler:Executor", runtimes=()))


def test_an_unknown_executor_is_refused_naming_the_executors(workdir):
    config = write_pipeline(workdir, tiny_pipeline(cluster={"executor": "slurn"}))
    done = run_cli("validate", config, cwd=workdir)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cluster.executor: no executor 'slurn' (did you mean 'slurm'?); executors: local, slurm" in done.stderr


@pytest.fixture
def fake_scheduler():
    """tests/ importable here and in the stage's tasks; the fake scheduler forgotten afterwards."""
    with plugins_importable():
        yield
    schedulers.unregister("fake")
    for module in [m for m in sys.modules if m.startswith("tests.fake_scheduler")]:
        sys.modules.pop(module)


@pytest.mark.slow
@pytest.mark.stack_free
def test_a_scheduler_in_one_package_runs_a_stage_requeued_at_its_own_signal(workdir, fake_scheduler, monkeypatch):
    from tests.fake_scheduler import node, submit

    steps = 24
    stage = {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama",
             "data": {"path": "builtin:digits", "eval_split": "eval"}, "max_steps": steps}
    config = write_pipeline(workdir, tiny_pipeline(cluster={"executor": "fake"}, plugins=["tests.fake_scheduler"],
                                                   stages=[stage], defaults={"log_interval": 1}))
    monkeypatch.setenv(submit.PREEMPT_ENV, "3")
    done = run_cli("run", config, cwd=workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    folder = StageFolder(workdir / "runs" / "t" / "sft")
    job = json.loads((workdir / "runs" / "t" / "pipeline.json").read_text())["stages"]["sft"]["job_id"]
    first, second = timeline.attempts(folder)
    # Its own job id and restart count; saved at its own signal, on every rank at the same step, and resumed there.
    assert (first.job_id, first.restart, second.job_id, second.restart) == (job, 0, job, 1)
    assert (first.ended, first.signal) == (timeline.PREEMPTED, "SIGXCPU")
    assert 3 <= first.at_step < steps and second.resumed_from == first.at_step
    training = [json.loads(line)["step"] for line in folder.metrics.read_text().splitlines() if '"lr"' in line]
    assert training == list(range(1, steps + 1))  # every step logged once
    assert read_result(folder.path)["world_size"] == 2 and failure.read(folder) == []
    for rank in (0, 1):  # its rank and layout from its own variables, its logs where it names them
        log = node.FakeTask.task_log(folder.logs, job, rank).with_suffix(".out").read_text()
        assert len(re.findall(rf"rank {rank} of 2 on .* \(local rank {rank} of 2\) via fake", log)) == 2, log[-2000:]

    status = json.loads(run_cli("status", config, "--json", cwd=workdir).stdout)["stages"][0]
    assert status["state"] == "finished"
    assert f"requeued 1x: preempted (SIGXCPU) at step {first.at_step}, resumed from step {first.at_step}" \
        in status["detail"]
