"""Advantage estimators: each one declared once, with what the house needs to know of it.

The declaration is torch-free: the schema validates an RL stage against it (its samples per prompt,
the options it reads), the planner counts the critic it trains. Each estimator's tensor function
lives in stages/advantages.py, registered there under the same name (`advantages.advantage_estimator`),
as a stage kind binds its run (core/kinds.py); every estimator takes the same inputs and gives
the same outputs (advantages.estimate_advantages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimator:
    name: str
    description: str  # what it does, as the schema's documentation quotes it
    group_relative: bool = False  # compares the samples of one prompt: needs 2 or more of them
    critic: bool = False  # trains a critic (a value model) beside the policy, exported to critic/
    samples_per_prompt: int = 1  # completions per prompt when the pipeline file does not say
    scales_rewards: bool = False  # reads scale_rewards (which std its advantages are divided by)


_ESTIMATORS: dict[str, Estimator] = {}


def register(estimator: Estimator) -> Estimator:
    """Add an estimator; a name already taken is refused."""
    if estimator.name in _ESTIMATORS:
        raise ValueError(f"advantage estimator '{estimator.name}' is declared twice")
    _ESTIMATORS[estimator.name] = estimator
    return estimator


def unregister(name: str) -> None:
    """Forget an estimator (a plug-in's, e.g. a test's, when it is done)."""
    _ESTIMATORS.pop(name, None)


def get(name: str) -> Estimator:
    try:
        return _ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"no advantage estimator '{name}'; estimators: {', '.join(names())}") from None


def names() -> list[str]:
    return list(_ESTIMATORS)


def check_name(name: str) -> str:
    """`name` when an estimator is declared under it; else ValueError naming the ones that are."""
    if name not in _ESTIMATORS:
        raise ValueError(f"Input should be {_quoted(names())} (got {name!r})")
    return name


def described() -> str:
    """Every estimator and what it does, for the schema's documentation."""
    return _quoted([f"{e.name} ({e.description})" for e in _ESTIMATORS.values()], quote="")


def samples_described() -> str:
    """Which estimators need several samples per prompt, and each one's default, for the schema."""
    grouped = [e.name for e in _ESTIMATORS.values() if e.group_relative]
    defaults: dict[int, list[str]] = {}
    for estimator in _ESTIMATORS.values():
        defaults.setdefault(estimator.samples_per_prompt, []).append(estimator.name)
    return (f"({' and '.join(grouped)} need 2+). Default "
            + ", ".join(f"{n} for {' and '.join(named)}" for n, named in defaults.items()))


def _quoted(items: list[str], quote: str = "'") -> str:
    """a, b or c (as pydantic lists the values a field takes)."""
    quoted = [f"{quote}{item}{quote}" for item in items]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


register(Estimator("grpo", "each sample against its prompt's group; see scale_rewards", group_relative=True,
                   samples_per_prompt=8, scales_rewards=True))
register(Estimator("rloo", "leave-one-out baseline", group_relative=True, samples_per_prompt=8))
register(Estimator("reinforce_pp", "returns whitened over the rollout"))
register(Estimator("gae", "PPO with a critic, exported to critic/", critic=True))
