"""Why a stage failed, as one message a person can act on: the cause, the place, what to do.

Every process (rank) of a stage job has a failure record in the stage folder
(`StageFolder.failure_record`). It is reserved, blank, when the rank starts, so a
cause can still be written when the disk is full; it is removed when the rank
succeeds. A rank that raises writes what went wrong there (`record_exception`);
locally, a rank that dies without a word (a signal, an exit code) is recorded by
the process that watches it (stages/supervise.py); on Slurm, the scheduler's
own lines about dead tasks say it (its executor's `deaths`). `run` and `status` print
`explain`'s message: a cause beats the other ranks' lost connections. The full
traceback stays in the rank's log. Who a process is (its rank, its job) its
scheduler says (schedulers/).

Torch-free: `status` reads the records on a login node; stages write them.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import json
import os
import re
import signal
import socket
import sysconfig
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import schedulers
from core.checkpoints import newest_intact
from core.errors import Diverged, InvalidInput
from core.runfolder import StageFolder, remove, temporary

INVALID_INPUT = "invalid input"
DISK_FULL = "disk full"
FILE_TOO_LARGE = "file too large"
PERMISSION_DENIED = "permission denied"
HOST_OUT_OF_MEMORY = "host out of memory"
GPU_OUT_OF_MEMORY = "GPU out of memory"
PROCESS_DIED = "process died"
DIVERGED = "diverged"  # the weights, or the evaluation loss, stopped being numbers
STOPPED = "stopped"  # on purpose: e.g. the local `run` that started it is gone
LOST_PEER = "lost a peer"
ERROR = "error"

RESERVED_BYTES = 4096  # written when a rank starts; a record fits in it, so it needs no new space
PLAN_HINT = "`python -m pipeline plan CONFIG` shows what each process needs"

# What a rank says when another rank died under it: a consequence, not a cause.
_PEER_LOST = re.compile(
    r"connection (reset|closed) by peer|broken pipe|remote process exited|communicator was aborted"
    r"|socket timeout|timed out waiting|NCCL (error|communicator)", re.IGNORECASE)
WRITE_ERRORS = (errnos.ENOSPC, errnos.EDQUOT, errnos.EFBIG, errnos.EACCES, errnos.EPERM, errnos.EROFS)
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|os error (\d+)|Error code (\d+)")


@dataclass
class Failure:
    rank: int
    host: str
    kind: str  # one of the names above
    message: str  # the cause and what to do
    log: str | None = None  # the rank's stderr: the full traceback
    job_id: str | None = None
    secondary: bool = False  # a consequence of another rank's failure
    time: float = 0.0


# --------------------------------------------------------------------------- what went wrong


class WriteFailed(OSError):
    """Writing `what` at `filename` failed; errno says why. What the file system showed then
    (see `saving`): `free`, the room left to this user; `written`, the bytes it had written
    when it failed (a lower bound of what it needs); `largest`, its largest file; `like`, the
    size of an earlier complete copy of the same thing (the previous checkpoint), when known;
    `limit`, this process's file size limit (RLIMIT_FSIZE) then."""

    def __init__(self, code: int, filename: str, what: str, free: str | None = None,
                 written: int | None = None, largest: int | None = None, like: tuple | None = None):
        super().__init__(code, os.strerror(code), filename)
        self.what, self.free, self.written, self.largest, self.like = what, free, written, largest, like
        self.limit = file_size_limit()


def causes(err: BaseException) -> Iterator[BaseException]:
    """The error and what it was raised from (explicitly, or while handling), outermost first."""
    seen = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)


def error_number(err: BaseException) -> int | None:
    """The errno an error carries, as an attribute or in its text (safetensors, torch's allocator)."""
    if isinstance(err, OSError) and err.errno:
        return err.errno
    match = _ERRNO_IN_TEXT.search(str(err))
    if match:
        return int(next(g for g in match.groups() if g))
    text = str(err)
    for code in WRITE_ERRORS + (errnos.ENOMEM,):
        if os.strerror(code) in text:
            return code
    return None


