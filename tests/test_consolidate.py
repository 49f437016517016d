"""Tail consolidation: the decision on hand-built step states (pure, no process group), the
placement across replicas by modelled seconds, and the simulator with consolidation on counting
the same tokens as static."""

import numpy as np
import pytest

from flexfloor.config import PlacementPolicy
from flexfloor.rollout.consolidate import (
    ConsolidationRules, ConsolidationState, MoveKind, MovePrices, RankState, Running, decide,
    remaining_estimate,
)
from flexfloor.rollout.scheduler import (
    LengthHistory, PromptGroup, Scheduler, _worst_end, replica_finish,
)
from flexfloor.rollout.types import Request

CHEAP_KV = MovePrices(kv_bytes_per_token=1000, transfer_bytes_per_s=1e9, reprefill_s_per_token=1e-5)
CHEAP_PREFILL = MovePrices(kv_bytes_per_token=1000, transfer_bytes_per_s=1e6,
                           reprefill_s_per_token=1e-5)


def flat(n, ctx):  # a step costs the same whatever the batch: moving in never slows the taker
    return 0.01 + 0.0 * np.asarray(ctx, dtype=float)


def per_request(n, ctx):  # a step costs 10 ms per running request
    return 0.01 * np.asarray(n, dtype=float)


def rank(rank, replica, *remaining, queued=0, free=None, cached=100):
    return RankState(rank, replica, tuple(Running(f"r{rank}-{i}", cached, float(x))
                                          for i, x in enumerate(remaining)), queued, free)


def state(*ranks, max_batch=8, now=None):
    """Replica 0's clock 1 s ahead of the others' by default (the simulator's replicas run on
    their own clocks; a taker ahead of its giver has the moved KV before it steps again)."""
    replicas = sorted({r.replica for r in ranks})
    return ConsolidationState(tuple(ranks), now or {i: 1.0 if i == 0 else 0.0 for i in replicas},
                              max_batch, 16)


def test_a_short_tail_moves_across_replicas_and_its_replica_leaves():
    # the taker's clock is ahead of the giver's (the simulator's replicas run on their own):
    # the KV arrives before it steps again, so its end does not move
    s = state(rank(0, 0, 1000), rank(1, 0, 1000, 900), rank(2, 1, 10), rank(3, 1))
    d = decide(s, ConsolidationRules(), flat, CHEAP_KV)
    assert d.leaving_replicas == [1]
    assert [(m.request_id, m.src, m.dst, m.kind) for m in d.moves] == [
        ("r2-0", 2, 0, MoveKind.KV_TRANSFER)]  # the least loaded rank of the staying replica
    assert d.moves[0].seconds == pytest.approx(100 * 1000 / 1e9)
    # on the replica that ends the rollout even a transfer's wait would lengthen it: refused
    s0 = state(rank(0, 0, 1000), rank(1, 0, 1000, 900), rank(2, 1, 10), rank(3, 1),
               now={0: 0.0, 1: 0.0})
    assert decide(s0, ConsolidationRules(), flat, CHEAP_KV).moves == []
    # where the link is slow, the request is re-prefilled on its taker instead: the prefill's
    # second would delay replica 0, which ends the rollout, so it goes to replica 2 (slack)
    s = state(rank(0, 0, 1000), rank(2, 1, 10), rank(4, 2, 100))
    d = decide(s, ConsolidationRules(), flat, CHEAP_PREFILL)
    assert [(m.src, m.dst, m.kind) for m in d.moves] == [(2, 4, MoveKind.REPREFILL)]
    assert d.moves[0].seconds == pytest.approx(100 * 1e-5)


def test_a_replica_that_has_shrunk_inside_gives_but_never_takes():
    """The step-cost bound prices a taker as a full replica; a shrunk one's ranks host more
    experts and step slower, so it takes nothing (`ConsolidationState.shrunk`)."""
    import dataclasses

    s = state(rank(0, 0, 1000), rank(1, 0, 1000, 900), rank(2, 1, 10), rank(3, 1))
    assert decide(s, ConsolidationRules(), flat, CHEAP_KV).leaving_replicas == [1]
    shrunk = dataclasses.replace(s, shrunk=frozenset({0}))
    assert decide(shrunk, ConsolidationRules(), flat, CHEAP_KV).moves == []
    # a shrunk replica may still give: replica 1 shrank, and its tail goes to replica 0
    gives = dataclasses.replace(s, shrunk=frozenset({1}))
    assert decide(gives, ConsolidationRules(), flat, CHEAP_KV).leaving_replicas == [1]


