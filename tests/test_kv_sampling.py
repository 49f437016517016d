"""The KV block pool and the counter-based batch sampler, in one process (no Megatron)."""

import math

import pytest
import torch
import torch.nn.functional as F

from flexfloor.rollout.kv import BlockPool, blocks_for
from flexfloor.rollout.sampling import draw_keys, key_fields, sample, splitmix64, uniforms
from flexfloor.rollout.types import Request, RolloutError, SamplingParams


def pool(capacity, block_tokens=4):
    return BlockPool(num_layers=2, groups=2, head_dim=8, dtype=torch.float32, device="cpu",
                     block_tokens=block_tokens, capacity=capacity)


def test_blocks_for_counts_whole_blocks():
    assert [blocks_for(t, 16) for t in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_pool_never_exceeds_capacity_and_reuses_freed_blocks():
    p = pool(capacity=5)
    a = p.allocate(3)
    assert p.free_blocks == 2 and not p.can_allocate(3) and p.can_allocate(2)
    with pytest.raises(RolloutError, match="3 blocks asked, 2 free"):
        p.allocate(3)
    assert p.used == 3  # a refused allocation takes nothing
    b = p.allocate(2)
    assert sorted(a + b) == list(range(5)) and p.k.shape[1] == 5 * 4  # storage stops at capacity
    p.free(a)
    assert p.free_blocks == 3 and sorted(p.allocate(3)) == sorted(a)
    assert p.peak == 5
    # borrowed expert bytes take whole blocks of the room
    p.free(b)
    p.withhold(p.block_bytes + 1)
    assert p.free_blocks == 0 and p.peak == 5


def test_pool_grows_on_demand_when_unbounded_and_keeps_contents():
    p = pool(capacity=None)
    a = p.allocate(2)
    p.k[0, p.slots(a, 0, 8)] = 1.0
    p.allocate(BlockPool.GROW + 5)  # storage grows
    assert p.free_blocks is None and p.k.shape[1] >= (BlockPool.GROW + 7) * 4
    assert bool((p.k[0, p.slots(a, 0, 8)] == 1.0).all())
    assert p.slots([3, 1], 2, 7) == [14, 15, 4, 5, 6]  # block table: position -> slot


def req(uid, sampling, sample_index=0):
    return Request(prompt_uid=uid, sample_index=sample_index, prompt_ids=(1, 2, 3),
                   max_new_tokens=8, sampling=sampling, seed=5, step=2)


def test_hash_streams_are_keyed_by_every_field():
    base = torch.tensor([[5, 2, 7, 0, 11]])
    keys = {int(draw_keys(base)[0])}
    for col in range(5):
        other = base.clone()
        other[0, col] += 1
        keys.add(int(draw_keys(other)[0]))
    assert len(keys) == 6
    u = uniforms(draw_keys(base), 1000)
    assert u.dtype == torch.float64 and 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.03
    # wrapping int64 arithmetic, no overflow error, a bijection on a sample
    x = torch.arange(-1000, 1000, dtype=torch.int64) * (1 << 40)
    assert splitmix64(x).unique().numel() == x.numel()


def test_sampling_follows_the_tempered_distribution_and_returns_unfiltered_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(12, dtype=torch.float64) * 2
    sp = SamplingParams(temperature=0.7)
    n = 4000
    reqs = [req(i, sp) for i in range(n)]
    tokens, logprobs = sample(logits.expand(n, -1), reqs, [3] * n)
    want = F.softmax(logits / 0.7, dim=-1)
    freq = torch.bincount(tokens, minlength=12).double() / n
    assert float((freq - want).abs().max()) < 0.03
    expect = F.log_softmax(logits / 0.7, dim=-1)[tokens]
    assert torch.allclose(logprobs, expect, atol=1e-12, rtol=0)
    # the same key draws the same token whatever the batch around it
    alone, _ = sample(logits.view(1, -1), [reqs[17]], [3])
    assert int(alone[0]) == int(tokens[17])
    # another position is another draw
    moved, _ = sample(logits.expand(n, -1), reqs, [4] * n)
    assert not torch.equal(moved, tokens)


def test_top_k_top_p_greedy_and_mixed_batches():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    n = 500
    top_k = [req(i, SamplingParams(top_k=2)) for i in range(n)]
    tokens, logprobs = sample(logits.expand(n, -1), top_k, [0] * n)
    assert set(tokens.tolist()) == {0, 1}
    # log-probs stay those of the unfiltered distribution (what the trainer recomputes)
    assert math.isclose(float(logprobs[tokens == 1][0]), float(F.log_softmax(logits, -1)[1]))
    # top_p 0.6: token 0 has 0.636 of the mass, so it alone is kept
    top_p = [req(i, SamplingParams(top_p=0.6)) for i in range(n)]
    assert set(sample(logits.expand(n, -1), top_p, [0] * n)[0].tolist()) == {0}
    mixed = [req(0, SamplingParams(greedy=True)), req(1, SamplingParams(temperature=5.0))]
    rows = torch.stack([logits.flip(0), logits])
    tokens, logprobs = sample(rows, mixed, [0, 0])
    assert int(tokens[0]) == 4
    assert math.isclose(float(logprobs[0]), float(F.log_softmax(logits.flip(0), -1)[4]))
    assert math.isclose(float(logprobs[1]), float(F.log_softmax(logits / 5.0, -1)[tokens[1]]))
    fields = key_fields(mixed, [0, 9], "cpu")
    assert fields.tolist() == [[5, 2, 0, 0, 0], [5, 2, 1, 0, 9]]


def test_greedy_batch_logprobs_in_the_logits_dtype():
    """An all-greedy batch takes its log-probs in the logits' own dtype (no float64 copy of the
    logits): float32 logits give float32's log-softmax, returned as float64, within 1e-6 of
    float64's; the tokens are the argmax either way."""
    torch.manual_seed(5)
    logits = torch.randn(6, 50) * 4
    reqs = [req(i, SamplingParams(greedy=True)) for i in range(6)]
    tokens, logprobs = sample(logits, reqs, [0] * 6)
    assert torch.equal(tokens, logits.argmax(-1)) and logprobs.dtype == torch.float64
    pick = tokens.view(-1, 1)
    assert torch.equal(logprobs, F.log_softmax(logits, -1).gather(1, pick).view(-1).double())
    exact = F.log_softmax(logits.double(), -1).gather(1, pick).view(-1)
    assert float((logprobs - exact).abs().max()) < 1e-6


def _full_vocabulary_draw(logits, requests, positions):
    """The sampler's definition over the whole vocabulary: every token gets its noise, the
    filtered ones -inf, Gumbel-max picks (what `sample` computes on the candidates only)."""
    V = logits.shape[1]
    out = []
    keys = draw_keys(key_fields(requests, positions, "cpu"))
    noise = -torch.log(-torch.log(uniforms(keys, V)))
    for row, r, g in zip(logits, requests, noise):
        p = r.sampling
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        scaled = row / p.temperature
        ordered, order = torch.sort(scaled, descending=True)
        keep = torch.arange(V) < (p.top_k if 0 < p.top_k < V else V)
        probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), -1)
        if p.top_p < 1.0:
            keep &= (torch.cumsum(probs, -1) - probs) < p.top_p
        filtered = torch.full_like(scaled, float("-inf"))
        filtered[order[keep]] = scaled[order[keep]]
        out.append(int((filtered + g).argmax()))
    return out


def test_noise_on_the_candidates_only_draws_the_full_vocabularys_tokens():
    torch.manual_seed(2)
    V, n = 300, 240
    logits = torch.randn(n, V, dtype=torch.float64) * 3
    kinds = [SamplingParams(top_k=20), SamplingParams(top_k=7, top_p=0.8, temperature=0.6),
             SamplingParams(greedy=True), SamplingParams(top_k=40, top_p=0.5)]
    reqs = [req(i, kinds[i % len(kinds)], sample_index=i % 3) for i in range(n)]
    positions = [i % 17 for i in range(n)]
    tokens, logprobs = sample(logits, reqs, positions)
    assert tokens.tolist() == _full_vocabulary_draw(logits, reqs, positions)
    assert len(set(tokens[0::4].tolist())) > 5  # the draws vary
    # top-p without top-k: every token is a candidate
    nucleus = [req(i, SamplingParams(top_p=0.7)) for i in range(n)]
    assert sample(logits, nucleus, positions)[0].tolist() == _full_vocabulary_draw(
        logits, nucleus, positions)