def describe(err: BaseException) -> tuple[str, str, bool]:
    """(kind, message, secondary) for an exception raised in a stage."""
    for cause in causes(err):
        if isinstance(cause, InvalidInput):
            return INVALID_INPUT, cause.message, False
        if isinstance(cause, Diverged):
            return DIVERGED, cause.message, False
        if type(cause).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(cause):
            return GPU_OUT_OF_MEMORY, (
                f"{_first_line(cause)}. {PLAN_HINT}; lower micro_batch_tokens or max_len, or turn on "
                "gradient_checkpointing, zero_stage: 3 or optimizer_offload"), False
        code = None if isinstance(cause, MemoryError) else error_number(cause)
        if isinstance(cause, MemoryError) or code == errnos.ENOMEM:
            detail = _first_line(cause) or type(cause).__name__
            return HOST_OUT_OF_MEMORY, (
                f"{detail}{_place(err)}. {PLAN_HINT} in host RAM; give the job more (cluster.mem) "
                "or run fewer processes per node"), False
        if code in (errnos.ENOSPC, errnos.EDQUOT):
            return (DISK_FULL, _write_message(cause, code, "Free space there, or set runs_dir to a disk with room"),
                    False)
        if code == errnos.EFBIG:
            return FILE_TOO_LARGE, _write_message(cause, code, (
                "Raise the limit (`ulimit -f unlimited` in the shell or job script that starts the run; on a "
                "cluster, ask whether the site sets one), or save smaller files")), False
        if code in (errnos.EACCES, errnos.EPERM, errnos.EROFS):
            return PERMISSION_DENIED, _write_message(cause, code, "Make it writable, or set runs_dir to a folder "
                                                     "you can write"), False
    if any(_PEER_LOST.search(str(cause)) for cause in causes(err)):
        return LOST_PEER, f"lost its connection to another process ({_first_line(err)[:200]})", True
    return ERROR, f"{type(err).__name__}: {_first_line(err)}{_place(err)}", False


def _write_message(err: BaseException, code: int, advice: str) -> str:
    """What could not be written where, why in words, how much it needed where that is known, and
    what to do; a failed save inside a stage also says what of the stage is intact."""
    path = getattr(err, "filename", None)
    if isinstance(err, WriteFailed):
        text = f"cannot write {path} ({err.what}): {os.strerror(code)}"
    else:
        text = f"{path}: {os.strerror(code)}" if path else _first_line(err)
    text += _why(code, path, err)
    text += f". {advice}"
    if isinstance(err, WriteFailed):
        text += f"; then `run` again: {_intact(Path(err.filename))}"
    return text


def _why(code: int, path: str | None, err: BaseException) -> str:
    """The cause in words, with the sizes that matter: the file size limit and the largest file,
    the room left and what the write needed, the file system's read-only flag, the user."""
    written, largest, like = (getattr(err, name, None) for name in ("written", "largest", "like"))
    if code == errnos.EFBIG:
        limit = err.limit if isinstance(err, WriteFailed) else file_size_limit()
        said = (f": this process may write files of at most {_bytes(limit)} (`ulimit -f`, RLIMIT_FSIZE)"
                if limit is not None else ": a file reached the largest size the file system allows")
        if like is not None and like[1] > (limit or 0):
            said += f", and the previous one ({like[2]}) has a file of {_bytes(like[1])}"
        elif largest and limit is not None and largest >= limit:
            said += ", and one of its files reached it"
        return said
    if code in (errnos.ENOSPC, errnos.EDQUOT):
        room = getattr(err, "free", None) or (free_space(path) if path else None)
        said = f" ({room} free on that file system)" if room is not None else ""
        if like is not None:
            said += f"; it needs about {_bytes(like[0])}, the size of the previous one ({like[2]})"
        elif written:
            said += f"; it needs more than the {_bytes(written)} it had written when it failed"
        return said
    if code == errnos.EROFS:
        return ": the file system holding it is mounted read-only"
    if code in (errnos.EACCES, errnos.EPERM):
        return f" to this user (uid {os.geteuid()})"
    return ""


def _intact(path: Path) -> str:
    """What a failed save left of its stage: the newest complete checkpoint, untouched."""
    for folder in list(path.parents)[:3]:
        stage = StageFolder(folder)
        if stage.spec.is_file() or stage.checkpoints.is_dir():
            latest = newest_intact(stage).tag
            if latest:
                return (f"nothing earlier was lost, and the stage resumes from its newest complete checkpoint, "
                        f"{latest} ({stage.checkpoints / latest})")
            return "nothing earlier was lost; no checkpoint was complete yet, so the stage starts over"
    return "nothing earlier was lost; the stage resumes from its newest complete checkpoint, if any"


def file_size_limit() -> int | None:
    """This process's largest writable file in bytes (RLIMIT_FSIZE, `ulimit -f`); None if unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def free_space(path) -> str | None:
    """Bytes left to this user on the file system holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return _bytes(stat.f_bavail * stat.f_frsize)


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _place(err: BaseException) -> str:
    """' at FILE:LINE in FUNCTION': the innermost frame of the deepest cause that is not
    Python's or an installed package's code (a stage file, or the user's reward file)."""
    paths = sysconfig.get_paths()
    library = tuple(filter(None, {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}))
    for cause in reversed(list(causes(err))):
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if not f.filename.startswith(library)]
        if frames:
            frame = frames[-1]
            return f" at {_short(frame.filename)}:{frame.lineno} in {frame.name}"
    return ""


