"""Will each stage fit its GPUs, by how much not, what would make it fit, and how long
will it take? Answered from the pipeline file alone, before anything is submitted.

Pure Python (no torch): `python -m pipeline plan` runs on login nodes.

Memory, per GPU (and host RAM per node), itemised:
- model states, as DeepSpeed 0.19 allocates them (read from its source and checked
  against real allocations in tests/test_plan_vs_deepspeed.py): with N trained
  parameters, W processes and b bytes per weight (2 for bf16/fp16, 4 for fp32):
    weights     b*N whole on every GPU; ZeRO-3: b*N/W, plus whole copies of the
                tensors at or under the persistence threshold (norms)
    gradients   ZeRO-0: b*N;  ZeRO-1/2/3: b*N/W (the reduced partition)
    optimizer   fp32 master copy + Adam m and v: 12*N/W with ZeRO-1/2/3 (also in
                fp32 training: DeepSpeed copies the partition); ZeRO-0: 12*N with
                bf16/fp16 (master + m + v), 8*N in fp32 (torch AdamW, no master)
    step        while the optimizer steps, the fp32 copy of the gradients:
                ZeRO-0 bf16 4*N; ZeRO-1/2 4*N/W (with LoRA's single parameter
                group the b*N/W partition is freed as it is made); ZeRO-3 4*N/W per
                sub-group of at most 1e9 elements, and it releases the persistent
                whole copies first; fp32 ZeRO-0 needs none.
  So mixed-precision Adam under ZeRO-3 costs 2+2+12 = 16 B/param at rest and
  20 B/param while stepping (DeepSpeed's own estimator says 18).
- optimizer offload: master, m, v and an fp32 gradient partition (16 B/param/W)
  plus a bf16 staging partition (2 B, 4 in fp32) live in pinned host RAM;
  ZeRO-1/2 keep one largest-tensor gradient buffer on each side.
- LoRA: only the adapters (r*(in+out) per targeted linear layer) have gradients
  and optimizer states; the frozen base and the adapters are in the training
  precision (stages/models.py casts peft's fp32 adapters, which ZeRO-3 would
  otherwise keep in fp32).
- buffers: ZeRO-1/2 gradient buckets during backward (reduce_bucket_size elements,
  two with overlap_comm); ZeRO-3 one persistent bucket, the gathered weights of
  the layer being computed plus the prefetched next one, and that layer's full
  gradients before they are reduce-scattered.
- activations per micro batch (bytes per token per layer, h hidden, i MLP, q/kv
  widths, b activation bytes): two RMSNorms 2*(4h + 2bh) (HF keeps an fp32 copy),
  attention b*(2q + 2kv) (q, k, v, output) + fp32 log-sum-exp, MLP 4bi, LoRA b*r
  per adapted layer; eager attention adds the heads*seq^2 scores (fp32 softmax +
  its cast), sdpa a seq^2 boolean mask. Without checkpointing every layer keeps
  them; with it each layer keeps its input (b*h) and one layer is recomputed at
  a time. One more layer's worth is counted for the activation gradients.
- logits: tokens x vocab x (b logits + fp32 log-softmax + two fp32 gradient
  buffers in the loss backward) = (b + 12) bytes per entry; a frozen model's
  forward needs b + 4. Reward and value models have a scalar head: no logits.
- workspace: 1 GiB for the CUDA context, cuBLAS and NCCL buffers, plus 10% of the
  largest phase's transient memory for caching-allocator fragmentation.
- host RAM: 3 GiB per GPU process (Python, torch, CUDA and NCCL libraries), the
  offloaded states, an offloaded reference model, and at start-up the model
  being loaded (whole per process unless ZeRO-3 shards it while loading).

- frozen models (DPO reference; PPO reference and reward model), as
  stages/models.py FrozenModel holds them: live = bf16 weights sharded like the
  policy under ZeRO-3, whole otherwise; offload = in host RAM (ZeRO-3 parameter
  offload: a 1/W shard per process; otherwise a whole copy per process, moved
  onto the GPU for each forward); precompute = nothing while training.
- PPO generation: the KV cache (2 x layers x kv width x b per token) and, under
  ZeRO-3, the whole actor gathered for the rollout (stages/ppo.py does that).

Phases: memory is the sum of what is always resident plus the largest phase
(policy forward+backward, reference forward, optimizer step, generation).

Time: FLOPs per token 2N forward (N = matmul parameters: the input embedding is
a lookup) + 4*layers*q_width*seq attention; backward twice the forward (LoRA:
once, no weight gradients for the frozen base); gradient checkpointing repeats
the forward (8N instead of 6N); a live or offloaded reference adds a forward
(DPO ~8N). Hardware utilisation HFU_BASE = 0.45 of dense peak on those executed
FLOPs (well-tuned stacks reach 40-55% MFU, see CONTEXT.md), x0.65 with eager
attention, x0.9 with ZeRO-3's per-layer fetch hooks. Communication (ring:
(W-1)/W of the bytes per GPU) over NVLink/PCIe or the inter-node network, hidden
behind at most half the compute; optimizer offload adds the PCIe copies and a
CPU Adam step at 2e9 parameters/s per node, not overlapped. The reported MFU is
6N+12*layers*q*seq model FLOPs over peak x step time. Sequences are assumed
max_len tokens long (padding/worst case): times are upper bounds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from pipeline import hardware
from pipeline.config import SEQUENCES_PER_ROW
from pipeline.errors import DoesNotFit, InvalidInput
from pipeline.shapes import ModelShape, count_text, resolve_shape

GiB = 1024**3

# --------------------------------------------------------------------------- constants

CUDA_WORKSPACE_BYTES = 1 * GiB
FRAGMENTATION = 0.10
PROCESS_HOST_BYTES = 3 * GiB  # a GPU training process's own resident memory
CPU_PROCESS_HOST_BYTES = 1 * GiB  # the same without CUDA libraries
CHECKPOINT_SHARD_BYTES = 10 * GiB  # host memory a ZeRO-3 process holds while loading (one shard file)

# DeepSpeed settings stages/engine.py `deepspeed_config` uses (tests check they agree).
GPU_BUCKET_ELEMENTS = int(5e8)
CPU_BUCKET_ELEMENTS = int(5e5)
SUB_GROUP_SIZE = int(1e9)  # DeepSpeed's default zero_optimization.sub_group_size
MAX_LIVE_PARAMETERS = int(1e9)  # DeepSpeed's default stage3_max_live_parameters
FROZEN_PREFETCH_ELEMENTS = int(5e7)  # DeepSpeed's default prefetch, which engine.frozen_model_config keeps


def persistence_threshold(hidden: int) -> int:
    """ZeRO-3 keeps tensors of at most this many elements whole on every GPU."""
    return min(100_000, 10 * hidden)


# Time model (see the module docstring).
HFU_BASE = 0.45
EAGER_EFFICIENCY = 0.65
ZERO3_EFFICIENCY = 0.9
COMM_OVERLAP = 0.5
CPU_ADAM_PARAMS_PER_S = 2e9

REFERENCE_PLACEMENTS = ("live", "offload", "precompute")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Knobs:
    """The settings of a stage that memory and time depend on (a stage spec, flattened)."""

    kind: str = "sft"
    precision: str = "bf16"
    zero_stage: int = 2
    optimizer_offload: bool = False
    gradient_checkpointing: bool = False
    attention: str = "auto"
    lora_rank: Optional[int] = None
    lora_targets: tuple = ()
    max_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    epochs: int = 1
    max_steps: Optional[int] = None
    nodes: int = 1
    reference: str = "live"

    @classmethod
    def from_stage(cls, stage) -> "Knobs":
        lora = getattr(stage, "lora", None)
        return cls(
            kind=stage.kind,
            precision=stage.precision,
            zero_stage=stage.zero_stage,
            optimizer_offload=bool(stage.optimizer_offload),
            gradient_checkpointing=bool(stage.gradient_checkpointing),
            attention=stage.attention,
            lora_rank=lora.rank if lora else None,
            lora_targets=tuple(lora.target_modules) if lora else (),
            max_len=stage.max_len,
            micro_batch_size=stage.micro_batch_size,
            global_batch_size=stage.global_batch_size,
            epochs=stage.epochs,
            max_steps=stage.max_steps,
            nodes=stage.nodes,
            reference=getattr(stage, "reference", "live") or "live",
        )

    @property
    def weight_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def offloads(self) -> bool:
        """DeepSpeed offloads the optimizer only with ZeRO 1-3 (stages/engine.py)."""
        return self.optimizer_offload and self.zero_stage >= 1


@dataclass(frozen=True)
class Hardware:
    """What a stage runs on. Memory overrides from the cluster section are read as GiB
    (binary, as torch and nvidia-smi count): cluster.gpu_memory_gb is usable memory per
    GPU, cluster.host_memory_gb RAM per node; else Slurm's cluster.mem, else the catalogue."""

    gpu: Optional[hardware.GPU]
    gpus_per_node: int
    processes_per_node: int
    gpu_memory_bytes: Optional[int]
    host_memory_bytes: Optional[int]
    host_memory_source: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @classmethod
    def from_cluster(cls, cluster) -> "Hardware":
        gpu = hardware.gpu(cluster.gpu) if getattr(cluster, "gpu", None) else None
        gpus_per_node = getattr(cluster, "gpus_per_node", 0) or 0
        processes = getattr(cluster, "processes_per_node", None) or getattr(cluster, "tasks_per_node", None) or gpus_per_node or 1
        gpu_memory = getattr(cluster, "gpu_memory_gb", None)
        gpu_bytes = int(gpu_memory * GiB) if gpu_memory else (gpu.memory_bytes if gpu else None)
        host_bytes, source = None, ""
        if getattr(cluster, "host_memory_gb", None):
            host_bytes, source = int(cluster.host_memory_gb * GiB), "cluster.host_memory_gb"
        elif _slurm_mem_bytes(getattr(cluster, "mem", None)):
            host_bytes, source = _slurm_mem_bytes(cluster.mem), f"cluster.mem ({cluster.mem})"
        elif gpu is not None:
            host_bytes, source = int(gpu.host_memory_gib * GiB), f"typical {gpu.name} node"
        return cls(gpu, gpus_per_node, processes, gpu_bytes, host_bytes, source)


