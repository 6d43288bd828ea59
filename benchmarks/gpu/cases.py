"""The cases the benchmark knows, and the two that need neither the project nor TRL.

A case has a body, run in its own subprocess (`gpu_bench.py case NAME`), which
leaves raw outputs in its work folder, and a `collect`, run by the runner after
the subprocess ended however it ended (finished, failed, timed out), which turns
whatever is there into the case's result: a case killed after 6 of 10 steps
still reports 6 steps. `collect` is torch-free.

Groups (what `--cases` accepts besides case names):
  throughput   env, matmul, then project and TRL cases, most important first
               (a budget that runs out drops the tail)
  memory       env, then the planner-vs-measured matrix (project SFT/DPO, 3 steps of 2 micro
               batches each, rows of exactly max_len tokens)
  slice        env, matmul, then a slice of the real 34B (its width, heads and vocabulary, as many
               of its 48 layers as fit) through the project's SFT and DPO at two layer counts
               (benchmarks/gpu/slice.py)
  rl           env, then a GRPO stage on the shared model with its EOS made likely (benchmarks/gpu/rl.py)
  all          all four
A project case name may carry extra stage knobs: `project-sft+packing` adds
`packing: true` to the stage, `project-sft+zero_stage=3` sets a value; a knob the
schema does not know makes the case fail with validate's message.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # env | matmul | project | trl | slice
    params: dict = field(default_factory=dict)
    estimate_s: float = 60.0  # on the 1B shape and an H100, for the budget
    timeout_s: float = 300.0


def _project(name, estimate, **params) -> Case:
    return Case(name, "project", params, estimate, 420.0)


def _trl(name, estimate, **params) -> Case:
    return Case(name, "trl", params, estimate, 360.0)


def _memory(name, estimate, **overrides) -> Case:
    kind = overrides.pop("kind", "sft")
    base = {"kind": kind, "data": f"{kind}-full", "zero_stage": 2, "gradient_checkpointing": True,
            "micro_batch_size": 4, "memory": True}
    return Case(name, "project", {**base, **overrides}, estimate, 300.0)


THROUGHPUT = [
    Case("env", "env", {}, 10, 120),
    Case("matmul", "matmul", {}, 20, 180),
    _project("project-sft", 100, kind="sft", data="sft"),
    _trl("trl-sft-packed", 60, trainer="sft", packing=True),
    _project("project-dpo", 120, kind="dpo", data="dpo", reference="live"),
    _trl("trl-dpo", 80, trainer="dpo"),
    _trl("trl-sft", 60, trainer="sft"),
    _trl("trl-sft-padfree", 60, trainer="sft", padding_free=True),
    _trl("trl-sft-liger", 60, trainer="sft", packing=True, liger=True),
    _trl("trl-dpo-liger", 80, trainer="dpo", liger=True),
    _trl("trl-dpo-padfree", 30, trainer="dpo", padding_free=True),
]

# Most telling first, so a budget that runs out drops the least.
MEMORY = [
    Case("env", "env", {}, 10, 120),
    _memory("mem-sft-z2", 50),
    _memory("mem-sft-z3", 55, zero_stage=3),
    _memory("mem-sft-nockpt", 50, gradient_checkpointing=False),
    _memory("mem-dpo-live", 70, kind="dpo", reference="live"),
    _memory("mem-dpo-precompute", 75, kind="dpo", reference="precompute"),
    _memory("mem-sft-lora", 45, lora={"rank": 16}),
    _memory("mem-sft-mb8", 55, micro_batch_size=8),
    _memory("mem-sft-z0", 50, zero_stage=0),
    _memory("mem-sft-mb2", 50, micro_batch_size=2),
    # Settings no record had before the H100 session of 2026-11-26 (out-of-sample checks of the
    # planner's fit): ZeRO-1's optimizer step (planned at ZeRO-2's bytes per parameter) and DPO
    # with its live reference at half the micro batch.
    _memory("mem-sft-z1", 50, zero_stage=1),
    _memory("mem-dpo-live-mb2", 60, kind="dpo", reference="live", micro_batch_size=2),
]

# The 34B slice (benchmarks/gpu/slice.py): each stage at the largest layer count that fits
# ("max") and at half of it. SFT's pair first: if the budget runs out, one stage's per-layer
# figures are whole. On an H100 a case builds (or reuses) a model of ~7 layers (~5B
# parameters), loads it under ZeRO-3 and runs 4 steps with the optimizer on the host; 570 s
# stays inside a 10-minute call.
SLICE = [Case("env", "env", {}, 10, 120), Case("matmul", "matmul", {}, 20, 180)] + [
    Case(f"slice-34b-{kind}{suffix}", "slice", {"kind": kind, "layers": role}, 300, 570)
    for kind in ("sft", "dpo") for role, suffix in (("max", ""), ("half", "-half"))
]

# A GRPO step on one GPU (benchmarks/gpu/rl.py): the project's stage and TRL's GRPOTrainer (its
# transformers generation) on the same actor, whose completions end like real RL's (issue 27, item 5).
RL = [Case("env", "env", {}, 10, 120), Case("project-grpo", "rl", {"stack": "project"}, 240, 540),
      Case("trl-grpo", "rl", {"stack": "trl"}, 240, 540)]

KNOWN = {c.name: c for c in THROUGHPUT + MEMORY + SLICE + RL}
GROUPS = {
    "throughput": [c.name for c in THROUGHPUT],
    "memory": [c.name for c in MEMORY],
    "slice": [c.name for c in SLICE],
    "rl": [c.name for c in RL],
    "all": list(dict.fromkeys([c.name for c in THROUGHPUT + MEMORY + SLICE + RL])),
}


def resolve(spec: str) -> list[Case]:
    """Comma-separated case names and group names -> cases, in order, each once."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        names += GROUPS.get(part, [part])
    cases = []
    for name in dict.fromkeys(names):
        case = lookup(name)
        if case is None:
            raise SystemExit(f"unknown case '{name}'; known: {', '.join(GROUPS)}, {', '.join(KNOWN)}, "
                             "and project-sft+KNOB[=VALUE] / project-dpo+KNOB[=VALUE]")
        cases.append(case)
    return cases


