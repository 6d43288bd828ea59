"""Seeing a run, the pure parts: ETA, the progress line, TensorBoard tags, the timeline, plan
versus measured, the README's measured columns, and where secrets and trackers are refused."""

from __future__ import annotations

import importlib.util

import pytest

from core import measured, timeline
from core import metrics as records
from core.config import PipelineSpec
from core.errors import InvalidInput
from pipeline import docs
from tests.conftest import run_cli, states_in_report_and_status, tiny_pipeline, write_pipeline


def test_eta_is_the_pace_so_far_times_the_steps_left():
    assert records.eta_seconds(10, 50.0, 30) == pytest.approx(150.0)  # 5 s a step, 30 steps to go
    assert records.eta_seconds(0, 3.0, 30) is None  # no pace yet
    assert records.eta_seconds(200, 999.0, 0) == 0.0


@pytest.mark.parametrize("seconds, text", [(42.4, "0:42"), (725, "12:05"), (11235, "3:07:15"),
                                           (2 * 86400 + 11235, "2d 3:07:15"), (None, "?")])
def test_durations_read_like_a_clock(seconds, text):
    assert records.duration_text(seconds) == text


def test_the_progress_line_gives_step_of_total_percent_eta_loss_and_tokens_per_second():
    record = {"step": 40, "loss": 0.53124, "tokens_per_s": 12345.6, "mfu": None, "lr": 0.003, "eta_s": 80.0,
              "total_steps": 200, "time": 1.0}
    line = records.progress_line("sft", record)
    assert line == "[sft] step 40/200  20%  ETA 1:20  loss 0.5312  tokens/s 12,346 | lr=0.003"
    assert "\r" not in line


def test_an_rl_progress_line_keeps_to_what_a_person_watching_needs():
    record = {"step": 3, "total_steps": 25, "eta_s": 25.0, "time": 1.0, "tokens_per_s": 5212.4, "policy_loss": 0.02113,
              "reward": 0.2773, "kl": 0.1654, "entropy": 0.3071, "response_length": 6.852, "clip_fraction": 0.0,
              "grad_norm": 1.606, "lr": 0.000289, "mfu": None, "gpu_mem_peak_gib": None, "kl_coef": 0.01,
              "approx_kl": 0.0, "reward_exact_match": 0.2773, "token_efficiency": 0.8867, "step_s": 0.9582,
              "host_rss_gib": 0.9178, "rollout": 3, "train_token_efficiency": 0.9574, "generate_s": 0.206,
              "score_s": 0.2775, "train_s": 0.4658, "other_s": 0.007193, "gather_s": 0.0, "offload_s": 0.0,
              "rollout_s": 0.9566, "generate_tokens_per_s": 8513.0, "score_tokens_per_s": 17990.0,
              "train_tokens_per_s": 10720.0, "gpu_busy_generate": None, "generate_bandwidth_fraction": None}
    line = records.progress_line("rl", record)
    assert line == ("[rl] step 3/25  12%  ETA 0:25  policy_loss 0.02113  reward 0.2773  tokens/s 5,212 | kl=0.1654 "
                    "entropy=0.3071 response_length=6.852 clip_fraction=0")
    assert len(line) <= records.LINE_CHARS


def test_status_says_how_old_the_progress_it_shows_is():
    progress = records.Progress(step=40, total_steps=200, eta_s=80.0, time=1000.0)
    assert progress.text(now=1005.0) == "step 40/200 (20%), ETA 1:20 as of 0:05 ago"


@pytest.mark.parametrize("key, tag", [
    ("loss", "train/loss"), ("reward", "train/reward"), ("eval_loss", "eval/loss"), ("mfu", "perf/mfu"),
    ("tokens_per_s", "perf/tokens_per_s"), ("host_rss_gib", "memory/host_rss_gib"), ("generate_s", "time/generate_s"),
    ("score_s", "time/score_s"), ("lr", "optim/lr"), ("eta_s", "progress/eta_s"), ("step", None), ("time", None),
])
def test_tensorboard_groups_each_key(key, tag):
    assert records.tag(key) == tag


def test_only_finite_numbers_are_plotted():
    record = {"step": 5, "loss": 1.5, "mfu": None, "grad_norm": float("nan"), "epoch": 0, "time": 3.0}
    assert records.scalars(record) == {"train/loss": 1.5, "progress/epoch": 0.0}


