"""Time per optimizer step (or PPO rollout) and in total of one stage.

step = GPU compute + optimizer step + exposed communication + offload (+ PPO generation)

Each term is work x a rate (pipeline/plan/rates.py says where each rate comes from: the
user's calibration file, a fit to the GPU runs on record, the datasheet, or a published
default), so a term that is wrong can be found and measured on its own:

- GPU compute, micro batch by micro batch on the process with the most work (processes step
  in lockstep), over the micro batches pipeline/plan/batches.py simulates from the data's
  sampled lengths (PPO: every sequence max_len long):
    matmuls     2 FLOPs per matmul parameter per position of the batch tensor (padding
                included; of a mixture of experts' layer, the router and the k experts
                each token goes through), x1 forward, x2 backward (LoRA: x1, the frozen weights need no
                gradient), x1 more for gradient checkpointing's recompute; at the matmul rate
    attention   2 x layers x (q + output width) per query-key pair the kernel computes (whole lines under
                sdpa/eager masks, each sequence's own with flash), same pass multiples; at the
                kernel's share of the datasheet peak
    tiled MLP   (mlp_tiles) the MLP's matmuls once more in the backward, where it reruns each
                tile (ZeRO-3's gathers and hooks for each tile's call are not counted)
    the loss    logits (positions x vocabulary) through the loss forward and backward, at
                bytes per logit through GPU memory
    ZeRO-3      its fetch and release hooks: a fixed cost per layer and pass (forward,
                recompute, backward x2)
    LoRA        the adapters' element-wise work per adapted feature and pass
  A frozen model (live or offloaded reference, reward model) adds one forward.
- optimizer step on the GPU (ZeRO-0/1/2 without offload): bytes per trained parameter each
  process steps, at GPU memory bandwidth.
- optimizer offload: the host's Adam on each process's partition at the process's rate (its
  share of the node's cores), and the PCIe copies (gradients down each micro batch, weights up
  each step). checkpoint_offload: every layer's checkpointed input down in the forward and up for
  its recompute, each micro batch, on the compute stream (exposed).
- communication (ring: (W-1)/W of the bytes per GPU) over the GPU links or the inter-node
  network, hidden behind at most half the compute.
- sequence parallel (N > 1, stages/sequence_parallel.py): each process computes 1/N of its
  group's micro batch (1/N of the positions; attention over the whole lines for 1/N of the
  heads), and in every attention layer Ulysses' all-to-alls exchange q, k, v and the output:
  per process and exchange, its positions x the tensor's width x bytes per value x (N-1)/N;
  4 exchanges forward, 4 backward, 4 more for checkpointing's recompute; over the GPU links
  when N <= GPUs per node, else the network. Attention waits for them: all exposed.
- PPO generation: memory-bound decoding (every weight read once per new token per call).

MFU, tokens_per_s, token_efficiency and step_s mean what the running stage logs under those
names (stages/engine.py Window): model FLOPs (flops.sequence_flops of the real sequences: no
recompute, no padding) / (step_s x processes x peak); real tokens / step_s over all processes;
real / processed tokens. `hfu` is the executed FLOPs over compute_s x peak: the GPU's busy
share the model implies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.batching import rows_per_step
from core.flops import (
    attention_flops,
    forward_flops_per_token,
    matmul_flops_per_position,
    pass_flops,
    sequence_flops,
)
from core.shapes import ModelShape
from pipeline.plan import rates as rate_table
from pipeline.plan import rollout_engine
from pipeline.plan.batches import Batches
from pipeline.plan.inputs import Generation, Hardware, Knobs, ModelUse, Workload, attention_kernel
from pipeline.plan.memory import trainable_tensors, vllm_engine_memory

COMM_OVERLAP = 0.5
# Passes a trained layer makes per micro batch, in units of one forward: the backward launches
# about twice the forward's kernels.
BACKWARD_PASSES = 2


@dataclass
class GPUWork:
    """What one process computes per unit of work, in the units the rates apply to."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    logits: float = 0.0  # logit elements x passes through the loss
    layer_passes: float = 0.0
    lora_elements: float = 0.0  # positions x layer passes x the adapted layers' in + out features
    exchanged_bytes: float = 0.0  # sequence parallel: what Ulysses' all-to-alls send from this process
    checkpoint_bytes: float = 0.0  # checkpoint_offload: the layer inputs copied to the host and back

    def add(self, other: GPUWork, times: float = 1.0) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + times * getattr(other, name))


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
    hfu: float  # matmul + attention FLOPs executed / (compute_s x peak): the GPU's busy share in compute
    compute_s: float
    optimizer_s: float
    communication_s: float  # ZeRO's collectives and sequence_exchange_s
    exposed_communication_s: float
    offload_s: float
    step_s: float
    mfu: float
    tokens_per_s: float
    token_efficiency: float | None  # real / processed tokens; None for PPO (not modelled)
    seconds_per_1000_rows: float
    precompute_s_per_1000_rows: float = 0.0
    sequence_exchange_s: float = 0.0  # sequence parallel: the all-to-alls' seconds (all exposed)
    rows: int | None = None
    steps: int | None = None
    total_s: float | None = None
    # compute_s by term (matmul, attention, loss, ZeRO-3 hooks, LoRA), and where each rate came from
    compute_terms: dict = field(default_factory=dict)
    calibration: str | None = None  # "calibrated on <node>, <date>" when a calibration file gave rates
    # the work the rates were applied to (the busiest process's GPUWork, the parameters its
    # optimizer steps on the GPU or the host, the host copies' seconds): what a fit regresses on
    work: dict = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
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
    busiest: GPUWork  # the busiest process, micro batch by micro batch
    model: float
    precompute: GPUWork = field(default_factory=GPUWork)  # a precomputed reference's forwards, all processes