def lookup(name: str) -> Case | None:
    if name in KNOWN:
        return KNOWN[name]
    base, *knobs = name.split("+")
    if base in ("project-sft", "project-dpo") and knobs:
        extra = {}
        for knob in knobs:
            key, _, value = knob.partition("=")
            extra[key] = _yaml_scalar(value) if value else True
        case = KNOWN[base]
        return Case(name, "project", {**case.params, "extra": extra}, case.estimate_s, case.timeout_s)
    return None


def _yaml_scalar(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def gradient_checkpointing(kind: str, setting) -> bool:
    """--gradient-checkpointing auto: off for SFT (a 1B model's activations fit an 80 GB GPU),
    on for DPO (twice the sequences, and a reference model beside the policy)."""
    return kind == "dpo" if setting == "auto" else bool(setting)


# --------------------------------------------------------------------------- the GPU catalogue


def catalogue_gpu(device_name: str | None) -> str | None:
    """The core/hardware.py name of a CUDA device, from its torch / nvidia-smi name."""
    from core.hardware import gpu_for_device

    entry = gpu_for_device(device_name) if device_name else None
    return entry.name if entry else None


def datasheet_tflops(gpu: str | None, precision: str) -> float | None:
    if gpu is None:
        return None
    from core import hardware

    return hardware.gpu(gpu).peak_tflops(precision)


# --------------------------------------------------------------------------- env


PACKAGES = ["torch", "transformers", "deepspeed", "trl", "liger-kernel", "flash-attn", "peft", "accelerate",
            "datasets", "tokenizers", "submitit", "pydantic", "triton"]


def nvidia_smi(query: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def run_env(work: Path, settings: dict) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    facts = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "git_commit": _git_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu_name=props.name,
            gpu_memory_gib=props.total_memory / GiB,
            gpu_count=torch.cuda.device_count(),
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_sm_count=props.multi_processor_count,
            driver=nvidia_smi("driver_version"),
        )
        facts["catalogue_gpu"] = catalogue_gpu(props.name)
    (work / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def collect_env(work: Path, settings: dict) -> dict:
    facts = read_json(work / "facts.json")
    return {"complete": facts is not None, "facts": facts or {}}


# --------------------------------------------------------------------------- matmul


def run_matmul(work: Path, settings: dict) -> None:
    """The GPU's own dense matmul rate: bf16 8192^3 torch.matmul, median of 30 timed after warm-up
    (CUDA events). On a CPU: fp32 1024^3, only so the dry run exercises the path."""
    import statistics
    import time

    import torch

    on_gpu = settings["device"] == "cuda"
    n = 8192 if on_gpu else 1024
    dtype = torch.bfloat16 if on_gpu else torch.float32
    device = "cuda" if on_gpu else "cpu"
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(10 if on_gpu else 2):
        a @ b
    rates = []
    for _ in range(30 if on_gpu else 5):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        rates.append(2 * n**3 / seconds / 1e12)
    facts = {"n": n, "dtype": str(dtype).removeprefix("torch."), "device": device,
             "tflops_median": statistics.median(rates), "tflops_max": max(rates), "samples": len(rates)}
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu_name=props.name, gpu_memory_gib=props.total_memory / GiB, driver=nvidia_smi("driver_version"),
                     catalogue_gpu=catalogue_gpu(props.name))
    (work / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")


def collect_matmul(work: Path, settings: dict) -> dict:
    facts = read_json(work / "facts.json")
    if facts is None:
        return {"complete": False}
    peak = datasheet_tflops(facts.get("catalogue_gpu"), "bf16")
    return {"complete": True, "facts": facts, "ceiling_tflops": facts["tflops_median"], "datasheet_tflops": peak,
            "ceiling_share_of_datasheet": facts["tflops_median"] / peak if peak else None}


def read_json(path: Path):
    """A JSON file's content; None when it is missing or cut short."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file (a line cut off by a kill is left out)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records
