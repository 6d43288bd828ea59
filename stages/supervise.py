"""Watch one task of a stage job and record how it ended if it could not say so itself.

    python -m stages.supervise RUN_DIR COMMAND...

The local scheduler (schedulers/local/) starts each task of a stage job through this: it runs
COMMAND (submitit's `python -u -m submitit.core._submit ...`) as a child, passes on the signals
the job's controller sends (interrupt, terminate, the scheduler's requeue signal), and exits as
the child did. When the child was killed by a signal or exited non-zero without writing its
failure record (the kernel's out-of-memory killer, a crash in native code), it writes one for it
— rank, host, signal or exit code — so the failure names the process that died, not the ranks
that then lost their connection to it. The exit code with which a task asks its scheduler to
start it again is no death. Who the task is, and where its log goes, its scheduler says
(schedulers/). On Slurm, Slurm reports the same in the job's log (schedulers/slurm/jobs.py).

Torch-free, and light: it lives as long as the task.
"""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import sys
from pathlib import Path

import schedulers
from core import failure
from core.runfolder import StageFolder

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)  # and the requeue signal
# A task stopped at a user's interrupt (SIGINT: Ctrl-C, or the local `run` stopping): it saved
# at the signal in the training loop (stages/preemption.py), or was interrupted outside it and
# resumes from its newest checkpoint. Not a failure: nothing to record.
STOPPED_EXIT_CODE = 128 + signal.SIGINT
STOPPED = (STOPPED_EXIT_CODE, -signal.SIGINT)


def main(argv: list[str]) -> int:
    folder, command = StageFolder(Path(argv[0])), argv[1:]
    runtime = schedulers.runtime()
    rank = failure.task_rank()
    failure.reserve(folder, rank)  # the child writes its cause here; so may we
    oom_kills = oom_kill_count()
    child = subprocess.Popen(command, preexec_fn=_die_with_parent)
    for sig in FORWARDED + ((runtime.requeue_signal,) if runtime is not None else ()):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    code = child.wait()
    recorded = failure.read_record(folder.failure_record(rank))
    # (A record of another job is stale: e.g. written by a stage process of a killed earlier run.)
    ended_well = (0, *STOPPED) + ((runtime.requeue_exit_code,) if runtime is not None else ())
    if code not in ended_well and (recorded is None or recorded.job_id != failure.task_job_id()):
        after = oom_kill_count()
        oom_killed = code == -signal.SIGKILL and oom_kills is not None and after is not None and after > oom_kills
        log = runtime.task_log(folder.logs, runtime.job_id(), rank) if runtime is not None else None
        failure.write(folder, failure.died(rank, code, oom_killed, log=str(log) if log else None))
    return 128 - code if code < 0 else code


def _die_with_parent() -> None:
    """In the child: be killed when this watcher dies (e.g. SIGKILLed with the job), never orphaned;
    and take SIGINT as python does by default, although the local job's controller ignores it
    (schedulers/local/submit.py): the stage stops at an interrupt outside its training loop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def oom_kill_count() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended in this process's memory
    cgroup (v2 memory.events, v1 memory.oom_control); None where it cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates = [Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates = [Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"]
        else:
            continue
        for candidate in candidates:
            try:
                match = re.search(r"^oom_kill (\d+)$", candidate.read_text(), re.MULTILINE)
            except OSError:
                continue
            if match:
                return int(match.group(1))
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
