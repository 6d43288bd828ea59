"""Rule-based rewards: built-in rules and user functions, scored on plain strings.

A user function is named `path/to/file.py:function` and returns one number per
completion. How it is called depends on its signature, read once when it is
loaded:

- with `**kwargs`: `f(prompts=..., completions=..., <column>=..., ...)`, every
  column of the completions' data rows as a list (TRL's convention, so a
  reward function written for TRL works unchanged), e.g.
  `def score(prompts, completions, answer, **kwargs)`;
- otherwise, as before: `f(prompts, completions, labels)`, labels being the
  row's label column (label_key); a `labels` parameter beside `**kwargs` gets
  them too.

`check_function` verifies a function without running it (the file parses and
defines it with a signature of either kind), so `validate` can run on a login
node. Each call verifies what it returns: one finite number per completion. A
function that raises, or returns something else, stops the stage with one
message naming the function, the row (its index in its split and the start of
its prompt) and what went wrong.

Torch-free on purpose: rules are plain Python, easy to test and to debug.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from core.errors import InvalidInput

RewardFn = Callable[..., list]
EXCERPT_CHARS = 60


class RewardError(InvalidInput, ValueError):
    """A reward function is missing, broken, or returned something unusable."""


@dataclass(frozen=True)
class Samples:
    """Completions to score, each with the data row it answers (all lists of equal length)."""

    prompts: list[str]
    completions: list[str]
    rows: list[dict]  # every column of each completion's data row
    labels: list[Optional[str]]  # the rows' label column (label_key)
    lengths: list[int]  # tokens of each completion, eos included
    names: list[str]  # how an error names each row, e.g. "train row 17"

    def __len__(self) -> int:
        return len(self.completions)

    def one(self, i: int) -> "Samples":
        return Samples(*([getattr(self, f)[i]] for f in ("prompts", "completions", "rows", "labels", "lengths",
                                                         "names")))

    def describe(self, i: int) -> str:
        prompt = str(self.prompts[i])
        excerpt = prompt if len(prompt) <= EXCERPT_CHARS else prompt[:EXCERPT_CHARS] + "..."
        return f"{self.names[i]} (prompt {excerpt!r})"

    def columns(self) -> dict[str, list]:
        """Every column of the rows as a list per column (None where a row lacks it)."""
        names: dict[str, None] = {}
        for row in self.rows:
            names.update(dict.fromkeys(row))
        return {c: [row.get(c) for row in self.rows] for c in names if c not in ("prompts", "completions")}


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


def overlong_penalty(lengths: Sequence[int], max_len: int, buffer: int) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), on completion tokens L:
    0 for L <= max_len - buffer, then ((max_len - buffer) - L) / buffer down to -1 at max_len, -1 beyond."""
    start = max_len - buffer
    return [0.0 if n <= start else -1.0 if n > max_len else (start - n) / buffer for n in lengths]


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


SIGNATURES = "(prompts, completions, **columns) to get every column of the row, or (prompts, completions, labels)"


def check_function(reference: str) -> None:
    """The file exists, parses, and defines `function` with a signature a reward function can have."""
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
            takes_columns = node.args.kwarg is not None
            if not takes_columns and len(positional) < 3 and node.args.vararg is None:
                raise RewardError(f"{reference}: takes {len(positional)} arguments; a reward function takes "
                                  + SIGNATURES)
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


def takes_columns(function: Callable) -> bool:
    """True when the function takes **kwargs: it gets every column of the rows by name."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def user_term(function: Callable) -> Callable[[Samples], list]:
    if takes_columns(function):
        wants_labels = "labels" in inspect.signature(function).parameters

        def call(s: Samples) -> list:
            columns = s.columns()
            if wants_labels:  # an old (prompts, completions, labels, **kwargs) function keeps its labels
                columns.setdefault("labels", list(s.labels))
            return function(prompts=list(s.prompts), completions=list(s.completions), **columns)

        return call
    return lambda s: function(list(s.prompts), list(s.completions), list(s.labels))


def builtin_term(rule: str, options: dict) -> Callable[[Samples], list]:
    if rule == "overlong_penalty":
        return lambda s: overlong_penalty(s.lengths, **options)
    function = BUILTIN_RULES[rule]
    return lambda s: function(s.prompts, s.completions, s.labels, **options)


# --------------------------------------------------------------------------- scoring


class RuleReward:
    """A weighted sum of rule terms; each term's output is checked on every call."""

    def __init__(self, terms: list[tuple[str, Callable[[Samples], list], float]]):
        self.terms = terms  # (name, term on Samples, weight)

    @classmethod
    def from_specs(cls, specs) -> "RuleReward":
        """From the pipeline file's reward rules (objects with rule/function, weight, options)."""
        terms = []
        for spec in specs:
            if spec.function:
                terms.append((spec.function, user_term(load_function(spec.function)), spec.weight))
            else:
                terms.append((spec.rule, builtin_term(spec.rule, dict(spec.options)), spec.weight))
        return cls(terms)

    def __call__(self, samples: Samples) -> tuple[list[float], dict[str, float]]:
        """Total reward per completion, and each term's mean (for metrics)."""
        totals = [0.0] * len(samples)
        means = {}
        for name, term, weight in self.terms:
            try:
                values = term(samples)
            except Exception as err:  # a user's function: say whose it was, and on which row
                raise _failure(name, term, samples, err) from err
            values = _checked(name, values, samples)
            totals = [t + weight * v for t, v in zip(totals, values)]
            means[name] = sum(values) / max(len(values), 1)
        return totals, means


def _failure(name: str, term, samples: Samples, err: Exception) -> RewardError:
    """Name the first row the term fails on by itself; the whole batch when none does."""
    for i in range(len(samples)):
        try:
            term(samples.one(i))
        except Exception as single:  # noqa: BLE001 - reported, not handled
            return RewardError(f"reward function {name} failed on {samples.describe(i)}: "
                               f"{type(single).__name__}: {single}")
    where = f"a batch of {len(samples)} completions, from {samples.describe(0)}" if len(samples) else "no completions"
    return RewardError(f"reward function {name} failed on {where}: {type(err).__name__}: {err}")


def _checked(name: str, values, samples: Samples) -> list[float]:
    expected = len(samples)
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name} returned {type(values).__name__}; expected a list of floats, "
                          "one per completion")
    if len(values) != expected:
        raise RewardError(f"reward function {name} returned {len(values)} values for {expected} completions")
    out = []
    for i, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name} returned {value!r} ({type(value).__name__}) for "
                              f"{samples.describe(i)}: a reward must be a number") from None
        if not math.isfinite(number):
            raise RewardError(f"reward function {name} returned {number} for {samples.describe(i)}: "
                              "a reward must be a finite number")
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
