"""The vLLM rollout engine in two processes beside a ZeRO-3 actor, tensor_parallel 2
(tests/vllm_probe.py, run once for the module): it samples what transformers samples, keeps the
stage's random state, reports log-probs the trainer agrees with, and samples the old policy until
the actor's weights are synced. End-to-end (a DeepSpeed fleet with two vLLM engines, ~1 min)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core import rollout_engine, tiny
from stages.distributed import free_port
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(rollout_engine.installed() is None,
                                                  reason="vLLM is not installed (the pinned stack has none)")]


@pytest.fixture(scope="module")
def engine_probe(tmp_path_factory) -> list[dict]:
    folder = tiny.materialize("tiny-llama", tmp_path_factory.mktemp("builtin"))
    out = tmp_path_factory.mktemp("probe")
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", env["MASTER_PORT"], str(REPO / "tests" / "vllm_probe.py"), str(folder),
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_vllm_greedy_completions_equal_transformers_with_the_weights_split_over_two_processes(engine_probe):
    for rank in engine_probe:
        assert rank["greedy"] == rank["hf_greedy"]
        assert rank["first_sync_bytes"] > 0  # the actor's weights went in before the first call
    assert engine_probe[0]["greedy"] != engine_probe[1]["greedy"]  # each process its own prompts


def test_building_the_engine_leaves_the_stages_random_state_alone(engine_probe):
    assert all(rank["random_state_kept"] for rank in engine_probe)


def test_the_same_random_state_samples_the_same_and_vllms_log_probs_are_the_trainers(engine_probe):
    for rank in engine_probe:
        assert rank["sampled_again_equal"]
        assert rank["logprob_gap"] < 1e-4  # fp32 on a CPU: the kernels differ in rounding only


def test_without_the_weight_sync_the_engine_samples_the_old_policy(engine_probe):
    for rank in engine_probe:
        assert rank["hf_greedy_after_step"] != rank["hf_greedy"]  # the step changed the policy
        assert rank["greedy_without_sync"] == rank["greedy"]  # the engine did not see it
        assert rank["greedy_after_sync"] == rank["hf_greedy_after_step"]  # the sync hands it over
