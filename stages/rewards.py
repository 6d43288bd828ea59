"""Rule-based rewards: built-in rules and user functions, scored on plain strings.

A user function is named `path/to/file.py:function` and has the signature
`(prompts, completions, labels) -> list[float]`. `check_function` verifies it
without running it (the file parses and defines the function with three
parameters), so `validate` can run on a login node; the first call verifies
what it returns (one finite float per completion).

Torch-free on purpose: rules are plain Python, easy to test and to debug.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from pathlib import Path
from typing import Callable, Optional, Sequence

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[Optional[str]]], list]


class RewardError(ValueError):
    """A reward function is missing, broken, or returned something unusable."""


# --------------------------------------------------------------------------- built-in rules


def exact_match(prompts, completions, labels) -> list[float]:
    """1 when the completion (stripped) equals the row's label, else 0."""
    return [float(c.strip() == (l or "").strip()) for c, l in zip(completions, labels)]


def numeric_match(prompts, completions, labels, tolerance: float = 1e-6) -> list[float]:
    """1 when the last number in the completion equals the label's number."""
    out = []
    for completion, label in zip(completions, labels):
        found = re.findall(r"-?\d+(?:\.\d+)?", completion)
        try:
            out.append(float(bool(found) and abs(float(found[-1]) - float(label)) <= tolerance))
        except (TypeError, ValueError):
            out.append(0.0)
    return out


def regex_format(prompts, completions, labels, pattern: str = ".*") -> list[float]:
    """1 when the whole completion (stripped) matches the pattern."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(prompts, completions, labels, target: int = 100) -> list[float]:
    """0 at the target length in characters, falling linearly: -|len - target| / target."""
    return [-abs(len(c.strip()) - target) / target for c in completions]


def keyword_presence(prompts, completions, labels, keywords: Sequence[str] = ()) -> list[float]:
    """Fraction of the keywords that appear in the completion."""
    if not keywords:
        return [0.0] * len(completions)
    return [sum(k in c for k in keywords) / len(keywords) for c in completions]


BUILTIN_RULES: dict[str, Callable] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "regex": regex_format,
    "length": length_penalty,
    "keyword": keyword_presence,
}


# --------------------------------------------------------------------------- user functions


def split_reference(reference: str) -> tuple[Path, str]:
    path, sep, name = reference.rpartition(":")
    if not sep or not path or not name:
        raise RewardError(f"'{reference}': expected path/to/file.py:function")
    return Path(path), name


def check_function(reference: str) -> None:
    """The file exists, parses, and defines `function` taking (prompts, completions, labels)."""
    path, name = split_reference(reference)
    if not path.is_file():
        raise RewardError(f"reward function file {path} not found")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as err:
        raise RewardError(f"{path}: line {err.lineno}: {err.msg}") from None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            positional = node.args.posonlyargs + node.args.args
            if len(positional) < 3 and node.args.vararg is None:
                raise RewardError(f"{reference}: takes {len(positional)} arguments; "
                                  "a reward function takes (prompts, completions, labels)")
            return
    defined = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
    raise RewardError(f"{path} defines no function '{name}' (functions there: {', '.join(defined) or 'none'})")


def load_function(reference: str) -> RewardFn:
    check_function(reference)
    path, name = split_reference(reference)
    spec = importlib.util.spec_from_file_location(f"reward_fn_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# --------------------------------------------------------------------------- scoring


class RuleReward:
    """A weighted sum of rule terms; each term's output is checked on every call."""

    def __init__(self, terms: list[tuple[str, RewardFn, float]]):
        self.terms = terms  # (name, function, weight)

    @classmethod
    def from_specs(cls, specs) -> "RuleReward":
        """From the pipeline file's reward rules (objects with rule/function, weight, options)."""
        terms = []
        for spec in specs:
            if spec.function:
                terms.append((spec.function, load_function(spec.function), spec.weight))
            else:
                rule = BUILTIN_RULES[spec.rule]
                options = dict(spec.options)
                terms.append((spec.rule, lambda p, c, l, _r=rule, _o=options: _r(p, c, l, **_o), spec.weight))
        return cls(terms)

    def __call__(self, prompts, completions, labels) -> tuple[list[float], dict[str, float]]:
        """Total reward per completion, and each term's mean (for metrics)."""
        totals = [0.0] * len(completions)
        means = {}
        for name, function, weight in self.terms:
            try:
                values = function(list(prompts), list(completions), list(labels))
            except Exception as err:  # a user's function: say whose it was
                raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}") from err
            values = _checked(name, values, len(completions))
            totals = [t + weight * v for t, v in zip(totals, values)]
            means[name] = sum(values) / max(len(values), 1)
        return totals, means


def _checked(name: str, values, expected: int) -> list[float]:
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name} returned {type(values).__name__}; expected a list of floats")
    if len(values) != expected:
        raise RewardError(f"reward function {name} returned {len(values)} values for {expected} completions")
    out = []
    for i, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name}: value {i} is {value!r}, not a number") from None
        if not math.isfinite(number):
            raise RewardError(f"reward function {name}: value {i} is {number}, not finite")
        out.append(number)
    return out


class RunningMoments:
    """Running mean and standard deviation over every reward seen (Chan et al.'s merge)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: Sequence[float]) -> None:
        n = len(values)
        if n == 0:
            return
        batch_mean = sum(values) / n
        batch_m2 = sum((v - batch_mean) ** 2 for v in values)
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def normalize(self, values: Sequence[float], clip: Optional[float] = None) -> list[float]:
        out = [(v - self.mean) / (self.std + 1e-8) for v in values]
        if clip:
            out = [max(-clip, min(clip, v)) for v in out]
        return out

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]
