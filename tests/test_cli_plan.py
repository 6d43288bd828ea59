"""`plan` on the command line, and `run` refusing what does not fit."""

from __future__ import annotations

import json

from tests.conftest import run_cli, write_pipeline


def dpo_34b(**dpo):
    return {
        "name": "big",
        "cluster": {"executor": "slurm", "gpu": "a100-80gb", "gpus_per_node": 8},
        "defaults": {"precision": "bf16", "zero_stage": 3, "gradient_checkpointing": True,
                     "attention": "flash_attention_2", "max_len": 2048, "micro_batch_size": 1,
                     "global_batch_size": 64},
        "stages": [{"name": "dpo", "kind": "dpo", "model": "codellama/CodeLlama-34b-hf",
                    "data": {"path": "builtin:digits"}, **dpo}],
    }


def test_plan_exits_3_and_names_what_would_make_it_fit(workdir):
    result = run_cli("plan", write_pipeline(workdir, dpo_34b()), cwd=workdir)
    assert result.returncode == 3, result.stderr
    assert "DOES NOT FIT" in result.stdout
    assert "would fit with (cheapest first):" in result.stdout
    assert "reference: precompute" in result.stdout


def test_plan_json_carries_the_same_verdict(workdir):
    result = run_cli("plan", write_pipeline(workdir, dpo_34b(optimizer_offload=True, reference="offload")),
                     "--json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    stage = json.loads(result.stdout)["stages"][0]
    assert stage["fits"] is True
    assert any(w["description"] == "no offload at all (ZeRO-3 alone)" and w["fits"] is False for w in stage["without"])


def test_plan_json_carries_the_predictions_metrics_jsonl_reports(workdir):
    result = run_cli("plan", write_pipeline(workdir, dpo_34b(optimizer_offload=True, reference="offload")),
                     "--json", cwd=workdir)
    stage = json.loads(result.stdout)["stages"][0]
    for key in ("step_s", "mfu", "tokens_per_s", "token_efficiency"):  # the names metrics.jsonl logs
        assert isinstance(stage["time"][key], float), key
    lengths = stage["batches"]["lengths"]
    assert lengths["sampled"] and "builtin:digits" in lengths["source"] and lengths["rows"] == 1000
    assert stage["batches"]["packed"] and stage["batches"]["token_budget"] == 2 * 2048
    assert 0 <= stage["batches"]["padding_share"] <= 0.03


def test_run_refuses_a_stage_that_does_not_fit_before_running_anything(workdir):
    result = run_cli("run", write_pipeline(workdir, dpo_34b()), "--executor", "local", cwd=workdir)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "stage 'dpo' does not fit" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (workdir / "runs").exists()
