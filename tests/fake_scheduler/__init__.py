"""A scheduler declared in one package, as a plug-in would be (tests/test_schedulers.py runs a
stage on it): it starts each task of a stage job as a plain subprocess of the `run`, names them
in its own environment variables (node.py), requeues at its own signal and exit code, and
preempts each job once when told to. Named under a pipeline file's `plugins:`, it registers on
import; nothing else in the project knows it.
"""

from __future__ import annotations

import schedulers
from schedulers.base import Scheduler
from tests.fake_scheduler.node import FakeTask

SCHEDULER = schedulers.register(Scheduler("fake", executor="tests.fake_scheduler.submit:FakeExecutor",
                                          runtimes=(FakeTask,)))
