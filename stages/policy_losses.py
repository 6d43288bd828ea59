"""RL policy and value losses: importance ratios, the clipped policy loss and its aggregation, the
value loss, the KL penalty and its coefficient controllers (stages/ppo.py, stages/rollout.py).

Pure PyTorch tensor code, following stages/masked.py's conventions.
"""

from __future__ import annotations

import torch

from stages.masked import as_bool_mask, check_same_shape

__all__ = [
    "importance_log_ratio",
    "sampler_correction",
    "IMPORTANCE_SAMPLING",
    "policy_loss",
    "aggregate_loss",
    "LOSS_AGGREGATIONS",
    "value_loss",
    "kl_penalty",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING: tuple[str, ...] = ("token", "sequence")
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "sequence_sum_normalized")


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
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    m = as_bool_mask(mask)
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
    return torch.where(as_bool_mask(mask), torch.exp(log_ratio).clamp(max=cap), torch.ones_like(log_ratio))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    importance_sampling: str = "token",
    sampler_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    m = as_bool_mask(mask)
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
    tokens: float | None = None,
    sequences: float | None = None,
    max_len: int | None = None,
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
    check_same_shape(losses=losses, mask=mask)
    m = as_bool_mask(mask)
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
) -> tuple[torch.Tensor, torch.Tensor]:
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
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = as_bool_mask(mask)
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
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
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

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
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

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        """No-op; returns the (unchanged) value."""
        return self.value