def test_nothing_moves_when_it_does_not_fit():
    # the takers' batches are full
    s = state(rank(0, 0, 1000, 900), rank(1, 0, 1000, 900), rank(2, 1, 10, 5), max_batch=2)
    assert decide(s, ConsolidationRules(), flat, CHEAP_KV).moves == []
    # a replica with queued requests does not give; only part of a replica would free nothing
    s = state(rank(0, 0, 1000), rank(1, 0, 1000), rank(2, 1, 10, queued=1))
    assert decide(s, ConsolidationRules(), flat, CHEAP_KV).moves == []
    s = state(rank(0, 0, 1000, 900), rank(1, 0, 1000), rank(2, 1, 10, 5), max_batch=2)
    assert decide(s, ConsolidationRules(), flat, CHEAP_KV).moves == []  # one slot for two
    # the floor of staying replicas
    s = state(rank(0, 0, 1000), rank(2, 1, 10))
    assert decide(s, ConsolidationRules(min_replicas=2), flat, CHEAP_KV).moves == []


def test_the_memory_floor_keeps_the_takers_reserve():
    # the request needs blocks for its 100 cached + 10 remaining tokens (+1): 7 blocks of 16
    def two(free):
        return state(rank(0, 0, 1000, free=free), rank(2, 1, 10, free=50))

    assert decide(two(7), ConsolidationRules(), flat, CHEAP_KV).leaving_replicas == [1]
    assert decide(two(6), ConsolidationRules(), flat, CHEAP_KV).moves == []
    assert decide(two(9), ConsolidationRules(reserve_blocks=3), flat, CHEAP_KV).moves == []
    assert decide(two(10), ConsolidationRules(reserve_blocks=3), flat, CHEAP_KV).moves != []


def test_the_step_cost_bound_never_lengthens_the_rollout():
    # one more request on the long replica doubles its step: 1000 steps at 20 ms > its 11 s end
    s = state(rank(0, 0, 1000), rank(2, 1, 10))
    assert decide(s, ConsolidationRules(), per_request, CHEAP_KV).moves == []
    # the same move onto a replica with slack (it ends long before the rollout does) is taken
    s = state(rank(0, 0, 1000), rank(2, 1, 10), rank(4, 2, 100))
    d = decide(s, ConsolidationRules(), per_request, CHEAP_KV)
    assert d.leaving_replicas == [1]
    assert [(m.src, m.dst) for m in d.moves] == [(2, 4)]
    # its end with the move (100 steps at 10 ms, 10 of them at 20 ms) within the rollout's
    # 11 s; a later clock counts: from 9.95 s replica 2 would end at 11.05 s
    s = state(rank(0, 0, 1000), rank(2, 1, 10), rank(4, 2, 100), now={0: 1.0, 1: 0.0, 2: 9.95})
    assert decide(s, ConsolidationRules(), per_request, CHEAP_KV).moves == []
    # with an end to keep (the correction's bound) the taker stays within it too: replica 2
    # would end at 1.1 s with the move, past a bound of 1 s though within the rollout's 11 s
    import dataclasses

    s = state(rank(0, 0, 1000), rank(2, 1, 10), rank(4, 2, 100))
    assert decide(dataclasses.replace(s, end_bound_s=1.2), ConsolidationRules(), per_request,
                  CHEAP_KV, givers=[1]).leaving_replicas == [1]
    assert decide(dataclasses.replace(s, end_bound_s=1.0), ConsolidationRules(), per_request,
                  CHEAP_KV, givers=[1]).moves == []


def test_a_replica_running_late_hands_its_longest_to_one_held_anyway():
    """The correction: replica 0 would end past the bound (its four requests step at 40 ms);
    its longest goes to replica 1, which runs anyway and ends within the bound with it (its
    estimate counted twice), and replica 0 stays and ends within the bound."""
    import dataclasses

    late = [rank(0, 0, 1000, 900, 900, 900), rank(2, 1, 300)]
    # replica 0 from its clock of 1 s: 900 steps at 40 ms, 100 at 10 ms: 38 s
    s = dataclasses.replace(state(*late), end_bound_s=30.0)
    d = decide(s, ConsolidationRules(), per_request, CHEAP_KV, givers=[0])
    assert [(m.request_id, m.src, m.dst, m.kind) for m in d.moves] == [
        ("r0-0", 0, 2, MoveKind.KV_TRANSFER)]
    assert d.corrected_replicas == [0] and d.leaving_replicas == []
    # not when the taker would end past the bound with it: at 22 s (replica 1 from 1 s, when
    # the KV arrives: 300 steps at 20 ms, 1700 at 10 ms of the doubled estimate: 24 s)
    # (without lightening, which test_a_late_replica_whose_longest_no_taker_takes_is_lightened
    # covers)
    s = dataclasses.replace(state(*late), end_bound_s=22.0)
    assert decide(s, ConsolidationRules(lighten=False), per_request, CHEAP_KV,
                  givers=[0]).moves == []
    # at 25 s replica 0 must hand over two (900 steps at 30 ms: 28 s), which one taker cannot
    # take within the bound; with a second taker, one goes to each (a split)
    s = dataclasses.replace(state(*late, rank(4, 2, 300)), end_bound_s=25.0)
    d = decide(s, ConsolidationRules(), per_request, CHEAP_KV, givers=[0])
    assert sorted((m.request_id, m.dst) for m in d.moves) == [("r0-0", 2), ("r0-1", 4)]
    # within the bound, or without one (the engine's), nothing moves
    for bound in (40.0, None):
        s = dataclasses.replace(state(*late), end_bound_s=bound)
        assert decide(s, ConsolidationRules(), per_request, CHEAP_KV, givers=[0]).moves == []
    # a taker with queued requests (lengths unknown) is not one
    s = dataclasses.replace(state(late[0], rank(2, 1, 300, queued=1)), end_bound_s=30.0)
    assert decide(s, ConsolidationRules(), per_request, CHEAP_KV, givers=[0]).moves == []


