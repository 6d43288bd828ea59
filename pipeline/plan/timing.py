"""Time per optimizer step (or PPO rollout) and in total of one stage.

step = compute + optimizer step + exposed communication + offload (+ PPO generation)

- compute: the FLOPs the step executes / (dense peak x HFU), micro batch by micro
  batch on the process with the most work (processes step in lockstep). FLOPs from
  pipeline/flops.py pass_flops over the micro batches pipeline/plan/batches.py
  simulates from the data's sampled lengths: matmuls on every position of a batch
  tensor, padding included; attention by each sequence's own length with flash
  kernels, by whole lines under sdpa/eager masks; backward twice the forward (LoRA:
  once, plus the adapters' gradients); gradient checkpointing a second forward; a
  live or offloaded DPO reference one forward.
- HFU_BASE = 0.30 of dense peak on those executed FLOPs, measured: on an H100 the
  project's packed SFT of a Llama-3.2-1B shape (bf16, sdpa, ZeRO-2, 8192-token micro
  batches) ran a step in 0.49 s where these FLOPs take 0.14 s at 100%, once the
  batch shapes repeat (benchmarks/RESULTS.md, 2026-11-22). Well-tuned stacks reach
  40-55% MFU on large models (LLM Foundry 30B on A100 55%, Megatron-Core up to 47% on
  H100; CONTEXT.md), so for 7B-70B models this is on the slow side. x0.65 with eager
  attention, x0.9 with ZeRO-3's per-layer fetch hooks. metrics.jsonl reports step_s,
  mfu, tokens_per_s and token_efficiency under the names the plan's --json uses, so
  every run checks it.
- optimizer step: memory-bound. Adam reads the fp32 master weights, gradients, m
  and v and writes master, m and v (28 B per parameter), the gradient-norm pass
  reads the gradients once more (4 B) and, where a master copy exists, the
  training copy is written back (b B): parameters each process steps x those bytes
  / GPU memory bandwidth. With optimizer offload: the PCIe copies and a CPU Adam at
  2e9 parameters/s per node instead, not overlapped.
- communication (ring: (W-1)/W of the bytes per GPU) over NVLink/PCIe or the
  inter-node network, hidden behind at most half the compute.
- PPO: every sequence max_len long (prompt + max_new_tokens); decoding is
  memory-bound (every weight read once per new token per generation call).

MFU, tokens_per_s, token_efficiency and step_s mean what the running stage logs
under those names (stages/engine.py Window): model FLOPs (flops.sequence_flops of
the real sequences: no recompute, no padding) / (step_s x processes x peak); real
tokens / step_s over all processes; real / processed tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pipeline.flops import forward_flops_per_token, pass_flops, sequence_flops
from pipeline.plan.batches import Batches
from pipeline.plan.inputs import Hardware, Knobs, ModelUse, Workload
from pipeline.plan.memory import trainable_tensors

HFU_BASE = 0.30
EAGER_EFFICIENCY = 0.65
ZERO3_EFFICIENCY = 0.9
COMM_OVERLAP = 0.5
CPU_ADAM_PARAMS_PER_S = 2e9
ADAM_BYTES_PER_PARAM = 32  # master, gradient, m, v read; master, m, v written; the gradients read for their norm


@dataclass
class TimeEstimate:
    """Per unit of work: one optimizer step (SFT, RM, DPO) or one rollout (PPO)."""

    unit: str
    rows_per_step: int
    tokens_per_step: float  # real tokens (the sequences' own), all processes
    processed_tokens_per_step: float  # positions of the batch tensors, padding included
    micro_batches_per_step: float  # forward passes per process
    flops_per_token: float  # executed (padding, masks, recompute), all models, per real token
    model_flops_per_token: float  # flops.sequence_flops of the trained models (+ forward of live frozen ones)
    hfu: float
    compute_s: float
    optimizer_s: float
    communication_s: float
    exposed_communication_s: float
    offload_s: float
    step_s: float
    mfu: float
    tokens_per_s: float
    token_efficiency: Optional[float]  # real / processed tokens; None for PPO (not modelled)
    seconds_per_1000_rows: float
    precompute_s_per_1000_rows: float = 0.0
    rows: Optional[int] = None
    steps: Optional[int] = None
    total_s: Optional[float] = None
    notes: list[str] = field(default_factory=list)


@dataclass
class _Work:
    """FLOPs and passes of one unit of work (per unit; FLOPs over all processes unless said)."""

    rows: int
    real_tokens: float
    processed_tokens: float
    train_micro: float  # training passes per process
    optimizer_steps: float
    scoring_micro: float  # frozen models' passes per process
    executed: float
    slowest: float  # executed FLOPs of the busiest process, micro batch by micro batch
    model: float
    precompute: float = 0.0  # a precomputed reference's forward FLOPs (run once, before training)


def estimate_time(models: list[ModelUse], workload: Workload, knobs: Knobs, hw: Hardware,
                  rows: Optional[int] = None, batches: Optional[Batches] = None) -> Optional[TimeEstimate]:
    """Step time and total time; None without a known GPU (nothing to compare with).

    The unit of work is one optimizer step (SFT, RM, DPO: over `batches`, the
    simulated micro batches) or one rollout (PPO: generate, score, then train_passes
    passes of optimizer steps over it).
    """
    if not hw.on_gpu or hw.gpu is None:
        return None
    gpu, b = hw.gpu, knobs.weight_bytes
    world = knobs.nodes * hw.processes_per_node
    peak = gpu.peak_tflops(knobs.precision) * 1e12
    notes: list[str] = []
    if knobs.precision == "bf16" and gpu.bf16_tflops is None:
        notes.append(f"{gpu.name} has no bf16 tensor cores: bf16 runs at its fp32 rate; use precision fp16")
    ring = (world - 1) / world if world > 1 else 0.0
    bandwidth = gpu.link_gbs if knobs.nodes == 1 else min(gpu.link_gbs, gpu.network_gbs / max(hw.gpus_per_node, 1))
    bandwidth *= 1e9
    rollout = workload.rows_per_rollout is not None
    work = _rollout_work(models, workload, knobs, world) if rollout else _step_work(models, knobs, batches)

    comm_bytes = offload_bytes = cpu_adam_params = optimizer_bytes = 0.0
    for use in models:
        n_all = use.shape.params_with_head(use.head)
        if use.trained:
            n_trained = sum(trainable_tensors(use, knobs)[0])
            if knobs.zero_stage in (0, 1):
                comm_bytes += 2 * b * n_trained * ring * work.optimizer_steps
            elif knobs.zero_stage == 2:
                comm_bytes += b * n_trained * ring * (work.train_micro + work.optimizer_steps)
            else:
                comm_bytes += (2 * b * n_all + b * n_trained) * ring * work.train_micro
            if knobs.offloads:
                offload_bytes += b * n_trained / world * (work.train_micro + work.optimizer_steps)
                cpu_adam_params += n_trained / world * hw.processes_per_node * work.optimizer_steps
            else:
                stepped = n_trained / world if knobs.zero_stage >= 1 else n_trained
                master = knobs.zero_stage >= 1 or knobs.precision != "fp32"
                optimizer_bytes += stepped * (ADAM_BYTES_PER_PARAM + (b if master else 0)) * work.optimizer_steps
        elif use.placement != "precompute":
            if knobs.zero_stage == 3:
                comm_bytes += b * n_all * ring * work.scoring_micro
            if use.placement == "offload":
                share = n_all / world if knobs.zero_stage == 3 else n_all
                offload_bytes += b * share * work.scoring_micro

    hfu = HFU_BASE * (EAGER_EFFICIENCY if knobs.attention == "eager" else 1.0)
    hfu *= ZERO3_EFFICIENCY if knobs.zero_stage == 3 else 1.0
    compute_s = work.slowest / (peak * hfu)
    optimizer_s = optimizer_bytes / (gpu.memory_bandwidth_gbs * 1e9)
    comm_s = comm_bytes / bandwidth if world > 1 else 0.0
    exposed = max(0.0, comm_s - COMM_OVERLAP * compute_s)
    offload_s = offload_bytes / (gpu.host_link_gbs * 1e9) + cpu_adam_params / CPU_ADAM_PARAMS_PER_S
    unit_s = compute_s + optimizer_s + exposed + offload_s
    if rollout:
        unit_s += _generation_s(models, workload, knobs, hw, world, ring, bandwidth)
        notes.append("generation time assumes memory-bound decoding (weights read once per new token)")

    per_1000 = unit_s * 1000 / work.rows
    pre_per_1000 = work.precompute / work.rows * 1000 / (world * peak * HFU_BASE)
    steps = total = None
    if rows is not None:
        units = max(1, knobs.epochs * rows // work.rows)
        steps = int(units * work.optimizer_steps)
        total = units * unit_s + pre_per_1000 * rows / 1000
    if knobs.max_steps:
        steps = knobs.max_steps
        total = knobs.max_steps / work.optimizer_steps * unit_s + (pre_per_1000 * rows / 1000 if rows else 0.0)
    return TimeEstimate(
        unit="rollout" if rollout else "optimizer step", rows_per_step=work.rows, tokens_per_step=work.real_tokens,
        processed_tokens_per_step=work.processed_tokens, micro_batches_per_step=work.train_micro,
        flops_per_token=work.executed / work.real_tokens, model_flops_per_token=work.model / work.real_tokens,
        hfu=hfu, compute_s=compute_s, optimizer_s=optimizer_s, communication_s=comm_s, exposed_communication_s=exposed,
        offload_s=offload_s, step_s=unit_s, mfu=work.model / (unit_s * world * peak),
        tokens_per_s=work.real_tokens / unit_s,
        token_efficiency=None if rollout else work.real_tokens / work.processed_tokens,
        seconds_per_1000_rows=per_1000 + pre_per_1000, precompute_s_per_1000_rows=pre_per_1000, rows=rows,
        steps=steps, total_s=total, notes=notes,
    )


def _lora_params(use: ModelUse, knobs: Knobs) -> Optional[int]:
    return sum(trainable_tensors(use, knobs)[0]) if use.trained and knobs.lora_rank else None


def _step_work(models: list[ModelUse], knobs: Knobs, batches: Batches) -> _Work:
    """An optimizer step of sft/rm/dpo over the simulated micro batches."""
    lora = {use.role: _lora_params(use, knobs) for use in models}
    slowest = total = model = precompute = 0.0
    for step in batches.steps:
        for j in range(max(len(mine) for mine in step)):
            busiest = 0.0
            for micro in (mine[j] for mine in step if j < len(mine)):
                positions, attended = micro.processed_tokens, micro.attended(batches.masked)
                executed = 0.0
                for use in models:
                    flops = pass_flops(use.shape, use.head, positions, attended, trained=use.trained,
                                       lora_params=lora[use.role],
                                       recompute=use.trained and knobs.gradient_checkpointing)
                    if use.placement == "precompute":
                        precompute += flops
                        continue
                    executed += flops
                    if micro.counts:
                        model += sum(sequence_flops(use.shape, use.head, n, use.trained, lora[use.role])
                                     for n in micro.sequences)
                busiest = max(busiest, executed)
                total += executed
            slowest += busiest
    count = len(batches.steps)
    return _Work(rows=batches.rows_per_step, real_tokens=batches.real_tokens_per_step,
                 processed_tokens=batches.processed_tokens_per_step, train_micro=batches.micro_batches_per_step,
                 optimizer_steps=1.0, scoring_micro=batches.micro_batches_per_step, executed=total / count,
                 slowest=slowest / count,
                 model=model / count, precompute=precompute / count)


def _rollout_work(models: list[ModelUse], workload: Workload, knobs: Knobs, world: int) -> _Work:
    """A PPO rollout: experience (a forward of every model over every sequence), then
    train_passes passes of the trained models; every sequence max_len long."""
    seq = workload.seq_len
    per_pass_rows = knobs.global_batch_size or knobs.micro_batch_size * world
    accumulation = max(1, per_pass_rows // (knobs.micro_batch_size * world))
    sequences = workload.rows_per_rollout * workload.sequences_per_row
    train_micro = workload.train_passes * sequences / (knobs.micro_batch_size * world)
    tokens = sequences * seq
    executed = model = 0.0
    for use in models:
        fwd = forward_flops_per_token(use.shape, use.head, seq)
        if use.trained:
            trained_flops = pass_flops(use.shape, use.head, seq, seq * seq, trained=True,
                                       lora_params=_lora_params(use, knobs))
            recompute = fwd * seq if knobs.gradient_checkpointing else 0.0
            executed += (trained_flops + recompute) / seq * tokens * workload.train_passes + fwd * tokens
            model += trained_flops / seq * tokens * workload.train_passes + fwd * tokens
        else:
            executed += fwd * tokens
            model += fwd * tokens
    return _Work(rows=workload.rows_per_rollout, real_tokens=tokens, processed_tokens=tokens, train_micro=train_micro,
                 optimizer_steps=max(1.0, train_micro / accumulation),
                 scoring_micro=sequences / (world * (workload.scoring_batch or knobs.micro_batch_size)),
                 executed=executed, slowest=executed / world, model=model)


def _generation_s(models: list[ModelUse], workload: Workload, knobs: Knobs, hw: Hardware, world: int, ring: float,
                  bandwidth: float) -> float:
    """Decoding a rollout: memory-bound, every weight read once per new token per call."""
    gen, actor = workload.generation, next((m for m in models if m.trained and m.head == "lm"), None)
    if gen is None or actor is None:
        return 0.0
    weights = actor.shape.n_params * knobs.weight_bytes
    calls = math.ceil(workload.rows_per_rollout * workload.sequences_per_row / world / gen.batch)
    seconds = calls * gen.new_tokens * weights / (hw.gpu.memory_bandwidth_gbs * 1e9)
    if knobs.zero_stage == 3 and world > 1:  # one gather of the whole actor per rollout
        seconds += weights * ring / bandwidth
    return seconds


# --------------------------------------------------------------------------- checkpoints

# What one node writes to the shared filesystem a checkpoint goes to: a conservative figure for
# an NFS or Lustre/GPFS client (a Lustre client alone does 1-5 GB/s; NFS often less).
CHECKPOINT_WRITE_BYTES_PER_S = 1e9
SIGNAL_MARGIN_S = 60  # requeueing (scontrol), the processes' exit, a slower filesystem moment
SIGNAL_LEAD_MIN_S, SIGNAL_LEAD_MAX_S = 90, 3600


def checkpoint_bytes(models: list[ModelUse], knobs: Knobs) -> int:
    """What a DeepSpeed checkpoint of the stage holds: each trained model's weights (knobs.weight_bytes
    per parameter, frozen base included) and its trained parameters' Adam states (m and v, and the
    fp32 master copy where the weights are bf16/fp16). Frozen models (reference, reward) are not saved."""
    total = 0
    for use in models:
        if not use.trained:
            continue
        trained, frozen = trainable_tensors(use, knobs)
        states = 8 if knobs.precision == "fp32" else 12
        total += (sum(trained) + sum(frozen)) * knobs.weight_bytes + sum(trained) * states
    return total


def checkpoint_save_seconds(models: list[ModelUse], knobs: Knobs) -> float:
    """Time to write one checkpoint: every rank writes its shard, so each node its share."""
    return checkpoint_bytes(models, knobs) / max(knobs.nodes, 1) / CHECKPOINT_WRITE_BYTES_PER_S


def signal_lead_seconds(save_s: float, step_s: Optional[float]) -> int:
    """How long before the time limit Slurm should signal: the step running then ends (twice an
    estimated step, for a slow one), the checkpoint is written (twice the estimate), and the
    job requeues and exits (SIGNAL_MARGIN_S)."""
    lead = 2 * save_s + 2 * (step_s or 0.0) + SIGNAL_MARGIN_S
    return int(min(SIGNAL_LEAD_MAX_S, max(SIGNAL_LEAD_MIN_S, math.ceil(lead))))
