"""GPU memory per process and host RAM per node of one stage, itemised.

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
                ZeRO-0 bf16 4*N; ZeRO-1/2 4*N/W plus the flat b*N/W copy it is made
                from (measured, _fragmentation; with LoRA's single parameter
                group the b*N/W partition is freed as it is made); ZeRO-3 4*N/W per
                sub-group of about 1e9 elements, and it releases the persistent
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
  two with overlap_comm; no more than the model trains: LoRA's are its adapters' size), and on GPUs a second
  gradient partition kept on the reduction
  stream; ZeRO-3 one persistent bucket, the gathered weights of
  the layer being computed plus the prefetched next one, and that layer's full
  gradients before they are reduce-scattered.
- activations, the attention mask and logits of a micro batch: see
  pipeline/plan/activations.py.
- context: the CUDA context and libraries outside PyTorch's allocator, 1.5 GiB (nvidia-smi's
  peak minus torch's reserved peak on the GPU records).
- workspace: what the caching allocator reserves beyond what is allocated (_fragmentation).
- host RAM: 3 GiB per GPU process (Python, torch, CUDA and NCCL libraries), the
  offloaded states, the checkpointed layer inputs with checkpoint_offload (pinned; pipeline/plan/
  activations.py), an offloaded reference model, and at start-up the model
  being loaded (whole per process unless ZeRO-3 shards it while loading).
- frozen models (DPO reference; PPO reference and reward model), as
  stages/models.py FrozenModel holds them: live = bf16 weights sharded like the
  policy under ZeRO-3, whole otherwise; offload = in host RAM (ZeRO-3 parameter
  offload: a 1/W shard per process; otherwise a whole copy per process, moved
  onto the GPU for each forward); precompute = nothing while training.
- PPO generation: the KV cache (layers x (k + v width) x b per token) and, under
  ZeRO-3, the whole actor gathered for the rollout (stages/ppo.py does that).

Phases: memory is the sum of what is always resident plus the largest phase (a trained model's
backward through the loss and backward through the layers, a frozen model's forward, the
optimizer step, generation). The GPU peak is what torch reserves plus the context: the GPU
records (benchmarks/gpu/records.py) hold it to -5%..+10% of the measured reserved peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.deepspeed_settings import (
    FROZEN_PREFETCH_ELEMENTS,
    MAX_LIVE_PARAMETERS,
    SUB_GROUP_SIZE,
    bucket_elements,
    persistence_threshold,
    reduce_bucket_elements,
)
from core.shapes import ModelShape
from pipeline.plan import rollout_engine
from pipeline.plan.activations import checkpointed_inputs, frozen_forward, held_while_reference_runs, trained_pass
from pipeline.plan.inputs import Generation, GiB, Hardware, Knobs, ModelUse, Workload, attention_kernel

# nvidia-smi's peak minus torch's reserved peak on the records (H100 and H200, CUDA 13): 1.3-1.7 GiB.
CUDA_CONTEXT_BYTES = 1.5 * GiB
FRAGMENTATION = 0.08
PROCESS_HOST_BYTES = 3 * GiB  # a GPU training process's own resident memory
CPU_PROCESS_HOST_BYTES = 1 * GiB  # the same without CUDA libraries
CHECKPOINT_SHARD_BYTES = 10 * GiB  # host memory a ZeRO-3 process holds while loading (one shard file)


@dataclass(frozen=True)
class Item:
    """One line of the estimate. GPU bytes are per GPU; host bytes per process unless scope='node'."""

    name: str
    # weights | gradients | optimizer | buffers | activations | logits | workspace | context | runtime | loading
    category: str
    where: str  # gpu | host
    # always | loading | "<role> backward through the loss|layers" | "<role> forward" | optimizer step | generation
    phase: str
    bytes: int
    scope: str = "process"


@dataclass
class Memory:
    items: list[Item]
    processes_per_node: int
    gpu_capacity: int | None
    host_capacity: int | None
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
    def gpu_headroom(self) -> int | None:
        return None if self.gpu_capacity is None else self.gpu_capacity - self.gpu_peak

    @property
    def host_headroom(self) -> int | None:
        return None if self.host_capacity is None else self.host_capacity - self.host_peak

    @property
    def fits(self) -> bool | None:
        """True/False when there is something to compare with; None when nothing is known."""
        checks = [h >= 0 for h in (self.gpu_headroom, self.host_headroom) if h is not None]
        return all(checks) if checks else None

    def per_process(self, categories, phases=("always",)) -> int:
        """Bytes one process holds (GPU + host) in the given categories and phases."""
        return sum(i.bytes for i in self.items
                   if i.scope == "process" and i.category in categories and i.phase in phases)


# --------------------------------------------------------------------------- shared pieces


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def trainable_tensors(use: ModelUse, knobs: Knobs) -> tuple[list[int], list[int]]:
    """(trained tensor sizes, frozen tensor sizes) of a model."""
    base = use.shape.parameter_tensors(use.head)
    if not use.trained:
        return [], base
    trained = use.shape.trained_tensors(use.head, knobs.lora_rank, knobs.lora_targets)
    return (trained, base) if knobs.lora_rank else (trained, [])


def largest_sub_group(partitions: list[int]) -> int:
    """Elements of ZeRO-3's largest optimizer sub-group, whose fp32 gradients exist while it
    steps: DeepSpeed (stage3.py _create_fp16_sub_groups) adds tensors' partitions in model
    order and closes a sub-group once it holds sub_group_size elements or more, so one can
    exceed it by almost a whole partition (CodeLlama-34B on 8 GPUs: 1.019e9 elements).
    The project's no-decay group (norms) shifts the boundaries by a few thousand elements."""
    largest = current = 0
    for n in partitions:
        current += n
        if current >= SUB_GROUP_SIZE:
            largest, current = max(largest, current), 0
    return max(largest, current)


