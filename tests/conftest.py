"""Shared test helpers: write pipeline files, run the CLI as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


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


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path
