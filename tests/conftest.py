"""Shared test helpers: write pipeline files, run the CLI as a user would."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
# The project's packages (each folder with an __init__.py at the top): core, pipeline, schedulers, stages.
PACKAGES = tuple(sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests"))


def copy_of_the_code(root: Path) -> None:
    """The project's packages copied under `root`: where a scan's test plants what it must find."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "configs"))


def tiny_pipeline(name="t", stages=None, **overrides) -> dict:
    """A small pipeline on the built-in tiny model: quick enough for tests."""
    spec = {
        "name": name,
        "cluster": {"executor": "local", "tasks_per_node": 2, "time": "0:20:00"},
        "defaults": {
            "precision": "fp32",
            "zero_stage": 2,
            "max_len": 48,
            "micro_batch_size": 8,
            "learning_rate": 3.0e-3,
            "warmup_steps": 5,
            "log_interval": 5,
            "save_interval": 0,
        },
        "stages": stages
        or [
            {
                "name": "sft",
                "kind": "sft",
                "model": "builtin:tiny-llama",
                "data": {"path": "builtin:digits", "eval_split": "eval"},
                "max_steps": 40,
            }
        ],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


@contextlib.contextmanager
def plugins_importable():
    """tests/ importable here and in the stage jobs, which import a pipeline's plug-ins (the test
    kinds: tests/toy_kind.py, tests/diverging_kind.py, ...) like any pickled code."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        yield


def tiny_rl_stage(reward: dict) -> dict:
    """An RL stage on the built-in tiny model and task, 2 short rollouts: quick, for a stage's
    failures (its reward functions: tests/test_failures.py, tests/test_rewards.py)."""
    return {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama",
            "data": {"path": "builtin:digits", "max_rows": 64}, "advantage": "grpo", "n_samples_per_prompt": 2,
            "rollout_batch_size": 8, "micro_rollout_batch_size": 16, "max_new_tokens": 4, "max_steps": 2,
            "eval_prompts": 8, "reward": reward}


def write_pipeline(folder: Path, spec: dict, filename="pipeline.yaml") -> Path:
    path = folder / filename
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_cli(*args, cwd: Path, timeout=900) -> subprocess.CompletedProcess:
    """python -m pipeline ARGS in `cwd`, as a user would type it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def states_in_report_and_status(config: Path, cwd: Path) -> tuple[dict, dict]:
    """{stage: its state cell in report.html's final-metrics table} and {stage: `status`'s state}."""
    import html
    import re

    assert run_cli("report", config, cwd=cwd).returncode == 0
    statuses = json.loads(run_cli("status", config, "--json", cwd=cwd).stdout)
    page = (Path(statuses["run_dir"]) / "report.html").read_text()
    table = page.split("<h2>Final metrics</h2>")[1].split("</table>")[0]
    cells = re.findall(r"<tr><td>([^<]*)</td><td>[^<]*</td><td>([^<]*)</td>", table)
    return {name: html.unescape(cell) for name, cell in cells}, {s["name"]: s["state"] for s in statuses["stages"]}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def processes_with(variable: str, value) -> dict[int, dict[str, str]]:
    """{pid: environment} of this machine's processes whose environment sets `variable` to `value`."""
    marker = f"{variable}={value}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ:
            found[int(entry.name)] = dict(v.decode(errors="replace").split("=", 1) for v in environ if b"=" in v)
    return found


def written_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a stage still running: its complete lines (none before the file exists)."""
    path = run_dir / "metrics.jsonl"
    found = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            continue
    return found


def read_result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


# The fixtures that run whole pipelines (a chain, a file of several stages, a fleet of DeepSpeed
# processes): (module, fixture). A test that uses one is end-to-end and is marked e2e, so that
# `make test` (-m "not e2e") never starts the run behind it.
E2E_FIXTURES = {
    ("conftest", "tiny_chain"),
    ("test_preference", "dpo_variants"),
    ("test_preemption", "runs"),
    ("test_plan_vs_deepspeed", "measured"),
    ("test_packing", "packed_and_padded"),
    ("test_sequence_parallel", "layouts"),
    ("test_sequence_parallel_rl", "rl_layouts"),
    ("test_checkpoints", "trained"),
    ("test_vllm_engine", "engine_probe"),
    ("test_vllm_rl", "vllm_runs"),
}


def pytest_configure(config):
    """The tests' own DeepSpeed processes (scripts that call init_distributed themselves) find the
    ops where the stages keep them, built by the same ninja (stages/deepspeed_ops.py)."""
    from stages import deepspeed_ops

    os.environ.update(deepspeed_ops.environment())


def pytest_collection_modifyitems(config, items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defined = {(definition.func.__module__.rpartition(".")[2], name)
                   for name, definitions in (info.name2fixturedefs.items() if info else ())
                   for definition in definitions}
        uses = sorted(name for _, name in defined & E2E_FIXTURES)
        if uses and item.get_closest_marker("e2e") is None:
            raise pytest.UsageError(f"{item.nodeid} uses {', '.join(uses)}, an end-to-end run (tests/conftest.py "
                                    "E2E_FIXTURES): mark it e2e, or `make test` starts that run")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# Stand-ins for credentials, set in the environment of the shared tiny-chain run: no file the
# run writes may contain them (tests/test_observe_run.py greps for them).
SECRET_MARKERS = {"HF_TOKEN": "hf_marker_c0ffee_never_written", "WANDB_API_KEY": "wandb_marker_c0ffee_never_written"}


@dataclass
class TinyChain:
    workdir: Path
    runs: Path  # runs/tiny
    stdout: str
    status_while_paused: str  # `python -m pipeline status tiny` while the sft stage was stopped after its first record


@pytest.fixture(scope="session")
def tiny_chain(tmp_path_factory) -> TinyChain:
    """`python -m pipeline run tiny` once per test session (the shipped chain, ~2 min on 2 cores),
    with secrets in its environment; its sft stage is paused (SIGSTOP) after its first training
    record while `status` looks at it, then let go. With parallel workers (pytest-xdist) the
    first worker that needs it runs it, and the others wait for it and read what it left."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_tiny_chain(tmp_path_factory.mktemp("tiny-chain"))
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent / "tiny-chain"  # the workers' common folder
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        told = shared / "told.json"
        if not told.exists():
            shared.mkdir(exist_ok=True)
            chain = run_tiny_chain(shared)
            told.write_text(json.dumps({"stdout": chain.stdout, "status_while_paused": chain.status_while_paused}))
        return TinyChain(shared, shared / "runs" / "tiny", **json.loads(told.read_text()))


def run_tiny_chain(workdir: Path) -> TinyChain:
    import psutil

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **SECRET_MARKERS}
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "tiny"], cwd=workdir, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = workdir / "runs" / "tiny" / "sft" / "metrics.jsonl"
    status = ""
    deadline = time.time() + 300
    while process.poll() is None and time.time() < deadline:
        if metrics.exists() and any('"loss"' in line for line in metrics.read_text().splitlines()):
            jobs = psutil.Process(process.pid).children(recursive=True)
            for job in jobs:
                job.suspend()
            try:
                status = run_cli("status", "tiny", cwd=workdir, timeout=120).stdout
            finally:
                for job in jobs:
                    job.resume()
            break
        time.sleep(0.2)
    stdout, _ = process.communicate(timeout=900)
    assert process.returncode == 0, stdout[-5000:]
    return TinyChain(workdir, workdir / "runs" / "tiny", stdout, status)