def _gathered_params(shape: ModelShape, head: str, bucket: int) -> int:
    """Elements ZeRO-3 holds gathered at once: the current layer (or the biggest single
    tensor, e.g. an lm_head) plus the prefetched next one, within max_live_parameters."""
    largest = max(shape.layer_params, max(shape.parameter_tensors(head)))
    return min(MAX_LIVE_PARAMETERS, largest + min(bucket, shape.layer_params))


@dataclass
class _Ledger:
    """The items of one estimate as they are added, and what each phase adds on the device."""

    knobs: Knobs
    workload: Workload
    world: int
    on_gpu: bool
    items: list[Item] = field(default_factory=list)
    phase_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "gpu" if self.on_gpu else "host"

    def kernel(self, shape: ModelShape) -> str:
        return attention_kernel(self.knobs.attention, self.on_gpu, shape)

    @property
    def shard_note(self) -> str:
        return f"1/{self.world} shard" if self.world > 1 else "whole"

    def add(self, name, category, where, phase, amount, scope="process"):
        """Record an item; negative amounts are memory a phase frees (only ZeRO-3's step does)."""
        amount = int(math.ceil(amount))
        if amount > 0 or (amount < 0 and phase == "optimizer step"):
            self.items.append(Item(name, category, where, phase, amount, scope))
            if phase not in ("always", "loading") and where == self.device:
                self.phase_bytes[phase] = self.phase_bytes.get(phase, 0) + amount

    def sharded(self, tensors: list[int], nbytes: int, threshold: int) -> tuple[float, float]:
        """(partition bytes, whole-copy bytes of persistent tensors) under ZeRO-3."""
        shard = sum(_ceil_div(n, self.world) for n in tensors) * nbytes
        persistent = sum(n for n in tensors if n <= threshold) * nbytes
        return shard, persistent


# --------------------------------------------------------------------------- the estimate


