"""A calibration file: what `python -m pipeline calibrate` measured on one node, and its reader.

The planner's time model needs rates of the machine a stage runs on: matmul TFLOP/s at the
shapes the models multiply, GPU memory and host<->GPU copy bandwidth, one process's CPU Adam
rate and the host work of a whole offloaded optimizer step, NCCL's collective bandwidth. core/hardware.py
holds datasheet numbers for them; a calibration file holds what a node really did (measured by
stages/calibrate.py).

    {"version": 1, "node": "gpu07", "date": "2026-11-26T05:50:00+00:00",
     "gpu": {"device_name": "NVIDIA H100 80GB HBM3", "catalogue": "h100-80gb", "count": 8, "memory_gib": 79.2},
     "cores_available": 128, "cores_per_process": 16, "processes_per_node": 8,
     "versions": {"torch": "2.13.0", "deepspeed": "0.19.8", "cuda": "13.0"},
     "matmul": [{"what": "mlp down fwd", "model": "codellama/CodeLlama-34b-hf", "m": 4096, "k": 22016,
                 "n": 8192, "dtype": "bf16", "tflops": 712.4}, ...],
     "memory_bandwidth_gbs": 2950.1, "host_to_gpu_gbs": 51.3, "gpu_to_host_gbs": 52.0,
     "cpu_adam": {"params_per_s": 1.1e9, "optimizer": "DeepSpeedCPUAdam", "threads": 16, "params": 67108864},
     "offload_step": {"params_per_s": 4.2e8, "model": "codellama/CodeLlama-34b-hf", "layers": 1,
                      "params": 692060160, "zero_stage": 3, "threads": 16, "step_s": 1.71, "copies_s": 0.06},
     "collective": {"all_gather_gbs": 361.0, "reduce_scatter_gbs": 355.2, "processes": 8, "bytes": 1073741824},
     "settings": {...}, "seconds": {"matmul": 21.0, ...}, "notes": ["..."]}

A field the node could not measure is null, and a note says why (no GPU: every GPU field;
one GPU: `collective`). The file goes to <runs_dir>/calibration/<catalogue GPU>.json
(core/runfolder.py), cpu.json on a machine without a GPU.

Torch-free: `plan` reads it on a login node.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from core import hardware, runfolder
from core.errors import InvalidInput

VERSION = 1
# The name of the file a machine without a GPU writes (core/runfolder.py calibration_file).
CPU_ONLY = "cpu"

Positive = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(gt=0)]
Dtype = Literal["bf16", "fp16", "fp32"]  # the names of a stage's `precision`


@dataclass(frozen=True)
class GPUInfo:
    """The GPUs the measuring process saw."""

    device_name: str  # as torch names device 0 (torch.cuda.get_device_name), e.g. "NVIDIA H100 80GB HBM3"
    catalogue: str | None  # its core/hardware.py entry (gpu_for_device); None for a GPU the catalogue lacks
    count: Count  # GPUs visible to the process (CUDA_VISIBLE_DEVICES), the collective's world
    memory_gib: Positive  # device 0's total memory as torch reports it (GiB), for telling variants apart


@dataclass(frozen=True)
class MatmulRate:
    """One timed GEMM: C[m, n] = A[m, k] @ B[k, n], 2*m*k*n FLOPs a call."""

    what: str  # which product: "<layer> fwd|dX|dW" of a model's decoder layer or LM head, or "reference 8192^3"
    model: str  # the model (as the pipeline file names it) whose shape this is; "" for the reference
    m: Count
    k: Count
    n: Count
    dtype: Dtype  # operands' dtype (fp32: without TF32, as the stages run it)
    tflops: Positive  # 2*m*k*n / seconds / 1e12, the median of the timed repeats after warm-up


@dataclass(frozen=True)
class CpuAdamRate:
    """One process stepping an optimizer over fp32 parameters on the CPU (optimizer_offload)."""

    params_per_s: Positive  # parameters stepped per second (weights, m and v updated)
    optimizer: str  # what stepped: "DeepSpeedCPUAdam" (what the stages use), or the fallback named
    threads: Count  # torch.set_num_threads: the process's share of the node's cores
    params: Count  # parameters in the measurement (its size)


@dataclass(frozen=True)
class OffloadStepRate:
    """One process's host work in DeepSpeed's own offloaded optimizer step (optimizer_offload), on a
    slice of a model the pipeline file trains: the norms, DeepSpeedCPUAdam, the fp32 and staging
    copies, all the host does per parameter. The plan's host term is this work (pipeline/plan/rates.py)."""

    params_per_s: Positive  # parameters stepped per second of host work (the upload of the new weights taken out)
    model: str  # the model the slice is of, as the pipeline file names it
    layers: Count  # its decoder layers in the slice, at the model's full width
    params: Count  # the slice's trained parameters
    zero_stage: int  # the stage's ZeRO stage (1-3) the step ran under
    threads: Count  # the process's share of the node's cores
    step_s: Positive  # the median optimizer step
    copies_s: float  # of which the new weights' host->GPU copies (0 on a CPU), taken out of the rate


@dataclass(frozen=True)
class CollectiveRate:
    """NCCL collectives between the node's GPUs, one process per GPU; bus bandwidth as nccl-tests
    defines it: the full tensor's bytes x (W-1)/W / seconds, comparable to a link's speed."""

    all_gather_gbs: Positive  # all-gather into one tensor (ZeRO-3's parameter gathers), GB/s
    reduce_scatter_gbs: Positive  # reduce-scatter out of one tensor (ZeRO-2/3's gradient reduction), GB/s
    processes: Count  # W
    bytes: Count  # the full (gathered, or reduced) tensor


