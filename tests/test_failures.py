"""A failed stage leaves one message a person can act on: the cause, the place, what to do.

Real failures throughout: writes to /dev/full and to a file system that really is
full (a small tmpfs in a private mount namespace), a read-only remount, real
MemoryErrors, the kernel's out-of-memory killer in a memory cgroup, and a
training process killed by SIGKILL in a two-process stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import failure
from core.errors import InvalidInput
from core.runfolder import StageFolder
from tests.conftest import REPO, run_cli, tiny_pipeline, tiny_rl_stage, write_pipeline


def described(action):
    """describe() of what `action` really raises."""
    try:
        action()
    except Exception as err:  # noqa: BLE001
        return failure.describe(err)
    raise AssertionError("no error raised")


def write_to_dev_full():
    with open("/dev/full", "w") as f:
        f.write("x" * 100)
        f.flush()


# --------------------------------------------------------------------------- causes


def test_a_full_disk_during_a_save_names_the_path_and_removes_the_partial_file(tmp_path):
    target = tmp_path / "checkpoints" / "step-00000002"
    target.mkdir(parents=True)
    (target / "half-written.pt").write_bytes(b"\0" * 100)

    def save():
        with failure.saving(target, "checkpoint step-00000002"):
            write_to_dev_full()  # ENOSPC from the kernel

    kind, message, secondary = described(save)
    assert (kind, secondary) == (failure.DISK_FULL, False)
    assert f"cannot write {target} (checkpoint step-00000002): No space left on device" in message
    assert "Free space there, or set runs_dir" in message
    assert not target.exists()


def test_a_save_past_the_file_size_limit_names_the_path_the_limit_and_the_checkpoint_kept(tmp_path):
    """torch.save under `ulimit -f` says only "unexpected pos"; the message says why."""
    import resource

    torch = pytest.importorskip("torch")
    folder = StageFolder(tmp_path / "sft")
    kept, target = folder.checkpoints / "step-00000001", folder.checkpoints / "step-00000002"
    kept.mkdir(parents=True)
    torch.save(torch.zeros(1 << 17), kept / "model.pt")  # 512 KiB
    folder.latest_marker.write_text(kept.name)
    target.mkdir()

    def save():
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, hard))  # Python ignores SIGXFSZ: the write raises
        try:
            with failure.saving(target, "checkpoint step-00000002", like=kept):
                torch.save(torch.zeros(1 << 17), target / "model.pt")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    kind, message, _ = described(save)
    assert kind == failure.FILE_TOO_LARGE
    assert message.startswith(f"cannot write {target} (checkpoint step-00000002): File too large: this process "
                              "may write files of at most 128.0 KiB (`ulimit -f`, RLIMIT_FSIZE)")
    assert re.search(rf"the previous one \({re.escape(str(kept))}\) has a file of 51\d\.\d KiB\. ", message)
    assert "ulimit -f unlimited" in message
    assert message.endswith(f"nothing earlier was lost, and the stage resumes from its newest complete checkpoint, "
                            f"step-00000001 ({kept})")
    assert not target.exists() and folder.latest_named() == "step-00000001"


def test_an_append_the_disk_refuses_names_the_file():
    def log_a_line():
        with failure.writing(Path("/dev/full"), "metrics.jsonl"), open("/dev/full", "a") as f:
            f.write("{}\n")

    kind, message, _ = described(log_a_line)
    assert kind == failure.DISK_FULL
    assert message.startswith("cannot write /dev/full (metrics.jsonl): No space left on device")


def test_a_folder_that_may_not_be_written_is_named():
    # Root may write almost anywhere; sysfs refuses new files even to root.
    kind, message, _ = described(lambda: open("/sys/kernel/no-such-file", "w"))
    assert kind == failure.PERMISSION_DENIED
    assert message.startswith(f"/sys/kernel/no-such-file: Permission denied to this user (uid {os.geteuid()}). "
                              "Make it writable")


def test_host_out_of_memory_names_the_place_and_points_at_the_plan():
    def tokenize():
        return bytearray(1 << 50)  # 1 PiB: the allocation fails at once

    kind, message, _ = described(tokenize)
    assert kind == failure.HOST_OUT_OF_MEMORY
    assert "test_failures.py:" in message and "in tokenize" in message
    assert "python -m pipeline plan" in message and "cluster.mem" in message


def test_torchs_allocators_running_out_of_host_or_gpu_memory_say_which():
    torch = pytest.importorskip("torch")
    kind, message, _ = described(lambda: torch.empty(1 << 50, dtype=torch.uint8))
    assert kind == failure.HOST_OUT_OF_MEMORY
    assert "can't allocate memory" in message

    def on_gpu():  # what torch raises when a CUDA allocation fails (no GPU here to fill)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 79.10 GiB of which 1.06 GiB is free.")

    kind, message, _ = described(on_gpu)
    assert kind == failure.GPU_OUT_OF_MEMORY
    assert message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "gradient_checkpointing" in message and "python -m pipeline plan" in message


def test_a_lost_connection_is_a_consequence_and_the_rank_that_died_is_the_cause():
    lost = failure.Failure(rank=0, host="n1", kind=failure.LOST_PEER, time=10.0, secondary=True,
                           message="lost its connection to another process (Connection reset by peer)")
    died = failure.died(1, -signal.SIGKILL, oom_killed=False, log="logs/7_1_log.err")
    died.host, died.time = "n2", 11.0  # recorded after the survivor's error, still the cause
    assert failure.explaining([lost, died]) is died
    text = failure.explain("rl", [lost, died])
    assert text.startswith("stage rl failed: process died on rank 1 (host n2): "
                           "the process was killed by SIGKILL (signal 9)")
    assert "rank 0 then stopped: it lost its connection to it" in text
    assert "Connection reset" not in text
    assert text.endswith("log: logs/7_1_log.err")


def test_bad_input_found_inside_a_stage_is_reported_as_bad_input_exit_2(tmp_path, monkeypatch):
    from submitit import LocalJob

    from core import config
    from pipeline import graph
    from schedulers.local import submit as local

    spec = config.PipelineSpec.model_validate({**tiny_pipeline(), "runs_dir": str(tmp_path / "runs")})
    task = graph.build_tasks(spec)[0]
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "4242")
    for rank in (0, 1):
        failure.reserve(task.folder, rank)
        try:
            raise InvalidInput("data/rows.jsonl: every row loses its response to max_len 48")
        except InvalidInput as err:
            failure.record_exception(task.folder, rank, err, log=None)
    error = local.stage_failure(task, LocalJob(folder=task.folder.logs, job_id="4242", tasks=[0, 1]))
    assert isinstance(error, InvalidInput) and error.exit_code == 2
    assert error.message == "stage sft: data/rows.jsonl: every row loses its response to max_len 48"


def test_srun_lines_name_the_tasks_that_died_on_slurm():
    from schedulers.slurm.jobs import srun_deaths

    # srun's own words (src/srun: "%s: %s %s: %s%s" with strsignal, or "Exited with exit code %d").
    log = ("Traceback (most recent call last):\n"
           "srun: error: gpu07: task 3: Killed\n"
           "srun: error: gpu02: tasks 0-1: Exited with exit code 1\n"
           "srun: error: gpu09: task 5: Out Of Memory\n"
           "srun: error: gpu04: task 2: Segmentation fault (core dumped)\n")
    died = {d.rank: d for d in srun_deaths(log)}
    assert sorted(died) == [0, 1, 2, 3, 5]
    assert died[3].host == "gpu07" and "killed: Killed (SIGKILL)" in died[3].message
    assert died[0].message == died[1].message == "the process exited with code 1"
    assert died[5].kind == failure.HOST_OUT_OF_MEMORY and "cluster.mem" in died[5].message
    assert "Segmentation fault (SIGSEGV)" in died[2].message


def test_a_record_written_over_its_reservation_reads_back_and_a_blank_one_is_no_failure(tmp_path):
    folder = StageFolder(tmp_path / "sft")
    failure.reserve(folder, 3)
    assert failure.read(folder) == []
    long = failure.Failure(rank=3, host="h", kind=failure.ERROR, message="x" * 10_000)
    failure.write(folder, long)
    (back,) = failure.read(folder)
    assert back.rank == 3 and back.message.endswith("...")
    assert folder.failure_record(3).stat().st_size == failure.RESERVED_BYTES  # needed no new space


# --------------------------------------------------------------------------- real processes


def _memory_cgroup(tmp_name: str):
    """A fresh memory cgroup (v2 or v1) this test may create, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            root, limit, no_swap = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", ("memory.swap.max", "0")
        elif "memory" in controllers.split(","):
            root, limit = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
            no_swap = ("memory.swappiness", "0")
        else:
            continue
        try:
            group = root / tmp_name
            group.mkdir()
            (group / limit).write_text(str(64 << 20))
        except OSError:
            return None
        with contextlib.suppress(OSError):  # with swap, the hog would page out instead of being killed
            (group / no_swap[0]).write_text(no_swap[1])
        return group
    return None


