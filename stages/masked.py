"""Masked tensors: the conventions every loss and estimator here follows, and the statistics
over masked entries (stages/losses.py, stages/advantages.py, stages/policy_losses.py use them).

Pure PyTorch tensor code: no DeepSpeed, no transformers.

Conventions used throughout
---------------------------
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
from collections.abc import Callable

import torch

__all__ = ["as_bool_mask", "check_same_shape", "compute_dtype", "masked_mean", "masked_var", "masked_whiten",
           "global_mean_var", "SumOverProcesses"]

# Sums a 1-D float64 tensor over every process (an all-reduce); statistics that span a
# rollout use it so that they do not depend on how the rollout is split over processes.
SumOverProcesses = Callable[[torch.Tensor], torch.Tensor]


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """`mask` as bool: any non-zero entry counts."""
    return mask if mask.dtype == torch.bool else mask != 0


def check_same_shape(**tensors: torch.Tensor) -> None:
    """ValueError naming each tensor's shape unless all are the same."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32



def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None
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
    check_same_shape(x=x, mask=mask)
    m = as_bool_mask(mask)
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
    m = as_bool_mask(mask)
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
    sum_over_processes: SumOverProcesses | None = None,
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
    check_same_shape(x=x, mask=mask)
    m = as_bool_mask(mask)
    mean, var = global_mean_var(x, m, sum_over_processes)
    y = (x.double() - mean) / math.sqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return torch.where(m, y, torch.zeros_like(y)).to(x.dtype)


def global_mean_var(
    x: torch.Tensor, m: torch.Tensor, sum_over_processes: SumOverProcesses | None
) -> tuple[float, float]:
    """Mean and unbiased variance of x where m, over every process (two float64 sums)."""
    reduce = sum_over_processes or (lambda sums: sums)
    xd = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    total, count = reduce(torch.stack([xd.sum(), m.sum().double()])).tolist()
    mean = total / max(count, 1.0)
    centered = torch.where(m, xd - mean, torch.zeros_like(xd))
    (squares,) = reduce(centered.pow(2).sum().reshape(1)).tolist()
    return mean, squares / max(count - 1.0, 1.0)

