"""The tiny chain's RL stage sampled by vLLM (generation: vllm) from the chain's own SFT model: it
learns as the transformers engine does (held-out reward from ~0 to >= 0.5) with the engine's
weights split over the stage's 2 processes (tensor_parallel 2) and whole in each (1); and a run
signalled mid-stage resumes on the same trajectory, sampling the same completions. End-to-end:
~3 RL stages of 25 rollouts on 2 cores, beside the session's tiny chain (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from core import rollout_engine
from core.config import CONFIGS_DIR
from tests.conftest import read_metrics, read_result, write_pipeline
from tests.test_preemption import LOSS_RTOL, stage_processes, training_records

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(rollout_engine.installed() is None,
                                                  reason="vLLM is not installed (the pinned stack has none)")]

SIGNALLED = "rl-tp2"


def vllm_chain(sft_model: str, stages: dict) -> dict:
    """The shipped tiny chain's RL stage, from `sft_model`, once per {name: vllm settings}."""
    tiny = yaml.safe_load((CONFIGS_DIR / "tiny.yaml").read_text())
    rl = next(stage for stage in tiny["stages"] if stage["name"] == "rl")
    rl = {key: value for key, value in rl.items() if key != "from"}
    return {**tiny, "name": "v", "stages": [{**rl, "name": name, "model": sft_model, "generation": "vllm",
                                              "vllm": settings} for name, settings in stages.items()]}


def run(workdir, spec, signal_rank_after: tuple = ()) -> subprocess.CompletedProcess:
    config = write_pipeline(workdir, spec)
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(config)], cwd=workdir,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if signal_rank_after:
        rank, after = signal_rank_after
        deadline = time.time() + 600
        while process.poll() is None and time.time() < deadline:
            records = training_records(workdir / "runs" / "v" / SIGNALLED)
            pid = stage_processes(process.pid).get(rank) if records and records[-1]["step"] >= after else None
            if pid:
                os.kill(pid, signal.SIGUSR2)
                break
            time.sleep(0.05)
    stdout, _ = process.communicate(timeout=1200)
    assert process.returncode == 0, stdout[-5000:]
    return stdout


@pytest.fixture(scope="module")
def vllm_runs(tiny_chain, tmp_path_factory) -> dict:
    sft = str(tiny_chain.runs / "sft" / "model")
    learning = tmp_path_factory.mktemp("learning")
    run(learning, vllm_chain(sft, {"rl-tp1": {"tensor_parallel": 1}, SIGNALLED: {"tensor_parallel": 2}}))
    signalled = tmp_path_factory.mktemp("signalled")
    run(signalled, vllm_chain(sft, {SIGNALLED: {"tensor_parallel": 2}}), signal_rank_after=(1, 3))
    return {"hf": tiny_chain.runs / "rl", "learning": learning / "runs" / "v", "signalled": signalled / "runs" / "v"}


@pytest.mark.parametrize("stage", ["rl-tp1", SIGNALLED])
def test_the_rl_stage_sampled_by_vllm_learns_like_the_transformers_engine(vllm_runs, stage):
    mine, hf = read_result(vllm_runs["learning"] / stage), read_result(vllm_runs["hf"])
    assert mine["generation"] == "vllm" and hf["generation"] == "padded"
    assert mine["initial_reward"] == hf["initial_reward"] <= 0.05  # the same SFT model, greedy: the same answers
    assert mine["final_reward"] >= 0.5, mine
    records = [r for r in read_metrics(vllm_runs["learning"] / stage) if "rollout" in r]
    assert all(r["sync_bytes"] > 0 and r["sync_s"] > 0 for r in records)  # the weights went over every rollout
    assert all(r["sampler_logprob_diff_max"] < 1e-3 for r in records)  # fp32 on a CPU: rounding apart


def test_a_signalled_vllm_stage_resumes_sampling_what_the_uninterrupted_one_sampled(vllm_runs):
    signalled, reference = vllm_runs["signalled"] / SIGNALLED, vllm_runs["learning"] / SIGNALLED
    events = [json.loads(line)["event"] for line in (signalled / "events.jsonl").read_text().splitlines()]
    assert events.count("started") == 2 and "resumed" in events  # stopped at the signal, resumed once
    got, want = training_records(signalled), training_records(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for mine, theirs in zip(got, want):
        for key in ("reward", "response_length", "policy_loss", "sampler_logprob_diff_mean"):
            assert mine[key] == pytest.approx(theirs[key], rel=LOSS_RTOL, abs=1e-7), (mine["step"], key)
    assert read_result(signalled)["final_reward"] == read_result(reference)["final_reward"]
