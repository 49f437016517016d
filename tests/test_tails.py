"""Tail consolidation in the engine (flexfloor/rollout/tails.py) on 4 real gloo workers, one
launch shared with the session's other 4-worker tests: the same tokens and log-probs as the
static policy at R = 1 and R = 2, greedy and sampled, with a request moved twice and requests
moved across replicas; every request finished exactly once; a replica whose one rank adopts a
request at a boundary where another could give inside the replica decides alike on both; the
simulator, driving the same decision with unit cost, takes the engine's steps rank for rank.
Plus the pure pieces."""

import pickle
from dataclasses import replace

import pytest

from distributed import Worker, by_request as tokens
from flexfloor.config import ConfigError, ElasticConfig
from flexfloor.rollout.consolidate import RankState, Running
from flexfloor.rollout.engine import StepReport
from flexfloor.rollout.scheduler import RolloutPlan
from flexfloor.rollout.tails import (
    Mailbox, TailRules, across_replicas, after_moves, end_to_keep, may_give_within,
    remaining_tokens, within_replica, worst_tokens,
)

WORKER = Worker("tails.py", 4, timeout=400)
KINDS = ["greedy", "sampled"]


@pytest.fixture(scope="module")
def res(shared):
    return shared.run(WORKER).results


def moves(parts, mode="elastic"):
    """Every move the ranks recorded in `mode`, once each (the giver's side)."""
    return [m for p in parts for m in p[mode]["record"]["trace"]["moves"]
            if m["src"] == p[mode]["record"]["rank"]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("replicas", [1, 2])
def test_consolidated_tokens_identical_to_static(res, replicas, kind):
    parts = res[f"r{replicas}_{kind}"]
    lengths = res["world" if replicas == 1 else "replicas"]
    want = sorted(f"{int(r) * 10 + i}/{s}" for r, ls in lengths.items()
                  for i, n in enumerate(ls) for s in range(len(n) if isinstance(n, list) else 1))
    static, elastic = tokens(parts, "static"), tokens(parts, "elastic")
    assert sorted(static) == want and sorted(elastic) == want  # each exactly once
    assert elastic == static
    # log-probs too, to fp32 rounding: a moved request decodes (or re-prefills) in another batch
    # shape (tests/test_kvmove.py shapes its batches to compare them bit for bit)
    got, ref = tokens(parts, "elastic", "logprobs"), tokens(parts, "static", "logprobs")
    assert {k: pytest.approx(v, abs=1e-5) for k, v in ref.items()} == got
    # ranks gave their requests away: fewer occupied steps; inside one group (one clock) the
    # rollout is no longer (across replicas the step a hand-over lands at is the machine's)
    steps = lambda policy: [p[policy]["record"]["steps"] for p in parts]
    assert sum(steps("elastic")) < sum(steps("static"))
    if replicas == 1:
        assert max(steps("elastic")) == max(steps("static"))
    recs = [p["elastic"]["record"] for p in parts]
    assert sum(r["migrated_out"] for r in recs) == sum(r["adopted"] for r in recs) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_moves_twice_inside_one_group(res, kind):
    parts = res[f"r1_{kind}"]
    ids = [m["request_id"] for m in moves(parts)]
    assert "30/0" in ids and ids.count("30/0") == 2, ids  # rank 3 -> rank 0 -> on
    first, second = sorted((m for m in moves(parts) if m["request_id"] == "30/0"),
                           key=lambda m: m["step"])
    assert (first["src"], first["dst"]) == (3, 0) and second["src"] == 0
    assert not any(m["across"] for m in moves(parts))
    assert parts[3]["elastic"]["record"]["steps"] == 1  # rank 3 left at the first boundary


@pytest.mark.parametrize("kind", KINDS)
def test_a_replica_hands_its_requests_to_the_other_and_leaves(res, kind):
    """Replica 1 is meant to give (its last two requests are predicted short from their
    siblings); on a loaded machine replica 0 can run far ahead and reach its own tail first,
    and then it gives: either way requests cross replicas and the giver leaves whole early.

    Where the hand-over lands follows the replicas' wall clocks, so the scenario saves steps
    wherever it lands (tests/workers/tails.py): replica 1 (tail 60 steps) hands over at its
    step k once replica 0 posted a state, replica 0 (90 steps) adopts at its step t; the two
    replicas' occupied steps are 2k + 2 max(90, t + 60 - k) against 2 * 60 + 2 * 90, fewer
    while k < 60 (replica 0 up to ~58 steps late) and t + 60 - k < 148 (replica 0 up to ~86
    steps ahead)."""
    parts = res[f"r2_{kind}"]
    recs = [p["elastic"]["record"] for p in parts]
    across = [m for m in moves(parts) if m["across"]]
    assert across and all(m["src"] // 2 != m["dst"] // 2 for m in across), across
    assert sum(r["migrated_across"] for r in recs) == sum(r["adopted_across"] for r in recs) == len(
        across)
    giver = across[0]["src"] // 2
    assert all(m["src"] // 2 == giver for m in across)  # one replica gave, the other took
    mine = [2 * giver, 2 * giver + 1]
    # it left whole when it handed over, before its own requests would have ended
    assert recs[mine[0]]["steps"] == recs[mine[1]]["steps"] < max(
        parts[r]["static"]["record"]["steps"] for r in mine)
    assert all(p["elastic"]["timeline"][-1].get("handed_over") for p in (parts[r] for r in mine))


def test_the_simulators_hedge_and_correction_keep_the_tokens_across_replicas(res):
    """R = 2 with consolidation across replicas, `elastic.consolidate_correct` and
    `elastic.consolidate_taker_hedge=1.25`, and an end to keep that no replica passes
    (tests/workers/tails.py): the same tokens as static, each request once; nothing is late, so
    no replica corrects; replica 0's own requests count at their cap (no sibling finished: the
    estimate is a bound, `tails.worst_tokens`), no more, so replica 1 still hands over."""
    parts = res["r2_sampled"]
    assert tokens(parts, "hedged") == tokens(parts, "static")
    got, ref = tokens(parts, "hedged", "logprobs"), tokens(parts, "static", "logprobs")
    assert {k: pytest.approx(v, abs=1e-5) for k, v in ref.items()} == got
    recs = [p["hedged"]["record"] for p in parts]
    across = [m for r in recs for m in r["trace"]["moves"]
              if m["across"] and m["src"] == r["rank"]]
    assert across and sum(r["migrated_across"] for r in recs) == sum(
        r["adopted_across"] for r in recs) == len(across)
    assert not any("corrected" in t for p in parts for t in p["hedged"]["timeline"])


@pytest.mark.parametrize("case", ["corrected", "corrected_modelled"])
def test_a_late_replica_hands_its_longest_request_over_and_stays(res, case):
    """R = 2, the correction made on 4 engine workers (tests/workers/tails.py, `CORRECTED`),
    on the engine's step clock and on a modelled clock (a plan by seconds' clock) under the
    unit cost, where every step is priced once from the step report:
    replica 0 is predicted past the end to keep (rank 0's request, to its cap, ends it), replica
    1 decodes far behind it on the step clock (the worker stops and continues the processes:
    `Conductor`); at a check of its end replica 0 hands rank 0's request to replica 1 and stays
    with rank 1's: the same tokens as static, each request once. (Replica 1 may hand it back
    at its own tail, as the replicas' clocks then say: rank 0 then finishes it.)"""
    parts = res[case]
    want = sorted(f"{int(r) * 10 + i}/0" for r, ls in res["corrected_lengths"].items()
                  for i in range(len(ls)))
    assert sorted(tokens(parts, "static")) == want and sorted(tokens(parts, "corrected")) == want
    assert tokens(parts, "corrected") == tokens(parts, "static")
    got, ref = tokens(parts, "corrected", "logprobs"), tokens(parts, "static", "logprobs")
    assert {k: pytest.approx(v, abs=1e-5) for k, v in ref.items()} == got
    fixes = [[t for t in p["corrected"]["timeline"] if "corrected" in t] for p in parts]
    assert fixes[2] == fixes[3] == []  # replica 1 only takes
    assert fixes[0] == fixes[1] and len(fixes[0]) == 1, fixes  # the same on both of its ranks
    (fix,) = fixes[0]
    assert list(fix["corrected"]) == ["0/0"] and fix["corrected"]["0/0"] in (2, 3), fix
    assert fix["step"] >= 45  # from half the end to keep on
    recs = [p["corrected"]["record"] for p in parts]
    # it stayed: rank 1 decoded its own request on to its end, rank 0 moved its only one
    assert recs[1]["steps"] >= 88 > fix["step"] and recs[1]["migrated_out"] == 0
    assert recs[0]["migrated_across"] == 1 and recs[0]["adopted_across"] <= 1
    assert sum(r["migrated_across"] for r in recs) == sum(r["adopted_across"] for r in recs)
    if case == "corrected_modelled":  # replica 0 stayed to its end: each of its steps priced
        for r in (0, 1):
            clock = parts[r]["clock"]
            assert clock["priced"] == recs[r]["steps"] == clock["seconds"], (clock, r)


def test_a_modelled_clock_under_a_real_cost_prices_what_each_replica_ran(res):
    """R = 2 on 4 engine workers, the replicas on modelled clocks under the H800 cost model
    (tests/workers/tails.py, `PRICED`): each rank's clock priced every step its rank ran, from
    the loads its step report carried (every rank's of the replica, all-gathered with the
    report), and so reads what `price_trace` makes of the replica's ranks' own traces; both
    ranks of a replica keep the same clock. The tokens are static's. (Here no request crosses
    replicas: priced, a taker's steps grow dearer with a request added, and replica 0's own end
    is the rollout's; the move's pricing is the 4-worker correction case's, at unit cost.)"""
    from flexfloor.rollout.elastic import pace_cost_of
    from flexfloor.rollout.types import StepTrace
    from flexfloor.sim.cost import price_trace

    parts = res["priced"]
    assert tokens(parts, "priced") == tokens(parts, "static")
    recs = [p["priced"]["record"] for p in parts]
    traces = {r["rank"]: StepTrace.from_dict(r["trace"]) for r in recs}
    cost = pace_cost_of(ElasticConfig(pace_model="H800"), parts[0]["model_shape"])
    for replica in ((0, 1), (2, 3)):
        want = price_trace({r: traces[r] for r in replica}, cost).rollout_s
        for r in replica:
            clock = parts[r]["clock"]
            assert clock["priced"] == traces[r].steps == recs[r]["steps"] > 0, (clock, r)
            assert clock["seconds"] == pytest.approx(want, rel=1e-9), (replica, r)
        assert parts[replica[0]]["clock"] == parts[replica[1]]["clock"]
    # priced, not counted: a step costs other than 1 and the two replicas' clocks differ
    assert parts[0]["clock"]["seconds"] != parts[0]["clock"]["priced"]
    assert parts[0]["clock"]["seconds"] != parts[2]["clock"]["seconds"]


def test_a_replica_predicted_short_by_its_history_hands_its_requests_over(res):
    """R = 2 on 4 engine workers with the plan's estimates (tests/workers/tails.py, `HISTORY`):
    one sample per prompt, so no sibling ever finishes and without the plan each request's
    estimate is its cap (128), which only fits on a replica running 8 steps behind. From its
    history replica 1's two requests (60 and 58 tokens) are predicted to end well inside
    replica 0's 120 steps: it hands both over and leaves whole, before its own requests would
    have ended; replica 0 decodes them on. The tokens are static's, each request once."""
    parts = res["history"]
    want = sorted(f"{int(r) * 10 + i}/0" for r, ls in res["history_lengths"].items()
                  for i in range(len(ls)))
    assert sorted(tokens(parts, "history")) == want
    assert tokens(parts, "history") == tokens(parts, "static")
    got, ref = tokens(parts, "history", "logprobs"), tokens(parts, "static", "logprobs")
    assert {k: pytest.approx(v, abs=1e-5) for k, v in ref.items()} == got
    across = [m for m in moves(parts, "history") if m["across"]]
    assert sorted(m["request_id"] for m in across) == ["20/0", "30/0"], across
    assert all(m["dst"] in (0, 1) for m in across)
    recs = [p["history"]["record"] for p in parts]
    assert recs[2]["steps"] == recs[3]["steps"] < 58  # left whole, early
    assert all(p["history"]["timeline"][-1].get("handed_over") for p in parts[2:])
    assert sum(r["adopted_across"] for r in recs[:2]) == 2


def test_a_request_arriving_on_one_rank_leaves_its_replica_deciding_alike(res):
    """R = 2 on 4 engine workers, min_active_ranks 1 (tests/workers/tails.py, `ARRIVAL`):
    replica 1's one request arrives on rank 0 of replica 0 at the boundary where rank 1's short
    request has ended, so either rank of replica 0 could give its one request to the other.
    Every rank of the replica skips the consolidation inside it at that boundary (the mailbox
    says the replica received work: `MailboxBoundary.arrived`, the same on both, where only rank
    0 adopts): had rank 1 planned a move to rank 0 while rank 0 adopted, it would wait for rank 0
    in the move's exchange for ever. The rollout ends, with static's tokens, each request once."""
    parts = res["arrival"]
    want = sorted(f"{int(r) * 10 + i}/0" for r, ls in res["arrival_lengths"].items()
                  for i in range(len(ls)))
    assert sorted(tokens(parts, "arrival")) == want
    assert tokens(parts, "arrival") == tokens(parts, "static")
    across = [m for m in moves(parts, "arrival") if m["across"]]
    assert [(m["request_id"], m["dst"]) for m in across] == [("20/0", 0)], across
    # the arrival's boundary, as ranks 0 and 1 saw it: (step, arrived, own arrivals, each rank's
    # running requests, a rank could give inside the replica): one request each (rank 1's short
    # one just ended), so each had a free slot to take the other's
    at = [[tuple(s) for s in p["seen"] if s[1]] for p in parts[:2]]
    assert at == [[(8, True, 1, [1, 1], True)], [(8, True, 0, [1, 1], True)]], at
    # the consolidation inside came later (rank 0 then gave its request to rank 1 and left)
    inside = [t["step"] for t in parts[0]["arrival"]["timeline"] if "consolidated" in t]
    assert inside and 8 not in inside, inside
    assert sum(p["arrival"]["record"]["adopted_across"] for p in parts[:2]) == 1


def test_the_plans_estimates_read_history_then_siblings_then_the_prior():
    """`RunningEstimates`, the rule the engine and the simulator share: a prompt with history
    at its plan's prediction until it outlives it (then known wrong: up to its cap), unless the
    samples finished so far prove the history wrong; a prompt without, the longest of its
    siblings finished, else the plan's prior; a plan placed as static reads no history."""
    from flexfloor.rollout.scheduler import LengthHistory, Predictor
    from flexfloor.rollout.tails import RunningEstimates

    history = LengthHistory()
    for uid in range(9):
        history.record(uid, [20, 30])  # prompts 0-8 ran 20-30 tokens last time; 10 is new
    history.record(9, [60, 70])
    predicted = {**{u: 30.0 for u in range(9)}, 9: 70.0, 10: 50.0}
    plan = RolloutPlan(assignment={}, predicted=predicted,
                       sources={"history": 10, "prior": 1}, expected_finish={})
    est = RunningEstimates.of_plan(plan, Predictor(history))
    assert est.with_history == frozenset(range(10))
    none: dict = {}
    # (remaining, worst)
    assert est.running(3, "3/0", 10, 100, none) == (20.0, None)  # its history's longest, 30
    assert est.running(3, "3/1", 10, 100, {3: [12]})[0] == 20.0  # a sibling: still its history
    # outlived: half what it produced, and known wrong: up to its cap
    assert est.running(3, "3/0", 40, 100, none) == (20.0, 60.0)
    assert est.running(10, "10/1", 10, 100, none)[0] == 40.0  # no history: the plan's prior
    assert est.running(10, "10/1", 10, 100, {10: [12, 44]})[0] == 34.0  # its longest sibling
    # sixteen samples finished, all far outside their prompts' past ranges: the history is wrong
    wrong = {u: [200, 200] for u in (0, 1, 2, 4, 5, 6, 7, 8)}
    assert est.history_wrong(wrong) and not est.history_wrong({u: [25, 25] for u in range(8)})
    assert est.running(3, "3/0", 10, 300, {**wrong, 3: [150]})[0] == 140.0  # its sibling
    distrusted = RunningEstimates.of_plan(replace(plan, distrusted=True), Predictor(history))
    assert distrusted.with_history == frozenset()
    prior = history.quantile(0.5)
    assert est.length(9, "9/0", none) == 70.0 and distrusted.length(9, "9/0", none) == prior
    assert prior < 70.0


def test_the_simulator_takes_the_engines_steps_with_consolidation(res):
    """R = 1: the simulator's replica driver (`simulate_replicas`) applies the engine's decision
    inside the group (`tails.within_replica`) with unit cost, so every rank's steps, tokens and
    moves equal the engine's. (R = 2 is not replayed: the engine's replicas run on wall clocks,
    so which boundary of the taker sees a hand-over depends on the machine's timing.)"""
    from flexfloor.rollout.consolidate import ConsolidationRules
    from flexfloor.rollout.release import RankLimits, ReleaseRules
    from flexfloor.sim.cost import UnitCost
    from flexfloor.sim.rollout import SimRequest, TailConsolidation, replica_state, simulate_replicas

    cap, lengths = res["max_new_tokens"], res["world"]
    placement, holding = replica_state(8, (0, 1, 2, 3), training_ep=4)
    assignment = {int(r): [SimRequest(f"{int(r) * 10 + i}/0", int(r) * 10 + i, 3 + i, n)
                           for i, n in enumerate(ls)] for r, ls in lengths.items()}
    limits = RankLimits(kv_bytes_per_token=1, max_seq_len=64, max_batch_size=8,
                        kv_budget_bytes=None, expert_nbytes=1)
    rules = TailRules.of(ElasticConfig(consolidate=True, consolidate_max_requests=2), floor=1)
    tc = TailConsolidation(ConsolidationRules(), None, None,
                           lambda req, produced, finished: remaining_tokens(cap, produced, ()),
                           within=rules)
    out, = simulate_replicas([{"assignment": assignment, "placement": placement,
                               "rules": ReleaseRules(min_active_ranks=1, holding=holding)}],
                             UnitCost(), limits=limits, kv_block_tokens=16, consolidation=tc)
    keys = ("steps", "busy_steps", "tokens", "release_step", "migrated_out", "adopted")
    for kind in KINDS:
        engine = [p["elastic"]["record"] for p in res[f"r1_{kind}"]]
        assert [{k: r[k] for k in keys} for r in out.records] == [
            {k: r[k] for k in keys} for r in engine], kind


# ------------------------------------------------------------------------------------------
# pure pieces


def state(rank, n, produced=10, queued=0, free=None):
    return RankState(rank, 0, tuple(Running(f"{rank}/{k}", 5 + produced, 4.0) for k in range(n)),
                     queued, free)


def report(states):
    return StepReport(has_work=[bool(s.running or s.queued) for s in states], finished=0,
                      tokens=0, requests=0, running=[len(s.running) for s in states],
                      queued=[s.queued for s in states], remaining=[9] * len(states),
                      kv_free=[10 ** 6] * len(states))


def test_within_a_group_the_smallest_rank_gives_when_the_others_have_room():
    rules = TailRules(max_requests=2)
    states = [state(0, 3), state(1, 3), state(2, 1)]
    assert may_give_within(report(states), rules)
    d = within_replica(states, rules, max_batch=8, block_tokens=16)
    assert [(m.src, m.request_id) for m in d.moves] == [(2, "2/0")] and d.leaving_replicas == [2]
    # no batch slot anywhere: nothing moves; nothing queued may stay behind
    assert within_replica(states, rules, max_batch=3, block_tokens=16).moves == []
    queued = [state(0, 3), state(1, 1, queued=1)]
    assert not may_give_within(report(queued), rules)
    # the floor: two ranks stay whatever fits
    assert not may_give_within(report(states[1:]), TailRules(max_requests=2, floor=2))
    # a taker without the KV room for the request to its predicted end takes nothing
    tight = [state(0, 3, free=1), state(1, 3, free=1), state(2, 1)]
    assert within_replica(tight, rules, max_batch=8, block_tokens=16).moves == []


def test_after_moves_is_the_report_the_release_decision_then_sees():
    states = [state(0, 3), state(1, 3), state(2, 1)]
    d = within_replica(states, TailRules(max_requests=2), max_batch=8, block_tokens=16)
    after = after_moves(report(states), [0, 1, 2], d.moves, {"2/0": 15}, 100, 16)
    assert after.has_work == [True, True, False] and after.running[2] == 0
    assert sum(after.running) == 7 and min(after.kv_free) == 10 ** 6 - 100


def test_remaining_tokens_from_siblings_then_corrected_never_past_the_cap():
    assert remaining_tokens(100, 10, [30, 50, 40]) == 30  # the siblings' median, less produced
    assert remaining_tokens(100, 60, [30, 50, 40]) == 30  # outlived them: half again
    assert remaining_tokens(100, 95, [30]) == 5  # never past max_new_tokens
    assert remaining_tokens(100, 10, []) == 90  # nothing known: up to the cap


def test_the_config_names_a_bad_consolidation_field():
    with pytest.raises(ConfigError, match="elastic.consolidate_max_requests"):
        ElasticConfig(consolidate_max_requests=0).validate()
    with pytest.raises(ConfigError, match="elastic.consolidate_reserve_blocks"):
        ElasticConfig(consolidate_reserve_blocks=-1).validate()
    assert TailRules.of(ElasticConfig(consolidate=False), 1) is None
    assert TailRules.of(None, 1) is None
    # on by default (the main job's), never across replicas unless asked
    assert TailRules.of(ElasticConfig(), 2) == TailRules(max_requests=8, reserve_blocks=0, floor=2)
    assert TailRules.of(ElasticConfig(consolidate=True, consolidate_across=True), 1).across
    # the hedge and the correction: across replicas only
    got = TailRules.of(ElasticConfig(consolidate_across=True, consolidate_taker_hedge=1.25,
                                     consolidate_correct=True), 1)
    assert got.taker_hedge == 1.25 and got.correct
    with pytest.raises(ConfigError, match="elastic.consolidate_taker_hedge.*>= 1"):
        ElasticConfig(consolidate_across=True, consolidate_taker_hedge=0.9).validate()
    for bad in (dict(consolidate_taker_hedge=1.25), dict(consolidate_correct=True),
                dict(consolidate_correct=True, consolidate_across=True, consolidate=False)):
        with pytest.raises(ConfigError, match="consolidate_across=true"):
            ElasticConfig(**bad).validate()


# ------------------------------------------------------------------------------------------
# across replicas: the simulator's hedge and correction on the engine's step clock


def ranks_of(replica, *per_rank):
    """RankStates of one replica of two ranks: per rank its requests' (remaining, worst)."""
    return [RankState(2 * replica + k, replica, tuple(
        Running(f"{2 * replica + k}/{j}", 20, r, w) for j, (r, w) in enumerate(reqs)), 0, None)
        for k, reqs in enumerate(per_rank)]


ACROSS = TailRules(max_requests=2, across=True)
# replica 0 is late (its clock 90, its end 105 past the end to keep, 100), replica 1 behind it
LATE = ranks_of(0, [(15, None), (5, None)], [(5, None)])
CLOCKS = {0: 90, 1: 60}


def decided(states, clocks, giver, rules, **kw):
    d = across_replicas(states, clocks, giver, rules, max_batch=8, block_tokens=16, **kw)
    return [(m.request_id, m.dst) for m in d.moves], d.leaving_replicas, d.corrected_replicas


def test_the_takers_hedge_refuses_a_hand_over_its_own_requests_may_outrun():
    """Replica 1 may give its one short request to replica 0, whose own requests end the
    rollout: as estimated they still do with it; at 1.25x their estimate they would end
    past the rollout's predicted end, so nothing moves."""
    states = ranks_of(0, [(40, None)], [(30, None)]) + ranks_of(1, [(10, None)], [])
    assert decided(states, {0: 50, 1: 50}, 1, ACROSS) == ([("2/0", 0)], [1], [])
    hedged = replace(ACROSS, taker_hedge=1.25)
    assert decided(states, {0: 50, 1: 50}, 1, hedged) == ([], [], [])
    assert hedged.across_rules().taker_hedge == 1.25  # the rules decide() gets
    assert ACROSS.within_rules().taker_hedge == 1.0  # inside a replica: the caps are bounds
    assert not ACROSS.within_rules().hedged and ACROSS.within_rules().min_replicas == 1


def test_the_correction_hands_a_late_replicas_longest_request_over_and_it_stays():
    taker = ranks_of(1, [(20, None)], [])
    on = replace(ACROSS, correct=True)
    # its longest (15 left, counted 2x on the taker: 60 + 30 <= 100) goes to replica 1's idle
    # rank; replica 0 stays with the rest and now ends at 95
    assert decided(LATE + taker, CLOCKS, 0, on, end_bound=100, correct=True) == (
        [("0/0", 3)], [], [0])
    # off, without an end to keep, or at a boundary that does not check: nothing moves (it
    # ends the rollout, so it does not give either)
    assert decided(LATE + taker, CLOCKS, 0, ACROSS, end_bound=100, correct=True)[0] == []
    assert decided(LATE + taker, CLOCKS, 0, on, end_bound=None, correct=True)[0] == []
    assert decided(LATE + taker, CLOCKS, 0, on, end_bound=100, correct=False)[0] == []
    # the correction counts a leaving replica's requests 1.5x on their takers (the simulator's)
    assert on.across_rules().evacuation_hedge == 1.5
    assert ACROSS.across_rules().evacuation_hedge == 1.0


def test_the_takers_hedge_and_the_worst_case_of_its_mispredicted_requests_in_the_correction():
    on = replace(ACROSS, correct=True)
    hedged = replace(on, taker_hedge=1.25)
    kw = dict(end_bound=100, correct=True)
    # the taker's own request: 28 left (35 hedged: 60 + 35 <= 100, it takes)
    taker = ranks_of(1, [(28, None)], [])
    assert decided(LATE + taker, CLOCKS, 0, hedged, **kw)[0] == [("0/0", 3)]
    # it outlived its siblings (up to 45 left, its cap): 60 + 45 > 100, it does not
    mispredicted = ranks_of(1, [(28, 45)], [])
    assert decided(LATE + mispredicted, CLOCKS, 0, hedged, **kw)[0] == []
    assert decided(LATE + mispredicted, CLOCKS, 0, on, **kw)[0] == [("0/0", 3)]  # 1.0: as is
    # 36 left: as estimated it takes, hedged (45) it does not
    assert decided(LATE + ranks_of(1, [(36, None)], []), CLOCKS, 0, on, **kw)[0] == [("0/0", 3)]
    assert decided(LATE + ranks_of(1, [(36, None)], []), CLOCKS, 0, hedged, **kw)[0] == []


def test_the_mailbox_plans_the_correction_with_its_end_to_keep_and_claims_the_taker():
    """Through the job's store (a real in-process one): replica 1's leader posted its state;
    replica 0's plans at a check of its end (`correction_due`) and holds replica 1's inbox."""
    import torch.distributed as dist

    store = dist.HashStore()
    on = replace(ACROSS, correct=True, taker_hedge=1.25)
    boxes = [Mailbox(store, "r", i, 2, 2, 2 * i, 60.0, end_bound=100.0) for i in (0, 1)]
    for b in boxes:
        b.open()
    boxes[1].post(60, ranks_of(1, [(28, None)], []))
    d = boxes[0].plan(90, LATE, on, max_batch=8, block_tokens=16, correct=True)
    assert [(m.request_id, m.dst) for m in d.moves] == [("0/0", 3)]
    assert d.corrected_replicas == [0] and d.leaving_replicas == []
    assert store.get(boxes[0].key("status", 1)) == b"busy:0" and boxes[0].claimed == [1]
    boxes[0].release_claims()
    assert boxes[0].plan(90, LATE, on, max_batch=8, block_tokens=16, correct=False).moves == []
    # without the end to keep (no plan with history), the check never comes
    assert not Mailbox(store, "r", 0, 2, 2, 0, 60.0).correction_due(90, on)
    assert boxes[0].plan(90, LATE, ACROSS, max_batch=8, block_tokens=16, correct=True).moves == []


def test_the_mailbox_hands_nothing_to_a_replica_that_has_shrunk_inside():
    """Replica 1's group shrank to one rank: it posts one rank's state, so replica 0's leader
    counts it shrunk (`ConsolidationState.shrunk`), and the correction that went to its ranks
    with both posted finds no taker and claims no inbox."""
    import torch.distributed as dist

    on = replace(ACROSS, correct=True, taker_hedge=1.25)
    for posted, moved in ((ranks_of(1, [(28, None)], []), [("0/0", 3)]),
                          (ranks_of(1, [(28, None)], [])[:1], [])):
        store = dist.HashStore()
        boxes = [Mailbox(store, "r", i, 2, 2, 2 * i, 60.0, end_bound=100.0) for i in (0, 1)]
        for b in boxes:
            b.open()
        boxes[1].post(60, posted)
        d = boxes[0].plan(90, LATE, on, max_batch=8, block_tokens=16, correct=True)
        assert [(m.request_id, m.dst) for m in d.moves] == moved
        assert boxes[0].claimed == ([1] if moved else [])
    assert decided(LATE + ranks_of(1, [(28, None)], []), CLOCKS, 0, on,
                   end_bound=100.0, correct=True, shrunk={1})[0] == []


def test_a_replica_that_shrank_posts_its_survivors_at_once():
    """Replica 1 (ranks 2 and 3) posted both ranks at its boundary, then shrank to rank 3: rank
    3, its new leader, reposts rank 3's state of that post at once, so replica 0's correction
    no longer hands it a request before replica 1's next boundary. Rank 2, which left, posts
    nothing."""
    import torch.distributed as dist

    on = replace(ACROSS, correct=True, taker_hedge=1.25)
    store = dist.HashStore()
    boxes = [Mailbox(store, "r", i, 2, 2, 2 * i, 60.0, end_bound=100.0) for i in (0, 1)]
    survivor = Mailbox(store, "r", 1, 2, 2, 3, 60.0, end_bound=100.0)
    for b in boxes:
        b.open()
    both = ranks_of(1, [(28, None)], [])
    boxes[1].post(60, both)
    d = boxes[0].plan(90, LATE, on, max_batch=8, block_tokens=16, correct=True)
    assert [(m.request_id, m.dst) for m in d.moves] == [("0/0", 3)]
    boxes[0].release_claims()
    boxes[1].shrunk([3])  # not the new leader
    assert pickle.loads(store.get(boxes[1].key("state", 1))) == (60, both)
    survivor.shrunk([3])
    assert pickle.loads(store.get(boxes[1].key("state", 1))) == (60, both[1:])
    assert boxes[0].plan(90, LATE, on, max_batch=8, block_tokens=16, correct=True).moves == []
    assert boxes[0].claimed == []


def test_the_end_is_checked_from_half_the_end_to_keep_on_a_hundredth_of_it_apart():
    on = replace(ACROSS, correct=True)
    box = Mailbox(None, "r", 0, 2, 2, 0, 60.0, end_bound=300.0)
    assert [s for s in range(140, 160) if box.correction_due(s, on)] == [150, 153, 156, 159]
    assert not Mailbox(None, "r", 0, 2, 2, 0, 60.0, end_bound=300.0).correction_due(200, ACROSS)
    # on a modelled clock (seconds) a hundredth apart, however short: no step's floor
    timed = Mailbox(None, "r", 0, 2, 2, 0, 60.0, end_bound=3.0, clock=modelled())
    assert [t for t in (1.4, 1.5, 1.52, 1.53, 1.55, 1.56) if timed.correction_due(t, on)] == [
        1.5, 1.53, 1.56]


def test_the_end_to_keep_is_the_plans_bound_where_it_predicted_from_history():
    plan = RolloutPlan({}, {}, {"history": 3, "prior": 1}, {}, finish_bound=120.0)
    assert end_to_keep(plan) == 120.0
    assert end_to_keep(replace(plan, sources={"history": 0, "prior": 4})) is None
    assert end_to_keep(replace(plan, finish_bound=None)) is None and end_to_keep(None) is None
    # a plan by seconds: its bound in modelled seconds, the replicas' modelled clock's
    assert end_to_keep(replace(plan, finish_bound=2.5, by_seconds=True)) == 2.5


def test_worst_tokens_is_the_cap_where_the_estimate_is_a_bound_or_known_wrong():
    assert worst_tokens(100, 10, [30, 50, 40]) is None  # its siblings' median still ahead
    assert worst_tokens(100, 60, [30, 50, 40]) == 40  # outlived them: up to the cap
    assert worst_tokens(100, 10, []) == 90 == remaining_tokens(100, 10, [])  # the cap already


def modelled(max_batch=8):
    from flexfloor.rollout.elastic import modelled_clock, plan_step_cost
    from flexfloor.sim.cost import cost_model
    from megatron_ext.placement import Placement

    cost = cost_model("H800", "qwen3-30b-a3b")
    placement = Placement(owner=(0,) * 4 + (1,) * 4, ranks=(0, 1))
    return modelled_clock(cost, placement, plan_step_cost(cost, placement, max_batch))


def test_a_plan_or_clock_by_modelled_seconds_without_a_cost_model_names_the_setting():
    """With the pace rule off (no cost model) neither the plan's step cost nor a modelled clock
    can be built: each says which setting to set, not an AttributeError."""
    from flexfloor.rollout.elastic import modelled_clock, plan_step_cost
    from megatron_ext.placement import Placement

    placement = Placement(owner=(0,) * 4 + (1,) * 4, ranks=(0, 1))
    with pytest.raises(ValueError, match="plan by modelled seconds.*elastic.pace_model=H800"):
        plan_step_cost(None, placement, 8)
    with pytest.raises(ValueError, match="modelled clock.*elastic.pace_model=H800"):
        modelled_clock(None, placement, None)


def test_on_modelled_seconds_a_reprefill_stalls_its_taker():
    """Replica 1 can hand its one short request over. On the step clock a re-prefill costs no
    step, so it goes to replica 2, planned to stay longest; on a modelled clock (a plan by
    seconds') the re-prefill of its 3000 cached tokens stalls the whole lockstep taker, which
    would then end the rollout later: it goes to replica 0, which ends well before."""
    states = [RankState(0, 0, (Running("a", 500, 100.0),), 0, None),
              RankState(1, 0, (Running("b", 500, 100.0),), 0, None),
              RankState(2, 1, (Running("g", 3000, 2.0),), 0, None), RankState(3, 1, (), 0, None),
              RankState(4, 2, (Running("c", 500, 300.0),), 0, None), RankState(5, 2, (), 0, None)]
    rules, clocks = TailRules(across=True), {0: 0.0, 1: 0.0, 2: 0.0}
    steps = across_replicas(states, clocks, 1, rules, max_batch=8, block_tokens=16)
    assert [(m.dst, m.seconds) for m in steps.moves] == [(5, 0.0)] and steps.leaving_replicas == [1]
    clock = modelled()
    secs = across_replicas(states, clocks, 1, rules, max_batch=8, block_tokens=16, clock=clock)
    (move,) = secs.moves
    assert move.dst == 0 and secs.leaving_replicas == [1]
    assert move.seconds > 0
    assert move.seconds == pytest.approx(3000 * clock.prices.reprefill_s_per_token)
    # with no replica ending after the taker, the stall would lengthen the rollout: no move
    two = [s for s in states if s.replica < 2]
    assert across_replicas(two, {0: 0.0, 1: 0.0}, 1, rules, max_batch=8, block_tokens=16,
                           clock=clock).moves == []


def test_a_modelled_clock_prices_each_step_once_as_price_trace_does():
    """Two ranks of a replica, their steps traced; the clock, advanced at each boundary from the
    step report's traced loads (every rank's last step), reads what `price_trace` makes of the
    whole traces; a boundary seen twice is priced once, a step skipped is an error."""
    from flexfloor.rollout.types import StepTrace
    from flexfloor.sim.cost import price_trace

    clock = modelled()
    traces = {r: StepTrace(num_experts=8, num_layers=2, expert_bytes=1000) for r in (0, 1)}
    for tr in traces.values():
        tr.enter_group((0, 1), (0,) * 4 + (1,) * 4)
    contexts = {0: [[(0, 7)], [(7, 1)], [(8, 1), (0, 300)], [(9, 1), (300, 1)]],
                1: [[(0, 40), (0, 3)], [(40, 1), (3, 1)], [], [(0, 1000)]]}
    for k in range(4):
        for r, tr in traces.items():
            tr.add_step(contexts[r][k], experts_touched=3 + r + k)
        rep = replace(report([state(0, 1), state(1, 1)]),
                      traced=[traces[r].load(r, k) for r in (0, 1)])
        clock.advance(rep, traces[0])
        clock.advance(rep, traces[0])  # the same boundary again: nothing more
    assert clock.priced == 4
    assert clock.seconds == pytest.approx(price_trace(traces, clock.cost).rollout_s, rel=1e-12)
    for tr in traces.values():
        tr.add_step([(10, 1)], 1)
        tr.add_step([(11, 1)], 1)
    with pytest.raises(ValueError, match="one step at each boundary"):
        clock.advance(rep, traces[0])
