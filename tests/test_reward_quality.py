"""An RL stage does not train against a reward model that ranked its own held-out pairs no better
than chance, unless its pipeline file allows it: refused (exit 2) by `validate` and `run` once the
reward model has finished, and by the stage itself before it loads anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core import config as config_module
from core import reward_quality
from core.errors import InvalidInput
from pipeline import graph
from pipeline.executors.base import write_spec
from tests.conftest import run_cli, tiny_pipeline, write_pipeline


def test_a_coin_gets_15_of_20_right_with_probability_21700_in_2_to_the_20():
    # C(20,15) + C(20,16) + ... + C(20,20) = 15504 + 4845 + 1140 + 190 + 20 + 1
    assert reward_quality.chance_tail(15, 20) == pytest.approx(21700 / 2**20)
    assert reward_quality.chance_tail(10, 20) == pytest.approx(0.5881, abs=1e-4)
    assert reward_quality.chance_tail(0, 20) == 1.0


@pytest.mark.parametrize("right, pairs, weak", [
    (10, 20, True),      # chance itself
    (14, 20, True),      # 0.70, but a coin does as well 5.8% of the time on 20 pairs
    (15, 20, False),     # 2.1%
    (540, 1000, True),   # significant on 1000 pairs, and still at most 0.55
    (560, 1000, False),
    (3, 4, True),        # 4 pairs cannot show anything: even 4 of 4 is 6.25%
    (0, 20, True),       # ties (a constant score) count as wrong
])
def test_a_reward_model_is_weak_at_most_0_55_or_not_significantly_above_a_coin(right, pairs, weak):
    said = reward_quality.weakness({"eval_accuracy": right / pairs, "eval_pairs": pairs})
    assert (said is not None) == weak, said


def test_the_bar_is_said_in_pairs_of_the_eval_split():
    said = reward_quality.weakness({"eval_accuracy": 0.5, "eval_pairs": 20})
    assert said.startswith("it ranked 10 of its 20 held-out pairs right (eval_accuracy 0.500), no better than "
                           "chance: a coin gets as many right with probability 0.59")
    assert "better than chance here is at least 15 of 20 (0.75)" in said
    assert reward_quality.weakness({"eval_pairs": 20}) is None  # nothing to judge by


def chain(workdir, **rl) -> dict:
    return tiny_pipeline(stages=[
        {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama", "data": {"path": "builtin:digits"}},
        {"name": "rm", "kind": "rm", "from": "sft", "data": {"path": "builtin:digits"}},
        {"name": "rl", "kind": "ppo", "from": "sft", "data": {"path": "builtin:digits"}, "reward": {"model": "rm"},
         "rollout_batch_size": 16, "n_samples_per_prompt": 2, "micro_batch_size": 8, "global_batch_size": 16, **rl},
    ])


def finish_upstream(config, rm_accuracy: float, rm_pairs: int = 40):
    """sft and rm finished as stages finish (spec.json, result.json with their spec hash)."""
    tasks = {t.name: t for t in graph.build_tasks(config_module.load_pipeline(str(config)))}
    for name, numbers in (("sft", {}), ("rm", {"eval_accuracy": rm_accuracy, "eval_pairs": rm_pairs})):
        write_spec(tasks[name])
        tasks[name].folder.result.write_text(json.dumps({"spec_hash": tasks[name].spec_hash, **numbers}))
    return tasks


def test_validate_refuses_rl_against_a_finished_reward_model_at_chance_and_allows_it_when_asked(workdir):
    config = write_pipeline(workdir, chain(workdir))
    finish_upstream(config, rm_accuracy=0.5)
    result = run_cli("validate", config, cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (f"stages[2] (rl).reward.model: reward model stage 'rm' ({workdir / 'runs' / 't' / 'rm' / 'result.json'}): "
            "it ranked 20 of its 40 held-out pairs right") in result.stderr
    assert "set allow_weak_reward_model: true in stage 'rl'" in result.stderr

    config = write_pipeline(workdir, chain(workdir, allow_weak_reward_model=True))  # the same spec hash
    assert run_cli("validate", config, cwd=workdir).returncode == 0


def test_a_good_reward_model_or_one_not_finished_yet_is_not_refused(workdir):
    config = write_pipeline(workdir, chain(workdir))
    assert run_cli("validate", config, cwd=workdir).returncode == 0  # rm has not run: the stage checks it
    finish_upstream(config, rm_accuracy=0.9)
    assert run_cli("validate", config, cwd=workdir).returncode == 0


def test_allowing_a_weak_reward_model_without_one_is_refused(workdir):
    spec = chain(workdir, allow_weak_reward_model=True)
    spec["stages"][2]["reward"] = {"rules": [{"rule": "exact_match"}]}
    result = run_cli("validate", write_pipeline(workdir, spec), cwd=workdir)
    assert result.returncode == 2 and "allow_weak_reward_model applies to a reward model" in result.stderr


def test_the_stage_warns_when_allowed(workdir):
    config = write_pipeline(workdir, chain(workdir, allow_weak_reward_model=True))
    tasks = finish_upstream(config, rm_accuracy=0.5)
    warning = reward_quality.check(tasks["rl"].stage, tasks["rl"].pipeline_dir)
    assert warning.startswith("warning: reward.model: reward model stage 'rm'")
    assert "Training against it anyway (allow_weak_reward_model: true)" in warning
    config = write_pipeline(workdir, chain(workdir))
    with pytest.raises(InvalidInput):
        reward_quality.check(graph.build_tasks(config_module.load_pipeline(str(config)))[2].stage,
                             tasks["rl"].pipeline_dir)


@pytest.mark.slow
@pytest.mark.stack_free
def test_the_rl_stage_itself_refuses_before_loading_anything(workdir):
    """On Slurm every stage is submitted before the reward model has run: the stage job checks."""
    config = write_pipeline(workdir, chain(workdir))
    tasks = finish_upstream(config, rm_accuracy=0.5)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    result = subprocess.run([sys.executable, "-m", "pipeline", "run-stage", str(config), "rl"], cwd=workdir,
                            env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error: reward.model: reward model stage 'rm'" in result.stderr
    assert "Traceback" not in result.stderr
    rl = tasks["rl"].folder
    assert not rl.model.exists() and not rl.checkpoints.exists() and not rl.metrics.exists()
