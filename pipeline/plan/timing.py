"""Time per optimizer step (or PPO rollout) and in total of one stage.

FLOPs per token from pipeline/flops.py, the formula the running stage reports its
MFU with: 2N forward (N = matmul parameters: the input embedding is a lookup) +
4*layers*q_width*seq attention; backward twice the forward (LoRA: once, no weight
gradients for the frozen base); gradient checkpointing repeats the forward (8N
instead of 6N); a live or offloaded reference adds a forward (DPO ~8N). Hardware
utilisation HFU_BASE = 0.45 of dense peak on those executed FLOPs (well-tuned
stacks reach 40-55% MFU, see CONTEXT.md), x0.65 with eager attention, x0.9 with
ZeRO-3's per-layer fetch hooks. Communication (ring: (W-1)/W of the bytes per
GPU) over NVLink/PCIe or the inter-node network, hidden behind at most half the
compute; optimizer offload adds the PCIe copies and a CPU Adam step at 2e9
parameters/s per node, not overlapped. The reported MFU is model FLOPs (without
the recompute) over peak x step time. Sequences are assumed max_len tokens long
(padding/worst case): times are upper bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pipeline.flops import backward_flops_per_token, forward_flops_per_token
from pipeline.plan.inputs import Hardware, Knobs, ModelUse, Workload
from pipeline.plan.memory import trainable_tensors

HFU_BASE = 0.45
EAGER_EFFICIENCY = 0.65
ZERO3_EFFICIENCY = 0.9
COMM_OVERLAP = 0.5
CPU_ADAM_PARAMS_PER_S = 2e9


@dataclass
class TimeEstimate:
    """Per unit of work: one optimizer step (SFT, RM, DPO) or one rollout (PPO)."""

    unit: str
    rows_per_step: int
    tokens_per_step: int
    flops_per_token: float  # executed (with recompute), all models
    model_flops_per_token: float  # 6N + attention of the trained models (+ forward of frozen ones)
    hfu: float
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    offload_s: float
    step_s: float
    mfu: float
    seconds_per_1000_rows: float
    precompute_s_per_1000_rows: float = 0.0
    rows: Optional[int] = None
    steps: Optional[int] = None
    total_s: Optional[float] = None
    notes: list[str] = field(default_factory=list)


def estimate_time(models: list[ModelUse], workload: Workload, knobs: Knobs, hw: Hardware,
                  rows: Optional[int] = None) -> Optional[TimeEstimate]:
    """Step time and total time; None without a known GPU (nothing to compare with).

    The unit of work is one optimizer step (SFT, RM, DPO) or one rollout (PPO:
    generate, score, then train_passes passes of optimizer steps over it).
    """
    if not hw.on_gpu or hw.gpu is None:
        return None
    gpu = hw.gpu
    world = knobs.nodes * hw.processes_per_node
    peak = gpu.peak_tflops(knobs.precision) * 1e12
    notes: list[str] = []
    if knobs.precision == "bf16" and gpu.bf16_tflops is None:
        notes.append(f"{gpu.name} has no bf16 tensor cores: bf16 runs at its fp32 rate; use precision fp16")
    seq = workload.seq_len
    b = knobs.weight_bytes
    ring = (world - 1) / world if world > 1 else 0.0
    bandwidth = gpu.link_gbs if knobs.nodes == 1 else min(gpu.link_gbs, gpu.network_gbs / max(hw.gpus_per_node, 1))
    bandwidth *= 1e9

    per_pass_rows = knobs.global_batch_size or knobs.micro_batch_size * world
    accumulation = max(1, per_pass_rows // (knobs.micro_batch_size * world))
    if workload.rows_per_rollout:  # PPO: a rollout of prompts, trained train_passes times
        rows_per_unit = workload.rows_per_rollout
        sequences = rows_per_unit * workload.sequences_per_row
        train_micro = workload.train_passes * sequences / (knobs.micro_batch_size * world)
        optimizer_steps = max(1.0, train_micro / accumulation)
        scoring_micro = sequences / (world * (workload.scoring_batch or knobs.micro_batch_size))
    else:
        rows_per_unit = per_pass_rows
        sequences = rows_per_unit * workload.sequences_per_row
        train_micro, optimizer_steps = float(accumulation), 1.0
        scoring_micro = float(accumulation)
    tokens_per_unit = sequences * seq
    train_tokens = tokens_per_unit * workload.train_passes

    executed = model = precompute = 0.0  # FLOPs per unit
    comm_bytes = offload_bytes = cpu_adam_params = 0.0
    for use in models:
        fwd = forward_flops_per_token(use.shape, use.head, seq)
        n_all = use.shape.params_with_head(use.head)
        if use.trained:
            n_trained = sum(trainable_tensors(use, knobs)[0])
            bwd = backward_flops_per_token(use.shape, use.head, seq, n_trained if knobs.lora_rank else None)
            recompute = fwd if knobs.gradient_checkpointing else 0.0
            executed += (fwd + bwd + recompute) * train_tokens
            model += (fwd + bwd) * train_tokens
            if workload.rows_per_rollout:  # experience: a no-grad forward of every sequence
                executed += fwd * tokens_per_unit
                model += fwd * tokens_per_unit
            if knobs.zero_stage in (0, 1):
                comm_bytes += 2 * b * n_trained * ring * optimizer_steps
            elif knobs.zero_stage == 2:
                comm_bytes += b * n_trained * ring * (train_micro + optimizer_steps)
            else:
                comm_bytes += (2 * b * n_all + b * n_trained) * ring * train_micro
            if knobs.offloads:
                offload_bytes += b * n_trained / world * (train_micro + optimizer_steps)
                cpu_adam_params += n_trained / world * hw.processes_per_node * optimizer_steps
        elif use.placement == "precompute":
            precompute += fwd * tokens_per_unit
        else:
            executed += fwd * tokens_per_unit
            model += fwd * tokens_per_unit
            if knobs.zero_stage == 3:
                comm_bytes += b * n_all * ring * scoring_micro
            if use.placement == "offload":
                share = n_all / world if knobs.zero_stage == 3 else n_all
                offload_bytes += b * share * scoring_micro

    hfu = HFU_BASE * (EAGER_EFFICIENCY if knobs.attention == "eager" else 1.0)
    hfu *= ZERO3_EFFICIENCY if knobs.zero_stage == 3 else 1.0
    compute_s = executed / (world * peak * hfu)
    comm_s = comm_bytes / bandwidth if world > 1 else 0.0
    exposed = max(0.0, comm_s - COMM_OVERLAP * compute_s)
    offload_s = offload_bytes / (gpu.host_link_gbs * 1e9) + cpu_adam_params / CPU_ADAM_PARAMS_PER_S
    unit_s = compute_s + exposed + offload_s

    gen = workload.generation
    if gen is not None:
        actor = next((m for m in models if m.trained and m.head == "lm"), None)
        if actor is not None:
            # Decoding is memory-bound: each new token reads every weight once per batch.
            per_token = actor.shape.n_params * b / (gpu.memory_bandwidth_gbs * 1e9)
            calls = math.ceil(sequences / world / gen.batch)
            unit_s += calls * gen.new_tokens * per_token
            if knobs.zero_stage == 3 and world > 1:  # one gather of the whole actor per rollout
                unit_s += actor.shape.n_params * b * ring / bandwidth
            notes.append("generation time assumes memory-bound decoding (weights read once per new token)")

    mfu = model / (unit_s * world * peak) if unit_s > 0 else 0.0
    per_1000 = unit_s * 1000 / rows_per_unit
    pre_per_1000 = precompute / rows_per_unit * 1000 / (world * peak * HFU_BASE) if precompute else 0.0
    steps = total = None
    if rows is not None:
        units = max(1, knobs.epochs * rows // rows_per_unit)
        steps = int(units * optimizer_steps)
        total = units * unit_s + pre_per_1000 * rows * knobs.epochs / 1000
    if knobs.max_steps:
        steps = knobs.max_steps
        total = knobs.max_steps / optimizer_steps * unit_s + (pre_per_1000 * rows * knobs.epochs / 1000 if rows else 0.0)
    return TimeEstimate(
        unit="rollout" if workload.rows_per_rollout else "optimizer step", rows_per_step=rows_per_unit,
        tokens_per_step=tokens_per_unit, flops_per_token=executed / tokens_per_unit,
        model_flops_per_token=model / tokens_per_unit, hfu=hfu, compute_s=compute_s, communication_s=comm_s,
        exposed_communication_s=exposed, offload_s=offload_s, step_s=unit_s, mfu=mfu,
        seconds_per_1000_rows=per_1000 + pre_per_1000, precompute_s_per_1000_rows=pre_per_1000, rows=rows,
        steps=steps, total_s=total, notes=notes,
    )
