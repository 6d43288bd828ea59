"""Log-probabilities, entropy and the supervised / preference losses of LLM post-training.

Pure PyTorch tensor code: no DeepSpeed, no transformers.  Everything here is a
stateless function of tensors, so it can be unit-tested on CPU and reused by the
SFT, reward-model, DPO and RL stages.

Conventions: stages/masked.py (masks, shapes, reductions over an empty mask).
RL's advantage estimators are in stages/advantages.py, its policy and value losses in
stages/policy_losses.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from stages.masked import as_bool_mask, check_same_shape, compute_dtype

__all__ = [
    "sequence_logprobs",
    "token_logprobs",
    "next_token_logprobs",
    "tiled_next_token_logprobs",
    "entropy_from_logits",
    "dpo_loss",
    "DPO_LOSS_TYPES",
    "reward_pair_loss",
]

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


# --------------------------------------------------------------------------- #
# Log-probabilities and entropy
# --------------------------------------------------------------------------- #
# Rows of the (rows, V) logits processed at once when up-casting to float32:
# about 2**25 float32 elements (128 MiB) per chunk.
_CHUNK_ELEMS = 1 << 25


def _row_chunks(n_rows: int, vocab: int):
    step = max(1, _CHUNK_ELEMS // max(vocab, 1))
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


class _TokenLogprob(torch.autograd.Function):
    """log_softmax(z)[y] per row, computed in chunks in float32.

    Forward saves only the (native-dtype) logits, targets and the per-row
    log-sum-exp, so no (rows, V) float32 tensor outlives a chunk.  Backward:
    d/dz_v log_softmax(z)[y] = 1[v = y] - softmax(z)_v.
    """

    @staticmethod
    def forward(ctx, logits2d: torch.Tensor, targets: torch.Tensor, out_dtype: torch.dtype):
        n, vocab = logits2d.shape
        picked = torch.gather(logits2d, 1, targets.unsqueeze(1)).squeeze(1).to(out_dtype)
        lse = torch.empty(n, dtype=out_dtype, device=logits2d.device)
        for a, b in _row_chunks(n, vocab):
            lse[a:b] = torch.logsumexp(logits2d[a:b].to(out_dtype), dim=-1)
        ctx.save_for_backward(logits2d, targets, lse)
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits2d, targets, lse = ctx.saved_tensors
        n, vocab = logits2d.shape
        grad = torch.empty_like(logits2d)
        for a, b in _row_chunks(n, vocab):
            g = grad_out[a:b].to(lse.dtype).unsqueeze(1)
            probs = torch.exp(logits2d[a:b].to(lse.dtype) - lse[a:b].unsqueeze(1))
            chunk = -g * probs
            chunk.scatter_add_(1, targets[a:b].unsqueeze(1), g)
            grad[a:b] = chunk.to(grad.dtype)
        return grad, None, None


def sequence_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    average: bool = False,
) -> torch.Tensor:
    r"""Log-probability of the response tokens of each sequence: the masked sum
    (or mean, with average=True) of :func:`token_logprobs`.
    """
    token_logps = token_logprobs(logits, labels, loss_mask)
    total = token_logps.sum(dim=-1)
    if average:
        count = as_bool_mask(loss_mask[:, 1:]).sum(dim=-1).clamp(min=1)
        return total / count.to(total.dtype)
    return total


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    r"""Per-token log-probability of the response tokens, ``(B, T-1)``, 0 elsewhere.

    Causal-LM alignment: the logits at position ``t`` predict the token at
    ``t + 1``, so ``logits[:, :-1]`` is scored against ``labels[:, 1:]`` and
    ``loss_mask[:, 1:]``.  ``loss_mask`` is expressed in *label* positions
    (it marks which tokens of ``labels`` are response tokens), so ``labels``
    can simply be ``input_ids``.

    .. math::
        \ell_{b,t} = \log\operatorname{softmax}(z_{b,t})[y_{b,t+1}]
                   = z_{b,t,y_{b,t+1}} - \log\sum_v e^{z_{b,t,v}}

        \text{sum:}\quad  S_b = \sum_{t=0}^{T-2} m_{b,t+1}\,\ell_{b,t}
        \qquad
        \text{average:}\quad  S_b / \max\big(1, \sum_{t} m_{b,t+1}\big)

    Args:
        logits: ``(B, T, V)`` any floating dtype (bf16/fp16/fp32/fp64).
        labels: ``(B, T)`` integer token ids.  Ids at masked-out positions are
            ignored and may be anything (e.g. ``-100``).
        loss_mask: ``(B, T)`` 1/0 or bool, aligned with ``labels``.

    Returns:
        ``(B, T-1)`` float32 (float64 if ``logits`` is float64): entry ``t`` is
        the log-probability of ``labels[:, t+1]``, 0 where ``loss_mask[:, t+1]``
        is 0.  Differentiable w.r.t. ``logits`` (first-order only).

    Precision / memory: the log-softmax is computed in float32 (float64 for
    float64 input) in row chunks of about 128 MiB, and only the selected
    token's log-probability plus one log-sum-exp per position are kept for
    backward (a custom autograd function), so no ``(B, T, V)`` float32 copy is
    ever materialised, with or without grad.  The gradient is returned in the
    dtype of ``logits``.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2] or loss_mask.shape != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} "
            f"must both be (B, T) = {tuple(logits.shape[:2])}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    # Target for position t is labels[t + 1]; the last position has none (masked, dropped below).
    # Scoring all T positions (one wasted position per row) keeps the reshape a view for
    # contiguous logits, instead of copying logits[:, :-1].
    targets = torch.zeros_like(labels, dtype=torch.long)
    targets[:, :-1] = labels[:, 1:]
    mask = torch.zeros_like(loss_mask, dtype=torch.bool)
    mask[:, :-1] = as_bool_mask(loss_mask[:, 1:])
    return next_token_logprobs(logits, targets, mask)[:, :-1]


