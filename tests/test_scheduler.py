"""Scheduler: history, prediction, memory model and placement on hand-made cases (pure)."""


import pytest

from flexfloor.config import ModelConfig, PlacementPolicy
from flexfloor.rollout.scheduler import (
    LengthHistory, MemoryModel, PromptGroup, Predictor, Scheduler, prediction_accuracy,
    _profile_by_events, pool_trace, rank_profile, simulate_rank_steps,
)
from flexfloor.rollout.types import Request


def groups(lengths_by_uid, n=2):
    return [PromptGroup(uid, tuple(Request(prompt_uid=uid, sample_index=s, prompt_ids=(1, 2),
                                           max_new_tokens=200) for s in range(n)))
            for uid in lengths_by_uid]


def history(lengths_by_uid):
    h = LengthHistory()
    for uid, n in lengths_by_uid.items():
        h.record(uid, [n, n - 1])
    return h


def test_predictor_prefers_history_then_siblings_then_prior():
    h = LengthHistory()
    p = Predictor(h, prior_quantile=0.5, default=64)
    assert p.predict(1) == (64, "default")
    h.record(1, [10, 30])
    h.record(2, [50, 70])
    assert p.predict(1) == (30, "history")
    assert p.predict(3, siblings=[12, 14]) == (14, "siblings")
    assert p.predict(3) == (h.quantile(0.5), "prior")
    assert h.quantile(0.0) == 10 and h.quantile(1.0) == 70


def test_history_survives_a_state_round_trip():
    h = history({1: 10, 2: 40})
    h2 = LengthHistory.from_state_dict(h.state_dict())
    assert h2.lengths == h.lengths and h2.quantile(0.5) == h.quantile(0.5)
    assert h2.max_epochs == h.max_epochs


def test_prediction_accuracy_perfect_and_reversed():
    pred = {1: 10.0, 2: 20.0, 3: 30.0}
    assert prediction_accuracy(pred, {1: 10, 2: 20, 3: 30}) == {"spearman": 1.0, "mae": 0.0, "n": 3}
    rev = prediction_accuracy(pred, {1: 30, 2: 20, 3: 10})
    assert rev["spearman"] == pytest.approx(-1.0) and rev["mae"] == pytest.approx(40 / 3)


def test_memory_model_from_tiny_config():
    m = MemoryModel.from_model_config(ModelConfig(), kv_budget_tokens=1000)
    # 2 (K,V) x 2 layers x 2 groups x 16 head dim x 4 bytes
    assert m.kv_bytes_per_token == 512
    assert m.expert_bytes == 3 * 64 * 64 * 4 * 2
    assert m.kv_tokens(0) == 1000
    assert m.kv_tokens(1) == (512_000 - m.expert_bytes) // 512  # a borrowed expert costs KV room
    assert m.max_borrowed(1000) == 0
    assert MemoryModel.from_model_config(ModelConfig()).kv_tokens() is None


def test_simulated_steps_follow_admission_under_kv_room():
    assert simulate_rank_steps([10, 5, 5], [0, 0, 0], None, 64) == 10
    assert simulate_rank_steps([10, 5, 5], [0, 0, 0], 15, 64) == 10  # 10 and 5 fit, then 5
    assert simulate_rank_steps([10, 10], [0, 0], 10, 64) == 20  # one at a time
    assert simulate_rank_steps([4, 4, 4], [0, 0, 0], None, 1) == 12  # batch of one


def test_baseline_is_equal_contiguous_chunks():
    gs = groups({u: 10 for u in range(8)})
    plan = Scheduler(PlacementPolicy.BASELINE).plan(gs, [0, 1, 2, 3])
    assert [len(plan.assignment[r]) for r in range(4)] == [4, 4, 4, 4]
    assert [q.prompt_uid for q in plan.assignment[0]] == [0, 0, 1, 1]


