"""Scheduler: history, prediction, memory model and placement on hand-made cases (pure)."""


import pytest

from flexfloor.config import ModelConfig, PlacementPolicy
from flexfloor.rollout.scheduler import (
    LengthHistory, MemoryModel, PromptGroup, Predictor, Scheduler, prediction_accuracy,
    _profile_by_events, rank_profile, simulate_rank_steps,
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