def rates_for(knobs: Knobs, hw: Hardware, models: list[ModelUse], workload: Workload) -> rate_table.Rates:
    """The rates of this stage's GPU (a calibration file's where the node was measured), at the
    shapes its trained model multiplies."""
    trained = next((use for use in models if use.trained), models[0])
    assert hw.gpu is not None, "rates are those of a known GPU (estimate_time returns None without one)"
    return rate_table.built_in(hw.gpu, knobs.precision, hw.cores_per_process, hw.calibration, trained.shape,
                               workload.train_tokens(knobs))


def compute_seconds(work: GPUWork, rates: rate_table.Rates, kernel: str, zero_stage: int) -> dict:
    """Seconds of each compute term of `work`."""
    return {
        "matmul": work.matmul_flops / rates.matmul.value,
        "attention": work.attention_flops / (rates.peak_flops * rates.attention(kernel).value),
        "loss": work.logits * rates.loss_bytes_per_logit.value / rates.hbm_bytes_per_s.value,
        "ZeRO-3 hooks": work.layer_passes * rates.zero3_layer_pass_s.value if zero_stage == 3 else 0.0,
        "LoRA": work.lora_elements * rates.lora_bytes_per_element.value / rates.hbm_bytes_per_s.value,
    }


def estimate_time(models: list[ModelUse], workload: Workload, knobs: Knobs, hw: Hardware,
                  rows: int | None = None, batches: Batches | None = None) -> TimeEstimate | None:
    """Step time and total time; None without a known GPU (nothing to compare with).

    The unit of work is one optimizer step (SFT, RM, DPO: over `batches`, the
    simulated micro batches) or one rollout (PPO: generate, score, then train_passes
    passes of optimizer steps over it).
    """
    if not hw.on_gpu or hw.gpu is None:
        return None
    rates = rates_for(knobs, hw, models, workload)
    trained = next((use for use in models if use.trained), models[0])
    kernel = attention_kernel(knobs.attention, hw.on_gpu, trained.shape)
    world = knobs.nodes * hw.processes_per_node
    notes = _rate_caveats(models, knobs, hw.gpu)
    ring = (world - 1) / world if world > 1 else 0.0
    bandwidth = link_bandwidth(rates, hw, across_nodes=knobs.nodes > 1)
    rollout = workload.rows_per_rollout is not None
    work = _unit_work(models, workload, knobs, world, batches, rates, kernel)
    traffic = _traffic(models, knobs, work, world, ring)
    terms = compute_seconds(work.busiest, rates, kernel, knobs.zero_stage)
    compute_s = sum(terms.values())
    step_bytes = rates.step_bytes_per_param[min(knobs.zero_stage, 2)].value
    optimizer_s = traffic.gpu_stepped * step_bytes / rates.hbm_bytes_per_s.value
    comm_s = traffic.comm_bytes / bandwidth if world > 1 else 0.0
    exposed = max(0.0, comm_s - COMM_OVERLAP * compute_s)
    exchange_s = _sequence_exchange_s(work, knobs, hw, rates, notes)
    comm_s += exchange_s  # attention waits for sequence parallel's exchanges: all exposed
    exposed += exchange_s
    copies_s = (traffic.offload_bytes + work.busiest.checkpoint_bytes) / rates.host_link_bytes_per_s.value
    offload_s = copies_s + traffic.host_adam_params / rates.host_adam_params_per_s.value
    unit_s = compute_s + optimizer_s + exposed + offload_s
    if rollout:
        unit_s += _generation_s(models, workload, knobs, rates, world, ring, bandwidth, hw)
        notes.append(_generation_note(knobs))
    precompute_s = sum(compute_seconds(work.precompute, rates, kernel, knobs.zero_stage).values()) / world
    pre_per_1000 = precompute_s / work.rows * 1000
    steps, total = _steps_and_total(rows, knobs, work, unit_s, pre_per_1000)
    peak = rates.peak_flops
    busiest_flops = work.busiest.matmul_flops + work.busiest.attention_flops
    return TimeEstimate(
        unit="rollout" if rollout else "optimizer step", rows_per_step=work.rows, tokens_per_step=work.real_tokens,
        processed_tokens_per_step=work.processed_tokens, micro_batches_per_step=work.train_micro,
        flops_per_token=work.executed / work.real_tokens, model_flops_per_token=work.model / work.real_tokens,
        hfu=busiest_flops / (compute_s * peak) if compute_s else 0.0, compute_s=compute_s, optimizer_s=optimizer_s,
        communication_s=comm_s, exposed_communication_s=exposed,
        offload_s=offload_s, step_s=unit_s, mfu=work.model / (unit_s * world * peak),
        tokens_per_s=work.real_tokens / unit_s,
        token_efficiency=None if rollout else work.real_tokens / work.processed_tokens,
        seconds_per_1000_rows=unit_s * 1000 / work.rows + pre_per_1000, precompute_s_per_1000_rows=pre_per_1000,
        sequence_exchange_s=exchange_s, rows=rows,
        steps=steps, total_s=total, compute_terms=terms,
        work={**vars(work.busiest), "gpu_stepped_params": traffic.gpu_stepped,
              "host_adam_params": traffic.host_adam_params, "host_copies_s": copies_s},
        sources=rates.sources(kernel, knobs.zero_stage, knobs.offloads, world, bool(knobs.lora_rank)),
        calibration=rates.calibration,
        notes=notes,
    )