def test_flexfloor_puts_longest_work_on_staying_ranks_and_staggers():
    lengths = {0: 5, 1: 80, 2: 10, 3: 40, 4: 20, 5: 160, 6: 15, 7: 30}
    s = Scheduler(PlacementPolicy.FLEXFLOOR, history=history(lengths))
    plan = s.plan(groups(lengths), [0, 1, 2, 3])
    uids = {r: sorted({q.prompt_uid for q in plan.assignment[r]}) for r in range(4)}
    # by hand: rank 0 may take twice its fair share (4 of 8 groups): the four longest; rank 1
    # the rest (its cap, 2 * ceil(4 / 3) = 4); ranks 2 and 3 have nothing and leave at once
    assert uids == {0: [1, 3, 5, 7], 1: [0, 2, 4, 6], 2: [], 3: []}
    finish = [plan.expected_finish[r] for r in range(4)]
    assert finish == [160, 20, 0, 0]  # ranks leave one after another
    # every sample of a prompt on one rank; within a rank the longest first
    assert [q.prompt_uid for q in plan.assignment[0]] == [5, 5, 1, 1, 3, 3, 7, 7]
    assert plan.sources["history"] == 8
    # occupied steps: static keeps 4 ranks for the longest; FlexFloor releases after each finish
    static = 4 * max(lengths.values())
    assert sum(finish) < static / 1.65


def test_flexfloor_respects_a_makespan_bound_when_memory_is_tight():
    lengths = {u: n for u, n in enumerate([100, 90, 80, 70, 20, 15, 10, 5])}
    tight = MemoryModel(kv_bytes_per_token=1, expert_bytes=1, kv_budget_bytes=210)
    s = Scheduler(PlacementPolicy.FLEXFLOOR, history=history(lengths), memory=tight)
    plan = s.plan(groups(lengths), [0, 1, 2, 3])
    base = Scheduler(PlacementPolicy.BASELINE, history=history(lengths), memory=tight)
    base_plan = base.plan(groups(lengths), [0, 1, 2, 3])
    assert max(plan.expected_finish.values()) <= max(base_plan.expected_finish.values())
    assert sum(len(v) for v in plan.assignment.values()) == 16  # nothing lost or duplicated


def test_rank_profile_peak_is_the_cached_tokens_just_before_a_finish():
    # two requests with 1-token prompts, 4 and 2 tokens: at step 2 both hold 1 + 2 = 3 tokens
    assert rank_profile([4, 2], [1, 1], None, 8) == (4, 6)
    # one slot: the 2-token request waits for the first; peaks 1 + 4, then 1 + 2
    assert rank_profile([4, 2], [1, 1], None, 1) == (6, 5)


def peak_and_finish(sched, assignment):
    """(finish, peak) of each rank under the scheduler's own per-request predictions."""
    return {r: rank_profile([sched._per_request[q.request_id] for q in reqs],
                            [len(q.prompt_ids) for q in reqs], None, sched.max_batch_size)
            for r, reqs in assignment.items()}


def test_load_cap_bounds_each_ranks_peak_by_the_baselines_and_places_everything():
    lengths = {uid: n for uid, n in enumerate([200, 190, 180, 170, 60, 50, 40, 30, 20, 12, 8, 4])}
    gs = groups(lengths, n=4)
    base = Scheduler(PlacementPolicy.BASELINE, history(lengths), max_batch_size=64)
    base_peak = max(p for _, p in peak_and_finish(base, base.plan(gs, range(4)).assignment).values())
    for cap, share in ((None, 2.0), (1.0, 1.0), (0.7, 1.0)):
        sched = Scheduler(PlacementPolicy.FLEXFLOOR, history(lengths), max_batch_size=64,
                          max_share=share, load_cap=cap)
        plan = sched.plan(gs, range(4))
        placed = sorted(q.request_id for reqs in plan.assignment.values() for q in reqs)
        assert placed == sorted(q.request_id for g in gs for q in g.requests)
        prof = peak_and_finish(sched, plan.assignment)
        assert max(f for f, _ in prof.values()) <= 200  # never slower than the longest group
        if cap is not None:
            # the longest work stays on rank 0, within the cap, and no rank is a dumping ground
            assert prof[0][1] <= cap * base_peak or len(plan.assignment[0]) == 4
            assert max(len(v) for v in plan.assignment.values()) <= 2 * 12
        assert plan.assignment[0][0].prompt_uid == 0


