"""What a forward (and backward) pass over one micro batch holds on the device:
activations, the attention mask, logits. Per micro batch of T tokens, the most a
micro batch can hold (the packing budget, or micro_batch_size rows padded to
max_len); h hidden, i MLP width, q/kv widths, V vocabulary, b bytes per value of
the training precision.

- activations per token per layer: two RMSNorms 2*(4h + 2bh) (HF keeps an fp32
  copy), attention b*(2q + 2kv) (q, k, v, output) + fp32 log-sum-exp, MLP 4bi
  (a mixture of experts: i is the width of the k experts a token goes through and the
  shared ones, plus the router's fp32 logits and probabilities 8E and the token's k
  copies sent to its experts bkh), LoRA b*r per adapted layer; eager attention adds the heads x width scores of its
  line (fp32 softmax + its cast). Without checkpointing every layer keeps them;
  with it each layer keeps its input (b*h) and one layer is recomputed at a time.
  A layer's backward holds besides (backward_bytes) the gradients of its output and of the
  residual stream (2bh) and, at its fuller moment, the gradients of the MLP product's two
  factors (2bi: the down projection has freed its input), or in the attention's backward, once
  the MLP and second norm have freed theirs, the gradients of q, k, v and the output and the
  fused kernels' fp32 accumulator of q's gradient (4q).
- attention mask, one per micro batch and model pass, kept through the backward
  (stages/packed_attention.py PackedSequences): packed lines for sdpa and eager get an
  additive (lines, 1, width, width) mask in the model dtype, built from a bool
  (lines, width, width) and a bool (width, width) causal temporary; lines are about
  as wide as the longest sequence, so at most about max_len, up to twice that where
  sequences do not share lines evenly (see inputs.masked_line_width). Padded micro
  batches get transformers' own (rows, 1, max_len, max_len) mask: bool for sdpa,
  the model dtype for eager. Flash attention takes no mask.
- logits (stages/losses.py): a trained LM's logits stay in the model dtype and so
  does their gradient, T*V*2b; the loss reads log-probs in fp32 chunks of at most
  2^25 elements, keeping per position only the picked log-prob and a log-sum-exp
  (8 bytes). A chunk's backward holds up to four fp32 chunk-sized tensors at once
  (the previous chunk's two and the current one's two), its forward three. A
  frozen LM's forward: T*V*b + the forward's chunk. Scalar heads have no logits.
- tiled MLPs (mlp_tiles K, stages/models.py tiled_mlp): a layer keeps its MLP's input (b*h)
  instead of its four intermediates (4bi); the MLP's backward recomputes one tile of
  ceil(T/K) positions at a time and holds that tile's intermediates and their gradients
  (8bi per position), a frozen forward one tile's intermediates (4bi).
- sequence parallel (N > 1): each process holds its 1/N of every line's positions, so T is
  its share (activations, activation gradients, logits: each process computes the logits of
  its own positions); attention runs over the whole lines for 1/N of the heads (the same
  bytes per position), with the whole lines' mask. The layer being computed holds its q, k,
  v and output twice while they are exchanged (sequence shards and head shards): one more
  b*(2q + 2kv) per position while the attention runs (backward_bytes).
- checkpoint_offload: the checkpointed layer inputs wait in pinned host memory (every layer's,
  per process), the device holds the two in flight (stages/checkpoint_offload.py).
- DPO runs the reference forward after the policy's and before its backward
  (stages/dpo.py), so the policy's stored activations and logits are held while
  the reference runs (and its mask too, without checkpointing).
"""

from __future__ import annotations

from core.shapes import ModelShape
from pipeline.plan.inputs import Knobs, ModelUse, Workload, masked_line_width

LOGPROB_CHUNK_ELEMENTS = 1 << 25  # stages/losses.py _CHUNK_ELEMS (tests/test_plan.py checks they agree)
MASKED_KERNELS = ("sdpa", "eager")

Pass = tuple[str, str, float]  # (item name, category, bytes)


def _norm_bytes(shape: ModelShape, knobs: Knobs) -> float:
    """What an RMSNorm keeps per token: HF's fp32 copy of its input and two tensors in the model dtype."""
    return 4 * shape.hidden + 2 * knobs.weight_bytes * shape.hidden


def _mlp_bytes(shape: ModelShape, knobs: Knobs) -> float:
    """What a layer's MLP keeps per token: its gate, up, their activation and product (a tiled MLP
    its input alone), and a mixture of experts' routing."""
    h, b = shape.hidden, knobs.weight_bytes
    mlp = b * h if knobs.mlp_tiles else 4 * b * shape.mlp_width
    if shape.is_moe:  # the router's fp32 logits and probabilities, each token's copies sent to its experts
        mlp += 8 * shape.experts + b * h * shape.experts_per_token
    return mlp


