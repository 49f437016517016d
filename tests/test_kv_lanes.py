"""KV pool lanes: a request's blocks at the start of its lane, read by attention as one view.

Pool tests without Megatron; then one in-process engine (one gloo rank, the default tiny
model) run twice over the same requests, with lanes and with every step's K/V gathered
through the block tables: the tokens and log-probs must be the same bits, for greedy and
sampled requests, with admissions into freed lanes out of order, and under a KV budget that
forces preemption and requests outside lanes. Also the CPU kernels on and off: the same tokens.
"""

import warnings

import pytest
import torch

from distributed import mixed_requests
from flexfloor.rollout.kv import BlockPool


def lanes_pool(capacity, lane_blocks=3, block_tokens=4):
    return BlockPool(num_layers=2, groups=2, head_dim=8, dtype=torch.float32, device="cpu",
                     block_tokens=block_tokens, capacity=capacity, lane_blocks=lane_blocks)


def test_lanes_fill_in_order_and_other_requests_take_their_blocks_last():
    p = lanes_pool(capacity=9)  # three lanes of three blocks
    a = p.open_lane()
    assert a == 0 and p.allocate(1, lane=a) == [0]
    b = p.open_lane()
    assert b == 1 and p.allocate(2, lane=b) == [3, 4]
    assert p.allocate(1, lane=a, start=1) == [1]  # a's next block, in its lane
    # a request outside lanes takes lane 2 (not open) before the open lanes' free blocks
    loose = p.allocate(3)
    assert sorted(loose) == [6, 7, 8] and p.open_lane() is None
    # nothing else is free now: the open lanes' free blocks go, and their owners' next
    # allocation in the lane falls back to any free block
    assert sorted(p.allocate(2)) == [2, 5]
    p.free([2])
    assert p.allocate(1, lane=b, start=2) == [2]  # not lane b's block 5: b leaves its lane
    assert p.used == 9 and p.free_blocks == 0
    p.free([0, 1])  # a finishes; lane 0 holds b's block 2 now, so it is not free yet
    assert p.open_lane() is None
    p.free([2])
    assert p.open_lane() == 0


def test_lane_view_is_the_storage_and_no_lane_passes_the_capacity():
    p = lanes_pool(capacity=7)  # two whole lanes fit, a third would pass the capacity
    lanes = [p.open_lane(), None, None]
    p.allocate(2, lane=lanes[0])
    lanes[1] = p.open_lane()
    p.allocate(3, lane=lanes[1])
    assert lanes[:2] == [0, 1] and p.open_lane() is None
    assert p.k.shape[1] <= 7 * 4
    p.k[1, p.slots([3, 4, 5], 0, 12)] = torch.arange(12.0).view(12, 1, 1)
    k, v = p.lane_view(1, 2, 3)  # [lanes, groups, 3 blocks * 4, head_dim]
    assert k.shape == (2, 2, 12, 8) and k.data_ptr() == p.k[1].data_ptr()
    assert torch.equal(k[1, 0, :, 0], torch.arange(12.0))
    # unbounded: lanes are always there, the storage grows to hold them
    q = lanes_pool(capacity=None)
    assert q.open_lane() == 0 and q.allocate(1, lane=0) == [0]
    assert q.open_lane() == 1 and q.free_blocks is None


def test_reserve_sizes_the_storage_once_and_takes_nothing():
    p = lanes_pool(capacity=7)
    p.reserve(9)  # three lanes asked: the capacity holds 7 blocks
    assert p.stored_blocks == 7 and p.used == 0 and p.free_blocks == 7
    k = p.k
    assert p.open_lane() == 0 and p.allocate(3, lane=0) == [0, 1, 2]
    assert p.open_lane() == 1 and p.allocate(1, lane=1) == [3]
    assert p.k is k  # no growth: the allocations fit the reserved storage
    q = lanes_pool(capacity=None)
    q.reserve(6)
    assert q.stored_blocks == 6 and q.free_blocks is None
    assert torch.equal(q.k, torch.zeros_like(q.k))  # masked slots read zeros, never NaN


# --------------------------------------------------------------------------------------------
# the engine, in this process: one gloo rank


@pytest.fixture(scope="module")
def engine_parts():
    from distributed import one_rank_world
    from flexfloor.config import ModelConfig, RolloutConfig
    from flexfloor.model import build_model
    from flexfloor.rollout.stack import RolloutStack

    # one intra-op thread (`one_rank_world`): with several, CPU SDPA's last bits follow the batch
    with one_rank_world() as par:
        model = build_model(ModelConfig(), par)
        model.eval()
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(progress=False))
        yield model, stack.moe, stack.engine
        stack.close()


