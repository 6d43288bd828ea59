"""Where an RL rollout's time goes (stages/phases.py, core/metrics.py ROLLOUT_PHASES): phases that add
up to the wall time, the GPU's busy share filed under the phase it was read in (null with no GPU),
the memory-bandwidth ceiling of decoding (core/hardware.py), and the report's per-rollout plot.
The whole chain's records are checked end to end in tests/test_observe_run.py."""

from __future__ import annotations

import base64
import re
import time

import pytest

from core import hardware
from core import metrics as records
from pipeline import report
from stages import phases


def test_nested_phases_count_only_to_the_innermost_and_add_up_to_the_wall_time():
    clock = phases.Clock()
    started = time.perf_counter()
    with clock.phase("other_s"):
        time.sleep(0.02)
        with clock.phase("generate_s"):
            time.sleep(0.05)
            clock.add("gather_s", 0.01)  # a part measured inside a phase: counted apart, not subtracted
        with clock.phase("train_s"):
            time.sleep(0.03)
        time.sleep(0.01)
    wall = time.perf_counter() - started
    seconds, busy = clock.take()
    assert seconds["generate_s"] == pytest.approx(0.05, abs=0.02)
    assert seconds["train_s"] == pytest.approx(0.03, abs=0.02)
    assert seconds["other_s"] == pytest.approx(0.03, abs=0.02)  # 0.02 + 0.01, not the nested phases' time
    assert seconds["gather_s"] == 0.01
    assert sum(seconds[k] for k in records.ROLLOUT_PHASES if k in seconds) == pytest.approx(wall, rel=0.05)
    assert busy == {"overall": None}  # no reader: no busy share, not a zero
    assert clock.take() == ({}, {"overall": None})  # take starts afresh


def test_gpu_readings_are_filed_under_the_phase_running_when_they_were_read():
    # A stand-in for NVML: the GPU looks busy exactly while generation runs.
    clock = phases.Clock(read_busy=lambda: 0.9 if clock._stack[-1:] == ["generate_s"] else 0.2, sample_s=0.005)
    try:
        with clock.phase("other_s"):
            with clock.phase("generate_s"):
                time.sleep(0.15)
            with clock.phase("train_s"):
                time.sleep(0.15)
    finally:
        clock.close()
    _, busy = clock.take()
    assert busy["generate_s"] == pytest.approx(0.9, abs=0.05)
    assert busy["train_s"] == pytest.approx(0.2, abs=0.05)
    assert 0.2 < busy["overall"] < 0.9


def test_without_a_gpu_there_is_no_busy_reader():
    assert phases.nvml_reader("cpu") is None


def test_decoding_is_capped_by_reading_the_weights_once_per_step():
    h200 = hardware.gpu("h200")
    # A 1B model in bf16 (2.5 GB), 128 sequences decoded together: 128 x 4.8 TB/s / 2.5 GB.
    assert hardware.decoding_tokens_per_s_limit(h200, 2.5e9, 128) == pytest.approx(245_760)
    assert hardware.decoding_tokens_per_s_limit(h200, 5e9, 128) == pytest.approx(245_760 / 2)


@pytest.mark.parametrize("key, tag", [("other_s", "time/other_s"), ("gather_s", "time/gather_s"),
                                      ("offload_s", "time/offload_s"),
                                      ("gpu_busy_generate", "gpu_busy/gpu_busy_generate"),
                                      ("generate_bandwidth_fraction", "perf/generate_bandwidth_fraction")])
def test_the_new_rollout_figures_have_their_tensorboard_groups(key, tag):
    assert records.tag(key) == tag


def rollout_records(busy: bool) -> list[dict]:
    out = []
    for i in range(3):
        record = {"step": i + 1, "rollout": i + 1, "generate_s": 1.0, "gather_s": 0.2, "score_s": 0.5,
                  "offload_s": 0.1, "train_s": 2.0, "other_s": 0.1, "rollout_s": 3.6}
        record.update({k: (0.5 if busy else None) for k in records.GPU_BUSY_KEYS})
        out.append(record)
    return out


@pytest.mark.parametrize("busy", [False, True])
def test_the_report_plots_each_rollouts_phases(busy):
    figure = report._phases_figure(rollout_records(busy), "rl rollout phases")
    image = re.match(r"<img alt='([^']*)' src='data:image/png;base64,([^']+)'>", figure)
    alt, data = image.groups()
    assert alt == "rl rollout phases"
    assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    said = figure[image.end():]  # without a GPU, one line says the busy share was not measured
    assert said == ("" if busy else
                    "<p class='note'>GPU busy share: not measured (no GPU, or NVML could not be read)</p>")
