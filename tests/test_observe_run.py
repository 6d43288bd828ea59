"""Seeing a run, end to end, on the one shared run of the shipped tiny chain (tests/conftest.py):
the measured keys in every training record, TensorBoard files that TensorBoard itself reads,
status of a paused stage, plan versus measured in result.json, the HTML report, and no secret
in any file the run wrote."""

from __future__ import annotations

import base64
import importlib.util
import json
import re

import pytest

from core import measured
from core import metrics as records
from tests.conftest import SECRET_MARKERS, read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.stack_free]

STAGES = ("sft", "rm", "dpo", "rl")


def test_every_training_record_of_every_stage_has_the_measured_keys(tiny_chain):
    for stage in STAGES:
        training = records.training(read_metrics(tiny_chain.runs / stage))
        assert training, stage
        for record in training:
            for key in records.MEASURED_KEYS:
                assert key in record, (stage, key)
                # This machine has no GPU: exactly the GPU-only keys are null.
                assert (record[key] is None) == (key in records.GPU_ONLY_KEYS), (stage, key, record[key])
            assert record["host_rss_gib"] > 0.1  # two processes with torch loaded
        assert training[0]["eta_s"] > 0 and training[-1]["eta_s"] == 0.0
        assert training[-1]["step"] == training[-1]["total_steps"]


def test_a_ppo_rollouts_phases_add_up_to_its_wall_time(tiny_chain):
    for record in records.training(read_metrics(tiny_chain.runs / "rl")):
        phases = [record[key] for key in records.ROLLOUT_PHASES]
        assert sum(phases) == pytest.approx(record["rollout_s"], rel=0.05)  # nothing hidden, nothing twice
        # tiny.yaml's rl samples with transformers: no vLLM engine to hand the weights to
        assert record["sync_s"] == 0 and min(record[key] for key in records.ROLLOUT_PHASES if key != "sync_s") > 0
        for part, phase in records.ROLLOUT_PHASE_PARTS.items():
            assert 0 <= record[part] <= record[phase]
        # tiny.yaml's rl: ZeRO-2, the reference live on the device: nothing gathered, nothing moved
        assert record["gather_s"] == 0 and record["offload_s"] == 0
        # No GPU here: no busy share and no bandwidth ceiling, written as null rather than made up.
        for key in (*records.GPU_BUSY_KEYS, "generate_bandwidth_fraction"):
            assert key in record and record[key] is None, key
        assert record["generate_tokens_per_s"] > 0


def test_tensorboard_reads_every_stage_s_events_with_the_values_of_metrics_jsonl(tiny_chain):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for stage in STAGES:
        accumulator = EventAccumulator(str(tiny_chain.runs / stage / "tensorboard"))
        accumulator.Reload()
        tags = set(accumulator.Tags()["scalars"])
        lines = read_metrics(tiny_chain.runs / stage)
        expected = {name for record in lines for name in records.scalars(record)}
        assert tags == expected, stage
        headline = "train/reward" if stage == "rl" else "train/loss"
        key = headline.split("/")[1]
        logged = [(r["step"], r[key]) for r in records.training(lines)]
        events = [(e.step, e.value) for e in accumulator.Scalars(headline)]
        assert [s for s, _ in events] == [s for s, _ in logged], stage
        assert [v for _, v in events] == pytest.approx([v for _, v in logged], rel=1e-6), stage
        assert "eval/" + ("reward" if stage == "rl" else "loss") in tags
        if stage == "rl":  # every phase of a rollout, and its parts (null figures, e.g. GPU busy, are left out)
            assert {records.tag(k) for k in (*records.ROLLOUT_PHASES, *records.ROLLOUT_PHASE_PARTS)} <= tags


def test_status_shows_step_of_total_and_eta_of_a_paused_stage(tiny_chain):
    sft = next(line for line in tiny_chain.status_while_paused.splitlines() if line.strip().startswith("sft"))
    step, total = map(int, re.search(r"step (\d+)/(\d+) \(\d+%\)", sft).groups())
    assert 0 < step < total == 200, sft
    assert re.search(r"ETA \d+:\d\d as of \d+:\d\d ago", sft), sft


def test_the_progress_lines_of_the_log_have_no_carriage_returns(tiny_chain):
    lines = [line for line in tiny_chain.stdout.splitlines() if "[sft] step " in line]
    assert len(lines) == 200 // 20  # one per log interval
    assert "ETA" in lines[0] and "loss" in lines[0] and "tokens/s" in lines[0]
    assert "\r" not in tiny_chain.stdout


