"""The rules of long sequences, torch-free: sharing sequences over processes (Ulysses, DeepSpeed's
ALST; the runtime is stages/sequence_parallel.py), tiling the LM head's logits
(stages/losses.py tiled_next_token_logprobs) and the decoder's MLPs (stages/models.py
tile_mlps): what a stack needs for them and which models can be shared how. The planner,
preflight and the stage itself ask here.
"""

from __future__ import annotations

import importlib.metadata

# DeepSpeed's Ulysses attention for Hugging Face models (DeepSpeed 0.18 and later) looks attention
# functions up in transformers' registry, which exists from 4.51.3 on.
ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
MIN_TRANSFORMERS = "4.51.3"
MIN_DEEPSPEED = "0.18.0"
# Attention implementations whose exchange the runtime wraps: eager builds a full 4D mask of its own.
SHARDABLE_ATTENTION = ("auto", "sdpa", "flash_attention_2")


def stack_problem(field: str = "sequence_parallel", off: str = "leave sequence_parallel at 1") -> str | None:
    """Why the installed stack (this python's transformers and DeepSpeed) cannot run `field` (sharing
    sequences over processes; tiling logits, which asks the model for no logits and DeepSpeed to
    wait for a weight's last gradient), or None when it can; `off`: how to do without."""
    from packaging.version import Version

    have = {name: importlib.metadata.version(name) for name in ("transformers", "deepspeed")}
    if (Version(have["transformers"]) >= Version(MIN_TRANSFORMERS)
            and Version(have["deepspeed"]) >= Version(MIN_DEEPSPEED)):
        return None
    return (f"{field} needs transformers >= {MIN_TRANSFORMERS} and DeepSpeed >= {MIN_DEEPSPEED} (for "
            f"sequence_parallel: DeepSpeed's Ulysses attention, {ULYSSES_MODULE}); this stack has transformers "
            f"{have['transformers']} and DeepSpeed {have['deepspeed']} (the pinned stack does not have it). Run "
            f"the stage on the current stack (containers/current.def), or {off}")


# Fields that compute a pass in tiles, each telling DeepSpeed's ZeRO to wait for a weight's last
# tile before reducing its gradient (`ds_grad_is_ready`, DeepSpeed 0.18 and later).
TILE_FIELDS = ("logits_tile", "mlp_tiles")


def tiles_problem(stage) -> str | None:
    """Why the installed stack cannot run the tiling `stage` asks for (its first such field), or None."""
    for name in TILE_FIELDS:
        if getattr(stage, name) is not None:
            return stack_problem(name, f"leave {name} out")
    return None


def heads_problem(heads: int, kv_heads: int, n: int) -> str | None:
    """Why n processes cannot share a model with these attention heads, or None. Each process
    attends with 1/n of the heads, so n divides them; key-value heads are split the same way, or
    copied when there are fewer than n (then they must divide n)."""
    if n == 1:
        return None
    if heads % n:
        return f"{n} does not divide the model's {heads} attention heads (each process takes 1/{n} of them)"
    if kv_heads % n and n % kv_heads:
        return (f"{n} and the model's {kv_heads} key-value heads do not divide one another (each process takes "
                f"1/{n} of them, or a copy when there are fewer)")
    return None


def shares_for(heads: int, kv_heads: int, processes: int) -> list[int]:
    """Every sequence_parallel that `processes` processes can run a model with these heads at, smallest first."""
    return [n for n in range(1, processes + 1) if processes % n == 0 and heads_problem(heads, kv_heads, n) is None]


def share_problem(heads: int, kv_heads: int, processes: int, n: int) -> str | None:
    """Why `processes` processes cannot share each sequence of a model with these heads n ways,
    with the shares they can, or None."""
    problem = (heads_problem(heads, kv_heads, n) if processes % n == 0 else
               f"{n} does not divide the stage's {processes} processes")
    if problem is None:
        return None
    able = shares_for(heads, kv_heads, processes)[1:]
    if able:
        return f"{problem}; on {processes} processes it can be {' or '.join(map(str, able))}"
    return (f"{problem}; on {processes} processes no sharing fits the model: leave it at 1, or change the "
            "processes (tasks_per_node, nodes)")
