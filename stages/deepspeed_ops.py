"""DeepSpeed's C++ ops as the stages build them: where the JIT-built ones are kept, and a line
whenever one is compiled.

The images and DS_BUILD_* installs ship the ops prebuilt; otherwise DeepSpeed compiles an op
the first time a process loads it (the CPU communication op at init_distributed on a CPU, CPU
Adam for optimizer_offload) through torch.utils.cpp_extension.load. torch writes build.ninja
into <extensions folder>/<op>/ and runs ninja there in every process that loads the op (its
own record of what it built lives only as long as the process), so ninja alone decides whether
anything is compiled: nothing when the library is newer than its sources and ninja's build log
holds the same commands. Another ninja version cannot use the log the other wrote (1.13 starts
over on 1.11's log, 1.11 finds 1.13's hashes changed) and compiles everything again, as does a
changed flag, a newer source or a missing library. So `prepare()` asks ninja itself, with a
dry run just before torch's real run, and says which op is built, why and about how long; a
process waiting on another's build says so too. The cached case says nothing.

`prepare()` also makes each environment build with its own ninja (the one installed beside its
python, when there is one), so an activated and a plain run of the same checkout do not rebuild
over each other, and keeps the folder per environment (`extensions_dir`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

ENV = "TORCH_EXTENSIONS_DIR"
# What each op is, and about how long it takes to compile on an idle 2-core machine (the
# compiles run in parallel, so more cores help little; a busy machine takes 2-4x as long).
OPS = {
    "deepspeed_shm_comm": ("DeepSpeed's CPU communication op", 40),
    "cpu_adam": ("DeepSpeed's CPU Adam, optimizer_offload's optimizer", 60),
}
# A waiting process stays quiet this long: a cached op holds the lock for a moment only.
QUIET_WAIT_S = 5.0
STALE_LOCK_S = 600.0
_built: dict[str, float] = {}  # ops this process compiled: seconds each


def extensions_dir() -> Path:
    """Where the stages' JIT-built ops are kept: TORCH_EXTENSIONS_DIR when set; else inside the
    virtual environment (<venv>/torch_extensions: a checkout's .venv keeps its own, as `make`
    always had it); else, where that cannot be written (a read-only image, the system python),
    a folder of the user's cache named after the environment, so two environments never
    compile over each other's ops."""
    chosen = os.environ.get(ENV)
    if chosen:
        return Path(chosen)
    if sys.prefix != sys.base_prefix:
        inside = Path(sys.prefix) / "torch_extensions"
        try:
            inside.mkdir(exist_ok=True)
        except OSError:
            pass
        else:
            if os.access(inside, os.W_OK):
                return inside
    return _cache_dir()


def _cache_dir() -> Path:
    """torch's own default folder, one per environment (its path, python, torch and DeepSpeed)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    environment = f"{sys.prefix}|{sys.version}|{torch.__version__}|{_version('deepspeed')}"
    key = hashlib.sha256(environment.encode()).hexdigest()[:8]
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}_{key}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def jit_built_ops() -> list[str]:
    """Ops JIT-built earlier into the extensions folder: DeepSpeed loads them from there."""
    return sorted(so.parent.name for so in extensions_dir().glob("*/*.so") if so.stem == so.parent.name)


def built_here() -> dict[str, float]:
    """The ops this process compiled, with the seconds each took."""
    return dict(_built)


def describe(op: str) -> str:
    return f"{OPS[op][0]} ({op})" if op in OPS else f"the C++ extension {op}"


def duration(op: str) -> str:
    if op in OPS:
        return f"about {OPS[op][1]} s on an idle 2-core machine, a few minutes on a busy one"
    return "a minute or more"


def environment() -> dict[str, str]:
    """What a process that may build an op needs in its environment: TORCH_EXTENSIONS_DIR
    (`extensions_dir`) and, first on PATH, the ninja installed beside this python when there is
    one. torch runs `ninja` from PATH, and an activated and a plain run of one checkout would
    otherwise build with different ninjas, which cannot use each other's build log."""
    env = {ENV: str(extensions_dir())}
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if (Path(scripts) / "ninja").is_file() and path.split(os.pathsep)[0] != scripts:
        env["PATH"] = os.pathsep.join([scripts, path]) if path else scripts
    return env


def prepare() -> None:
    """Call before DeepSpeed loads an op (each process that may build one), after logging is set
    up: sets `environment()` for this process and its children, and says when an op is compiled
    or waited for. Silences what DeepSpeed prints when nothing is built: its compatibility
    probes' compiler commands and "... built successfully"."""
    os.environ.update(environment())
    _quiet_probes()
    from torch.utils import cpp_extension

    if not getattr(cpp_extension._run_ninja_build, "announces", False):
        cpp_extension._run_ninja_build = _announcing(cpp_extension._run_ninja_build)
        cpp_extension.FileBaton = _saying_baton(cpp_extension.FileBaton)
    _quiet_loads()
    _quiet_shm_success()


