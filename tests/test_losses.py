"""Tests for stages/losses.py, stages/masked.py, stages/advantages.py and stages/policy_losses.py.

Expected values are either worked by hand (arithmetic in the comments) or
produced by a deliberately naive reference (plain Python loops, explicit
log_softmax + gather) written here, independent of the implementation.
"""

import math
import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stages import losses as L
from stages.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    estimate_advantages,
    gae,
    grpo_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    token_rewards,
)
from stages.losses import dpo_loss, entropy_from_logits, reward_pair_loss, sequence_logprobs
from stages.masked import masked_mean, masked_whiten
from stages.policy_losses import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)

LN2 = math.log(2.0)


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-9, rtol=0.0):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- #
# sequence_logprobs
# --------------------------------------------------------------------------- #
def naive_sequence_logprobs(logits, labels, mask, average=False):
    """Explicit per-token loop: log_softmax in float64, then index."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    out = []
    for b in range(logits.shape[0]):
        total, count = 0.0, 0
        for tpos in range(logits.shape[1] - 1):
            if mask[b, tpos + 1]:
                total = total + logp[b, tpos, labels[b, tpos + 1]]
                count += 1
        if average:
            total = total / max(count, 1)
        out.append(torch.as_tensor(total, dtype=torch.float64))
    return torch.stack(out)


def test_sequence_logprobs_by_hand_sum_and_average():
    # V = 3.  Position 0 logits [0, 0, 0] -> uniform, p = 1/3.
    # Position 1 logits [0, ln2, 0] -> probs [1/4, 2/4, 1/4].
    # Position 2 logits are never used (no next token).
    logits = t([[[0.0, 0.0, 0.0], [0.0, LN2, 0.0], [5.0, -5.0, 1.0]]])
    labels = torch.tensor([[0, 1, 2]])  # labels[0] is a prompt token (unused)
    mask = torch.tensor([[0, 1, 1]])
    # pos 0 predicts labels[1] = 1: log(1/3); pos 1 predicts labels[2] = 2: log(1/4)
    expected_sum = math.log(1 / 3) + math.log(1 / 4)  # = -log 12
    close(sequence_logprobs(logits, labels, mask), [expected_sum])
    close(sequence_logprobs(logits, labels, mask, average=True), [expected_sum / 2])
    # Only the last token is a response token: log(1/4).
    close(sequence_logprobs(logits, labels, torch.tensor([[0, 0, 1]])), [math.log(1 / 4)])


def test_sequence_logprobs_matches_manual_gather_with_ignore_index():
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 6, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    labels = labels.masked_fill(~mask, -100)  # ignored ids must not be gathered
    for average in (False, True):
        got = sequence_logprobs(logits, labels, mask, average=average)
        close(got, naive_sequence_logprobs(logits, labels, mask, average), atol=1e-12)
    # Empty row -> 0 for both sum and average.
    assert sequence_logprobs(logits, labels, mask, average=True)[2].item() == 0.0


def test_sequence_logprobs_gradient_matches_autograd_of_naive():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 4, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.autograd.gradcheck(
        lambda z: sequence_logprobs(z, labels, mask, average=True), (logits,)
    )
    weights = t([0.3, -1.7])
    (sequence_logprobs(logits, labels, mask) * weights).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    (naive_sequence_logprobs(logits, labels, mask) * weights).sum().backward()
    close(got, logits.grad, atol=1e-12)


def test_sequence_logprobs_chunked_path_matches(monkeypatch):
    # Force several row chunks (each chunk = 3 rows of V = 7).
    monkeypatch.setattr(L, "_CHUNK_ELEMS", 21)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 9, 7, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 9), generator=g)
    mask = (torch.arange(9) >= 3).long().expand(2, 9)
    got = sequence_logprobs(logits, labels, mask)
    close(got, naive_sequence_logprobs(logits, labels, mask), atol=1e-12)
    got.sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    naive_sequence_logprobs(logits, labels, mask).sum().backward()
    close(grad, logits.grad, atol=1e-12)


def test_sequence_logprobs_bf16_matches_fp32():
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 8, 50
    logits32 = (3 * torch.randn(B, T, V, generator=g)).requires_grad_(True)
    logits16 = logits32.detach().bfloat16().requires_grad_(True)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T) >= 2).expand(B, T)

    out16 = sequence_logprobs(logits16, labels, mask)
    out32 = sequence_logprobs(logits32, labels, mask)
    assert out16.dtype == torch.float32 and out32.dtype == torch.float32
    # Same (bf16-representable) inputs -> same result as a float32 computation.
    close(out16, sequence_logprobs(logits16.detach().float(), labels, mask), atol=1e-5)
    # Versus the unrounded fp32 logits: bf16 input rounding only (~0.4% per logit).
    torch.testing.assert_close(out16, out32.detach(), atol=0.15, rtol=0.02)

    out16.sum().backward()
    out32.sum().backward()
    assert logits16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits16.grad.float(), logits32.grad, atol=2e-2, rtol=0)


# --------------------------------------------------------------------------- #
# entropy_from_logits
# --------------------------------------------------------------------------- #
def test_entropy_by_hand():
    # Uniform over 4 -> log 4.  Logits [0, ln3] -> probs [1/4, 3/4]:
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4).
    close(entropy_from_logits(t([[0.0, 0.0, 0.0, 0.0]])), [math.log(4)])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(entropy_from_logits(t([[0.0, math.log(3)]])), [h], atol=1e-12)
    # -inf logit contributes 0 log 0 = 0 -> entropy of a fair coin.
    close(entropy_from_logits(t([[0.0, float("-inf"), 0.0]])), [LN2])


def test_entropy_shape_dtype_and_bf16():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 11, generator=g)
    ref = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    got = entropy_from_logits(logits)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    close(got, ref.float(), atol=1e-5)
    got16 = entropy_from_logits(logits.bfloat16())
    assert got16.dtype == torch.float32
    torch.testing.assert_close(got16, got, atol=2e-2, rtol=0)


# --------------------------------------------------------------------------- #
# DPO
# --------------------------------------------------------------------------- #
def test_dpo_loss_is_log2_when_policy_equals_reference():
    logps_c = t([-3.0, -10.0, -0.5])
    logps_r = t([-4.0, -2.0, -7.0])
    for beta in (0.1, 0.5, 2.0):
        losses, rc, rr = dpo_loss(logps_c, logps_r, logps_c.clone(), logps_r.clone(), beta=beta)
        close(losses, [LN2] * 3, atol=1e-12)  # -log sigma(0) = log 2
        close(rc, [0.0] * 3)
        close(rr, [0.0] * 3)


def test_dpo_sigmoid_loss_and_rewards_by_hand():
    # h = (pi_c - pi_r) - (ref_c - ref_r) = (-1 - -3) - (-2 - -2) = 2; beta h = 1
    pc, pr, rc_, rr_ = t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0])
    losses, chosen_r, rejected_r = dpo_loss(pc, pr, rc_, rr_, beta=0.5)
    close(losses, [math.log(1 + math.exp(-1.0))], atol=1e-12)  # -log sigma(1)
    # rewards = beta * (pi - ref): 0.5 * (-1 + 2) = 0.5 ; 0.5 * (-3 + 2) = -0.5
    close(chosen_r, [0.5])
    close(rejected_r, [-0.5])


def test_dpo_rewards_are_detached_beta_log_ratios():
    pc = t([-1.0, -2.0]).requires_grad_(True)
    pr = t([-3.0, -1.5]).requires_grad_(True)
    ref_c, ref_r = t([-1.5, -2.5]), t([-2.0, -1.0])
    losses, chosen_r, rejected_r = dpo_loss(pc, pr, ref_c, ref_r, beta=0.2)
    # 0.2 * (-1 + 1.5) = 0.1, 0.2 * (-2 + 2.5) = 0.1 ; 0.2 * (-3 + 2) = -0.2, 0.2 * (-1.5 + 1) = -0.1
    close(chosen_r, [0.1, 0.1], atol=1e-12)
    close(rejected_r, [-0.2, -0.1], atol=1e-12)
    assert not chosen_r.requires_grad and not rejected_r.requires_grad
    assert losses.requires_grad
    losses.sum().backward()
    assert pc.grad is not None and torch.all(pc.grad < 0)  # raising pi_c lowers the loss


def test_ipo_loss_by_hand():
    # h = 2 as above.  IPO: (h - 1/(2 beta))^2
    pc, pr, rc_, rr_ = t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0])
    cases = {0.5: (2 - 1) ** 2, 0.25: (2 - 2) ** 2, 0.1: (2 - 5) ** 2}
    for beta, expected in cases.items():
        losses, chosen_r, _ = dpo_loss(pc, pr, rc_, rr_, beta=beta, loss_type="ipo")
        close(losses, [expected], atol=1e-12)
        close(chosen_r, [beta * 1.0], atol=1e-12)


def test_cdpo_label_smoothing_interpolates_the_two_sigmoid_terms():
    pc, pr, rc_, rr_ = t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0])  # beta h = 1
    eps = 0.1
    losses, _, _ = dpo_loss(pc, pr, rc_, rr_, beta=0.5, label_smoothing=eps)
    # (1 - eps) * -log sigma(1) + eps * -log sigma(-1)
    expected = (1 - eps) * math.log(1 + math.exp(-1.0)) + eps * math.log(1 + math.exp(1.0))
    close(losses, [expected], atol=1e-12)
    # Equivalently the mix of the normal loss and the loss with labels swapped.
    plain, _, _ = dpo_loss(pc, pr, rc_, rr_, beta=0.5)
    swapped, _, _ = dpo_loss(pr, pc, rr_, rc_, beta=0.5)
    close(losses, (1 - eps) * plain + eps * swapped, atol=1e-12)


def test_dpo_rejects_bad_arguments():
    x = t([0.0])
    with pytest.raises(ValueError, match="sigmoid.*ipo"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="hinge-ish")
    for bad in (0.5, 0.7, -0.1):
        with pytest.raises(ValueError, match="label_smoothing"):
            dpo_loss(x, x, x, x, beta=0.1, label_smoothing=bad)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="ipo"):
        dpo_loss(x, x, x, x, beta=0.1, label_smoothing=0.1, loss_type="ipo")


# --------------------------------------------------------------------------- #
# Reward model
# --------------------------------------------------------------------------- #
def test_reward_pair_loss_by_hand():
    rc, rr = t([2.0, 0.0]), t([1.0, 0.5])
    # diffs 1, -0.5 -> -log sigma(1) = log(1 + e^-1), -log sigma(-0.5) = log(1 + e^0.5)
    close(
        reward_pair_loss(rc, rr),
        [math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(0.5))],
        atol=1e-12,
    )


def test_reward_pair_loss_with_margin_by_hand():
    rc, rr = t([2.0, 0.0]), t([1.0, 0.5])
    # float margin 1: diffs 0, -1.5 -> log 2, log(1 + e^1.5)
    close(reward_pair_loss(rc, rr, margin=1.0), [LN2, math.log(1 + math.exp(1.5))], atol=1e-12)
    # tensor margin [0.5, -0.5]: diffs 0.5, 0 -> log(1 + e^-0.5), log 2
    close(
        reward_pair_loss(rc, rr, margin=t([0.5, -0.5])),
        [math.log(1 + math.exp(-0.5)), LN2],
        atol=1e-12,
    )


# --------------------------------------------------------------------------- #
# masked statistics
# --------------------------------------------------------------------------- #
def test_masked_mean_by_hand():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    close(masked_mean(x, mask), 8.0 / 3.0)  # (1 + 2 + 5) / 3, NaN under mask ignored
    close(masked_mean(x, mask, dim=1), [1.5, 5.0])
    close(masked_mean(x, mask.bool(), dim=0), [1.0, 3.5, 0.0])  # empty column -> 0
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten_unbiased_by_hand():
    x = t([2.0, 4.0, 6.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean 4, unbiased var = (4 + 0 + 4) / (3 - 1) = 4, std 2 (biased would be sqrt(8/3))
    close(masked_whiten(x, mask), [-1.0, 0.0, 1.0, 0.0], atol=1e-7)
    # shift_mean=False keeps the mean: (x - 4) / 2 + 4
    close(masked_whiten(x, mask, shift_mean=False), [3.0, 4.0, 5.0, 0.0], atol=1e-7)


def test_masked_whiten_ignores_masked_values_and_handles_tiny_masks():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    a = masked_whiten(t([[1.0, 2.0, 50.0], [3.0, -7.0, 0.0]]), mask)
    b = masked_whiten(t([[1.0, 2.0, float("nan")], [3.0, 1e9, 1.0]]), mask)
    close(a, b)
    one = masked_whiten(t([5.0, 9.0]), torch.tensor([1, 0]))
    close(one, [0.0, 0.0])  # single valid entry: variance taken as 0, no NaN


# --------------------------------------------------------------------------- #
# GAE
# --------------------------------------------------------------------------- #
def naive_gae(values, rewards, lengths, gamma, lam):
    """Plain Python GAE over rows of given lengths (starting at column 0)."""
    B, T = len(values), len(values[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        last = 0.0
        for i in reversed(range(n)):
            next_v = values[b][i + 1] if i + 1 < n else 0.0
            delta = rewards[b][i] + gamma * next_v - values[b][i]
            last = delta + gamma * lam * last
            adv[b][i] = last
            ret[b][i] = last + values[b][i]
    return adv, ret


def test_gae_three_steps_by_hand_with_padding_ignored():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # Valid: V = [1, 2, 3], r = [0, 0, 1]; two padding positions hold junk.
    values = t([[1.0, 2.0, 3.0, 7.0, 9.0]])
    rewards = t([[0.0, 0.0, 1.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    # t=2: delta = 1 + 0.9*0 - 3 = -2            A2 = -2
    # t=1: delta = 0 + 0.9*3 - 2 = 0.7           A1 = 0.7 + 0.72*(-2) = -0.74
    # t=0: delta = 0 + 0.9*2 - 1 = 0.8           A0 = 0.8 + 0.72*(-0.74) = 0.2672
    # returns = A + V = [1.2672, 1.26, 1.0]
    adv, ret = gae(values, rewards, mask, gamma, lam)
    close(adv, [[0.2672, -0.74, -2.0, 0.0, 0.0]], atol=1e-12)
    close(ret, [[1.2672, 1.26, 1.0, 0.0, 0.0]], atol=1e-12)


def test_gae_with_masked_prompt_prefix():
    # Same episode, but preceded by two masked prompt positions.
    values = t([[4.0, 4.0, 1.0, 2.0, 3.0, 0.0]])
    rewards = t([[9.0, 9.0, 0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(values, rewards, mask, 0.9, 0.8)
    close(adv, [[0.0, 0.0, 0.2672, -0.74, -2.0, 0.0]], atol=1e-12)
    close(ret, [[0.0, 0.0, 1.2672, 1.26, 1.0, 0.0]], atol=1e-12)


def test_gae_matches_naive_loop():
    g = torch.Generator().manual_seed(5)
    B, T = 4, 7
    lengths = [7, 4, 1, 5]
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    adv, ret = gae(values, rewards, mask, 0.95, 0.9)
    nadv, nret = naive_gae(values.tolist(), rewards.tolist(), lengths, 0.95, 0.9)
    close(adv, nadv, atol=1e-12)
    close(ret, nret, atol=1e-12)
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- #
# GRPO / RLOO / REINFORCE++
# --------------------------------------------------------------------------- #
def test_grpo_advantages_known_groups():
    rewards = t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # Group 1: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3 -> A = +-0.5 / sqrt(1/3) = +-sqrt(3)/2
    # Group 2: mean 0.75, deviations [.25, .25, .25, -.75], sum sq = 0.75,
    #          unbiased var = 0.75 / 3 = 0.25, std 0.5 -> A = [.5, .5, .5, -1.5]
    s = math.sqrt(3) / 2
    close(grpo_advantages(rewards, 4, eps=0.0), [s, -s, -s, s, 0.5, 0.5, 0.5, -1.5], atol=1e-12)
    close(
        grpo_advantages(rewards, 4, scale="none"),
        [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75],
        atol=1e-12,
    )


def test_grpo_identical_rewards_give_zero_and_bad_group_size_raises():
    close(grpo_advantages(t([3.0, 3.0, 3.0, 1.0, 1.0, 1.0]), 3), [0.0] * 6)
    close(grpo_advantages(t([3.0, 1.0]), 1), [0.0, 0.0])
    with pytest.raises(ValueError):
        grpo_advantages(t([1.0, 2.0, 3.0]), 2)


def test_rloo_advantages_known_group_and_naive_loop():
    # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    close(rloo_advantages(t([1.0, 0.0, 0.0, 1.0]), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=1e-12)
    g = torch.Generator().manual_seed(6)
    k = 3
    r = torch.randn(4 * k, generator=g, dtype=torch.float64)
    expected = []
    for i in range(r.numel()):
        start = (i // k) * k
        others = [r[j].item() for j in range(start, start + k) if j != i]
        expected.append(r[i].item() - sum(others) / len(others))
    close(rloo_advantages(r, k), expected, atol=1e-12)


def test_rloo_requires_group_size_at_least_two():
    with pytest.raises(ValueError):
        rloo_advantages(t([1.0, 2.0]), 1)
    with pytest.raises(ValueError):
        rloo_advantages(t([1.0, 2.0, 3.0]), 2)


def test_reinforce_pp_returns_by_hand():
    gamma = 0.5
    rewards = t([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 0.0, 7.0]])  # 7s are padding junk
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # Row 0 returns: G2 = 1, G1 = 0.5, G0 = 0.25 ; Row 1: G1 = 2, G0 = 1
    # valid G = [0.25, 0.5, 1, 1, 2]: mean 0.95,
    # deviations [-.7, -.45, .05, .05, 1.05], sum sq = 1.8, unbiased var = 1.8/4 = 0.45
    std = math.sqrt(0.45)
    expected = [
        [(0.25 - 0.95) / std, (0.5 - 0.95) / std, (1 - 0.95) / std, 0.0],
        [(1 - 0.95) / std, (2 - 0.95) / std, 0.0, 0.0],
    ]
    close(reinforce_pp_returns(rewards, mask, gamma=gamma), expected, atol=1e-7)


def test_token_rewards_put_the_score_on_the_last_response_token_and_the_kl_everywhere():
    scores = t([2.0, 3.0])
    kl = t([[0.1, 0.2, 0.3, 9.0], [9.0, 0.5, 0.0, 9.0]])  # the 9s are off the mask
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    close(token_rewards(scores, kl, mask, kl_coef=0.5),
          [[-0.05, -0.1, -0.15 + 2.0, 0.0], [0.0, -0.25, 3.0, 0.0]], atol=1e-12)


def test_grpo_batch_scale_divides_by_the_whole_rollouts_std():
    rewards = t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # all 8: mean 5/8, squares 5 * 0.375^2 + 3 * 0.625^2 = 1.875, unbiased var 1.875 / 7
    std = math.sqrt(1.875 / 7)
    centered = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    close(grpo_advantages(rewards, 4, eps=0.0, scale="batch"), [c / std for c in centered], atol=1e-12)


def test_critic_free_estimators_subtract_the_summed_kl_from_the_score():
    mask = torch.ones(2, 2)
    kl = t([[0.5, 0.5], [0.0, 0.0]])
    inputs = AdvantageInputs(scores=t([1.0, 1.0]), kl=kl, mask=mask, kl_coef=0.2)
    # sequence rewards 1 - 0.2 * 1 = 0.8 and 1: group mean 0.9 -> -0.1, +0.1 on every token
    advantages, _ = estimate_advantages("grpo", inputs, AdvantageSettings(group_size=2, scale_rewards="none"))
    close(advantages, [[-0.1, -0.1], [0.1, 0.1]], atol=1e-12)
    advantages, _ = estimate_advantages("rloo", inputs, AdvantageSettings(group_size=2))
    close(advantages, [[-0.2, -0.2], [0.2, 0.2]], atol=1e-12)  # 0.8 - 1, 1 - 0.8


class _TwoProcesses:
    """sum_over_processes for threads standing in for processes: each waits for the others' sums."""

    def __init__(self, n: int):
        self.barrier, self.parts = threading.Barrier(n), [None] * n

    def of(self, rank: int):
        def reduce(values):
            self.parts[rank] = values.detach().double().clone()
            self.barrier.wait()
            total = sum(self.parts)
            self.barrier.wait()  # everyone has read before anyone writes again
            return total

        return reduce


