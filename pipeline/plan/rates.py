"""The rates the time model turns a step's work into seconds with, each with where it comes from.

A step's time (pipeline/plan/timing.py) is a sum of work x rate:

  matmuls          FLOPs / the GPU's matmul rate at the shapes the model multiplies
  attention        FLOPs / (datasheet peak x the kernel's efficiency)
  the loss         logits x bytes moved per logit / GPU memory bandwidth
  ZeRO-3 hooks     a fixed cost per layer and pass: its fetch and release hooks cost the same
                   whatever the layer's size
  optimizer step   bytes per parameter / GPU memory bandwidth (ZeRO-0/1/2 on the GPU), or the
                   host's Adam rate and the PCIe copies (optimizer offload)
  communication    bytes / link bandwidth (pipeline/plan/timing.py)

Where each number comes from, most trusted first:
  calibrated  measured on the user's own node by `python -m pipeline calibrate`
  records     fitted to the GPU runs on record (benchmarks/results; `python -m
              benchmarks.gpu.records fit` prints the fit, and tests/test_plan_records.py
              holds every record to the plan)
  datasheet   core/hardware.py's catalogue
  default     a published figure no record has checked yet

The fit (2026-11-26) is over 19 records (17 cases) on two GPUs and two shapes: the 1B-shaped SFT/DPO cases
of 2026-11-22 and 2026-11-26 on an H100 (ZeRO-0/1/2/3, with and without checkpointing, LoRA,
micro batch 2 to 8, sdpa) and the 34B slice of 2026-11-26 on an H200 (ZeRO-3, optimizer
offload, 1 and 2 layers). Memory-bound work is fitted as bytes over the copy bandwidth a
calibration measures, so a calibration enters on the same basis as the fit. What no record has
run is a default: flash attention's efficiency, eager attention, multi-GPU communication.

Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from core import hardware
from core.shapes import ModelShape

# ---- fitted to the records (python -m benchmarks.gpu.records fit)

# sdpa with the packed lines' additive mask runs PyTorch's memory-efficient kernel, far below
# the matmuls: ~9% of the datasheet on H100/H200 (the 1B cases, where attention is 14% of the
# FLOPs, pin it).
SDPA_MASKED_EFFICIENCY = 0.081
# The memory-bound terms below are bytes over the GPU's copy bandwidth (core/hardware.py
# copy_bandwidth_gbs: a 1 GiB device copy, 2,589 GB/s on the H100, 77% of the datasheet
# elsewhere), the figure `calibrate` measures: fitted on the datasheet's 3,350 they were 1.29x
# these (128 B/logit, 510 / 320 B/param, 21 B), and a calibration divided them by the copy rate.
# The loss path (stages/losses.py: bf16 logits, fp32 log-sum-exp chunks, their backward) moves
# about this many bytes per logit and pass through GPU memory.
LOSS_BYTES_PER_LOGIT = 96.8
# ZeRO-3's per-module fetch and release hooks: a fixed cost per layer and pass, the same for
# the 1B's 60M-parameter layers and the 34B's 692M ones (so hooks, not bandwidth).
ZERO3_LAYER_PASS_S = 6.0e-3
# The optimizer step on the GPU, as bytes of GPU memory traffic per trained parameter: torch's
# fused AdamW reads and writes ~36 B/param, but DeepSpeed's gradient buckets, fp32 copies,
# norms and overflow checks around it make the measured step cost far more.
STEP_BYTES_PER_PARAM = {0: 224.0, 1: 344.0, 2: 344.0}
# The host's share of an offloaded optimizer step, per core of the process: one process on 16
# cores stepped ~1.3e9 parameters/s besides the PCIe copies (the 34B slice, H200 machine). It is
# everything the host does per parameter (DeepSpeedCPUAdam, the fp32 gradient and staging
# copies, norms), not the optimizer alone (3.1e8 per core on the 2026-11-26 H100's machine):
# `calibrate` times DeepSpeed's whole offloaded step on a slice of the file's model, which replaces it.
HOST_ADAM_PARAMS_PER_S_PER_CORE = 8.3e7
# peft's adapters (dropout, the two thin matmuls, scaling, the add) move about this many bytes
# per token, layer pass and adapted in + out feature: LoRA SFT stepped no faster than the full
# fine-tune though a third of the matmuls go (one record pins it: mem-sft-lora).
LORA_BYTES_PER_ELEMENT = 15.9

# ---- published figures not yet checked against a record

# FlashAttention-2 reaches 50-73% of an A100's peak forward and ~35-63% forward + backward
# (Dao, 2023); half the datasheet for the kernels' share.
FLASH_EFFICIENCY = 0.50
EAGER_EFFICIENCY = SDPA_MASKED_EFFICIENCY * 0.65  # materialised scores: slower than sdpa's kernel
# Cores a GPU process has when the pipeline file does not say (cluster.cpus_per_task): a DGX
# A100 has 128 cores for 8 GPUs, a DGX H100 112.
DEFAULT_CORES_PER_PROCESS = 16


@dataclass(frozen=True)
class Rate:
    value: float
    source: str  # calibrated | records | datasheet | default
    note: str = ""

    def describe(self, unit: str = "", scale: float = 1.0) -> str:
        value = self.value * scale
        text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
        text += f"{unit} ({self.source}"
        return text + (f": {self.note})" if self.note else ")")


@dataclass(frozen=True)
class Rates:
    """What one GPU process of a stage does per second, with sources (see the module doc)."""

    peak_flops: float  # the datasheet's dense peak in the stage's precision
    matmul: Rate  # achieved matmul FLOP/s (at the model's shapes when calibrated)
    attention_efficiency: dict  # kernel -> Rate (fraction of peak_flops)
    hbm_bytes_per_s: Rate
    host_link_bytes_per_s: Rate
    link_bytes_per_s: Rate  # per GPU, collectives between the GPUs of a node
    network_bytes_per_s: Rate  # per node, between nodes
    host_adam_params_per_s: Rate  # one process, with its share of the node's cores
    loss_bytes_per_logit: Rate = Rate(LOSS_BYTES_PER_LOGIT, "records")
    zero3_layer_pass_s: Rate = Rate(ZERO3_LAYER_PASS_S, "records", "one process, 1B and 34B-slice layers")
    step_bytes_per_param: dict = field(default_factory=lambda: {
        z: Rate(v, "records", "one record" if z == 0 else "") for z, v in STEP_BYTES_PER_PARAM.items()})
    lora_bytes_per_element: Rate = Rate(LORA_BYTES_PER_ELEMENT, "records", "one record")
    calibration: str | None = None  # "calibrated on <node>, <date>" when a file was used

    def attention(self, kernel: str) -> Rate:
        return self.attention_efficiency.get(kernel, self.attention_efficiency["sdpa"])

    def sources(self, kernel: str, zero_stage: int, offloads: bool, world: int, lora: bool) -> list[str]:
        """What the plan's time rests on, one line per rate it used."""
        lines = [f"matmul {self.matmul.describe(' TFLOP/s', 1e-12)}",
                 f"attention ({kernel}) {self.attention(kernel).describe(' of peak')}",
                 f"GPU memory {self.hbm_bytes_per_s.describe(' GB/s', 1e-9)}",
                 f"loss {self.loss_bytes_per_logit.describe(' B/logit')}"]
        if zero_stage == 3:
            lines.append(f"ZeRO-3 hooks per layer pass {self.zero3_layer_pass_s.describe(' ms', 1e3)}")
        if lora:
            lines.append(f"LoRA adapters {self.lora_bytes_per_element.describe(' B per adapted feature and pass')}")
        if offloads:
            lines.append(f"host Adam {self.host_adam_params_per_s.describe('e9 params/s per process', 1e-9)}")
            lines.append(f"host<->GPU copies {self.host_link_bytes_per_s.describe(' GB/s', 1e-9)}")
        elif zero_stage < 3:
            lines.append(f"optimizer step {self.step_bytes_per_param[zero_stage].describe(' B/param')}")
        if world > 1:
            lines.append(f"GPU links {self.link_bytes_per_s.describe(' GB/s', 1e-9)}")
        return lines