def test_a_late_replica_whose_longest_no_taker_takes_is_lightened():
    """Replica 0 (clock 1 s) ends at 38 s, past a bound of 22 s; its longest (1000 tokens) would
    end past the bound on replica 1 too (at 24 s, its estimate doubled). Lightened instead: its
    three others go to replica 1, which then ends at 31 s (300 steps at 40 ms, 600 at 30 ms),
    before replica 0 would have; replica 0 keeps its longest and ends at 11 s."""
    import dataclasses

    late = [rank(0, 0, 1000, 900, 900, 900), rank(2, 1, 300)]
    s = dataclasses.replace(state(*late), end_bound_s=22.0)
    d = decide(s, ConsolidationRules(), per_request, CHEAP_KV, givers=[0])
    assert [(m.request_id, m.src, m.dst) for m in d.moves] == [
        ("r0-1", 0, 2), ("r0-2", 0, 2), ("r0-3", 0, 2)]
    assert d.corrected_replicas == [0] and d.leaving_replicas == []
    # only a move that brings its end in: replica 0 on two ranks (2 and 2 requests, 20 s from
    # its clock); replica 1 takes one within 20 s, which leaves the other rank as full
    two_ranks = [rank(0, 0, 1000, 900), rank(1, 0, 900, 900), rank(2, 1, 300)]
    s = dataclasses.replace(state(*two_ranks), end_bound_s=15.0)
    assert decide(s, ConsolidationRules(), per_request, CHEAP_KV, givers=[0]).moves == []


def test_a_request_moved_twice():
    # first: replica 0's batch is full, so replica 2's last request goes to replica 1
    s1 = state(rank(0, 0, 1000, 1000), rank(2, 1, 200), rank(4, 2, 10), max_batch=2)
    d1 = decide(s1, ConsolidationRules(), flat, CHEAP_KV)
    assert [(m.request_id, m.src, m.dst) for m in d1.moves] == [("r4-0", 4, 2)]
    # later: replica 0 has room; replica 1 holds its own request and the moved one, both leave
    moved = Running("r4-0", 150, 5.0)
    s2 = state(rank(0, 0, 900), RankState(2, 1, (Running("r2-0", 150, 150.0), moved), 0, None),
               max_batch=4)
    d2 = decide(s2, ConsolidationRules(), flat, CHEAP_KV)
    assert d2.leaving_replicas == [1]
    assert sorted((m.request_id, m.src, m.dst) for m in d2.moves) == [
        ("r2-0", 2, 0), ("r4-0", 2, 0)]


def test_remaining_estimate_corrects_an_outlived_prediction():
    assert remaining_estimate(100, 30, 1000) == 70
    assert remaining_estimate(100, 200, 1000) == 100  # outlived: half as much again
    assert remaining_estimate(100, 900, 1000) == 100  # never past the cap
    assert remaining_estimate(100, 999, 1000) == 1


def test_replica_finish_steps_at_the_fullest_ranks_pace():
    cost = lambda n, ctx: 1.0 + 0.0 * np.asarray(ctx, dtype=float) + 0.5 * (np.asarray(n) > 1)
    # rank 0: one request of 10 steps; rank 1: two of 4: 4 steps at 1.5, then 6 at 1.0
    assert replica_finish([([10], [0]), ([4, 4], [0, 0])], cost) == [pytest.approx(12.0),
                                                                     pytest.approx(6.0)]
    assert replica_finish([([10], [0]), ([], [])], cost) == [pytest.approx(10.0), 0.0]


def test_the_worst_end_runs_a_share_of_a_replicas_requests_to_the_cap():
    cost = lambda n, ctx: 1.0 + 0.0 * np.asarray(ctx, dtype=float) + 0.5 * (np.asarray(n) > 1)
    # no share: only the longest (10) runs to the cap of 20; the others end by step 8 at 1.5
    # a step, then 12 steps alone at 1.0
    assert _worst_end([[10, 8, 6, 4]], [[0] * 4], 20, cost) == pytest.approx(24.0)
    # half of the 4 requests, taken evenly longest first: 10 and 6 run to 20 together, every
    # step at 1.5
    assert _worst_end([[10, 8, 6, 4]], [[0] * 4], 20, cost, share=0.5) == pytest.approx(30.0)
    # over ranks, in lockstep at the fullest rank's pace: 10 and 6 run to the cap on two ranks,
    # each alone on its rank after step 8: 8 steps at 1.5, 12 at 1.0
    assert _worst_end([[10, 8], [6, 4]], [[0, 0], [0, 0]], 20, cost,
                      share=0.5) == pytest.approx(24.0)
    # a step costing 1 per request makes the end the sum of the lengths: a fifth of ten is two,
    # the longest (already at the cap) and the sixth longest (2), taken evenly
    by_count = lambda n, ctx: np.asarray(n, dtype=float) + 0.0 * np.asarray(ctx, dtype=float)
    at_cap = [[20, 20, 5, 4, 3, 2, 1, 1, 1, 1]]
    assert _worst_end(at_cap, [[0] * 10], 20, by_count) == pytest.approx(58.0)
    assert _worst_end(at_cap, [[0] * 10], 20, by_count,
                      share=0.2) == pytest.approx(58.0 + (20 - 2))