def _split_run(estimator, inputs, settings, cuts):
    """The estimator on each share of the rows, in threads that sum their statistics together."""
    shares = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
    processes = _TwoProcesses(len(shares))
    out = [None] * len(shares)

    def work(rank, rows):
        part = AdvantageInputs(scores=inputs.scores[rows], kl=inputs.kl[rows], mask=inputs.mask[rows],
                               kl_coef=inputs.kl_coef, values=None if inputs.values is None else inputs.values[rows])
        out[rank] = estimate_advantages(estimator, part, settings, processes.of(rank))

    threads = [threading.Thread(target=work, args=(r, rows)) for r, rows in enumerate(shares)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    advantages = torch.cat([a for a, _ in out])
    returns = None if out[0][1] is None else torch.cat([r for _, r in out])
    return advantages, returns


@pytest.mark.parametrize("estimator,scale", [("gae", "group"), ("reinforce_pp", "group"), ("grpo", "group"),
                                             ("grpo", "batch"), ("grpo", "none"), ("rloo", "group")])
def test_every_estimator_gives_the_same_advantages_however_the_rollout_is_split(estimator, scale):
    g = torch.Generator().manual_seed(11)
    S, T = 8, 6
    mask = (torch.arange(T)[None, :] < torch.tensor([6, 3, 1, 4, 0, 5, 2, 6])[:, None]).double()  # row 4: empty
    inputs = AdvantageInputs(scores=torch.randn(S, generator=g, dtype=torch.float64),
                             kl=torch.rand(S, T, generator=g, dtype=torch.float64) * mask * 0.1, mask=mask,
                             kl_coef=0.05, values=torch.randn(S, T, generator=g, dtype=torch.float64) * mask)
    settings = AdvantageSettings(group_size=2, gamma=0.99, lam=0.9, scale_rewards=scale)
    whole, whole_returns = estimate_advantages(estimator, inputs, settings)
    for cuts in ([0, 4, 8], [0, 2, 8]):  # two processes, even or not (groups never span processes)
        split, split_returns = _split_run(estimator, inputs, settings, cuts)
        close(split, whole, atol=1e-12)
        if whole_returns is not None:
            close(split_returns, whole_returns, atol=1e-12)
    assert whole[4].abs().sum() == 0 and (whole * (1 - mask)).abs().sum() == 0


def test_gae_advantages_are_whitened_over_the_rollout():
    mask = torch.ones(2, 2)
    inputs = AdvantageInputs(scores=t([1.0, 3.0]), kl=torch.zeros(2, 2, dtype=torch.float64), mask=mask,
                             values=torch.zeros(2, 2, dtype=torch.float64))
    advantages, returns = estimate_advantages("gae", inputs, AdvantageSettings(gamma=1.0, lam=1.0))
    # V = 0, gamma = lam = 1: raw advantages = returns = the score on every token: [1, 1, 3, 3];
    # mean 2, unbiased var 4/3 -> +-sqrt(3)/2
    close(returns, [[1.0, 1.0], [3.0, 3.0]], atol=1e-12)
    s = math.sqrt(3) / 2
    close(advantages, [[-s, -s], [s, s]], atol=1e-6)
    with pytest.raises(ValueError, match="needs the critic's values"):
        estimate_advantages("gae", AdvantageInputs(scores=t([1.0]), kl=t([[0.0]]), mask=t([[1.0]])),
                            AdvantageSettings())


# --------------------------------------------------------------------------- #
# Policy-gradient losses: clip ranges, importance sampling, aggregation
# --------------------------------------------------------------------------- #
def _ppo_inputs(ratios, advantages):
    old = t([-1.0] * len(ratios))
    logprobs = (old + torch.log(t(ratios))).requires_grad_(True)
    return logprobs, old, t(advantages)


def _token_loss(ratios, advantages, mask=None, **clip):
    logprobs, old, adv = _ppo_inputs(ratios, advantages)
    mask = torch.ones(len(ratios)) if mask is None else mask
    losses, clipped = policy_loss(logprobs.unsqueeze(0), old.unsqueeze(0), adv.unsqueeze(0), mask.unsqueeze(0), **clip)
    loss = aggregate_loss(losses, mask.unsqueeze(0))
    loss.backward()
    return loss, clipped[0], logprobs.grad


def test_policy_loss_inside_clip_range():
    loss, clipped, grad = _token_loss([1.1], [2.0], clip_eps_low=0.2)
    close(loss, -2.2, atol=1e-12)  # -rho A = -1.1 * 2
    assert not clipped.any()
    close(grad, [-2.2], atol=1e-12)  # d(-rho A)/dlogp = -rho A


def test_policy_loss_outside_clip_range():
    # rho = 1.5, A = +1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped (no gradient)
    loss, clipped, grad = _token_loss([1.5], [1.0], clip_eps_low=0.2)
    close(loss, -1.2, atol=1e-12)
    assert clipped.all()
    close(grad, [0.0])
    # rho = 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, unclipped term active
    loss, clipped, _ = _token_loss([1.5], [-1.0], clip_eps_low=0.2)
    close(loss, 1.5, atol=1e-12)
    assert not clipped.any()
    # rho = 0.5, A = -1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped
    loss, clipped, _ = _token_loss([0.5], [-1.0], clip_eps_low=0.2)
    close(loss, 0.8, atol=1e-12)
    assert clipped.all()


def test_policy_loss_token_mean_over_mixed_tokens():
    mask = torch.tensor([1, 1, 1, 1, 0])  # last token (huge ratio) is padding
    loss, clipped, _ = _token_loss([1.1, 1.5, 1.5, 0.5, 50.0], [2.0, 1.0, -1.0, -1.0, 3.0], mask, clip_eps_low=0.2)
    # per token: -2.2, -1.2, 1.5, 0.8 -> mean = -1.1 / 4
    close(loss, -1.1 / 4, atol=1e-12)
    assert clipped.tolist() == [False, True, False, True, False]  # tokens 2 and 4


def test_clip_higher_lets_a_rare_token_with_a_positive_advantage_grow_further():
    # rho = 1.25, A = +1. Symmetric 0.2: min(1.25, 1.2) = 1.2, clipped, no gradient.
    loss, clipped, grad = _token_loss([1.25], [1.0], clip_eps_low=0.2)
    close(loss, -1.2, atol=1e-12)
    assert clipped.all() and grad.abs().sum() == 0
    # DAPO's clip-higher, 0.2 / 0.28: 1.25 < 1.28, the unclipped term -1.25 is active, gradient -rho A.
    loss, clipped, grad = _token_loss([1.25], [1.0], clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, -1.25, atol=1e-12)
    assert not clipped.any()
    close(grad, [-1.25], atol=1e-12)
    # The low bound is untouched: rho = 0.75, A = -1 -> min(-0.75, -0.8) = -0.8, clipped either way.
    loss, clipped, _ = _token_loss([0.75], [-1.0], clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, 0.8, atol=1e-12)
    assert clipped.all()


def test_gspo_takes_the_geometric_mean_ratio_of_a_sequence_and_its_gradient_through_the_mean():
    old = t([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # token log-ratios 0.1 and 0.3 (the third position is padding)
    logprobs = (old + t([[0.1, 0.3, 5.0]])).requires_grad_(True)
    adv = t([[1.0, 1.0, 0.0]])
    losses, clipped = policy_loss(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28,
                                  importance_sampling="sequence")
    s = math.exp(0.2)  # (e^0.1 * e^0.3)^(1/2) = 1.2214, inside [0.8, 1.28]
    close(losses, [[-s, -s, 0.0]], atol=1e-12)
    assert not clipped.any()
    loss = aggregate_loss(losses, mask, "sequence_mean")  # GSPO's objective: one term per sequence
    close(loss, -s, atol=1e-12)
    loss.backward()
    # d(-s A)/d logp_t = -A s / |y| for every token of the sequence
    close(logprobs.grad, [[-s / 2, -s / 2, 0.0]], atol=1e-12)
    # Token-level for contrast: ratios e^0.1 = 1.105 (free) and e^0.3 = 1.35 (> 1.28, clipped).
    token_losses, token_clipped = policy_loss(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    close(token_losses, [[-math.exp(0.1), -1.28, 0.0]], atol=1e-12)
    assert token_clipped.tolist() == [[False, True, False]]


def test_gspo_clips_a_whole_sequence_at_once():
    old = t([[-1.0, -1.0]])
    logprobs = (old + t([[0.0, 0.8]])).requires_grad_(True)  # geometric mean ratio e^0.4 = 1.49 > 1.28
    losses, clipped = policy_loss(logprobs, old, t([[2.0, 2.0]]), torch.ones(1, 2), clip_eps_low=0.2,
                                  clip_eps_high=0.28, importance_sampling="sequence")
    close(losses, [[-1.28 * 2, -1.28 * 2]], atol=1e-12)
    assert clipped.all()  # even the token whose own ratio is 1
    aggregate_loss(losses, torch.ones(1, 2), "sequence_mean").backward()
    close(logprobs.grad, [[0.0, 0.0]])


def test_the_three_aggregations_by_hand():
    losses = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # the 9s are padding
    close(aggregate_loss(losses, mask, "token_mean"), (1 + 2 + 3 + 4) / 4)  # 2.5
    close(aggregate_loss(losses, mask, "sequence_mean"), (6 / 3 + 4 / 1) / 2)  # 3
    close(aggregate_loss(losses, mask, "sequence_sum_normalized", max_len=5), (6 + 4) / (2 * 5))  # 1
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate_loss(losses, mask, "sequence_sum_normalized")
    with pytest.raises(ValueError, match="token_mean, sequence_mean, sequence_sum_normalized"):
        aggregate_loss(losses, mask, "mean")


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_micro_batch_shares_add_up_to_the_step_loss(mode):
    g = torch.Generator().manual_seed(7)
    losses = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1, 3, 5])[:, None]).long()
    whole = aggregate_loss(losses, mask, mode, max_len=8)
    tokens, sequences = float(mask.sum()), 6.0
    shares = [aggregate_loss(losses[rows], mask[rows], mode, tokens=tokens, sequences=sequences, max_len=8)
              for rows in ([0, 1], [2, 3, 4], [5])]
    close(sum(shares), whole, atol=1e-12)


def test_dr_grpo_reproduces_its_formula_on_a_known_group():
    # Dr. GRPO (Liu et al. 2025): A_i = R_i - mean(R), and the loss sums token terms over a fixed
    # normaliser, G x L_max, instead of dividing each sequence by its own length.
    rewards, lengths, l_max = [1.0, 0.0, 0.0, 1.0], [2, 3, 1, 4], 4
    group = len(rewards)
    mask = (torch.arange(l_max)[None, :] < torch.tensor(lengths)[:, None]).double()
    scores = t(rewards)
    advantages, returns = estimate_advantages(
        "grpo", AdvantageInputs(scores=scores, kl=torch.zeros_like(mask), mask=mask),
        AdvantageSettings(group_size=group, scale_rewards="none"))
    assert returns is None
    close(advantages, t([0.5, -0.5, -0.5, 0.5]).unsqueeze(1) * mask, atol=1e-12)
    old = torch.full((group, l_max), -1.0, dtype=torch.float64)
    logprobs = old.clone().requires_grad_(True)  # on-policy: every ratio is 1
    losses, _ = policy_loss(logprobs, old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    loss = aggregate_loss(losses, mask, "sequence_sum_normalized", max_len=l_max)
    # -1/(G L) sum_i |o_i| A_i = -(2*.5 - 3*.5 - 1*.5 + 4*.5) / 16 = -1/16
    close(loss, -1.0 / 16, atol=1e-12)
    loss.backward()
    # every token of sample i gets -A_i / (G L), whatever the sample's length
    close(logprobs.grad, (-t([0.5, -0.5, -0.5, 0.5]) / 16).unsqueeze(1) * mask, atol=1e-12)


def test_value_loss_clipping_by_hand():
    eps = 0.2
    old = t([[0.0, 0.0, 0.0, 0.0]])
    values = t([[0.1, 0.5, 0.5, 9.0]]).requires_grad_(True)
    returns = t([[1.0, 1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # tok0: V = 0.1 within range -> Vclip = 0.1; (0.1-1)^2 = 0.81 both; not clipped
    # tok1: Vclip = 0.2; (0.5-1)^2 = 0.25 vs (0.2-1)^2 = 0.64 -> 0.64, clipped term active
    # tok2: Vclip = 0.2; (0.5+1)^2 = 2.25 vs (0.2+1)^2 = 1.44 -> 2.25, unclipped active
    # loss = 0.5 * (0.81 + 0.64 + 2.25) / 3
    losses, clipped = value_loss(values, old, returns, mask, eps)
    assert clipped.tolist() == [[False, True, False, False]]
    loss = aggregate_loss(losses, mask)
    close(loss, 0.5 * 3.7 / 3, atol=1e-12)
    loss.backward()
    # d/dV of 0.5 * (V - R)^2 / 3 = (V - R) / 3 where the unclipped term is active
    close(values.grad, [[(0.1 - 1.0) / 3, 0.0, (0.5 + 1.0) / 3, 0.0]], atol=1e-12)


# --------------------------------------------------------------------------- #
# KL penalty
# --------------------------------------------------------------------------- #
def test_kl_estimators_at_known_log_ratio():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.5])  # log r = [0.5, -0.5]
    close(kl_penalty(logp, ref, "k1"), [0.5, -0.5], atol=1e-12)
    close(kl_penalty(logp, ref, "k2"), [0.125, 0.125], atol=1e-12)  # 0.5 * 0.25
    # k3 = e^{-log r} - 1 + log r
    close(
        kl_penalty(logp, ref, "k3"),
        [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5],
        atol=1e-12,
    )
    close(kl_penalty(logp, ref), [0.5, -0.5], atol=1e-12)  # default k1


def test_kl_k3_nonnegative_and_k1_k3_unbiased():
    log_r = torch.linspace(-20, 20, 401, dtype=torch.float64)
    assert torch.all(kl_penalty(log_r, torch.zeros_like(log_r), "k3") >= 0)
    # Exact expectation under p of k1 and k3 equals KL(p || q).
    p, q = t([0.2, 0.3, 0.5]), t([0.4, 0.4, 0.2])
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    for est in ("k1", "k3"):
        close((p * kl_penalty(p.log(), q.log(), est)).sum(), kl, atol=1e-12)


def test_kl_penalty_unknown_estimator_lists_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


# --------------------------------------------------------------------------- #
# KL controllers
# --------------------------------------------------------------------------- #
def test_adaptive_kl_controller_moves_up_and_down_with_clipping():
    n, horizon = 256, 10000
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=horizon)
    # KL 6.6 > target: error = 6.6/6 - 1 = 0.1 (inside clip) -> coef * (1 + 0.1 * 256/10000)
    assert ctl.update(6.6, n) == pytest.approx(0.1 * (1 + 0.1 * n / horizon))
    # KL 12 -> error 1.0, clipped to +0.2
    ctl = AdaptiveKLController(0.1, 6.0, horizon)
    ctl.update(torch.tensor(12.0), n)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * n / horizon))
    # KL 5.4 < target: error -0.1 -> down
    ctl = AdaptiveKLController(0.1, 6.0, horizon)
    ctl.update(5.4, n)
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * n / horizon))
    assert ctl.value < 0.1
    # KL 0 -> error -1, clipped to -0.2
    ctl = AdaptiveKLController(0.1, 6.0, horizon)
    ctl.update(0.0, n)
    assert ctl.value == pytest.approx(0.1 * (1 - 0.2 * n / horizon))


def test_fixed_kl_controller_never_changes():
    ctl = FixedKLController(0.05)
    assert ctl.value == 0.05
    assert ctl.update(100.0, 512) == 0.05
    assert ctl.value == 0.05
