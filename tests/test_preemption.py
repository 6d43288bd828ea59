"""Save on the signal, resume exactly (stages/preemption.py, stages/checkpoints.py).

The end-to-end check sends real signals to a local run's stage processes: SIGTERM to
rank 0 of the sft stage, USR2 to rank 1 only of the rl stage (rank 0 learns it through
the all-reduce). Each stage saves at that step, requeues through submitit (local
executor: exit code 144) and resumes; its per-step losses must equal an uninterrupted
run's, every step logged exactly once. tests/test_slurm_preemption.py does the same to
a DPO stage on the real Slurm test cluster, and hangs a stage there (the watchdog).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core.runfolder import StageFolder
from stages.preemption import MOST_STEPS_BETWEEN_CHECKS
from tests.conftest import (
    processes_with,
    read_metrics,
    read_result,
    run_cli,
    tiny_pipeline,
    write_pipeline,
    written_metrics,
)

STEPS = 24
# fp32 on CPU with gloo, same data order, same generators: the sums are the same operations
# in the same order, so the losses should agree to float32 rounding.
LOSS_RTOL = 1e-5


# --------------------------------------------------------------------------- units


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A gloo group of this process alone (a file rendezvous: no MASTER_* variables set here,
    which the stage jobs this session starts would inherit)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_signal_is_noted_in_the_loop_and_handed_to_the_previous_handler_after(one_process_group, monkeypatch):
    from stages import preemption

    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "1")  # a task of a local job: its scheduler requeues at USR2
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        ctx = SimpleNamespace(device=torch.device("cpu"), rank=0, folder=None,
                              task=SimpleNamespace(time_limit_min=None))
        with preemption.Signals(ctx) as signals:
            assert signals.requested(1, 1.0, last=False) is None
            os.kill(os.getpid(), signal.SIGUSR2)
            assert signals.requested(2, 1.0, last=False) == "SIGUSR2"
            assert seen == []  # noted only, not acted on while the loop runs
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first's name
            signals.every = 4
            assert signals.requested(3, 1.0, last=False) is None  # not a checking step: no collective
            assert signals.requested(3, 1.0, last=True) == "SIGUSR2"  # the last step always checks
            assert signals.checks == 3
        # Still pending when the loop ended: the handler that was there before acts on it.
        assert seen == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGTERM) != signals._note
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_steps_between_checks_keep_the_check_within_one_percent_of_a_step():
    from stages.preemption import MOST_STEPS_BETWEEN_CHECKS, steps_between_checks

    assert steps_between_checks(check_s=50e-6, step_s=2.0) == 1  # NCCL, a real model
    assert steps_between_checks(check_s=1.5e-3, step_s=0.05) == 3  # 1.5 ms > 0.5 ms: every 3rd step
    assert steps_between_checks(check_s=1.0, step_s=0.001) == MOST_STEPS_BETWEEN_CHECKS
    assert steps_between_checks(check_s=1e-3, step_s=0.0) == 1


def test_rng_states_round_trip():
    from stages.checkpoints import rng_states, set_rng_states

    saved = rng_states()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move on
    set_rng_states(saved)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[0] == expected[0] and again[1] == expected[1] and torch.equal(again[2], expected[2])


class JsonEngine:
    """A stand-in for a DeepSpeed engine: its checkpoint is the client state, as JSON; its weights,
    one layer's (numbers: the loop looks at them before it saves)."""

    module = torch.nn.Linear(2, 1)

    def save_checkpoint(self, folder, tag, client_state=None, save_latest=False):
        (Path(folder) / tag).mkdir(parents=True, exist_ok=True)
        (Path(folder) / tag / "client.json").write_text(json.dumps(client_state))

    def load_checkpoint(self, folder, tag):
        return folder, json.loads((Path(folder) / tag / "client.json").read_text())


class FourStepUnits:
    """engine.Work whose units are 4 optimizer steps each (an RL rollout's update), 10 in all."""

    steps_per_unit, total_steps, log_interval = 4, 10, 1

    def __init__(self):
        self.engine, self.others = JsonEngine(), {"critic": JsonEngine()}
        self.advanced, self.evaluations, self.resumed = [], 0, None

    def advance(self, unit, window):
        self.advanced.append(unit)
        window.add(SimpleNamespace(real_tokens=1, processed_tokens=1), {"loss": torch.tensor(float(unit))}, 0.0)

    def record(self):
        return {"lr": 0.1, "unit": self.advanced[-1]}

    def evaluate(self):
        self.evaluations += 1
        return {"score": float(self.evaluations)}

    def state(self):
        return {"units": len(self.advanced)}

    def resume(self, state):
        self.resumed = state["units"]


