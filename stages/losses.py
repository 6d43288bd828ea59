"""Loss functions and advantage estimators for LLM post-training.

Pure PyTorch tensor code: no DeepSpeed, no transformers.  Everything here is a
stateless function of tensors (plus two tiny KL-coefficient controllers), so it
can be unit-tested on CPU and reused by the SFT, reward-model, DPO, PPO, GRPO,
RLOO and REINFORCE++ stages.

Conventions used throughout
---------------------------
* ``B`` = batch size, ``T`` = sequence length, ``V`` = vocabulary size.
* A *mask* is a tensor of the same shape as the data it masks, holding 1/0
  (any numeric dtype) or True/False.  Any non-zero entry counts as "valid";
  masks are binarised, never used as fractional weights.
* Masked-out positions never influence a result, even if they hold NaN/inf or
  out-of-vocabulary label ids (e.g. ``-100``).
* Per-token outputs (advantages, returns, whitened values) are exactly ``0`` at
  masked-out positions.
* Reductions over an empty mask return ``0`` rather than NaN.
* Statistics returned for logging are detached 0-dim tensors (no host sync);
  call ``.item()`` when you need a Python number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from core import estimators

__all__ = [
    "sequence_logprobs",
    "token_logprobs",
    "next_token_logprobs",
    "tiled_next_token_logprobs",
    "dpo_loss",
    "DPO_LOSS_TYPES",
    "reward_pair_loss",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "gae",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_returns",
    "token_rewards",
    "AdvantageInputs",
    "AdvantageSettings",
    "ADVANTAGE_ESTIMATORS",
    "estimate_advantages",
    "SCALE_REWARDS",
    "importance_log_ratio",
    "IMPORTANCE_SAMPLING",
    "policy_loss",
    "aggregate_loss",
    "LOSS_AGGREGATIONS",
    "value_loss",
    "kl_penalty",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "entropy_from_logits",
]

DPO_LOSS_TYPES: Tuple[str, ...] = ("sigmoid", "ipo")
KL_ESTIMATORS: Tuple[str, ...] = ("k1", "k2", "k3")
SCALE_REWARDS: Tuple[str, ...] = ("group", "batch", "none")
IMPORTANCE_SAMPLING: Tuple[str, ...] = ("token", "sequence")
LOSS_AGGREGATIONS: Tuple[str, ...] = ("token_mean", "sequence_mean", "sequence_sum_normalized")

# Sums a 1-D float64 tensor over every process (an all-reduce); statistics that span a
# rollout use it so that they do not depend on how the rollout is split over processes.
SumOverProcesses = Callable[[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _discounted_reverse_cumsum(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = m_t * (r_t + gamma * G_{t+1}), G_T = 0, over the last dim."""
    m = _as_bool_mask(mask)
    r = torch.where(m, rewards, torch.zeros_like(rewards))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[..., 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        running = torch.where(m[..., t], r[..., t] + gamma * running, torch.zeros_like(running))
        out[..., t] = running
    return out


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
        count = _as_bool_mask(loss_mask[:, 1:]).sum(dim=-1).clamp(min=1)
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
    mask[:, :-1] = _as_bool_mask(loss_mask[:, 1:])
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
    out_dtype = _compute_dtype(logits.dtype)
    bsz, seqlen, vocab = logits.shape
    mask = _as_bool_mask(mask)
    # Ignored ids (e.g. -100) become 0 before gathering.
    safe = torch.where(mask, targets, torch.zeros_like(targets)).long()
    token_logps = _TokenLogprob.apply(logits.reshape(bsz * seqlen, vocab), safe.reshape(-1), out_dtype).view(bsz, seqlen)
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
    out_dtype = _compute_dtype(logits.dtype)
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}"
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    _check_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )

    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratios - rejected_logratios

    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1.0 - label_smoothing)
        if label_smoothing > 0:
            losses = losses - F.logsigmoid(-beta * h) * label_smoothing
    else:  # ipo
        if label_smoothing != 0:
            raise ValueError("label_smoothing is not defined for loss_type='ipo'; use 0")
        losses = (h - 1.0 / (2.0 * beta)) ** 2

    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    return losses, chosen_rewards, rejected_rewards


