"""What Slurm says of its jobs: their state (scontrol, sacct), cancelling them, and srun's lines
about tasks that died.

`scontrol show job` knows a job from submission until MinJobAge seconds after
it ended (300 s by default); `sacct` knows it afterwards, but only where the
cluster runs accounting, and clusters without it exist. So the order is:
scontrol, then sacct, and callers fall back to the run folder after that
(result.json exists = the stage finished).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from dataclasses import dataclass

from core.errors import PipelineError
from core.failure import HOST_OUT_OF_MEMORY, PLAN_HINT, PROCESS_DIED, Failure

# Job states in which a job may still run, or is running, or is cleaning up.
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
})
WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "RESV_DEL_HOLD"})
COMMAND_TIMEOUT_S = 60


class SlurmUnavailable(PipelineError):
    """Slurm's commands are missing or its controller does not answer."""


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # Slurm's JobState: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    reason: str = ""  # e.g. Dependency, BeginTime, NonZeroExitCode, DependencyNeverSatisfied
    exit_code: str = ""  # "status:signal", e.g. 1:0
    restarts: int = 0  # how often the job was requeued
    nodes: str = ""  # e.g. n[1-2]
    source: str = "scontrol"

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def waiting(self) -> bool:
        return self.state in WAITING_STATES


def job_info(job_ids: list[str]) -> dict[str, JobInfo]:
    """What Slurm knows of each job; ids it has forgotten are absent from the answer."""
    found: dict[str, JobInfo] = {}
    for job_id in dict.fromkeys(job_ids):
        info = _from_scontrol(job_id)
        if info is not None:
            found[job_id] = info
    missing = [j for j in job_ids if j not in found]
    if missing:
        found.update(_from_sacct(missing))
    return found


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        _run(["scancel", *job_ids], check=True)


def wait_until_ended(job_ids: list[str], timeout_s: float, poll_s: float = 1.0) -> list[str]:
    """Poll until none of the jobs is live; returns those still live at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = job_info(job_ids)
        live = [j for j in job_ids if j in infos and infos[j].live]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(poll_s)


def _from_scontrol(job_id: str) -> JobInfo | None:
    result = _run(["scontrol", "-o", "show", "job", job_id])
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return None  # ended more than MinJobAge ago, or never existed
        raise SlurmUnavailable(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
    fields = parse_scontrol_line(result.stdout.strip().splitlines()[0] if result.stdout.strip() else "")
    if "JobState" not in fields:
        return None
    return JobInfo(
        job_id=job_id,
        state=fields["JobState"],
        reason=fields.get("Reason", "") if fields.get("Reason") != "None" else "",
        exit_code=fields.get("ExitCode", ""),
        restarts=int(fields.get("Restarts", "0") or 0),
        nodes=fields.get("NodeList", "") if fields.get("NodeList") != "(null)" else "",
    )


def parse_scontrol_line(line: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` (scontrol -o); a value may contain spaces."""
    fields: dict[str, str] = {}
    key = None
    for token in line.split(" "):
        name, sep, value = token.partition("=")
        if sep and name:
            key = name
            fields[key] = value
        elif key is not None and token:
            fields[key] += " " + token
    return fields


def _from_sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """Accounting, when the cluster has it; nothing when it does not."""
    try:
        result = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,NodeList", "-j", ",".join(job_ids)])
    except SlurmUnavailable:
        return {}
    if result.returncode != 0:
        return {}  # e.g. "Slurm accounting storage is disabled"
    found = {}
    for line in result.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 4 or parts[0] not in job_ids:
            continue
        state = parts[1].split(" ")[0]  # "CANCELLED by 1000" -> CANCELLED
        found[parts[0]] = JobInfo(parts[0], state, exit_code=parts[2], nodes=parts[3], source="sacct")
    return found


def _run(command: list[str], check: bool = False) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmUnavailable(f"{command[0]} not found: is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{' '.join(command)} did not answer in {COMMAND_TIMEOUT_S} s") from None
    if check and result.returncode != 0:
        raise SlurmUnavailable(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


# --------------------------------------------------------------------------- srun's lines


_SRUN_TASK_END = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+?)\s*$", re.MULTILINE)


def srun_deaths(text: str) -> list[Failure]:
    """Records for the tasks srun says died (its 'srun: error: HOST: task N: ...' lines in the
    batch script's stderr): what a Slurm stage cannot write for itself when it is killed."""
    failures = []
    for host, tasks, what in _SRUN_TASK_END.findall(text):
        what = what.removesuffix(" (core dumped)")
        exited = re.fullmatch(r"Exited with exit code (\d+)", what)
        if what == "Out Of Memory":
            kind, message = HOST_OUT_OF_MEMORY, (
                f"Slurm ended it: the job used more host memory than it asked for. {PLAN_HINT} in host RAM; "
                "ask for more (cluster.mem) or run fewer processes per node")
        elif exited:
            kind, message = PROCESS_DIED, f"the process exited with code {exited.group(1)}"
        else:
            kind, message = PROCESS_DIED, f"the process was killed: {what} ({_signal_named(what)})"
        for rank in _ranks(tasks):
            failures.append(Failure(rank=rank, host=host, kind=kind, message=message))
    return failures


def _signal_named(description: str) -> str:
    for sig in signal.Signals:
        if signal.strsignal(sig) == description:
            return sig.name
    return "a signal"


def _ranks(tasks: str) -> list[int]:
    ranks = []
    for part in tasks.split(","):
        low, _, high = part.partition("-")
        ranks += list(range(int(low), int(high or low) + 1))
    return ranks
