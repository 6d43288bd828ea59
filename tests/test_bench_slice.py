"""The 34B slice of the GPU benchmark (benchmarks/gpu/slice.py): its model, its layer choice,
and the torch-free maths (per-layer fits, the full 34B re-derived), against numbers worked by hand."""

import pytest

from benchmarks.gpu import report
from benchmarks.gpu import slice as slice_34b

GiB = 1024**3


def test_the_slice_keeps_the_real_34b_width_heads_and_vocabulary():
    config = slice_34b.slice_config(7, 2048)
    assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (8192, 22016, 64, 8, 32000)
    assert (config["num_hidden_layers"], config["max_position_embeddings"]) == (7, 2048)
    narrow = slice_34b.slice_config(2, 128, head_dim=2)  # the CPU stand-in: pipeline/scale.py's narrowing
    assert (narrow["hidden_size"], narrow["intermediate_size"], narrow["num_attention_heads"]) == (128, 344, 64)
    assert (narrow["vocab_size"], narrow["num_hidden_layers"]) == (32000, 2)


def test_the_layer_choice_is_the_largest_the_planner_fits():
    choice = slice_34b.choose_layers("h100-80gb", 128 * GiB, 2048)
    assert 1 <= choice["max"] < 48 and choice["half"] == max(1, choice["max"] // 2)
    for planned in choice["planned_at_max"].values():
        assert planned["host_peak_gib"] <= 0.8 * 128 and planned["gpu_peak_gib"] <= 79.2
    # the host RAM binds: twice the RAM fits more layers
    assert slice_34b.choose_layers("h100-80gb", 256 * GiB, 2048)["max"] > choice["max"]


def test_a_line_through_two_points_and_least_squares_through_three():
    assert slice_34b.line([(3, 10.0), (7, 18.0)]) == pytest.approx((4.0, 2.0))
    assert slice_34b.line([(1, 1.0), (2, 3.0), (3, 5.0)]) == pytest.approx((-1.0, 2.0))
    assert slice_34b.line([(3, 10.0), (3, 11.0)]) is None
    assert slice_34b.line([(3, 10.0), (7, None)]) is None


# Hand-worked: GPU seconds per token g = 0.001 + 0.002 L, host seconds per step H = 1 + 0.5 L;
# SFT steps carry 1000 tokens, DPO steps 2000. At L = 2: g = 0.005, H = 2 -> SFT 7 s, DPO 12 s;
# at L = 4: g = 0.009, H = 3 -> SFT 12 s, DPO 21 s. Reserved peak: model states 4 / 6 GiB
# (planner) + rest 6 / 8 GiB (rest = 4 + 1 per layer).
TARGET = {"file": "llama34b_dpo_8xa100.yaml", "gpu": "a100-80gb", "processes": 8, "layers": 48,
          "n_params": 33_743_970_304, "peak_tflops": 312.0, "gpu_peak_gib": 17.3, "host_peak_gib": 589.7,
          "model_states_gib": 8.0, "step_s": 75.3, "tokens_per_step": 8000.0, "tokens_per_s": 1741.0,
          "mfu": 0.147, "model_flops_per_token": 1e9, "exposed_communication_s": 0.5, "cores_per_process": 12}


def _case(kind, layers, step_s, reserved, states):
    tokens = 1000.0 if kind == "sft" else 2000.0
    role = "" if layers == 4 else "-half"
    return {
        "case": f"slice-34b-{kind}{role}", "kind": "slice", "status": "ok", "step_s": step_s,
        "tokens_per_s": tokens / step_s, "gpu_mem_reserved_gib": reserved, "gpu_mem_peak_gib": reserved - 1,
        "datasheet_tflops": 936.0, "steps_measured": 3,
        "settings": {"kind": kind, "zero_stage": 3, "gradient_checkpointing": True, "micro_batch_size": 1,
                     "global_batch_size": 8},
        "slice": {"kind": kind, "layers": layers, "n_params": 10**9, "planner_model_states_gib": states,
                  "tokens_per_step": tokens, "target": {"sft": TARGET, "dpo": {**TARGET, "tokens_per_step": 16000.0}},
                  "choice": {"max": 4, "half": 2, "gpu": "h100-80gb", "gpu_gib": 79.2, "host_gib": 128.0,
                             "host_margin": 0.8, "planned_at_max": {}}},
    }


CASES = [_case("sft", 4, 12.0, 14.0, 6.0), _case("sft", 2, 7.0, 10.0, 4.0),
         _case("dpo", 4, 21.0, 14.0, 6.0), _case("dpo", 2, 12.0, 10.0, 4.0)]


def test_per_layer_figures_are_differences_between_the_layer_counts():
    fits = slice_34b.per_layer(CASES)
    assert fits["sft"]["layers"] == [2, 4]
    assert fits["sft"]["step_s"] == pytest.approx((2.0, 2.5))
    assert fits["dpo"]["step_s"] == pytest.approx((3.0, 4.5))
    assert fits["sft"]["rest_gib"] == pytest.approx((4.0, 1.0))
    assert fits["sft"]["tokens_per_step"] == pytest.approx(1000.0)


def test_the_full_model_is_rederived_from_the_gpu_and_host_parts():
    fits = slice_34b.per_layer(CASES)
    derived = slice_34b.rederive(fits, {"sft": TARGET}, measured_tflops=936.0, measured_cores=16)
    assert derived["split"]["gpu_s_per_token"] == pytest.approx((0.001, 0.002))
    assert derived["split"]["host_s"] == pytest.approx((1.0, 0.5))
    sft = derived["stages"]["sft"]
    # GPU: (0.001 + 0.002 x 48) s/token x 8000 / 8 tokens x 936 / 312 = 291; host: (1 + 0.5 x 48) / 8 of the
    # parameters, on 12 cores per process where the slice's process had 16: 3.125 x 16 / 12 = 4.1667
    assert sft["gpu_s"] == pytest.approx(291.0)
    assert sft["host_s"] == pytest.approx(3.125 * 16 / 12)
    assert sft["step_s"] == pytest.approx(291.0 + 3.125 * 16 / 12 + 0.5)
    assert sft["tokens_per_s"] == pytest.approx(8000 / sft["step_s"])
    assert sft["mfu"] == pytest.approx(8000 / sft["step_s"] * 1e9 / (8 * 312e12))
    # one GPU partitions nothing under ZeRO-3: the peak at 8 ranks is not derived from it
    assert "gpu_peak_gib" not in sft and "one GPU cannot tell" in sft["notes"][0]
    assert len(sft["notes"]) == 1


def test_without_the_machines_cores_the_host_part_is_not_scaled_and_says_so():
    derived = slice_34b.rederive(slice_34b.per_layer(CASES), {"sft": TARGET}, measured_tflops=936.0,
                                 measured_cores=None)
    assert "step_s" not in derived["stages"]["sft"]
    assert "CPU cores are not on record" in derived["stages"]["sft"]["notes"][1]


def test_without_both_stages_the_step_time_is_not_derived_and_says_why():
    derived = slice_34b.rederive(slice_34b.per_layer(CASES[:2]), {"sft": TARGET}, measured_tflops=936.0,
                                 measured_cores=16)
    assert "step_s" not in derived["stages"]["sft"]
    assert "needs slice-34b-sft and slice-34b-dpo" in derived["stages"]["sft"]["notes"][1]


def test_the_report_prints_the_slice_the_per_layer_table_and_the_rederived_plan(monkeypatch):
    # the report sets the re-derived rows beside the planner's plan of the shipped file as it is now
    monkeypatch.setattr(slice_34b, "target_plan",
                        lambda: {"sft": TARGET, "dpo": {**TARGET, "tokens_per_step": 16000.0}})
    env = {"case": "env", "kind": "env", "status": "ok", "facts": {"cpu_count": 16}}
    text = report.render({"runs": [{"device": "cuda"}], "cases": {"env": env, **{c["case"]: c for c in CASES}},
                          "workload": None})
    assert "| slice-34b-sft | 4 |" in text
    assert "| SFT | 2 and 4 | 2.500 | 2.000 |" in text
    assert "| SFT | 295.7 (291.0 + 4.2 + 0.5) |" in text
    missing = report.render({"runs": [{"device": "cuda"}], "cases": {}, "workload": None})
    assert "| slice-34b-dpo-half |" in missing and "not measured: not run" in missing