def test_an_eval_record_is_told_from_a_training_record():
    assert records.is_eval({"step": 0, "eval_loss": 3.2, "time": 1.0})
    assert not records.is_eval({"step": 5, "loss": 3.2, "eval_loss": 3.0})


def test_a_requeued_stage_shows_queued_starting_running_requeued_starting_running():
    found = timeline.segments(submitted=0.0, attempts=[100.0, 10.0], activity=[20.0, 50.0, 120.0], done=130.0)
    assert [(s.state, s.start, s.end) for s in found] == [
        ("queued", 0.0, 10.0), ("starting", 10.0, 20.0), ("running", 20.0, 50.0), ("requeued", 50.0, 100.0),
        ("starting", 100.0, 120.0), ("running", 120.0, 130.0)]


def test_a_running_stage_runs_from_its_first_record_until_its_newest():
    found = timeline.segments(submitted=None, attempts=[10.0], activity=[5.0, 20.0, 35.0], done=None)
    assert [(s.state, s.start, s.end) for s in found] == [("starting", 10.0, 20.0), ("running", 20.0, 35.0)]


def test_a_stage_is_queued_until_its_processes_launch_and_starting_until_its_first_record():
    # Submitted at 0, the processes began at 2 (a local job: at once), joined up at 40 after imports
    # and an op build, evaluated first at 60; requeued at 90, launched again at 100.
    found = timeline.segments(submitted=0.0, attempts=[40.0, 110.0], activity=[60.0, 90.0, 130.0], done=140.0,
                              launches=[2.0, 100.0])
    assert [(s.state, s.start, s.end) for s in found] == [
        ("queued", 0.0, 2.0), ("starting", 2.0, 60.0), ("running", 60.0, 90.0), ("requeued", 90.0, 100.0),
        ("starting", 100.0, 130.0), ("running", 130.0, 140.0)]


def test_measured_rates_leave_out_the_first_record_and_memory_takes_the_peak():
    training = [
        {"step": 5, "step_s": 3.0, "tokens_per_s": 100.0, "host_rss_gib": 1.0, "gpu_mem_peak_gib": None, "mfu": None},
        {"step": 10, "step_s": 1.0, "tokens_per_s": 300.0, "host_rss_gib": 2.5, "gpu_mem_peak_gib": None, "mfu": None},
        {"step": 15, "step_s": 0.5, "tokens_per_s": 500.0, "host_rss_gib": 2.0, "gpu_mem_peak_gib": None, "mfu": None},
    ]
    got = measured.measured_numbers(training, "sft")
    assert got["step_s"] == pytest.approx(0.75)
    assert got["tokens_per_s"] == pytest.approx(400.0)
    assert got["host_mem_gib"] == 2.5
    assert got["gpu_mem_peak_gib"] is None and got["mfu"] is None
    rollouts = [{"step": 2, "step_s": 9.0, "rollout_s": 18.0}, {"step": 4, "step_s": 5.0, "rollout_s": 10.0}]
    assert measured.measured_numbers(rollouts, "ppo")["step_s"] == 10.0  # PPO's unit: the rollout


def test_the_plan_is_read_in_the_units_of_the_metrics():
    entry = {"kind": "sft", "gpu": {"peak_bytes": 3 * 2**30}, "host": {"peak_bytes": 2**29},
             "time": {"unit": "optimizer step", "step_s": 2.0, "tokens_per_s": 5.0, "mfu": 0.3,
                      "token_efficiency": 0.9},
             "batches": {"real_tokens_per_step": 90, "processed_tokens_per_step": 100}}
    assert measured.planned_numbers(entry) == {"unit": "optimizer step", "gpu_mem_peak_gib": 3.0, "host_mem_gib": 0.5,
                                               "step_s": 2.0, "tokens_per_s": 5.0, "mfu": 0.3, "token_efficiency": 0.9}
    cpu = {**entry, "gpu": {"peak_bytes": None}, "time": None}
    planned = measured.planned_numbers(cpu)
    assert planned["gpu_mem_peak_gib"] is None and planned["step_s"] is None
    assert planned["token_efficiency"] == pytest.approx(0.9)  # from the simulated batches, no GPU needed


