"""Replicas, the five modes, the cost model's terms and the RL-like workloads, in the simulator:
plain Python on the real scheduler, membership and cost objects, no process group."""

import numpy as np
import pytest

from flexfloor.rollout.elastic import RankLimits
from flexfloor.rollout.scheduler import PromptGroup, least_outstanding
from flexfloor.rollout.types import Request
from flexfloor.rollout.workload import dataset_batches, make_lengths
from flexfloor.sim.cost import (
    DEEPEP_LOW_LATENCY, CostParams, GroupSource, RankLoad, RooflineCost, a2a_seconds,
)
from flexfloor.sim.hardware import ACCELERATORS, ModelShape
from flexfloor.sim.rollout import SimRequest, replica_state, simulate_rollout
from flexfloor.sim.scenarios import MODES, SCENARIOS, route_least_outstanding, run

QWEN = ModelShape.from_preset("qwen3-30b-a3b")
H800 = ACCELERATORS["H800"]


# ---------------------------------------------------------------- routing


def test_least_outstanding_on_a_known_arrival_sequence():
    events = [("submit", "a"), ("submit", "b"), ("submit", "c"), ("done", "a"),
              ("submit", "d"), ("submit", "e"), ("done", "b"), ("submit", "f")]
    # outstanding after each: a->0 [1,0]; b->1 [1,1]; c->0 [2,1]; done a [1,1]; d->0 [2,1];
    # e->1 [2,2]; done b [2,1]; f->1
    assert least_outstanding(events, 2) == {"a": 0, "b": 1, "c": 0, "d": 0, "e": 1, "f": 1}
    # three targets, a finished request frees its target for the next
    events = [("submit", "a"), ("submit", "b"), ("done", "a"), ("submit", "c"), ("submit", "d")]
    assert least_outstanding(events, 3) == {"a": 0, "b": 1, "c": 0, "d": 2}
    with pytest.raises(ValueError, match="submitted twice"):
        least_outstanding([("submit", "a"), ("submit", "a")], 2)
    with pytest.raises(ValueError, match="before it was submitted"):
        least_outstanding([("done", "a")], 2)


def test_static_routes_samples_over_replicas_then_ranks():
    groups = [PromptGroup(u, tuple(Request(prompt_uid=u, sample_index=s, prompt_ids=(1, 2),
                                           max_new_tokens=8, target_len=4) for s in range(3)))
              for u in range(2)]
    out = route_least_outstanding(groups, [(0, 1), (2, 3)])
    ids = {r: [q.request_id for q in reqs] for r, reqs in out.items()}
    order = [q.request_id for g in groups for q in g.requests]
    # the batch in order alternates replicas (0, 1, 0, 1, ...), each replica alternates its ranks
    assert ids == {0: [order[0], order[4]], 1: [order[2]], 2: [order[1], order[5]], 3: [order[3]]}


# ---------------------------------------------------------------- cost model


def test_a_step_costs_more_with_batch_and_kv():
    cost = RooflineCost(H800, QWEN)
    owner = replica_state(QWEN.num_experts, range(8))[0].owner
    small = [RankLoad(r, 4, 4 * 1000, 16, 4 * 1000) for r in range(8)]
    big = [RankLoad(r, 384, 384 * 1000, 16, 384 * 1000) for r in range(8)]
    long_ctx = [RankLoad(r, 4, 4 * 16000, 16, 4 * 16000) for r in range(8)]
    assert cost.step_seconds(small, owner) < cost.step_seconds(long_ctx, owner)
    assert cost.step_seconds(small, owner) < cost.step_seconds(big, owner)