def next_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""``(B, T)``: entry ``t`` is ``log_softmax(logits[:, t])[targets[:, t]]`` where ``mask``, else 0.

    :func:`token_logprobs` with the targets already aligned to the logits (each
    position's next token): what a process that holds only some positions of a
    line can compute (stages/sequence_parallel.py).  Same precision and memory.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2] or mask.shape != targets.shape:
        raise ValueError(f"logits (B, T, V) with targets and mask (B, T): got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(mask.shape)}")
    out_dtype = compute_dtype(logits.dtype)
    bsz, seqlen, vocab = logits.shape
    mask = as_bool_mask(mask)
    # Ignored ids (e.g. -100) become 0 before gathering.
    safe = torch.where(mask, targets, torch.zeros_like(targets)).long()
    flat = _TokenLogprob.apply(logits.reshape(bsz * seqlen, vocab), safe.reshape(-1), out_dtype)
    token_logps = flat.view(bsz, seqlen)
    return torch.where(mask, token_logps, torch.zeros_like(token_logps))


class _TiledHead(torch.autograd.Function):
    """next_token_logprobs(head(hidden), targets, mask), `tile` positions of the head at a time.

    The forward keeps no logits; the backward runs the head again tile by tile and backpropagates
    each tile's log-probs on their own, so at most one tile's (tile, V) logits and their gradient
    exist at once. DeepSpeed's ZeRO reduces a weight's gradient when it is told it is ready
    (`ds_grad_is_ready`): the head's weights are marked ready at the last tile, or, when the head
    shares its weight with the input embedding (`tied`), left for the embedding's gradient to make
    ready, later in the same backward.
    """

    @staticmethod
    def forward(ctx, hidden, targets, mask, head, tile: int, untied: tuple, tied: tuple):
        ctx.head, ctx.tile, ctx.untied, ctx.tied = head, tile, untied, tied
        ctx.save_for_backward(hidden, targets, mask)
        flat, positions = hidden.reshape(1, -1, hidden.shape[-1]), targets.reshape(1, -1)
        ready = mask.reshape(1, -1)
        out = torch.cat([next_token_logprobs(head(flat[:, a:a + tile]), positions[:, a:a + tile], ready[:, a:a + tile])
                         for a in range(0, flat.shape[1], tile)], dim=1)
        return out.view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, targets, mask = ctx.saved_tensors
        flat = hidden.detach().reshape(1, -1, hidden.shape[-1])
        positions, ready, grads = targets.reshape(1, -1), mask.reshape(1, -1), grad_out.reshape(1, -1)
        grad_hidden = torch.zeros_like(flat)
        starts = range(0, flat.shape[1], ctx.tile)
        for a in starts:
            for param in ctx.untied:
                param.ds_grad_is_ready = a == starts[-1]
            for param in ctx.tied:
                param.ds_grad_is_ready = False
            piece = flat[:, a:a + ctx.tile].detach().requires_grad_(True)
            with torch.enable_grad():
                logps = next_token_logprobs(ctx.head(piece), positions[:, a:a + ctx.tile], ready[:, a:a + ctx.tile])
            torch.autograd.backward(logps, grads[:, a:a + ctx.tile])
            grad_hidden[:, a:a + ctx.tile] = piece.grad
        for param in ctx.untied + ctx.tied:
            param.ds_grad_is_ready = True
        return grad_hidden.view_as(hidden), None, None, None, None, None, None