def layer_activation_bytes(shape: ModelShape, knobs: Knobs, kernel: str, width: int) -> float:
    """Bytes one decoder layer keeps per token for the backward pass; `width`: the
    attention line a token attends within (eager materialises its scores)."""
    b = knobs.weight_bytes
    attention = b * shape.attention_io_width + 4 * shape.heads
    lora = b * knobs.lora_rank * len(knobs.lora_targets) if knobs.lora_rank else 0
    scores = shape.heads * width * (4 + (b if b < 4 else 0)) if kernel == "eager" else 0.0
    return 2 * _norm_bytes(shape, knobs) + attention + _mlp_bytes(shape, knobs) + lora + scores


def backward_bytes(shape: ModelShape, knobs: Knobs, kernel: str, width: int) -> float:
    """Bytes per token a layer's backward holds beside what the layer kept, at its fuller moment.
    Throughout: the gradients of the layer's output and of the residual stream (2bh). In the MLP's
    backward (untiled), the gradients of its product's two factors once the down projection has
    freed its input (2bi). In the attention's, once the MLP and the second norm have freed what
    they kept: the gradients of the output and of q, k, v, and the fused kernels' fp32 accumulator
    of q's gradient (eager: the scores' gradient), and with shared sequences the copies of q, k, v
    and the output the exchanges make (they exist while the attention runs, not the MLP)."""
    b = knobs.weight_bytes
    mlp = 0.0 if knobs.mlp_tiles else 2 * b * shape.mlp_width  # a tile's own gradients: mlp_tile
    attention = b * shape.attention_io_width * (2 if knobs.sequence_parallel > 1 else 1)
    attention += shape.heads * width * 4 if kernel == "eager" else 4 * shape.q_width
    freed = _mlp_bytes(shape, knobs) + _norm_bytes(shape, knobs)
    return 2 * b * shape.hidden + max(mlp, attention - freed)


def whole_tokens(knobs: Knobs, tokens: int) -> int:
    """The tokens of the micro batch a process's `tokens` are its share of: attention spans the
    whole lines (sequence parallel: after the exchange; the lines widened to a multiple of N)."""
    return tokens * knobs.sequence_parallel


def line_width(knobs: Knobs, workload: Workload, kernel: str, tokens: int) -> int:
    """The widest attention line of a micro batch of which a process holds `tokens` tokens."""
    if knobs.packs and kernel in MASKED_KERNELS:
        return masked_line_width(whole_tokens(knobs, tokens), knobs.max_len)
    return workload.seq_len


def attention_mask_bytes(knobs: Knobs, workload: Workload, kernel: str, tokens: int) -> float:
    """The mask sdpa and eager attention get for one micro batch of which a process holds
    `tokens` tokens: the whole lines' (none for flash)."""
    if kernel not in MASKED_KERNELS:
        return 0.0
    b, tokens = knobs.weight_bytes, whole_tokens(knobs, tokens)
    if knobs.packs:
        width = masked_line_width(tokens, knobs.max_len)
        return tokens * width * (b + 1) + width * width  # the mask + its bool temporaries
    rows, width = tokens // workload.seq_len, workload.seq_len
    return rows * width * width * (1 if kernel == "sdpa" else b)