def test_placement_across_replicas_hedges_by_how_often_samples_ran_to_the_cap_unforeseen():
    """Two histories with the same last epoch (so the same predictions), two prompts' samples
    at the cap in it: in one the epoch before had them there too, in the other they came as a
    surprise (`LengthHistory.surprise_share`). The plan then takes that share of each replica's
    requests at the cap, and the replica the short work gathers on takes less."""
    lengths = [400, 380, 60, 50, 40, 40, 30, 30, 20, 20, 10, 10] * 2

    def cost(n, ctx):
        return 1.0 + 0.002 * np.asarray(ctx, dtype=float)

    gs = [PromptGroup(u, tuple(Request(prompt_uid=u, sample_index=s, prompt_ids=(1,) * 4,
                                       max_new_tokens=500) for s in range(4)))
          for u in range(len(lengths))]
    replicas = [[0, 1], [2, 3], [4, 5]]
    plans = {}
    for surprise in (False, True):
        h = LengthHistory()
        for uid, n in enumerate(lengths):
            last = [500 if (uid in (2, 5) and s == 0) else n for s in range(4)]
            h.record(uid, [n] * 4 if surprise else last)
            h.record(uid, last)
        assert h.surprise_share(500) == (pytest.approx(2 / 96) if surprise else 0.0)
        sched = Scheduler(PlacementPolicy.FLEXFLOOR, h, max_batch_size=64, pace_margin=1.0)
        plans[surprise] = sched.plan(gs, range(6), replicas=replicas, step_cost=cost)
    assert plans[True].predicted == plans[False].predicted
    for plan in plans.values():
        assert sorted(q.request_id for v in plan.assignment.values() for q in v) == sorted(
            q.request_id for g in gs for q in g.requests)
    fullest = {s: max(sum(len(p.assignment[r]) for r in g) for g in replicas)
               for s, p in plans.items()}
    assert fullest[True] < fullest[False]