def built_in(gpu: hardware.GPU, precision: str, cores_per_process: int | None = None,
             calibration=None, shape: ModelShape | None = None, tokens: int | None = None) -> Rates:
    """The rates of a catalogue GPU for a stage that trains `shape` on micro batches of `tokens`
    tokens; a calibration (core/calibration.py) replaces what it measured."""
    peak = gpu.peak_tflops(precision) * 1e12
    if gpu.measured_matmul_tflops and precision in ("bf16", "fp16"):
        matmul = Rate(gpu.measured_matmul_tflops * 1e12, "records", "8192^3 bf16 matmuls on this GPU")
    else:
        matmul = Rate(peak * hardware.MATMUL_FRACTION, "default",
                      f"{hardware.MATMUL_FRACTION:.0%} of the datasheet, as H100/H200 measured")
    cores = cores_per_process or DEFAULT_CORES_PER_PROCESS
    cores_note = (f"{cores} cores per process (cluster.cpus_per_task)" if cores_per_process
                  else f"{cores} cores per process assumed (set cluster.cpus_per_task)")
    rates = Rates(
        peak_flops=peak,
        matmul=matmul,
        attention_efficiency={
            "sdpa": Rate(SDPA_MASKED_EFFICIENCY, "records", "masked packed lines"),
            "eager": Rate(EAGER_EFFICIENCY, "default", "no record ran eager attention"),
            "flash_attention_2": Rate(FLASH_EFFICIENCY, "default", "FlashAttention-2's published figures; "
                                      "no record ran it"),
        },
        hbm_bytes_per_s=_copy_bandwidth(gpu),
        host_link_bytes_per_s=(Rate(gpu.measured_host_link_gbs * 1e9, "records", "pinned 1 GiB copies on this GPU")
                               if gpu.measured_host_link_gbs else Rate(gpu.host_link_gbs * 1e9, "datasheet")),
        link_bytes_per_s=Rate(gpu.link_gbs * 1e9, "default", "typical NCCL bus bandwidth, not measured here"),
        network_bytes_per_s=Rate(gpu.network_gbs * 1e9, "default", "a typical node's interconnect"),
        host_adam_params_per_s=Rate(HOST_ADAM_PARAMS_PER_S_PER_CORE * cores, "records", cores_note),
    )
    if calibration is not None:
        rates = _calibrated(rates, calibration, precision, shape, tokens)
    return rates