def test_all_to_all_follows_the_deepep_table():
    p = CostParams()
    # at each published EP size, the bytes a rank moves at the published rate take the
    # published time (dispatch and combine), and a larger group is slower for the same bytes
    for ep, (disp_s, disp_bw, comb_s, comb_bw) in DEEPEP_LOW_LATENCY.items():
        d, _ = a2a_seconds(disp_s * disp_bw, ep, True, H800, p)
        _, c = a2a_seconds(comb_s * comb_bw, ep, True, H800, p)
        assert d == pytest.approx(disp_s) and c == pytest.approx(comb_s)
    times = [a2a_seconds(8e6, ep, True, H800, p)[0] for ep in (8, 12, 16, 48, 128, 256)]
    assert times == sorted(times) and times[-1] == times[-2]  # held beyond EP128
    # one node: NVLink at DeepEP's intranode rate, cheaper than across nodes; a floor for a few
    # tokens; nothing for a group of one
    assert a2a_seconds(8e6, 8, False, H800, p)[0] == pytest.approx(8e6 / 155e9)
    assert a2a_seconds(8e6, 8, False, H800, p)[0] < a2a_seconds(8e6, 16, True, H800, p)[0]
    assert a2a_seconds(100.0, 64, True, H800, p) == (p.a2a_floor_s, p.a2a_floor_s)
    assert a2a_seconds(8e6, 1, False, H800, p) == (0.0, 0.0)


def test_group_creation_costs_what_the_code_does():
    from megatron_ext.placement import Transfer

    transfers = [Transfer(0, 0, 1)]
    new = RooflineCost(H800, QWEN, CostParams(group_source=GroupSource.NEW))
    prebuilt = RooflineCost(H800, QWEN, CostParams(group_source=GroupSource.PREBUILT))
    moved = QWEN.expert_bytes / (H800.nvlink_bytes_per_s * CostParams().link_efficiency)
    assert new.shrink_seconds(transfers, [0]) == pytest.approx(moved + 2.0)
    assert prebuilt.shrink_seconds(transfers, [0]) == pytest.approx(moved + 0.02)


def test_zipf_popularity_slows_the_rank_with_hot_experts():
    owner = replica_state(QWEN.num_experts, range(8))[0].owner
    uniform, skewed = RooflineCost(H800, QWEN), RooflineCost(H800, QWEN, CostParams(zipf_s=1.2))
    # many tokens (prefill-sized): the rank hosting the hot experts computes and receives more
    big = [RankLoad(r, 2048, 2048, 16, 2048 * 1024) for r in range(8)]
    assert skewed.step_seconds(big, owner) > 1.2 * uniform.step_seconds(big, owner)
    # a few tokens: they touch fewer distinct experts, so fewer expert weights are read
    small = [RankLoad(r, 2, 2000, 16, 2000) for r in range(8)]
    assert skewed.step_seconds(small, owner) < uniform.step_seconds(small, owner)
    with pytest.raises(ValueError, match="zipf_s"):
        RooflineCost(H800, QWEN, CostParams(zipf_s=-1.0))


# ---------------------------------------------------------------- KV blocks


def _one_rank(block, budget_tokens, n=10, prompt=10, length=200):
    kv = 4
    limits = RankLimits(kv_bytes_per_token=kv, max_seq_len=prompt + length, max_batch_size=64,
                        kv_budget_bytes=budget_tokens * kv, expert_nbytes=1)
    placement, _ = replica_state(2, [0])
    reqs = [SimRequest(f"r{i}", i, prompt, length) for i in range(n)]
    from flexfloor.sim.cost import UnitCost

    return simulate_rollout({0: reqs}, None, UnitCost(), limits=limits, placement=placement,
                            kv_block_tokens=block)


def test_blocks_admit_as_tokens_are_produced_and_preempt_when_full():
    # room for 2100 tokens: all 10 requests (210 tokens each) at once, with blocks; the full
    # reservation admits them at once too
    full, blocks = _one_rank(None, 2400), _one_rank(16, 2400)
    assert full.records[0]["steps"] == blocks.records[0]["steps"] == 200
    # room for 1000 tokens: the full reservation runs 4 at a time (3 waves), blocks start all
    # 10 and preempt the last admitted as their caches fill; every token still comes out
    full, blocks = _one_rank(None, 1000), _one_rank(16, 1000)
    assert full.records[0]["steps"] == 600
    assert blocks.records[0]["preempted"] > 0
    assert blocks.total_tokens == full.total_tokens == 2000 and blocks.num_responses == 10
    assert blocks.records[0]["kv_peak_bytes"] <= 1000 * 4


# ---------------------------------------------------------------- workloads