def estimate_memory(models: list[ModelUse], workload: Workload, knobs: Knobs, hw: Hardware) -> Memory:
    """Itemised memory of a stage that holds `models` and trains on `workload`."""
    ledger = _Ledger(knobs, workload, knobs.nodes * hw.processes_per_node, hw.on_gpu)
    for use in models:
        if not use.trained:
            _frozen_model(ledger, use)
        else:
            _trained_model_states(ledger, use)
            _trained_model_passes(ledger, use)
    if workload.generation is not None:
        _generation(ledger, models, hw, workload.generation)
    _workspace_and_host(ledger, models)
    capacity_gpu = hw.gpu_memory_bytes if hw.on_gpu else None
    return Memory(ledger.items, hw.processes_per_node, capacity_gpu, hw.host_memory_bytes, hw.host_memory_source)


def _frozen_model(ledger: _Ledger, use: ModelUse) -> None:
    """A reference or reward model: its weights where its placement keeps them, and its forward."""
    if use.placement == "precompute":
        return
    knobs, device, add = ledger.knobs, ledger.device, ledger.add
    shape, role, b = use.shape, use.role, knobs.weight_bytes
    _, frozen = trainable_tensors(use, knobs)
    threshold = persistence_threshold(shape.hidden)
    prec, z = knobs.precision, knobs.zero_stage
    fwd_phase = f"{role} forward"
    total = sum(frozen) * b
    gathered = _gathered_params(shape, use.head, FROZEN_PREFETCH_ELEMENTS) * b
    if use.placement == "live":
        if z == 3:
            shard, persistent = ledger.sharded(frozen, b, threshold)
            add(f"{role} weights ({prec}, frozen, {ledger.shard_note})", "weights", device, "always",
                shard + persistent)
            add(f"{role} gathered layers", "buffers", device, fwd_phase, gathered)
        else:
            add(f"{role} weights ({prec}, frozen, whole)", "weights", device, "always", total)
    else:  # offload: kept in host RAM, brought in for its forward
        if z == 3:
            shard, persistent = ledger.sharded(frozen, b, threshold)
            add(f"{role} weights offloaded ({prec}, {ledger.shard_note})", "weights", "host", "always", shard)
            add(f"{role} gathered layers", "buffers", device, fwd_phase, gathered + persistent)
        else:
            add(f"{role} weights offloaded ({prec}, whole copy per process)", "weights", "host", "always", total)
            add(f"{role} weights moved in for its forward", "weights", device, fwd_phase, total)
    passes = frozen_forward(use, knobs, ledger.workload, ledger.kernel(shape))
    if not knobs.stage_kind.rollouts:  # it runs between the policy's forward and backward on the same rows
        policy = ModelUse("policy", shape, "lm")
        passes += held_while_reference_runs(policy, knobs, ledger.workload, ledger.kernel(shape))
    for name, category, amount in passes:
        add(name, category, device, fwd_phase, amount)


def _trained_model_states(ledger: _Ledger, use: ModelUse) -> None:
    """A trained model's weights, gradients, optimizer states and ZeRO's buffers."""
    trained, frozen = trainable_tensors(use, ledger.knobs)
    _trained_weights(ledger, use, trained, frozen)
    _gradients_and_optimizer_states(ledger, use, trained)
    _communication_buffers(ledger, use, sum(trained))


def _trained_weights(ledger: _Ledger, use: ModelUse, trained: list[int], frozen: list[int]) -> None:
    """A trained model's weights: ZeRO-3's shards and whole small tensors, else the whole model."""
    knobs, device, add, role, b = ledger.knobs, ledger.device, ledger.add, use.role, ledger.knobs.weight_bytes
    prec, shard_note = knobs.precision, ledger.shard_note
    lora_note = f", LoRA r={knobs.lora_rank}" if knobs.lora_rank else ""
    if knobs.zero_stage == 3:
        threshold = persistence_threshold(use.shape.hidden)
        shard, persistent = ledger.sharded(frozen, b, threshold)
        a_shard, a_persistent = ledger.sharded(trained, b, threshold)
        add(f"{role} weights ({prec}{lora_note}, {shard_note} + small tensors whole)", "weights", device,
            "always", shard + persistent + a_shard + a_persistent)
        # DeepSpeed releases even the persistent tensors' whole copies before the optimizer step.
        add(f"{role} small tensors' whole copies, released for the step", "weights", device,
            "optimizer step", -(persistent + a_persistent))
    else:
        add(f"{role} weights ({prec}{lora_note}, whole)", "weights", device, "always",
            (sum(frozen) + sum(trained)) * b)


