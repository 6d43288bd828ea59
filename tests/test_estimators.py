"""Advantage estimators are one registry: each is declared once in core/estimators.py (torch-free: its
properties, which the schema validates a stage against) and its tensor function is registered under
the same name in stages/advantages.py, the one that estimate_advantages runs."""

from __future__ import annotations

import pytest
import torch

from core import estimators
from core.schemas.ppo import PPOStage
from stages import advantages as L

DIGITS = {"path": "builtin:digits"}


def rl_stage(**fields) -> PPOStage:
    return PPOStage.model_validate({"name": "rl", "kind": "ppo", "model": "builtin:tiny-llama", "data": DIGITS,
                                    "reward": {"rules": [{"rule": "exact_match"}]}, **fields})


@pytest.fixture
def mean_baseline():
    """An estimator declared as a plug-in would: each sample's reward against the rollout's mean."""
    declared = estimators.register(estimators.Estimator("mean_baseline", "each sample against the rollout's mean",
                                                        samples_per_prompt=4))

    @L.advantage_estimator("mean_baseline")
    def estimate(inputs, settings, sum_over_processes):
        per_sequence = inputs.scores.double() - inputs.scores.double().mean()
        return per_sequence.unsqueeze(1) * inputs.mask.double(), None

    yield declared
    estimators.unregister("mean_baseline")
    L.ADVANTAGE_ESTIMATORS.pop("mean_baseline")


def test_every_declared_estimator_has_its_tensor_function_and_every_function_its_declaration():
    assert list(L.ADVANTAGE_ESTIMATORS) and set(L.ADVANTAGE_ESTIMATORS) == set(estimators.names())


def test_the_schema_takes_each_estimators_samples_per_prompt_and_group_rule_from_its_declaration():
    for name in estimators.names():
        declared = estimators.get(name)
        assert rl_stage(advantage=name).n_samples_per_prompt == declared.samples_per_prompt
        if declared.group_relative:
            with pytest.raises(ValueError, match=f"advantage {name} compares samples of one prompt"):
                rl_stage(advantage=name, n_samples_per_prompt=1)
        else:
            assert rl_stage(advantage=name, n_samples_per_prompt=1).n_samples_per_prompt == 1


def test_an_estimator_declared_once_is_validated_and_computed(mean_baseline):
    stage = rl_stage(advantage="mean_baseline")
    assert stage.n_samples_per_prompt == 4  # its declared default
    inputs = L.AdvantageInputs(scores=torch.tensor([1.0, 3.0]), kl=torch.zeros(2, 2), mask=torch.ones(2, 2))
    advantages, returns = L.estimate_advantages(stage.advantage, inputs, L.AdvantageSettings())
    assert advantages.tolist() == [[-1.0, -1.0], [1.0, 1.0]] and returns is None


def test_an_unknown_estimator_is_named_with_the_declared_ones():
    with pytest.raises(ValueError, match=r"Input should be 'grpo', 'rloo', 'reinforce_pp' or 'gae' \(got 'ppo'\)"):
        rl_stage(advantage="ppo")


def test_a_tensor_function_for_an_estimator_nobody_declared_is_refused():
    with pytest.raises(KeyError, match="no advantage estimator 'nobody'"):
        L.advantage_estimator("nobody")
    with pytest.raises(ValueError, match="declared twice"):
        estimators.register(estimators.Estimator("grpo", "again"))