def test_the_shipped_table_gains_measured_columns_only_where_a_run_exists():
    table = ("| file | hardware | stages | the plan says |\n|---|---|---|---|\n"
             "| `a.yaml` | CPU | SFT | 2 min |\n| `b.yaml` | 8 A100 | DPO | fits |\n")
    runs = {"a.yaml": {"hardware": "CPU (x), 2 processes", "date": "2026-11-22", "seconds": 65.0,
                       "peak_memory": "0.9 GiB host per node", "result": "sft final_eval_loss=0.23"}}
    rows = docs.pipelines_table(table, runs).splitlines()
    assert rows[0] == "| file | hardware | stages | the plan says | measured on | time | peak memory | result |"
    assert rows[2] == ("| `a.yaml` | CPU | SFT | 2 min | CPU (x), 2 processes, 2026-11-22 | 65 s | "
                       "0.9 GiB host per node | sft final_eval_loss=0.23 |")
    assert rows[3] == "| `b.yaml` | 8 A100 | DPO | fits | not run |  |  |  |"


def test_the_readme_measured_columns_come_from_docs_measured_json():
    text = docs.README.read_text()
    table = text.split(docs.PIPELINES_START, 1)[1].split(docs.PIPELINES_END, 1)[0]
    assert table.strip() == docs.pipelines_table(table, docs.load_measured()).strip(), "run `make docs`"


def test_a_secret_in_cluster_env_is_refused_before_it_reaches_a_batch_script():
    spec = tiny_pipeline(cluster={"env": {"HF_TOKEN": "hf_abc", "OMP_NUM_THREADS": "4"}})
    with pytest.raises(Exception) as caught:
        PipelineSpec.model_validate(spec)
    assert "HF_TOKEN" in str(caught.value) and "export HF_TOKEN in your shell" in str(caught.value)


def test_wandb_is_off_by_default_and_offline_when_asked_for():
    assert PipelineSpec.model_validate(tiny_pipeline()).tracking.wandb is None
    spec = PipelineSpec.model_validate(tiny_pipeline(tracking={"wandb": {"project": "p"}}))
    assert spec.tracking.wandb.mode == "offline"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_validate_refuses_wandb_tracking_without_the_package(workdir):
    path = write_pipeline(workdir, tiny_pipeline(tracking={"wandb": {"project": "my-lab", "mode": "online"}}))
    result = run_cli("validate", path, cwd=workdir)
    assert result.returncode == InvalidInput.exit_code, result.stderr
    assert "tracking.wandb" in result.stderr and "pip install wandb" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (workdir / "runs").exists()


GPU_WINDOW = r"""
import json, os, sys, types
from pathlib import Path
import torch, torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl", rank=0, world_size=1)
from core import metrics as records
from core.runfolder import StageFolder
from stages import engine, tracking

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
task = types.SimpleNamespace(stage=types.SimpleNamespace(precision="bf16", kind="sft"), processes_per_node=1,
                             name="gpu", pipeline="p", wandb=None, spec_hash="x")
folder = StageFolder(Path(sys.argv[1]))
folder.path.mkdir(parents=True, exist_ok=True)
ctx = types.SimpleNamespace(device=device, on_gpu=True, world_size=1, task=task, folder=folder, is_main=True)
window, metrics = engine.Window(ctx), tracking.Metrics(ctx, total_steps=3)
metrics.truncate_after(-1)
batch = types.SimpleNamespace(real_tokens=1000, processed_tokens=1250)
n, reps = 8192, 50
warm = torch.ones(n, n, device=device, dtype=torch.bfloat16)
(warm @ warm).sum().item()  # cuBLAS set up, and the writers' start, outside the measured window
del warm
window.restart()
for step in range(1, 4):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(reps):
        c = a @ b
    torch.cuda.synchronize()
    window.add(batch, {"loss": torch.tensor(1.0, device=device)}, flops=reps * 2.0 * n**3)
    del a, b, c
    metrics.write({"step": step, **window.close(1)})
metrics.close()
print(json.dumps({"records": records.training(records.read(folder.metrics)),
                  "peak_flops": engine._device_peak_flops(ctx)}))
dist.destroy_process_group()
"""