def _gradients_and_optimizer_states(ledger: _Ledger, use: ModelUse, trained: list[int]) -> None:
    """A trained model's gradients, fp32 master weights and Adam states, and the step's temporaries,
    by ZeRO stage and optimizer offload."""
    knobs, device, add, world, role = ledger.knobs, ledger.device, ledger.add, ledger.world, use.role
    b, z, off, prec = knobs.weight_bytes, knobs.zero_stage, knobs.offloads, knobs.precision
    shard_note = ledger.shard_note
    n_trained = sum(trained)
    per_rank = n_trained / world if z >= 1 else n_trained
    if z == 3:
        per_rank = sum(_ceil_div(n, world) for n in trained)
    where = "host" if off else device
    if z == 0:
        add(f"{role} gradients ({prec}, whole)", "gradients", device, "always", n_trained * b)
        if prec == "fp32":
            add(f"{role} Adam m, v (fp32, whole)", "optimizer", device, "always", 8 * n_trained)
        else:
            add(f"{role} fp32 master + Adam m, v (whole)", "optimizer", device, "always", 12 * n_trained)
            add(f"{role} fp32 gradients for the step", "gradients", device, "optimizer step", 4 * n_trained)
    else:
        if z == 3 or not off:  # ZeRO-1/2 offload accumulate straight into the host fp32 partition
            add(f"{role} gradients ({prec}{', host' if off else ''}, {shard_note})",
                "gradients", where, "always", per_rank * b)
        if off:
            add(f"{role} fp32 gradients (host, {shard_note})", "gradients", "host", "always", 4 * per_rank)
            if z < 3:
                add(f"{role} {prec} staging copy (host, {shard_note})", "buffers", "host", "always", per_rank * b)
                largest = max(trained) if trained else 0
                add(f"{role} gradient transfer buffer (largest tensor)", "buffers", device, "always", largest * b)
                add(f"{role} gradient transfer buffer (host, largest tensor)", "buffers", "host", "always", largest * b)
        elif z == 3:
            add(f"{role} fp32 gradients for the step (per sub-group)", "gradients", device, "optimizer step",
                4 * largest_sub_group([_ceil_div(n, world) for n in trained]))
        elif knobs.lora_rank:
            # One parameter group (adapters are all matrices): its low-precision partition is
            # freed as the fp32 copy is made. Full models keep it, viewed by the norms' group.
            add(f"{role} fp32 gradients for the step (replacing the {prec} partition)", "gradients", device,
                "optimizer step", (4 - b) * per_rank)
        else:
            # DeepSpeed 0.19.8's step flattens the partition into a new tensor and copies that to
            # fp32: in bf16/fp16 both are alive at once, and the flat one is freed before Adam runs,
            # its block still reserved (measured, _fragmentation); in fp32 the copy is the flat
            # tensor itself (.to() of the same dtype).
            add(f"{role} fp32 gradients for the step", "gradients", device, "optimizer step", 4 * per_rank)
            if b != 4:
                add(f"{role} flat {prec} gradient partition the step makes first (freed before Adam, "
                    f"its block still reserved)", "workspace", device, "optimizer step", b * per_rank)
            if ledger.on_gpu:
                add(f"{role} second {prec} gradient partition, reduction stream (overlap_comm), kept cached",
                    "workspace", device, "always", b * per_rank)
        add(f"{role} fp32 master + Adam m, v ({'host, ' if off else ''}{shard_note})", "optimizer", where,
            "always", 12 * per_rank)