def _slurm_mem_bytes(mem: Optional[str]) -> Optional[int]:
    """Slurm --mem (default unit MB; K/M/G/T suffixes); 0 means the whole node: unknown here."""
    if not mem:
        return None
    text = str(mem).strip().upper()
    unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1])
    number = float(text[:-1] if unit else text)
    return int(number * (unit or 2**20)) or None


@dataclass(frozen=True)
class ModelUse:
    """One model a stage holds: trained (policy, reward model, critic) or frozen (reference, reward)."""

    role: str
    shape: ModelShape
    head: str = "lm"  # "lm" (next-token logits) or "scalar" (reward / value)
    trained: bool = True
    placement: str = "live"  # frozen models: live (on the GPUs), offload (host RAM), precompute (not at all)


@dataclass(frozen=True)
class Generation:
    """PPO rollouts: sequences generated per GPU at once, prompt and new tokens."""

    batch: int
    prompt_len: int
    new_tokens: int


@dataclass(frozen=True)
class Workload:
    """What a stage computes. A row is a training example (SFT: one sequence; RM/DPO: a
    chosen/rejected pair; PPO: a prompt with its sampled completions)."""

    sequences_per_row: int
    seq_len: int
    generation: Optional[Generation] = None
    # PPO: sequences per micro batch are counted directly (not rows), each rollout of
    # rows_per_rollout prompts is trained train_passes times, and the frozen models (and a
    # no-grad pass of the trained ones) score it scoring_batch sequences at a time.
    micro_batch_in_sequences: bool = False
    train_passes: int = 1
    scoring_batch: Optional[int] = None
    rows_per_rollout: Optional[int] = None

    def train_tokens(self, micro_batch_size: int) -> int:
        per_micro = micro_batch_size if self.micro_batch_in_sequences else micro_batch_size * self.sequences_per_row
        return per_micro * self.seq_len

    def scoring_tokens(self, micro_batch_size: int) -> int:
        return self.scoring_batch * self.seq_len if self.scoring_batch else self.train_tokens(micro_batch_size)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Item:
    """One line of the estimate. GPU bytes are per GPU; host bytes per process unless scope='node'."""

    name: str
    category: str  # weights | gradients | optimizer | buffers | activations | logits | workspace | runtime | loading
    where: str  # gpu | host
    phase: str  # always | loading | "<role> forward+backward" | "<role> forward" | optimizer step | generation
    bytes: int
    scope: str = "process"


