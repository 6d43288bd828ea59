"""Run a list of cases, each in its own subprocess with a timeout, within a total budget.

Each case's result is written to OUT/<case>.json as soon as it ends, however it
ends: ok, failed, timeout (with whatever steps it logged), skipped (a reason:
TRL or Liger missing...), not-run (the budget would be exceeded). Run the same
command again and it goes on: cases already ok or skipped with the same settings
are kept, the rest run. The summary table is printed last.

OUT holds only small files (case JSONs, log tails, settings.json, workload.json,
RESULTS.md): on the lent GPU machine it can be the folder that comes back. The
model, the data and the stages' run folders go to WORK.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.gpu import cases as case_list
from benchmarks.gpu import hf_trl, project, rl, workload
from benchmarks.gpu import slice as slice_34b
from benchmarks.gpu.cases import Case, read_json

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_bench.py"
DONE = ("ok", "skipped")
PREPARE = Case("workload", "workload", {}, 60, 900)  # model, tokenizer, data; once per WORK folder
LOG_TAIL_BYTES = 64_000
KILL_GRACE_S = 20
WORKLOAD_KINDS = ("project", "trl", "rl")  # the cases that run on the shared workload (workload.py)

# What a result depends on: a case is re-run when one of these changed.
SETTINGS_KEYS = ("device", "shape", "max_len", "steps", "warmup_steps", "memory_steps", "precision", "zero_stage",
                 "gradient_checkpointing", "micro_batch_size", "global_batch_size", "learning_rate", "gpu")


def run(settings: dict, names: str, force: bool) -> list[dict]:
    out, work = Path(settings["out"]), Path(settings["work"])
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    earlier = (read_json(out / "settings.json") or {}).get("commands", [])
    settings["commands"] = list(dict.fromkeys(earlier + [settings["command"]]))  # every run into this folder
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    deadline = time.monotonic() + settings["budget_s"] if settings.get("budget_s") else None
    selected = case_list.resolve(names)
    kept = {}
    for case in selected:
        previous = read_json(out / f"{case.name}.json")
        if not force and previous and previous.get("status") in DONE and _same_settings(previous, settings):
            kept[case.name] = previous
    to_run = [c for c in selected if c.name not in kept]
    unprepared = None
    if any(c.kind in WORKLOAD_KINDS for c in to_run) and not _workload_ready(settings):
        prepared = _run_subprocess(PREPARE, ["prepare"], settings, deadline)
        if prepared["status"] != "ok" or not _workload_ready(settings):
            unprepared = f"the workload was not prepared: {prepared['reason'] or 'workload.json missing'}"
    results = []
    for case in selected:
        if case.name in kept:
            print(f"[{case.name}] {kept[case.name]['status']} earlier with the same settings: kept", flush=True)
            results.append(kept[case.name])
            continue
        if case.kind in WORKLOAD_KINDS and unprepared:
            results.append(_write(out, case, settings, {"status": "not-run", "seconds": 0.0, "reason": unprepared}))
            continue
        results.append(_run_case(case, settings, deadline))
    print_summary(results)
    return results


def _same_settings(previous: dict, settings: dict) -> bool:
    return all(previous.get("run_settings", {}).get(k) == settings.get(k) for k in SETTINGS_KEYS)


def _workload_ready(settings: dict) -> bool:
    info = workload.load(Path(settings["work"]) / "workload")
    wanted = workload.describe(settings["shape"], settings["max_len"], settings["rows"], settings["precision"])
    if info is not None and info["described"] == wanted:
        shutil.copy(Path(settings["work"]) / "workload" / "workload.json", Path(settings["out"]) / "workload.json")
        return True
    return False


def _run_case(case: Case, settings: dict, deadline) -> dict:
    outcome = _run_subprocess(case, ["case", case.name], settings, deadline)
    if outcome["status"] == "not-run":
        return _write(Path(settings["out"]), case, settings, outcome)
    work = Path(settings["work"]) / case.name
    info = read_json(Path(settings["work"]) / "workload" / "workload.json")
    try:
        measured = _collect(case, work, settings, info)
    except Exception as err:  # noqa: BLE001 -- a broken output must not lose the other cases
        measured = {"complete": False, "error": f"collecting the results failed: {type(err).__name__}: {err}"}
    status, reason = outcome["status"], outcome["reason"]
    if measured.get("skipped"):
        status, reason = "skipped", measured["skipped"]
    elif status == "ok" and not measured.get("complete"):
        status, reason = "failed", measured.get("error") or "the case ended without its results"
    elif status != "ok":
        reason = measured.get("error") or reason
    return _write(Path(settings["out"]), case, settings, {**outcome, **measured, "status": status, "reason": reason})


def _collect(case: Case, work: Path, settings: dict, info) -> dict:
    if case.kind == "env":
        return case_list.collect_env(work, settings)
    if case.kind == "matmul":
        return case_list.collect_matmul(work, settings)
    if case.kind == "project":
        return project.collect(case, work, settings, info)
    if case.kind == "slice":  # its own workload, not the shared one
        return slice_34b.collect(case, work, settings)
    if case.kind == "rl":
        return rl.collect(case, work, settings, info)
    return hf_trl.collect(case, work, settings, info)


def _run_subprocess(case: Case, command: list[str], settings: dict, deadline) -> dict:
    """Run `gpu_bench.py COMMAND` in its own process group with the case's timeout (cut to what is
    left of the budget); on a timeout the whole group gets SIGTERM, then SIGKILL."""
    remaining = deadline - time.monotonic() if deadline is not None else None
    if remaining is not None and remaining < case.estimate_s:
        reason = f"budget: {remaining:.0f} s left, the case needs about {case.estimate_s:.0f} s"
        print(f"[{case.name}] not run ({reason})", flush=True)
        return {"status": "not-run", "reason": reason, "seconds": 0.0}
    timeout = min(t for t in (case.timeout_s, settings.get("case_timeout_s"), remaining) if t is not None)
    work = Path(settings["work"]) / case.name
    if case.kind != "workload":
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    console = work / "console.log"
    print(f"[{case.name}] running (timeout {timeout:.0f} s); log: {console}", flush=True)
    sampler = GpuMemorySampler() if settings["device"] == "cuda" else None
    started = time.monotonic()
    with open(console, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), *command, "--out", settings["out"], "--work", settings["work"]],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=child_environment(settings), start_new_session=True,
        )
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        _stop_group(process)  # after a timeout, or what a finished case left behind (a stage job)
    seconds = time.monotonic() - started
    peak = sampler.stop() if sampler else None
    if timed_out:
        status, reason = "timeout", f"stopped after {seconds:.0f} s (timeout {timeout:.0f} s)"
    elif process.returncode != 0:
        status, reason = "failed", f"exit {process.returncode}: {_last_error(console)}"
    else:
        status, reason = "ok", None
    print(f"[{case.name}] {status} in {seconds:.0f} s" + (f": {reason}" if reason else ""), flush=True)
    logs = Path(settings["out"]) / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"{case.name}.log").write_bytes(_tail(console, LOG_TAIL_BYTES))
    return {"status": status, "reason": reason, "seconds": seconds, "rc": process.returncode,
            "device_mem_used_peak_gib": peak}


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to what is left of the case's process group (a stage job it started included),
    then SIGKILL: the next case needs the GPU free."""
    if not _signal_group(process, signal.SIGTERM):
        return
    try:
        process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(2)  # a stage job may outlive the case's process by a moment
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> bool:
    """Send sig to the case's process group; False when nothing of it is left."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return False
    return True


def child_environment(settings: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(Path(settings["work"]) / "hf-datasets"))
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        # DeepSpeed 0.19.8's op builder cannot parse arch-specific names such as 9.0a (GPU.md)
        env["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)a\b", r"\1", arch)
    return env


def _write(out: Path, case: Case, settings: dict, result: dict) -> dict:
    record = {
        "case": case.name,
        "kind": case.kind,
        "params": case.params,
        **result,
        "run_settings": {k: settings.get(k) for k in SETTINGS_KEYS},
        "finished_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    tmp = out / f".{case.name}.json.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(out / f"{case.name}.json")
    return record


def _tail(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - size))
        return f.read()


def _last_error(console: Path) -> str:
    """The last line of the log that names an error, with the line after it (often the detail)."""
    lines = [line.strip() for line in _tail(console, 20_000).decode(errors="replace").splitlines() if line.strip()]
    found = [i for i, line in enumerate(lines) if re.search(r"(Error|error:|Exception|Killed|out of memory)", line)]
    if not found:
        return (lines or ["no output"])[-1][:300]
    return " / ".join(lines[found[-1]:found[-1] + 2])[:400]


class GpuMemorySampler:
    """The largest `nvidia-smi` memory.used (MiB -> GiB) seen while a case runs, every 0.5 s: the
    same outside measure for both stacks (it includes the CUDA context, ~0.5 GiB)."""

    def __init__(self):
        self.peak_mib = None
        self.process = None
        if shutil.which("nvidia-smi") is None:
            return
        self.process = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "500"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                value = float(line.strip())
            except ValueError:
                continue
            self.peak_mib = value if self.peak_mib is None else max(self.peak_mib, value)

    def stop(self):
        if self.process is None:
            return None
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.thread.join(timeout=5)
        return self.peak_mib / 1024 if self.peak_mib is not None else None


# --------------------------------------------------------------------------- summary


def print_summary(results: list[dict]) -> None:
    def number(value, fmt):
        width = int(fmt.split(".")[0])
        return "-".rjust(width) if value is None else format(value, fmt)

    header = f"{'case':<22} {'status':<8} {'s':>5} {'tok/s':>9} {'pad%':>5} {'step s':>7} {'MFU%':>5} " \
             f"{'alloc':>6} {'resv':>6} {'smi':>6} {'plan':>6}  note"
    print("\n" + header)
    print("-" * len(header))
    for r in results:
        padding = r.get("padding_share")
        mfu = r.get("mfu")
        note = r.get("reason") or ""
        if r.get("kind") == "matmul" and r.get("ceiling_tflops"):
            note = f"matmul ceiling {r['ceiling_tflops']:.3g} TFLOP/s"
        print(f"{r['case']:<22} {r['status']:<8} {number(r.get('seconds'), '5.0f')} "
              f"{number(r.get('tokens_per_s'), '9.0f')} {number(None if padding is None else 100 * padding, '5.1f')} "
              f"{number(r.get('step_s'), '7.3f')} {number(None if mfu is None else 100 * mfu, '5.1f')} "
              f"{number(r.get('gpu_mem_peak_gib'), '6.1f')} {number(r.get('gpu_mem_reserved_gib'), '6.1f')} "
              f"{number(r.get('device_mem_used_peak_gib'), '6.1f')} {number(r.get('planner_peak_gib'), '6.1f')}  "
              f"{note[:90]}")
