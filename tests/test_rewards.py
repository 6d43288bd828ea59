"""Rule-based rewards: built-in rules, user functions and their errors, calls stopped at
reward.timeout_s (core/reward_process.py), running moments."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest

from core import rewards
from core.errors import InvalidInput
from core.rewards import RewardError, RuleReward, RunningMoments, Samples
from core.schemas.reward import RewardRule
from tests.conftest import run_cli, tiny_pipeline, tiny_rl_stage, write_pipeline


def samples(prompts, completions, labels=None, rows=None, lengths=None) -> Samples:
    n = len(completions)
    labels = labels if labels is not None else [None] * n
    rows = rows if rows is not None else [{"prompt": p, "label": label} for p, label in zip(prompts, labels)]
    return Samples(prompts=list(prompts), completions=list(completions), rows=rows, labels=list(labels),
                   lengths=lengths or [len(c) for c in completions], names=[f"train row {10 + i}" for i in range(n)])


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
    ref = write_function(tmp_path,
                         "def score(prompts, completions, labels):\n    return [len(c) for c in completions]\n")
    reward = RuleReward.from_specs([rule(rule="exact_match", weight=2.0), rule(function=ref, weight=0.5)])
    totals, means = reward(samples(["p", "q"], ["12", "9"], ["12", "1"]))
    assert totals == [2.0 * 1 + 0.5 * 2, 2.0 * 0 + 0.5 * 1]
    assert means == {"exact_match": 0.5, ref: 1.5}


def test_a_function_with_kwargs_gets_every_column_of_its_rows(tmp_path):
    ref = write_function(tmp_path, (
        "def score(prompts, completions, answer, **kwargs):\n"
        "    return [float(c == a and u == 'km') for c, a, u in zip(completions, answer, kwargs['unit'])]\n"))
    rows = [{"prompt": "p", "answer": "3", "unit": "km"}, {"prompt": "q", "answer": "4", "unit": "mi"},
            {"prompt": "r", "answer": "5", "unit": "km"}]
    totals, _ = RuleReward.from_specs([rule(function=ref)])(samples(["p", "q", "r"], ["3", "4", "6"], rows=rows))
    assert totals == [1.0, 0.0, 0.0]


def test_an_old_function_with_kwargs_still_gets_its_labels(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels, **kwargs):\n"
                                   "    return [float(c == l) for c, l in zip(completions, labels)]\n")
    totals, _ = RuleReward.from_specs([rule(function=ref)])(samples(["p", "q"], ["1", "2"], ["1", "3"]))
    assert totals == [1.0, 0.0]


def test_trl_style_completions_and_kwargs_only_functions_work(tmp_path):
    ref = write_function(tmp_path, "def score(completions, **kwargs):\n"
                                   "    return [float(len(kwargs['prompts'][0]) + len(c)) for c in completions]\n")
    rewards.check_function(ref)
    totals, _ = RuleReward.from_specs([rule(function=ref)])(samples(["pp"], ["abc"]))
    assert totals == [5.0]


def test_overlong_penalty_follows_dapos_soft_punishment():
    # max_len 10, buffer 4: free up to 6 tokens, then -(L - 6) / 4, -1 at 10, -1 beyond
    assert rewards.overlong_penalty([3, 6, 7, 8, 10, 11], max_len=10, buffer=4) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    reward = RuleReward.from_specs([rule(rule="overlong_penalty", weight=0.5, options={"max_len": 10, "buffer": 4})])
    totals, _ = reward(samples(["p", "q"], ["short", "long"], lengths=[5, 9]))
    assert totals == [0.0, 0.5 * -0.75]  # in tokens, not characters


def test_overlong_penalty_options_are_checked():
    with pytest.raises(ValueError, match="options.buffer must be a whole number of tokens"):
        rule(rule="overlong_penalty", options={"max_len": 10})
    with pytest.raises(ValueError, match="options.buffer 12 is longer than options.max_len 10"):
        rule(rule="overlong_penalty", options={"max_len": 10, "buffer": 12})


def test_check_function_finds_missing_files_and_functions_without_running_them(tmp_path):
    with pytest.raises(RewardError, match="not found"):
        rewards.check_function(f"{tmp_path}/nope.py:score")
    ref = write_function(tmp_path,
                         "raise SystemExit('never run at validate time')\ndef other(a, b, c):\n    return []\n")
    with pytest.raises(RewardError, match="defines no function 'score' \\(functions there: other\\)"):
        rewards.check_function(ref)
    ref = write_function(tmp_path, "def score(completions):\n    return []\n")
    with pytest.raises(RewardError, match="takes 1 arguments; a reward function takes \\(prompts, completions, "
                                          "\\*\\*columns\\)"):
        rewards.check_function(ref)


def test_a_function_that_raises_names_itself_the_row_and_the_error_in_one_line(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n"
                                   "    return [1.0 if c else {}['answer'] for c in completions]\n")
    long_prompt = "sort " + "9" * 80 + " ="
    with pytest.raises(RewardError) as caught:
        RuleReward.from_specs([rule(function=ref)])(samples(["sort 1 =", long_prompt], ["1", ""]))
    message = str(caught.value)
    assert message == (f"reward function {ref} failed on train row 11 (prompt {long_prompt[:60] + '...'!r}): "
                       "KeyError: 'answer'")
    assert isinstance(caught.value, InvalidInput)  # a stage reports it as bad input, without a traceback


def test_a_function_that_fails_only_on_the_whole_batch_names_the_batch(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n"
                                   "    assert len(completions) < 2, 'too many'\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardError, match="failed on a batch of 2 completions, from train row 10 "
                                          "\\(prompt 'p'\\): AssertionError: too many"):
        RuleReward.from_specs([rule(function=ref)])(samples(["p", "q"], ["c", "d"]))


def test_a_function_returning_the_wrong_length_is_named_in_the_error(tmp_path):
    ref = write_function(tmp_path, "def score(prompts, completions, labels):\n    return [1.0]\n")
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        RuleReward.from_specs([rule(function=ref)])(samples(["p", "q"], ["c", "d"]))


@pytest.mark.parametrize("value,problem", [("float('nan')", "returned nan for train row 11 \\(prompt 'q'\\): "
                                                            "a reward must be a finite number"),
                                           ("'high'", "returned 'high' \\(str\\) for train row 11 "
                                                      "\\(prompt 'q'\\): a reward must be a number")])
def test_a_function_returning_a_non_number_names_the_row(tmp_path, value, problem):
    ref = write_function(tmp_path, f"def score(prompts, completions, labels):\n    return [1.0, {value}]\n")
    with pytest.raises(RewardError, match=f"reward function {ref} {problem}"):
        RuleReward.from_specs([rule(function=ref)])(samples(["p", "q"], ["c", "d"]))


SLEEPS_ON_Q = ("import time\ndef score(prompts, completions, labels):\n"
               "    if 'q' in prompts:\n        time.sleep(600)\n    return [1.0] * len(completions)\n")


def test_a_call_past_reward_timeout_s_is_stopped_and_names_the_row_it_hangs_on(tmp_path):
    ref = write_function(tmp_path, SLEEPS_ON_Q)
    reward = RuleReward.from_specs([rule(function=ref)], timeout_s=1.0)
    ((_, term, _),) = reward.terms
    child = term.process.child.pid
    started = time.monotonic()
    with pytest.raises(RewardError) as caught:
        reward(samples(["p", "q", "r"], ["c", "d", "e"]))
    message = str(caught.value)
    assert message.startswith(f"reward function {ref} did not return within reward.timeout_s (1 s) on a call with 3 "
                              "completions; called on one at a time, it was still running on train row 11 (prompt 'q') "
                              "after ")
    assert "It was stopped" in message and "raise reward.timeout_s" in message
    assert time.monotonic() - started < 10  # the call, then the rows one at a time within one more timeout
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the hung process is gone
    assert reward(samples(["p"], ["c"]))[0] == [1.0]  # the next call starts a new one
    reward.close()


SLEEPS = ("import time\ndef score(prompts, completions, labels):\n"
          "    time.sleep(600)\n    return [0.0] * len(completions)\n")


@pytest.mark.slow
@pytest.mark.stack_free
def test_a_reward_function_that_sleeps_stops_every_rank_of_an_rl_stage_naming_itself_and_the_row(workdir):
    (workdir / "sleeps.py").write_text(SLEEPS)
    spec = tiny_pipeline(stages=[tiny_rl_stage({"rules": [{"function": "sleeps.py:score"}], "timeout_s": 2})])
    result = run_cli("run", write_pipeline(workdir, spec), cwd=workdir, timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    # The first evaluation scores 4 held-out prompts on each rank; rank 0's first is eval row 0.
    assert ("error: stage rl: reward function sleeps.py:score did not return within reward.timeout_s (2 s) on a call "
            "with 4 completions; called on one at a time, it was still running on eval row 0 (prompt 'sort ") \
        in result.stderr, result.stderr
    stage_dir = workdir / "runs" / "t" / "rl"
    records = [json.loads((stage_dir / "failures" / f"rank-{r:05d}.json").read_text()) for r in (0, 1)]
    assert [r["kind"] for r in records] == ["invalid input", "invalid input"]  # every rank ended, saying why
    (log,) = (stage_dir / "logs").glob("*_0_log.err")
    assert "reward function sleeps.py:score is past its time: stopping it; its Python stack:" in log.read_text()
    assert 'sleeps.py", line 3 in score' in log.read_text()
    assert not [p for p in Path("/proc").glob("[0-9]*") if _runs(p, "core.reward_process", str(workdir))]


def _runs(process: Path, *words: str) -> bool:
    try:
        command = (process / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return all(word in command for word in words)


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