@dataclass
class Memory:
    items: list[Item]
    processes_per_node: int
    gpu_capacity: Optional[int]
    host_capacity: Optional[int]
    host_capacity_source: str = ""

    def total_bytes(self, item: Item) -> int:
        """An item's bytes per GPU (gpu) or per node (host)."""
        return item.bytes * (self.processes_per_node if item.where == "host" and item.scope == "process" else 1)

    def peak(self, where: str) -> tuple[int, str]:
        """(bytes, phase) of the worst moment: always-resident plus the largest phase.
        Loading (start-up) is its own moment, before the training buffers exist."""
        sums: dict[str, int] = {}
        for item in self.items:
            if item.where == where:
                sums[item.phase] = sums.get(item.phase, 0) + self.total_bytes(item)
        always = sums.pop("always", 0)
        loading = sums.pop("loading", None)
        phase, extra = max(sums.items(), key=lambda kv: kv[1], default=("always", 0))
        best = (always + extra, phase) if extra > 0 else (always, "always")
        if loading is not None:
            runtime = sum(self.total_bytes(i) for i in self.items if i.where == where and i.category == "runtime")
            if loading + runtime > best[0]:
                best = (loading + runtime, "loading")
        return best

    @property
    def gpu_peak(self) -> int:
        return self.peak("gpu")[0]

    @property
    def host_peak(self) -> int:
        return self.peak("host")[0]

    @property
    def gpu_headroom(self) -> Optional[int]:
        return None if self.gpu_capacity is None else self.gpu_capacity - self.gpu_peak

    @property
    def host_headroom(self) -> Optional[int]:
        return None if self.host_capacity is None else self.host_capacity - self.host_peak

    @property
    def fits(self) -> Optional[bool]:
        """True/False when there is something to compare with; None when nothing is known."""
        checks = [h >= 0 for h in (self.gpu_headroom, self.host_headroom) if h is not None]
        return all(checks) if checks else None

    def per_process(self, categories, phases=("always",)) -> int:
        """Bytes one process holds (GPU + host) in the given categories and phases."""
        return sum(i.bytes for i in self.items
                   if i.scope == "process" and i.category in categories and i.phase in phases)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _trainable_tensors(use: ModelUse, knobs: Knobs) -> tuple[list[int], list[int]]:
    """(trained tensor sizes, frozen tensor sizes) of a model."""
    base = use.shape.parameter_tensors(use.head)
    if not use.trained:
        return [], base
    if knobs.lora_rank:
        adapters = use.shape.lora_tensors(knobs.lora_rank, knobs.lora_targets)
        if use.head == "scalar":
            adapters = adapters + [use.shape.hidden]  # peft trains the score head in full (modules_to_save)
        return adapters, base
    return base, []


def _layer_activation_bytes(shape: ModelShape, knobs: Knobs, seq: int) -> float:
    """Bytes one decoder layer keeps per token for the backward pass."""
    h, b = shape.hidden, knobs.weight_bytes
    norms = 2 * (4 * h + 2 * b * h)
    attention = b * (2 * shape.q_width + 2 * shape.kv_width) + 4 * shape.heads
    mlp = 4 * b * shape.intermediate
    lora = b * knobs.lora_rank * len(knobs.lora_targets) if knobs.lora_rank else 0
    scores = 0.0
    if knobs.attention == "eager":
        scores = shape.heads * seq * (4 + (b if b < 4 else 0))
    elif knobs.attention == "sdpa":
        scores = seq  # the boolean (seq x seq) mask, per token
    return norms + attention + mlp + lora + scores


def _gathered_params(shape: ModelShape, head: str, bucket: int) -> int:
    """Elements ZeRO-3 holds gathered at once: the current layer (or the biggest single
    tensor, e.g. an lm_head) plus the prefetched next one, within max_live_parameters."""
    largest = max(shape.layer_params, max(shape.parameter_tensors(head)))
    return min(MAX_LIVE_PARAMETERS, largest + min(bucket, shape.layer_params))


