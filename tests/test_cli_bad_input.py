"""Bad input: exit 2, a short message naming what is wrong, no traceback, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli, tiny_pipeline, write_pipeline


def assert_rejected(result, *fragments, workdir=None):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    if workdir is not None:
        assert not (workdir / "runs").exists(), "a rejected pipeline must write nothing"


def run_rejected(workdir, spec_or_text, *fragments):
    path = workdir / "pipeline.yaml"
    if isinstance(spec_or_text, str):
        path.write_text(spec_or_text)
    else:
        write_pipeline(workdir, spec_or_text)
    for command in ("validate", "run"):
        assert_rejected(run_cli(command, path, cwd=workdir), *fragments, workdir=workdir)


def sft_spec(**data):
    spec = tiny_pipeline()
    spec["stages"][0]["data"] = {"path": "builtin:digits", **data}
    return spec


def test_malformed_yaml(workdir):
    run_rejected(workdir, "name: t\nstages: [\n", "malformed YAML at line 3")


def test_unknown_key_with_suggestion(workdir):
    spec = tiny_pipeline(defaults={"micro_batch": 2})
    run_rejected(workdir, spec, "unknown key 'micro_batch'", "did you mean 'micro_batch_size'")


def test_value_out_of_range(workdir):
    spec = tiny_pipeline()
    spec["stages"][0]["learning_rate"] = -1
    run_rejected(workdir, spec, "stages[0] (sft).learning_rate", "greater than 0")


def test_missing_data_file(workdir):
    run_rejected(workdir, sft_spec(path="nowhere/rows.jsonl"), "data file nowhere/rows.jsonl not found")


def test_rows_without_the_configured_keys_name_the_row(workdir):
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}, {"prompt": "e", "answer": "f"}]
    (workdir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_rejected(workdir, sft_spec(path="rows.jsonl"), "row 3", "missing column 'response'", "data.response_key")


def test_row_that_is_not_json_names_the_line(workdir):
    (workdir / "rows.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    run_rejected(workdir, sft_spec(path="rows.jsonl"), "line 2: not valid JSON")


def test_missing_model_folder(workdir):
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = "./models/not-here"
    run_rejected(workdir, spec, "stages[0] (sft).model", "does not exist")


def test_unloadable_model_folder(workdir):
    folder = workdir / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text("{ not json")
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = str(folder)
    run_rejected(workdir, spec, "config.json is not readable JSON")


def test_model_folder_without_weights(workdir):
    folder = workdir / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    spec = tiny_pipeline()
    spec["stages"][0]["model"] = str(folder)
    run_rejected(workdir, spec, "no weights")


def test_unknown_pipeline_name_lists_the_shipped_ones(workdir):
    assert_rejected(run_cli("validate", "no-such-pipeline", cwd=workdir), "no such pipeline file", "tiny")


def test_validate_accepts_the_tiny_pipeline_and_writes_nothing(workdir):
    result = run_cli("validate", "tiny", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "valid pipeline 'tiny'" in result.stdout
    assert not (workdir / "runs").exists()


def test_gpus_asked_of_a_machine_that_shows_none_are_refused_before_anything_runs(workdir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # none visible, whatever this machine has
    path = write_pipeline(workdir, tiny_pipeline(cluster={"gpus_per_node": 2}))
    for command in ("validate", "run"):
        result = run_cli(command, path, cwd=workdir)
        assert_rejected(result, "cluster.gpus_per_node: 2 GPUs asked", "set gpus_per_node: 0", workdir=workdir)
        # What was found: a CPU-only torch, or a CUDA torch with every device hidden.
        assert "has no CUDA support" in result.stderr or "no CUDA device visible (CUDA_VISIBLE_DEVICES='')" \
            in result.stderr, result.stderr


def test_validate_of_a_slurm_pipeline_does_not_look_for_its_gpus_here(workdir):
    path = write_pipeline(workdir, tiny_pipeline(cluster={"executor": "slurm", "gpus_per_node": 8}))
    result = run_cli("validate", path, cwd=workdir)
    assert result.returncode == 0, result.stderr


def test_the_pipeline_package_imports_no_gpu_libraries():
    code = (
        "import sys, pipeline.cli, pipeline.launch, pipeline.graph, pipeline.preflight, stages.runner;"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_missing_reward_function_is_reported_at_validate_time(workdir):
    spec = tiny_pipeline()
    spec["stages"].append({
        "name": "rl", "kind": "ppo", "from": "sft", "data": {"path": "builtin:digits"},
        "advantage": "grpo", "n_samples_per_prompt": 2, "rollout_batch_size": 8, "micro_batch_size": 8,
        "reward": {"rules": [{"function": "rewards/mine.py:score"}]},
    })
    run_rejected(workdir, spec, "stages[1] (rl).reward.rules[0].function", "rewards/mine.py not found")