def tiled_next_token_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                              targets: torch.Tensor, mask: torch.Tensor, tile: int,
                              untied: Sequence[torch.Tensor] = (), tied: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    r"""``next_token_logprobs(head(hidden), targets, mask)`` without ever holding the ``(B, T, V)``
    logits: ``head`` (the LM head) runs on ``tile`` positions at a time, in the forward and again
    in the backward. Same values and gradients, up to the head's matmul rounding per tile.

    Args:
        head: the LM head, ``(1, n, H) -> (1, n, V)``.
        hidden: ``(B, T, H)``, the last hidden states.
        targets, mask: ``(B, T)``, each position's next token and whether it is learned.
        tile: positions per head call.
        untied, tied: the head's trainable weights, apart from or shared with the input
            embedding (for DeepSpeed's gradient bucketing; empty without DeepSpeed).
    """
    if tile < 1:
        raise ValueError(f"tile must be at least 1, got {tile}")
    return _TiledHead.apply(hidden, targets, mask, head, tile, tuple(untied), tuple(tied))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    r"""Entropy of the categorical distribution at every position.

    .. math::
        H(z) = -\sum_v p_v \log p_v
             = \log\sum_v e^{z_v} - \sum_v p_v z_v, \qquad p = \operatorname{softmax}(z)

    Args:
        logits: ``(..., V)`` any floating dtype, e.g. ``(B, T, V)``.

    Returns:
        ``(...)`` float32 (float64 for float64 input), e.g. ``(B, T)``.
        Computed in float32 in row chunks (plain autograd: under grad the
        float32 chunks are kept for backward).  Not masked: apply your mask
        (e.g. :func:`masked_mean`) afterwards.
    """
    out_dtype = compute_dtype(logits.dtype)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)

    parts = []
    for a, b in _row_chunks(flat.shape[0], vocab):
        z = flat[a:b].to(out_dtype)
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        # 0 * log 0 = 0 (logits of -inf, e.g. a masked vocabulary, give no NaN).
        plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
        parts.append(-plogp.sum(dim=-1))
    if not parts:
        return logits.new_zeros(logits.shape[:-1], dtype=out_dtype)
    return torch.cat(parts).view(logits.shape[:-1])


# --------------------------------------------------------------------------- #
# Preference losses
# --------------------------------------------------------------------------- #
def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Direct Preference Optimisation loss (Rafailov et al. 2023) and variants.

    With :math:`\pi` the policy and :math:`\pi_{ref}` the frozen reference,
    sequence log-probabilities of chosen (c) and rejected (r) responses:

    .. math::
        h = (\log\pi_c - \log\pi_r) - (\log\pi_{ref,c} - \log\pi_{ref,r})

    * ``"sigmoid"`` (DPO; conservative DPO / cDPO when :math:`\varepsilon > 0`):

      .. math::
          L = -(1-\varepsilon)\,\log\sigma(\beta h) - \varepsilon\,\log\sigma(-\beta h)

      With :math:`\varepsilon` = ``label_smoothing`` = assumed probability that a
      preference label is flipped.  :math:`L = \log 2` when policy = reference.
    * ``"ipo"`` (Azar et al. 2023): :math:`L = \big(h - \tfrac{1}{2\beta}\big)^2`
      (here ``beta`` is IPO's :math:`\tau`; ``label_smoothing`` must be 0).

    Implicit rewards (detached, for logging / accuracy):

    .. math::
        r_c = \beta(\log\pi_c - \log\pi_{ref,c}), \qquad
        r_r = \beta(\log\pi_r - \log\pi_{ref,r})

    Args:
        All four log-prob tensors are ``(B,)`` (typically from
        :func:`sequence_logprobs`, summed not averaged for standard DPO).
        beta: > 0.
        label_smoothing: :math:`\varepsilon \in [0, 0.5)`.
        loss_type: one of :data:`DPO_LOSS_TYPES`.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``.  ``losses``
        is per example (take ``.mean()`` yourself).

    Raises:
        ValueError: unknown ``loss_type``, ``beta <= 0``, ``label_smoothing``
            outside ``[0, 0.5)``, or non-zero ``label_smoothing`` with ``"ipo"``.
    """
    _check_dpo_settings(beta, label_smoothing, loss_type)
    check_same_shape(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                     ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    losses = _dpo_losses(chosen_logratios - rejected_logratios, beta, label_smoothing, loss_type)
    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    return losses, chosen_rewards, rejected_rewards


def _check_dpo_settings(beta: float, label_smoothing: float, loss_type: str) -> None:
    """ValueError for a loss type, beta or label smoothing that dpo_loss does not define."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}"
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing != 0:
        raise ValueError("label_smoothing is not defined for loss_type='ipo'; use 0")


def _dpo_losses(h: torch.Tensor, beta: float, label_smoothing: float, loss_type: str) -> torch.Tensor:
    """Per-pair losses of `loss_type` from h, the policy's log-ratio margin over the reference's."""
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    losses = -F.logsigmoid(beta * h) * (1.0 - label_smoothing)
    if label_smoothing > 0:
        losses = losses - F.logsigmoid(-beta * h) * label_smoothing
    return losses


def reward_pair_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> torch.Tensor:
    r"""Bradley–Terry pairwise loss for reward-model training.

    .. math::
        L = -\log\sigma(r_c - r_r - m)

    (``m = 0`` when ``margin`` is None; Llama-2 style margin otherwise.)

    Args:
        chosen_rewards, rejected_rewards: ``(B,)`` scalar rewards per pair.
        margin: None, a float, or a tensor broadcastable to ``(B,)``.

    Returns:
        ``(B,)`` per-pair losses.
    """
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)