def reward_pair_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: Optional[Union[torch.Tensor, float]] = None,
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
    _check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


# --------------------------------------------------------------------------- #
# Masked statistics
# --------------------------------------------------------------------------- #
def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None
) -> torch.Tensor:
    r"""Mean of ``x`` over the positions where ``mask`` is non-zero.

    .. math::
        \bar x = \frac{\sum_i m_i x_i}{\max(1, \sum_i m_i)}

    Args:
        x: any shape.
        mask: same shape as ``x``, 1/0 or bool.
        dim: reduce over this dim only (result drops it); None = all elements
            (0-dim result).

    Returns:
        The masked mean; 0 where the mask is empty.  Masked-out entries of ``x``
        may be NaN/inf without affecting the result.
    """
    _check_same_shape(x=x, mask=mask)
    m = _as_bool_mask(mask)
    xm = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1).to(xm.dtype)
    return xm.sum(dim=dim) / m.sum(dim=dim).clamp(min=1).to(xm.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    r"""Variance of ``x`` over all masked positions (0-dim).

    .. math::
        \operatorname{var} = \frac{\sum_i m_i (x_i - \bar x)^2}{n - 1}
        \ \text{(unbiased, Bessel)}\quad\text{or}\quad
        \frac{\sum_i m_i (x_i - \bar x)^2}{n}\ \text{(biased)},\qquad n = \sum_i m_i

    Returns 0 when ``n <= 1`` (unbiased) or ``n == 0`` (biased).
    """
    m = _as_bool_mask(mask)
    mean = masked_mean(x, m)
    centered = torch.where(m, x - mean, torch.zeros_like(x))
    n = m.sum()
    denom = (n - 1) if unbiased else n
    return centered.pow(2).sum() / denom.clamp(min=1).to(x.dtype)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    eps: float = 1e-8,
    sum_over_processes: Optional[SumOverProcesses] = None,
) -> torch.Tensor:
    r"""Normalise ``x`` to unit variance using statistics of the masked entries.

    Statistics are taken over *all* masked elements of the tensor (the whole
    batch) and, with ``sum_over_processes``, over every process's tensor, with
    the **unbiased** (Bessel, ``n - 1``) variance, as in common PPO
    implementations:

    .. math::
        \mu = \frac{\sum_i m_i x_i}{n}, \quad
        \sigma^2 = \frac{\sum_i m_i (x_i - \mu)^2}{n - 1}, \qquad n = \sum_i m_i

        \text{shift\_mean=True:}\quad  y = (x - \mu) / \sqrt{\sigma^2 + \epsilon}

        \text{shift\_mean=False:}\quad y = (x - \mu) / \sqrt{\sigma^2 + \epsilon} + \mu

    i.e. with ``shift_mean=False`` the spread is rescaled but the original mean
    is kept (useful for rewards, whose sign matters).

    Args:
        x: any shape.
        mask: same shape, 1/0 or bool.
        shift_mean: see above.
        eps: added to the variance.
        sum_over_processes: sums a 1-D float64 tensor over all processes (e.g.
            an all-reduce); None = this tensor is the whole batch.  The sums
            are taken in float64, so the result does not depend on how the
            batch is split over processes (beyond float64 rounding).

    Returns:
        Same shape and dtype as ``x``, 0 at masked-out positions.  With fewer
        than two valid entries the variance is taken as 0.
    """
    _check_same_shape(x=x, mask=mask)
    m = _as_bool_mask(mask)
    mean, var = _global_mean_var(x, m, sum_over_processes)
    y = (x.double() - mean) / math.sqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return torch.where(m, y, torch.zeros_like(y)).to(x.dtype)


