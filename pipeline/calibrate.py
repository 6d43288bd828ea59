"""`python -m pipeline calibrate CONFIG`: measure what the planner's time model needs from a
node, at the pipeline file's own shapes, and write it to a calibration file.

Here, torch-free: what to measure (Request: the GEMMs of each model the file trains, at a micro
batch's tokens, in the stages' precision), where (its executor's: this machine, or one Slurm job
with the file's cluster section), and the file (core/calibration.py). On the node, stages/calibrate.py
measures.

Without a GPU here, a local calibration measures what a CPU can (the CPU Adam rate, the offloaded
optimizer step) and writes cpu.json with every GPU field null; --require-gpu refuses instead (exit 2).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from core import calibration, hardware, kinds, runfolder
from core.calibration import Calibration
from core.config import PipelineSpec
from core.errors import InvalidInput
from core.shapes import builtin_config, from_config_json, resolve_shape, to_config_json
from pipeline.hfcache import hf_cache
from pipeline.plan.estimate import stage_models
from pipeline.plan.inputs import Knobs
from pipeline.plan.planner import _stage_model_name
from pipeline.preflight import model_folder

# The square product every calibration times beside the file's shapes: the matmul ceiling
# people quote, comparable between nodes and pipelines.
REFERENCE_SIZE = 8192


@dataclass(frozen=True)
class Gemm:
    """One product to time: C[m, n] = A[m, k] @ B[k, n] in `dtype`, laid out as training lays it
    out: fwd A @ B^T (nn.Linear, B the weight [n, k]), dX A @ B, dW A^T @ B."""

    what: str  # e.g. "mlp down dW", or "reference 8192^3"
    model: str  # the model as the pipeline file names it; "" for the reference
    m: int
    k: int
    n: int
    dtype: str  # bf16, fp16 or fp32: a stage's precision
    layout: str  # "nt" (fwd), "nn" (dX, reference) or "tn" (dW): which operand is transposed


@dataclass(frozen=True)
class Sizes:
    """How much each measurement moves and repeats: FULL, or QUICK with --quick."""

    matmul_repeats: int  # timed samples per GEMM (median kept), after a warm-up call
    matmul_budget_s: float  # no GEMM starts after this many seconds (the others are noted as not measured)
    copy_bytes: int  # GPU memory and host<->GPU copies
    copy_repeats: int
    cpu_adam_params: int  # fp32 parameters CPU Adam steps (4 bytes each, plus grads, m and v)
    cpu_adam_steps: int  # timed steps (median kept), after a warm-up step
    cpu_adam_budget_s: float  # fewer steps if they would take longer (the first JIT build is not counted)
    offload_params: int  # about this many parameters in the offloaded step's slice (whole layers, at least one)
    offload_steps: int  # timed offloaded steps (median kept), after a warm-up step
    collective_bytes: int  # the full tensor each collective gathers or reduces
    collective_repeats: int
    collective_timeout_s: float  # the spawned processes are stopped after this (NCCL start-up included)


FULL = Sizes(matmul_repeats=10, matmul_budget_s=240, copy_bytes=2**30, copy_repeats=10,
             cpu_adam_params=2**26, cpu_adam_steps=10, cpu_adam_budget_s=60, offload_params=2**27, offload_steps=5,
             collective_bytes=2**30, collective_repeats=10, collective_timeout_s=180)
QUICK = Sizes(matmul_repeats=3, matmul_budget_s=60, copy_bytes=2**28, copy_repeats=3,
              cpu_adam_params=2**22, cpu_adam_steps=5, cpu_adam_budget_s=15, offload_params=2**22, offload_steps=3,
              collective_bytes=2**26, collective_repeats=3, collective_timeout_s=120)


@dataclass(frozen=True)
class OffloadSlice:
    """The model whose offloaded optimizer step is timed: the first layers of a model the file
    trains, at its full width, as many as make about Sizes.offload_params parameters (one at least),
    with a small vocabulary (the host's work per parameter is the same in every tensor)."""

    model: str  # as the pipeline file names it
    config: dict  # the slice's config.json
    layers: int
    params: int  # trained parameters (core/shapes.py's count of the slice)
    precision: str
    zero_stage: int  # the stage's (1-3; ZeRO-2 for a stage without ZeRO, which cannot offload)


@dataclass(frozen=True)
class Request:
    """What the node is asked to measure (pickled into the Slurm job)."""

    gemms: tuple[Gemm, ...]
    processes_per_node: int  # the pipeline's: a stage process's share of the cores is cores // this
    sizes: Sizes
    require_gpu: bool  # refuse (InvalidInput) rather than measure only the CPU when no GPU is visible
    offload: OffloadSlice | None = None  # None: the offloaded step is not measured (request says why)


def gemms(spec: PipelineSpec) -> list[Gemm]:
    """The products of one decoder layer (and the LM head) of each model the file's stages train,
    forward and both backward products, at the tokens of one process's fullest micro batch (the
    planner's Workload.train_tokens: the packing budget, or micro_batch_size rows of max_len), in
    the stage's precision; then the reference square in each precision. Each distinct shape once."""
    cache = hf_cache(spec)
    found: dict[tuple, Gemm] = {}
    for index, stage in enumerate(spec.stages):
        model = _stage_model_name(spec, stage)
        try:
            shape = resolve_shape(model, cache.hub)
        except ValueError as err:
            field_name = "model" if stage.model else "from"
            raise InvalidInput(f"stages[{index}] ({stage.name}).{field_name}: {err}") from None
        knobs = Knobs.from_stage(stage)
        tokens = stage_models(knobs, shape)[1].train_tokens(knobs)
        # Each linear layer apart, as transformers' models run them (q, k, v, gate and up are
        # separate nn.Linear modules) and as `plan` looks them up (pipeline/plan/rates.py).
        linears = [(name.removesuffix("_proj"), k, n) for name, (k, n) in shape.linear_dims().items()]
        if kinds.get(stage.kind).trained_head == "lm":  # a reward model's head is Linear(hidden, 1): nothing to time
            linears.append(("lm head", shape.hidden, shape.vocab))
        for name, k, n in linears:
            for gemm in (Gemm(f"{name} fwd", model, tokens, k, n, knobs.precision, "nt"),
                         Gemm(f"{name} dX", model, tokens, n, k, knobs.precision, "nn"),
                         Gemm(f"{name} dW", model, n, tokens, k, knobs.precision, "tn")):
                found.setdefault((gemm.m, gemm.k, gemm.n, gemm.dtype, gemm.layout), gemm)
    for dtype in sorted({g.dtype for g in found.values()}):
        found.setdefault((REFERENCE_SIZE,) * 3 + (dtype, "nn"),
                         Gemm(f"reference {REFERENCE_SIZE}^3", "", REFERENCE_SIZE, REFERENCE_SIZE, REFERENCE_SIZE,
                              dtype, "nn"))
    return list(found.values())


SLICE_VOCAB = 256


def offload_slice(spec: PipelineSpec, sizes: Sizes) -> OffloadSlice | None:
    """The slice of the model of the file's first stage that offloads its optimizer (else its first
    stage) whose offloaded step calibrate times; None where the model's config.json is not here."""
    cache = hf_cache(spec)
    stage = next((s for s in spec.stages if s.optimizer_offload), spec.stages[0])
    model = _stage_model_name(spec, stage)
    config = _config_json(model, cache)
    if config is None:
        return None
    shape = resolve_shape(model, cache.hub)
    layers = max(1, min(shape.layers, sizes.offload_params // max(1, shape.layer_params)))
    config = {**{k: v for k, v in config.items() if k not in ("quantization_config", "_name_or_path")},
              "num_hidden_layers": layers, "vocab_size": SLICE_VOCAB, "tie_word_embeddings": False}
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists: the slice's layers only
        if isinstance(config.get(key), list):
            config[key] = [x for x in config[key] if key == "layer_types" or x < layers][:layers]
    params = from_config_json(config).n_params
    return OffloadSlice(model, config, layers, params, stage.precision, stage.zero_stage or 2)


def _config_json(model: str, cache) -> dict | None:
    """A model's config.json: its folder's (local or in the hub cache), the built-in table's."""
    folder = model_folder(model, cache)
    if folder is not None and (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    try:
        return builtin_config(model) or to_config_json(resolve_shape(model, cache.hub))
    except ValueError:
        return None


def request(spec: PipelineSpec, quick: bool, require_gpu: bool) -> Request:
    sizes = QUICK if quick else FULL
    return Request(tuple(gemms(spec)), spec.cluster.processes_per_node, sizes, require_gpu,
                   offload_slice(spec, sizes))


# --------------------------------------------------------------------------- where it runs


def calibrate(spec: PipelineSpec, executor, quick: bool = False, require_gpu: bool = False,
              out: Path | None = None, echo=print) -> tuple[Calibration, Path]:
    """Measure where `executor` (pipeline/executors/) runs the stages: this machine, or one job
    of the cluster; write the file (`out`, else <runs_dir>/calibration/<GPU>.json) and return
    it with its path."""
    # Where a job is given the GPUs asked for, a GPU pipeline's job that finds none ran on the
    # wrong nodes (e.g. partition): not a CPU calibration.
    asked = request(spec, quick, require_gpu or (executor.grants_asked_gpus and spec.cluster.gpus_per_node > 0))
    _check_writable(out.parent if out else runfolder.calibration_folder(Path(spec.runs_dir)))
    # Torch-free at import (it imports torch as it measures); pickled by reference for a job.
    from stages.calibrate import measure

    measured = executor.measure_node(spec, measure, asked, echo)
    result = calibration.from_json(measured, f"the measurement of {measured.get('node')}")
    path = out or runfolder.calibration_file(Path(spec.runs_dir), result.name)  # named after the GPU found
    calibration.save(result, path)
    return result, path


def _check_writable(folder: Path) -> None:
    """Refuse before measuring, not after, when the file could not be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidInput(f"{folder}: cannot write the calibration file there: {err.strerror or err}") from None
    if not os.access(folder, os.W_OK):
        raise InvalidInput(f"{folder}: cannot write the calibration file there: permission denied")


# --------------------------------------------------------------------------- what it says


def summary(result: Calibration, path: Path, spec: PipelineSpec) -> str:
    """A short table of what was measured, beside the catalogue's datasheet numbers, and the notes."""
    sheet = hardware.GPUS.get(result.gpu.catalogue) if result.gpu and result.gpu.catalogue else None
    gpu = (f"{result.gpu.count} x {result.gpu.device_name} (catalogue: {result.gpu.catalogue or 'not in it'})"
           if result.gpu else "no GPU")
    rows = [("measurement", "measured", "datasheet", "seconds")]
    took = _seconds(result, "matmul")
    for dtype in ("bf16", "fp16", "fp32"):
        rates = [r for r in result.matmul if r.dtype == dtype]
        for r in (r for r in rates if not r.model):  # the reference square
            rows.append((f"matmul {dtype} {r.m}x{r.k}x{r.n}", _rate(r.tflops, "TFLOP/s"),
                         _rate(sheet.peak_tflops(dtype) if sheet else None, "TFLOP/s"), took))
            took = ""
        shaped = sorted(r.tflops for r in rates if r.model)
        if shaped:
            rows.append((f"matmul {dtype}, {len(shaped)} pipeline GEMMs (min/median/max)",
                         f"{shaped[0]:.3g} / {statistics.median(shaped):.3g} / {shaped[-1]:.3g} TFLOP/s", "", ""))
    if result.gpu is not None:
        collective = result.collective
        rows += [
            ("GPU memory copy (read + write)", _rate(result.memory_bandwidth_gbs, "GB/s"),
             _rate(sheet.memory_bandwidth_gbs if sheet else None, "GB/s"), _seconds(result, "memory_bandwidth")),
            ("host -> GPU, pinned", _rate(result.host_to_gpu_gbs, "GB/s"),
             _rate(sheet.host_link_gbs if sheet else None, "GB/s"),
             _seconds(result, "host_copies")),
            ("GPU -> host, pinned", _rate(result.gpu_to_host_gbs, "GB/s"), "", ""),
            ("all-gather, bus", _rate(collective.all_gather_gbs if collective else None, "GB/s"),
             _rate(sheet.link_gbs if sheet else None, "GB/s"), _seconds(result, "collective")),
            ("reduce-scatter, bus", _rate(collective.reduce_scatter_gbs if collective else None, "GB/s"), "", ""),
        ]
    adam = result.cpu_adam
    per_node = result.cpu_adam_params_per_s_per_node
    if adam and per_node is not None:  # the node's rate is there whenever one process's is
        threads = f"{adam.threads} thread{'s' if adam.threads > 1 else ''}"
        rows += [(f"CPU Adam ({adam.optimizer}), 1 process, {threads}", _rate(adam.params_per_s / 1e9, "G params/s"),
                  "", _seconds(result, "cpu_adam")),
                 (f"  x {result.processes_per_node} processes (node)",
                  _rate(per_node / 1e9, "G params/s"), "", "")]
    step = result.offload_step
    if step:
        rows.append((f"offloaded optimizer step (DeepSpeed, ZeRO-{step.zero_stage}, {step.layers} layer"
                     f"{'s' if step.layers > 1 else ''} of {step.model}), 1 process, {step.threads} "
                     f"thread{'s' if step.threads > 1 else ''}",
                     _rate(step.params_per_s / 1e9, "G params/s"), "", _seconds(result, "offload_step")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"calibration of {result.node}: {gpu}, {result.cores_available} cores, "
             f"{result.processes_per_node} processes per node", f"  written to {path}", ""]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    notes = list(result.notes)
    planned = calibration.default_path(spec)
    if path.resolve() != planned.resolve():
        notes.append(f"this pipeline's calibration file, the one for `plan` (cluster.gpu: "
                     f"{spec.cluster.gpu or 'not set'}), is {planned}, not this one")
    return "\n".join(lines + [f"  note: {note}" for note in notes])


def _rate(value: float | None, unit: str) -> str:
    """A rate to three significant figures; "-" for one not measured (or not in the catalogue)."""
    if not value:
        return "-"
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def _seconds(result: Calibration, key: str) -> str:
    return f"{result.seconds[key]:.1f}" if key in result.seconds else ""
