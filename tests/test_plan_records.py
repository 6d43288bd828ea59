"""Every GPU run on record is a test of the planner (benchmarks/gpu/records.py): the plan of the
same case, made here without a GPU, must give the measured step time within +-20% and the
measured reserved GPU peak from 5% under to 10% over. A record added under benchmarks/results/
joins by itself; a model of the GPU that is wrong fails them."""

import dataclasses

import pytest

from benchmarks.gpu import records
from pipeline.plan import rates

RECORDS = records.records()


def test_the_records_cover_both_shapes_and_both_gpus():
    assert {r.gpu for r in RECORDS} == {"h100-80gb", "h200"}
    assert {r.kind for r in RECORDS} == {"project", "slice"}
    assert len(RECORDS) >= 14


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.name)
def test_the_plan_gives_the_recorded_step_time_and_gpu_peak(record):
    compared = records.compare(record)
    if "time" not in record.superseded:
        assert abs(compared["time_error"]) <= records.TIME_TOLERANCE, compared
    if "memory" not in record.superseded:
        assert -records.MEMORY_UNDER <= compared["memory_error"] <= records.MEMORY_OVER, compared


def _failing(monkeypatch, **wrong) -> list[str]:
    built_in = rates.built_in
    monkeypatch.setattr(rates, "built_in", lambda *a, **k: dataclasses.replace(built_in(*a, **k), **wrong))
    return [r.name for r in RECORDS if abs(records.compare(r)["time_error"]) > records.TIME_TOLERANCE]


def test_one_efficiency_for_every_model_fails_the_records(monkeypatch):
    # the planner before the records: every executed FLOP at 27% of the datasheet, nothing else on the
    # GPU, Adam's 34 B/param of traffic, the host's Adam at 2e9 parameters/s
    wrong = _failing(monkeypatch, matmul=rates.Rate(0.27 * 989e12, "wrong"),
                     attention_efficiency={k: rates.Rate(0.27, "wrong")
                                           for k in ("sdpa", "eager", "flash_attention_2")},
                     loss_bytes_per_logit=rates.Rate(0.0, "wrong"), zero3_layer_pass_s=rates.Rate(0.0, "wrong"),
                     step_bytes_per_param={z: rates.Rate(34.0, "wrong") for z in (0, 1, 2)},
                     host_adam_params_per_s=rates.Rate(2e9, "wrong"))
    # the 1B SFT 1.6x optimistic (issue 24), and ZeRO-3 on one GPU twice as slow as planned
    assert {"h100-2026-11-22-s2/run3/project-sft", "h100-2026-11-22-s2/run4/mem-sft-z3"} <= set(wrong), wrong


def test_zero3_without_its_hooks_fails_the_zero3_records(monkeypatch):
    wrong = _failing(monkeypatch, zero3_layer_pass_s=rates.Rate(0.0, "wrong"))
    assert "h100-2026-11-22-s2/run4/mem-sft-z3" in wrong


def test_the_fitted_rates_are_what_the_records_give():
    """rates.py's fitted constants are the least-squares fit over the records, rounded (a record
    added later that moves the fit fails this: refit with `python -m benchmarks.gpu.records fit`)."""
    fitted = records.fit(RECORDS)
    written = {
        "SDPA_MASKED_EFFICIENCY": rates.SDPA_MASKED_EFFICIENCY,
        "LOSS_BYTES_PER_LOGIT": rates.LOSS_BYTES_PER_LOGIT,
        "ZERO3_LAYER_PASS_S": rates.ZERO3_LAYER_PASS_S,
        "LORA_BYTES_PER_ELEMENT": rates.LORA_BYTES_PER_ELEMENT,
        "STEP_BYTES_PER_PARAM[0]": rates.STEP_BYTES_PER_PARAM[0],
        "STEP_BYTES_PER_PARAM[1,2]": rates.STEP_BYTES_PER_PARAM[2],
        "HOST_ADAM_PARAMS_PER_S_PER_CORE": rates.HOST_ADAM_PARAMS_PER_S_PER_CORE,
    }
    assert set(written) == set(fitted)
    for name, value in written.items():
        assert value == pytest.approx(fitted[name], rel=0.03), name


def test_a_record_planned_with_a_calibration_takes_the_rates_it_measured():
    """`python -m benchmarks.gpu.records --calibration FILE`: the same case, the node's rates."""
    from core import calibration
    from tests.test_calibrate import a_calibration

    record = next(r for r in RECORDS if r.gpu == "h100-80gb" and r.kind == "project")
    measured = calibration.from_json(a_calibration(memory_bandwidth_gbs=2589.0 / 2), "a test")
    built_in, calibrated = records.planned(record).time, records.planned(record, measured).time
    assert built_in.calibration is None and calibrated.calibration == "calibrated on gpu07, 2026-11-26"
    # the loss's bytes per logit over half the copy bandwidth the H100's records measured: twice as long
    assert calibrated.compute_terms["loss"] == pytest.approx(2 * built_in.compute_terms["loss"], rel=1e-6)