def _global_mean_var(
    x: torch.Tensor, m: torch.Tensor, sum_over_processes: Optional[SumOverProcesses]
) -> Tuple[float, float]:
    """Mean and unbiased variance of x where m, over every process (two float64 sums)."""
    reduce = sum_over_processes or (lambda sums: sums)
    xd = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    total, count = reduce(torch.stack([xd.sum(), m.sum().double()])).tolist()
    mean = total / max(count, 1.0)
    centered = torch.where(m, xd - mean, torch.zeros_like(xd))
    (squares,) = reduce(centered.pow(2).sum().reshape(1)).tolist()
    return mean, squares / max(count - 1.0, 1.0)


# --------------------------------------------------------------------------- #
# Advantage / return estimators
# --------------------------------------------------------------------------- #
def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Generalised Advantage Estimation (Schulman et al. 2016), per token.

    Reverse-time recursion over the valid (masked) tokens of each row:

    .. math::
        \delta_t = r_t + \gamma V_{t+1} - V_t, \qquad
        A_t = \delta_t + \gamma\lambda A_{t+1}, \qquad
        R_t = A_t + V_t

    where :math:`V_{t+1}` and :math:`A_{t+1}` are 0 when position ``t + 1`` is
    not a valid token (past the end of the response), so the last response
    token bootstraps from 0 (terminal state).

    Args:
        values: ``(B, T)`` critic values :math:`V_t`.
        rewards: ``(B, T)`` per-token rewards (e.g. -β·KL everywhere plus the
            scalar score at the last valid token).
        mask: ``(B, T)`` 1/0 or bool, the valid response tokens.  Expected to be
            one contiguous run per row (right padding; left prompt positions
            masked out are fine).  A hole inside a row acts as an episode end.
        gamma: discount :math:`\gamma`.
        lam: GAE :math:`\lambda`.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, 0 at masked-out positions,
        computed without gradient (detached).  Advantages are *not* whitened;
        use :func:`masked_whiten` if desired.
    """
    _check_same_shape(values=values, rewards=rewards, mask=mask)
    m = _as_bool_mask(mask)
    with torch.no_grad():
        zero = torch.zeros_like(values)
        v = torch.where(m, values, zero).detach()
        r = torch.where(m, rewards.to(values.dtype), zero).detach()
        T = v.shape[-1]
        adv = torch.zeros_like(v)
        next_value = torch.zeros_like(v[:, 0])
        next_adv = torch.zeros_like(v[:, 0])
        for t in range(T - 1, -1, -1):
            delta = r[:, t] + gamma * next_value - v[:, t]
            a_t = torch.where(m[:, t], delta + gamma * lam * next_adv, torch.zeros_like(delta))
            adv[:, t] = a_t
            next_adv = a_t
            next_value = v[:, t]  # already 0 where invalid
        returns = torch.where(m, adv + v, zero)
    return adv, returns


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    scale: str = "group",
    *,
    valid: Optional[torch.Tensor] = None,
    sum_over_processes: Optional[SumOverProcesses] = None,
) -> torch.Tensor:
    r"""Group-relative advantages (GRPO, Shao et al. 2024) and their variants.

    Samples of one prompt are contiguous: rows ``[g*k, (g+1)*k)`` form group
    ``g`` (``k = group_size``).  Outcome supervision, one scalar per sample,
    centred on its group's mean and divided by a spread that ``scale`` picks:

    .. math::
        A_i = \frac{r_i - \bar r_g}{s + \epsilon}

    * ``"group"``: :math:`s = s_g`, the group's **unbiased** (``k - 1``)
      standard deviation (GRPO; TRL's default);
    * ``"batch"``: :math:`s` is the unbiased standard deviation of every
      reward of the rollout, over all processes (``sum_over_processes``);
      PPO-Lite's "group mean, batch std";
    * ``"none"``: :math:`A_i = r_i - \bar r_g` (Dr. GRPO, Liu et al. 2025:
      dividing by the group std favours prompts that are too easy or too hard).

    With ``group_size == 1`` the advantages are all 0.

    Args:
        rewards: ``(N,)`` with ``N = n_prompts * group_size``.
        group_size: ``k >= 1``; must divide ``N``.
        eps: added to the std.
        scale: one of :data:`SCALE_REWARDS`.
        valid: ``(N,)`` bool, the samples the batch statistic counts (default
            all); groups are always centred on all their samples.
        sum_over_processes: see :func:`masked_whiten`; used by ``"batch"``.

    Returns:
        ``(N,)`` float advantages (broadcast them over tokens yourself).
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALE_REWARDS)}")
    g = _grouped(rewards, group_size, min_size=1)
    centered = g - g.mean(dim=1, keepdim=True)
    if scale == "group":
        std = (centered.pow(2).sum(dim=1, keepdim=True) / max(group_size - 1, 1)).sqrt()
        centered = centered / (std + eps)
    elif scale == "batch":
        flat = g.reshape(-1)
        keep = torch.ones_like(flat, dtype=torch.bool) if valid is None else _as_bool_mask(valid)
        _, var = _global_mean_var(flat, keep, sum_over_processes)
        centered = centered / (math.sqrt(var) + eps)
    return centered.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r"""REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024).

    .. math::
        A_i = r_i - \frac{1}{k-1}\sum_{j \in g,\, j \ne i} r_j
            = \frac{k}{k-1}\,(r_i - \bar r_g)

    Args:
        rewards: ``(N,)``, groups of ``group_size`` contiguous samples.
        group_size: ``k >= 2``.

    Raises:
        ValueError: ``group_size < 2`` or ``N`` not divisible by it.
    """
    g = _grouped(rewards, group_size, min_size=2)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def _grouped(rewards: torch.Tensor, group_size: int, min_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got {tuple(rewards.shape)}")
    if int(group_size) != group_size or group_size < min_size:
        raise ValueError(f"group_size must be an integer >= {min_size}, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})"
        )
    r = rewards if rewards.is_floating_point() else rewards.float()
    return r.reshape(-1, int(group_size))


def reinforce_pp_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    sum_over_processes: Optional[SumOverProcesses] = None,
) -> torch.Tensor:
    r"""REINFORCE++ token-level advantages (Hu 2025): discounted returns,
    then whitened over the whole rollout (every process's share).

    .. math::
        G_t = r_t + \gamma G_{t+1} \ \ (G = 0 \text{ past the last valid token}),
        \qquad
        A_t = \frac{G_t - \mu_G}{\sqrt{\sigma_G^2 + 10^{-8}}}

    with :math:`\mu_G, \sigma_G^2` the masked mean and **unbiased** variance of
    :math:`G` over all valid tokens of the rollout (:func:`masked_whiten`).

    Args:
        rewards: ``(B, T)`` per-token rewards; the caller places the sequence
            score at the last valid token (and may add per-token KL terms).
        mask: ``(B, T)`` valid response tokens, 1/0 or bool.
        gamma: discount.
        sum_over_processes: see :func:`masked_whiten`.

    Returns:
        ``(B, T)`` whitened returns (used as advantages), 0 at masked-out
        positions, detached.
    """
    _check_same_shape(rewards=rewards, mask=mask)
    with torch.no_grad():
        returns = _discounted_reverse_cumsum(rewards.detach(), mask, gamma)
        return masked_whiten(returns, mask, shift_mean=True, sum_over_processes=sum_over_processes)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    r"""Per-token rewards of a sequence-level score: :math:`r_t = -\beta\,KL_t`
    on every response token, plus the score on the last one.

    Args:
        scores: ``(B,)``.  kl, mask: ``(B, T)``.  kl_coef: :math:`\beta`.

    Returns:
        ``(B, T)``, 0 outside the mask (a row with an empty mask gets nothing).
    """
    m = _as_bool_mask(mask)
    out = torch.where(m, -kl_coef * kl, torch.zeros_like(kl))
    last = m.long().cumsum(dim=1).argmax(dim=1)  # the last response position of each row
    has_tokens = m.any(dim=1)
    rows = torch.arange(m.shape[0], device=m.device)
    out[rows, last] += torch.where(has_tokens, scores.to(out.dtype), torch.zeros_like(out[:, 0]))
    return out


