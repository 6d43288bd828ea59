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
node. A stage runs each function in a child process (core/reward_process.py),
where each call may take at most reward.timeout_s. Each call verifies what it
returns: one finite number per completion. A function that raises, returns
something else or does not return in time stops the stage with one message
naming the function, the row (its index in its split and the start of its
prompt) and what went wrong.

Torch-free on purpose: rules are plain Python, easy to test and to debug.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from core.errors import InvalidInput
from core.reward_process import INVALID, RAISED, FunctionProcess, Raised, TimedOut, said

RewardFn = Callable[..., list]
EXCERPT_CHARS = 60
# What stopping a call that did not return in time may take besides the calls: its stack
# written, a new child started (the user's imports) for the calls that find the row.
STOP_SLACK_S = 60.0


class RewardError(InvalidInput, ValueError):
    """A reward function is missing, broken, or returned something unusable."""


@dataclass(frozen=True)
class Samples:
    """Completions to score, each with the data row it answers (all lists of equal length)."""

    prompts: list[str]
    completions: list[str]
    rows: list[dict]  # every column of each completion's data row
    labels: list[str | None]  # the rows' label column (label_key)
    lengths: list[int]  # tokens of each completion, eos included
    names: list[str]  # how an error names each row, e.g. "train row 17"

    def __len__(self) -> int:
        return len(self.completions)

    def one(self, i: int) -> Samples:
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
    return [float(c.strip() == (label or "").strip()) for c, label in zip(completions, labels)]


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
    assert spec is not None and spec.loader is not None  # a .py file, checked above
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


class FunctionTerm:
    """A user's function as a term: called in its own child process (core/reward_process.py), each
    call stopped after timeout_s (None: no limit). Loading it stops the stage as a call would."""

    def __init__(self, reference: str, timeout_s: float | None):
        self.reference, self.timeout_s = reference, timeout_s
        self.process = FunctionProcess(reference)
        try:
            self._values(self.process.start(timeout_s))
        except TimedOut:
            raise RewardError(f"reward function {reference}: loading it did not finish within reward.timeout_s "
                              f"({timeout_s:g} s); code at the top level of its file runs when it loads: move what "
                              "waits (downloads, servers) into the function, or raise reward.timeout_s") from None
        except Raised as err:
            raise RewardError(f"reward function {reference}: loading it failed: {err}") from None

    def __call__(self, samples: Samples, timeout_s: float | None = None) -> list:
        """The function's numbers (checked); TimedOut past timeout_s (default: the term's own)."""
        return self._values(self.process.call(samples, self.timeout_s if timeout_s is None else timeout_s))

    @staticmethod
    def _values(answer: tuple) -> list:
        kind, content = answer
        if kind == INVALID:
            raise RewardError(content)
        if kind == RAISED:
            raise Raised(content)
        return content

    def close(self) -> None:
        self.process.close()


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
    def from_specs(cls, specs, timeout_s: float | None = None) -> RuleReward:
        """From the pipeline file's reward rules (objects with rule/function, weight, options);
        a user function's calls are stopped after timeout_s (reward.timeout_s; None: never)."""
        terms: list[tuple[str, Callable[[Samples], list], float]] = []
        for spec in specs:
            if spec.function:
                check_function(spec.function)
                terms.append((spec.function, FunctionTerm(spec.function, timeout_s), spec.weight))
            else:
                terms.append((spec.rule, builtin_term(spec.rule, dict(spec.options)), spec.weight))
        return cls(terms)

    @property
    def longest_s(self) -> float:
        """The longest a call of every term may take before it returns or stops the stage: each
        function's call within its timeout, the last one's past it and the calls that find its row
        (stages/rollout.py tells the watchdog); 0 without a limit."""
        limits = [term.timeout_s for _, term, _ in self.terms if isinstance(term, FunctionTerm) and term.timeout_s]
        return sum(limits) + max(limits) + STOP_SLACK_S if limits else 0.0

    def close(self) -> None:
        for _, term, _ in self.terms:
            if isinstance(term, FunctionTerm):
                term.close()

    def __call__(self, samples: Samples) -> tuple[list[float], dict[str, float]]:
        """Total reward per completion, and each term's mean (for metrics)."""
        totals = [0.0] * len(samples)
        means = {}
        for name, term, weight in self.terms:
            try:
                values = term(samples)
            except RewardError:  # already says whose it was, and on which row
                raise
            except TimedOut:
                raise _timed_out(name, cast(FunctionTerm, term), samples) from None  # only a function times out
            except Exception as err:  # a user's function: say whose it was, and on which row
                raise _failure(name, term, samples, err) from err
            values = checked(name, values, samples)
            totals = [t + weight * v for t, v in zip(totals, values)]
            means[name] = sum(values) / max(len(values), 1)
        return totals, means


def _failure(name: str, term, samples: Samples, err: Exception) -> RewardError:
    """Name the first row the term fails on by itself; the whole batch when none does."""
    for i in range(len(samples)):
        try:
            term(samples.one(i))
        except TimedOut:
            return _timed_out(name, term, samples.one(i))
        except Exception as single:  # noqa: BLE001 - reported, not handled
            return RewardError(f"reward function {name} failed on {samples.describe(i)}: {said(single)}")
    return RewardError(f"reward function {name} failed on {_batch(samples)}: {said(err)}")


def _timed_out(name: str, term: FunctionTerm, samples: Samples) -> RewardError:
    """A call past reward.timeout_s, stopped. Names the row it was on: called on one completion at
    a time, within one more timeout_s in all, the one still running when that time is up."""
    limit = term.timeout_s
    assert limit is not None  # it timed out, so it has a limit
    head = f"reward function {name} did not return within reward.timeout_s ({limit:g} s)"
    advice = ("It was stopped; its Python stack then is in the stage's .err log. Make it return sooner (e.g. give "
              "what it waits on a timeout of its own), or raise reward.timeout_s")
    if len(samples) == 1:
        return RewardError(f"{head} on {samples.describe(0)}. {advice}")
    deadline = time.monotonic() + limit
    returned = 0
    for i in range(len(samples)):
        started = time.monotonic()
        if started >= deadline:
            break
        try:
            term(samples.one(i), timeout_s=deadline - started)
        except TimedOut:
            before = f" (the {i} before it took {started - deadline + limit:.1f} s)" if i else ""
            return RewardError(f"{head} on a call with {len(samples)} completions; called on one at a time, it was "
                               f"still running on {samples.describe(i)} after {time.monotonic() - started:.1f} s"
                               f"{before}. {advice}")
        except Exception:  # noqa: BLE001 -- a row it fails on alone is not what this looks for
            pass
        returned += 1
    return RewardError(f"{head} on {_batch(samples)}; called on one at a time, it returned on {returned} of them "
                       f"within that time: it is too slow for calls of {len(samples)}. Make it faster, or raise "
                       "reward.timeout_s")


def _batch(samples: Samples) -> str:
    return f"a batch of {len(samples)} completions, from {samples.describe(0)}" if len(samples) else "no completions"


def checked(name: str, values, samples: Samples) -> list[float]:
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

    def normalize(self, values: Sequence[float], clip: float | None = None) -> list[float]:
        out = [(v - self.mean) / (self.std + 1e-8) for v in values]
        if clip:
            out = [max(-clip, min(clip, v)) for v in out]
        return out

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]
