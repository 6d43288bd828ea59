"""The local scheduler: the chain on this machine, one stage job at a time, each a submitit
LocalExecutor job (node.py: who a task is; submit.py: the executor that runs the chain)."""

from __future__ import annotations

import schedulers
from schedulers.base import Scheduler
from schedulers.local.node import LocalTask

SCHEDULER = schedulers.register(Scheduler("local", executor="schedulers.local.submit:LocalExecutor",
                                          runtimes=(LocalTask,)))
