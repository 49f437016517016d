"""RL algorithm functions against numbers worked out by hand (in the comments), not by the code."""

import math

import pytest
import torch

from flexfloor.config import KLEstimator, LossAgg
from flexfloor.trainer.algorithms import (
    aggregate, broadcast_to_tokens, entropy_from_logits, gae, grpo_advantages, kl_penalty,
    logprob_diff, policy_loss, token_level_rewards, token_logprobs, truncated_is_weight,
    value_loss, whiten,
)

NAN = float("nan")


def close(actual, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# ---- GRPO -------------------------------------------------------------------------------------

def test_grpo_mean_only_two_groups():
    # group A = [1, 0, 0]: mean 1/3 -> [2/3, -1/3, -1/3]
    # group B = [1, 1, 0]: mean 2/3 -> [1/3, 1/3, -2/3]
    adv = grpo_advantages(t([1, 0, 0, 1, 1, 0]), torch.tensor([0, 0, 0, 1, 1, 1]), std_norm=False)
    close(adv, [2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3])


def test_grpo_std_scaled_is_unbiased_and_groups_by_id_not_position():
    # Same groups, interleaved and with arbitrary ids. Group A squared deviations:
    # 4/9 + 1/9 + 1/9 = 2/3; unbiased var = (2/3) / (3 - 1) = 1/3; std = 0.577350.
    # A: [0.666667, -0.333333, -0.333333] / 0.577350 = [1.154701, -0.577350, -0.577350]
    # B: [0.333333, 0.333333, -0.666667] / 0.577350 = [0.577350, 0.577350, -1.154701]
    # (the biased std sqrt(2/9) = 0.471405 would give 1.414214 instead of 1.154701)
    rewards = t([1, 1, 0, 1, 0, 0])
    ids = torch.tensor([7, 3, 7, 3, 7, 3])  # A = id 7 -> rewards [1, 0, 0]; B = id 3 -> [1, 1, 0]
    adv = grpo_advantages(rewards, ids, std_norm=True)
    close(adv, [1.154701, 0.577350, -0.577350, 0.577350, -0.577350, -1.154701], tol=1e-4)


def test_grpo_singleton_and_constant_groups_give_zero_not_nan():
    # id 0: singleton -> 0. id 1: [1, 3], mean 2, unbiased std sqrt((1 + 1) / 1) = 1.414214
    # -> [-0.707107, 0.707107]. id 2: [4, 4] -> std 0 -> 0 / eps = 0.
    rewards = t([5, 1, 3, 4, 4])
    ids = torch.tensor([0, 1, 1, 2, 2])
    close(grpo_advantages(rewards, ids, std_norm=False), [0, -1, 1, 0, 0])
    close(grpo_advantages(rewards, ids, std_norm=True), [0, -0.707107, 0.707107, 0, 0], tol=1e-4)


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(broadcast_to_tokens(t([2, -1]), mask), [[2, 2, 0], [-1, 0, 0]])


# ---- GAE and token rewards --------------------------------------------------------------------

REWARDS = [0.0, 0.0, 1.0]
VALUES = [0.5, 0.2, 0.7]


def test_gae_gamma1_lam1_is_return_minus_value():
    # Undiscounted return from each token is 1 (the final reward): advantage = 1 - V
    # = [0.5, 0.8, 0.3].
    adv, ret = gae(t([REWARDS]), t([VALUES]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.8, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_gamma09_lam05_recursion():
    # gamma * lam = 0.45, V past the end = 0.
    # t=2: delta = 1 + 0.9*0   - 0.7 =  0.3;  A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.2 =  0.43; A1 = 0.43 + 0.45*0.3   =  0.565
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32; A0 = -0.32 + 0.45*0.565 = -0.06575
    # returns = A + V = [0.43425, 0.765, 1.0]
    adv, ret = gae(t([REWARDS]), t([VALUES]), torch.ones(1, 3), gamma=0.9, lam=0.5)
    close(adv, [[-0.06575, 0.565, 0.3]])
    close(ret, [[0.43425, 0.765, 1.0]])


def test_gae_padding_does_not_leak():
    # Row 0: the sequence above, padded to 5 with garbage (including NaN) in rewards and values.
    # Row 1: a one-token response, reward 2, value 0.5 -> A = 2 - 0.5 = 1.5, return 2.
    rewards = t([[0.0, 0.0, 1.0, 100.0, NAN], [2.0, 9.0, 9.0, 9.0, 9.0]])
    values = t([[0.5, 0.2, 0.7, -50.0, NAN], [0.5, NAN, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv, [[-0.06575, 0.565, 0.3, 0, 0], [1.5, 0, 0, 0, 0]])
    close(ret, [[0.43425, 0.765, 1.0, 0, 0], [2.0, 0, 0, 0, 0]])


def test_token_level_rewards_on_last_valid_token_with_kl():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    score = t([2, 3, 4])
    # the empty row gets nothing
    close(token_level_rewards(score, mask), [[0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]])
    kl = t([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    # minus 0.5 * kl on valid tokens: [-0.05, -0.1, 2 - 0.15], [3 - 0.2]
    close(token_level_rewards(score, mask, kl=kl, kl_coef=0.5),
          [[-0.05, -0.1, 1.85, 0], [2.8, 0, 0, 0], [0, 0, 0, 0]])


def test_whiten_over_valid_tokens():
    # valid [1, 2, 3, 4]: mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3,
    # std 1.290994 -> [-1.161895, -0.387298, 0.387298, 1.161895]; padding (100) ignored -> 0.
    x = t([[1, 2, 3], [4, 100, 100]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(whiten(x, mask), [[-1.161895, -0.387298, 0.387298], [1.161895, 0, 0]], tol=1e-4)


# ---- policy loss and aggregation --------------------------------------------------------------

MASK_3_1 = torch.tensor([[1, 1, 1], [1, 0, 0]])  # lengths 3 and 1


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    # ratio 1 everywhere -> loss = -(1 - 2 + 3 + 0.5) / 4 = -0.625; padding adv (99) ignored.
    adv = t([[1, -2, 3], [0.5, 99, 99]])
    logp = torch.full((2, 3), -1.2, requires_grad=True)
    loss, stats = policy_loss(logp, torch.full((2, 3), -1.2), adv, MASK_3_1, clip_eps=0.2,
                              agg=LossAgg.TOKEN_MEAN)
    close(loss, -0.625)
    close(stats["clip_frac"], 0.0)
    close(stats["approx_kl"], 0.0)
    close(stats["ratio_mean"], 1.0)
    loss.backward()  # d/dlogp of -A * ratio / N at ratio 1 = -A / 4
    close(logp.grad, [[-0.25, 0.5, -0.75], [-0.125, 0, 0]])


def test_policy_loss_clipped():
    old = torch.zeros(1, 2)
    logp = torch.full((1, 2), math.log(1.5), requires_grad=True)  # ratio 1.5
    mask = torch.ones(1, 2)
    # adv +2: max(-2 * 1.5, -2 * 1.2) = max(-3, -2.4) = -2.4, the clipped term; no gradient.
    loss, stats = policy_loss(logp, old, t([[2, 2]]), mask, clip_eps=0.2, agg="token_mean")
    close(loss, -2.4)
    close(stats["clip_frac"], 1.0)
    close(stats["ratio_mean"], 1.5)
    close(stats["approx_kl"], -0.405465)  # old - new = -ln 1.5
    loss.backward()
    close(logp.grad, [[0.0, 0.0]])
    # adv -2: max(3, 2.4) = 3, the unclipped (pessimistic) term; not counted as clipped.
    loss, stats = policy_loss(logp, old, t([[-2, -2]]), mask, clip_eps=0.2, agg="token_mean")
    close(loss, 3.0)
    close(stats["clip_frac"], 0.0)
    # clip-higher: upper bound 1 + 0.28 -> -2 * 1.28 = -2.56
    loss, _ = policy_loss(logp, old, t([[2, 2]]), mask, clip_eps=0.2, clip_eps_high=0.28,
                          agg="token_mean")
    close(loss, -2.56)
    # lower side: ratio 0.5, adv -1: max(0.5, 0.8) = 0.8 (clip at 1 - 0.2)
    loss, stats = policy_loss(torch.full((1, 2), math.log(0.5)), old, t([[-1, -1]]), mask,
                              clip_eps=0.2, agg="token_mean")
    close(loss, 0.8)
    close(stats["clip_frac"], 1.0)


def test_dual_clip_caps_the_loss_of_negative_advantages_at_clip_ratio_c():
    # Three tokens (ratio, A): (e^2, -1), (e^2, +1), (0.5, -1); clip_eps 0.2, clip_ratio_c 3.
    #   token 0: L1 = max(-(-1) * 7.389056, -(-1) * 1.2) = 7.389056; A < 0: min(7.389056, 3) = 3
    #   token 1: L1 = max(-7.389056, -1.2) = -1.2; A > 0: no dual-clip               -> -1.2
    #   token 2: L1 = max(0.5, 0.8) = 0.8; A < 0: min(0.8, 3) = 0.8                  ->  0.8
    # token mean: (3 - 1.2 + 0.8) / 3 = 0.866667; without dual-clip
    # (7.389056 - 1.2 + 0.8) / 3 = 2.329685. Token 0 is the one capped: clip_frac_lower 1/3.
    old = torch.zeros(1, 3)
    logp = torch.tensor([[2.0, 2.0, math.log(0.5)]], requires_grad=True)
    adv, mask = t([[-1, 1, -1]]), torch.ones(1, 3)
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_ratio_c=3.0,
                              agg="token_mean")
    close(loss, 0.866667)
    close(stats["clip_frac_lower"], 1 / 3)
    loss.backward()  # the capped token and the two clipped ones carry no gradient
    close(logp.grad, [[0.0, 0.0, 0.0]])
    off, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, agg="token_mean")
    close(off, 2.329685)
    close(stats["clip_frac_lower"], 0.0)
    # a ratio below the cap is untouched: ratio 2, A = -1 -> L1 = 2 < 3
    two, _ = policy_loss(torch.full((1, 1), math.log(2.0)), torch.zeros(1, 1), t([[-1]]),
                         torch.ones(1, 1), clip_eps=0.2, clip_ratio_c=3.0, agg="token_mean")
    close(two, 2.0)


def test_truncated_is_weight_scales_the_policy_loss():
    # w = min(exp(old - rollout), 2):
    #   exp(0.1) = 1.105171, exp(1) = 2.718282 -> 2, exp(-0.5) = 0.606531
    old = t([[0.1, 1.0, -0.5]])
    w = truncated_is_weight(old, torch.zeros(1, 3), cap=2.0)
    close(w, [[1.105171, 2.0, 0.606531]])
    # ratio 1 (logp == old), A = [1, 1, 1]: loss = -(1.105171 + 2 + 0.606531) / 3 = -1.237234
    loss, _ = policy_loss(old, old, t([[1, 1, 1]]), torch.ones(1, 3), clip_eps=0.2,
                          is_weight=w, agg="token_mean")
    close(loss, -1.237234)


def test_logprob_diff_sum_max_count_over_valid_tokens_only():
    # |[-1, -2, -3] - [-1.5, -2, -1]| = [0.5, 0, 2];
    # row 1: |-1 - -1.25| = 0.25, padding (99) ignored
    old = t([[-1, -2, -3], [-1, 99, 99]])
    eng = t([[-1.5, -2, -1], [-1.25, -99, -99]])
    total, biggest, count = logprob_diff(old, eng, MASK_3_1)
    close(total, 2.75)
    close(biggest, 2.0)
    close(count, 4.0)


def test_token_mean_and_seq_mean_differ_on_different_lengths():
    # ratio 1 -> per-token loss = -adv. Row 0 [1, 2, 3] (length 3), row 1 [6] (length 1).
    # token_mean: -(1 + 2 + 3 + 6) / 4 = -3.   seq_mean: -((1 + 2 + 3) / 3 + 6) / 2 = -4.
    adv = t([[1, 2, 3], [6, 50, 50]])
    logp = torch.zeros(2, 3)
    tok, _ = policy_loss(logp, logp, adv, MASK_3_1, clip_eps=0.2, agg=LossAgg.TOKEN_MEAN)
    seq, _ = policy_loss(logp, logp, adv, MASK_3_1, clip_eps=0.2, agg=LossAgg.SEQ_MEAN)
    close(tok, -3.0)
    close(seq, -4.0)
    close(aggregate(adv, MASK_3_1, "seq_mean"), 4.0)
    # an all-padding row does not count as a response with mean 0
    adv3 = t([[1, 2, 3], [6, 50, 50], [7, 7, 7]])
    mask3 = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(aggregate(adv3, mask3, LossAgg.SEQ_MEAN), 4.0)
    close(aggregate(adv3, mask3, LossAgg.TOKEN_MEAN), 3.0)
    with pytest.raises(ValueError):
        aggregate(adv, MASK_3_1, "sum")


def test_policy_loss_nan_in_padding_does_not_leak():
    logp = t([[-1.0, NAN], [-1.0, -1.0]])
    old = t([[-1.0, NAN], [-1.0, NAN]])
    mask = torch.tensor([[1, 0], [1, 0]])
    loss, stats = policy_loss(logp, old, t([[1, NAN], [3, 1]]), mask, clip_eps=0.2,
                              agg="seq_mean")
    close(loss, -2.0)  # ratio 1: -(1 + 3) / 2
    assert all(torch.isfinite(v) for v in stats.values())


# ---- KL ---------------------------------------------------------------------------------------

def test_kl_estimators_on_known_numbers():
    logp = t([-1.0, -2.0, -0.7])
    ref = t([-2.0, -1.0, -0.7])
    # k1 = logp - ref = [1, -1, 0]
    close(kl_penalty(logp, ref, estimator=KLEstimator.K1), [1.0, -1.0, 0.0])
    close(kl_penalty(logp, ref, estimator="k1"), [1.0, -1.0, 0.0])
    # k3, d = ref - logp = [-1, 1, 0]: e^-1 + 1 - 1 = 0.367879; e - 1 - 1 = 0.718282; 0
    close(kl_penalty(logp, ref, estimator=KLEstimator.K3), [0.367879, 0.718282, 0.0])
    close(kl_penalty(logp, ref, estimator="k3"), [0.367879, 0.718282, 0.0])


def test_k3_non_negative():
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(4, 50, generator=g) * 5, -torch.rand(4, 50, generator=g) * 5
    assert (kl_penalty(logp, ref, estimator="k3") >= 0).all()


# ---- from logits ------------------------------------------------------------------------------

def test_entropy_uniform_is_log_v():
    # ln 5 = 1.609438, whatever the (constant) logit and the input dtype
    close(entropy_from_logits(torch.zeros(2, 3, 5)), torch.full((2, 3), 1.609438))
    ent = entropy_from_logits(torch.full((1, 2, 5), 7.0, dtype=torch.bfloat16))
    assert ent.dtype == torch.float32
    close(ent, [[1.609438, 1.609438]])


def test_entropy_known_and_degenerate_distributions():
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.039721
    logits = torch.log(t([[[0.5, 0.25, 0.25]]]))
    close(entropy_from_logits(logits), [[1.039721]])
    # one token with all the mass (others -inf): 0, not NaN
    close(entropy_from_logits(t([[[0.0, -math.inf, -math.inf]]])), [[0.0]])


def test_token_logprobs_known_numbers_and_dtypes():
    # logits [0, ln 3] -> p = [0.25, 0.75]: ln 0.25 = -1.386294, ln 0.75 = -0.287682
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(token_logprobs(logits, torch.tensor([[0, 1]])), [[-1.386294, -0.287682]])
    assert token_logprobs(logits.bfloat16(), torch.tensor([[0, 1]])).dtype == torch.float32
    assert token_logprobs(logits.double(), torch.tensor([[0, 1]])).dtype == torch.float64


def test_token_logprobs_matches_manual_log_softmax_gather():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 11, generator=g) * 3
    tokens = torch.randint(0, 11, (3, 4), generator=g)
    expected = torch.log_softmax(logits, dim=-1)
    expected = torch.stack([torch.stack([expected[b, i, tokens[b, i]] for i in range(4)])
                            for b in range(3)])
    close(token_logprobs(logits, tokens), expected)


# ---- value loss -------------------------------------------------------------------------------

def test_value_loss_clipped_and_unclipped():
    mask = torch.ones(1, 1)
    # V 1, old 0, R 2, clip 0.2: V_clip 0.2; (1 - 2)^2 = 1, (0.2 - 2)^2 = 3.24 -> 0.5 * 3.24
    close(value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), mask, clip_eps=0.2, agg="token_mean"),
          1.62)
    # V 0.5, old 0, R -1: (0.5 + 1)^2 = 2.25, (0.2 + 1)^2 = 1.44 -> 0.5 * 2.25 (unclipped)
    close(value_loss(t([[0.5]]), t([[0.0]]), t([[-1.0]]), mask, clip_eps=0.2, agg="token_mean"),
          1.125)
    # V 1, old 0.9, within the clip: both (1 - 0)^2 = 1 -> 0.5
    close(value_loss(t([[1.0]]), t([[0.9]]), t([[0.0]]), mask, clip_eps=0.2, agg="token_mean"),
          0.5)


def test_value_loss_aggregation():
    # per-token 0.5 * err^2 with old = V (no clipping): row 0 errors [1, 3] -> [0.5, 4.5],
    # row 1 error [2] -> [2]. token_mean (0.5 + 4.5 + 2) / 3 = 2.333333;
    # seq_mean ((0.5 + 4.5) / 2 + 2) / 2 = 2.25
    v = t([[1.0, 3.0], [2.0, 77.0]])
    r = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    close(value_loss(v, v, r, mask, clip_eps=0.2, agg=LossAgg.TOKEN_MEAN), 2.333333)
    close(value_loss(v, v, r, mask, clip_eps=0.2, agg=LossAgg.SEQ_MEAN), 2.25)