def test_a_task_the_out_of_memory_killer_ends_is_recorded_as_host_out_of_memory(tmp_path):
    group = _memory_cgroup(f"post-train-test-{os.getpid()}")
    if group is None:
        pytest.skip("no memory cgroup this user may create here")
    folder = StageFolder(tmp_path / "sft")
    hog = "x = bytearray(512 << 20)"  # touches 512 MiB in a 64 MiB cgroup
    env = {**os.environ, "PYTHONPATH": str(REPO), "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_JOB_ID": "77"}
    try:
        done = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
             sys.executable, "-m", "stages.supervise", str(folder.path), sys.executable, "-c", hog],
            env=env, capture_output=True, text=True, timeout=60)
    finally:
        time.sleep(0.2)
        with contextlib.suppress(OSError):
            group.rmdir()
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    (record,) = failure.read(folder)
    assert (record.rank, record.kind, record.job_id) == (1, failure.HOST_OUT_OF_MEMORY, "77")
    assert "out-of-memory killer ended it" in record.message
    assert record.log == str(folder.logs / "77_1_log.err")


DISK_SCRIPT = r"""
import json, os, subprocess, sys
from pathlib import Path
from core import failure, tiny
from core.checkpoints import newest_intact
from core.runfolder import StageFolder
from stages import compat, distributed, engine, export, models
from tests.test_engine import stage
from tests.test_failures import fill

work = Path(sys.argv[1])
folder = StageFolder(work / "sft")
folder.path.mkdir(parents=True)
distributed.detect()  # a world of one, on a free port
import deepspeed
from transformers import AutoModelForCausalLM
deepspeed.init_distributed(dist_backend="gloo")
model_dir = tiny.materialize("tiny-llama", work / "builtin")
tokenizer = models.load_tokenizer(str(model_dir))
spec = stage(zero_stage=2, precision="fp32")
model = AutoModelForCausalLM.from_pretrained(model_dir)
ds = engine.initialize(model, spec, engine.deepspeed_config(spec, 1, 64, on_gpu=False), total_steps=10)
checkpoints = engine.Checkpoints(folder, keep=2, is_main=True)
checkpoints.save(ds, 1, {"step": 1})
export.export(ds, tokenizer, spec, folder.model, is_main=True)
exported = sorted(p.name for p in folder.model.iterdir())
failure.reserve(folder, 0)

def outcome(action):
    try:
        action()
        return None
    except Exception as err:
        kind, message, _ = failure.describe(err)
        return {"kind": kind, "message": message}

seen = {}
for name, action in (("checkpoint", lambda: checkpoints.save(ds, 2, {"step": 2})),
                     ("export", lambda: export.export(ds, tokenizer, spec, folder.model, is_main=True))):
    fill(work)  # again: each failed save frees what it had written
    seen[name] = outcome(action)
try:
    raise MemoryError()
except MemoryError as err:
    failure.record_exception(folder, 0, err, log="the log")  # over its reservation, on the full disk
seen["record"] = [f.kind for f in failure.read(folder)]
seen["tags"] = folder.checkpoint_tags()
seen["latest"] = newest_intact(folder).tag
seen["leftovers"] = [str(p) for p in folder.temporaries()]
seen["exported"] = sorted(p.name for p in folder.model.iterdir()) == exported
seen["resumed"] = checkpoints.load(ds)["step"]
os.remove(work / "ballast")
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # `ulimit -f 64`
seen["too_large"] = outcome(lambda: checkpoints.save(ds, 3, {"step": 3}))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
seen["tags_after_limit"] = folder.checkpoint_tags()
subprocess.run(["mount", "-o", "remount,ro", str(work)], check=True)
seen["read_only"] = outcome(lambda: checkpoints.save(ds, 3, {"step": 3}))
print("RESULT", json.dumps(seen))
compat.remove_cpu_comm_buffer()  # its /dev/shm buffer (70 MB), which DeepSpeed leaves behind
"""