def _short(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


@contextlib.contextmanager
def saving(path: Path, what: str, like: Path | None = None) -> Iterator[None]:
    """Write `what` at `path` (a file or a folder); if that fails, remove what it half wrote
    and, when the cause is the disk (full, a file size limit, read-only, not ours), raise
    WriteFailed saying so. `like`: an earlier complete copy of the same thing (the previous
    checkpoint), whose size says what the write needs.

    Writers such as torch.save report a write error as "[enforce fail at
    inline_container.cc:...] unexpected pos" with no errno; the file system and this
    process's limits are then asked why (`_diagnose`), before the partial files are removed
    (which frees space).
    """
    try:
        yield
    except Exception as err:
        sizes = _file_sizes(path)
        code = (next((c for c in map(error_number, causes(err)) if c in WRITE_ERRORS), None)
                or _diagnose(path, max(sizes, default=0)))
        free = free_space(path)  # before the partial files go
        remove(path)
        if code not in WRITE_ERRORS:
            raise
        earlier = _file_sizes(like) if like is not None else []
        raise WriteFailed(code, str(path), what, free, written=sum(sizes), largest=max(sizes, default=None),
                          like=(sum(earlier), max(earlier), str(like)) if earlier else None) from err


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """Add to `what` at `path` (e.g. a line of metrics.jsonl), keeping what is there: a write the
    disk refuses raises WriteFailed naming the file (a failed write names none by itself)."""
    try:
        yield
    except OSError as err:
        code = err.errno if err.errno in WRITE_ERRORS else None
        if code is None:
            raise
        raise WriteFailed(code, str(path), what, free_space(path)) from err


def cannot_make_in(folder: Path) -> int | None:
    """The errno that keeps this user from making a folder with a file in it inside `folder`
    (tried, then removed), or None: what `run` will do there, asked before it does."""
    probe = temporary(Path(folder) / f".write-probe-{os.getpid()}")
    try:
        probe.mkdir()
        (probe / "probe").write_bytes(b"\0" * 4096)
    except OSError as err:
        return err.errno
    finally:
        remove(probe)
    return None


def cannot_make_reason(code: int, folder: Path) -> str:
    """`cannot_make_in`'s errno in words, naming the folder."""
    if code == errnos.EROFS:
        return f"the file system holding {folder} is mounted read-only"
    if code in (errnos.EACCES, errnos.EPERM):
        return f"{folder} is not writable by this user (uid {os.geteuid()})"
    if code == errnos.ENOENT:
        return f"{folder} takes no new folders (a kernel file system such as /proc or /sys)"
    if code in (errnos.ENOSPC, errnos.EDQUOT):
        return f"the file system holding {folder} is full ({free_space(folder)} free)"
    return f"{os.strerror(code)} in {folder}"


def _file_sizes(path: Path) -> list[int]:
    """The sizes of the files at `path` (a file, or a folder's files)."""
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    sizes = []
    for file in files:
        with contextlib.suppress(OSError):
            sizes.append(file.stat().st_size)
    return sizes


def _diagnose(path: Path, largest: int) -> int | None:
    """Why a write at `path` failed, asked of this process and the file system when the error
    carried no errno: a file that reached the file size limit (EFBIG), a read-only file system
    (EROFS), a folder this user may not write (EACCES), no room (a probe write meets ENOSPC)."""
    limit = file_size_limit()
    if limit is not None and largest >= limit:
        return errnos.EFBIG
    folder = _nearest_folder(path)
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return errnos.EROFS
    except OSError:
        pass
    if not os.access(folder, os.W_OK | os.X_OK):
        return errnos.EACCES
    return _probe(folder)


def _nearest_folder(path: Path) -> Path:
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    return folder


def _probe(folder: Path, size: int = 1 << 20) -> int | None:
    """Write `size` bytes in `folder` and remove them; the errno it meets, or None."""
    probe = temporary(folder / f"write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return err.errno
    finally:
        remove(probe)
    return None


# --------------------------------------------------------------------------- the records


def task_rank() -> int:
    """This process's rank (before torch.distributed is up): its scheduler's word, else a
    launcher's (torchrun's RANK), else 0."""
    runtime = schedulers.runtime()
    if runtime is not None:
        return runtime.rank()
    return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0


def task_job_id() -> str | None:
    """The id of the scheduler's job this process is a task of; None outside one."""
    runtime = schedulers.runtime()
    return runtime.job_id() if runtime is not None else None


def reserve(folder: StageFolder, rank: int) -> None:
    """A blank record for this rank (replacing one from an earlier attempt)."""
    path = folder.failure_record(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b" " * RESERVED_BYTES)


def release(folder: StageFolder, rank: int) -> None:
    with contextlib.suppress(OSError):
        folder.failure_record(rank).unlink()


def write(folder: StageFolder, failure: Failure) -> None:
    """Write the record over its reserved blank, in place: no new space is needed."""
    path = folder.failure_record(failure.rank)
    data = json.dumps(asdict(failure)).encode()
    if len(data) > RESERVED_BYTES:
        failure.message = failure.message[: max(0, len(failure.message) - (len(data) - RESERVED_BYTES) - 3)] + "..."
        data = json.dumps(asdict(failure)).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data.ljust(RESERVED_BYTES))
        os.ftruncate(fd, max(len(data), RESERVED_BYTES))
    finally:
        os.close(fd)


def record_exception(folder: StageFolder, rank: int, err: BaseException, log: str | None) -> Failure:
    kind, message, secondary = describe(err)
    failure = Failure(rank=rank, host=socket.gethostname(), kind=kind, message=message, log=log,
                      job_id=task_job_id(), secondary=secondary, time=time.time())
    write(folder, failure)
    return failure


def died(rank: int, returncode: int, oom_killed: bool, log: str | None) -> Failure:
    """The record of a rank whose process ended by a signal or an exit code without saying why."""
    if returncode < 0:
        name = _signal_name(-returncode)
        message = f"the process was killed by {name} (signal {-returncode})"
        if oom_killed:
            message += (": the kernel's out-of-memory killer ended it (host RAM ran out). "
                        f"{PLAN_HINT} in host RAM; give the job more (cluster.mem) or run fewer processes per node")
        elif -returncode == signal.SIGKILL:
            message += (": the kernel's out-of-memory killer sends it when host RAM runs out (see `dmesg`), "
                        "or a person or the scheduler killed it")
    else:
        message = (f"the process exited with code {returncode} without a Python error (a crash in native code, "
                   "or os._exit)")
    return Failure(rank=rank, host=socket.gethostname(), kind=HOST_OUT_OF_MEMORY if oom_killed else PROCESS_DIED,
                   message=message, log=log, job_id=task_job_id(), time=time.time())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def read(folder: StageFolder, job_id: str | None = None) -> list[Failure]:
    """The written records (not the blank reservations), of one job when job_id is given."""
    paths = sorted(folder.failures.glob("rank-*.json")) if folder.failures.is_dir() else []
    found = [f for f in map(read_record, paths) if f is not None]
    return [f for f in found if job_id is None or f.job_id in (None, job_id)]


def read_record(path: Path) -> Failure | None:
    """One rank's record; None while it is blank (reserved) or unreadable."""
    try:
        text = path.read_text(errors="replace").strip()
        return Failure(**json.loads(text)) if text else None
    except (OSError, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------- the message


def explaining(failures: list[Failure]) -> Failure | None:
    """The record that explains the failure: bad input, else the first cause, else a lost connection."""
    if not failures:
        return None
    candidates = [f for f in failures if f.kind == INVALID_INPUT] or [f for f in failures if not f.secondary]
    if candidates:
        return min(candidates, key=lambda f: (f.time, f.rank))
    return min(failures, key=lambda f: f.rank)


def summary(failures: list[Failure]) -> str | None:
    """The cause in one paragraph (what, on which rank and host, what to do); None without records."""
    first = explaining(failures)
    if first is None:
        return None
    if first.kind == INVALID_INPUT:
        return first.message
    text = f"{first.kind} on rank {first.rank} (host {first.host}): {first.message}"
    if first.secondary:
        return text + ("; no process recorded a cause of its own: one may have been killed or crashed "
                       "(each rank's log is in the stage's logs folder)")
    followers = sorted({f.rank for f in failures if f.secondary})
    if followers:
        ranks = ", ".join(map(str, followers))
        text += (f"; rank {ranks} then stopped: it lost its connection to it" if len(followers) == 1 else
                 f"; ranks {ranks} then stopped: they lost their connection to it")
    return text


def explain(stage: str, failures: list[Failure]) -> str | None:
    """What `run` prints for a failed stage, or None when no rank left a record."""
    first = explaining(failures)
    if first is None:
        return None
    if first.kind == INVALID_INPUT:
        return f"stage {stage}: {first.message}"
    return f"stage {stage} failed: {summary(failures)}" + (f"\n  log: {first.log}" if first.log else "")
