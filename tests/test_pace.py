"""The pace rule of a shrink (elastic.pace_model, flexfloor/rollout/release.py `Pace`): a shrink
is refused when its survivors, at their post-shrink step cost, would end the replica later than
it ends without the shrink (or, given the end to keep, later than that or at no saving of
occupied seconds); with a step that costs the same whatever the group it never is. Hand-built
step reports, no process group."""

import random

import pytest

from flexfloor.config import ConfigError, ElasticConfig
from flexfloor.rollout.elastic import pace_of
from flexfloor.rollout.engine import StepReport
from flexfloor.rollout.release import (
    Pace, RankLimits, ReleaseRules, decide, slows_replica, under_pace,
)
from flexfloor.sim.cost import UnitCost, cost_model
from megatron_ext.placement import initial_placement

LIMITS = RankLimits(kv_bytes_per_token=1, max_seq_len=64, max_batch_size=8,
                    kv_budget_bytes=None, expert_nbytes=1)


def placement(ranks=4, experts=8):
    per = experts // ranks
    return initial_placement(experts, {r: list(range(r * per, (r + 1) * per))
                                       for r in range(ranks)})


def report(work):
    """The shared report of a group whose ranks run `work` (per rank: (remaining, cached))."""
    return StepReport(has_work=[bool(w) for w in work], finished=0, tokens=0, requests=0,
                      running=[len(w) for w in work], queued=[0] * len(work),
                      remaining=[int(max((n for n, _ in w), default=0)) for w in work],
                      kv_free=[10 ** 6] * len(work))


def by_hosted(per_expert: float, per_group: float = 0.0) -> Pace:
    """A step that costs more the more experts its rank hosts (it reads their weights every
    step), and `per_group` more when the group has more than one rank (its all-to-all)."""
    def group_cost(p, busy):
        hosted = max(p.owner.count(r) for r in p.ranks)
        return lambda n, ctx: 1.0 + per_expert * hosted + per_group * (len(p.ranks) > 1)
    return Pace(group_cost)


# ranks 2 and 3 are done; ranks 0 and 1 still run (remaining tokens, cached tokens)
WORK = [[(10.0, 8), (4.0, 6)], [(7.0, 9)], [], []]


def test_a_shrink_whose_survivors_would_end_later_is_refused():
    slower = ReleaseRules(pace=by_hosted(0.1))
    d = decide(slower, placement(), report(WORK), LIMITS, 1, WORK)
    assert d.paced and d.leaving == [] and d.placement is None
    # without the rule, or without the ranks' work, the same report shrinks
    for rules, work in ((ReleaseRules(), WORK), (slower, None)):
        d = decide(rules, placement(), report(WORK), LIMITS, 1, work)
        assert d.leaving == [2, 3] and not d.paced


def test_a_shrink_whose_survivors_end_no_later_goes_ahead():
    # the all-to-all it saves outweighs the experts it adds: the survivors' steps are no slower
    faster = ReleaseRules(pace=by_hosted(0.1, per_group=1.0))
    alone = [WORK[0] + WORK[1], [], [], []]  # rank 0 runs on alone, hosting all 8 experts
    d = decide(faster, placement(), report(alone), LIMITS, 1, alone)
    assert d.leaving == [1, 2, 3] and not d.paced
    assert decide(ReleaseRules(pace=by_hosted(0.1)), placement(), report(alone), LIMITS, 1,
                  alone).paced
    # nothing left to run on the survivors: nothing to slow
    idle = [[], [], [], []]
    assert decide(ReleaseRules(pace=by_hosted(0.1)), placement(), report(idle), LIMITS, 1,
                  idle).leaving == [1, 2, 3]


