"""The DeepSpeed settings that both the running stage and the planner depend on.

stages/engine.py writes them into the DeepSpeed config it hands to
`deepspeed.initialize`; pipeline/plan reads the same numbers to size the buffers
DeepSpeed allocates. One owner, so the plan cannot drift from the run. Pure
Python (no torch): the planner runs on login nodes.
"""

from __future__ import annotations

# ZeRO's reduce / all-gather / prefetch buckets, in elements. DeepSpeed's 5e8 default
# suits GPUs; on CPU buckets that size make every step take seconds.
GPU_BUCKET_ELEMENTS = int(5e8)
CPU_BUCKET_ELEMENTS = int(5e5)

# DeepSpeed defaults the config leaves alone; the planner sizes buffers by them
# (tests/test_plan.py checks them against the installed DeepSpeed).
SUB_GROUP_SIZE = int(1e9)  # zero_optimization.sub_group_size: ZeRO-3 steps the optimizer a sub-group at a time
MAX_LIVE_PARAMETERS = int(1e9)  # stage3_max_live_parameters: the most ZeRO-3 keeps gathered at once
FROZEN_PREFETCH_ELEMENTS = int(5e7)  # stage3_prefetch_bucket_size, which frozen_model_config keeps


def bucket_elements(on_gpu: bool) -> int:
    """Elements per ZeRO all-gather and prefetch bucket on GPUs or on CPU."""
    return GPU_BUCKET_ELEMENTS if on_gpu else CPU_BUCKET_ELEMENTS


def reduce_bucket_elements(on_gpu: bool, trained: int | None = None) -> int:
    """Elements per gradient (reduce) bucket for a model that trains `trained` parameters (None:
    not known, as many as a bucket holds). DeepSpeed allocates each bucket whole at the first
    backward, two with overlap_comm, whatever fills them: LoRA on Llama-3-8B trains 168M
    parameters, and 5e8-element buckets held 1.2 GiB that no gradient ever used."""
    limit = bucket_elements(on_gpu)
    return limit if trained is None else max(1, min(limit, trained))


def persistence_threshold(hidden: int) -> int:
    """ZeRO-3 keeps tensors of at most this many elements whole on every process:
    vectors (norms, 10 x hidden at most) stay whole, every matrix is partitioned."""
    return min(100_000, 10 * hidden)


def offloads_optimizer(optimizer_offload: bool, zero_stage: int) -> bool:
    """DeepSpeed moves the optimizer to host RAM only under ZeRO 1-3: with ZeRO-0, optimizer_offload
    is ignored (the planner warns)."""
    return bool(optimizer_offload) and zero_stage >= 1

