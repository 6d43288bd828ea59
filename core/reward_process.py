"""A user's reward function in a child process of its own, so that a call that hangs can be stopped.

A reward function is any code: it may wait forever on a server, loop, or sit in a C extension.
A thread cannot stop it. A signal raised in the training process (SIGALRM) cannot stop C code
either, and a function that sets an alarm of its own (math_verify's timeouts do, on the same
timer) would silently cancel it. A process can always be stopped, and the stage then ends as
for any failing reward function: one message on every rank (stages/rollout.py `score`), each
rank's failure record written. So each process of a stage runs each reward function in one
child python (`python -m core.reward_process`), started when the stage loads it, which keeps the
function and its state for the whole stage. A call's samples go down a pipe and its numbers come
back checked (core/rewards.py `checked`). A call that has not answered in time has the child's
Python stack written to the stage's log (its faulthandler, on SIGUSR1), then the child is
killed; the next call starts a new one.

The child ignores the signals meant for the stage (Ctrl-C, SIGTERM and its scheduler's requeue
signal: the stage decides when to stop, and may need a score to finish the step it saves at), and
dies with the process that started it. Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import schedulers

STACK_WAIT_S = 0.5  # for the child to write its stack before it is killed
CODE_ROOT = str(Path(__file__).resolve().parent.parent)  # where `core` is imported from, in the child too
# What the child answers: the numbers, a problem with them or with the file that the parent can say
# as it is (its message names the function and the row), or an error the function raised.
VALUES, INVALID, RAISED = "values", "invalid", "raised"


class TimedOut(Exception):
    """A call did not answer within its time limit; the child was stopped."""


class Raised(Exception):
    """What the function raised in the child, as `Type: message` (e.g. "KeyError: 'answer'")."""


def said(err: BaseException) -> str:
    return str(err) if isinstance(err, Raised) else f"{type(err).__name__}: {err}"


class FunctionProcess:
    """`path/to/file.py:function` loaded in a child process of this one; `call` sends it samples."""

    def __init__(self, reference: str):
        self.reference = reference
        self.child: subprocess.Popen | None = None
        self.connection: Connection | None = None

    def start(self, timeout_s: float | None) -> tuple:
        """Start the child and wait (at most timeout_s) for it to load the function: (VALUES, None),
        or its INVALID or RAISED answer (a missing file, an import that fails)."""
        self.close()  # a child that ended
        ours, theirs = Pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CODE_ROOT, os.environ.get("PYTHONPATH")]))}
        ignored = ",".join(str(int(sig)) for sig in stage_signals())
        self.child = subprocess.Popen(
            [sys.executable, "-m", "core.reward_process", str(theirs.fileno()), str(os.getpid()), ignored,
             self.reference],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)  # a terminal's Ctrl-C is the stage's to act on, not the child's
        theirs.close()
        self.connection = ours
        return self._answer(timeout_s)

    def call(self, samples, timeout_s: float | None) -> tuple:
        """The child's answer on `samples`: (VALUES, numbers), (INVALID, message) or (RAISED, text);
        TimedOut when it has not answered within timeout_s (None: no limit)."""
        started = time.monotonic()
        if self.child is None or self.child.poll() is not None:
            loaded = self.start(timeout_s)
            if loaded[0] != VALUES:
                return loaded
        left = None if timeout_s is None else timeout_s - (time.monotonic() - started)
        assert self.connection is not None  # started
        try:
            self.connection.send(samples)
        except OSError:  # the child is gone: _answer says how it ended
            pass
        return self._answer(left)

    def _answer(self, timeout_s: float | None) -> tuple:
        assert self.child is not None and self.connection is not None  # started
        try:
            ready = self.connection.poll(None if timeout_s is None else max(timeout_s, 0.0))
            if ready:
                return self.connection.recv()
        except (EOFError, OSError):
            return RAISED, f"its process ended ({_ending(self.child.wait())})"
        self.stop()
        raise TimedOut(timeout_s)

    def stop(self) -> None:
        """Have the child write its Python stack to the log, then kill it."""
        print(f"reward function {self.reference} is past its time: stopping it; its Python stack:", file=sys.stderr,
              flush=True)
        assert self.child is not None  # started
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, signal.SIGUSR1)
            time.sleep(STACK_WAIT_S)
            os.kill(self.child.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        """End the child: it leaves when its pipe closes (killed if it does not within a second)."""
        if self.child is None or self.connection is None:  # never started (the two are set together)
            return
        self.connection.close()
        try:
            self.child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        self.child = self.connection = None


def stage_signals() -> tuple[int, ...]:
    """The signals the stage acts on: Ctrl-C, SIGTERM, and its scheduler's requeue signal."""
    runtime = schedulers.runtime()
    return (signal.SIGINT, signal.SIGTERM) + ((runtime.requeue_signal,) if runtime is not None else ())


def _ending(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# --------------------------------------------------------------------------- the child


def main(argv: list[str]) -> int:
    """python -m core.reward_process FD PARENT_PID SIGNALS path.py:function: serve calls on the pipe
    FD, ignoring SIGNALS (comma-separated numbers)."""
    connection, parent, reference = Connection(int(argv[0])), int(argv[1]), argv[3]
    _die_with(parent)
    for sig in argv[2].split(","):
        signal.signal(int(sig), signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from core import rewards

    try:
        term = rewards.user_term(rewards.load_function(reference))
    except rewards.RewardError as err:
        connection.send((INVALID, err.message))
        return 1
    except BaseException as err:  # noqa: BLE001 -- the user's file, said to the stage
        connection.send((RAISED, said(err)))
        return 1
    connection.send((VALUES, None))
    while True:
        try:
            samples = connection.recv()
        except EOFError:  # the stage closed the pipe, or ended
            return 0
        connection.send(_score(reference, term, samples, rewards))


def _score(reference: str, term, samples, rewards) -> tuple:
    try:
        values = term(samples)
    except BaseException as err:  # noqa: BLE001 -- the user's function: said to the stage, which stops
        return RAISED, said(err)
    try:
        return VALUES, rewards.checked(reference, values, samples)
    except rewards.RewardError as err:
        return INVALID, err.message


def _die_with(parent: int) -> None:
    """Be killed when the process that started this one ends (Linux), even while a call hangs."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