def estimate_memory(models: list[ModelUse], workload: Workload, knobs: Knobs, hw: Hardware) -> Memory:
    """Itemised memory of a stage that holds `models` and trains on `workload`."""
    world = knobs.nodes * hw.processes_per_node
    device = "gpu" if hw.on_gpu else "host"
    bucket = GPU_BUCKET_ELEMENTS if hw.on_gpu else CPU_BUCKET_ELEMENTS
    overlap_buckets = 2 if hw.on_gpu else 1  # overlap_comm double-buffers on GPUs (stages/engine.py)
    b = knobs.weight_bytes
    z = knobs.zero_stage
    off = knobs.offloads
    items: list[Item] = []
    tokens = workload.train_tokens(knobs.micro_batch_size)
    scoring_tokens = workload.scoring_tokens(knobs.micro_batch_size)
    phase_bytes: dict[str, float] = {}

    def add(name, category, where, phase, amount, scope="process"):
        """Record an item; negative amounts are memory a phase frees (only ZeRO-3's step does)."""
        amount = int(math.ceil(amount))
        if amount > 0 or (amount < 0 and phase == "optimizer step"):
            items.append(Item(name, category, where, phase, amount, scope))
            if phase not in ("always", "loading") and where == device:
                phase_bytes[phase] = phase_bytes.get(phase, 0) + amount

    def sharded_weights(tensors: list[int], nbytes: int, threshold: int) -> tuple[float, float]:
        """(partition bytes, whole-copy bytes of persistent tensors) under ZeRO-3."""
        shard = sum(_ceil_div(n, world) for n in tensors) * nbytes
        persistent = sum(n for n in tensors if n <= threshold) * nbytes
        return shard, persistent

    shard_note = f"1/{world} shard" if world > 1 else "whole"
    for use in models:
        shape, role = use.shape, use.role
        trained, frozen = _trainable_tensors(use, knobs)
        n_trained, n_frozen = sum(trained), sum(frozen)
        threshold = persistence_threshold(shape.hidden)
        prec = knobs.precision

        # ------------------------------------------------------------ frozen models
        if not use.trained:
            if use.placement == "precompute":
                continue
            fwd_phase = f"{role} forward"
            total = n_frozen * b
            if use.placement == "live":
                if z == 3:
                    shard, persistent = sharded_weights(frozen, b, threshold)
                    add(f"{role} weights ({prec}, frozen, {shard_note})", "weights", device, "always", shard + persistent)
                    add(f"{role} gathered layers", "buffers", device, fwd_phase,
                        _gathered_params(shape, use.head, FROZEN_PREFETCH_ELEMENTS) * b)
                else:
                    add(f"{role} weights ({prec}, frozen, whole)", "weights", device, "always", total)
            else:  # offload: kept in host RAM, brought in for its forward
                if z == 3:
                    shard, persistent = sharded_weights(frozen, b, threshold)
                    add(f"{role} weights offloaded ({prec}, {shard_note})", "weights", "host", "always", shard)
                    add(f"{role} gathered layers", "buffers", device, fwd_phase,
                        _gathered_params(shape, use.head, FROZEN_PREFETCH_ELEMENTS) * b + persistent)
                else:
                    add(f"{role} weights offloaded ({prec}, whole copy per process)", "weights", "host", "always", total)
                    add(f"{role} weights moved in for its forward", "weights", device, fwd_phase, total)
            add(f"{role} forward activations (one layer, no grad)", "activations", device, fwd_phase,
                scoring_tokens * _layer_activation_bytes(shape, knobs, workload.seq_len))
            if use.head == "lm":
                add(f"{role} logits + log-probs", "logits", device, fwd_phase, scoring_tokens * shape.vocab * (b + 4))
            continue

        # ------------------------------------------------------------ trained models
        train_phase = f"{role} forward+backward"
        lora_note = f", LoRA r={knobs.lora_rank}" if knobs.lora_rank else ""
        # weights
        if z == 3:
            shard, persistent = sharded_weights(frozen, b, threshold)
            a_shard, a_persistent = sharded_weights(trained, b, threshold)
            add(f"{role} weights ({prec}{lora_note}, {shard_note} + small tensors whole)", "weights", device,
                "always", shard + persistent + a_shard + a_persistent)
            # DeepSpeed releases even the persistent tensors' whole copies before the optimizer step.
            add(f"{role} small tensors' whole copies, released for the step", "weights", device,
                "optimizer step", -(persistent + a_persistent))
        else:
            add(f"{role} weights ({prec}{lora_note}, whole)", "weights", device, "always", (n_frozen + n_trained) * b)
        # gradients and optimizer states
        per_rank = n_trained / world if z >= 1 else n_trained
        if z == 3:
            per_rank = sum(_ceil_div(n, world) for n in trained)
        grad_where = "host" if off else device
        opt_where = "host" if off else device
        if z == 0:
            add(f"{role} gradients ({prec}, whole)", "gradients", device, "always", n_trained * b)
            if prec == "fp32":
                add(f"{role} Adam m, v (fp32, whole)", "optimizer", device, "always", 8 * n_trained)
            else:
                add(f"{role} fp32 master + Adam m, v (whole)", "optimizer", device, "always", 12 * n_trained)
                add(f"{role} fp32 gradients for the step", "gradients", device, "optimizer step", 4 * n_trained)
        else:
            where_note = "host, " if off else ""
            if z == 3 or not off:  # ZeRO-1/2 offload accumulate straight into the host fp32 partition
                add(f"{role} gradients ({prec}{', host' if off else ''}, {shard_note})",
                    "gradients", grad_where, "always", per_rank * b)
            if off:
                add(f"{role} fp32 gradients (host, {shard_note})", "gradients", "host", "always", 4 * per_rank)
                if z < 3:
                    add(f"{role} {prec} staging copy (host, {shard_note})", "buffers", "host", "always", per_rank * b)
                    largest = max(trained) if trained else 0
                    add(f"{role} gradient transfer buffer (largest tensor)", "buffers", device, "always", largest * b)
                    add(f"{role} gradient transfer buffer (host, largest tensor)", "buffers", "host", "always", largest * b)
            elif z == 3:
                add(f"{role} fp32 gradients for the step (per sub-group)", "gradients", device, "optimizer step",
                    4 * min(per_rank, SUB_GROUP_SIZE))
            elif knobs.lora_rank:
                # One parameter group (adapters are all matrices): its low-precision partition is
                # freed as the fp32 copy is made. Full models keep it, viewed by the norms' group.
                add(f"{role} fp32 gradients for the step (replacing the {prec} partition)", "gradients", device,
                    "optimizer step", (4 - b) * per_rank)
            else:
                add(f"{role} fp32 gradients for the step", "gradients", device, "optimizer step", 4 * per_rank)
            add(f"{role} fp32 master + Adam m, v ({where_note}{shard_note})", "optimizer", opt_where, "always",
                12 * per_rank)
        # communication buffers
        if z == 3:
            add(f"{role} gradient bucket", "buffers", device, "always", bucket * b)
            add(f"{role} gathered layers", "buffers", device, train_phase, _gathered_params(shape, use.head, bucket) * b)
            trained_layer = (knobs.lora_rank * sum(a + o for a, o in (shape.linear_dims()[t] for t in knobs.lora_targets
                                                                          if t in shape.linear_dims()))
                             if knobs.lora_rank else shape.layer_params)
            add(f"{role} one layer's full gradients", "buffers", device, train_phase, trained_layer * b)
        elif z in (1, 2):
            add(f"{role} gradient buckets", "buffers", device, train_phase, bucket * b * overlap_buckets)
        # activations and logits
        layer = _layer_activation_bytes(shape, knobs, workload.seq_len)
        if knobs.gradient_checkpointing:
            add(f"{role} activations (checkpointed: layer inputs + one layer recomputed)", "activations", device,
                train_phase, tokens * (shape.layers * b * shape.hidden + layer))
        else:
            add(f"{role} activations ({shape.layers} layers)", "activations", device, train_phase,
                tokens * shape.layers * layer)
        add(f"{role} activation gradients (one layer)", "activations", device, train_phase,
            tokens * (layer + 4 * shape.hidden + 2 * b * shape.hidden))
        if use.head == "lm":
            add(f"{role} logits + loss (fp32)", "logits", device, train_phase, tokens * shape.vocab * (b + 12))

    # ------------------------------------------------------------ generation (PPO)
    gen = workload.generation
    if gen is not None:
        actor = next((m for m in models if m.trained and m.head == "lm"), None)
        if actor is not None:
            s = actor.shape
            length = gen.prompt_len + gen.new_tokens
            add("KV cache for generation", "activations", device, "generation",
                2 * s.layers * s.kv_width * b * gen.batch * length)
            add("generation logits", "logits", device, "generation", gen.batch * s.vocab * 4)
            if z == 3:  # stages/ppo.py gathers the whole actor once per rollout, not per token
                add("actor weights gathered whole for generation", "weights", device, "generation",
                    s.n_params * b)

    # ------------------------------------------------------------ workspace, host runtime, loading
    if hw.on_gpu:
        largest_phase = max(phase_bytes.values(), default=0)
        add(f"workspace: CUDA context, cuBLAS/NCCL ({CUDA_WORKSPACE_BYTES / GiB:.0f} GiB) + "
            f"{FRAGMENTATION:.0%} fragmentation of the largest phase", "workspace", "gpu", "always",
            CUDA_WORKSPACE_BYTES + FRAGMENTATION * largest_phase)
    add("process runtime (Python, torch, CUDA libraries)", "runtime", "host", "always",
        PROCESS_HOST_BYTES if hw.on_gpu else CPU_PROCESS_HOST_BYTES)
    loading = 0
    for use in models:
        if use.trained or use.placement != "precompute":
            whole = use.shape.params_with_head(use.head) * b
            loading = max(loading, min(whole, CHECKPOINT_SHARD_BYTES) if z == 3 else whole)
    if hw.on_gpu:
        add("model weights while loading" + (" (one checkpoint shard, ZeRO-3)" if z == 3 else " (whole model)"),
            "loading", "host", "loading", loading)

    capacity_gpu = hw.gpu_memory_bytes if hw.on_gpu else None
    return Memory(items, hw.processes_per_node, capacity_gpu, hw.host_memory_bytes, hw.host_memory_source)


