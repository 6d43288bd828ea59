"""An RL kind's `reward:` section: a reward model, rule-based terms, or their weighted sum
(core/rewards.py scores them; an RL kind names its reward field in its `Rollouts`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from core.config import Strict

# Built-in rules that compare a completion with the row's label column (label_key).
RULES_NEEDING_LABELS = ("exact_match", "numeric_match")
RULE_OPTIONS = {
    "exact_match": set(),
    "numeric_match": {"tolerance"},
    "regex": {"pattern"},
    "length": {"target"},
    "keyword": {"keywords"},
    "overlong_penalty": {"max_len", "buffer"},
}


class RewardRule(Strict):
    """One rule-based reward term: a built-in rule or your own function."""

    rule: Literal["exact_match", "numeric_match", "regex", "length", "keyword", "overlong_penalty"] | None = Field(
        None,
        description="Built-in rule: exact_match or numeric_match (against the row's label column), "
        "regex (options.pattern must match the whole completion), length (options.target characters; "
        "-abs(len - target) / target), keyword (fraction of options.keywords present), overlong_penalty "
        "(DAPO's soft length penalty on completion tokens: 0 up to options.max_len - options.buffer, "
        "falling linearly to -1 at options.max_len, -1 beyond; its weight is DAPO's penalty factor).",
    )
    function: str | None = Field(
        None, description="Your own reward: path/to/file.py:function returning one float per completion. "
        "A function that takes **kwargs gets keywords: prompts, completions and every column of the rows, one "
        "list per column (TRL's convention); any other is called as f(prompts, completions, labels)."
    )
    weight: float = Field(1.0, description="Weight of this term in the summed reward.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of the built-in rule (see rule).")

    @model_validator(mode="after")
    def _rule_or_function(self):
        if (self.rule is None) == (self.function is None):
            raise ValueError("give exactly one of `rule` (built-in) or `function` (path/to/file.py:function)")
        if self.rule is not None:
            unknown = set(self.options) - RULE_OPTIONS[self.rule]
            if unknown:
                valid = ", ".join(sorted(RULE_OPTIONS[self.rule])) or "none"
                raise ValueError(f"rule {self.rule} has no option '{sorted(unknown)[0]}' (its options: {valid})")
            if self.rule == "overlong_penalty":
                _check_overlong_options(self.options)
        elif self.options:
            raise ValueError("options are for built-in rules; a function gets the rows' columns itself")
        return self


def _check_overlong_options(options: dict) -> None:
    """overlong_penalty needs whole-token max_len and buffer, 1 <= buffer <= max_len."""
    for key in ("max_len", "buffer"):
        value = options.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"rule overlong_penalty: options.{key} must be a whole number of tokens >= 1 "
                             f"(got {value!r}); e.g. options: {{max_len: 256, buffer: 64}}")
    if options["buffer"] > options["max_len"]:
        raise ValueError(f"rule overlong_penalty: options.buffer {options['buffer']} is longer than "
                         f"options.max_len {options['max_len']}")


class RewardSpec(Strict):
    """What an RL stage maximises: a reward model, rule-based terms, or their weighted sum."""

    model: str | None = Field(None, description="Name of an upstream `rm` stage whose model scores completions.")
    model_weight: float = Field(1.0, description="Weight of the reward model's score in the sum.")
    rules: list[RewardRule] = Field(default_factory=list, description="Rule-based terms, summed with their weights.")
    normalize: bool = Field(True, description="Normalise rewards by their running mean and standard deviation.")
    clip: float | None = Field(5.0, gt=0, description="Clip (normalised) rewards to [-clip, clip]; null = no clip.")
    timeout_s: float = Field(
        300.0, gt=0, description="The longest one call of a reward function (rules: function) may take, on all "
        "the completions a process scores at once: a call still running then is stopped, and the stage stops "
        "with a message naming the function and the row it was on. Each process runs its reward functions in a "
        "child process of its own, which is what lets a hung call be stopped.")

    @model_validator(mode="after")
    def _something_to_maximise(self):
        if self.model is None and not self.rules:
            raise ValueError("name a reward `model` (an rm stage), `rules`, or both")
        return self