def test_result_json_puts_the_measured_numbers_beside_the_saved_plan(tiny_chain):
    for stage in STAGES:
        folder = tiny_chain.runs / stage
        result, plan = read_result(folder), json.loads((folder / "plan.json").read_text())
        training = records.training(read_metrics(folder))
        assert result["measured"]["host_mem_gib"] == max(r["host_rss_gib"] for r in training)
        assert result["measured"]["gpu_mem_peak_gib"] is None
        assert result["planned"]["host_mem_gib"] == plan["host"]["peak_bytes"] / 2**30
    # The saved plan is the planner's own JSON for that stage.
    printed = json.loads(run_cli("plan", "tiny", "--json", cwd=tiny_chain.workdir).stdout)
    saved = json.loads((tiny_chain.runs / "dpo" / "plan.json").read_text())
    saved.pop("saved_at")
    assert saved == next(s for s in printed["stages"] if s["stage"] == "dpo")


def test_the_report_is_one_self_contained_page_with_every_plot(tiny_chain):
    result = run_cli("report", "tiny", cwd=tiny_chain.workdir)
    assert result.returncode == 0, result.stderr
    page = (tiny_chain.runs / "report.html").read_text()
    images = re.findall(r"<img alt='([^']*)' src='data:image/png;base64,([^']+)'>", page)
    alts = [alt for alt, _ in images]
    assert alts[:2] == ["timeline", "plan vs measured"]
    for stage in STAGES:
        phases = [f"{stage} rollout phases"] if stage == "rl" else []  # RL's phases per rollout
        assert [a for a in alts if a.startswith(stage + " ")] == [
            f"{stage} training", f"{stage} eval", *phases, f"{stage} throughput", f"{stage} memory"]
    for _, data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    # Nothing fetched from anywhere. The PNGs' base64 is left out first: it can spell "http" by chance.
    text = re.sub(r"data:image/png;base64,[^']+", "data:", page)
    assert "http" not in text.replace("http-equiv", "")
    assert all(link.startswith(("data:", "#")) for link in re.findall(r"(?:src|href)=['\"]([^'\"]*)", text))
    assert "partial" not in text


def test_run_ends_by_writing_the_report_and_printing_its_path(tiny_chain):
    assert tiny_chain.stdout.rstrip().splitlines()[-1] == f"report: {(tiny_chain.runs / 'report.html').resolve()}"


def test_no_secret_from_the_environment_is_written_anywhere_under_runs(tiny_chain):
    # runs/tiny/<stage>/logs is the submitit folder of each stage's job.
    files = [p for p in tiny_chain.runs.rglob("*") if p.is_file()]
    assert any(p.match("*/logs/*_submitted.pkl") for p in files)
    for path in files:
        content = path.read_bytes()
        for name, marker in SECRET_MARKERS.items():
            assert marker.encode() not in content, f"{name} written to {path}"
    assert all(m not in tiny_chain.stdout for m in SECRET_MARKERS.values())


def test_the_readme_row_of_a_finished_run_comes_from_its_result_files(tiny_chain, monkeypatch):
    from core.config import load_pipeline
    from pipeline.graph import build_tasks

    monkeypatch.chdir(tiny_chain.workdir)  # runs_dir is relative to the folder the command runs in
    summary = measured.run_summary(build_tasks(load_pipeline("tiny")))
    seconds = sum(read_result(tiny_chain.runs / s)["seconds"] for s in STAGES)
    assert summary["seconds"] == pytest.approx(seconds, abs=0.1)
    assert summary["hardware"].startswith("CPU") and summary["hardware"].endswith("2 processes")
    final_reward = read_result(tiny_chain.runs / "rl")["final_reward"]
    assert f"rl final_reward={records.number_text(final_reward)}" in summary["result"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional)")
def test_wandb_offline_writes_its_run_in_the_stage_folder_and_no_secret(workdir):
    import os
    import subprocess
    import sys

    spec = tiny_pipeline(tracking={"wandb": {"project": "tests"}})
    spec["stages"][0]["max_steps"] = 10
    path = write_pipeline(workdir, spec)
    env = {**os.environ, **SECRET_MARKERS}
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", str(path)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = list((workdir / "runs" / "t" / "sft" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    for file in (p for p in workdir.rglob("*") if p.is_file()):
        content = file.read_bytes()
        assert not any(m.encode() in content for m in SECRET_MARKERS.values()), file