@dataclass(frozen=True)
class AdvantageInputs:
    """What every estimator reads: one process's share of a rollout.

    ``S`` sequences, the samples of each prompt contiguous (groups never span
    processes); ``T`` target positions (``token_logprobs`` alignment).
    """

    scores: torch.Tensor  # (S,) each sequence's reward
    kl: torch.Tensor  # (S, T) per-token KL estimate to the reference, 0 off the mask
    mask: torch.Tensor  # (S, T) response tokens that train (a sequence with none is left out of statistics)
    kl_coef: float = 0.0  # weight of the KL inside the reward (0: none, e.g. the KL is a loss term)
    values: Optional[torch.Tensor] = None  # (S, T) critic values (gae)


@dataclass(frozen=True)
class AdvantageSettings:
    group_size: int = 1  # samples per prompt
    gamma: float = 1.0
    lam: float = 0.95
    scale_rewards: str = "group"  # grpo: group | batch | none


Estimator = Callable[
    [AdvantageInputs, AdvantageSettings, Optional[SumOverProcesses]],
    Tuple[torch.Tensor, Optional[torch.Tensor]],
]


# Each estimator's tensor function, under the name core/estimators.py declares it with (its properties:
# group-relative, a critic, its default samples per prompt).
ADVANTAGE_ESTIMATORS: Dict[str, Estimator] = {}