def test_dataset_epochs_bring_a_prompt_back_once_per_d_over_b_steps():
    b = dataset_batches(64, 16, 8, seed=0)
    assert b.shape == (8, 16)
    for start in (0, 4):  # each dataset epoch (4 steps) draws every prompt exactly once
        assert sorted(b[start:start + 4].ravel().tolist()) == list(range(64))
    assert np.array_equal(dataset_batches(16, 16, 3, 0)[2], np.array(
        __import__("flexfloor.rollout.workload", fromlist=["epoch_order"]).epoch_order(16, 0, 3)))
    with pytest.raises(ValueError, match="dataset_prompts"):
        dataset_batches(8, 16, 2, 0)


def test_no_history_for_a_prompt_before_its_second_appearance():
    sc = SCENARIOS["tiny-cpu"].with_overrides(num_prompts=8, dataset_prompts=24, epochs=5,
                                              samples_per_prompt=2, max_len=40)
    rep = run(sc)
    # steps 1-3 draw 24 distinct prompts (no history); steps 4-5 draw them again (all history)
    assert rep["workload"]["prompts_with_history"] == [0, 0, 0, 8, 8]
    assert rep["workload"]["dataset_prompts"] == 24


def test_history_correlation_and_cap_fraction():
    sizes = dict(num_prompts=400, samples_per_prompt=4, epochs=2, seed=0, max_len=10_000)

    def spearman(a):
        g = a.max(axis=2).astype(float)
        r0, r1 = (np.argsort(np.argsort(x)) for x in g)
        return np.corrcoef(r0, r1)[0, 1]

    strong = spearman(make_lengths("lognormal", **sizes))
    weak = spearman(make_lengths("lognormal", history_correlation=0.3, **sizes))
    none = spearman(make_lengths("lognormal", history_correlation=0.0, **sizes))
    assert strong > 0.9 and 0.1 < weak < 0.6 and abs(none) < 0.15
    # the first epoch is the same whatever the correlation: only later bases are redrawn
    assert np.array_equal(make_lengths("lognormal", history_correlation=0.3, **sizes)[0],
                          make_lengths("lognormal", **sizes)[0])
    capped = make_lengths("lognormal", median=100, cap_fraction=0.1, **sizes)
    assert 0.08 < (capped == 10_000).mean() < 0.12
    with pytest.raises(ValueError, match="history_correlation"):
        make_lengths("lognormal", history_correlation=1.5, **sizes)
    with pytest.raises(ValueError, match="cap_fraction"):
        make_lengths("lognormal", cap_fraction=-0.1, **sizes)


# ---------------------------------------------------------------- five modes


def test_five_modes_same_requests_and_their_hold_rules():
    sc = SCENARIOS["tiny-cpu"].with_overrides(replicas=2, epochs=2, num_prompts=12,
                                              samples_per_prompt=4, max_len=60,
                                              length_params={"median": 8.0})
    rep = run(sc)
    assert rep["modes"] == MODES == ["static", "static_chunks", "replica_release",
                                     "single_group", "elastic"]
    tokens = {m: rep[m]["total_response_tokens"] for m in MODES}
    assert len(set(tokens.values())) == 1, tokens
    for entry in rep["per_epoch"]:
        for m in ("static", "static_chunks", "single_group"):  # all held to the end
            assert len({r["release_s"] for r in entry[m]["per_rank"]}) == 1, m
        # replica_release: the ranks of a replica leave together, the replicas at their own ends
        rel = entry["replica_release"]["per_rank"]
        assert rel[0]["release_s"] == rel[1]["release_s"] and rel[2]["release_s"] == rel[3]["release_s"]
        assert entry["replica_release"]["occupied_worker_seconds"] <= entry["static"]["occupied_worker_seconds"]
        # same routing: replica_release never takes longer than static
        assert entry["replica_release"]["rollout_wall_seconds"] == entry["static"]["rollout_wall_seconds"]
    assert set(rep["ratios_vs"]) == set(MODES) - {"elastic"}
    assert rep["ratios"] == rep["ratios_vs"]["static"] | {
        k: rep["ratios"][k] for k in ("elastic_over_ideal", "static_over_ideal")}
    assert rep["vs_static"]["static"]["tokens_per_occupied_worker_second"] == 1.0
    with pytest.raises(ValueError, match="replicas=3 must divide"):
        run(sc.with_overrides(replicas=3))