def test_units_of_several_optimizer_steps_log_evaluate_and_save_by_step_and_resume_at_the_next_unit(
        one_process_group, tmp_path):
    from core import metrics as records
    from stages import engine

    folder = StageFolder(tmp_path / "rl")
    folder.path.mkdir()
    task = SimpleNamespace(name="rl", wandb=None, max_retries=2, time_limit_min=None, processes_per_node=1)
    ctx = SimpleNamespace(folder=folder, is_main=True, rank=0, device=torch.device("cpu"), on_gpu=False,
                          world_size=1, task=task)
    stage = SimpleNamespace(keep_checkpoints=5, eval_interval=3, save_interval=5)

    work = FourStepUnits()
    assert engine.run(work, stage, ctx) == {"initial": {"score": 1.0}, "final": {"score": 4.0}, "steps": 10}
    # The last unit is cut at total_steps; an interval counts when a unit's steps reach a multiple of it.
    assert work.advanced == [0, 1, 2]
    written = records.read(folder.metrics)
    training = [(r["step"], r["unit"], r["loss"]) for r in written if "lr" in r]
    assert training == [(4, 0, 0.0), (8, 1, 0.25), (10, 2, 1.0)]  # window means are per optimizer step
    assert [r["step"] for r in written if "eval_score" in r] == [0, 4, 8, 10]  # 3 in (0, 4], 6 in (4, 8], the end
    assert folder.checkpoint_tags() == ["step-00000008", "step-00000010"]  # 5 in (4, 8], and the last
    assert (folder.checkpoints / "step-00000008" / "critic" / "client.json").exists()

    # Stopped after step 8: the resumed run trains the third unit only, with the state saved at step 8.
    shutil.rmtree(folder.checkpoints / "step-00000010")
    folder.latest_marker.write_text("step-00000008")
    again = FourStepUnits()
    assert engine.run(again, stage, ctx) == {"initial": {"score": 1.0}, "final": {"score": 1.0}, "steps": 10}
    assert again.advanced == [2] and again.resumed == 2
    assert [(r["step"], r["unit"]) for r in records.read(folder.metrics) if "lr" in r] == [(4, 0), (8, 1), (10, 2)]


def events_folder(tmp_path, *events) -> StageFolder:
    """A stage folder whose events.jsonl holds `events` (dicts), one second apart."""
    folder = StageFolder(tmp_path / "sft")
    folder.path.mkdir(parents=True)
    folder.events.write_text("".join(json.dumps({"time": 1000.0 + k, **e}) + "\n" for k, e in enumerate(events)))
    return folder


def started(job="7", restart=0) -> dict:
    return {"event": "started", "job_id": job, "slurm_restart_count": restart}


def test_status_says_why_each_attempt_ended_and_where_the_next_resumed(tmp_path):
    from core import timeline

    folder = events_folder(
        tmp_path,
        started(job="6"), {"event": "hang", "step": 3},  # an earlier run's job: not this job's history
        started(), {"event": "saved at signal", "signal": "SIGUSR2", "step": 12, "reason": "time limit"},
        {"event": "requeue", "signal": "SIGUSR2", "reason": "preempted"},  # submitit's, after the save: no news
        started(restart=1), {"event": "resumed", "step": 12}, {"event": "hang", "step": 30},
        started(restart=2), {"event": "resumed", "step": 24},
        started(restart=3),  # the attempt before ended without a word: its node failed
        {"event": "requeue", "signal": "SIGUSR2", "reason": "preempted"},  # USR2 while loading
        started(restart=4),
    )
    assert [a.ended for a in timeline.attempts(folder)] == [
        timeline.TIME_LIMIT, timeline.HUNG, timeline.UNEXPLAINED, timeline.PREEMPTED, None]
    assert timeline.interruptions(folder) == (
        "requeued 4x: time limit (SIGUSR2) at step 12, resumed from step 12; hang at step 30, resumed from step 24; "
        "ended without a word (node failure?); preempted (SIGUSR2)")
    # Every rank of start 4 counts the same silent endings, whether or not rank 0 wrote start 4 yet.
    assert timeline.unexplained_endings(folder, "7", 4) == 1
    assert timeline.unexplained_endings(folder, "7", 3) == 1  # start 2 ended silently: start 3 follows it
    assert timeline.unexplained_endings(folder, "7", 2) == 0
    assert timeline.unexplained_endings(folder, "6", 1) == 0  # an earlier job's history is its own