def _unit_work(models: list[ModelUse], workload: Workload, knobs: Knobs, world: int, batches: Batches | None,
               rates: rate_table.Rates, kernel: str) -> _Work:
    """The work of one unit: a rollout (PPO), or an optimizer step over the simulated batches."""
    if workload.rows_per_rollout is not None:
        return _rollout_work(models, workload, knobs, world)
    assert batches is not None, "a stage that trains on its rows is timed over its simulated batches"
    return _step_work(models, knobs, batches, rates, kernel)


def _rate_caveats(models: list[ModelUse], knobs: Knobs, gpu) -> list[str]:
    """What the rates cannot time as they run: experts' products, bf16 without bf16 tensor cores."""
    notes: list[str] = []
    if any(use.shape.is_moe for use in models):
        notes.append("mixture of experts: each token's experts and the router are timed at the dense matmul rate "
                     "(no GPU record has run experts: their smaller products and the tokens' dispatch are not timed)")
    if knobs.precision == "bf16" and gpu.bf16_tflops is None:
        notes.append(f"{gpu.name} has no bf16 tensor cores: bf16 runs at its fp32 rate; use precision fp16")
    return notes


@dataclass
class _Traffic:
    """Per unit of work: bytes over the GPU links and to the host, parameters the host's Adam steps
    and parameters the GPU steps (each process's share)."""

    comm_bytes: float = 0.0
    offload_bytes: float = 0.0
    host_adam_params: float = 0.0
    gpu_stepped: float = 0.0


