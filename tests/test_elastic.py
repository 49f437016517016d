"""Elastic EP on 4 real gloo workers: static and elastic rollouts give identical tokens for shrink
sequences the stock Megatron layout cannot express, with 8 and 6 experts; resync restores the
training layout; released ranks take no further step. One torchrun launch, shared with the
session's other 4-worker modules (distributed.SharedLaunches)."""

import pytest

from distributed import Worker

WORKER = Worker("elastic.py", 4, timeout=400)
SEQUENCES = {"4-2-1": [2, 1], "4-3-1": [3, 1], "4-3-2-1": [3, 2, 1]}


@pytest.fixture(scope="module")
def res(shared):
    return shared.run(WORKER).results


def tokens(parts, policy):
    return {rid: t for p in parts for rid, t in p[policy]["tokens"].items()}


@pytest.mark.parametrize("experts", [8, 6])
@pytest.mark.parametrize("seq", list(SEQUENCES))
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_elastic_tokens_identical_to_static(res, experts, seq, kind):
    parts = res[f"e{experts}_{seq}_{kind}"]
    static, elastic = tokens(parts, "static"), tokens(parts, "elastic")
    # every prompt gets exactly its responses: 3 per rank, none lost or duplicated
    assert sorted(static) == sorted(f"{r * 10 + i}/0" for r in range(4) for i in range(3))
    assert sorted(elastic) == sorted(static)
    assert elastic == static
    # the group really shrank as planned
    timeline = parts[0]["elastic"]["timeline"]
    assert [len(t["active"]) for t in timeline] == SEQUENCES[seq]
    # every rank saw the same plan up to its own release (a leaver sees no later shrink)
    plan = [(t["step"], t["leaving"], t["active"]) for t in timeline]
    for p in parts:
        mine = [(t["step"], t["leaving"], t["active"]) for t in p["elastic"]["timeline"]]
        assert mine and mine == plan[: len(mine)]
        # the survivor groups were built ahead from the plan: none created while decoding
        assert p["groups"]["groups_created_during_rollout"] == 0
        assert len(p["groups"]["switch_s_per_shrink"]) == len(mine)


@pytest.mark.parametrize("experts", [8, 6])
def test_released_ranks_take_no_further_step(res, experts):
    parts = res[f"e{experts}_4-3-2-1_greedy"]
    longest = [40, 30, 20, 10]
    for rank, p in enumerate(parts):
        el, st = p["elastic"]["record"], p["static"]["record"]
        assert st["steps"] == 40  # static: every rank to the end
        assert el["steps"] == longest[rank]  # elastic: a rank stops stepping at its release
        assert el["release_step"] == el["steps"]
        if rank > 0:
            assert el["release_s"] < parts[0]["elastic"]["record"]["release_s"]
    assert sum(p["elastic"]["record"]["steps"] for p in parts) == 100  # vs 160 occupied steps


def test_transfers_move_only_what_survivors_lack(res):
    # 8 experts, training EP=4: every leaver's experts move; 6 experts at training EP=2: a
    # survivor often holds the leaver's experts already, so fewer bytes move
    e8 = sum(p["elastic"]["record"]["sent_bytes"] for p in res["e8_4-3-2-1_greedy"])
    e6 = sum(p["elastic"]["record"]["sent_bytes"] for p in res["e6_4-3-2-1_greedy"])
    assert e8 > 0 and e6 < e8
    assert res["e6_initial_placement"]["owner"] == [0, 2, 0, 1, 3, 1]


@pytest.mark.parametrize("experts", [8, 6])
def test_resync_restores_training_logits(res, experts):
    assert res[f"e{experts}_resync_logits_equal"] == [True] * 4


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_migrating_last_requests_keeps_tokens_and_releases_sooner(res, dtype):
    parts = res[f"migrate_{dtype}"]
    static, elastic = tokens(parts, "static"), tokens(parts, "elastic")
    assert sorted(elastic) == sorted(static) and elastic == static  # re-prefilled, same stream
    timeline = parts[0]["elastic"]["timeline"]
    assert timeline[0]["migrated"] == {"1": 0, "2": 0, "3": 0}  # all hand over to rank 0
    steps = [p["elastic"]["record"]["steps"] for p in parts]
    assert steps[0] == 40 and max(steps[1:]) < 10  # without migration: 30, 20, 10
    assert parts[0]["elastic"]["record"]["adopted"] == 6


def test_the_pace_rule_refuses_slower_shrinks_and_never_with_unit_cost(res):
    """elastic.pace_model in the engine (4-3-2-1, greedy): with unit cost the shrinks of the
    rule-free rollout, none refused; priced as qwen3-30b-a3b on H800, a shrink leaves survivors
    reading more expert weights per step, later to their end: refused. Tokens as static's
    either way."""
    def shrinks(parts):
        return [(t["step"], t["leaving"]) for t in parts[0]["elastic"]["timeline"]]

    free, unit, h800 = (res[k] for k in ("e8_4-3-2-1_greedy", "paced_unit", "paced_H800"))
    for parts in (unit, h800):
        assert tokens(parts, "elastic") == tokens(parts, "static") == tokens(free, "static")
    assert shrinks(unit) == shrinks(free) and len(shrinks(free)) == 3
    assert all(p["paced_refusals"] == 0 for p in unit)
    # refused at every rank until late (a lone survivor with its last request, no all-to-all
    # left, may then go faster): fewer shrinks, every done rank held longer
    assert len(shrinks(h800)) < 3 and all(p["paced_refusals"] > 0 for p in h800)
    steps = lambda parts: [p["elastic"]["record"]["steps"] for p in parts]
    assert all(a > b for a, b in zip(steps(h800)[1:], steps(free)[1:])), (steps(h800), steps(free))


def test_memory_floor_stops_the_shrink_and_keeps_tokens(res):
    parts = res["memory_floor"]
    assert tokens(parts, "elastic") == tokens(parts, "static")
    timeline = parts[0]["elastic"]["timeline"]
    # survivors' free KV room holds about two borrowed experts each: 4 -> 3 -> 2, then the floor
    assert [t["active"] for t in timeline] == [[0, 1, 2], [0, 1]]
    assert [p["elastic"]["record"]["steps"] for p in parts] == [40, 40, 20, 10]
    assert parts[1]["elastic"]["record"]["floor_hits"] > 0  # rank 1 asked to leave, and stayed