def logits_bytes(shape: ModelShape, tokens: int, b: int, trained: bool) -> float:
    """Logits of `tokens` positions in the model dtype (and their gradient when trained),
    the fp32 log-prob chunks, and the picked log-prob and log-sum-exp per position."""
    chunk = min(tokens, max(1, LOGPROB_CHUNK_ELEMENTS // shape.vocab)) * shape.vocab
    if trained:
        return 2 * b * tokens * shape.vocab + 4 * 4 * chunk + 8 * tokens
    return b * tokens * shape.vocab + 3 * 4 * chunk + 8 * tokens


def logit_positions(knobs: Knobs, tokens: int) -> int:
    """Positions whose logits exist at once: all of a process's micro batch, or one tile of them
    (logits_tile: stages/losses.py tiled_next_token_logprobs)."""
    return min(tokens, knobs.logits_tile) if knobs.logits_tile else tokens


def tiled(knobs: Knobs) -> str:
    return f" (one tile of {knobs.logits_tile} positions)" if knobs.logits_tile else ""


def mlp_tile_positions(tiles: int, tokens: int) -> int:
    """Positions of a tiled MLP's largest tile (of mlp_tiles `tiles`), of a process's `tokens`."""
    return -(-tokens // tiles)


def mlp_tile(role: str, shape: ModelShape, knobs: Knobs, tokens: int, trained: bool) -> list[Pass]:
    """One tile's MLP intermediates (and, trained, their gradients) under mlp_tiles; none without."""
    if not knobs.mlp_tiles:
        return []
    positions = mlp_tile_positions(knobs.mlp_tiles, tokens)
    what = "intermediates + their gradients" if trained else "intermediates"
    return [(f"{role} MLP {what} of one tile of {positions:,} positions (mlp_tiles {knobs.mlp_tiles})",
             "activations", positions * (8 if trained else 4) * knobs.weight_bytes * shape.mlp_width)]


def checkpointed_inputs(shape: ModelShape, knobs: Knobs, tokens: int) -> float:
    """Bytes of every layer's checkpointed input of `tokens` positions (on the host with checkpoint_offload)."""
    return tokens * shape.layers * knobs.weight_bytes * shape.hidden


def device_inputs(shape: ModelShape, knobs: Knobs, tokens: int) -> float:
    """The checkpointed inputs on the device: all of them, or with checkpoint_offload the two in
    flight (the one a copy is bringing back, the one the backward recomputes)."""
    layers = min(2, shape.layers) if knobs.checkpoint_offload else shape.layers
    return tokens * layers * knobs.weight_bytes * shape.hidden


def _stored(shape: ModelShape, knobs: Knobs, tokens: int, layer: float) -> float:
    """Activations a trained model's forward keeps for its backward on the device (checkpointing:
    each layer's input)."""
    if knobs.gradient_checkpointing:
        return device_inputs(shape, knobs, tokens)
    return tokens * shape.layers * layer


def trained_pass(use: ModelUse, knobs: Knobs, workload: Workload, kernel: str) -> tuple[list[Pass], list[Pass]]:
    """A trained model's forward + backward over one micro batch, at its two largest moments:
    (backward through the loss, backward through the layers). The logits and their gradient
    are freed once the LM head's backward has run, before any layer's; the layers' backward
    then recomputes one layer at a time (checkpointing) and holds its activation gradients."""
    shape, role, b = use.shape, use.role, knobs.weight_bytes
    tokens = workload.train_tokens(knobs)
    layer = layer_activation_bytes(shape, knobs, kernel, line_width(knobs, workload, kernel, tokens))
    mask = (f"{role} attention mask ({kernel})", "activations", attention_mask_bytes(knobs, workload, kernel, tokens))
    if knobs.gradient_checkpointing:
        inputs = device_inputs(shape, knobs, tokens)
        which = "2 layer inputs in flight, the rest on the host" if knobs.checkpoint_offload else "layer inputs"
        at_loss = [(f"{role} activations (checkpointed: {which})", "activations", inputs)]
        in_layers = [(f"{role} activations (checkpointed: {which} + one layer recomputed)", "activations",
                      inputs + tokens * layer)]
    else:
        stored = (f"{role} activations ({shape.layers} layers)", "activations", tokens * shape.layers * layer)
        at_loss, in_layers = [stored], [stored]
    exchanged = " and all-to-all copies" if knobs.sequence_parallel > 1 else ""
    in_layers.append((f"{role} activation gradients (one layer's backward{exchanged})", "activations",
                      tokens * backward_bytes(shape, knobs, kernel, line_width(knobs, workload, kernel, tokens))))
    in_layers += mlp_tile(role, shape, knobs, tokens, trained=True)
    if use.head == "lm":
        at_loss.append((f"{role} logits + their gradient ({knobs.precision}), fp32 log-prob chunks{tiled(knobs)}",
                        "logits", logits_bytes(shape, logit_positions(knobs, tokens), b, trained=True)))
    return at_loss + [mask], in_layers + [mask]


def frozen_forward(use: ModelUse, knobs: Knobs, workload: Workload, kernel: str) -> list[Pass]:
    """A frozen model's no-grad forward over one scoring micro batch."""
    shape, role = use.shape, use.role
    tokens = workload.scoring_tokens(knobs)
    layer = layer_activation_bytes(shape, knobs, kernel, line_width(knobs, workload, kernel, tokens))
    out = [(f"{role} forward activations (one layer, no grad)", "activations", tokens * layer),
           (f"{role} attention mask ({kernel})", "activations", attention_mask_bytes(knobs, workload, kernel, tokens))]
    out += mlp_tile(role, shape, knobs, tokens, trained=False)
    if use.head == "lm":
        out.append((f"{role} logits ({knobs.precision}), fp32 log-prob chunks{tiled(knobs)}", "logits",
                    logits_bytes(shape, logit_positions(knobs, tokens), knobs.weight_bytes, trained=False)))
    return out


def held_while_reference_runs(policy: ModelUse, knobs: Knobs, workload: Workload, kernel: str) -> list[Pass]:
    """DPO: what the policy's forward left for its backward while the reference runs."""
    shape, tokens = policy.shape, workload.train_tokens(knobs)
    layer = layer_activation_bytes(shape, knobs, kernel, line_width(knobs, workload, kernel, tokens))
    held = _stored(shape, knobs, tokens, layer) + knobs.weight_bytes * tokens * shape.vocab
    if not knobs.gradient_checkpointing:  # the policy's mask is saved for its attention backward
        held += attention_mask_bytes(knobs, workload, kernel, tokens)
    return [(f"{policy.role}'s stored activations and logits, held while the reference runs", "activations", held)]
