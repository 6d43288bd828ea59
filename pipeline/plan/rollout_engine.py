"""The vLLM rollout engine in the plan (generation: vllm; stages/vllm_engine.py): its memory on
each GPU, its decoding time and the weight sync after every update.

Memory. vLLM takes `gpu_memory_utilization` of each GPU at start: its 1/N of the actor's weights
(tensor_parallel N) and, in the rest of that share, its KV cache. Without sleep it keeps the share
for the whole stage (in the plan: "always", beside training); with sleep it releases both while the
actor trains (in the plan: only at generation). The sync gathers one module at a time under ZeRO-3:
the largest module's weights, whole, for a moment.

Time. Decoding is memory-bound: each token step of an engine reads its 1/N of the weights and the
KV cache of the sequences it decodes at once (as many as its cache holds, at most MAX_SEQUENCES,
vLLM's default). An engine samples its N processes' prompts together. The sync moves every weight
once: a ZeRO-3 gather (the ring over the processes) or a copy on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.rollout_engine import KvShape, kv_cache_bytes
from core.shapes import ModelShape

MAX_SEQUENCES = 256  # vLLM's max_num_seqs default: sequences an engine decodes at once


@dataclass(frozen=True)
class EngineMemory:
    weights: int  # this process's share of the actor's weights in the engine
    kv_cache: int  # the rest of its share of the GPU
    sync_module: int  # the largest module gathered whole by a ZeRO-3 sync
    sequence_kv: int  # one sequence's KV cache at the stage's longest (prompt + completion)
    tensor_parallel: int  # processes whose GPUs the engine's weights are split over

    @property
    def sequences(self) -> int:
        """Sequences of the stage's longest the KV cache holds at once (0: not even one)."""
        return self.kv_cache // self.sequence_kv if self.sequence_kv else 0


def kv_shape(shape: ModelShape) -> KvShape:
    return KvShape(layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim)


def engine_memory(shape: ModelShape, weight_bytes: int, tensor_parallel: int, memory_share: float,
                  gpu_bytes: int, longest: int) -> EngineMemory:
    """One process's part of its engine on a GPU of `gpu_bytes`."""
    weights = shape.n_params * weight_bytes // tensor_parallel
    kv = max(int(memory_share * gpu_bytes) - weights, 0)
    largest = max(shape.vocab, shape.intermediate) * shape.hidden * weight_bytes
    one = kv_cache_bytes(kv_shape(shape), 1, longest, weight_bytes, tensor_parallel)
    return EngineMemory(weights, kv, largest, one, tensor_parallel)


def decode_s(shape: ModelShape, weight_bytes: int, tensor_parallel: int, sequences: int, prompt_len: int,
             new_tokens: int, concurrent: int, hbm_bytes_per_s: float) -> float:
    """Seconds an engine takes to sample `sequences` completions of `new_tokens`, `concurrent` at a time."""
    concurrent = max(1, min(concurrent, MAX_SEQUENCES, sequences))
    per_token_kv = kv_cache_bytes(kv_shape(shape), 1, 1, weight_bytes, tensor_parallel)
    cache = concurrent * (prompt_len + new_tokens / 2) * per_token_kv  # on average half the completion in
    step_bytes = shape.n_params * weight_bytes / tensor_parallel + cache
    return math.ceil(sequences / concurrent) * new_tokens * step_bytes / hbm_bytes_per_s


def sync_s(shape: ModelShape, weight_bytes: int, zero3_ring_bytes_per_s: float, hbm_bytes_per_s: float) -> float:
    """Handing every weight to the engine once: gathered over the processes (ZeRO-3: the ring's
    rate; None or 0 without ZeRO-3) and copied in on the GPU."""
    weights = shape.n_params * weight_bytes
    gathered = weights / zero3_ring_bytes_per_s if zero3_ring_bytes_per_s else 0.0
    return gathered + weights / hbm_bytes_per_s