def test_with_unit_cost_the_rule_never_refuses():
    """The engine's own clock (a step costs 1) and `cost_model("unit")` through `pace_of`: the
    decision with the rule is the decision without it, on random reports."""
    g = random.Random(0)
    rules = ReleaseRules(pace=pace_of(UnitCost(), 8))
    for _ in range(200):
        ranks = g.choice([2, 4])
        work = [[(float(g.randint(1, 40)), g.randint(1, 30)) for _ in range(g.randint(0, 3))]
                for _ in range(ranks)]
        p = placement(ranks)
        want = decide(ReleaseRules(), p, report(work), LIMITS, 1, work)
        got = decide(rules, p, report(work), LIMITS, 1, work)
        assert (got.leaving, got.paced) == (want.leaving, False)


def test_the_cost_model_prices_a_survivor_that_hosts_every_expert():
    """An H800 with qwen3-30b-a3b's shape (the benchmark's): one survivor decoding 8 requests
    at 1k context hosts all 128 experts after the shrink; the rule asks the cost model."""
    cost = cost_model("H800", "qwen3-30b-a3b")
    pace = pace_of(cost, 8)
    before, after = placement(2), placement(2).__class__((0,) * 8, (0,))
    work = [[(100.0, 1000)] * 8, []]
    t_before = pace.group_cost(before, (0,))(8, 8000.0)
    t_after = pace.group_cost(after, (0,))(8, 8000.0)
    assert t_after > t_before  # one GPU reads every expert's weights each step
    assert slows_replica(pace, before, after, work)


def test_the_config_names_a_bad_pace_field():
    assert ElasticConfig().pace_model == "none"  # off by default
    with pytest.raises(ConfigError, match="elastic.pace_model:.*H800"):
        ElasticConfig(pace_model="h800").validate()
    with pytest.raises(ConfigError, match="elastic.pace_model_shape:.*qwen3-30b-a3b"):
        ElasticConfig(pace_model="H800", pace_model_shape="qwen3").validate()
    ElasticConfig(pace_model="H800", pace_model_shape="qwen3-30b-a3b").validate()


def test_a_shrink_whose_expert_transfers_outlast_what_it_saves_is_refused():
    """The survivors stall for the experts the shrink ships (`Pace.shrink_cost`): with steps no
    slower after it, a shrink still ends the replica later when the stall is longer than
    nothing (here the stall is all it changes); `pace_of` prices the stall as `price_trace`
    prices a shrink (each engine expert stands for its share of the cost model's, sent and
    received at once, then the switch to a group built ahead, or the group's creation where
    none takes the survivors: `creates`, `survivors.creates_group`)."""
    same = by_hosted(0.0)
    stalled = ReleaseRules(pace=Pace(same.group_cost, lambda p, q, transfers: 0.5 * len(transfers)))
    d = decide(stalled, placement(), report(WORK), LIMITS, 1, WORK)
    assert d.paced and d.leaving == []
    free = ReleaseRules(pace=Pace(same.group_cost, lambda p, q, transfers: 0.0))
    assert decide(free, placement(), report(WORK), LIMITS, 1, WORK).leaving == [2, 3]
    # nothing left to run on the survivors: they wait for nothing
    idle = [[], [], [], []]
    assert decide(stalled, placement(), report(idle), LIMITS, 1, idle).leaving == [1, 2, 3]

    cost = cost_model("H800", "qwen3-30b-a3b")  # 128 experts; the engine's 8 as 16 each
    two = placement(ranks=2)
    d = decide(ReleaseRules(), two, report([[(5.0, 8)], []]), LIMITS, 1)
    assert d.leaving == [1] and len(d.transfers) == 4
    stall = pace_of(cost, 8).shrink_cost(two, d.placement, d.transfers)
    assert stall == pytest.approx(cost.measured_shrink_seconds({0: 64.0, 1: 64.0}, (0, 1), 0))
    # the survivors' group priced as the shrink will make it: created where none takes them
    asked = []
    for made in (True, False):
        pace = pace_of(cost, 8, creates=lambda a, s, m=made: asked.append((a, s)) or m)
        assert pace.shrink_cost(two, d.placement, d.transfers) == pytest.approx(
            cost.measured_shrink_seconds({0: 64.0, 1: 64.0}, (0, 1), int(made)))
    assert asked == [((0, 1), (0,))] * 2
    assert cost.params.group_create_s > cost.params.switch_s
    # half of a 30B-A3B model's experts over NVLink outlasts many decode steps
    step = pace_of(cost, 8).group_cost(two, (0,))(1, 100)
    assert stall > 20 * step
    assert decide(ReleaseRules(pace=pace_of(cost, 8)), two, report([[(5.0, 8)], []]), LIMITS, 1,
                  [[(5.0, 8)], []]).paced