def advantage_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: the tensor function of the estimator declared as `name` in core/estimators.py
    (KeyError for a name nobody declared: each function has its declaration)."""
    estimators.get(name)

    def bind(function: Estimator) -> Estimator:
        ADVANTAGE_ESTIMATORS[name] = function
        return function

    return bind


@advantage_estimator("gae")
def _gae_estimator(inputs, settings, sum_over_processes):
    rewards = token_rewards(inputs.scores, inputs.kl, inputs.mask, inputs.kl_coef)
    advantages, returns = gae(inputs.values, rewards, inputs.mask, settings.gamma, settings.lam)
    return masked_whiten(advantages, inputs.mask, sum_over_processes=sum_over_processes), returns


@advantage_estimator("reinforce_pp")
def _reinforce_pp_estimator(inputs, settings, sum_over_processes):
    rewards = token_rewards(inputs.scores, inputs.kl, inputs.mask, inputs.kl_coef)
    return reinforce_pp_returns(rewards, inputs.mask, settings.gamma, sum_over_processes=sum_over_processes), None


def _sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """Critic-free estimators take one number per sequence: the KL enters as a sequence penalty."""
    kl = torch.where(_as_bool_mask(inputs.mask), inputs.kl, torch.zeros_like(inputs.kl)).sum(dim=1)
    return inputs.scores.to(kl.dtype) - inputs.kl_coef * kl


@advantage_estimator("grpo")
def _grpo_estimator(inputs, settings, sum_over_processes):
    per_sequence = grpo_advantages(_sequence_scores(inputs), settings.group_size, scale=settings.scale_rewards,
                                   valid=_as_bool_mask(inputs.mask).any(dim=1),
                                   sum_over_processes=sum_over_processes)
    return per_sequence.unsqueeze(1) * inputs.mask.to(per_sequence.dtype), None


@advantage_estimator("rloo")
def _rloo_estimator(inputs, settings, sum_over_processes):
    per_sequence = rloo_advantages(_sequence_scores(inputs), settings.group_size)
    return per_sequence.unsqueeze(1) * inputs.mask.to(per_sequence.dtype), None


def estimate_advantages(
    estimator: str,
    inputs: AdvantageInputs,
    settings: AdvantageSettings,
    sum_over_processes: Optional[SumOverProcesses] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Advantages of a whole rollout, the same call for every estimator.

    * ``gae``: per-token rewards (:func:`token_rewards`), :func:`gae` with the
      critic's values, advantages whitened over the rollout;
    * ``reinforce_pp``: discounted returns of the per-token rewards, whitened
      over the rollout (:func:`reinforce_pp_returns`);
    * ``grpo`` / ``rloo``: one number per sequence (score minus
      :math:`\beta\sum_t KL_t`), :func:`grpo_advantages` (with
      ``settings.scale_rewards``) or :func:`rloo_advantages`, broadcast over the
      sequence's tokens.

    Every statistic that spans sequences (whitening, the batch std) is summed
    over processes with ``sum_over_processes``, so the advantages are the same
    however the rollout is split over processes and micro batches.

    Returns:
        ``(advantages, returns)``: ``(S, T)`` each, 0 off the mask; returns
        (the critic's targets) only for ``gae``, else None.  Detached.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    if estimators.get(estimator).critic and inputs.values is None:
        raise ValueError(f"advantage estimator {estimator} needs the critic's values")
    _check_same_shape(kl=inputs.kl, mask=inputs.mask)
    with torch.no_grad():
        return ADVANTAGE_ESTIMATORS[estimator](inputs, settings, sum_over_processes)


# --------------------------------------------------------------------------- #
# Policy-gradient losses
# --------------------------------------------------------------------------- #
def importance_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    r"""Log of the importance ratio between the current and the behaviour policy.

    * ``"token"`` (PPO, GRPO, DAPO): :math:`\log\rho_{i,t} = \log\pi_{i,t} - \log\pi_{old,i,t}`;
    * ``"sequence"`` (GSPO, Zheng et al. 2025): one ratio per sequence, the
      geometric mean of its token ratios,

      .. math::
          \log s_i = \frac{1}{|y_i|}\sum_{t} \big(\log\pi_{i,t} - \log\pi_{old,i,t}\big),

      repeated on every token of the sequence.  The gradient flows through the
      mean, as in the GSPO paper: :math:`\nabla s_i = s_i\,\frac{1}{|y_i|}\sum_t
      \nabla\log\pi_{i,t}`.

    Returns:
        ``(B, T)``, 0 off the mask (so ``exp`` of it cannot overflow there).
    """
    if level not in IMPORTANCE_SAMPLING:
        raise ValueError(f"unknown importance sampling level {level!r}; valid: {', '.join(IMPORTANCE_SAMPLING)}")
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    m = _as_bool_mask(mask)
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    if level == "sequence":
        per_sequence = log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1).to(log_ratio.dtype)
        log_ratio = torch.where(m, per_sequence.unsqueeze(1).expand_as(log_ratio), torch.zeros_like(log_ratio))
    return log_ratio


def sampler_correction(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
    level: str = "token",
) -> torch.Tensor:
    r"""Truncated importance sampling (TIS) weights for samples drawn by another engine (vLLM), whose
    probabilities differ from the trainer's for the same weights (kernels, precision):

    .. math::
        w_{i,t} = \min\big(\pi_{train}(y_t) / \pi_{sampler}(y_t),\ C\big)

    with :math:`\pi_{train}` the trainer's probability at sampling time (the rollout's old
    log-probs), constant in the loss. ``level="sequence"`` (GSPO) uses one weight per sequence, the
    geometric mean of its token ratios (:func:`importance_log_ratio`), capped.  Multiplied into the
    per-token policy loss, it makes the surrogate's expectation the one under the trainer's policy;
    the cap bounds the variance a rare token could add.

    Returns:
        ``(B, T)`` weights, 1 off the mask.
    """
    log_ratio = importance_log_ratio(trainer_logprobs.detach(), sampler_logprobs, mask, level)
    return torch.where(_as_bool_mask(mask), torch.exp(log_ratio).clamp(max=cap), torch.ones_like(log_ratio))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: Optional[float] = None,
    importance_sampling: str = "token",
    sampler_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""PPO's clipped surrogate, per token, with decoupled clip bounds (DAPO's
    clip-higher) and token- or sequence-level ratios (:func:`importance_log_ratio`).

    .. math::
        \ell_t = -\min\big(\rho_t A_t,\
                 \operatorname{clip}(\rho_t, 1-\epsilon_{low}, 1+\epsilon_{high}) A_t\big)

    ``clip_eps_high`` defaults to ``clip_eps_low`` (symmetric PPO).  Reduce the
    per-token losses with :func:`aggregate_loss`.

    Args:
        logprobs: ``(B, T)`` current policy token log-probs (with grad).
        old_logprobs: ``(B, T)`` behaviour-policy log-probs (treated as constant).
        advantages: ``(B, T)`` (treated as constant).
        mask: ``(B, T)`` 1/0 or bool.
        sampler_weights: ``(B, T)`` :func:`sampler_correction`'s weights, multiplied into each
            token's loss (samples from another engine), or None.

    Returns:
        ``(losses, clipped)``: ``(B, T)`` per-token losses, 0 off the mask, and
        a bool ``(B, T)`` marking the tokens where the clipped term is the
        active one, i.e. :math:`-\operatorname{clip}(\rho)A > -\rho A` strictly
        (the token's gradient is zeroed).  A token with :math:`\rho` outside
        the range but on the unclipped side of the min (e.g.
        :math:`\rho > 1+\epsilon` with :math:`A < 0`) is **not** clipped.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    m = _as_bool_mask(mask)
    ratio = torch.exp(importance_log_ratio(logprobs, old_logprobs, m, importance_sampling))
    adv = advantages.detach().to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + high)
    losses = torch.where(m, torch.maximum(unclipped, clipped), torch.zeros_like(ratio))
    if sampler_weights is not None:
        losses = losses * sampler_weights.detach().to(losses.dtype)
    return losses, (clipped > unclipped).detach() & m


def aggregate_loss(
    losses: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    tokens: Optional[float] = None,
    sequences: Optional[float] = None,
    max_len: Optional[int] = None,
) -> torch.Tensor:
    r"""Reduce per-token losses ``(B, T)`` to a loss, as one of :data:`LOSS_AGGREGATIONS`:

    * ``"token_mean"``: every token of the batch weighs the same (DAPO's
      token-level loss; TRL's default ``loss_type="dapo"``):
      :math:`L = \sum_{i,t} m_{i,t}\ell_{i,t} / \sum_{i,t} m_{i,t}`;
    * ``"sequence_mean"``: each sequence's token mean, averaged over sequences
      (the GRPO paper's; GSPO's with sequence-level ratios):
      :math:`L = \frac{1}{N}\sum_i \frac{1}{|y_i|}\sum_t m_{i,t}\ell_{i,t}`;
    * ``"sequence_sum_normalized"``: token sums over a fixed normaliser, the
      number of sequences times the longest completion allowed (Dr. GRPO), so
      no sequence's length scales its tokens' weight:
      :math:`L = \sum_{i,t} m_{i,t}\ell_{i,t} / (N \cdot L_{max})`.

    ``tokens`` and ``sequences`` default to this batch's own counts (sequences
    with at least one masked token).  Give a whole optimizer step's counts
    (over every micro batch and process) to get this micro batch's *share* of
    the step's loss: the shares add up to the step's loss however the step is
    split.

    Args:
        losses: ``(B, T)`` per-token losses.
        mask: ``(B, T)`` 1/0 or bool.
        mode: the aggregation.
        tokens: denominator of ``token_mean``.
        sequences: :math:`N` of the two sequence modes.
        max_len: :math:`L_{max}` of ``sequence_sum_normalized`` (required there).

    Returns:
        0-dim loss; 0 when the denominator is 0.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
    _check_same_shape(losses=losses, mask=mask)
    m = _as_bool_mask(mask)
    masked = torch.where(m, losses, torch.zeros_like(losses))
    if mode == "token_mean":
        count = float(m.sum()) if tokens is None else float(tokens)
        return masked.sum() / max(count, 1.0)
    n = float(m.any(dim=1).sum()) if sequences is None else float(sequences)
    if mode == "sequence_mean":
        per_sequence = masked.sum(dim=1) / m.sum(dim=1).clamp(min=1).to(masked.dtype)
        return per_sequence.sum() / max(n, 1.0)
    if max_len is None or max_len < 1:
        raise ValueError("loss aggregation sequence_sum_normalized needs max_len, the longest completion allowed")
    return masked.sum() / (max(n, 1.0) * max_len)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""PPO clipped value loss, per token.

    .. math::
        V^{clip}_t = V_{old,t} + \operatorname{clip}(V_t - V_{old,t}, -\epsilon, \epsilon)

        \ell_t = \tfrac12 \max\big((V_t - R_t)^2,\ (V^{clip}_t - R_t)^2\big)

    Args:
        values: ``(B, T)`` current critic values (with grad).
        old_values: ``(B, T)`` critic values at rollout time (constant).
        returns: ``(B, T)`` targets :math:`R_t` (constant).
        mask: ``(B, T)`` 1/0 or bool.
        clip_eps: :math:`\epsilon` (in value units).

    Returns:
        ``(losses, clipped)``: ``(B, T)`` per-token losses, 0 off the mask (reduce
        them with :func:`aggregate_loss`), and a bool ``(B, T)`` marking where
        the clipped error is strictly larger (the active term).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = _as_bool_mask(mask)
    old = old_values.detach()
    ret = returns.detach()
    v_clipped = old + torch.clamp(values - old, -clip_eps, clip_eps)
    err_unclipped = (values - ret) ** 2
    err_clipped = (v_clipped - ret) ** 2
    losses = torch.where(m, 0.5 * torch.maximum(err_unclipped, err_clipped), torch.zeros_like(values))
    return losses, (err_clipped > err_unclipped).detach() & m


