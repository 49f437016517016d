"""Engine replicas on 4 real gloo workers (one torchrun launch): every mode of the benchmark gives
the same tokens at R = 1 and R = 2, greedy and sampled; a replica done is released whole; the
elastic policy shrinks inside each replica; the experts a replica placement borrows are fetched
at start and dropped at resync. Plus the pure pieces: the replica placement and the config check."""

import pytest

from distributed import Worker
from flexfloor.config import Config
from flexfloor.rollout.replicas import (
    MODES, held_to_end, replica_placement, replica_ranks,
)

R2 = [[0, 1], [2, 3]]
WORKER = Worker("replicas.py", 4, timeout=500)  # shares the session's 4-worker launch


@pytest.fixture(scope="module")
def res(shared):
    return shared.run(WORKER).results


def tokens(parts, mode):
    return {rid: t for p in parts for rid, t in p[mode]["tokens"].items()}


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_tokens_identical_across_replicas_and_modes(res, kind):
    parts = res[kind]
    want = tokens(parts, "single_group")  # R = 1
    assert sorted(want) == sorted(f"{u}/{s}" for u in range(6) for s in range(2))
    assert all(len(t) > 0 for t in want.values())
    for mode in [*MODES, "r1_elastic"]:
        assert tokens(parts, mode) == want, mode


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_replica_done_is_released_whole(res, kind):
    parts = res[kind]
    for mode in ("replica_release", "static"):
        steps = [p[mode]["record"]["steps"] for p in parts]
        # lockstep inside a replica; replica 0 got the short samples and left first
        assert steps[0] == steps[1] and steps[2] == steps[3] and steps[0] < steps[2], (mode, steps)
        assert [p[mode]["record"]["release_step"] for p in parts] == steps  # left at its end
        assert all(p[mode]["timeline"] == [] for p in parts)  # no shrink: whole replicas
    # the world-wide group steps together to the end
    assert len({p["single_group"]["record"]["steps"] for p in parts}) == 1
    # the hold rule (the simulator's): every rank occupied to the slowest replica's end
    held = held_to_end([p["static"]["record"] for p in parts])
    assert {r["steps"] for r in held} == {max(p["static"]["record"]["steps"] for p in parts)}


