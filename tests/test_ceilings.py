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


def test_the_kv_bound_counts_whole_blocks_where_traced():
    """A paged pool holds whole blocks: where the traces count them the bound is in blocks
    (the budget's whole blocks to a rank-step), the bound in tokens kept beside it."""
    def rank(steps, busy, kv, blocks):
        return {"steps": steps, "busy_steps": busy,
                "trace": {"kv_tokens": kv, "kv_blocks": blocks, "block_tokens": 16}}

    static = [rank(4, 4, [10, 20, 30, 40], [1, 2, 2, 3]), rank(4, 2, [15, 25, 0, 0], [1, 2, 0, 0])]
    elastic = [rank(4, 4, [10, 20, 30, 40], [1, 2, 2, 3]), rank(2, 2, [15, 25], [1, 2])]
    c = ceilings({"static": static, "elastic": elastic}, kv_budget_tokens=50)  # 3 blocks of 16
    assert c["kv_block_use"] == {"static": 11 / (3 * 8), "elastic": 11 / (3 * 6)}
    assert c["kv_bound_step_ratio"] == 8 / math.ceil(11 / 3)
    assert c["kv_token_bound_step_ratio"] == 8 / math.ceil(140 / 50)
    assert c["kv_pool_use"] == {"static": 140 / (50 * 8), "elastic": 140 / (50 * 6)}


def test_a_step_trace_counts_each_requests_context_in_whole_blocks():
    from flexfloor.rollout.types import StepTrace

    t = StepTrace(block_tokens=4)
    t.add_step([(0, 5), (7, 1), (3, 1)], experts_touched=2)  # 5, 8 and 4 tokens: 2 + 2 + 1
    assert (t.kv_tokens, t.kv_blocks) == ([17], [5])
    untraced = StepTrace()
    untraced.add_step([(0, 5)], experts_touched=1)
    assert untraced.kv_blocks == []


def test_the_ceilings_line_names_the_kv_bound_only_where_static_and_elastic_ran():
    from tools.bench_rollout import ceilings_line

    def rank(steps, busy, kv, blocks):
        return {"steps": steps, "busy_steps": busy,
                "trace": {"kv_tokens": kv, "kv_blocks": blocks, "block_tokens": 16}}

    static = [rank(4, 4, [10, 20, 30, 40], [1, 2, 2, 3]), rank(4, 2, [15, 25, 0, 0], [1, 2, 0, 0])]
    alone = ceilings({"static": static, "replica_release": static}, kv_budget_tokens=50)
    assert "kv_block_use" in alone and "kv_bound_step_ratio" not in alone
    assert ceilings_line(alone) == ("ceilings (step ratio vs static): 1.33 releasing static's "
                                    "ranks at their own last response")
    both = ceilings({"static": static, "elastic": static}, kv_budget_tokens=50)
    assert ceilings_line(both).endswith(
        ", 2.00 with every rank-step's KV pool full of blocks (block use: static 0.46, elastic "
        "0.46; 2.67 counting tokens, which a pool of blocks cannot hold)")
    assert ceilings_line({}) is None
