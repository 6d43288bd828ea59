"""RL stages through `python -m pipeline run`: real DeepSpeed, 2 processes, the tiny task."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, read_result, run_cli, tiny_pipeline, write_pipeline

pytestmark = pytest.mark.slow

DIGITS = {"path": "builtin:digits", "eval_split": "eval"}


def rl_stage(name, **knobs):
    return {
        "name": name, "kind": "ppo", "from": "sft", "data": DIGITS,
        "rollout_batch_size": 8, "n_samples_per_prompt": 2, "micro_rollout_batch_size": 16,
        "max_new_tokens": 8, "max_steps": 4, "eval_prompts": 16, "learning_rate": 1e-4, **knobs,
    }


def test_sft_rm_ppo_with_the_reward_model_as_the_reward_runs_and_logs_why_the_gpu_idles(workdir):
    from transformers import AutoModelForCausalLM

    spec = tiny_pipeline(stages=[
        {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama", "data": DIGITS, "max_steps": 30},
        {"name": "rm", "kind": "rm", "from": "sft", "data": DIGITS, "max_steps": 20},
        rl_stage("ppo", advantage="gae", reward={"model": "rm"}),
        rl_stage("grpo_zero3", advantage="grpo", zero_stage=3,
                 reward={"model": "rm", "rules": [{"rule": "exact_match", "weight": 1.0}]}),
    ])
    result = run_cli("run", write_pipeline(workdir, spec), cwd=workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = workdir / "runs" / "t"
    for name in ("ppo", "grpo_zero3"):
        outcome = read_result(runs / name)
        assert {"initial_reward", "final_reward"} <= set(outcome)
        rollouts = [m for m in read_metrics(runs / name) if "rollout" in m]
        assert rollouts, name
        for key in ("reward", "kl", "entropy", "clip_fraction", "response_length", "generate_s", "train_s",
                    "generate_tokens_per_s"):
            assert key in rollouts[-1], (name, key)
        AutoModelForCausalLM.from_pretrained(runs / name / "model")
    assert "value_loss" in [m for m in read_metrics(runs / "ppo") if "rollout" in m][-1]
    assert "reward_reward_model" in [m for m in read_metrics(runs / "grpo_zero3") if "rollout" in m][-1]