def _communication_buffers(ledger: _Ledger, use: ModelUse, n_trained: int) -> None:
    """A trained model's gradient buckets (stages/engine.py sizes them from what trains), and ZeRO-3's
    gathers and prefetches of every weight."""
    knobs, device, add, role, shape = ledger.knobs, ledger.device, ledger.add, use.role, use.shape
    b, z, off = knobs.weight_bytes, knobs.zero_stage, knobs.offloads
    bucket, gradient_bucket = bucket_elements(ledger.on_gpu), reduce_bucket_elements(ledger.on_gpu, n_trained)
    if z == 3:
        add(f"{role} gradient bucket", "buffers", device, "always", gradient_bucket * b)
        gathered = _gathered_params(shape, use.head, bucket) * b
        add(f"{role} gathered layers", "buffers", device, loss_phase(role), gathered)
        add(f"{role} gathered layers", "buffers", device, layers_phase(role), gathered)
        trained_layer = (shape.lora_layer_params(knobs.lora_rank, knobs.lora_targets)
                         if knobs.lora_rank else shape.layer_params)
        add(f"{role} one layer's full gradients", "buffers", device, layers_phase(role), trained_layer * b)
    elif z in (1, 2):
        # Allocated at the first gradient's hook, after the loss's backward freed the logits, and
        # released when the backward ends; overlap_comm double-buffers on GPUs (stages/engine.py).
        buckets = gradient_bucket * b * (2 if ledger.on_gpu else 1)
        add(f"{role} gradient buckets", "buffers", device, layers_phase(role), buckets)
        if ledger.on_gpu and not off and not knobs.lora_rank:
            add(f"{role} the gradient bucket pair's freed blocks, cached apart from the step's tensors", "workspace",
                device, "optimizer step", buckets)


def loss_phase(role: str) -> str:
    return f"{role} backward through the loss"


def layers_phase(role: str) -> str:
    return f"{role} backward through the layers"


def _trained_model_passes(ledger: _Ledger, use: ModelUse) -> None:
    """What a trained model's forward and backward hold at their two largest moments (and, with
    checkpoint_offload, in host memory through them)."""
    knobs = ledger.knobs
    at_loss, in_layers = trained_pass(use, knobs, ledger.workload, ledger.kernel(use.shape))
    for phase, items in ((loss_phase(use.role), at_loss), (layers_phase(use.role), in_layers)):
        for name, category, amount in items:
            ledger.add(name, category, ledger.device, phase, amount)
    if knobs.checkpoint_offload:
        inputs = checkpointed_inputs(use.shape, knobs, ledger.workload.train_tokens(knobs))
        ledger.add(f"{use.role} checkpointed layer inputs (pinned host memory, checkpoint_offload)", "activations",
                   "host", layers_phase(use.role), inputs)


def _generation(ledger: _Ledger, models: list[ModelUse], hw: Hardware, gen: Generation) -> None:
    """PPO rollouts: the actor's KV cache and logits, and under ZeRO-3 the actor gathered whole
    (vLLM: _vllm_engine)."""
    actor = next((m for m in models if m.trained and m.head == "lm"), None)
    if actor is None:
        return
    if ledger.knobs.samples_with_vllm and ledger.on_gpu and hw.gpu_memory_bytes:
        _vllm_engine(ledger, actor, hw, gen)
        return
    s, b, device = actor.shape, ledger.knobs.weight_bytes, ledger.device
    length = gen.prompt_len + gen.new_tokens
    ledger.add("KV cache for generation", "activations", device, "generation",
               s.layers * (s.kv_width + s.v_width) * b * gen.batch * length)
    ledger.add("generation logits", "logits", device, "generation", gen.batch * s.vocab * 4)
    if ledger.knobs.zero_stage == 3:  # stages/ppo.py gathers the whole actor once per rollout, not per token
        ledger.add("actor weights gathered whole for generation", "weights", device, "generation", s.n_params * b)


def vllm_engine_memory(actor: ModelUse, knobs: Knobs, hw: Hardware, gen: Generation) -> rollout_engine.EngineMemory:
    """One process's part of its vLLM engine (pipeline/plan/rollout_engine.py), for a stage that samples
    with vLLM on a GPU of known memory (the planner counts and times an engine only there)."""
    n, gpu_bytes = knobs.vllm_tensor_parallel, hw.gpu_memory_bytes
    assert n is not None and gpu_bytes, "a vLLM engine is planned where it samples on a GPU of known memory"
    return rollout_engine.engine_memory(actor.shape, knobs.weight_bytes, n, knobs.vllm_memory_share, gpu_bytes,
                                        gen.prompt_len + gen.new_tokens)