# --------------------------------------------------------------------------- #
# KL penalty and controllers
# --------------------------------------------------------------------------- #
def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    r"""Per-token estimate of :math:`KL(\pi\,\|\,\pi_{ref})` from samples of
    :math:`\pi` (Schulman, "Approximating KL Divergence", 2020).

    With :math:`\log r = \log\pi - \log\pi_{ref}`:

    * ``k1``: :math:`\log r` (unbiased, high variance, can be negative)
    * ``k2``: :math:`\tfrac12(\log r)^2` (biased, low variance, >= 0)
    * ``k3``: :math:`e^{-\log r} - 1 + \log r` (unbiased, >= 0)

    Args:
        logprobs, ref_logprobs: same shape, e.g. ``(B, T)``.
        estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        Same shape as the inputs; not masked (mask it yourself).

    Raises:
        ValueError: unknown estimator (the message lists the valid ones).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}"
        )
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = logprobs - ref_logprobs
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    return torch.exp(-log_r) - 1.0 + log_r


class AdaptiveKLController:
    r"""Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences").

    .. math::
        e = \operatorname{clip}\Big(\frac{KL_{cur}}{KL_{target}} - 1,\ -0.2,\ 0.2\Big),
        \qquad
        \beta \leftarrow \beta\,\Big(1 + e\,\frac{n_{steps}}{H}\Big)

    Attributes:
        value: the current coefficient :math:`\beta` (float).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not target > 0:
            raise ValueError(f"target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: Union[float, torch.Tensor], n_steps: int) -> float:
        """Update :attr:`value` from the observed KL over ``n_steps`` samples/steps.

        Returns the new value.
        """
        current = float(current_kl)
        error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class FixedKLController:
    """Constant KL coefficient; same interface as :class:`AdaptiveKLController`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: Union[float, torch.Tensor], n_steps: int) -> float:
        """No-op; returns the (unchanged) value."""
        return self.value