def test_placement_across_replicas_puts_long_work_on_the_staying_replica_within_the_bound():
    lengths = {u: n for u, n in enumerate([400, 380, 60, 50, 40, 40, 30, 30, 20, 20, 10, 10])}
    h = LengthHistory()
    for uid, n in lengths.items():
        h.record(uid, [n] * 4)
    gs = [PromptGroup(u, tuple(Request(prompt_uid=u, sample_index=s, prompt_ids=(1,) * 4,
                                       max_new_tokens=500) for s in range(4))) for u in lengths]

    def cost(n, ctx):  # a step's fixed part plus its KV read
        return 1.0 + 0.002 * np.asarray(ctx, dtype=float)

    sched = Scheduler(PlacementPolicy.FLEXFLOOR, h, max_batch_size=64, pace_margin=1.0)
    replicas = [[0, 1], [2, 3], [4, 5]]
    plan = sched.plan(gs, range(6), replicas=replicas, step_cost=cost)
    placed = sorted(q.request_id for v in plan.assignment.values() for q in v)
    assert placed == sorted(q.request_id for g in gs for q in g.requests)
    where = {}
    for r, v in plan.assignment.items():
        for q in v:
            where.setdefault(q.prompt_uid, []).append(r)
    # the longest prompt alone on one replica, two samples to a rank, would end past static's
    # predicted end (726 against 718 steps: a step there reads twice the KV), so it goes round
    # robin over the two replicas meant to stay, one sample per rank; the next fits alone (two
    # to a rank) and not beside the first, so it takes the third replica
    assert sorted(where[0]) == [0, 1, 2, 3]
    assert len({r // 2 for r in where[1]}) == 1 and where[1][0] in (4, 5)
    # every rank within the bound (the static baseline's predicted end)
    assert max(plan.expected_finish.values()) <= plan.finish_bound + 1e-9
    ends = [max(plan.expected_finish[r] for r in g) for g in replicas]
    assert max(ends) < 718
    # the plan's order: replicas leave as their predicted ends come, the one with the next
    # prompt two samples to a rank last
    order = plan.leaving_order(replicas)
    assert [ends[i] for i in order] == sorted(ends) and order[-1] == where[1][0] // 2


def test_the_simulator_with_consolidation_counts_the_same_tokens():
    """Three replicas of 8 H800 ranks: replica 1's short requests fit on replica 2, which has
    slack before replica 0 ends the rollout, so they move and replica 1 leaves early; every
    response has the length it has without consolidation, and the tokens are the same."""
    from flexfloor.rollout.release import RankLimits, ReleaseRules
    from flexfloor.sim.cost import RooflineCost
    from flexfloor.sim.hardware import ACCELERATORS, ModelShape
    from flexfloor.sim.rollout import (
        SimRequest, TailConsolidation, replica_state, simulate_replicas, simulate_rollout,
    )
    from flexfloor.sim.scenarios import rank_step_cost

    shape = ModelShape.from_preset("qwen3-30b-a3b")
    cost = RooflineCost(ACCELERATORS["H800"], shape)
    limits = RankLimits(kv_bytes_per_token=shape.kv_bytes_per_token, max_seq_len=9000,
                        max_batch_size=64, kv_budget_bytes=None, expert_nbytes=shape.expert_bytes)
    groups = []
    for i, ranks in enumerate([tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 24))]):
        placement, holding = replica_state(shape.num_experts, ranks)
        # replica 0: the longest requests (it ends the rollout); replica 1: short ones; replica
        # 2: medium ones (it has slack to take replica 1's tail)
        lengths = [[[4000 + 100 * r, 3000], [200 + 50 * r, 300 + 50 * r], [1500, 1200]][i]
                   for r in range(8)]
        assignment = {rank: [SimRequest(f"{rank}-{k}", rank * 10 + k, 200, n)
                             for k, n in enumerate(lengths[j])] for j, rank in enumerate(ranks)}
        groups.append({"assignment": assignment, "placement": placement,
                       "rules": ReleaseRules(min_active_ranks=8, holding=holding)})
    placement = groups[0]["placement"]
    tails = TailConsolidation(
        ConsolidationRules(), rank_step_cost(cost, placement, tuple(range(8)), 64),
        MovePrices(shape.kv_bytes_per_token, 35e9, 1e-4),
        lambda req, produced, finished: float(req.length - produced), 16)
    on = simulate_replicas(groups, cost, limits=limits, kv_block_tokens=16, consolidation=tails)
    off = [simulate_rollout(g["assignment"], g["rules"], cost, limits=limits,
                            placement=g["placement"], kv_block_tokens=16) for g in groups]
    moved = [t for t in on[1].timeline if "consolidated" in t]
    assert moved and 1 not in moved[0]["to_replicas"], on[1].timeline
    assert sum(o.total_tokens for o in on) == sum(o.total_tokens for o in off) == sum(
        q.length for g in groups for v in g["assignment"].values() for q in v)
    lengths_on, lengths_off = {}, {}
    for outs, into in ((on, lengths_on), (off, lengths_off)):
        for o in outs:
            for uid, ls in o.lengths.items():
                into.setdefault(uid, []).extend(ls)
    assert {u: sorted(v) for u, v in lengths_on.items()} == {u: sorted(v) for u, v in lengths_off.items()}
    # replica 1 leaves when it hands over, before its own requests would have ended; the
    # rollout is no longer for it
    release = lambda outs, i: max(r["release_s"] for r in outs[i].records)
    assert release(on, 1) < release(off, 1)
    assert max(release(on, i) for i in range(3)) <= max(release(off, i) for i in range(3))


def test_a_finish_memo_changes_no_decision():
    """The simulator keeps one `FinishMemo` per rollout: a replica's finish is remembered by its
    running work (remaining and cached tokens), so a decision with it equals one without, also
    when only a request's cached tokens differ (a longer context steps slower)."""
    import dataclasses

    from flexfloor.rollout.consolidate import FinishMemo

    def kv_read(n, ctx):  # a step reads the cached tokens: context matters
        return 0.01 + 1e-5 * np.asarray(ctx, dtype=float)

    memo = FinishMemo(kv_read)
    # replica 0 ends the rollout at 78 s; replica 2's last request fits on replica 1 while its
    # own request has a short context (it ends at 8.4 s), not when it has 8,345 cached tokens
    # (it ends at 77.96 s, and with the move at 78.02 s: past the rollout's end)
    short = state(rank(0, 0, 3000), rank(2, 1, 800), rank(4, 2, 50), now={0: 0.0, 1: 0.0, 2: 0.0})
    long_ctx = dataclasses.replace(short, ranks=(short.ranks[0], rank(2, 1, 800, cached=8345),
                                                 short.ranks[2]))
    for s in (short, long_ctx, short):
        fresh = decide(s, ConsolidationRules(), kv_read, CHEAP_KV)
        assert decide(s, ConsolidationRules(), kv_read, CHEAP_KV, memo=memo) == fresh
    assert [(m.src, m.dst) for m in decide(short, ConsolidationRules(), kv_read, CHEAP_KV).moves
            ] == [(4, 2)]
    assert decide(long_ctx, ConsolidationRules(), kv_read, CHEAP_KV).moves == []
    with pytest.raises(ValueError, match="memo"):
        decide(short, ConsolidationRules(), flat, CHEAP_KV, memo=memo)


