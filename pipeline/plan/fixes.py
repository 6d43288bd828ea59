"""What would make a stage fit, and what each memory-saving setting of a fitting
stage buys: the stage re-estimated with candidate changes, one to a few at a time.

Pure Python (no torch)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from core.batching import rows_per_step
from core.rollout_engine import tensor_parallel_sizes
from core.sequence_parallel import SHARDABLE_ATTENTION, shares_for
from core.shapes import ModelShape
from pipeline.lengths import RowLengths
from pipeline.plan.estimate import Estimate, estimate_stage
from pipeline.plan.inputs import REFERENCE_PLACEMENTS, Hardware, Knobs, PPOWorkload, Workload
from pipeline.plan.rollout_engine import engine_memory


@dataclass
class Suggestion:
    changes: dict  # field -> new value
    description: str
    changes_training: bool  # False: same result, only memory/speed differ
    estimate: Estimate


# Within these groups a later option goes further than an earlier one (more GPUs, more
# sharding): it is only worth suggesting where the lesser one, with the same companions, fails.
ESCALATING_GROUPS = ("zero", "nodes", "sequence")


def sequence_shares(knobs: Knobs, shape: ModelShape, hw: Hardware) -> list[int]:
    """The sequence_parallel values above the stage's that its kind, attention, processes and
    model heads allow (core/sequence_parallel.py), smallest first: those within a node (the
    all-to-alls stay on the GPU links), else the smallest across nodes."""
    if not knobs.stage_kind.sequence_parallel or knobs.attention not in SHARDABLE_ATTENTION:
        return []
    processes = knobs.nodes * hw.processes_per_node
    larger = [n for n in shares_for(shape.heads, shape.kv_heads, processes) if n > knobs.sequence_parallel]
    within = [n for n in larger if n <= max(hw.gpus_per_node, hw.processes_per_node)]
    return within or larger[:1]


# What a suggested logits_tile holds at once: 2**27 logits, 256 MiB in bf16 (with their gradient 512).
TILE_LOGITS = 2**27


def logits_tile_for(vocab: int) -> int:
    """The logits_tile to suggest: the largest power of two of positions whose logits stay within
    TILE_LOGITS (1024 for a 128K vocabulary), at least 64."""
    return max(64, 2 ** int(math.log2(max(TILE_LOGITS // vocab, 1))))


def mlp_tiles_for(knobs: Knobs, shape: ModelShape) -> int:
    """The mlp_tiles to suggest: tiles of about `hidden` positions of a process's micro batch (as
    DeepSpeed's ALST picks them), whose intermediates are then the size of one MLP weight; at least 2."""
    tokens = Workload(knobs.stage_kind.sequences_per_row, knobs.max_len).train_tokens(knobs)
    return max(2, -(-tokens // shape.hidden))


# (group, field changes, description, changes what is trained?)
Change = tuple[str, dict, str, bool]


def _candidate_changes(knobs: Knobs, shape: ModelShape, hw: Hardware) -> list[Change]:
    """(group, field changes, description, changes what is trained?) one at a time."""
    return (_memory_setting_changes(knobs) + _batch_changes(knobs, hw) + _tiling_and_sharing_changes(knobs, shape, hw)
            + _training_changes(knobs))


def _memory_setting_changes(knobs: Knobs) -> list[Change]:
    """Checkpointing, flash attention, a higher ZeRO stage, optimizer offload, the reference's placement."""
    out: list[Change] = []
    if not knobs.gradient_checkpointing:
        out.append(("checkpointing", {"gradient_checkpointing": True}, "gradient_checkpointing: true", False))
    elif not knobs.checkpoint_offload:
        out.append(("checkpointing", {"checkpoint_offload": True},
                    "checkpoint_offload: true (the checkpointed layer inputs in host memory; the same loss)", False))
    if knobs.attention == "eager":
        out.append(("attention", {"attention": "flash_attention_2"}, "attention: flash_attention_2", False))
    for stage in (2, 3):
        if stage > knobs.zero_stage:
            out.append(("zero", {"zero_stage": stage}, f"zero_stage: {stage}", False))
    if not knobs.offloads:
        change: dict[str, bool | int] = {"optimizer_offload": True}
        text = "optimizer_offload: true"
        if knobs.zero_stage == 0:
            change["zero_stage"] = 2
            text += " (with zero_stage: 2)"
        out.append(("offload", change, text, False))
    if knobs.stage_kind.frozen_reference and knobs.reference is not None:
        # A rollout's reference must score fresh samples: it cannot be precomputed.
        for placement in ("offload",) if knobs.stage_kind.rollouts else ("offload", "precompute"):
            if REFERENCE_PLACEMENTS.index(placement) > REFERENCE_PLACEMENTS.index(knobs.reference):
                out.append(("reference", {"reference": placement}, f"reference: {placement}", False))
    return out


def _batch_changes(knobs: Knobs, hw: Hardware) -> list[Change]:
    """Smaller micro batches (the same global batch by accumulation), and 2x or 4x the nodes."""
    out: list[Change] = []
    processes = knobs.nodes * hw.processes_per_node
    groups = knobs.data_parallel(processes)  # those that take rows of their own
    rows = rows_per_step(knobs.global_batch_size, knobs.micro_batch_size, groups)
    smaller = knobs.micro_batch_size // 2
    if knobs.packs and knobs.micro_batch_tokens:  # the budget, not micro_batch_size, sizes a micro batch
        fewer = knobs.micro_batch_tokens // 2
        if fewer >= knobs.max_len * knobs.stage_kind.sequences_per_row:
            out.append(("micro", {"micro_batch_tokens": fewer}, f"micro_batch_tokens: {fewer}", False))
    elif smaller >= 1 and rows % (smaller * groups) == 0:
        out.append(("micro", {"micro_batch_size": smaller, "global_batch_size": rows},
                    f"micro_batch_size: {smaller} (global_batch_size stays {rows} by accumulation)", False))
    for factor in (2, 4):
        nodes = knobs.nodes * factor
        per_pass = knobs.micro_batch_size * groups * factor
        if rows % per_pass == 0:
            out.append(("nodes", {"nodes": nodes, "global_batch_size": rows},
                        f"nodes: {nodes} (global_batch_size {rows})", False))
        else:
            out.append(("nodes", {"nodes": nodes, "global_batch_size": per_pass},
                        f"nodes: {nodes} (global_batch_size {rows} -> {per_pass}: the minimum for "
                        f"{groups * factor} data-parallel processes)", True))
    return out


def _tiling_and_sharing_changes(knobs: Knobs, shape: ModelShape, hw: Hardware) -> list[Change]:
    """Logits and MLP tiles, sequence parallel shares, and sampling with vLLM; none changes the loss."""
    out: list[Change] = []
    processes = knobs.nodes * hw.processes_per_node
    if knobs.stage_kind.tiled_logits and not knobs.logits_tile:
        tile = logits_tile_for(shape.vocab)
        out.append(("logits", {"logits_tile": tile},
                    f"logits_tile: {tile} (the LM head's logits {tile} positions at a time; the same loss)", False))
    if knobs.stage_kind.tiled_mlp and not knobs.mlp_tiles:
        tiles = mlp_tiles_for(knobs, shape)
        out.append(("mlp", {"mlp_tiles": tiles},
                    f"mlp_tiles: {tiles} (each MLP over {tiles} tiles of positions, recomputed in the backward; "
                    "the same loss)", False))
    for n in sequence_shares(knobs, shape, hw):
        out.append(("sequence", {"sequence_parallel": n},
                    f"sequence_parallel: {n} ({processes // n} data-parallel group{'' if processes == n else 's'} "
                    f"of {n} processes sharing each sequence; max_len stays {knobs.max_len})", False))
    if knobs.stage_kind.rollouts and not knobs.samples_with_vllm and hw.on_gpu and hw.gpu_memory_bytes:
        for n in tensor_parallel_sizes(hw.processes_per_node):
            engine = engine_memory(shape, knobs.weight_bytes, n, knobs.vllm_memory_share, hw.gpu_memory_bytes,
                                   knobs.max_len)
            if engine.sequences == 0:  # its share of the GPU would not hold 1/n of the actor and one sequence
                continue
            out.append(("generation", {"vllm_tensor_parallel": n, "vllm_sleep": True},
                        f"generation: vllm, vllm: {{tensor_parallel: {n}, sleep: true}} (each GPU holds 1/{n} of the "
                        f"actor to sample, released while it trains)", False))
    return out


def _training_changes(knobs: Knobs) -> list[Change]:
    """What changes what is trained: LoRA adapters instead of all weights, half the max_len."""
    out: list[Change] = []
    if not knobs.lora_rank:
        out.append(("lora", {"lora_rank": 16, "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj")},
                    "lora: {rank: 16} (train adapters instead of all weights)", True))
    if knobs.max_len >= 512:
        out.append(("max_len", {"max_len": knobs.max_len // 2},
                    f"max_len: {knobs.max_len // 2} (longer rows are truncated)", True))
    return out


def suggest(knobs: Knobs, shape: ModelShape, hw: Hardware, rows: int | None = None,
            ppo: PPOWorkload | None = None, lengths: RowLengths | None = None, limit: int = 5,
            max_changes: int = 3) -> list[Suggestion]:
    """Changes that make the stage fit, each re-estimated, cheapest first.

    Cheapest = changes that keep the training result (checkpointing, ZeRO stage,
    offload, reference placement, smaller micro batch with accumulation, more
    nodes, sharing sequences over processes: sequence_parallel keeps every row's
    tokens) before those that change it (LoRA, shorter max_len, another batch
    size); within each, fewest GPU-seconds per 1000 rows (throughput lost, and
    GPUs added), then fewest changes. Only minimal combinations are kept (no
    subset of a kept one already fits). When nothing fits, the closest ones.
    """
    candidates = _candidate_changes(knobs, shape, hw)
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
            estimate = estimate_stage(new, shape, hw, rows, ppo, lengths)
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


def settings_relaxed(knobs: Knobs, shape: ModelShape, hw: Hardware, rows: int | None = None,
                     ppo: PPOWorkload | None = None, lengths: RowLengths | None = None) -> list[Suggestion]:
    """The stage re-estimated with each memory-saving setting it has on turned off,
    with every offload off at once, and, where the optimizer is offloaded, on one
    more node without that offload: what each setting buys, and the way out of it."""
    options: list[tuple[dict, str]] = []
    if knobs.optimizer_offload:
        options.append(({"optimizer_offload": False}, "optimizer_offload: false"))
    reference_off_gpu = knobs.reference not in ("live", None)
    if reference_off_gpu:
        options.append(({"reference": "live"}, "reference: live"))
    if knobs.optimizer_offload and reference_off_gpu:
        options.append(({"optimizer_offload": False, "reference": "live"},
                         f"no offload at all (ZeRO-{knobs.zero_stage} alone)"))
    if knobs.gradient_checkpointing:
        options.append(({"gradient_checkpointing": False, "checkpoint_offload": False},
                        "gradient_checkpointing: false"))
    if knobs.checkpoint_offload:
        options.append(({"checkpoint_offload": False}, "checkpoint_offload: false (the layer inputs on the GPU)"))
    if knobs.zero_stage == 3:
        options.append(({"zero_stage": 2}, "zero_stage: 2"))
    if knobs.lora_rank:
        options.append(({"lora_rank": None, "lora_targets": ()}, "no LoRA (all parameters trained)"))
    if knobs.sequence_parallel > 1:
        options.append(({"sequence_parallel": 1}, "sequence_parallel: 1 (every process a sequence of its own)"))
    if knobs.logits_tile:
        options.append(({"logits_tile": None}, "no logits_tile (all of a micro batch's logits at once)"))
    if knobs.mlp_tiles:
        options.append(({"mlp_tiles": None}, "no mlp_tiles (each MLP over all of a micro batch's positions at once)"))
    if knobs.optimizer_offload:
        more = knobs.nodes + 1
        while (more * hw.processes_per_node) % knobs.sequence_parallel:  # the shares must still divide the processes
            more += 1
        options.append(({"optimizer_offload": False, "nodes": more}, f"nodes: {more}, optimizer_offload: false"))
    return [Suggestion(changes, text, False, estimate_stage(replace(knobs, **changes), shape, hw, rows, ppo, lengths))
            for changes, text in options]