def test_a_cap_no_rank_can_meet_does_not_pile_onto_the_last_rank():
    lengths = {uid: 100 for uid in range(16)}  # no history difference: every group alike
    sched = Scheduler(PlacementPolicy.FLEXFLOOR, history(lengths), max_batch_size=64,
                      max_share=1.0, load_cap=0.3)
    plan = sched.plan(groups(lengths, n=2), range(4))
    counts = [len(plan.assignment[r]) for r in range(4)]
    assert sum(counts) == 32 and max(counts) <= 10, counts


def test_rank_profile_shortcut_equals_the_event_simulation():
    import random

    rng = random.Random(3)
    for _ in range(500):
        n = rng.randint(1, 30)
        lengths = [rng.choice([rng.randint(1, 80), rng.uniform(0.5, 60)]) for _ in range(n)]
        prompts = [rng.randint(1, 12) for _ in range(n)]
        for kv, batch in ((None, 64), (10_000, n), (None, max(1, n // 2)), (sum(prompts) + 40, 64)):
            fast, slow = rank_profile(lengths, prompts, kv, batch), _profile_by_events(
                lengths, prompts, kv, batch)
            assert fast == pytest.approx(slow), (lengths, prompts, kv, batch)


# ---------------------------------------------------------------- tight KV budget: blocks


def test_pool_trace_counts_blocks_as_the_engine_step_for_step():
    """The scheduler's prediction of one rank is the engine's block pool (as the simulator
    counts it, which is held to the real engine step for step in test_sim): admission over
    the watermark, blocks as tokens are produced, the youngest preempted when the pool runs
    out, borrowed experts' room withheld after a release."""
    import random

    from flexfloor.rollout.release import RankLimits
    from flexfloor.sim.cost import UnitCost
    from flexfloor.sim.rollout import SimError, SimRequest, simulate_rollout
    from megatron_ext.placement import balanced_placement

    rng = random.Random(1)
    preempted = 0
    # first by hand: 25 one-block prompts in a 25-block pool, admission keeping one block free
    # (the watermark) admits 24, the last a step later
    cases = [([1] * 25, [16] * 25, 16, 400, 64)]
    for _ in range(120):
        n = rng.randint(1, 40)
        lengths = [rng.randint(1, 120) for _ in range(n)]
        prompts = [rng.randint(1, 20) for _ in range(n)]
        longest = max(a + b for a, b in zip(lengths, prompts))
        cases.append((lengths, prompts, rng.choice([1, 4, 16]),
                      rng.choice([None, longest + rng.randint(0, 200), 3 * longest]),
                      rng.choice([n, max(1, n // 3)])))
    for case, (lengths, prompts, bt, tokens, batch) in enumerate(cases):
        limits = RankLimits(kv_bytes_per_token=8, max_seq_len=200, max_batch_size=batch,
                            kv_budget_bytes=None if tokens is None else tokens // bt * bt * 8,
                            expert_nbytes=1 << 40)
        reqs = [SimRequest(f"r{i}", i, p, a) for i, (a, p) in enumerate(zip(lengths, prompts))]
        blocks = None if tokens is None else tokens // bt
        try:
            out = simulate_rollout({0: reqs}, None, UnitCost(), limits=limits,
                                   placement=balanced_placement(2, [0]), kv_block_tokens=bt,
                                   exact_blocks=True).records[0]
        except SimError:  # a preempted request outgrew the pool: the engine fails too
            with pytest.raises(ValueError, match="nothing running"):
                pool_trace(lengths, prompts, blocks, bt, batch)
            continue
        got = pool_trace(lengths, prompts, blocks, bt, batch)
        assert got.steps == out["local_finish_step"], (case, lengths, prompts, tokens, bt)
        assert rank_profile(lengths, prompts, tokens, batch, block_tokens=bt)[0] == got.steps
        assert len(got.used) == len(got.queued) == len(got.running) == got.steps
        preempted += out["preempted"]
    assert preempted > 0  # the cases reach preemption
    assert pool_trace(*cases[0][:2], 25, 16, 64).steps == 2
    # room withheld after a release (a survivor's borrowed experts) delays the same requests
    free = pool_trace([60] * 6, [4] * 6, 25, 16, 64)
    shrunk = pool_trace([60] * 6, [4] * 6, 25, 16, 64, withheld=[(10, 12)])
    assert shrunk.steps > free.steps and shrunk.used[10] <= 25 - 12


def _tight_case(n_groups=16, samples=8):
    lengths = [150, 120, 100, 90, 80, 70, 60, 50, 40, 30, 25, 20, 16, 12, 10, 8][:n_groups]
    h = LengthHistory()
    for uid, n in enumerate(lengths):
        h.record(uid, [n] * samples)  # the history is what will happen
    gs = [PromptGroup(uid, tuple(Request(prompt_uid=uid, sample_index=s, prompt_ids=(1, 2, 3, 4),
                                         max_new_tokens=200) for s in range(samples)))
          for uid in range(len(lengths))]
    return lengths, h, gs


def _steps(assignment, lengths, blocks):
    """Each rank's steps under the engine's pool with the lengths that happen."""
    return {r: pool_trace([lengths[q.prompt_uid] for q in reqs], [4] * len(reqs), blocks, 16,
                          64).steps for r, reqs in assignment.items()}


@pytest.mark.parametrize("replicas", [None, [(0, 1), (2, 3)]])
def test_tight_kv_placement_never_plans_past_the_static_end(replicas):
    """25 KV blocks per rank: static (least outstanding) admits in waves. Piling the long work
    on the ranks meant to stay (the placement before the bound: its rank 0 alone takes 948
    steps, and the others leave early, so it occupies no more steps than static) runs it far
    past static's end; the plan keeps every rank within static's end."""
    from flexfloor.rollout.replicas import route_least_outstanding

    lengths, h, gs = _tight_case()
    # 1 block per expert: survivors can host a leaver's experts (R = 1, four ranks)
    mem = MemoryModel(kv_bytes_per_token=1, expert_bytes=16, kv_budget_bytes=400,
                      block_tokens=16, num_experts=4)
    sched = Scheduler(PlacementPolicy.FLEXFLOOR, h, memory=mem)
    groups_of = [tuple(range(4))] if replicas is None else replicas
    static = _steps(route_least_outstanding(gs, groups_of), lengths, 25)
    plan = sched.plan(gs, range(4), replicas=replicas)
    piled = sched._staggered(sorted(gs, key=lambda g: -lengths[g.uid]), range(4), lambda r: True)
    assert max(_steps(piled, lengths, 25).values()) > 2 * max(static.values())
    assert max(plan.expected_finish.values()) <= max(static.values())  # history = what happens
    assert max(_steps(plan.assignment, lengths, 25).values()) <= max(static.values())
    placed = sorted(q.request_id for reqs in plan.assignment.values() for q in reqs)
    assert placed == sorted(q.request_id for g in gs for q in g.requests)


def test_tight_kv_concentrates_only_within_the_bound():
    """With no margin for mispredictions (pace_margin 1), the long work gathers on the replica
    meant to stay as far as static's predicted end allows: the plan differs from static's,
    every rank still within static's end."""
    from flexfloor.rollout.replicas import route_least_outstanding

    lengths, h, gs = _tight_case()
    mem = MemoryModel(kv_bytes_per_token=1, expert_bytes=192, kv_budget_bytes=400,
                      block_tokens=16, num_experts=8)
    replicas = [(0, 1), (2, 3)]
    plan = Scheduler(PlacementPolicy.FLEXFLOOR, h, memory=mem, pace_margin=1.0).plan(
        gs, range(4), replicas=replicas)
    static = route_least_outstanding(gs, replicas)
    assert [len(plan.assignment[r]) for r in range(4)] != [len(static[r]) for r in range(4)]
    end = max(_steps(static, lengths, 25).values())
    assert max(_steps(plan.assignment, lengths, 25).values()) <= end
    # the replica meant to stay holds the longest prompt's samples
    assert {q.prompt_uid for r in (0, 1) for q in plan.assignment[r]} >= {0}


def test_release_keeps_the_kv_room_running_requests_still_need():
    """A survivor borrows an expert only from room its running requests will not write: with
    requests running that still produce tokens, the same free room hosts nothing more, and the
    group holds at its floor instead of shrinking into their KV."""
    from types import SimpleNamespace

    from flexfloor.rollout.release import RankLimits, ReleaseRules, capacity_now, decide
    from megatron_ext.placement import balanced_placement

    limits = RankLimits(kv_bytes_per_token=10, max_seq_len=100, max_batch_size=8,
                        kv_budget_bytes=10_000, expert_nbytes=1_000)
    placement = balanced_placement(4, [0, 1])
    idle = SimpleNamespace(kv_free=[2_000, 10_000], queued=[0, 0], running=[0, 0],
                           remaining=[0, 0])
    busy = SimpleNamespace(kv_free=[2_000, 10_000], queued=[0, 0], running=[3, 0],
                           remaining=[40, 0])  # 3 requests x 40 tokens x 10 bytes = 1200
    assert capacity_now(ReleaseRules(), placement, idle, limits)[0] == 2 + 2
    assert capacity_now(ReleaseRules(), placement, busy, limits)[0] == 2 + 0
    report = StepReportLike(has_work=[True, False], running=[3, 0], queued=[0, 0],
                            remaining=[40, 0], kv_free=[2_000, 10_000])
    d = decide(ReleaseRules(), placement, report, limits, 1)
    assert d.leaving == [] and d.floor_hit  # rank 1 is done but rank 0 cannot host its experts
    roomy = StepReportLike(has_work=[True, False], running=[1, 0], queued=[0, 0],
                           remaining=[40, 0], kv_free=[2_500, 10_000])
    assert decide(ReleaseRules(), placement, roomy, limits, 1).leaving == [1]


def StepReportLike(**kw):
    from flexfloor.rollout.engine import StepReport

    return StepReport(finished=0, tokens=0, requests=0, **kw)


def test_a_rollout_outside_the_history_proves_it_wrong_and_the_verdict_is_saved():
    """`record_rollout` judges the history by the rollout's lengths before recording them: more
    than a tenth of 16+ samples outside their prompt's last range (widened by a quarter) prove
    it wrong; a later rollout that keeps to the (new) history clears the verdict; checkpoints
    keep it, and one saved before it existed loads as not proved wrong."""
    h = LengthHistory()
    h.record_rollout({u: [100, 120] for u in range(10)})
    assert not h.proved_wrong  # no history to judge
    h.record_rollout({u: [110, 118] for u in range(10)})
    assert not h.proved_wrong  # within 100 / 1.25 .. 120 * 1.25
    h.record_rollout({u: [110, 400 if u < 3 else 118] for u in range(10)})
    assert h.proved_wrong  # 3 of 20 samples past 118 * 1.25
    assert LengthHistory.from_state_dict(h.state_dict()).proved_wrong
    old = h.state_dict()
    del old["proved_wrong"]
    assert not LengthHistory.from_state_dict(old).proved_wrong
    h.record_rollout({u: [110, 400 if u < 3 else 118] for u in range(10)})
    assert not h.proved_wrong  # the same lengths again: the history now holds


def test_a_predictor_that_does_not_trust_history_uses_siblings_and_the_prior():
    h = LengthHistory()
    h.record(1, [10, 30])
    h.record(2, [50, 70])
    p = Predictor(h, prior_quantile=0.5, trust_history=False)
    assert p.predict(1) == (h.quantile(0.5), "prior")
    assert p.predict(1, siblings=[12, 14]) == (14, "siblings")
    assert p.running(1, [12, 14], produced=20) == 14.0
    assert Predictor(h).running(1, [12, 14], produced=20) == 30.0


@pytest.mark.parametrize("replicas,step_cost", [(None, None), ([(0, 1), (2, 3)], None),
                                                ([(0, 1), (2, 3)], lambda n, ctx: 1.0 + 0.01 * n),
                                                ([(0, 1, 2, 3)], lambda n, ctx: 1.0 + 0.01 * n)])
def test_after_a_rollout_that_proved_history_wrong_the_plan_is_statics(replicas, step_cost):
    """By modelled seconds FlexFloor packs the long work by history; once the last rollout
    proved that history wrong (`LengthHistory.proved_wrong`) it places as static does (least
    outstanding requests over the replicas, then the ranks), with no end to keep, and says so
    (`distrusted`); `distrust_wrong_history=False` packs anyway. By predicted steps (no step
    cost) it packs whatever the verdict."""
    from flexfloor.rollout.replicas import route_least_outstanding

    lengths = {0: 5, 1: 80, 2: 10, 3: 40, 4: 20, 5: 160, 6: 15, 7: 30}
    gs = groups(lengths)
    groups_of = [tuple(range(4))] if replicas is None else replicas
    static = route_least_outstanding(gs, groups_of)
    ids = lambda a: {r: [q.request_id for q in reqs] for r, reqs in a.items()}  # noqa: E731
    priced = step_cost is not None
    for wrong, distrust in ((False, True), (True, True), (True, False)):
        h = history(lengths)
        h.proved_wrong = wrong
        sched = Scheduler(PlacementPolicy.FLEXFLOOR, history=h, distrust_wrong_history=distrust)
        plan = sched.plan(gs, range(4), replicas=replicas, step_cost=step_cost)
        placed = sorted(q.request_id for reqs in plan.assignment.values() for q in reqs)
        assert placed == sorted(q.request_id for g in gs for q in g.requests)
        assert plan.distrusted == (priced and wrong and distrust)
        assert (ids(plan.assignment) == ids(static)) == (priced and wrong and distrust)
        assert (plan.finish_bound is None) == (priced and wrong and distrust)
        assert plan.predicted[5] == 160 and plan.sources["history"] == 8  # still reported
        assert set(plan.expected_finish) == {0, 1, 2, 3}


def test_a_plan_by_modelled_seconds_is_the_simulators_plan_and_its_end_in_seconds():
    """scheduler.plan_seconds: the job's plan (`coordinator.plan_rollout`) with the step cost
    `elastic.plan_step_cost` makes of a replica's placement is the plan the simulator makes
    (`rank_step_cost` over the placement stretched to the cost model's experts). Its bound is
    static's predicted end in modelled seconds, the end the correction keeps
    (`tails.end_to_keep`) on the replicas' modelled clocks."""
    from flexfloor.config import ReleasePolicy
    from flexfloor.coordinator import plan_rollout
    from flexfloor.rollout.elastic import plan_step_cost
    from flexfloor.rollout.tails import end_to_keep
    from flexfloor.sim.cost import cost_model, model_owner
    from flexfloor.sim.scenarios import rank_step_cost
    from megatron_ext.placement import Placement

    lengths = {0: 5, 1: 80, 2: 10, 3: 40, 4: 20, 5: 160, 6: 15, 7: 30}
    gs = groups(lengths, n=4)
    replicas = [(0, 1), (2, 3)]
    first = Placement(owner=(0, 0, 0, 0, 1, 1, 1, 1), ranks=(0, 1))  # the engine's 8 experts
    cost = cost_model("H800", "qwen3-30b-a3b")  # 128 experts
    ids = lambda a: {r: [q.request_id for q in reqs] for r, reqs in a.items()}  # noqa: E731

    def plan(step_cost):
        return plan_rollout(Scheduler(PlacementPolicy.FLEXFLOOR, history=history(lengths)), gs,
                            policy=ReleasePolicy.ELASTIC, replicas=replicas, step_cost=step_cost)

    by_seconds, by_steps = plan(plan_step_cost(cost, first, 64)), plan(None)
    stretched = Placement(owner=tuple(model_owner(first.owner, cost)), ranks=(0, 1))
    sim = Scheduler(PlacementPolicy.FLEXFLOOR, history=history(lengths)).plan(
        gs, range(4), replicas=replicas, step_cost=rank_step_cost(cost, stretched, (0, 1), 64))
    assert len(stretched.owner) == 128 and stretched.owner.count(0) == 64
    assert ids(by_seconds.assignment) == ids(sim.assignment)
    assert by_seconds.finish_bound == sim.finish_bound
    assert by_seconds.by_seconds and not by_steps.by_seconds
    # the longest prompt's 160 steps bound the plan by steps; at milliseconds a step on an H800
    # the same rollout is a few seconds
    assert by_steps.finish_bound >= 160 and 0 < by_seconds.finish_bound < 16
    assert end_to_keep(by_steps) == by_steps.finish_bound
    assert end_to_keep(by_seconds) == by_seconds.finish_bound
