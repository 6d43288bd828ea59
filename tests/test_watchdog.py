"""The watchdog over every phase of a stage (stages/watchdog.py), and what `status` says of a
running stage: the age of its last record and the phase it is in."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import pytest

from core import timeline
from core.runfolder import StageFolder
from stages import watchdog
from tests.conftest import plugins_importable, run_cli, tiny_pipeline, write_pipeline


def dog(tmp_path, **knobs) -> watchdog.Watchdog:
    """A watchdog whose thread is not started: its phases and limits only."""
    stage = SimpleNamespace(**{"hang_factor": 20.0, "hang_min_s": 3.0, "hang_first_s": 100.0, **knobs})
    return watchdog.Watchdog(SimpleNamespace(rank=0, folder=StageFolder(tmp_path)), stage, 2, None)


def test_a_phase_is_judged_by_its_own_runs_once_it_has_five_and_by_hang_first_s_before(tmp_path, monkeypatch):
    watching = dog(tmp_path)
    monkeypatch.setattr(watchdog, "_active", watching)
    with watchdog.phase(watchdog.EVALUATION, step=0):
        (evaluation,) = watching.open
        assert watching.limit_s(evaluation)[0] == 100.0  # no history: hang_first_s
    watching.history[("evaluation",)] = [0.5] * (watchdog.HANG_WARMUP - 1) + [0.1, 0.2, 0.3, 0.4]
    assert watching.limit_s(evaluation)[0] == pytest.approx(20 * 0.45)  # the median of its own runs
    watching.history[("evaluation",)] = [0.01] * 10
    assert watching.limit_s(evaluation)[0] == 3.0  # never under hang_min_s


def test_nested_phases_take_the_step_around_them_and_keep_a_history_of_their_own(tmp_path, monkeypatch):
    watching = dog(tmp_path)
    monkeypatch.setattr(watchdog, "_active", watching)
    with watchdog.phase(watchdog.TRAINING_STEP, step=7), watchdog.phase(watchdog.GENERATION):
        assert watching.open[-1].where() == "training step > generation at step 7"
    with watchdog.phase(watchdog.EVALUATION, step=5), watchdog.phase(watchdog.GENERATION):
        pass
    assert set(watching.history) == {("training step",), ("training step", "generation"), ("evaluation",),
                                     ("evaluation", "generation")}
    assert watching.open == []


def test_a_phase_is_judged_by_its_time_since_a_part_of_it_last_ended(tmp_path, monkeypatch):
    watching = dog(tmp_path)
    monkeypatch.setattr(watchdog, "_active", watching)
    with watchdog.phase(watchdog.EVALUATION, step=0):
        (evaluation,) = watching.open
        evaluation.started = evaluation.progress = time.monotonic() - 1000  # a long evaluation ...
        with watchdog.phase(watchdog.FORWARD):
            pass
        assert evaluation.without_progress(time.monotonic()) < 1.0  # ... whose forward passes end
    assert 1000 <= watching.history[("evaluation",)][0] < 1001  # its longest time without progress


def test_a_phase_with_its_own_bound_may_go_that_long_and_its_time_is_not_counted_around_it(tmp_path, monkeypatch):
    watching = dog(tmp_path)
    monkeypatch.setattr(watchdog, "_active", watching)
    with watchdog.phase(watchdog.SCORING):
        with watchdog.phase(watchdog.REWARD_FUNCTIONS, at_least_s=500.0):
            scoring, rewards = watching.open
            assert watching.limit_s(rewards) == (500.0, "its own bound, reward.timeout_s per call")
            scoring.progress -= 400.0  # the functions have run 400 s
            rewards.progress -= 400.0
        assert scoring.without_progress(time.monotonic()) < 1.0
    assert watching.history[("scoring",)][0] < 1.0
    assert watching.history[("scoring", "reward functions")][0] >= 400


def test_rank_0_notes_a_phase_that_lasts_and_that_it_ended(tmp_path, monkeypatch):
    folder = StageFolder(tmp_path)
    folder.events.write_text(json.dumps({"event": "started", "time": time.time() - 100, "job_id": "7"}) + "\n")
    watching = dog(tmp_path)
    monkeypatch.setattr(watchdog, "_active", watching)
    with watchdog.phase(watchdog.EVALUATION, step=40):
        watching._note(list(watching.open), time.monotonic())
        assert timeline.phase_now(folder) is None  # not yet PHASE_NOTE_S long: nothing written
        watching._note(list(watching.open), time.monotonic() + watchdog.PHASE_NOTE_S)
        note = timeline.phase_now(folder)
        assert (note.phase, note.step) == ("evaluation", 40)
    watching._note([], time.monotonic())
    assert timeline.phase_now(folder).phase is None


# --------------------------------------------------------------------------- status


def running_folder(tmp_path, records: list[dict], phase: dict | None, started: float) -> StageFolder:
    folder = StageFolder(tmp_path / "rl")
    folder.path.mkdir()
    folder.events.write_text(json.dumps({"event": "started", "time": started, "job_id": "7"}) + "\n")
    folder.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    if phase is not None:
        folder.phase.write_text(json.dumps(phase))
    return folder


def test_status_says_the_age_of_the_last_record_and_the_phase_of_a_running_stage(tmp_path):
    from pipeline import state

    now = 10_000.0
    in_scoring = {"phase": "evaluation > scoring > reward functions", "step": 0, "since": now - 50}
    folder = running_folder(tmp_path, [{"step": 0, "eval_reward": 0.5, "time": now - 65}], in_scoring, now - 100)
    assert state.activity(folder, now)[0] == ("last record (evaluation at step 0) 1:05 ago; "
                                              "in evaluation > scoring > reward functions at step 0 for 0:50")


def test_status_says_a_stage_has_no_record_yet_and_since_when_it_runs(tmp_path):
    from pipeline import state

    now = 10_000.0
    stale = {"phase": "training step", "step": 3, "since": now - 500}  # an earlier attempt's: not said
    folder = running_folder(tmp_path, [], stale, now - 139)
    assert state.activity(folder, now) == ("no record yet, started 2:19 ago", None)


def test_status_says_a_newer_evaluation_after_the_training_progress(tmp_path):
    from pipeline import state

    now = 10_000.0
    records = [{"step": 40, "loss": 1.0, "total_steps": 200, "eta_s": 80.0, "time": now - 120},
               {"step": 40, "eval_loss": 1.2, "time": now - 5}]
    folder = running_folder(tmp_path, records, None, now - 1000)
    said, progress = state.activity(folder, now)
    assert said == "step 40/200 (20%), ETA 1:20 as of 2:00 ago, last record (evaluation at step 40) 0:05 ago"
    assert progress.step == 40


def test_a_hang_is_said_with_its_phase_and_step():
    attempt = timeline.Attempt(job_id="7", started=0.0, ended=timeline.HUNG, at_step=0, phase="evaluation")
    assert attempt.text() == "hang in evaluation at step 0"


# --------------------------------------------------------------------------- a whole stage


@pytest.mark.slow
@pytest.mark.stack_free
def test_a_hang_in_evaluation_is_requeued_then_fails_and_the_console_says_hang(workdir):
    stage = {"name": "sft", "kind": "sft_sleeping_eval", "sleep_s": 600, "model": "builtin:tiny-llama",
             "data": {"path": "builtin:digits", "eval_split": "eval"}, "max_steps": 2, "hang_first_s": 10}
    spec = tiny_pipeline(stages=[stage], plugins=["tests.sleeping_kind"],
                         cluster={"tasks_per_node": 1, "max_retries": 1})
    config = write_pipeline(workdir, spec)
    with plugins_importable():
        result = run_cli("run", config, cwd=workdir, timeout=300)
        status = json.loads(run_cli("status", config, "--json", cwd=workdir).stdout)
    console = result.stdout + result.stderr
    assert result.returncode == 1, console[-3000:]
    assert "hang in evaluation at step 0: rank 0's evaluation has run " in result.stdout, console[-3000:]
    assert "more than 10.0 s (hang_first_s: it has run 0 times before, fewer than 5)" in result.stdout
    assert "hang in evaluation at step 0: requeueing (1 of cluster.max_retries 1)" in result.stdout
    assert "preempted" not in console
    assert (f"error: stage sft failed: error on rank 0 (host {socket.gethostname()}): Hang: hang in evaluation at "
            "step 0") in result.stderr
    assert "The stage hung 2 times, more than cluster.max_retries (1): failing" in result.stderr
    assert "raise hang_first_s" in result.stderr
    (sft,) = status["stages"]
    assert "requeued 1x: hang in evaluation at step 0; hang in evaluation at step 0" in sft["detail"], sft
    (log,) = (workdir / "runs" / "t" / "sft" / "logs").glob("*_0_log.err")
    assert "sleeping_kind.py\", line" in log.read_text()  # the stack says where it waited