def test_on_a_gpu_the_records_measure_memory_and_mfu_of_a_known_workload(tmp_path):
    import json
    import subprocess
    import sys

    import torch

    from tests.conftest import REPO

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    done = subprocess.run([sys.executable, "-c", GPU_WINDOW, str(tmp_path / "gpu")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for record in out["records"]:
        # a, b and c (8192^2 bf16, 128 MiB each) live at once; nothing else is allocated.
        assert 0.375 <= record["gpu_mem_peak_gib"] < 0.75
        assert record["gpu_mem_reserved_gib"] >= record["gpu_mem_peak_gib"]
        assert record["token_efficiency"] == pytest.approx(0.8)
        if out["peak_flops"]:  # a GPU of core/hardware.py's catalogue: a large bf16 matmul
            assert 0.2 < record["mfu"] < 1.0
    assert records.training(out["records"])[-1]["eta_s"] == 0.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "gpu" / "tensorboard"))
    events.Reload()
    assert {"memory/gpu_mem_peak_gib", "perf/mfu"} <= set(events.Tags()["scalars"])


def test_the_report_of_a_chain_still_running_shows_what_its_folders_hold_so_far(workdir):
    import json
    import re

    from core.config import load_pipeline
    from pipeline import report
    from pipeline.graph import build_tasks

    spec = tiny_pipeline(stages=[
        {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"},
         "max_steps": 40},
        {"name": "dpo", "kind": "dpo", "from": "sft", "data": {"path": "builtin:digits"}, "max_steps": 10},
    ])
    tasks = build_tasks(load_pipeline(str(write_pipeline(workdir, spec))))
    sft = tasks[0].folder
    sft.path.mkdir(parents=True)
    sft.spec.write_text("{}")
    sft.events.write_text(json.dumps({"event": "started", "time": 1000.0}) + "\n")
    lines = [{"step": 0, "eval_loss": 3.0, "time": 1001.0}]
    lines += [{"step": s, "loss": 3.0 - s / 10, "tokens_per_s": 500.0, "step_s": 0.1, "host_rss_gib": 0.8,
               "gpu_mem_peak_gib": None, "eta_s": 4.0 - s / 10, "total_steps": 40, "time": 1001.0 + s / 10}
              for s in (5, 10, 15)]
    sft.metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    page = report.render("t", tasks, None)
    assert "<b>partial</b>" in page
    assert re.findall(r"<img alt='([^']*)'", page) == ["timeline", "sft training", "sft eval", "sft throughput",
                                                        "sft memory"]
    assert "step 15/40 (38%)" in page  # sft's state in the final metrics table
    assert page.count("No metrics yet") == 1  # dpo


def test_report_and_status_agree_on_each_stage_after_a_cancel_a_kill_and_before_a_start(workdir):
    """Three stages: one a local `run` recorded as cancelled, one whose `run` was killed while it
    trained (its record still says running), one never started; the first two wrote a training
    record with an ETA. The report says what `status` says of each, with no ETA for any."""
    import json
    import socket

    from core.config import load_pipeline
    from pipeline import state
    from pipeline.graph import build_tasks
    from schedulers.local.submit import LocalExecutor

    sft = {"kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"}, "max_steps": 40}
    config = write_pipeline(workdir,
                            tiny_pipeline(stages=[{"name": n, **sft} for n in ("cancelled", "killed", "later")]))
    spec = load_pipeline(str(config))
    run_state = state.RunState(pipeline=spec.name, config=str(config))
    for task, ended in zip(build_tasks(spec)[:2], (state.CANCELLED, state.RUNNING)):
        task.folder.path.mkdir(parents=True)
        task.folder.spec.write_text(json.dumps({"spec_hash": task.spec_hash}))
        task.folder.metrics.write_text(json.dumps({"step": 15, "loss": 1.0, "eta_s": 40.0, "total_steps": 40,
                                                   "time": 1000.0}) + "\n")
        run_state.stages[task.name] = state.StageRecord(
            job_id="1", executor=LocalExecutor.name, host=socket.gethostname(), state=ended,
            detail="interrupted (SIGINT): saved at step 15" if ended == state.CANCELLED else "",
            spec_hash=task.spec_hash, submitted_at=state.now(), logs=str(task.folder.logs))
    state.save(spec.run_dir.resolve(), run_state)

    in_report, in_status = states_in_report_and_status(config, workdir)
    assert in_status == {"cancelled": "cancelled", "killed": "failed", "later": "not started"}
    for name, said in in_status.items():
        assert in_report[name].split(",")[0].split(":")[0] == said and "ETA" not in in_report[name], in_report
    assert in_report["cancelled"].startswith("cancelled, step 15/40 (38%): interrupted (SIGINT): saved at step 15")