def test_a_sigterm_outside_the_loop_is_noted_as_a_preemption_then_handed_on(tmp_path):
    from core import timeline
    from stages import runner

    folder = events_folder(tmp_path, started())
    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # submitit's, in a job
    try:
        runner._note_sigterm(folder)
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIGTERM]
    with open(folder.events, "a") as f:  # Slurm requeued the job after killing it
        f.write(json.dumps({"time": 2000.0, **started(restart=1)}) + "\n")
    assert [a.ended for a in timeline.attempts(folder)] == [timeline.PREEMPTED, None]
    assert timeline.unexplained_endings(folder, "7", 1) == 0  # not a node failure


def test_the_requeue_signal_is_a_time_limit_only_near_the_limit():
    from core.timeline import PREEMPTED, TIME_LIMIT, signal_reason

    # 60 min limit: a time limit from 48 min (80%); 20 min: from 10 min (10 minutes before).
    def reason(name, elapsed_s, limit_min):
        return signal_reason(name, elapsed_s, limit_min, requeue_signal="SIGUSR2")

    assert reason("SIGUSR2", 47 * 60, 60) == PREEMPTED and reason("SIGUSR2", 48 * 60, 60) == TIME_LIMIT
    assert reason("SIGUSR2", 9 * 60, 20) == PREEMPTED and reason("SIGUSR2", 10 * 60, 20) == TIME_LIMIT
    assert reason("SIGTERM", 59 * 60, 60) == PREEMPTED  # Slurm's preemption signal
    assert reason("SIGUSR2", 10**6, None) == PREEMPTED  # a local job has no limit


def test_the_stage_names_the_signal_its_local_run_got_not_the_sigint_it_was_stopped_with(tmp_path):
    from core import timeline
    from stages.preemption import Signals

    folder = StageFolder(tmp_path / "sft")
    folder.path.mkdir()
    signals = Signals(SimpleNamespace(device=None, rank=0, folder=folder, task=SimpleNamespace(time_limit_min=None)))
    timeline.record(folder, timeline.LAUNCHED)
    assert signals.said("SIGINT") == "SIGINT"  # a Ctrl-C: the terminal signals the stage itself
    timeline.record(folder, timeline.STOP_ASKED, signal="SIGTERM")  # `kill` of the local run
    assert signals.said("SIGINT") == "SIGTERM" and signals.said("SIGUSR2") == "SIGUSR2"
    timeline.record(folder, timeline.LAUNCHED)  # the next attempt: the earlier stop is not its own
    assert signals.said("SIGINT") == "SIGINT"


# --------------------------------------------------------------------------- end to end


def stage_processes(run_pid: int) -> dict[int, int]:
    """{global rank: pid} of the stage job's task processes started by the local `run`."""
    found = {}
    for pid, environ in processes_with("PIPELINE_RUN_PID", run_pid).items():
        try:
            task = b"_submit" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if task and "SUBMITIT_LOCAL_GLOBALID" in environ:
            found[int(environ["SUBMITIT_LOCAL_GLOBALID"])] = pid
    return found


def training_records(folder: Path) -> list[dict]:
    """metrics.jsonl's training records so far."""
    return [record for record in written_metrics(folder) if "lr" in record]


RL_ROLLOUTS = 8