def _traffic(models: list[ModelUse], knobs: Knobs, work: _Work, world: int, ring: float) -> _Traffic:
    """What ZeRO's stage, offload and each model's placement move and step per unit of work."""
    b = knobs.weight_bytes
    out = _Traffic()
    for use in models:
        n_all = use.shape.params_with_head(use.head)
        if use.trained:
            n_trained = sum(trainable_tensors(use, knobs)[0])
            if knobs.zero_stage in (0, 1):
                out.comm_bytes += 2 * b * n_trained * ring * work.optimizer_steps
            elif knobs.zero_stage == 2:
                out.comm_bytes += b * n_trained * ring * (work.train_micro + work.optimizer_steps)
            else:
                out.comm_bytes += (2 * b * n_all + b * n_trained) * ring * work.train_micro
            if knobs.offloads:
                out.offload_bytes += b * n_trained / world * (work.train_micro + work.optimizer_steps)
                out.host_adam_params += n_trained / world * work.optimizer_steps
            else:
                stepped = n_trained / world if knobs.zero_stage >= 1 else n_trained
                out.gpu_stepped += stepped * work.optimizer_steps
        elif use.placement != "precompute":
            if knobs.zero_stage == 3:
                out.comm_bytes += b * n_all * ring * work.scoring_micro
            if use.placement == "offload":
                share = n_all / world if knobs.zero_stage == 3 else n_all
                out.offload_bytes += b * share * work.scoring_micro
    return out


def _sequence_exchange_s(work: _Work, knobs: Knobs, hw: Hardware, rates: rate_table.Rates, notes: list[str]) -> float:
    """Seconds of sequence parallel's all-to-all exchanges per unit (0 without it), all exposed; says so in notes."""
    if knobs.sequence_parallel <= 1:
        return 0.0
    across = knobs.sequence_parallel > max(hw.gpus_per_node, 1)
    exchange_s = work.busiest.exchanged_bytes / link_bandwidth(rates, hw, across_nodes=across)
    notes.append(f"sequence_parallel {knobs.sequence_parallel}: attention's all-to-all exchanges "
                 f"({_seconds(exchange_s)} per step, over the "
                 f"{'inter-node network' if across else 'GPU links'}) are counted as exposed communication, "
                 f"not overlapped with compute")
    return exchange_s


def _generation_note(knobs: Knobs) -> str:
    return ("generation time assumes memory-bound decoding (weights read once per new token)"
            + (f"; vLLM: each process reads 1/{knobs.vllm_tensor_parallel} of them per token step, plus "
               "the KV cache, and the weights are synced after every update" if knobs.samples_with_vllm
               else ""))


