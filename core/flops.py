"""FLOPs of a model's passes: the one formula behind the planner's predicted time and
MFU and the MFU a running stage measures, so a wrong prediction shows in the run's
own numbers. Pure Python (no torch).

A forward pass costs, per token of a sequence of n tokens, 2 FLOPs per matmul
parameter it goes through (the input embedding is a lookup; a tied output embedding
is a matmul; of a mixture of experts' layer, the router and the experts_per_token
experts the token is routed to) plus 2 * layers * (q_width + out_width) * n for the
attention scores and their weighted sum, 4 * layers * q_width * n where heads are
alike (counted in full, as PaLM and Megatron count them). The backward pass costs twice
the forward; with LoRA the frozen weights need no gradient of their own, so it
costs one forward plus 2 FLOPs per trained parameter. Gradient checkpointing's
recomputed forward is executed work, not model work: it is not counted in MFU.

What a pass executes can be more than the model FLOPs of its sequences
(`pass_flops`): every position of a batch tensor goes through the matmuls,
padding included, and attention with a mask (sdpa, eager) computes the scores of
a whole line, width^2, whichever sequences the mask keeps apart; varlen flash
kernels compute each sequence's own n^2 only.
"""

from __future__ import annotations

from core.shapes import ModelShape


def _matmul_params(shape: ModelShape, head: str) -> int:
    matmul = shape.active_params_with_head(head) - shape.embedding_params
    if head == "lm" and shape.tied_embeddings:
        matmul += shape.embedding_params  # the tied table is also the output matmul
    return matmul


def matmul_flops_per_position(shape: ModelShape, head: str) -> float:
    """Forward matmul FLOPs of one position of a batch tensor ("lm" or "scalar" head)."""
    return 2 * _matmul_params(shape, head)


def attention_flops(shape: ModelShape, attended: float) -> float:
    """Forward FLOPs of the attention scores and their weighted sum over `attended` query-key pairs."""
    return 2 * shape.layers * (shape.q_width + shape.out_width) * attended


def forward_flops_per_token(shape: ModelShape, head: str, length: int) -> float:
    """Forward FLOPs per token of a sequence of `length` tokens ("lm" or "scalar" head)."""
    return matmul_flops_per_position(shape, head) + attention_flops(shape, length)


def backward_flops_per_token(shape: ModelShape, head: str, length: int, lora_params: int | None = None) -> float:
    """Backward FLOPs per token: twice the forward, or with LoRA one forward (the
    activation gradients) plus the adapters' weight gradients."""
    forward = forward_flops_per_token(shape, head, length)
    return forward + 2 * lora_params if lora_params is not None else 2 * forward


def sequence_flops(shape: ModelShape, head: str, length: int, trained: bool,
                   lora_params: int | None = None) -> float:
    """Model FLOPs of one sequence: forward, plus backward when the model is trained."""
    total = forward_flops_per_token(shape, head, length)
    if trained:
        total += backward_flops_per_token(shape, head, length, lora_params)
    return total * length


def pass_flops(shape: ModelShape, head: str, positions: int, attended: int, *, trained: bool,
               lora_params: int | None = None, recompute: bool = False) -> float:
    """FLOPs a pass executes over `positions` token positions of a batch tensor (padding
    included) whose attention scores `attended` query-key pairs: the sum of width^2
    over its lines when a mask keeps packed sequences apart (sdpa, eager), of each
    sequence's length^2 with varlen flash kernels. A trained model adds its backward,
    and with gradient checkpointing (recompute) a second forward. One sequence of n
    tokens, alone: pass_flops(n, n * n, trained=...) == sequence_flops(n, trained=...)."""
    forward = matmul_flops_per_position(shape, head) * positions + attention_flops(shape, attended)
    if not trained:
        return forward
    backward = forward + 2 * lora_params * positions if lora_params is not None else 2 * forward
    return forward + backward + (forward if recompute else 0.0)


def rollout_sequence_flops(models, length: int, train_passes: int) -> float:
    """Model FLOPs of one PPO sequence of `length` tokens, as the planner counts a rollout:
    every model's forward while the experience is made, plus `train_passes` forward and
    backward passes of each trained one (generation is not counted).
    models: (shape, head, trained, lora_params) of the actor, reference, critic, reward model."""
    total = 0.0
    for shape, head, trained, lora in models:
        total += sequence_flops(shape, head, length, trained=False)
        if trained:
            total += train_passes * sequence_flops(shape, head, length, trained=True, lora_params=lora)
    return total
