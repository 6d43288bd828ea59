"""Rule-based rewards: built-in rules, user functions and their errors, running moments."""

from __future__ import annotations

import math
import statistics

import pytest

from pipeline.config import RewardRule
from stages import rewards
from stages.rewards import RewardError, RuleReward, RunningMoments


def test_exact_match_compares_the_stripped_completion_with_the_label():
    assert rewards.exact_match(["p"] * 3, [" 123", "124", "123\n"], ["123", "123", "123"]) == [1.0, 0.0, 1.0]


def test_numeric_match_takes_the_last_number():
    got = rewards.numeric_match(["p"] * 3, ["so 2 + 2 = 4", "answer: 4.0", "none"], ["4", "4", "4"])
    assert got == [1.0, 1.0, 0.0]


def test_regex_length_and_keyword_rules():
    assert rewards.regex_format(["p"] * 2, [" 0123", "12a"], [None] * 2, pattern=r"\d+") == [1.0, 0.0]
    assert rewards.length_penalty(["p"] * 2, ["abcd", "ab"], [None] * 2, target=4) == [0.0, -0.5]
    assert rewards.keyword_presence(["p"], ["red and blue"], [None], keywords=["red", "green"]) == [0.5]


def write_function(tmp_path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return f"{path}:score"


def rule(**spec) -> RewardRule:
    return RewardRule.model_validate(spec)


def test_weighted_sum_of_a_builtin_rule_and_a_user_function(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n    return [len(c) for c in completions]\n")
    reward = RuleReward.from_specs([rule(rule="exact_match", weight=2.0), rule(function=ref, weight=0.5)])
    totals, means = reward(["p", "q"], ["12", "9"], ["12", "1"])
    assert totals == [2.0 * 1 + 0.5 * 2, 2.0 * 0 + 0.5 * 1]
    assert means == {"exact_match": 0.5, ref: 1.5}


def test_check_function_finds_missing_files_and_functions_without_running_them(tmp_path):
    with pytest.raises(RewardError, match="not found"):
        rewards.check_function(f"{tmp_path}/nope.py:score")
    ref = write_function(tmp_path, "raise SystemExit('never run at validate time')\ndef other(a, b, c):\n    return []\n")
    with pytest.raises(RewardError, match="defines no function 'score' \\(functions there: other\\)"):
        rewards.check_function(ref)
    ref = write_function(tmp_path, "def score(completions):\n    return []\n")
    with pytest.raises(RewardError, match="takes 1 arguments"):
        rewards.check_function(ref)


def test_a_function_that_raises_is_named_in_the_error(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n    raise KeyError('x')\n")
    with pytest.raises(RewardError, match=f"reward function {ref} raised KeyError"):
        RuleReward.from_specs([rule(function=ref)])(["p"], ["c"], [None])


def test_a_function_returning_the_wrong_length_is_named_in_the_error(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n    return [1.0]\n")
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        RuleReward.from_specs([rule(function=ref)])(["p", "q"], ["c", "d"], [None, None])


def test_a_function_returning_non_finite_values_is_named_in_the_error(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n    return [float('nan')]\n")
    with pytest.raises(RewardError, match="value 0 is nan, not finite"):
        RuleReward.from_specs([rule(function=ref)])(["p"], ["c"], [None])


def test_rule_options_are_checked_against_the_rule():
    with pytest.raises(ValueError, match="rule regex has no option 'target'"):
        rule(rule="regex", options={"target": 3})
    with pytest.raises(ValueError, match="exactly one of `rule`"):
        rule(rule="regex", function="f.py:g")


def test_running_moments_match_the_statistics_of_everything_seen():
    moments = RunningMoments()
    batches = [[1.0, 2.0, 3.0], [10.0], [4.0, -2.0, 0.5, 7.0]]
    for batch in batches:
        moments.update(batch)
    seen = [v for b in batches for v in b]
    assert moments.mean == pytest.approx(statistics.mean(seen))
    assert moments.std == pytest.approx(statistics.stdev(seen))
    normalized = moments.normalize([10.0], clip=1.0)
    assert normalized == [1.0]
    assert math.isclose(moments.normalize([moments.mean])[0], 0.0, abs_tol=1e-12)
