"""Schedulers: where stage jobs run, one package each, found through one registry.

Each package here (local/: this machine; slurm/: a Slurm cluster) declares itself on import
with `register(Scheduler(...))`: its name (the pipeline file's cluster.executor), its node half
(schedulers/base.py `Runtime`) and its submit half (an Executor, named by module). A scheduler
from elsewhere is a package that does the same, named under the pipeline file's `plugins:`
(tests/fake_scheduler/ is one). The shipped ones are found by looking in this folder, not by name.

`runtime()` answers a stage's process who it is: the node half of the scheduler whose job it is
a task of. Nothing outside these packages reads a scheduler's environment, names its signals
or its log files (tests/test_schedulers.py).

Torch-free, and importing nothing of the project: core stands on it.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from pathlib import Path

from schedulers.base import Layout, Runtime, Scheduler

__all__ = ["Layout", "Runtime", "Scheduler", "register", "unregister", "get", "names", "declared", "runtime",
           "job_started"]

_DECLARED: dict[str, Scheduler] = {}
_SHIPPED: list[str] = []  # the packages in this folder, in order (each declares the scheduler of its name)
_shipped_loaded = False


def register(scheduler: Scheduler) -> Scheduler:
    """Add a scheduler; a name already declared by another submit half is refused."""
    known = _DECLARED.get(scheduler.name)
    if known is not None and known.executor != scheduler.executor:
        raise ValueError(f"scheduler '{scheduler.name}' is declared twice ({known.executor} and "
                         f"{scheduler.executor})")
    _DECLARED[scheduler.name] = scheduler
    return scheduler


def unregister(name: str) -> None:
    """Forget a scheduler (a plug-in's, e.g. a test's, when it is done)."""
    _DECLARED.pop(name, None)


def get(name: str) -> Scheduler:
    _load_shipped()
    try:
        return _DECLARED[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), _DECLARED, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise KeyError(f"no executor '{name}'{hint}; executors: {', '.join(names())} (a plug-in's: name its "
                       "module under plugins:)") from None


def names() -> list[str]:
    return [scheduler.name for scheduler in declared()]


def declared() -> list[Scheduler]:
    """The shipped schedulers in their folders' order, then the others as they were declared."""
    _load_shipped()
    shipped = [_DECLARED[name] for name in _SHIPPED if name in _DECLARED]
    return shipped + [s for s in _DECLARED.values() if s not in shipped]


def runtime() -> Runtime | None:
    """This process as a task of a scheduler's job; None outside one (a test, torchrun, a plain
    python). The shipped schedulers are asked first, in their folders' order (a local job started
    inside a Slurm allocation is a local task), then those of plug-ins."""
    for scheduler in declared():
        for candidate in scheduler.runtimes:
            if candidate.active():
                return candidate()
    return None


def job_started(logs: Path) -> bool:
    """Whether a job of any scheduler ever started with `logs` as its logs folder."""
    return logs.is_dir() and any(r.job_started(logs) for s in declared() for r in s.runtimes)


def _load_shipped() -> None:
    global _shipped_loaded
    if _shipped_loaded:
        return
    _shipped_loaded = True
    _SHIPPED.extend(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg))
    for name in _SHIPPED:
        importlib.import_module(f"{__name__}.{name}")