# --------------------------------------------------------------------------- time


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


def _forward_flops(shape: ModelShape, head: str, seq: int) -> float:
    """Forward FLOPs per token: 2 per matmul parameter (the input embedding is a lookup)
    plus attention scores and their weighted sum, 4 * layers * q_width * seq."""
    matmul = shape.params_with_head(head) - shape.embedding_params
    if head == "lm" and shape.tied_embeddings:
        matmul += shape.embedding_params  # the tied table is also the output matmul
    return 2 * matmul + 4 * shape.layers * shape.q_width * seq


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
        fwd = _forward_flops(use.shape, use.head, seq)
        n_all = use.shape.params_with_head(use.head)
        if use.trained:
            trained, _ = _trainable_tensors(use, knobs)
            n_trained = sum(trained)
            bwd = fwd + 2 * n_trained if knobs.lora_rank else 2 * fwd
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
        unit="rollout" if workload.rows_per_rollout else "optimizer step", rows_per_step=rows_per_unit, tokens_per_step=tokens_per_unit,
        flops_per_token=executed / tokens_per_unit, model_flops_per_token=model / tokens_per_unit, hfu=hfu,
        compute_s=compute_s, communication_s=comm_s, exposed_communication_s=exposed, offload_s=offload_s,
        step_s=unit_s, mfu=mfu, seconds_per_1000_rows=per_1000 + pre_per_1000,
        precompute_s_per_1000_rows=pre_per_1000, rows=rows, steps=steps, total_s=total, notes=notes,
    )


# --------------------------------------------------------------------------- stages -> models