def _vllm_engine(ledger: _Ledger, actor: ModelUse, hw: Hardware, gen: Generation) -> None:
    """The vLLM engine's share of the GPU (pipeline/plan/rollout_engine.py): all the time, or only
    at generation where it sleeps while the actor trains; a ZeRO-3 sync gathers one module at a time."""
    knobs, engine = ledger.knobs, vllm_engine_memory(actor, ledger.knobs, hw, gen)
    n = engine.tensor_parallel
    phase = "generation" if knobs.vllm_sleep else "always"
    ledger.add(f"vLLM engine: 1/{n} of the actor's weights (tensor_parallel {n})", "weights", "gpu", phase,
               engine.weights)
    holds = (f"{engine.sequences} sequences of {gen.prompt_len + gen.new_tokens} tokens" if engine.sequences else
             f"NO sequence of {gen.prompt_len + gen.new_tokens} tokens: vLLM will not start; raise "
             f"vllm.gpu_memory_utilization or vllm.tensor_parallel")
    ledger.add(f"vLLM engine: KV cache, the rest of gpu_memory_utilization {knobs.vllm_memory_share:g} ({holds})",
               "activations", "gpu", phase, engine.kv_cache)
    if knobs.zero_stage == 3:
        ledger.add("actor's largest module gathered whole for the weight sync", "weights", "gpu", "generation",
                   engine.sync_module)


def _workspace_and_host(ledger: _Ledger, models: list[ModelUse]) -> None:
    """CUDA context and the caching allocator's fragmentation, each process's own host memory, and loading."""
    knobs = ledger.knobs
    z, b = knobs.zero_stage, knobs.weight_bytes
    if ledger.on_gpu:
        ledger.add(f"CUDA context and libraries, outside PyTorch's allocator ({CUDA_CONTEXT_BYTES / GiB:.1f} GiB)",
                   "context", "gpu", "always", CUDA_CONTEXT_BYTES)
        _fragmentation(ledger, models)
    ledger.add("process runtime (Python, torch, CUDA libraries)", "runtime", "host", "always",
               PROCESS_HOST_BYTES if ledger.on_gpu else CPU_PROCESS_HOST_BYTES)
    loading = 0
    for use in models:
        if use.trained or use.placement != "precompute":
            whole = use.shape.params_with_head(use.head) * b
            loading = max(loading, min(whole, CHECKPOINT_SHARD_BYTES) if z == 3 else whole)
    if ledger.on_gpu:
        ledger.add("model weights while loading" + (" (one checkpoint shard, ZeRO-3)" if z == 3 else " (whole model)"),
                   "loading", "host", "loading", loading)