def test_the_simulator_checks_a_late_replica_between_finishes():
    """Replica 0's rank 0 holds eight long requests, its other ranks one each: no request
    finishes before the end, so the simulator's replicas would jump to their last step at once.
    Its end is checked from half the bound on all the same (`GroupView.wake_s`): replica 0 is
    past the bound, no taker can take its longest within it, so its others on rank 0 go to
    replica 1 (lightened), and it ends sooner than without the correction."""
    from flexfloor.rollout.release import RankLimits, ReleaseRules
    from flexfloor.sim.cost import RooflineCost
    from flexfloor.sim.hardware import ACCELERATORS, ModelShape
    from flexfloor.sim.rollout import SimRequest, TailConsolidation, replica_state, simulate_replicas
    from flexfloor.sim.scenarios import rank_step_cost

    shape = ModelShape.from_preset("qwen3-30b-a3b")
    cost = RooflineCost(ACCELERATORS["H800"], shape)
    limits = RankLimits(kv_bytes_per_token=shape.kv_bytes_per_token, max_seq_len=9000,
                        max_batch_size=64, kv_budget_bytes=None, expert_nbytes=shape.expert_bytes)

    def groups():
        out = []
        for i, ranks in enumerate([tuple(range(8)), tuple(range(8, 16))]):
            placement, holding = replica_state(shape.num_experts, ranks)
            assignment = {rank: [SimRequest(f"{rank}-{k}", rank * 10 + k, 200, 3000)
                                 for k in range(8 if rank == 0 else 1)] for rank in ranks}
            out.append({"assignment": assignment, "placement": placement,
                        "rules": ReleaseRules(min_active_ranks=8, holding=holding)})
        return out

    step_cost = rank_step_cost(cost, groups()[0]["placement"], tuple(range(8)), 64)

    def tails(bound):
        return TailConsolidation(ConsolidationRules(max_requests=4), step_cost,
                                 MovePrices(shape.kv_bytes_per_token, 35e9, 1e-4),
                                 lambda req, produced, finished: float(req.length - produced),
                                 16, end_bound_s=bound)

    off = simulate_replicas(groups(), cost, limits=limits, kv_block_tokens=16,
                            consolidation=tails(None))
    end_off = max(r["release_s"] for r in off[0].records)
    on = simulate_replicas(groups(), cost, limits=limits, kv_block_tokens=16,
                           consolidation=tails(0.9 * end_off))
    corrected = [t for t in on[0].timeline if "corrected" in t]
    assert corrected and corrected[0]["to_replicas"] == [1], on[0].timeline
    assert max(r["release_s"] for r in on[0].records) < end_off
    assert sum(o.total_tokens for o in on) == sum(o.total_tokens for o in off) == 23 * 3000