def stage_models(knobs: Knobs, shape: ModelShape, extra: Optional[dict] = None) -> tuple[list[ModelUse], Workload]:
    """The models a stage of this kind holds, and what it computes per row.

    PPO passes what it holds besides the actor in `extra` (see `ppo_extra`): the
    reward model's and critic's shapes (None when absent), reward placement,
    samples per prompt, rollout sizes and epochs.
    """
    kind = knobs.kind
    if kind == "sft":
        models = [ModelUse("policy", shape, "lm", trained=True)]
    elif kind == "rm":
        models = [ModelUse("reward model", shape, "scalar", trained=True)]
    elif kind == "dpo":
        if knobs.reference not in REFERENCE_PLACEMENTS:
            raise ValueError(f"reference must be one of {', '.join(REFERENCE_PLACEMENTS)}, not '{knobs.reference}'")
        models = [ModelUse("policy", shape, "lm", trained=True),
                  ModelUse("reference", shape, "lm", trained=False, placement=knobs.reference)]
    elif kind == "ppo":
        extra = extra or {}
        models = ppo_models(shape, extra.get("critic_shape"), extra.get("reward_shape"), knobs.reference,
                            extra.get("reward_placement", "live"))
        new_tokens = min(extra.get("new_tokens", knobs.max_len // 2), knobs.max_len)
        scoring = extra.get("scoring_batch", knobs.micro_batch_size)
        return models, Workload(
            sequences_per_row=extra.get("samples_per_prompt", 1), seq_len=knobs.max_len,
            generation=Generation(scoring, knobs.max_len - new_tokens, new_tokens),
            micro_batch_in_sequences=True, train_passes=extra.get("train_passes", 1), scoring_batch=scoring,
            rows_per_rollout=extra.get("rollout_rows", knobs.micro_batch_size),
        )
    else:
        raise ValueError(f"the planner does not know stage kind '{kind}'")
    return models, Workload(SEQUENCES_PER_ROW[kind], knobs.max_len)


def ppo_models(actor: ModelShape, critic: Optional[ModelShape], reward: Optional[ModelShape],
               reference: str = "live", reward_placement: str = "live") -> list[ModelUse]:
    """PPO's models: actor and (for gae) critic trained; reference and reward model frozen."""
    models = [ModelUse("actor", actor, "lm", trained=True)]
    if critic is not None:
        models.append(ModelUse("critic", critic, "scalar", trained=True))
    models.append(ModelUse("reference", actor, "lm", trained=False, placement=reference))
    if reward is not None:
        models.append(ModelUse("reward model", reward, "scalar", trained=False, placement=reward_placement))
    return models


# --------------------------------------------------------------------------- suggestions


@dataclass
class Estimate:
    knobs: Knobs
    memory: Memory
    time: Optional[TimeEstimate]

    @property
    def gpu_seconds_per_1000_rows(self) -> Optional[float]:
        if self.time is None:
            return None
        return self.time.seconds_per_1000_rows * self.knobs.nodes

    @property
    def fits(self) -> Optional[bool]:
        return self.memory.fits


@dataclass
class Suggestion:
    changes: dict  # field -> new value
    description: str
    changes_training: bool  # False: same result, only memory/speed differ
    estimate: Estimate


# Within these groups a later option goes further than an earlier one (more GPUs, more
# sharding): it is only worth suggesting where the lesser one, with the same companions, fails.
ESCALATING_GROUPS = ("zero", "nodes")


def _candidate_changes(knobs: Knobs, hw: Hardware) -> list[tuple[str, dict, str, bool]]:
    """(group, field changes, description, changes what is trained?) one at a time."""
    out: list[tuple[str, dict, str, bool]] = []
    if not knobs.gradient_checkpointing:
        out.append(("checkpointing", {"gradient_checkpointing": True}, "gradient_checkpointing: true", False))
    if knobs.attention == "eager":
        out.append(("attention", {"attention": "flash_attention_2"}, "attention: flash_attention_2", False))
    for stage in (2, 3):
        if stage > knobs.zero_stage:
            out.append(("zero", {"zero_stage": stage}, f"zero_stage: {stage}", False))
    if not knobs.offloads:
        change = {"optimizer_offload": True}
        text = "optimizer_offload: true"
        if knobs.zero_stage == 0:
            change["zero_stage"] = 2
            text += " (with zero_stage: 2)"
        out.append(("offload", change, text, False))
    if knobs.kind in ("dpo", "ppo"):
        # PPO's reference must score fresh samples: it cannot be precomputed.
        for placement in ("offload", "precompute") if knobs.kind == "dpo" else ("offload",):
            if REFERENCE_PLACEMENTS.index(placement) > REFERENCE_PLACEMENTS.index(knobs.reference):
                out.append(("reference", {"reference": placement}, f"reference: {placement}", False))
    rows = knobs.global_batch_size or knobs.micro_batch_size * knobs.nodes * hw.processes_per_node
    smaller = knobs.micro_batch_size // 2
    if smaller >= 1 and rows % (smaller * knobs.nodes * hw.processes_per_node) == 0:
        out.append(("micro", {"micro_batch_size": smaller, "global_batch_size": rows},
                    f"micro_batch_size: {smaller} (global_batch_size stays {rows} by accumulation)", False))
    for factor in (2, 4):
        nodes = knobs.nodes * factor
        per_pass = knobs.micro_batch_size * nodes * hw.processes_per_node
        if rows % per_pass == 0:
            out.append(("nodes", {"nodes": nodes, "global_batch_size": rows},
                        f"nodes: {nodes} (global_batch_size {rows})", False))
        else:
            out.append(("nodes", {"nodes": nodes, "global_batch_size": per_pass},
                        f"nodes: {nodes} (global_batch_size {rows} -> {per_pass}: the minimum for "
                        f"{nodes * hw.processes_per_node} processes)", True))
    if not knobs.lora_rank:
        out.append(("lora", {"lora_rank": 16, "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj")},
                    "lora: {rank: 16} (train adapters instead of all weights)", True))
    if knobs.max_len >= 512:
        out.append(("max_len", {"max_len": knobs.max_len // 2},
                    f"max_len: {knobs.max_len // 2} (longer rows are truncated)", True))
    return out


def suggest(knobs: Knobs, shape: ModelShape, hw: Hardware, rows: Optional[int] = None,
            extra: Optional[dict] = None, limit: int = 5, max_changes: int = 3) -> list[Suggestion]:
    """Changes that make the stage fit, each re-estimated, cheapest first.

    Cheapest = changes that keep the training result (checkpointing, ZeRO stage,
    offload, reference placement, smaller micro batch with accumulation, more
    nodes) before those that change it (LoRA, shorter max_len, another batch
    size); within each, fewest GPU-seconds per 1000 rows (throughput lost, and
    GPUs added), then fewest changes. Only minimal combinations are kept (no
    subset of a kept one already fits). When nothing fits, the closest ones.
    """
    candidates = _candidate_changes(knobs, hw)
    evaluated: list[tuple[tuple, Suggestion]] = []
    for count in range(1, max_changes + 1):
        for combo in itertools.combinations(range(len(candidates)), count):
            groups = [candidates[i][0] for i in combo]
            if len(set(groups)) < len(groups):
                continue
            changes: dict = {}
            for i in combo:
                changes.update(candidates[i][1])
            new = replace(knobs, **changes)
            if new.zero_stage < knobs.zero_stage:
                continue
            estimate = _estimate(new, shape, hw, rows, extra)
            text = "; ".join(candidates[i][2] for i in combo)
            alters = any(candidates[i][3] for i in combo)
            evaluated.append((combo, Suggestion(changes, text, alters, estimate)))

    def cost(s: Suggestion, combo) -> tuple:
        gpu_s = s.estimate.gpu_seconds_per_1000_rows
        return (s.changes_training, gpu_s if gpu_s is not None else 0.0, len(combo))

    def weaker(small, big) -> bool:
        """`small` asks for less than `big`: fewer changes, or a lesser option of an escalating group."""
        if small == big:
            return False
        by_group = {candidates[i][0]: i for i in big}
        for i in small:
            group = candidates[i][0]
            if group not in by_group or (i != by_group[group] and
                                         (group not in ESCALATING_GROUPS or i > by_group[group])):
                return False
        return True

    fitting = [(c, s) for c, s in evaluated if s.estimate.fits]
    if fitting:
        minimal = [(c, s) for c, s in fitting if not any(weaker(other, c) for other, _ in fitting)]
        minimal.sort(key=lambda cs: cost(cs[1], cs[0]))
        return [s for _, s in minimal[:limit]]

    def shortfall(s: Suggestion) -> float:
        m = s.estimate.memory
        return -min(h for h in (m.gpu_headroom, m.host_headroom, 0) if h is not None)

    evaluated.sort(key=lambda cs: (shortfall(cs[1]), cost(cs[1], cs[0])))
    return [s for _, s in evaluated[:min(limit, 3)]]


# --------------------------------------------------------------------------- plans


@dataclass
class StagePlan:
    stage: str
    kind: str
    model: str
    shape: ModelShape
    knobs: Knobs
    hardware: Hardware
    world: int
    trained_params: int
    total_params: int
    estimate: Estimate
    suggestions: list[Suggestion]
    warnings: list[str]
    # For a stage that fits: the stage re-estimated without each memory-saving
    # setting it has on, so the plan says why each one is there.
    without: list[Suggestion] = field(default_factory=list)

    @property
    def memory(self) -> Memory:
        return self.estimate.memory

    @property
    def time(self) -> Optional[TimeEstimate]:
        return self.estimate.time

    @property
    def fits(self) -> Optional[bool]:
        return self.estimate.fits


def _estimate(knobs: Knobs, shape: ModelShape, hw: Hardware, rows: Optional[int], extra: Optional[dict]) -> Estimate:
    models, workload = stage_models(knobs, shape, extra)
    return Estimate(knobs, estimate_memory(models, workload, knobs, hw), estimate_time(models, workload, knobs, hw, rows))


def plan_stage(stage, shape: ModelShape, hw: Hardware, rows: Optional[int] = None, extra: Optional[dict] = None,
               model_name: str = "") -> StagePlan:
    knobs = Knobs.from_stage(stage)
    models, _ = stage_models(knobs, shape, extra)
    estimate = _estimate(knobs, shape, hw, rows, extra)
    warnings: list[str] = []
    if not shape.is_llama_like:
        warnings.append(f"model_type '{shape.model_type}' is estimated as a Llama-style decoder; sizes may differ")
    if shape.max_positions and knobs.max_len > shape.max_positions:
        warnings.append(f"max_len {knobs.max_len} exceeds the model's max_position_embeddings {shape.max_positions}")
    if knobs.optimizer_offload and knobs.zero_stage == 0:
        warnings.append("optimizer_offload needs zero_stage 1-3; with zero_stage 0 it is ignored")
    if hw.on_gpu and hw.gpu is None:
        warnings.append("cluster.gpu is not set: GPU memory and time cannot be checked")
    if not hw.on_gpu and hw.gpu is not None:
        warnings.append(f"cluster.gpu is {hw.gpu.name} but gpus_per_node is 0: planned as a CPU run")
    if hw.on_gpu and hw.processes_per_node != hw.gpus_per_node:
        warnings.append(f"{hw.processes_per_node} processes per node on {hw.gpus_per_node} GPUs")
    if estimate.time is not None:
        warnings += estimate.time.notes
    suggestions = suggest(knobs, shape, hw, rows, extra) if estimate.fits is False else []
    without = settings_relaxed(knobs, shape, hw, rows, extra) if estimate.fits else []
    trained = sum(sum(_trainable_tensors(m, knobs)[0]) for m in models if m.trained)
    total = sum(m.shape.params_with_head(m.head) for m in models)
    return StagePlan(stage.name, knobs.kind, model_name, shape, knobs, hw, knobs.nodes * hw.processes_per_node,
                     trained, total, estimate, suggestions, warnings, without)


def settings_relaxed(knobs: Knobs, shape: ModelShape, hw: Hardware, rows: Optional[int] = None,
                     extra: Optional[dict] = None) -> list[Suggestion]:
    """The stage re-estimated with each memory-saving setting it has on turned off,
    with every offload off at once, and, where the optimizer is offloaded, on one
    more node without that offload: what each setting buys, and the way out of it."""
    options: list[tuple[dict, str]] = []
    if knobs.optimizer_offload:
        options.append(({"optimizer_offload": False}, "optimizer_offload: false"))
    if knobs.reference != "live":
        options.append(({"reference": "live"}, "reference: live"))
    if knobs.optimizer_offload and knobs.reference != "live":
        options.append(({"optimizer_offload": False, "reference": "live"},
                         f"no offload at all (ZeRO-{knobs.zero_stage} alone)"))
    if knobs.gradient_checkpointing:
        options.append(({"gradient_checkpointing": False}, "gradient_checkpointing: false"))
    if knobs.zero_stage == 3:
        options.append(({"zero_stage": 2}, "zero_stage: 2"))
    if knobs.lora_rank:
        options.append(({"lora_rank": None, "lora_targets": ()}, "no LoRA (all parameters trained)"))
    if knobs.optimizer_offload:
        options.append(({"optimizer_offload": False, "nodes": knobs.nodes + 1},
                        f"nodes: {knobs.nodes + 1}, optimizer_offload: false"))
    return [Suggestion(changes, text, False, _estimate(replace(knobs, **changes), shape, hw, rows, extra))
            for changes, text in options]


def _stage_model_name(spec, stage) -> str:
    """The model a stage starts from, following `from` back to the first stage's `model`."""
    seen = set()
    while stage.model is None and stage.from_ and stage.from_ not in seen:
        seen.add(stage.name)
        stage = spec.stage(stage.from_)
    return stage.model


def ppo_extra(spec, stage) -> dict:
    """What a PPO stage holds besides its actor, from its fields (stages/ppo.py): a reward
    model (reward.model, an upstream rm stage), a critic for gae (started from the reward
    model, else from the actor's model), rollout sizes."""
    reward_stage = getattr(getattr(stage, "reward", None), "model", None)
    reward_shape = None
    if reward_stage:
        reward_shape = resolve_shape(_stage_model_name(spec, spec.stage(reward_stage)))
    actor_shape = resolve_shape(_stage_model_name(spec, stage))
    critic_shape = (reward_shape or actor_shape) if getattr(stage, "advantage", "gae") == "gae" else None
    return {
        "reward_shape": reward_shape,
        "critic_shape": critic_shape,
        "reward_placement": "offload" if getattr(stage, "reward_offload", False) else "live",
        "samples_per_prompt": getattr(stage, "n_samples_per_prompt", 1),
        "rollout_rows": getattr(stage, "rollout_batch_size", stage.micro_batch_size),
        "scoring_batch": getattr(stage, "micro_rollout_batch_size", stage.micro_batch_size),
        "new_tokens": getattr(stage, "max_new_tokens", stage.max_len // 2),
        "train_passes": getattr(stage, "ppo_epochs", 1),
    }


def plan_pipeline(spec, rows_by_stage: Optional[dict] = None) -> list["StagePlan"]:
    """A plan for every stage of a validated pipeline (PipelineSpec).

    rows_by_stage: training rows per stage name, when known, for total times;
    otherwise each plan gives the time per 1000 rows. Raises InvalidInput (exit 2)
    for an unknown GPU or a model whose size cannot be found.
    """
    rows_by_stage = rows_by_stage or {}
    try:
        hw = Hardware.from_cluster(spec.cluster)
    except ValueError as err:
        raise InvalidInput(f"cluster.gpu: {err}") from None
    plans = []
    for index, stage in enumerate(spec.stages):
        where = f"stages[{index}] ({stage.name})"
        model = _stage_model_name(spec, stage)
        try:
            shape = resolve_shape(model)
            rows = rows_by_stage.get(stage.name)
            if rows is not None and stage.data.max_rows is not None:
                rows = min(rows, stage.data.max_rows)
            extra = ppo_extra(spec, stage) if stage.kind == "ppo" else None
            plans.append(plan_stage(stage, shape, hw, rows, extra=extra, model_name=model))
        except ValueError as err:
            field = "model" if stage.model else "from"
            raise InvalidInput(f"{where}.{field}: {err}") from None
    return plans


def raise_if_not_fits(plans: list[StagePlan]) -> None:
    """DoesNotFit (exit 3) naming each stage that does not fit, by how much, and the best fix."""
    failing = [p for p in plans if p.fits is False]
    if not failing:
        return
    lines = []
    for plan in failing:
        lines.append(f"stage '{plan.stage}' does not fit: {_shortfall_text(plan.memory)}")
        if plan.suggestions:
            best = plan.suggestions[0]
            verdict = "fits" if best.estimate.fits else "comes closest"
            lines.append(f"  {verdict} with: {best.description}")
    raise DoesNotFit("\n".join(lines))


# --------------------------------------------------------------------------- output


def _gib(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def _size(n: float) -> str:
    """Item sizes: GiB for big ones, MiB for the small ones a tiny model has."""
    return f"{n / GiB:10.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 2**20:10.2f} MiB"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _shortfall_text(memory: Memory) -> str:
    parts = []
    if memory.gpu_headroom is not None and memory.gpu_headroom < 0:
        parts.append(f"GPU needs {_gib(memory.gpu_peak)} of {_gib(memory.gpu_capacity)}, "
                     f"{_gib(-memory.gpu_headroom)} short")
    if memory.host_headroom is not None and memory.host_headroom < 0:
        parts.append(f"host RAM needs {_gib(memory.host_peak)} of {_gib(memory.host_capacity)} per node, "
                     f"{_gib(-memory.host_headroom)} short")
    return "; ".join(parts) or "fits"


def _verdict(memory: Memory) -> str:
    if memory.fits is None:
        return "not checked (no GPU type or memory size known)"
    if memory.fits:
        parts = []
        if memory.gpu_headroom is not None:
            parts.append(f"{_gib(memory.gpu_headroom)} spare per GPU")
        if memory.host_headroom is not None:
            parts.append(f"{_gib(memory.host_headroom)} spare host RAM per node")
        return "FITS: " + ", ".join(parts)
    return "DOES NOT FIT: " + _shortfall_text(memory)


def _summary(estimate: Estimate) -> str:
    m, t = estimate.memory, estimate.time
    text = f"GPU {_gib(m.gpu_peak) if m.gpu_capacity is not None else '-'}, host {_gib(m.host_peak)}/node"
    if t is not None:
        text += f", {_duration(t.seconds_per_1000_rows)}/1000 rows, MFU {t.mfu:.0%}"
    return text


def format_plan(plans: list[StagePlan]) -> str:
    """A readable report: per stage the itemised memory, verdict, suggestions and time."""
    out: list[str] = []
    for plan in plans:
        k, hw, m = plan.knobs, plan.hardware, plan.memory
        gpu_name = hw.gpu.name if hw.gpu else ("CPU" if not hw.on_gpu else "unknown GPU")
        out.append(f"== stage '{plan.stage}' ({plan.kind}) on {k.nodes} node{'s' if k.nodes > 1 else ''} x "
                   f"{hw.processes_per_node} {gpu_name} = {plan.world} processes")
        out.append(f"   model {plan.model}: {plan.shape.describe()}")
        lora = f", LoRA r={k.lora_rank}" if k.lora_rank else ""
        ref = f", reference {k.reference}" if k.kind in ("dpo", "ppo") else ""
        out.append(f"   {k.precision}, ZeRO-{k.zero_stage}{' + optimizer offload' if k.offloads else ''}"
                   f"{', gradient checkpointing' if k.gradient_checkpointing else ''}, attention {k.attention}{lora}"
                   f"{ref}, max_len {k.max_len}, micro batch {k.micro_batch_size}")
        out.append(f"   trained parameters {count_text(plan.trained_params)} of {count_text(plan.total_params)} held")
        for where, title, capacity in (("gpu", "GPU memory per GPU", m.gpu_capacity),
                                       ("host", "host RAM per node", m.host_capacity)):
            rows = [i for i in m.items if i.where == where]
            if not rows:
                continue
            peak, phase = m.peak(where)
            source = f" ({m.host_capacity_source})" if where == "host" and m.host_capacity_source else ""
            moment = "at rest" if phase == "always" else f"during {phase}"
            out.append(f"   {title}: peak {_gib(peak)} {moment}, available {_gib(capacity)}{source}")
            for phase_name in ["always"] + sorted({i.phase for i in rows} - {"always"}):
                for item in (i for i in rows if i.phase == phase_name):
                    tag = "" if phase_name == "always" else f"  [{phase_name}]"
                    out.append(f"     {_size(m.total_bytes(item))}  {item.name}{tag}")
        out.append(f"   verdict: {_verdict(m)}")
        t = plan.time
        if t is not None:
            out.append(f"   time: {t.rows_per_step} rows = {t.tokens_per_step:,} tokens per {t.unit}, "
                       f"{t.flops_per_token / 1e9:.1f} GFLOP/token executed, assumed HFU {t.hfu:.0%}")
            out.append(f"         {t.unit} {_duration(t.step_s)} (compute {_duration(t.compute_s)}, communication "
                       f"{_duration(t.communication_s)} of which exposed {_duration(t.exposed_communication_s)}, "
                       f"offload {_duration(t.offload_s)}), MFU {t.mfu:.0%}")
            total = (f"{t.steps} steps = {_duration(t.total_s)}" if t.total_s is not None
                     else "rows unknown: give rows for a total")
            pre = f" (incl. {_duration(t.precompute_s_per_1000_rows)} reference precompute)" \
                if t.precompute_s_per_1000_rows else ""
            out.append(f"         {_duration(t.seconds_per_1000_rows)} per 1000 rows{pre}; {total}")
        for warning in plan.warnings:
            out.append(f"   warning: {warning}")
        if plan.without:
            out.append("   why these settings (the stage re-estimated without each):")
            for s in plan.without:
                out.append(f"     {s.description}")
                out.append(f"        -> {_verdict(s.estimate.memory)}; {_summary(s.estimate)}")
        if plan.suggestions:
            fitting = any(s.estimate.fits for s in plan.suggestions)
            out.append("   would fit with (cheapest first):" if fitting else "   nothing tried fits; closest:")
            for n, s in enumerate(plan.suggestions, 1):
                flag = " [changes the training]" if s.changes_training else ""
                out.append(f"     {n}. {s.description}{flag}")
                out.append(f"        -> {_verdict(s.estimate.memory)}; {_summary(s.estimate)}")
        out.append("")
    return "\n".join(out)


def _suggestion_json(s: Suggestion) -> dict:
    return {"changes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.changes.items()},
            "description": s.description, "changes_training": s.changes_training, **_estimate_json(s.estimate)}


def _estimate_json(estimate: Estimate) -> dict:
    m, t = estimate.memory, estimate.time
    gpu_peak, gpu_phase = m.peak("gpu")
    host_peak, host_phase = m.peak("host")
    return {
        "fits": m.fits,
        "gpu": {"peak_bytes": gpu_peak if any(i.where == "gpu" for i in m.items) else None,
                "peak_phase": gpu_phase, "capacity_bytes": m.gpu_capacity, "headroom_bytes": m.gpu_headroom},
        "host": {"peak_bytes": host_peak, "peak_phase": host_phase, "capacity_bytes": m.host_capacity,
                 "capacity_source": m.host_capacity_source, "headroom_bytes": m.host_headroom},
        "items": [{**asdict(i), "total_bytes": m.total_bytes(i)} for i in m.items],
        "time": None if t is None else asdict(t),
    }


def plan_to_json(plans: list[StagePlan]) -> dict:
    """The same numbers as format_plan, machine-readable (bytes and seconds)."""
    stages = []
    for plan in plans:
        entry = {
            "stage": plan.stage, "kind": plan.kind, "model": plan.model,
            "shape": {k: v for k, v in asdict(plan.shape).items() if k != "source"} | {"n_params": plan.shape.n_params,
                                                                                        "source": plan.shape.source},
            "settings": asdict(plan.knobs),
            "gpu": plan.hardware.gpu.name if plan.hardware.gpu else None,
            "processes": plan.world, "trained_params": plan.trained_params, "total_params": plan.total_params,
            **_estimate_json(plan.estimate),
            "warnings": plan.warnings,
            "suggestions": [_suggestion_json(s) for s in plan.suggestions],
            "without": [_suggestion_json(s) for s in plan.without],
        }
        stages.append(entry)
    return {"fits": all(p.fits is not False for p in plans), "stages": stages}