def _announcing(run_ninja_build):
    """torch's ninja run, preceded by a dry run that says whether it compiles anything."""

    @functools.wraps(run_ninja_build)
    def run(build_directory, verbose, error_prefix):
        op = Path(build_directory).name
        reason = pending(Path(build_directory))
        if reason is None:
            return run_ninja_build(build_directory, verbose, error_prefix)
        say(f"building {describe(op)} with the C++ compiler: {reason}; {duration(op)}; kept in "
            f"{Path(build_directory).parent} for later stages and runs")
        started = time.monotonic()
        run_ninja_build(build_directory, verbose, error_prefix)
        _built[op] = time.monotonic() - started
        say(f"built {op} in {_built[op]:.0f} s")

    run.announces = True  # type: ignore[attr-defined]  # marks the patch, so it is made once
    return run


def pending(build_directory: Path) -> str | None:
    """Why ninja would compile something in `build_directory` (its dry run, explained), or None
    when it has nothing to do or cannot say (then the real run reports its own errors)."""
    had_log = (build_directory / ".ninja_log").exists()  # a dry run may remove one it cannot read
    try:
        dry = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=build_directory, capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    said = dry.stdout + dry.stderr
    if dry.returncode != 0 or not re.search(r"^\[\d+/\d+\] ", said, re.MULTILINE):
        return None
    if not (build_directory / f"{build_directory.name}.so").exists():
        return "not built yet"
    if not had_log:
        return "ninja's build log there is gone, so it compiles it again"
    if "build log version" in said or "command line not found in log" in said:
        return (f"another ninja version built it, and ninja {_ninja_version()} ({_which_ninja()}) cannot use "
                "that one's build log, so it compiles it again")
    if "command line changed" in said:
        return ("its compile commands changed (another compiler, other flags or paths, or another ninja "
                "version's build log)")
    if "older than most recent input" in said:
        return "a source is newer than the library"
    first = next((line for line in said.splitlines() if line.startswith("ninja explain:")), "")
    return first.removeprefix("ninja explain: ") or "ninja finds it out of date"


def _ninja_version() -> str:
    """e.g. 1.13.2 (the pip wheel's own says "1.13.2.git.kitware.jobserver-pipe-1")."""
    try:
        said = subprocess.run(["ninja", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    found = re.match(r"\d+(\.\d+)*", said.strip())
    return found.group(0) if found else said.strip()


def _which_ninja() -> str:
    return shutil.which("ninja") or "ninja"


def _saying_baton(baton_class):
    """torch's lock on a build folder, whose waiters say so once another process is building."""

    class SayingBaton(baton_class):  # type: ignore[misc,valid-type]  # torch's class, subclassed at run time
        def wait(self):
            lock = Path(self.lock_file_path)
            op, started, said = lock.parent.name, time.monotonic(), 0
            while lock.exists():
                waited = time.monotonic() - started
                if said == 0 and waited > QUIET_WAIT_S:
                    said = 1
                    say(f"waiting while another process builds {describe(op)} in {lock.parent} "
                        f"({duration(op)})")
                elif said == 1 and waited > STALE_LOCK_S:
                    said = 2
                    say(f"still waiting on {lock} after {waited / 60:.0f} min: if no process is building "
                        f"{op}, a killed build left this lock behind: remove it")
                time.sleep(self.wait_seconds)

    return SayingBaton


def say(line: str) -> None:
    """A line of every process that builds or waits: on its own output, as its log's other
    lines (rank 0's is the one a local run shows)."""
    print(line, flush=True)


class _DistutilsEcho(logging.Filter):
    """setuptools' distutils logs each compiler command of DeepSpeed's compatibility probes
    (`gcc ... test.c -laio`) at INFO (on the root logger, or on "compilers.C.base" from
    setuptools 80), which rank 0 shows: not a build. Their warnings and errors still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not re.search(r"[/\\]_?distutils[/\\]", record.pathname)


def _quiet_probes() -> None:
    """On the handlers logging has by now (the stage's, set up before `prepare`)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _DistutilsEcho) for f in handler.filters):
            handler.addFilter(_DistutilsEcho())


def _quiet_loads() -> None:
    """DeepSpeed 0.13 loads an op verbosely unless told otherwise: ninja's "no work to do",
    torch's "Loading extension module ...", "Time to load cpu_adam op: ..." at every load, built
    or cached (0.14+ is quiet). Loads default to quiet: a build says so itself (above), and a
    failed one raises with the compiler's output."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    load = OpBuilder.load
    if getattr(load, "quiet", False):
        return

    @functools.wraps(load)
    def quiet_load(self, verbose=False):
        return load(self, verbose=verbose)

    quiet_load.quiet = True  # type: ignore[attr-defined]  # marks the patch, so it is made once
    OpBuilder.load = quiet_load


def _quiet_shm_success() -> None:
    """DeepSpeed 0.14+ prints "... deepspeed_shm_comm_op built successfully" whenever it loads
    the op, built or cached (0.13 has no such op): the same load without the print. A build
    says so itself (above)."""
    try:
        import deepspeed

        backend = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch is torch itself
    except ImportError:
        return
    original = getattr(backend, "build_shm_op", None)
    if original is None or getattr(original, "quiet", False):
        return

    def build_shm_op():
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return None
        return builder.load()

    build_shm_op.quiet = True  # type: ignore[attr-defined]  # marks the patch, so it is made once
    setattr(backend, "build_shm_op", build_shm_op)  # noqa: B010 -- a name mypy cannot see on the module
