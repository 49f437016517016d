"""Placement functions: pure, no process groups."""

import random

import pytest

from megatron_ext.placement import (
    Placement, Transfer, balanced_placement, contiguous_placement, floor_size, initial_placement,
    plan_shrink,
)


def check(placement, ranks):
    assert placement.ranks == tuple(sorted(ranks))
    assert set(placement.owner) <= set(ranks)  # every expert on exactly one active rank


def test_contiguous_matches_megatron_layout():
    p = contiguous_placement(8, [0, 1, 2, 3])
    assert p.owner == (0, 0, 1, 1, 2, 2, 3, 3)
    assert [p.experts_of(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="do not split evenly"):
        contiguous_placement(8, [0, 1, 2])


def test_balanced_handles_sizes_megatron_cannot():
    assert balanced_placement(8, [0, 1, 2]).owner == (0, 0, 0, 1, 1, 1, 2, 2)
    assert balanced_placement(6, [0, 1, 2, 3]).owner == (0, 0, 1, 1, 2, 3)
    assert balanced_placement(8, [0, 1, 2, 3]) == contiguous_placement(8, [0, 1, 2, 3])
    with pytest.raises(ValueError):
        balanced_placement(2, [0, 1, 2])


def test_shrink_moves_only_leavers_experts_and_balances():
    p = contiguous_placement(8, [0, 1, 2, 3])
    new, transfers = plan_shrink(p, [3])
    check(new, [0, 1, 2])
    assert transfers == [Transfer(6, 3, 0), Transfer(7, 3, 1)]
    assert sorted(len(new.experts_of(r)) for r in new.ranks) == [2, 3, 3]
    for e in range(6):  # survivors keep what they had
        assert new.owner[e] == p.owner[e]


def test_shrink_respects_capacity_and_reports_the_floor():
    p = contiguous_placement(8, [0, 1, 2, 3])
    new, _ = plan_shrink(p, [2, 3], capacity={0: 5, 1: 3})
    assert len(new.experts_of(0)) == 5 and len(new.experts_of(1)) == 3
    with pytest.raises(ValueError, match="floor"):
        plan_shrink(p, [1, 2, 3], capacity={0: 7})
    assert floor_size(8, 3) == 3 and floor_size(8, 8) == 1


def test_shrink_prefers_survivors_that_already_hold_the_weights():
    hosting = {0: [0, 1, 2], 1: [3, 4, 5], 2: [0, 1, 2], 3: [3, 4, 5]}  # 6 experts, training EP=2
    p = initial_placement(6, hosting)
    assert p.owner == (0, 2, 0, 1, 3, 1)
    new, transfers = plan_shrink(p, [3], holding=hosting)
    assert transfers == []  # rank 1 holds expert 4 already
    assert new.owner[4] == 1


@pytest.mark.parametrize("seed", range(20))
def test_property_random_shrinks(seed):
    rng = random.Random(seed)
    experts, world = rng.choice([(8, 4), (6, 4), (16, 8), (7, 3), (12, 5)])
    p = balanced_placement(experts, range(world))
    while len(p.ranks) > 1:
        k = rng.randint(1, len(p.ranks) - 1)
        leaving = rng.sample(list(p.ranks), k)
        new, transfers = plan_shrink(p, leaving)
        again = plan_shrink(p, list(reversed(leaving)))
        assert (new, transfers) == again  # deterministic: the same plan on every rank
        survivors = [r for r in p.ranks if r not in leaving]
        check(new, survivors)
        for r in leaving:
            assert new.experts_of(r) == []  # leavers own nothing
        moved = {t.expert for t in transfers}
        assert moved == {e for e in range(experts) if p.owner[e] in leaving}  # only theirs move
        for t in transfers:
            assert t.src in leaving and t.dst in survivors and new.owner[t.expert] == t.dst
        counts = [len(new.experts_of(r)) for r in survivors]
        before = [len(p.experts_of(r)) for r in survivors]
        assert max(counts) - min(counts) <= max(1, max(before) - min(before))
        p = new


def test_placement_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="outside the group"):
        Placement(owner=(0, 5), ranks=(0, 1))
    with pytest.raises(ValueError, match="not in the EP group"):
        plan_shrink(contiguous_placement(4, [0, 1]), [7])
    with pytest.raises(ValueError, match="cannot leave"):
        plan_shrink(contiguous_placement(4, [0, 1]), [0, 1])