def test_each_replica_shrinks_inside_itself(res):
    parts = res["shrink"]
    assert tokens(parts, "elastic") == tokens(parts, "static")
    lines = [[(t["leaving"], t["active"]) for t in p["elastic"]["timeline"] if "leaving" in t]
             for p in parts]
    assert lines[0] == [([1], [0])] and lines[2] == [([3], [2])]
    assert lines[1] == [([1], [0])] and lines[3] == [([3], [2])]  # a leaver sees its own shrink
    steps = [p["elastic"]["record"]["steps"] for p in parts]
    assert steps[1] < steps[0] and steps[3] < steps[2]
    # every leaver heard its release, once, at its shrink's step, and its rejoin at resync
    for r in (1, 3):
        assert parts[r]["elastic"]["events"] == [["released", steps[r]], ["rejoined", -1]]
    # the replica that ended first left whole while the other decoded: its survivor was
    # released (timeline, listener) as a leaver is; the last one to end was not
    left = [[t for t in parts[r]["elastic"]["timeline"] if "replica_left" in t] for r in (0, 2)]
    assert sorted(map(len, left)) == [0, 1], left
    first = 0 if left[0] else 2
    assert left[first // 2][0]["replica_left"] == [first]
    assert left[first // 2][0]["step"] == steps[first]
    assert parts[first]["elastic"]["events"] == [["released", steps[first]], ["rejoined", -1]]
    assert parts[2 - first]["elastic"]["events"] == [["rejoined", -1]]
    # the survivor groups were planned per replica: none created while decoding
    assert all(p["elastic"]["groups"]["groups_created_during_rollout"] == 0 for p in parts)


def test_borrowed_experts_fetched_at_start_and_dropped_at_resync(res):
    parts = res["greedy"]
    own = res["own_experts"]  # rank 0's training shard (EP 4: 2 experts)
    placements = res["replica_placements"]
    assert [p["ranks"] for p in placements] == R2
    for rank, p in enumerate(parts):
        view = p["static"]
        replica = placements[rank // 2]
        mine = sorted(e for e, r in enumerate(replica["owner"]) if r == rank)
        assert len(mine) == 4  # 8 experts over a replica of 2
        assert view["during"]["group"] == R2[rank // 2]
        assert all(set(mine) <= set(layer) for layer in view["during"]["hosted"])
        assert view["start"]["received"] == 2  # the two its shard of 2 lacks
        # back to the training placement: own experts only, the world-wide group
        assert view["after"]["group"] == [0, 1, 2, 3]
        assert view["after"]["placement"] == res["world_placement"]
        assert all(len(layer) == 2 for layer in view["after"]["hosted"])
        # R = 1 (single group) fetches nothing
        assert p["single_group"]["start"]["received"] == 0
        assert p["single_group"]["during"]["group"] == [0, 1, 2, 3]
    assert all(len(layer) == 2 for layer in parts[0]["static"]["after"]["hosted"])
    assert parts[0]["static"]["after"]["hosted"][0] == own
    assert all(res["logits_unchanged"])


def test_replicas_refuse_without_start_and_a_bad_count(res):
    assert "layout.start(moe)" in res["no_start"]
    assert "rollout.replicas=3" in res["bad_replicas"] and "[1, 2, 4]" in res["bad_replicas"]


def test_replica_placement_borrows_what_the_shard_lacks():
    shards = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    placement, transfers = replica_placement(8, (0, 1), shards)
    assert placement.experts_of(0) == [0, 1, 4, 6] and placement.experts_of(1) == [2, 3, 5, 7]
    assert [(t.expert, t.src, t.dst) for t in transfers] == [
        (4, 2, 0), (5, 2, 1), (6, 3, 0), (7, 3, 1)]
    # a shard that already holds the replica's experts moves nothing (training EP = 2)
    placement, transfers = replica_placement(8, (2, 3), {0: [0, 1, 2, 3], 1: [4, 5, 6, 7],
                                                         2: [0, 1, 2, 3], 3: [4, 5, 6, 7]})
    assert transfers == [] and placement.experts_of(2) == [0, 1, 2, 3]
    assert replica_ranks(4, 2) == [(0, 1), (2, 3)] and replica_ranks(4, 1) == [(0, 1, 2, 3)]
    with pytest.raises(ValueError, match="rollout.replicas=3"):
        replica_ranks(4, 3)


def test_config_checks_replicas_against_the_world():
    cfg = Config()
    cfg.rollout.replicas = 2
    cfg.resolve_world(4)  # fits
    with pytest.raises(ValueError, match="rollout.replicas"):
        cfg.resolve_world(3)
    cfg.elastic.min_active_ranks = 3
    with pytest.raises(ValueError, match="elastic.min_active_ranks"):
        cfg.resolve_world(4)


def test_the_stack_hands_its_config_sections_to_each_rollout(res):
    got = res["stack_configs"]
    assert got["elastic"] == {"membership": "ElasticMembership", "step": 7, "min_active_ranks": 3,
                              "check_interval_steps": 4, "migrate_max_requests": 5}
    assert got["static"]["membership"] == "StaticMembership"


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_the_jobs_static_policy_is_the_baseline_step_for_step(res, kind):
    """elastic.release_policy=static in the job (its plan and its section's policy): the
    benchmark's `static` mode: least-outstanding routing over the replicas whatever
    scheduler.placement, every rank held to its replica's end, nothing consolidated."""
    parts = res[kind]
    assert tokens(parts, "job_static") == tokens(parts, "single_group")
    for p in parts:
        job, static = p["job_static"], p["static"]
        assert job["membership"] == "ReplicaStaticMembership"
        assert sorted(job["tokens"]) == sorted(static["tokens"])  # the same requests per rank
        assert job["record"]["steps"] == static["record"]["steps"]
        assert job["record"]["release_step"] == job["record"]["steps"]  # held to its end
        assert job["timeline"] == [] and job["record"]["trace"]["moves"] == []
    assert [p["job_static"]["record"]["steps"] for p in parts] != [
        p["elastic"]["record"]["steps"] for p in parts]  # not FlexFloor's placement


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_the_jobs_default_consolidates_inside_replicas_with_the_same_tokens(res, kind):
    """The default elastic section (tail consolidation on) on FlexFloor's placement: requests
    move inside a replica, the tokens stay, the givers leave earlier than under the paper's
    release alone (mode `elastic` here, consolidation off) and no replica ends later."""
    parts = res[kind]
    assert tokens(parts, "job_default") == tokens(parts, "single_group")
    recs = [p["job_default"]["record"] for p in parts]
    moved = [m for r in recs for m in r["trace"]["moves"] if m["src"] == r["rank"]]
    assert moved and not any(m["across"] for m in moved)
    assert all(m["src"] // 2 == m["dst"] // 2 for m in moved)
    assert sum(r["migrated_out"] for r in recs) == sum(r["adopted"] for r in recs) == len(moved)
    paper = [p["elastic"]["record"]["steps"] for p in parts]
    steps = [r["steps"] for r in recs]
    assert sum(steps) < sum(paper)
    assert [max(steps[:2]), max(steps[2:])] == [max(paper[:2]), max(paper[2:])]
