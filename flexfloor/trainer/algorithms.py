"""RL algorithms as pure tensor functions: advantages, policy and value losses, KL, entropy.

Tensors in, tensors out: no config objects, no process groups, no globals. Shapes:
    B  responses in the batch
    T  response tokens, right-padded
    V  vocabulary
    mask (B, T): 1 on real response tokens, 0 on padding (bool or float).

Padding never leaks: every reduction selects valid tokens with `torch.where`, so even NaN or inf
in padded positions (e.g. log-probabilities of padding tokens) cannot reach a loss or a statistic.
Modes (`agg`, `estimator`) take the enums of flexfloor.config or their string values.
"""

from __future__ import annotations

import torch

from flexfloor.config import KLEstimator, LossAgg

__all__ = [
    "aggregate", "broadcast_to_tokens", "entropy_from_logits", "gae", "grpo_advantages",
    "kl_penalty", "logprob_diff", "policy_loss", "token_level_rewards", "token_logprobs",
    "truncated_is_weight", "value_loss", "whiten",
]


def _float(x: torch.Tensor) -> torch.Tensor:
    """float64 stays float64; everything else (bf16, fp16, ints) computes in float32."""
    return x if x.dtype == torch.float64 else x.float()


def _masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


# ---- advantages -------------------------------------------------------------------------------

def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_norm: bool,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage of each response: its reward minus the mean of its group.

    A group is the responses sharing a `group_ids` value (the samples of one prompt). With
    `std_norm` the difference is divided by (group std + eps); the std is the unbiased one
    (Bessel's correction, n - 1), as `torch.std` and verl use. A group of one has advantage 0.
    """
    r = _float(rewards)  # (B,)
    ids, inv = torch.unique(group_ids, return_inverse=True)  # (G,), (B,) index in [0, G)
    count = torch.zeros(ids.numel(), dtype=r.dtype, device=r.device).index_add_(
        0, inv, torch.ones_like(r))  # (G,)
    mean = torch.zeros_like(count).index_add_(0, inv, r) / count  # (G,)
    centred = r - mean[inv]  # (B,) exactly 0 for a group of one
    if not std_norm:
        return centred
    sq = torch.zeros_like(count).index_add_(0, inv, centred * centred)  # (G,)
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # (G,) unbiased; a group of one: 0, not 0/0
    return centred / (std[inv] + eps)  # (B,)


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-response value (B,) on each of its valid tokens (B, T); 0 on padding."""
    return adv[:, None] * mask.to(adv.dtype)  # (B, T)


def token_level_rewards(score: torch.Tensor, mask: torch.Tensor, *, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0) -> torch.Tensor:
    """Each response's score on its last valid token, minus `kl_coef * kl` on every valid token.

    A response with no valid token gets no reward. `kl` (B, T) is a per-token penalty such as
    `kl_penalty(logp, ref_logp, estimator="k1")`.
    """
    s = _float(score)  # (B,)
    m = mask.bool()  # (B, T)
    T = m.shape[1]
    pos = torch.arange(T, device=m.device).expand_as(m)  # (B, T)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1).values  # (B,) -1 if empty
    rewards = torch.zeros(m.shape, dtype=s.dtype, device=s.device)  # (B, T)
    rewards.scatter_(1, last.clamp(min=0)[:, None], torch.where(last >= 0, s, 0.0)[:, None])
    if kl is not None:
        rewards = rewards - kl_coef * torch.where(m, _float(kl), 0.0)
    return rewards  # (B, T)


def gae(rewards_tok: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each response.

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where "next" is the next *valid* token of the same response (V = 0 and A = 0 past the end).
    Padded tokens are skipped, not treated as steps: their rewards and values are ignored and their
    advantage and return are 0. Returns (advantages (B, T), returns = advantages + values (B, T)).
    Not whitened; see `whiten`.
    """
    r = _float(rewards_tok)  # (B, T)
    v = _float(values).to(r.dtype)  # (B, T)
    m = mask.bool()  # (B, T)
    B, T = r.shape
    next_value = torch.zeros(B, dtype=r.dtype, device=r.device)  # (B,)
    next_adv = torch.zeros(B, dtype=r.dtype, device=r.device)  # (B,)
    adv = torch.zeros_like(r)  # (B, T)
    for t in reversed(range(T)):
        valid = m[:, t]  # (B,)
        delta = r[:, t] + gamma * next_value - v[:, t]  # (B,)
        a = delta + gamma * lam * next_adv  # (B,)
        adv[:, t] = torch.where(valid, a, 0.0)
        next_adv = torch.where(valid, a, next_adv)  # carried through padding unchanged
        next_value = torch.where(valid, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)  # (B, T)
    return adv, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens of the whole batch; 0 on padding.

    The variance is unbiased (n - 1), like the GRPO std above.
    """
    xf = _float(x)  # (B, T)
    m = mask.bool()  # (B, T)
    n = m.sum().to(xf.dtype)
    mean = _masked_sum(xf, m) / n.clamp(min=1)
    var = _masked_sum((xf - mean) ** 2, m) / (n - 1).clamp(min=1)
    return torch.where(m, (xf - mean) * torch.rsqrt(var + eps), 0.0)  # (B, T)


# ---- losses -----------------------------------------------------------------------------------

def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: LossAgg | str) -> torch.Tensor:
    """Reduce a per-token quantity (B, T) to a scalar over the valid tokens.

    token_mean: sum over all valid tokens / their number (long responses weigh more).
    seq_mean:   each response's mean over its valid tokens, then the mean over the responses that
                have at least one valid token (every response weighs the same).
    An empty mask gives 0.
    """
    agg = LossAgg(agg)
    m = mask.bool()  # (B, T)
    if agg is LossAgg.TOKEN_MEAN:
        return _masked_sum(x, m) / m.sum().clamp(min=1)
    lengths = m.sum(dim=1)  # (B,)
    per_seq = _masked_sum(x, m, dim=1) / lengths.clamp(min=1)  # (B,)
    has_tokens = lengths > 0  # (B,)
    return _masked_sum(per_seq, has_tokens) / has_tokens.sum().clamp(min=1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, *, clip_eps: float, clip_eps_high: float | None = None,
                clip_ratio_c: float | None = None, is_weight: torch.Tensor | None = None,
                agg: LossAgg | str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, with verl's dual-clip for negative advantages.

        ratio = exp(logp - old_logp)
        L1    = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
        L     = min(L1, -A * clip_ratio_c)   where A < 0 (dual-clip)
        L     = L1                           where A >= 0
        loss  = aggregate(L * is_weight)

    With A < 0 a large ratio would make L1 = -A * ratio unbounded; dual-clip caps it at
    -A * clip_ratio_c (> 1; None turns it off). `clip_eps_high` defaults to `clip_eps` (set it
    higher for the asymmetric "clip-higher" bound). `is_weight` (B, T), detached, scales each
    token's loss, e.g. `truncated_is_weight` to correct for the rollout engine's policy.
    Returns (loss scalar, stats). The stats are detached scalars, always token means: clip_frac
    (tokens where the clipped term is the one used), clip_frac_lower (tokens capped by
    dual-clip), approx_kl (mean of old_logp - logp), ratio_mean.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)  # (B, T)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    capped = torch.zeros_like(per_token, dtype=torch.bool)  # (B, T)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c  # (B, T)
        capped = (adv < 0) & (bound < per_token)  # (B, T)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)  # (B, T)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()  # (B, T)
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        stats = {
            "clip_frac": aggregate((clipped > unclipped).to(ratio.dtype), mask, LossAgg.TOKEN_MEAN),
            "clip_frac_lower": aggregate(capped.to(ratio.dtype), mask, LossAgg.TOKEN_MEAN),
            "approx_kl": aggregate(-log_ratio, mask, LossAgg.TOKEN_MEAN),
            "ratio_mean": aggregate(ratio, mask, LossAgg.TOKEN_MEAN),
        }
    return loss, stats


def truncated_is_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, *,
                        cap: float) -> torch.Tensor:
    """Truncated importance weight of each token (B, T), detached:

        w = min(exp(old_logp - rollout_logp), cap)

    old_logp: the trainer's log-probs of the sampled tokens before the update; rollout_logp: the
    engine's, the policy that actually sampled them. The two differ by numerics (or by a stale
    engine); w corrects the policy gradient for it, and `cap` bounds its variance (verl's
    truncated importance sampling).
    """
    return torch.clamp(torch.exp(_float(old_logp) - _float(rollout_logp)), max=cap).detach()


