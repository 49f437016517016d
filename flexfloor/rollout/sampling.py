"""Sampling for a whole batch at once, on the device, with counter-based randomness.

Each draw is Gumbel-max over the filtered, temperature-scaled logits (noise drawn only for the
candidates top-k keeps), with noise from an integer
hash (splitmix64 in int64 torch ops: the same bits on CPU and CUDA) of the key (seed, step,
prompt_uid, sample_index, position, token id). The token a request samples at a position
therefore depends on nothing else: not its rank, batch, placement, preemption or migration, and
moving a request needs only its position (no generator state).

The returned log-prob is under the temperature-scaled distribution before top-k/top-p filtering
(the quantity the trainer recomputes for the importance ratio); greedy reports it at
temperature 1. Sampling runs in float64; an all-greedy batch in the logits' own dtype (float32
for a float32 or bfloat16 model: its log-probs within ~1e-6 of float64's).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from flexfloor.rollout.types import Request


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping multiply): a bijective integer hash."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def draw_keys(fields: torch.Tensor) -> torch.Tensor:
    """fields [B, F] int64 (seed, step, prompt_uid, sample_index, position) -> one key per row [B]."""
    h = torch.zeros(fields.shape[0], dtype=torch.int64, device=fields.device)
    for i in range(fields.shape[1]):
        h = splitmix64(h ^ fields[:, i])
    return h


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [B] -> uniforms [B, V] in (0, 1), float64, one per (key, token id)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    return uniforms_at(keys, ids.unsqueeze(0))


def uniforms_at(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """keys [B], token_ids [B or 1, K] -> the uniforms of those tokens [B, K]: the same values
    as the columns `token_ids` of `uniforms(keys, V)`."""
    salt = (token_ids + 1) * _GOLDEN  # token id t hashes as t + 1
    bits = _shr(splitmix64(keys.unsqueeze(1) ^ salt), 11)  # 53 bits
    return (bits.double() + 0.5) * (1.0 / (1 << 53))


def key_fields(requests: Sequence[Request], positions: Sequence[int], device) -> torch.Tensor:
    """[B, 5] int64: each request's stream key at the position of the token it samples."""
    return torch.tensor([[r.seed, r.step, r.prompt_uid, r.sample_index, p]
                         for r, p in zip(requests, positions)], dtype=torch.int64, device=device)


def sample(logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, log-probs [B] float64), every row its own request's
    parameters (greedy, temperature, top_k, top_p) and its own stream at `positions[b]` (the
    index in the sequence of the token sampled)."""
    params = [r.sampling for r in requests]
    is_greedy = [p.greedy or p.temperature == 0.0 for p in params]  # on the host: no device read
    if all(is_greedy):  # in the logits' dtype: no float64 copy of [B, V] (argmax: the same token)
        tokens = logits.argmax(dim=-1)
        chosen = F.log_softmax(logits, dim=-1).gather(1, tokens.view(-1, 1)).view(-1)
        return tokens, chosen.double()
    logits = logits.double()
    B, V = logits.shape
    dev = logits.device
    greedy = torch.tensor(is_greedy, device=dev)
    temp = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, is_greedy)],
                        dtype=torch.float64, device=dev)
    scaled = logits / temp.unsqueeze(1)
    logprobs = F.log_softmax(scaled, dim=-1)  # [B, V] before filtering: what the trainer uses
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    # candidates: the K most likely tokens of each row, K the largest top_k (all V when a row
    # has none): only they get noise; the rest are filtered out anyway
    K = max(k for k, g in zip(ks, is_greedy) if not g)
    top_k = torch.tensor(ks, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    if K < V:  # [B, K] in descending order, as the first K of a full sort
        ordered, order = torch.topk(scaled, K, dim=-1, sorted=True)
    else:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    rank = torch.arange(K, device=dev).unsqueeze(0)
    ordered = ordered.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        probs = torch.softmax(ordered, dim=-1)
        # drop a token when the tokens before it already cover top_p
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(1)
        ordered = ordered.masked_fill(drop & (top_p < 1.0).unsqueeze(1), float("-inf"))
    keys = draw_keys(key_fields(requests, positions, dev))
    gumbel = -torch.log(-torch.log(uniforms_at(keys, order)))  # each candidate's own noise
    sampled = order.gather(1, torch.argmax(ordered + gumbel, dim=-1, keepdim=True)).view(-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen = torch.where(greedy.unsqueeze(1), F.log_softmax(logits, dim=-1), logprobs)
    return tokens, chosen.gather(1, tokens.view(-1, 1)).view(-1)