def _copy_bandwidth(gpu: hardware.GPU) -> Rate:
    """GPU memory bandwidth as a device copy moves it (core/hardware.py copy_bandwidth_gbs):
    the basis the memory-bound constants above are fitted on."""
    if gpu.measured_memory_bandwidth_gbs:
        return Rate(gpu.measured_memory_bandwidth_gbs * 1e9, "records", "1 GiB device copy on this GPU")
    return Rate(gpu.copy_bandwidth_gbs * 1e9, "default",
                f"{hardware.MEMORY_FRACTION:.0%} of the datasheet's {gpu.memory_bandwidth_gbs:,.0f}, "
                "as a copy on an H100 measured")


def _calibrated(rates: Rates, calibration, precision: str, shape: ModelShape | None,
                tokens: int | None) -> Rates:
    """`rates` with what a calibration file measured in its place (core/calibration.py)."""
    where = f"{calibration.node}, {calibration.date[:10]}"
    # Rates' Rate fields by name, replace()'s keywords: Any, as mypy checks a ** mapping's values
    # against every field of Rates (peak_flops, the dicts) whatever its keys are.
    measured: dict[str, Any] = {}
    matmul = _matmul_at_shapes(calibration, precision, shape, tokens) if shape and tokens else None
    if matmul:
        measured["matmul"] = Rate(matmul, "calibrated", f"{where}, at this model's shapes")
    if calibration.memory_bandwidth_gbs:
        measured["hbm_bytes_per_s"] = Rate(calibration.memory_bandwidth_gbs * 1e9, "calibrated", where)
    if calibration.host_to_gpu_gbs and calibration.gpu_to_host_gbs:
        slower = min(calibration.host_to_gpu_gbs, calibration.gpu_to_host_gbs)
        measured["host_link_bytes_per_s"] = Rate(slower * 1e9, "calibrated", where)
    if calibration.offload_step:
        # Like for like: the host's work in DeepSpeed's own offloaded step (the norms, DeepSpeedCPUAdam,
        # the fp32 gradient and staging copies), one process on its share of the node's cores.
        step = calibration.offload_step
        measured["host_adam_params_per_s"] = Rate(
            step.params_per_s, "calibrated", f"{where}: DeepSpeed's offloaded step on {step.layers} layer"
            f"{'s' if step.layers > 1 else ''} of {step.model}, ZeRO-{step.zero_stage}, {step.threads} cores")
    elif calibration.cpu_adam:
        # A file without the offloaded step (written before calibrate measured it): DeepSpeedCPUAdam
        # alone is not the records' host rate (everything the host does per parameter in an offloaded
        # step, fitted to the 34B slices; it was 3.8x that on the 2026-11-26 H100's machine). Shown, not used.
        adam = calibration.cpu_adam
        host = rates.host_adam_params_per_s
        note = (f"{host.note}; calibrated {adam.optimizer} alone {adam.params_per_s / 1e9:.3g}e9 params/s "
                f"on {adam.threads} cores ({where}) not used: it leaves out the offloaded step's other host work")
        measured["host_adam_params_per_s"] = dataclasses.replace(host, note=note.lstrip("; "))
    if calibration.collective:
        both = min(calibration.collective.all_gather_gbs, calibration.collective.reduce_scatter_gbs)
        measured["link_bytes_per_s"] = Rate(both * 1e9, "calibrated", f"{where}, NCCL between "
                                            f"{calibration.collective.processes} GPUs")
    return dataclasses.replace(rates, **measured, calibration=f"calibrated on {where}")


def _matmul_at_shapes(calibration, precision: str, shape: ModelShape, tokens: int) -> float | None:
    """The model's matmul rate from the measured GEMMs nearest its own: each linear layer of a
    decoder layer as the model runs it (q, k, v, o, gate, up, down apiece: pipeline/calibrate.py
    times these) and the LM head, on a micro batch of `tokens` rows, each product in its three
    passes (forward, dX, dW: the pass's layout), weighted by their FLOPs (the three passes one
    each: a training step's share without checkpointing's recompute)."""
    dims = list(shape.linear_dims().values()) + [(shape.hidden, shape.vocab)]
    seconds = flops = 0.0
    for k, n in dims:
        for what, m_, k_, n_ in (("fwd", tokens, k, n), ("dX", tokens, n, k), ("dW", n, tokens, k)):
            rate = calibration.matmul_tflops(m_, k_, n_, precision, what)
            if rate is None:
                return None
            flops += 2 * m_ * k_ * n_
            seconds += 2 * m_ * k_ * n_ / (rate * 1e12)
    return flops / seconds