@dataclass(frozen=True)
class Calibration:
    """A calibration file, read (or about to be written). GB is 1e9 bytes throughout."""

    version: int  # the schema version: VERSION
    node: str  # hostname of the node measured
    date: str  # when (ISO 8601, UTC)
    gpu: GPUInfo | None  # None: no GPU was visible
    cores_available: Count  # cores the measuring process could run on (os.sched_getaffinity)
    cores_per_process: Count  # cores_available // processes_per_node: a stage process's share
    processes_per_node: Count  # the pipeline's processes per node (cluster.tasks_per_node or gpus_per_node)
    versions: dict[str, str | None]  # torch, deepspeed, cuda (None: not installed, or a CPU build)
    matmul: tuple[MatmulRate, ...]  # empty without a GPU
    memory_bandwidth_gbs: Positive | None  # device-to-device copy: bytes read + bytes written per second
    host_to_gpu_gbs: Positive | None  # pinned host memory -> GPU copy
    gpu_to_host_gbs: Positive | None  # GPU -> pinned host memory copy
    cpu_adam: CpuAdamRate | None
    collective: CollectiveRate | None  # None with one GPU, or none
    offload_step: OffloadStepRate | None = None  # None: not measured (a note says why; files before it)
    settings: dict[str, Any] = field(default_factory=dict)  # sizes and repeats each measurement used
    seconds: dict[str, float] = field(default_factory=dict)  # wall time each measurement took
    notes: tuple[str, ...] = ()  # what was not measured and why; anything unusual seen

    @property
    def name(self) -> str:
        """What the file is named after: the GPU's catalogue name, else its device name made
        file-safe, else CPU_ONLY."""
        if self.gpu is None:
            return CPU_ONLY
        return self.gpu.catalogue or re.sub(r"[^a-z0-9.]+", "-", self.gpu.device_name.lower()).strip("-")

    def matmul_tflops(self, m: int, k: int, n: int, dtype: str, what: str | None = None) -> float | None:
        """The measured rate of the recorded GEMM nearest to m x k x n (by the sum of squared log
        ratios of the three dimensions: a GEMM twice as long in one dimension is as far as one
        half as long) in `dtype`, among the products of the same pass when `what` names one
        ("fwd", "dX", "dW": each pass has its own operand layout, and one shape can run at
        different rates in two layouts) and any were recorded; None when none was recorded in
        that dtype."""
        rates = [r for r in self.matmul if r.dtype == dtype]
        if what:
            rates = [r for r in rates if r.what.endswith(f" {what}")] or rates
        if not rates:
            return None

        def distance(rate: MatmulRate) -> float:
            return sum(math.log(a / b) ** 2 for a, b in ((rate.m, m), (rate.k, k), (rate.n, n)))

        return min(rates, key=distance).tflops

    @property
    def cpu_adam_params_per_s_per_node(self) -> float | None:
        """The node's CPU Adam rate, the quantity pipeline/plan/timing.py's CPU_ADAM_PARAMS_PER_S
        stands for: one process's rate x processes_per_node, each stepping its own shard on its
        own cores at once. An upper bound: the processes share the node's memory bandwidth."""
        return self.cpu_adam.params_per_s * self.processes_per_node if self.cpu_adam else None

    def to_json(self) -> dict:
        """The file's content, in JSON's types (lists, not tuples)."""
        return json.loads(json.dumps(asdict(self)))


_ADAPTER = TypeAdapter(Calibration)


def from_json(data: Any, path) -> Calibration:
    """A Calibration from parsed JSON; InvalidInput (exit 2) naming `path` (the file, or where
    the data came from) and what is wrong."""
    if not isinstance(data, dict) or "version" not in data or "node" not in data:
        raise InvalidInput(f"{path}: not a calibration file (a JSON object with version, node, gpu, matmul, ...; "
                           "`python -m pipeline calibrate CONFIG` writes one)")
    if data["version"] != VERSION:
        raise InvalidInput(f"{path}: calibration file version {data['version']!r}, but this code reads version "
                           f"{VERSION}: measure again with `python -m pipeline calibrate CONFIG`")
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<top>'}: {e['msg']}" for e in err.errors())
        raise InvalidInput(f"{path}: not a valid calibration file: {problems}") from None


def load(path: Path) -> Calibration:
    """Read a calibration file; InvalidInput (exit 2) naming the file for one that is missing,
    not JSON, not a calibration file, or of another schema version."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise InvalidInput(f"{path}: cannot read the calibration file: {err.strerror or err}") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise InvalidInput(f"{path}: not a calibration file: not JSON ({err})") from None
    return from_json(data, path)


def save(calibration: Calibration, path: Path) -> None:
    """Write the file atomically (a temporary beside it, renamed): a `plan` reading it meanwhile
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = runfolder.temporary(path)
    tmp.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def default_path(spec) -> Path:
    """The calibration file `plan` reads for a pipeline: <runs_dir>/calibration/<cluster.gpu's
    catalogue name>.json, or cpu.json for a pipeline that names no GPU. InvalidInput for a
    cluster.gpu the catalogue does not know."""
    if not spec.cluster.gpu:
        return runfolder.calibration_file(Path(spec.runs_dir), CPU_ONLY)
    try:
        return runfolder.calibration_file(Path(spec.runs_dir), hardware.gpu(spec.cluster.gpu).name)
    except ValueError as err:
        raise InvalidInput(f"cluster.gpu: {err}") from None