def test_prompts_without_history_are_placed_as_static_places_them():
    """Across replicas, a prompt with no history has nothing to concentrate by: its samples go
    round robin over the replicas, then their ranks (static's routing), which keeps the
    replicas' loads alike; the prompts with history are placed around them, each on one
    replica."""
    h = LengthHistory()
    for uid, n in enumerate([400, 300, 20, 10]):
        h.record(uid, [n] * 4)
    h.record(99, [50] * 4)  # a prompt of an earlier step: the prior's lengths

    def cost(n, ctx):  # a step costs the same whatever it reads: with a KV term, a prompt whole
        # on one replica (two samples to a rank) would end after static, and the plan be static's
        return np.ones_like(np.asarray(ctx, dtype=float))

    gs = [PromptGroup(u, tuple(Request(prompt_uid=u, sample_index=s, prompt_ids=(1,) * 4,
                                       max_new_tokens=500) for s in range(4))) for u in range(8)]
    replicas = [[0, 1], [2, 3], [4, 5]]
    plan = Scheduler(PlacementPolicy.FLEXFLOOR, h, max_batch_size=64).plan(
        gs, range(6), replicas=replicas, step_cost=cost)
    where = {q.request_id: r for r, v in plan.assignment.items() for q in v}
    fresh = [q for g in gs[4:] for q in g.requests]
    assert [where[q.request_id] for q in fresh] == [
        replicas[i % 3][(i // 3) % 2] for i in range(len(fresh))]
    replica_of = {r: i for i, g in enumerate(replicas) for r in g}
    for g in gs[:4]:  # with history: each prompt's samples together on one replica
        assert len({replica_of[where[q.request_id]] for q in g.requests}) == 1
    # with no history at all, the plan is static's
    plan = Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), max_batch_size=64).plan(
        gs, range(6), replicas=replicas, step_cost=cost)
    every = [q for g in gs for q in g.requests]
    assert {q.request_id: r for r, v in plan.assignment.items() for q in v} == {
        q.request_id: replicas[i % 3][(i // 3) % 2] for i, q in enumerate(every)}


def test_a_taker_whose_own_work_may_run_long_takes_nothing():
    """`ConsolidationRules.taker_hedge`: replica 2 ends at 9 s with its own request and at 9.1 s
    with replica 1's last one (10 steps at 20 ms), within the rollout's 11 s; counted 1.5 times
    (its own may run past its prediction) it would end at 13.6 s, past it: it takes nothing, and
    replica 0 (which ends the rollout) cannot either, so replica 1 keeps its request. A taker's
    request known mispredicted counts at its `Running.worst`."""
    s = state(rank(0, 0, 1000), rank(2, 1, 10), rank(4, 2, 900))
    d = decide(s, ConsolidationRules(), per_request, CHEAP_KV)
    assert d.leaving_replicas == [1] and [(m.src, m.dst) for m in d.moves] == [(2, 4)]
    assert decide(s, ConsolidationRules(taker_hedge=1.5), per_request, CHEAP_KV).moves == []
    # a taker with slack for its own work counted so (ends at 7.6 s with the move) still takes
    s = state(rank(0, 0, 1000), rank(2, 1, 10), rank(4, 2, 500))
    d = decide(s, ConsolidationRules(taker_hedge=1.5), per_request, CHEAP_KV)
    assert [(m.src, m.dst) for m in d.moves] == [(2, 4)]
    # a request of the taker's known mispredicted (it outlived its prediction) counts at its
    # `worst` (up to its cap): 2,000 steps from replica 2's clock, past the rollout's 11 s
    def taker(worst):
        return RankState(4, 2, (Running("r4-0", 600, 100.0, worst=worst),
                                Running("r4-1", 100, 100.0)), 0, None)

    s = state(rank(0, 0, 1000), rank(2, 1, 10), taker(2000.0))
    d = decide(s, ConsolidationRules(taker_hedge=1.25), per_request, CHEAP_KV)
    assert 1 not in d.leaving_replicas and not any(m.src == 2 for m in d.moves)
    s = state(rank(0, 0, 1000), rank(2, 1, 10), taker(None))
    d = decide(s, ConsolidationRules(taker_hedge=1.25), per_request, CHEAP_KV)
    assert [(m.src, m.dst) for m in d.moves] == [(2, 4)]


def test_a_prompt_too_long_for_one_replica_goes_over_two_one_sample_per_rank():
    """A prompt of 4 samples on 2-rank replicas: alone on one replica its samples run two to a
    rank (200 steps at 2 per step), past static's predicted end (170: one to a rank, beside the
    short work), so it goes round robin over two replicas, one sample per rank (on one replica
    it would be two to a rank again)."""
    h = LengthHistory()
    h.record(0, [100] * 4)
    for uid in range(1, 8):
        h.record(uid, [10] * 4)
    gs = [PromptGroup(u, tuple(Request(prompt_uid=u, sample_index=s, prompt_ids=(1,),
                                       max_new_tokens=100) for s in range(4))) for u in range(8)]

    def cost(n, ctx):
        return 1.0 * np.asarray(n, dtype=float) + 0.0 * np.asarray(ctx, dtype=float)

    plan = Scheduler(PlacementPolicy.FLEXFLOOR, h, max_batch_size=64).plan(
        gs, range(4), replicas=[[0, 1], [2, 3]], step_cost=cost)
    long_on = sorted(r for r, v in plan.assignment.items() for q in v if q.prompt_uid == 0)
    assert long_on == [0, 1, 2, 3]


def test_a_lockstep_step_beside_lighter_ranks_reads_fewer_experts():
    """`GroupStepCost`: a replica of 8 H800 ranks with one request on one rank steps faster
    than with one on each (the experts a rank reads depend on the whole group's tokens), and
    `replica_finish` prices that; with every rank loaded alike it is the per-rank cost."""
    from flexfloor.sim.cost import RankLoad, RooflineCost
    from flexfloor.sim.hardware import ACCELERATORS, ModelShape
    from flexfloor.sim.rollout import replica_state
    from flexfloor.sim.scenarios import rank_step_cost

    shape = ModelShape.from_preset("qwen3-30b-a3b")
    cost = RooflineCost(ACCELERATORS["H800"], shape)
    ranks = tuple(range(8))
    placement, _ = replica_state(shape.num_experts, ranks)
    step = rank_step_cost(cost, placement, ranks, 64)
    hosted = {r: placement.owner.count(r) for r in ranks}
    lone = cost.step_seconds([RankLoad(r, int(r == 0), 1000 * (r == 0), hosted[r], 1000 * (r == 0))
                              for r in ranks], placement.owner)
    alike = cost.step_seconds([RankLoad(r, 1, 1000, hosted[r], 1000) for r in ranks],
                              placement.owner)
    assert lone < 0.95 * alike
    one = replica_finish([([100], [1000])] + [([], [])] * 7, step)[0]
    each = replica_finish([([100], [1000])] * 8, step)[0]
    assert one == pytest.approx(100 * lone, rel=0.02)
    assert each == pytest.approx(100 * alike, rel=0.02)


def test_with_no_end_to_keep_long_work_gathers_on_a_replica_that_ends_later():
    """`ConsolidationRules.gather`: replica 1's request of 700 steps is too long a share of the
    rollout's longest (1300) to evacuate it, and there is no end to keep (no history); replica
    0 runs to 13 s anyway, and with the request (counted 1.5 times: 1050 steps) still ends by
    then, so the request moves there, and the short one with it (it fits too): replica 1 has
    nothing left. Replica 2 ends before replica 1: not a taker. Counted twice (1400 steps) it would end replica 0 past the
    rollout's end: nothing moves; off (the engine's default), nothing moves."""
    s = state(rank(0, 0, 1300), rank(2, 1, 700, 50), rank(4, 2, 100))
    d = decide(s, ConsolidationRules(gather=True, correction_hedge=1.5), flat, CHEAP_KV,
               givers=[1])
    assert [(m.request_id, m.src, m.dst) for m in d.moves] == [("r2-0", 2, 0), ("r2-1", 2, 0)]
    assert d.corrected_replicas == [1]
    assert decide(s, ConsolidationRules(gather=True), flat, CHEAP_KV, givers=[1]).moves == []
    assert decide(s, ConsolidationRules(correction_hedge=1.5), flat, CHEAP_KV,
                  givers=[1]).moves == []


def test_no_denser_hands_a_leaving_replicas_request_only_to_a_rank_no_denser():
    # per_request: a rank's step costs 10 ms per request. The giver's fullest rank decodes one
    # request (10 ms); every rank of the taker already decodes some
    s = state(rank(0, 0, 1000, 900), rank(1, 0, 1000, 900, 800), rank(2, 1, 10))
    moved = decide(s, ConsolidationRules(), per_request, CHEAP_KV)
    assert moved.leaving_replicas == [1] and [m.dst for m in moved.moves] == [0]
    # with the rule the taker's rank would step at 30 ms against the giver's 10: refused
    guarded = ConsolidationRules(no_denser=True)
    assert decide(s, guarded, per_request, CHEAP_KV).moves == []
    # a taker rank with nothing running steps at the giver's pace with it: allowed
    s = state(rank(0, 0, 1000, 900), rank(1, 0), rank(2, 1, 10))
    d = decide(s, guarded, per_request, CHEAP_KV)
    assert d.leaving_replicas == [1] and [(m.src, m.dst) for m in d.moves] == [(2, 1)]


def test_length_history_is_unproven_once_finished_samples_leave_its_range():
    h = LengthHistory()
    for uid in range(4):
        h.record(uid, [100, 150, 200, 250])
    within = {uid: [90, 160, 240, 300] for uid in range(4)}  # within 1.25x of the range
    assert not h.unproven(within)
    wrong = {uid: [90, 160, 240, 400] for uid in range(4)}  # a quarter of them past 1.25 x 250
    assert h.unproven(wrong)
    short = {uid: [60, 160, 240, 300] for uid in range(4)}  # under 100 / 1.25
    assert h.unproven(short)
    assert not h.unproven({0: [400, 400]})  # too few samples to tell
    assert not h.unproven({9: [400] * 32})  # no history for them: nothing proved wrong
    assert not LengthHistory().unproven(wrong)


def test_the_bound_is_static_routing_the_samples_in_their_own_order():
    """The oracle's plan holds each prompt's samples longest first (so the i-th gets the i-th
    longest length). Static routes them in their own order, so its end, the bound, is priced
    that way: here each prompt's long sample is a different one, three to a rank under static;
    routed longest first, all twelve would be priced on one rank. Nothing fits that bound with
    room, and the groups left over, each whole on the replica that ends soonest, would hold
    four long samples to a rank: the plan is then static's routing, never predicted later, and
    it keeps no end of its own (the correction would move static's work against a bound below
    static's predicted end)."""
    from flexfloor.rollout.replicas import route_least_outstanding
    from flexfloor.sim.scenarios import oracle_plan

    def cost(n, ctx):
        return 1.0 + 0.002 * np.asarray(ctx, dtype=float)

    gs = [PromptGroup(u, tuple(Request(prompt_uid=u, sample_index=s, prompt_ids=(1,) * 4,
                                       max_new_tokens=500, target_len=300 if s == u % 4 else 20)
                               for s in range(4))) for u in range(12)]
    replicas = [[0, 1], [2, 3]]
    sched = Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), max_batch_size=64,
                      pace_margin=0.9)
    plan = oracle_plan(sched, gs, range(4), replicas=replicas, step_cost=cost)
    static = route_least_outstanding(gs, [tuple(g) for g in replicas])
    assert sorted(sum(q.target_len == 300 for q in static[r]) for r in range(4)) == [3, 3, 3, 3]
    end = max(replica_finish([([q.target_len for q in static[r]],
                               [len(q.prompt_ids) for q in static[r]]) for r in g], cost)[i]
              for g in replicas for i in range(len(g)))
    assert plan.finish_bound is None
    assert max(plan.expected_finish.values()) == pytest.approx(end)
    assert {r: sorted(q.request_id for q in v) for r, v in plan.assignment.items()} == {
        r: sorted(q.request_id for q in v) for r, v in static.items()}