@pytest.mark.slow
def test_a_full_disk_a_file_size_limit_or_a_read_only_disk_fails_saves_cleanly_and_keeps_the_previous_checkpoint(
        tmp_path):
    # A real small file system (tmpfs) in a private mount namespace: it really fills up.
    work = tmp_path / "disk"
    work.mkdir()
    mount = f"mount -t tmpfs -o size=48m tmpfs {work}"
    if subprocess.run(["unshare", "-rm", "sh", "-c", f"{mount} && umount {work}"], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh",
                           sys.executable, "-c", DISK_SCRIPT, str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(lines[-1][len("RESULT "):])
    step2 = work / "sft" / "checkpoints" / "step-00000002"

    assert seen["checkpoint"]["kind"] == failure.DISK_FULL
    assert f"cannot write {step2} (checkpoint step-00000002): No space left on device" in seen["checkpoint"]["message"]
    assert seen["export"]["kind"] == failure.DISK_FULL
    assert f"cannot write {work / 'sft' / 'model.tmp'} (the exported model)" in seen["export"]["message"]
    assert seen["record"] == [failure.HOST_OUT_OF_MEMORY]
    # Nothing half-written stays; the previous checkpoint and model are whole and load.
    assert seen["tags"] == ["step-00000001"] and seen["latest"] == "step-00000001"
    assert seen["leftovers"] == []
    assert seen["exported"] is True
    assert seen["resumed"] == 1
    assert seen["read_only"]["kind"] == failure.PERMISSION_DENIED
    assert "Read-only file system: the file system holding it is mounted read-only" in seen["read_only"]["message"]
    kept = f"the stage resumes from its newest complete checkpoint, step-00000001 ({step2.parent / 'step-00000001'})"
    assert "it needs about" in seen["checkpoint"]["message"] and kept in seen["checkpoint"]["message"]
    # DeepSpeed's own save under `ulimit -f`: torch.save says only "unexpected pos"; named all the same.
    step3 = work / "sft" / "checkpoints" / "step-00000003"
    assert seen["too_large"]["kind"] == failure.FILE_TOO_LARGE
    assert seen["too_large"]["message"].startswith(
        f"cannot write {step3} (checkpoint step-00000003): File too large: this process may write files of at "
        "most 64.0 KiB (`ulimit -f`, RLIMIT_FSIZE)")
    assert kept in seen["too_large"]["message"] and seen["tags_after_limit"] == ["step-00000001"]


def fill(folder: Path) -> None:
    """Write until the file system holding `folder` has no room left."""
    with open(folder / "ballast", "ab") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def fail_on_a_full_disk(work: str) -> None:
    """A stage job's last moments: it failed (its exit is set up as run_stage does) and the
    disk is full, so submitit cannot write the job's error either."""
    from stages import runner

    runner._exit_hard_at_interpreter_exit(1)
    fill(Path(work))
    raise RuntimeError("the stage failed")


SUBMIT_SCRIPT = r"""
import sys, time, submitit
from pathlib import Path
from tests.test_failures import fail_on_a_full_disk
work = Path(sys.argv[1])
job = submitit.LocalExecutor(folder=work / "logs").submit(fail_on_a_full_disk, str(work))
while not job.done():
    time.sleep(0.1)
print("LOGS", " ".join(sorted(p.name for p in (work / "logs").iterdir())))
"""


def test_a_job_that_fails_on_a_full_disk_leaves_no_half_written_submitit_file(tmp_path):
    work = tmp_path / "disk"
    work.mkdir()
    mount = f"mount -t tmpfs -o size=1m tmpfs {work}"
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh",
                           sys.executable, "-c", SUBMIT_SCRIPT, str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    if "mount" in done.stderr and "LOGS" not in done.stdout:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {done.stderr.strip()}")
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("LOGS ")]
    names = line.split()[1:]
    assert any(name.endswith("_log.err") for name in names), names
    assert not [name for name in names if name.endswith(".save_tmp")], names  # submitit's temporary name


