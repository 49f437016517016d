"""The benchmark's ceilings: what no release policy can beat on a run, from its own records."""

import math

from tools.bench_rollout import ceilings


def _rank(steps, busy, kv):
    return {"steps": steps, "busy_steps": busy, "trace": {"kv_tokens": kv}}


def test_release_only_and_kv_bound_come_from_the_records():
    # static: 2 ranks held 4 steps, busy 4 and 2; elastic: the same cached tokens, fewer steps
    static = [_rank(4, 4, [10, 20, 30, 40]), _rank(4, 2, [15, 25, 0, 0])]
    elastic = [_rank(4, 4, [10, 20, 30, 40]), _rank(2, 2, [15, 25])]
    c = ceilings({"static": static, "elastic": elastic}, kv_budget_tokens=50)
    assert c["release_only_step_ratio"] == 8 / 6
    assert c["kv_pool_use"] == {"static": 140 / (50 * 8), "elastic": 140 / (50 * 6)}
    # 140 cached tokens need at least ceil(140 / 50) = 3 full rank-steps
    assert c["kv_bound_step_ratio"] == 8 / math.ceil(140 / 50)


def test_no_kv_budget_no_kv_bound():
    static = [_rank(3, 1, [1, 0, 0])]
    c = ceilings({"static": static, "elastic": static}, kv_budget_tokens=None)
    assert c == {"release_only_step_ratio": 3.0}
