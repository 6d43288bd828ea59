"""Advantage and return estimators for RL stages, and their registry (one signature for all).

Each estimator's properties are declared torch-free in core/estimators.py; its tensor function is
registered here under the same name (`advantage_estimator`), and `estimate_advantages` is the one
call stages/rollout.py makes. Pure PyTorch tensor code, following stages/masked.py's conventions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core import estimators
from stages.masked import SumOverProcesses, as_bool_mask, check_same_shape, global_mean_var, masked_whiten

__all__ = [
    "gae",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_returns",
    "token_rewards",
    "AdvantageInputs",
    "AdvantageSettings",
    "ADVANTAGE_ESTIMATORS",
    "advantage_estimator",
    "estimate_advantages",
    "SCALE_REWARDS",
]

SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    check_same_shape(values=values, rewards=rewards, mask=mask)
    m = as_bool_mask(mask)
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
    valid: torch.Tensor | None = None,
    sum_over_processes: SumOverProcesses | None = None,
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
        keep = torch.ones_like(flat, dtype=torch.bool) if valid is None else as_bool_mask(valid)
        _, var = global_mean_var(flat, keep, sum_over_processes)
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
    sum_over_processes: SumOverProcesses | None = None,
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
    check_same_shape(rewards=rewards, mask=mask)
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
    m = as_bool_mask(mask)
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
    values: torch.Tensor | None = None  # (S, T) critic values (gae)


@dataclass(frozen=True)
class AdvantageSettings:
    group_size: int = 1  # samples per prompt
    gamma: float = 1.0
    lam: float = 0.95
    scale_rewards: str = "group"  # grpo: group | batch | none


Estimator = Callable[
    [AdvantageInputs, AdvantageSettings, SumOverProcesses | None],
    tuple[torch.Tensor, torch.Tensor | None],
]


# Each estimator's tensor function, under the name core/estimators.py declares it with (its properties:
# group-relative, a critic, its default samples per prompt).
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


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
    kl = torch.where(as_bool_mask(inputs.mask), inputs.kl, torch.zeros_like(inputs.kl)).sum(dim=1)
    return inputs.scores.to(kl.dtype) - inputs.kl_coef * kl


@advantage_estimator("grpo")
def _grpo_estimator(inputs, settings, sum_over_processes):
    per_sequence = grpo_advantages(_sequence_scores(inputs), settings.group_size, scale=settings.scale_rewards,
                                   valid=as_bool_mask(inputs.mask).any(dim=1),
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
    sum_over_processes: SumOverProcesses | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    check_same_shape(kl=inputs.kl, mask=inputs.mask)
    with torch.no_grad():
        return ADVANTAGE_ESTIMATORS[estimator](inputs, settings, sum_over_processes)


def _discounted_reverse_cumsum(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = m_t * (r_t + gamma * G_{t+1}), G_T = 0, over the last dim."""
    m = as_bool_mask(mask)
    r = torch.where(m, rewards, torch.zeros_like(rewards))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[..., 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        running = torch.where(m[..., t], r[..., t] + gamma * running, torch.zeros_like(running))
        out[..., t] = running
    return out
