"""DeepSpeed's JIT-built ops (stages/deepspeed_ops.py): where they are kept, a line whenever one
is compiled, whatever made ninja compile it, and nothing when it comes from the folder."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from stages import deepspeed_ops

REPO = Path(__file__).resolve().parent.parent
# The repository importable in a child, beside what is on PYTHONPATH already (the pinned shims).
PYTHONPATH = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
# The smallest extension DeepSpeed's op builder can build: a Python module with nothing in it
# (a second or two of compiling, where DeepSpeed's own ops take a minute).
PROBE_SOURCE = """#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "quiet_probe", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_quiet_probe(void) { return PyModule_Create(&module); }
"""
PROBE_LOAD = """
import sys
from stages import deepspeed_ops

deepspeed_ops.prepare()
from deepspeed.ops.op_builder.builder import OpBuilder


class ProbeBuilder(OpBuilder):
    BUILD_VAR = "DS_BUILD_QUIET_PROBE"
    NAME = "quiet_probe"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return self.NAME

    def sources(self):
        return [sys.argv[1]]


ProbeBuilder().load()
"""


def _said(stdout: str) -> list[str]:
    """A process's lines but DeepSpeed's own on which accelerator it found."""
    return [line for line in stdout.splitlines() if "real_accelerator.py" not in line]


def _ninja_version(ninja: str) -> str:
    return subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()


def _other_ninja() -> str | None:
    """A ninja of another version than this environment's (which the stages build with)."""
    scripts = sysconfig.get_path("scripts")
    own = shutil.which("ninja", path=scripts)
    elsewhere = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != scripts)
    other = shutil.which("ninja", path=elsewhere)
    if own and other and _ninja_version(own) != _ninja_version(other):
        return other
    return None


@pytest.mark.slow
def test_an_op_another_ninja_built_is_announced_when_it_is_compiled_again(tmp_path):
    other = _other_ninja()
    if other is None:
        pytest.skip("needs a second ninja of another version on PATH (e.g. Debian's ninja-build beside the venv's)")
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    script = tmp_path / "load_probe.py"
    script.write_text(PROBE_LOAD)
    folder = tmp_path / "extensions"
    env = {**os.environ, deepspeed_ops.ENV: str(folder), "PYTHONPATH": PYTHONPATH}

    def load() -> str:
        done = subprocess.run([sys.executable, str(script), str(source)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return "\n".join(_said(done.stdout))

    first = load()
    assert (f"building the C++ extension quiet_probe with the C++ compiler: not built yet; a minute or more; "
            f"kept in {folder} for later stages and runs") in first
    assert "built quiet_probe in " in first
    assert load() == ""  # from the folder: not a word
    # Another ninja builds it (a run before this one, or from a shell where another ninja comes
    # first on PATH) and leaves its own build log, which this environment's ninja cannot use.
    build = folder / "quiet_probe"
    for own_log in (".ninja_log", ".ninja_deps"):
        (build / own_log).unlink()
    subprocess.run([other], cwd=build, check=True, capture_output=True, timeout=600)
    (announced,) = [line for line in load().splitlines() if line.startswith("building ")]
    assert announced.startswith("building the C++ extension quiet_probe with the C++ compiler: ")
    assert "another ninja version" in announced
    assert load() == ""


@pytest.mark.slow
def test_loading_the_cpu_communication_op_from_the_folder_prints_nothing(tmp_path):
    """DeepSpeed's compatibility probes echo their gcc commands through the root logger at INFO
    (a stage's rank 0 logs at INFO), and it prints "... built successfully" at every load."""
    if "deepspeed_shm_comm" not in deepspeed_ops.jit_built_ops():
        pytest.skip("the CPU communication op is not built here yet (`make test` builds it first)")
    script = tmp_path / "init.py"
    script.write_text(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from stages import deepspeed_ops\n"
        "deepspeed_ops.prepare()\n"
        "import deepspeed\n"
        "deepspeed.init_distributed(dist_backend='gloo')\n"
        "print('initialised')\n")
    from stages.distributed import free_port

    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _said(done.stdout) == ["initialised"]


def test_a_process_waiting_on_anothers_build_says_so_and_a_moment_s_wait_does_not(tmp_path, monkeypatch, capsys):
    from torch.utils.file_baton import FileBaton

    monkeypatch.setattr(deepspeed_ops, "QUIET_WAIT_S", 0.3)
    baton_class = deepspeed_ops._saying_baton(FileBaton)
    (tmp_path / "cpu_adam").mkdir()
    lock = tmp_path / "cpu_adam" / "lock"

    def hold(seconds: float) -> None:
        lock.write_text("")
        threading.Timer(seconds, lock.unlink).start()
        baton_class(str(lock), wait_seconds=0.02).wait()

    hold(0.05)  # another process found the op built
    assert capsys.readouterr().out == ""
    hold(1.0)
    assert capsys.readouterr().out == (
        f"waiting while another process builds DeepSpeed's CPU Adam, optimizer_offload's optimizer (cpu_adam) "
        f"in {tmp_path / 'cpu_adam'} ({deepspeed_ops.duration('cpu_adam')})\n")


def test_each_virtual_environment_keeps_its_own_ops_and_a_read_only_one_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(deepspeed_ops.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    (tmp_path / "venv").mkdir()
    assert deepspeed_ops.extensions_dir() == tmp_path / "venv" / "torch_extensions"
    monkeypatch.setattr(sys, "prefix", "/proc/read-only-venv")  # as an image's venv: nothing can be made there
    in_cache = deepspeed_ops.extensions_dir()
    assert in_cache.parent == tmp_path / "cache" / "torch_extensions"
    monkeypatch.setattr(sys, "prefix", "/proc/another-read-only-venv")
    assert deepspeed_ops.extensions_dir().parent == in_cache.parent
    assert deepspeed_ops.extensions_dir() != in_cache  # environments never share one
    monkeypatch.setenv(deepspeed_ops.ENV, str(tmp_path / "mine"))
    assert deepspeed_ops.extensions_dir() == tmp_path / "mine"


def test_only_extensions_whose_library_was_built_count_as_jit_built(monkeypatch, tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    (tmp_path / "fused_adam").mkdir()  # a build that stopped before linking
    (tmp_path / "fused_adam" / "build.ninja").write_text("")
    monkeypatch.setenv(deepspeed_ops.ENV, str(tmp_path))
    assert deepspeed_ops.jit_built_ops() == ["cpu_adam"]


def test_the_compatibility_probes_compiler_echo_is_dropped_but_not_their_warnings():
    echo = deepspeed_ops._DistutilsEcho()

    def record(level, path):
        return logging.LogRecord("root", level, path, 1, "gcc ... test.c -laio", None, None)

    assert not echo.filter(record(logging.INFO, "/venv/lib/site-packages/setuptools/_distutils/spawn.py"))
    assert echo.filter(record(logging.WARNING, "/venv/lib/site-packages/setuptools/_distutils/spawn.py"))
    assert echo.filter(record(logging.INFO, "/work/stages/runner.py"))