def _steps_and_total(rows: int | None, knobs: Knobs, work: _Work, unit_s: float,
                     pre_per_1000: float) -> tuple[int | None, float | None]:
    """(optimizer steps, seconds) of the whole stage: its epochs over `rows`, or max_steps where set."""
    steps = total = None
    if rows is not None:
        units = max(1, knobs.epochs * rows // work.rows)
        steps = int(units * work.optimizer_steps)
        total = units * unit_s + pre_per_1000 * rows / 1000
    if knobs.max_steps:
        steps = knobs.max_steps
        total = knobs.max_steps / work.optimizer_steps * unit_s + (pre_per_1000 * rows / 1000 if rows else 0.0)
    return steps, total


def link_bandwidth(rates: rate_table.Rates, hw: Hardware, across_nodes: bool) -> float:
    """Bytes per second per GPU a collective moves: the GPU links inside a node; across nodes
    no more than each GPU's share of the node's network."""
    if not across_nodes:
        return rates.link_bytes_per_s.value
    return min(rates.link_bytes_per_s.value, rates.network_bytes_per_s.value / max(hw.gpus_per_node, 1))


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 120 else f"{value / 60:.1f} min"


def _lora_params(use: ModelUse, knobs: Knobs) -> int | None:
    return sum(trainable_tensors(use, knobs)[0]) if use.trained and knobs.lora_rank else None


def pass_work(shape: ModelShape, head: str, positions: float, attended: float, *, trained: bool,
              knobs: Knobs) -> GPUWork:
    """One process's pass over a micro batch of `positions` positions (its own: 1/N of its
    group's under sequence parallel) whose attention scores `attended` query-key pairs: a forward,
    and for a trained model its backward (and recompute)."""
    lora_rank = knobs.lora_rank if trained else None  # None: no adapters trained in this pass
    lora = lora_rank is not None
    matmul = matmul_flops_per_position(shape, head) * positions
    attention = attention_flops(shape, attended)
    logits = positions * shape.vocab if head == "lm" else 0.0
    exchanged = exchange_bytes(shape, positions, knobs)
    if not trained:
        return GPUWork(matmul, attention, logits, shape.layers, exchanged_bytes=exchanged)
    recompute = 1 if knobs.gradient_checkpointing else 0
    layer_passes = shape.layers * (1 + recompute + BACKWARD_PASSES)
    # A tiled head (logits_tile) runs again in the backward: its matmul and the loss's read of the logits.
    tiled = bool(knobs.logits_tile) and head == "lm"
    # A tiled MLP (mlp_tiles) runs its forward again in the backward, tile by tile.
    mlp_again = 2 * positions * shape.mlp_active_params if knobs.mlp_tiles else 0.0
    work = GPUWork(
        matmul_flops=matmul * (1 + recompute + (1 if lora else 2)) + (2 * shape.hidden * shape.vocab * positions
                                                                      if tiled else 0.0) + mlp_again,
        attention_flops=attention * (1 + recompute + 2),
        logits=(3 if tiled else 2) * logits,
        layer_passes=layer_passes,
        exchanged_bytes=exchanged * (1 + recompute + 1),  # the backward exchanges the gradients back
        # checkpoint_offload: every layer's input down in the forward and up again for its recompute
        checkpoint_bytes=2 * shape.layers * positions * shape.hidden * knobs.weight_bytes if knobs.checkpoint_offload
        else 0.0,
    )
    if lora_rank is not None:
        work.lora_elements = positions * (1 + recompute + BACKWARD_PASSES) * shape.lora_features(knobs.lora_targets)
        work.matmul_flops += 4 * sum(shape.lora_tensors(lora_rank, knobs.lora_targets)) * positions
    return work


def exchange_bytes(shape: ModelShape, positions: float, knobs: Knobs) -> float:
    """Bytes one process sends in a forward's all-to-alls (Ulysses): in every layer q, k, v
    go out as sequence shards and come back as head shards, then the output returns; each keeps
    its 1/N share, so (N-1)/N of positions x width x bytes per value leaves the process."""
    n = knobs.sequence_parallel
    if n == 1:
        return 0.0
    return shape.layers * positions * shape.attention_io_width * knobs.weight_bytes * (n - 1) / n


def _step_work(models: list[ModelUse], knobs: Knobs, batches: Batches, rates: rate_table.Rates,
               kernel: str) -> _Work:
    """An optimizer step of sft/rm/dpo over the simulated micro batches."""
    lora = {use.role: _lora_params(use, knobs) for use in models}
    total = model = 0.0
    busiest, precompute = GPUWork(), GPUWork()
    for step in batches.steps:
        for j in range(max(len(mine) for mine in step)):
            slowest, slowest_s = GPUWork(), -1.0
            for micro in (mine[j] for mine in step if j < len(mine)):
                positions, attended = micro.processed_tokens, micro.attended(batches.masked)
                local, local_attended = micro.per_process(batches.masked, batches.sequence_parallel)
                mine = GPUWork()
                for use in models:
                    work = pass_work(use.shape, use.head, local, local_attended, trained=use.trained, knobs=knobs)
                    if use.placement == "precompute":
                        precompute.add(work, batches.sequence_parallel)  # the group's processes each do this
                        continue
                    mine.add(work)
                    total += pass_flops(use.shape, use.head, positions, attended, trained=use.trained,
                                        lora_params=lora[use.role],
                                        recompute=use.trained and knobs.gradient_checkpointing)
                    if micro.counts:
                        model += sum(sequence_flops(use.shape, use.head, n, use.trained, lora[use.role])
                                     for n in micro.sequences)
                seconds = sum(compute_seconds(mine, rates, kernel, knobs.zero_stage).values())
                if seconds > slowest_s:
                    slowest, slowest_s = mine, seconds
            busiest.add(slowest)
    count = len(batches.steps)
    per_step, precompute_per_step = GPUWork(), GPUWork()
    per_step.add(busiest, 1 / count)
    precompute_per_step.add(precompute, 1 / count)
    return _Work(rows=batches.rows_per_step, real_tokens=batches.real_tokens_per_step,
                 processed_tokens=batches.processed_tokens_per_step, train_micro=batches.micro_batches_per_step,
                 optimizer_steps=1.0, scoring_micro=batches.micro_batches_per_step, executed=total / count,
                 busiest=per_step, model=model / count, precompute=precompute_per_step)


def _rollout_work(models: list[ModelUse], workload: Workload, knobs: Knobs, world: int) -> _Work:
    """A PPO rollout: experience (a forward of every model over every sequence, scoring_batch
    sequences at a time), then train_passes passes of the trained models in micro batches;
    every sequence max_len long. Under sequence parallel (N) every process of a data-parallel
    group scores and trains on the group's sequences, 1/N of each one's positions (sampling,
    timed by _generation_s, stays whole: each process samples 1/N of its group's prompts)."""
    seq, mb, n, rows = workload.seq_len, knobs.micro_batch_size, knobs.sequence_parallel, workload.rows_per_rollout
    assert rows is not None, "estimate_time times a rollout where the workload has rows_per_rollout"
    groups = knobs.data_parallel(world)
    accumulation = max(1, rows_per_step(knobs.global_batch_size, mb, groups) // (mb * groups))
    sequences = workload.sequences_per_rollout
    train_micro = workload.train_passes * sequences / (mb * groups)
    scoring = workload.scoring_batch or mb
    tokens = sequences * seq
    executed = model = 0.0
    busiest = GPUWork()
    for use in models:
        fwd = forward_flops_per_token(use.shape, use.head, seq)
        busiest.add(pass_work(use.shape, use.head, scoring * seq / n, scoring * seq * seq / n, trained=False,
                              knobs=knobs), sequences / groups / scoring)
        executed += fwd * tokens
        model += fwd * tokens
        if use.trained:
            trained_flops = pass_flops(use.shape, use.head, seq, seq * seq, trained=True,
                                       lora_params=_lora_params(use, knobs))
            recompute = fwd * seq if knobs.gradient_checkpointing else 0.0
            executed += (trained_flops + recompute) / seq * tokens * workload.train_passes
            model += trained_flops / seq * tokens * workload.train_passes
            busiest.add(pass_work(use.shape, use.head, mb * seq / n, mb * seq * seq / n, trained=True, knobs=knobs),
                        train_micro)
    return _Work(rows=rows, real_tokens=tokens, processed_tokens=tokens, train_micro=train_micro,
                 optimizer_steps=max(1.0, train_micro / accumulation), scoring_micro=sequences / (groups * scoring),
                 executed=executed, busiest=busiest, model=model)


def _generation_s(models: list[ModelUse], workload: Workload, knobs: Knobs, rates: rate_table.Rates, world: int,
                  ring: float, bandwidth: float, hw: Hardware) -> float:
    """Decoding a rollout: memory-bound, every weight read once per new token per call (vLLM:
    _vllm_generation_s)."""
    gen, actor = workload.generation, next((m for m in models if m.trained and m.head == "lm"), None)
    if gen is None or actor is None:
        return 0.0
    if knobs.samples_with_vllm and hw.on_gpu and hw.gpu_memory_bytes:
        return _vllm_generation_s(actor, workload, gen, knobs, rates, world, ring, bandwidth, hw)
    weights = actor.shape.n_params * knobs.weight_bytes
    calls = math.ceil(workload.sequences_per_rollout / world / gen.batch)
    seconds = calls * gen.new_tokens * weights / rates.hbm_bytes_per_s.value
    if knobs.zero_stage == 3 and world > 1:  # one gather of the whole actor per rollout
        seconds += weights * ring / bandwidth
    return seconds


def _vllm_generation_s(actor: ModelUse, workload: Workload, gen: Generation, knobs: Knobs, rates: rate_table.Rates,
                       world: int, ring: float, bandwidth: float, hw: Hardware) -> float:
    """A rollout's decoding by the vLLM engines (each samples its tensor_parallel processes' prompts,
    as many at once as its KV cache holds) and the weight sync after the update
    (pipeline/plan/rollout_engine.py)."""
    engine = vllm_engine_memory(actor, knobs, hw, gen)
    n, b = engine.tensor_parallel, knobs.weight_bytes
    sequences = math.ceil(workload.sequences_per_rollout / world) * n
    hbm = rates.hbm_bytes_per_s.value
    decode = rollout_engine.decode_s(actor.shape, b, n, sequences, gen.prompt_len, gen.new_tokens, engine.sequences,
                                     hbm)
    gather = bandwidth / ring if knobs.zero_stage == 3 and world > 1 else 0.0
    return decode + rollout_engine.sync_s(actor.shape, b, gather, hbm)


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


def signal_lead_seconds(save_s: float, step_s: float | None) -> int:
    """How long before the time limit Slurm should signal: the step running then ends (twice an
    estimated step, for a slow one), the checkpoint is written (twice the estimate), and the
    job requeues and exits (SIGNAL_MARGIN_S)."""
    lead = 2 * save_s + 2 * (step_s or 0.0) + SIGNAL_MARGIN_S
    return int(min(SIGNAL_LEAD_MAX_S, max(SIGNAL_LEAD_MIN_S, math.ceil(lead))))