def test_within_the_end_to_keep_a_slower_shrink_that_saves_occupancy_goes_ahead():
    """`end_s` (the seconds the replica may take: the rollout's end to keep less its clock): a
    shrink whose survivors end later is made when they still end within it and the leavers'
    seconds held to the unshrunk end exceed what the survivors add; else it is refused."""
    from flexfloor.rollout.scheduler import lockstep_end

    pace = by_hosted(0.1)
    rules = ReleaseRules(pace=pace)
    p = placement()  # 4 ranks of 2 experts; ranks 2 and 3 done
    before = lockstep_end(WORK, pace.group_cost(p, (0, 1)))
    shrunk = decide(ReleaseRules(), p, report(WORK), LIMITS, 1)
    after = lockstep_end(WORK[:2], pace.group_cost(shrunk.placement, (0, 1)))
    assert after > before  # the survivors host 4 experts each: slower
    assert decide(rules, p, report(WORK), LIMITS, 1, WORK).paced  # no end given: refused
    ok = decide(rules, p, report(WORK), LIMITS, 1, WORK, end_s=after * 1.01)
    assert ok.leaving == [2, 3] and not ok.paced
    assert decide(rules, p, report(WORK), LIMITS, 1, WORK, end_s=after * 0.99).paced
    # one leaver, three survivors that each slow by a third: the leaver's seconds (one
    # replica's end) do not exceed the three survivors' extra, whatever the end to keep
    three = [[(10.0, 8)], [(7.0, 9)], [(3.0, 2)], []]
    slow = ReleaseRules(pace=by_hosted(1.0))
    assert decide(slow, p, report(three), LIMITS, 1, three, end_s=1e9).paced
    # the same shrink with the survivors slowed less: it saves, and goes ahead
    assert decide(ReleaseRules(pace=by_hosted(0.1)), p, report(three), LIMITS, 1, three,
                  end_s=1e9).leaving == [3]


def test_the_rule_prices_the_shrink_fitted_to_the_groups_built_ahead():
    """Ranks 1 and 3 are done, but only (0, 1, 2), (0, 1), (0,) were built ahead: the nearest
    prebuilt superset of the survivors (0, 2) is (0, 1, 2), so only rank 3 leaves
    (`survivors.leavers_for`). The rule prices that shrink, not the one to (0, 2): here a group of
    two steps slower than the four, a group of three faster."""
    from flexfloor.rollout.survivors import leavers_for

    def group_cost(p, busy):
        return lambda n, ctx: {2: 2.0, 3: 1.0}.get(len(p.ranks), 1.5)

    rules = ReleaseRules(pace=Pace(group_cost))
    work = [[(10.0, 8)], [], [(7.0, 9)], []]
    prebuilt = {(0, 1, 2): None, (0, 1): None, (0,): None}
    fit = lambda active, leaving: leavers_for(active, leaving, prebuilt)  # noqa: E731
    d = decide(rules, placement(), report(work), LIMITS, 1, work, fit=fit)
    assert d.leaving == [3] and not d.paced and tuple(d.placement.ranks) == (0, 1, 2)
    # unfitted, the same report is refused: the survivors (0, 2) would step at 2.0
    assert decide(rules, placement(), report(work), LIMITS, 1, work).paced