REWARD_THAT_KILLS_RANK_1 = """
import os, signal

calls = 0

def score(prompts, completions, labels):
    global calls
    calls += 1
    if os.environ["RANK"] == "1" and calls == 2:  # in the first rollout, after the held-out scoring
        os.kill(os.getppid(), signal.SIGKILL)  # the stage process: the function runs in a child of it
    return [0.0] * len(completions)
"""


@pytest.mark.slow
@pytest.mark.stack_free
def test_a_training_process_killed_by_a_signal_is_named_not_the_ranks_that_lost_it(workdir):
    (workdir / "reward.py").write_text(REWARD_THAT_KILLS_RANK_1)
    spec = tiny_pipeline(stages=[tiny_rl_stage({"rules": [{"function": "reward.py:score"}]})])
    path = write_pipeline(workdir, spec)
    result = run_cli("run", path, cwd=workdir)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    host = socket.gethostname()
    assert f"error: stage rl failed: process died on rank 1 (host {host}): the process was killed by SIGKILL " \
           "(signal 9)" in result.stderr, result.stderr
    assert "rank 0 then stopped: it lost its connection to it" in result.stderr
    logs = workdir / "runs" / "t" / "rl" / "logs"
    (log,) = logs.glob("*_1_log.err")
    assert f"log: {log}" in result.stderr
    assert "Traceback" not in result.stderr and "Connection reset" not in result.stderr

    status = run_cli("status", path, cwd=workdir)
    assert status.returncode == 1
    assert "process died on rank 1" in status.stdout and f"log: {log}" in status.stdout, status.stdout
