"""Reward model and DPO stages through `python -m pipeline run`: real DeepSpeed, 2 processes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

# DPO's reference modes and batch layouts against each other: the pinned stack trains DPO in the tiny chain.
pytestmark = [pytest.mark.slow, pytest.mark.stack_free]


def run_pipeline(workdir, spec_or_name):
    target = spec_or_name if isinstance(spec_or_name, str) else write_pipeline(workdir, spec_or_name)
    result = run_cli("run", target, cwd=workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def dpo_stage(name, **knobs):
    return {
        "name": name,
        "kind": "dpo",
        "model": "builtin:tiny-llama",
        "data": {"path": "builtin:digits", "eval_split": "eval"},
        "max_steps": 20,
        "global_batch_size": 16,
        "learning_rate": 1e-3,
        **knobs,
    }


@pytest.fixture(scope="module")
def dpo_variants(tmp_path_factory):
    """The same DPO run several ways, in one pipeline file (one stage each)."""
    workdir = tmp_path_factory.mktemp("dpo")
    spec = tiny_pipeline(stages=[
        dpo_stage("live"),
        dpo_stage("zero3", zero_stage=3),
        dpo_stage("precompute", reference="precompute"),
        dpo_stage("zero3-precompute", zero_stage=3, reference="precompute"),
        dpo_stage("offload", reference="offload"),
        dpo_stage("accumulate", micro_batch_size=4),
        dpo_stage("padded", packing=False),
    ])
    run_pipeline(workdir, spec)
    return workdir / "runs" / "t"


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def assert_same_curve(a, b, rel):
    curve_a, curve_b = losses(a), losses(b)
    assert sorted(curve_a) == sorted(curve_b) == [5, 10, 15, 20]
    for step in curve_a:
        assert curve_b[step] == pytest.approx(curve_a[step], rel=rel), step
    assert read_result(b)["eval_loss"] == pytest.approx(read_result(a)["eval_loss"], rel=rel)


@pytest.mark.e2e
def test_dpo_learns_from_the_live_reference(dpo_variants):
    result = read_result(dpo_variants / "live")
    assert result["eval_loss"] < result["initial_eval_loss"] - 0.1
    assert result["eval_reward_accuracy"] > 0.8


@pytest.mark.e2e
def test_zero2_and_zero3_give_the_same_dpo_loss_curve(dpo_variants):
    assert_same_curve(dpo_variants / "live", dpo_variants / "zero3", rel=1e-3)


@pytest.mark.e2e
@pytest.mark.parametrize("live, precompute", [("live", "precompute"), ("zero3", "zero3-precompute")])
def test_precomputed_reference_equals_the_live_reference(dpo_variants, live, precompute):
    assert (dpo_variants / precompute / "reference_logps.pt").exists()
    assert_same_curve(dpo_variants / live, dpo_variants / precompute, rel=1e-4)


@pytest.mark.e2e
@pytest.mark.parametrize("precompute", ["precompute", "zero3-precompute"])  # a plain module; a DeepSpeed engine
def test_the_precomputed_reference_is_freed_before_the_policy_loads(dpo_variants, precompute):
    logs = {path.name: path.read_text() for path in (dpo_variants / precompute / "logs").glob("*_log.out")}
    (rank0,) = [text for name, text in logs.items() if name.endswith("_0_log.out")]
    assert "LlamaForCausalLM released: its weights are freed" in rank0
    assert not [name for name, text in logs.items() if "something still holds it" in text]


@pytest.mark.e2e
def test_offloaded_reference_equals_the_live_reference(dpo_variants):
    assert_same_curve(dpo_variants / "live", dpo_variants / "offload", rel=1e-5)


@pytest.mark.e2e
def test_micro_batch_times_accumulation_does_not_change_the_curve(dpo_variants):
    # 8 rows x 2 processes x 1 step  vs  4 rows x 2 processes x 2 accumulated steps
    assert_same_curve(dpo_variants / "live", dpo_variants / "accumulate", rel=1e-4)


@pytest.mark.e2e
def test_packing_does_not_change_the_dpo_curve(dpo_variants):
    assert_same_curve(dpo_variants / "live", dpo_variants / "padded", rel=1e-4)


PAIRS = [
    {"prompt": "a", "chosen": "good", "rejected": "bad"},
    {"prompt": "b", "chosen": "same", "rejected": "same"},
    {"prompt": "c", "chosen": "", "rejected": "bad"},
    {"prompt": "d", "rejected": "bad"},
]


def write_pairs(workdir):
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS * 10))


def test_invalid_preference_rows_are_reported_by_row_number(workdir):
    write_pairs(workdir)
    spec = tiny_pipeline(stages=[dpo_stage("dpo", data={"path": "pairs.jsonl"})])
    result = run_cli("validate", write_pipeline(workdir, spec), cwd=workdir)
    assert result.returncode == 2
    assert "30 invalid rows" in result.stderr
    assert "row 2: chosen and rejected are identical" in result.stderr
    assert "row 3: 'chosen' (data.chosen_key) must be a non-empty string" in result.stderr
    assert "row 4: missing column 'chosen'" in result.stderr
    assert "data.invalid_rows: skip" in result.stderr


@pytest.mark.e2e
def test_lenient_data_handling_skips_invalid_rows_with_a_count(workdir):
    write_pairs(workdir)
    spec = tiny_pipeline(stages=[dpo_stage("dpo", max_steps=2, data={"path": "pairs.jsonl", "invalid_rows": "skip",
                                                                     "eval_fraction": 0.2})])
    spec["defaults"]["micro_batch_size"] = 2
    spec["stages"][0]["global_batch_size"] = 4
    result = run_pipeline(workdir, spec)
    assert "skipped 30 invalid rows" in result.stdout
    assert read_result(workdir / "runs" / "t" / "dpo")["train_pairs"] == 8
