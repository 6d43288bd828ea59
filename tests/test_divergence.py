"""A stage whose weights stop being numbers stops there, on every process, before it saves or
exports them, and says in which steps and what to change (stages/engine.py `Numbers`). Real
DeepSpeed on 2 gloo processes; the nan comes from tests/diverging_kind.py, on rank 0's weights."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import plugins_importable, run_cli, tiny_pipeline, write_pipeline

pytestmark = pytest.mark.slow


def diverging_run(tmp_path, **defaults):
    stage = {"name": "sft", "kind": "sft_diverging", "diverge_at": 3, "model": "builtin:tiny-llama",
             "data": {"path": "builtin:digits", "eval_split": "eval"}, "max_steps": 8}
    spec = tiny_pipeline(stages=[stage], defaults=defaults, plugins=["tests.diverging_kind"])
    with plugins_importable():
        result = run_cli("run", write_pipeline(tmp_path, spec), cwd=tmp_path, timeout=600)
    stage_dir = tmp_path / "runs" / "t" / "sft"
    return result, result.stdout + result.stderr, stage_dir


def records(stage_dir) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.stack_free  # the records' check; the weights' checks below read DeepSpeed's and transformers' tensors
def test_a_nan_in_a_training_record_stops_the_stage_before_it_exports(tmp_path):
    result, output, stage_dir = diverging_run(tmp_path, log_interval=5, save_interval=0)
    assert result.returncode == 1, output[-3000:]
    assert "failed: diverged on rank" in output and "training diverged: loss nan" in output, output[-3000:]
    assert "in steps 1-5, and the weights are no longer numbers" in output
    assert "a lower learning_rate (0.003 now)" in output and "no checkpoint of it was saved" in output
    assert "Traceback" not in result.stdout
    # The record that showed it is kept; nothing after it ran, nothing was exported.
    last = records(stage_dir)[-1]
    assert last["step"] == 5 and math.isnan(last["loss"])
    assert not (stage_dir / "model").exists() and not (stage_dir / "result.json").exists()


def test_the_weights_are_looked_at_before_each_save_by_every_process(tmp_path):
    # ZeRO-3, saves at steps 2 and 4, no record before 10: after step 3 only rank 0's share of the
    # weights is nan. Both processes stop before saving step 4 (one saving alone would hang), and
    # step 2's checkpoint stays the newest.
    result, output, stage_dir = diverging_run(tmp_path, zero_stage=3, log_interval=10, save_interval=2)
    assert result.returncode == 1, output[-3000:]
    assert "the weights stopped being numbers in steps 1-4 (found before saving step 4)" in output, output[-3000:]
    assert "its newest checkpoint, step-00000002, is from before" in output
    checkpoints = stage_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002"]
    assert not (stage_dir / "model").exists()


def test_a_stage_that_starts_from_weights_that_are_not_numbers_stops_before_training(tmp_path):
    # As a stage would that starts from a diverged export of an earlier one (written before this check).
    import torch
    from transformers import AutoModelForCausalLM

    from core import tiny

    broken = tmp_path / "broken"
    tiny.write_tiny_llama(broken)
    model = AutoModelForCausalLM.from_pretrained(broken)
    with torch.no_grad():
        model.model.norm.weight[0] = math.nan
    model.save_pretrained(broken)
    stage = {"name": "sft", "kind": "sft", "model": str(broken),
             "data": {"path": "builtin:digits", "eval_split": "eval"}, "max_steps": 8}
    result = run_cli("run", write_pipeline(tmp_path, tiny_pipeline(stages=[stage])), cwd=tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "the model this stage starts from gives eval loss nan before any training" in output, output[-3000:]
    stage_dir = tmp_path / "runs" / "t" / "sft"
    assert [r["step"] for r in records(stage_dir)] == [0]  # its evaluation, and not one step
    assert not (stage_dir / "model").exists()