def chain() -> dict:
    stage = {"model": "builtin:tiny-llama", "data": {"path": "builtin:digits", "eval_split": "eval"},
             "max_steps": STEPS}
    # RL with the state a resume must carry: the reward normaliser's statistics, the adaptive KL
    # coefficient, and every rank's sampler (each rank samples differently).
    rl = {**stage, "name": "rl", "kind": "ppo", "max_steps": RL_ROLLOUTS, "advantage": "grpo",
          "reward": {"rules": [{"rule": "exact_match"}, {"rule": "length", "options": {"target": 4}}],
                     "normalize": True},
          "kl_target": 0.5, "n_samples_per_prompt": 4, "rollout_batch_size": 8, "micro_rollout_batch_size": 32,
          "max_new_tokens": 6, "micro_batch_size": 16, "global_batch_size": 32}
    return tiny_pipeline(stages=[{"name": "sft", "kind": "sft", **stage}, rl],
                         defaults={"log_interval": 1, "warmup_steps": 4, "save_interval": 0})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The chain run twice: uninterrupted, and signalled once in each stage mid-training."""
    out = {}
    for name in ("uninterrupted", "signalled"):
        workdir = tmp_path_factory.mktemp(name)
        config = write_pipeline(workdir, chain())
        process = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(config)], cwd=workdir,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sent = {}
        if name == "signalled":
            # rank, signal, after step
            plan = {"sft": (0, signal.SIGTERM, 7), "rl": (1, signal.SIGUSR2, 3)}
            deadline = time.time() + 600  # two stages, two starts each (the pinned stack is slow)
            while len(sent) < len(plan) and process.poll() is None and time.time() < deadline:
                for stage, (rank, sig, after) in plan.items():
                    records = training_records(workdir / "runs" / "t" / stage)
                    if stage not in sent and records and records[-1]["step"] >= after:
                        pid = stage_processes(process.pid).get(rank)
                        if pid:
                            os.kill(pid, sig)
                            sent[stage] = (time.time(), records[-1]["step"])
                time.sleep(0.05)
        stdout, _ = process.communicate(timeout=900)
        assert process.returncode == 0, stdout[-5000:]
        status = json.loads(run_cli("status", config, "--json", cwd=workdir).stdout)
        out[name] = {"runs": workdir / "runs" / "t", "sent": sent, "stdout": stdout,
                     "status": {s["name"]: s["detail"] for s in status["stages"]}}
    return out


@pytest.mark.slow
@pytest.mark.e2e
def test_a_signalled_stage_saves_at_the_signal_and_resumes_on_the_same_trajectory(runs):
    stage = "sft"
    signalled, reference = runs["signalled"]["runs"] / stage, runs["uninterrupted"]["runs"] / stage
    sent_at, step_seen = runs["signalled"]["sent"][stage]

    # One checkpoint (save_interval 0: no periodic ones), at a step the signal came during or before.
    tags = sorted(p.name for p in (signalled / "checkpoints").glob("step-*"))
    assert len(tags) == 1, tags
    saved_step = int(tags[0].removeprefix("step-"))
    assert step_seen <= saved_step <= step_seen + 1 + MOST_STEPS_BETWEEN_CHECKS, (step_seen, saved_step)
    assert sorted(p.name for p in (signalled / "checkpoints" / tags[0]).glob("rng-rank*.pt")) == [
        "rng-rank00000.pt", "rng-rank00001.pt"]
    log = (signalled / "logs").glob("*_0_log.out")
    log_text = "".join(p.read_text() for p in log)
    assert f"resumed from checkpoint {tags[0]}" in log_text
    events = [json.loads(line) for line in (signalled / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] == "started"] == ["started", "started"]
    signal_name = "SIGTERM"
    # `status` shows the stage's requeue: why, and the step it resumed from (0 steps lost).
    said = f"requeued 1x: preempted ({signal_name}) at step {saved_step}, resumed from step {saved_step}"
    assert said in runs["signalled"]["status"][stage]

    # Every step once, and the same numbers as the uninterrupted run's.
    got, want = training_records(signalled), training_records(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for mine, theirs in zip(got, want):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-9), mine["step"]
    evals = [r["step"] for r in read_metrics(signalled) if any(k.startswith("eval_") for k in r)]
    assert evals == [0, STEPS]
    key = "final_eval_loss"
    assert read_result(signalled)[key] == pytest.approx(read_result(reference)[key], rel=LOSS_RTOL)
    print(json.dumps({"stage": stage, "signal_after_step": step_seen, "saved_step": saved_step}))


@pytest.mark.slow
@pytest.mark.e2e
def test_a_signalled_rl_stage_resumes_with_its_normaliser_kl_coefficient_and_samplers(runs):
    signalled, reference = runs["signalled"]["runs"] / "rl", runs["uninterrupted"]["runs"] / "rl"
    _, rollout_seen = runs["signalled"]["sent"]["rl"]
    tags = sorted(p.name for p in (signalled / "checkpoints").glob("step-*"))
    assert len(tags) == 1 and rollout_seen <= int(tags[0].removeprefix("step-")) <= RL_ROLLOUTS, tags
    got, want = training_records(signalled), training_records(reference)
    assert [r["step"] for r in got] == list(range(1, RL_ROLLOUTS + 1))
    for mine, theirs in zip(got, want):
        for key in ("policy_loss", "reward", "kl", "kl_coef", "response_length"):
            assert mine[key] == pytest.approx(theirs[key], rel=LOSS_RTOL, abs=1e-7), (mine["step"], key)