def _fragmentation(ledger: _Ledger, models: list[ModelUse]) -> None:
    """What PyTorch's caching allocator reserves beyond what is allocated (its reserved peak).

    - FRAGMENTATION of the largest phase's allocations: blocks split and cached as a micro
      batch's tensors come and go.
    - ZeRO-1/2 stepping on the GPU (full fine-tune), measured on the H100 on 2026-11-26 with an
      allocator probe (benchmarks/gpu/stepmem_session.sh; benchmarks/results/h100-2026-11-26/
      stepmem/; the 1B, one process, expandable segments as stages/distributed.py sets them):
      DeepSpeed 0.19.8's step flattens the bf16 partition into a new tensor (b*N/W, 2.30 GiB),
      copies it to fp32 (4*N/W, 4.60 GiB), frees the flat copy, and at the first step torch's
      AdamW creates m and v (8*N/W) after them; the fp32 copy is freed at the step's end. So the
      first step leaves a 6*N/W hole (flat + fp32) under m and v, and every later step puts its
      flat and fp32 tensors into that hole again (no byte newly reserved at steps 2 and 3 in any
      of six cases); the forward and backward reuse it too (without checkpointing fully: 39.53 GiB
      = 16.18 resting + 18.72, the first step's activation footprint, + 4.61). The step does not
      stack on the passes' freed blocks, as this function planned before (+6..+7% on the cases
      without checkpointing and DPO with a live reference); it costs the states + (b+4)*N/W, the
      two step items of _trained_model_states. Besides, on the reduction stream (overlap_comm)
      a segment of two bf16 partitions (4.61 GiB in all six) stays reserved: the gradients and a
      second partition-sized buffer made at the second micro batch (counted in _trained_model_states;
      every ZeRO-1/2 record accumulates 2 or 8 micro batches, 1 is not measured). And the freed
      blocks of the gradient bucket pair (2 x 0.93 GiB, every backward) may sit in a segment of
      their own, apart from the step's larger tensors: micro batch 4 held a 1.97 GiB main-stream
      segment with them and the logits (reserved peak 29.81 = 23.22 + 4.61 + 1.97), micro batch 2
      had them in the main segment's tail, where the step used them (28.01 = 23.40 + 4.61).
      Counted, on the safe side, in the step phase (_trained_model_states). Not counted: a later step's activations that
      do not fit the hole (micro batch 8: 1.5 GiB of its 6.9 left unused, and a 0.39 GiB side
      segment; planned -4.1%).
      Reserved peaks under the probe, micro batch 2 / 4 / 8 / no checkpointing / DPO live /
      DPO precompute: 28.02 / 29.81 / 32.04 / 39.53 / 34.91 / 32.35 GiB (the records: 28.0 /
      29.8 / 32.3 / 39.5 / 35.1 / 32.3). The first step sets the peak at micro batch 2 and 4,
      a later step's forward and backward at 8, without checkpointing and in DPO.
    - ZeRO-3 stepping on the GPU: the optimizer step allocates new segments while the forward
      and backward's freed blocks stay cached, so the step phase reserves the largest
      forward/backward phase besides them (the flat fp32 gradient partition of a sub-group, one
      tensor larger than any block freed before; not re-measured with the probe). Under ZeRO-3
      with optimizer offload, a copy of the trained layers' weight partitions too (the 34B slice's
      reserved peak grew by 2x a layer's bf16 weights per layer, its allocated peak by 1x: one
      process, 1 and 2 layers; why is not known, and at several processes it is planned as the
      1/W partition, which no record has checked). Per-tensor buffers (ZeRO-0) and LoRA's small
      ones reuse the cache.
    Fitted to the GPU records (benchmarks/gpu/records.py)."""
    knobs, phases = ledger.knobs, ledger.phase_bytes
    largest = max(phases.values(), default=0)
    step = "optimizer step"
    new_segments = 0
    if knobs.zero_stage == 3 and not knobs.offloads and not knobs.lora_rank and step in phases:
        new_segments = sum(i.bytes for i in ledger.items if i.phase == step and i.category == "gradients")
    if knobs.zero_stage == 3 and knobs.offloads:
        new_segments += _offloaded_step_weight_copy(ledger, models)
    if new_segments:
        passes = max((v for p, v in phases.items() if p not in (step, "generation")), default=0)
        cached = passes - (phases.get(step, 0) - new_segments)
        ledger.add("forward/backward blocks still cached while the step allocates", "workspace", "gpu", step, cached)
    ledger.add(f"allocator fragmentation: {FRAGMENTATION:.0%} of the largest phase", "workspace", "gpu",
               "always", FRAGMENTATION * largest)


def _offloaded_step_weight_copy(ledger: _Ledger, models: list[ModelUse]) -> int:
    """ZeRO-3 with optimizer offload: the trained layers' weight partitions the step copies onto the
    GPU (see _fragmentation), added to the step phase; their bytes."""
    knobs = ledger.knobs
    trained = [use for use in models if use.trained]
    layers = sum(use.shape.decoder_params if not knobs.lora_rank else
                 use.shape.lora_params(knobs.lora_rank, knobs.lora_targets) for use in trained)
    copy = _ceil_div(layers, ledger.world) * knobs.weight_bytes
    ledger.add("ZeRO-3 with offload: the trained layers' weight partitions, copied in by the step", "workspace",
               "gpu", "optimizer step", copy)
    return copy