def _decode(model, moe, engine, *, lanes, **kw):
    from flexfloor.rollout.engine import RolloutEngine, StaticMembership
    import flexfloor.rollout.engine as engine_module

    eng = RolloutEngine(model, moe, rank=0, block_tokens=4, kv_lanes=lanes, **kw)
    seen = {"lanes": 0, "gathered": 0, "rows": 0}
    real = RolloutEngine._batch

    def counting(self, running, pool):  # which attention path each step took
        batch = real(self, running, pool)
        seen["lanes" if batch.lanes is not None else "gathered"] += 1
        seen["rows"] += batch.lane_rows is not None
        return batch

    engine_module.RolloutEngine._batch = counting
    try:
        out = eng.generate(mixed_requests(model.vocab_size), StaticMembership())
    finally:
        engine_module.RolloutEngine._batch = real
    return {r.request_id: (r.token_ids, r.logprobs) for r in out.results}, seen, out.record


@pytest.mark.parametrize("engine_kw", [
    dict(max_batch_size=4),  # later admissions take freed lanes, not in request order
    dict(max_batch_size=10, kv_budget_bytes=None),  # every request in a lane from the start
], ids=["freed-lanes", "all-lanes"])
def test_lanes_give_the_gathered_steps_tokens_bit_for_bit(engine_parts, engine_kw):
    model, moe, engine = engine_parts
    want, gathered, _ = _decode(model, moe, engine, lanes=False, **engine_kw)
    got, seen, _ = _decode(model, moe, engine, lanes=True, **engine_kw)
    assert gathered["lanes"] == 0 and seen["gathered"] == 0 and seen["lanes"] > 0
    if engine_kw["max_batch_size"] == 4:
        assert seen["rows"] > 0  # running requests sat in lanes other than 0 .. B-1
    assert got == want


def test_a_tight_budget_preempts_and_leaves_lanes_with_the_same_tokens(engine_parts):
    model, moe, engine = engine_parts
    # 14 blocks of 4 tokens: fewer than 10 whole lanes, so requests run outside lanes too,
    # and too few for every running request's growth, so some are preempted
    kw = dict(max_batch_size=10, kv_budget_bytes=14 * 4 * engine.kv_bytes_per_token)
    want, _, _ = _decode(model, moe, engine, lanes=False, **kw)
    got, seen, record = _decode(model, moe, engine, lanes=True, **kw)
    assert record.preempted > 0 and seen["gathered"] > 0
    assert got == want


def test_an_engine_on_several_cpu_threads_warns_that_tokens_may_follow_the_batch(engine_parts):
    from flexfloor.rollout.engine import RolloutEngine

    model, moe, _ = engine_parts
    torch.set_num_threads(2)
    try:
        with pytest.warns(RuntimeWarning, match="OMP_NUM_THREADS=1"):
            RolloutEngine(model, moe, rank=0)
    finally:
        torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutEngine(model, moe, rank=0)  # one thread: no warning


def test_the_cpu_kernels_give_torchs_tokens(engine_parts, monkeypatch):
    """rollout.cpu_kernels on (the default) and off over the same requests (greedy and
    sampled, lanes and gathered blocks under a budget that preempts): the same tokens, log-probs
    within float32 rounding; with them on, every decode-only step's attention ran the kernel."""
    from megatron_ext import cpu_kernels

    model, moe, engine = engine_parts
    calls = {"decode_attention": 0, "grouped_mm": 0}

    def counting(name):
        real = getattr(cpu_kernels, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in calls:  # each kernel's calls counted, in both runs
        monkeypatch.setattr(cpu_kernels, name, counting(name))
    kw = dict(max_batch_size=10, kv_budget_bytes=14 * 4 * engine.kv_bytes_per_token)
    want, _, _ = _decode(model, moe, engine, lanes=True, cpu_kernels=False, **kw)
    assert calls == {"decode_attention": 0, "grouped_mm": 0}
    got, seen, record = _decode(model, moe, engine, lanes=True, **kw)
    assert record.preempted > 0 and seen["gathered"] > 0 and seen["lanes"] > 0
    assert calls["decode_attention"] > 0 and calls["grouped_mm"] > 0
    assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in want.items()}
    for k, (_, logprobs) in got.items():
        torch.testing.assert_close(logprobs, want[k][1], rtol=0, atol=1e-5)