def logprob_diff(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|old_logp - rollout_logp| over the valid tokens: (sum, max, count), float64 scalars, so
    that sums and maxima over micro-batches and ranks give the exact mean and max."""
    d = (_float(old_logp) - _float(rollout_logp)).abs().to(torch.float64)  # (B, T)
    m = mask.bool()  # (B, T)
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    return (_masked_sum(d, m), torch.where(m, d, zero).max() if m.any() else zero,
            m.sum().to(torch.float64))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, *, clip_eps: float, agg: LossAgg | str) -> torch.Tensor:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2), aggregated.

    V_clipped = old_V + clip(V - old_V, -clip_eps, clip_eps): the critic is not rewarded for
    moving further than clip_eps from the values the advantages were computed with.
    """
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)  # (B, T)
    err = (values - returns) ** 2  # (B, T)
    err_clipped = (v_clipped - returns) ** 2  # (B, T)
    return 0.5 * aggregate(torch.maximum(err, err_clipped), mask, agg)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, *,
               estimator: KLEstimator | str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probabilities (B, T).

    k1 = logp - ref_logp                   unbiased, can be negative per token
    k3 = exp(d) - d - 1, d = ref_logp - logp   unbiased, >= 0, lower variance (Schulman's k3)
    """
    estimator = KLEstimator(estimator)
    if estimator is KLEstimator.K1:
        return logp - ref_logp  # (B, T)
    d = ref_logp - logp  # (B, T)
    return torch.exp(d) - d - 1  # (B, T)


# ---- from logits ------------------------------------------------------------------------------

def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for each position: (B, T, V), (B, T) -> (B, T).

    Computed in float32 (float64 stays float64) as logit[token] - logsumexp(logits), which does
    not keep a (B, T, V) log-softmax around.
    """
    z = _float(logits)  # (B, T, V)
    picked = z.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(z, dim=-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at each position: (B, T, V) -> (B, T), float32 or float64.

    Masked-out vocabulary entries (logit -inf, probability 0) contribute 0.
    """
    logp = torch.log_softmax(_float(logits), dim=-1)  # (B, T, V)
    p = logp.exp()  # (B, T, V)
    return -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)  # (B, T)
