"""The report (pipeline/report.py) on run folders written by hand: what it plots and what it
says it left out, and `run` ending with it. The whole page of a real run: tests/test_observe_run.py."""

from __future__ import annotations

import json

import pytest

from core.config import PipelineSpec
from pipeline import cli, graph, report
from tests.conftest import tiny_pipeline

RL_STAGE = {"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
            "reward": {"rules": [{"rule": "exact_match"}]},
            "max_steps": 3}


def stage_with_records(tmp_path, records: list[dict]):
    """The tasks of a one-stage RL pipeline whose metrics.jsonl holds `records`."""
    spec = PipelineSpec.model_validate({**tiny_pipeline(stages=[RL_STAGE]), "runs_dir": str(tmp_path / "runs")})
    tasks = graph.build_tasks(spec)
    tasks[0].folder.path.mkdir(parents=True)
    tasks[0].folder.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    return spec, tasks


def cpu_rollout(step: int, time: float) -> dict:
    """A rollout's record on a CPU: no GPU busy share, nothing gathered or offloaded, nothing clipped."""
    return {"step": step, "rollout": step, "time": time, "reward": 0.1 * step, "clip_fraction": 0.0,
            "policy_loss": 0.02 / step, "rollout_s": 1.0, "generate_s": 0.2, "score_s": 0.3, "train_s": 0.45,
            "other_s": 0.05, "gather_s": 0.0, "offload_s": 0.0, "gpu_busy_generate": None, "gpu_busy_score": None,
            "gpu_busy_train": None, "gpu_busy_rollout": None, "tokens_per_s": 5000.0 + step, "host_rss_gib": 0.9,
            "gpu_mem_peak_gib": None, "mfu": None}


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the report draws, laid out as its PNG is and kept open to look at."""
    figures = []

    def keep(fig, alt):
        fig.canvas.draw()
        figures.append(fig)
        return f"<img alt='{alt}' src='data:image/png;base64,'>"

    monkeypatch.setattr(report, "_embed", keep)
    yield figures
    import matplotlib.pyplot as plt

    for fig in figures:
        plt.close(fig)


def titles(figures) -> list[str]:
    return [ax.get_title() for fig in figures for ax in fig.axes if ax.get_title()]


def test_a_cpu_run_gets_no_empty_or_all_zero_plot_and_a_line_saying_what_was_left_out(tmp_path, drawn):
    spec, tasks = stage_with_records(tmp_path, [cpu_rollout(k, 1000.0 + k) for k in (1, 2, 3)])
    page = report.render(spec.name, tasks, None)
    shown = titles(drawn)
    assert "train/reward" in shown and "perf/tokens_per_s" in shown
    for left_out in ("train/clip_fraction", "time/gather_s", "time/offload_s", "GPU busy share (NVML utilisation)"):
        assert left_out not in shown
    assert "0 throughout, so not plotted: train/clip_fraction</p>" in page
    assert "0 throughout, so not plotted: time/gather_s, time/offload_s</p>" in page
    assert "GPU busy share: not measured (no GPU, or NVML could not be read)" in page


def test_a_measured_gpu_busy_share_is_plotted_beside_the_phases(tmp_path, drawn):
    busy = [{**cpu_rollout(k, 1000.0 + k), "gpu_busy_generate": 0.4, "gpu_busy_train": 0.9} for k in (1, 2)]
    spec, tasks = stage_with_records(tmp_path, busy)
    page = report.render(spec.name, tasks, None)
    assert "GPU busy share (NVML utilisation)" in titles(drawn)
    assert "GPU busy share: not measured" not in page


@pytest.mark.parametrize("span_s", [0.2, 4.0, 95.0, 1000.0, 40_000.0])
def test_no_two_tick_labels_of_a_plot_run_into_each_other(tmp_path, drawn, span_s):
    # Ten records over span_s seconds: left to itself matplotlib put ten labels such as 0.0035
    # (minutes) under a 3.4-inch memory plot.
    records = [{**cpu_rollout(k, 1000.0 + span_s * k / 9), "host_rss_gib": 0.9 + 0.001 * k} for k in range(1, 11)]
    spec, tasks = stage_with_records(tmp_path, records)
    report.render(spec.name, tasks, None)
    for fig in drawn:
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
                boxes = [t.get_window_extent(renderer) for t in labels if t.get_text()]
                for k, a in enumerate(boxes):
                    assert not any(a.overlaps(b) for b in boxes[k + 1:]), (
                        ax.get_title(), [t.get_text() for t in labels])


def test_run_says_so_and_keeps_its_outcome_when_the_report_cannot_be_written(tmp_path, capsys):
    spec, _ = stage_with_records(tmp_path, [cpu_rollout(1, 1000.0)])
    (spec.run_dir / "report.html").mkdir()  # something that is not a file stands where the report goes
    cli.write_report_after_run(spec, "my.yaml")
    said = capsys.readouterr().out
    assert said.startswith("report: not written (IsADirectoryError: ")
    assert said.rstrip().endswith("`python -m pipeline report my.yaml` tries again")


@pytest.mark.slow
@pytest.mark.stack_free
def test_a_run_whose_stage_failed_ends_with_the_report_of_what_there_is(tmp_path):
    from tests.test_divergence import diverging_run

    result, output, _ = diverging_run(tmp_path, log_interval=5, save_interval=0)
    assert result.returncode == 1, output[-3000:]
    written = (tmp_path / "runs" / "t" / "report.html").resolve()
    assert result.stdout.rstrip().endswith(f"report: {written}"), result.stdout[-2000:]
    page = written.read_text()
    assert "<td>sft</td><td>sft_diverging</td><td>failed, step 5/8" in page and "alt='sft eval'" in page