def test_the_engine_gives_the_rule_its_end_to_keep_on_the_modelled_clock():
    """`ElasticMembership.end_to_keep_s`: the plan's end to keep less the replica's modelled
    clock, where the replicas keep modelled seconds and the correction keeps that end (as the
    simulator passes `end_s`); else none, and a slower shrink is refused. The membership's own
    decision takes it (the case of the test above), pricing the shrink it planned without
    work (`release.under_pace`), as `decide` with the work does."""
    from flexfloor.rollout.elastic import ElasticMembership
    from flexfloor.rollout.scheduler import lockstep_end
    from flexfloor.rollout.tails import Mailbox, ModelledClock, TailRules

    pace = by_hosted(0.1)
    p = placement()
    shrunk = decide(ReleaseRules(), p, report(WORK), LIMITS, 1)
    after = lockstep_end(WORK[:2], pace.group_cost(shrunk.placement, (0, 1)))

    def membership(correct=True, clock=True, end_bound=100.0):
        box = Mailbox(store=None, rollout_id="0", replica=0, replicas=2, ranks_per_replica=4,
                      rank=0, timeout_s=1.0, end_bound=end_bound,
                      clock=(ModelledClock(cost=None, step_cost=None, prices=None,
                                           seconds=100.0 - after * 1.01) if clock else None))
        m = ElasticMembership(parallel=None, min_active_ranks=1, mailbox=box,
                              tails=TailRules(across=True, correct=correct))
        m._pace, m._boundaries = pace, 1
        return m

    m = membership()
    assert m.end_to_keep_s() == pytest.approx(after * 1.01)
    d = under_pace(m.rules, p, m._decide_at(p, report(WORK), LIMITS), WORK, m.end_to_keep_s())
    assert d.leaving == [2, 3] and not d.paced
    for other in (membership(correct=False), membership(clock=False),
                  membership(end_bound=None), ElasticMembership(parallel=None)):
        assert other.end_to_keep_s() is None
    for end_s in (None, after * 0.5, after * 1.01, after * 2):
        rules = m.rules
        assert under_pace(rules, p, decide(rules, p, report(WORK), LIMITS, 1), WORK, end_s) == (
            decide(rules, p, report(WORK), LIMITS, 1, WORK, end_s)), end_s
    m = membership(correct=False)
    assert under_pace(m.rules, p, m._decide_at(p, report(WORK), LIMITS), WORK,
                      m.end_to_keep_s()).paced


def test_the_engines_work_for_the_rule_is_counted_as_the_simulators():
    """`elastic.pace_work`: every rank's running requests, a moved one on its taker; with the
    correction each counted as the takers count their own (the simulator's rule: its worst
    where known wrong, else the taker hedge times its estimate); without, as estimated."""
    from flexfloor.rollout.consolidate import Move, MoveKind, RankState, Running
    from flexfloor.rollout.elastic import pace_work
    from flexfloor.rollout.tails import TailRules

    states = [RankState(0, 0, (Running("a", 10, 30.0), Running("b", 12, 5.0, worst=50.0)), 0, None),
              RankState(1, 0, (Running("c", 7, 8.0),), 0, None),
              RankState(2, 0, (), 0, None)]
    moves = [Move("c", 1, 2, MoveKind.REPREFILL, 0.0)]
    assert pace_work(states, (0, 1, 2), moves) == [[(30.0, 10), (5.0, 12)], [], [(8.0, 7)]]
    hedged = TailRules(across=True, taker_hedge=1.25, correct=True)
    assert pace_work(states, (0, 1, 2), moves, hedged) == [[(37.5, 10), (50.0, 12)], [],
                                                           [(10.0, 7)]]
    uncorrected = TailRules(across=True, taker_hedge=1.25)
    assert pace_work(states, (0, 1, 2), (), uncorrected) == [[(30.0, 10), (5.0, 12)],
                                                             [(8.0, 7)], []]
