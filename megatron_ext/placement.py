"""Expert placement as data: which rank hosts which expert, computed by pure functions.

A `Placement` maps every expert to exactly one rank of the active EP group. It is a plain value:
every rank computes the same one from the same inputs, and it is tested without process groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Placement:
    """expert id -> global rank, over the active ranks (sorted)."""

    owner: tuple[int, ...]  # owner[e] = global rank hosting expert e
    ranks: tuple[int, ...]  # the active EP group, sorted global ranks

    def __post_init__(self):
        missing = sorted(set(self.owner) - set(self.ranks))
        if missing:
            raise ValueError(f"placement puts experts on ranks {missing} outside the group {self.ranks}")
        if list(self.ranks) != sorted(set(self.ranks)):
            raise ValueError(f"placement ranks must be sorted and unique, got {self.ranks}")

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    def experts_of(self, rank: int) -> list[int]:
        """The experts `rank` hosts, ascending."""
        return [e for e, r in enumerate(self.owner) if r == rank]

    def group_index(self, rank: int) -> int:
        """Position of `rank` in the group (its rank within the EP process group)."""
        return self.ranks.index(rank)

    def as_dict(self) -> dict:
        return {"ranks": list(self.ranks), "owner": list(self.owner)}


def contiguous_placement(num_experts: int, ranks: Sequence[int]) -> Placement:
    """Megatron-Core's training layout: EP rank i hosts experts [i*n, (i+1)*n), n = E / |ranks|."""
    ranks = tuple(sorted(ranks))
    if not ranks:
        raise ValueError("an EP group needs at least one rank")
    if num_experts % len(ranks):
        raise ValueError(
            f"{num_experts} experts do not split evenly over {len(ranks)} ranks in the contiguous "
            "(training) layout; use balanced_placement for other sizes"
        )
    per = num_experts // len(ranks)
    return Placement(owner=tuple(ranks[e // per] for e in range(num_experts)), ranks=ranks)


@dataclass(frozen=True)
class Transfer:
    """Move expert `expert` (all layers) from global rank `src` to global rank `dst`."""

    expert: int
    src: int
    dst: int


def balanced_placement(num_experts: int, ranks: Sequence[int]) -> Placement:
    """Experts in contiguous blocks whose sizes differ by at most one (8 on 3 ranks: 3, 3, 2).

    Equals `contiguous_placement` whenever that one exists, so the training layout is a special
    case; handles the sizes the stock Megatron layout cannot.
    """
    ranks = tuple(sorted(ranks))
    if not ranks:
        raise ValueError("an EP group needs at least one rank")
    if num_experts < len(ranks):
        raise ValueError(f"{num_experts} experts cannot give each of {len(ranks)} ranks one")
    base, extra = divmod(num_experts, len(ranks))
    owner = []
    for i, r in enumerate(ranks):
        owner += [r] * (base + (1 if i < extra else 0))
    return Placement(owner=tuple(owner), ranks=ranks)


def initial_placement(num_experts: int, hosting: dict[int, Sequence[int]]) -> Placement:
    """A rollout placement over every rank in `hosting` (rank -> experts whose weights it holds,
    e.g. its training shard), each expert on one of its holders, experts per rank balanced.

    With the training layout at EP = world this is Megatron's contiguous layout; with a smaller
    training EP size (experts replicated over expert-data-parallel ranks) the rollout still uses
    every rank, and each rank serves experts it already holds: no transfer.
    """
    ranks = tuple(sorted(hosting))
    load = {r: 0 for r in ranks}
    owner = []
    for e in range(num_experts):
        holders = [r for r in ranks if e in set(hosting[r])]
        if not holders:
            raise ValueError(f"expert {e} is held by no rank: the EP layout does not cover the model")
        dst = min(holders, key=lambda r: (load[r], r))
        owner.append(dst)
        load[dst] += 1
    return Placement(owner=tuple(owner), ranks=ranks)


def plan_shrink(
    placement: Placement,
    leaving: Sequence[int],
    *,
    capacity: dict[int, int] | None = None,
    holding: dict[int, Sequence[int]] | None = None,
) -> tuple[Placement, list[Transfer]]:
    """The placement after `leaving` ranks release, and the expert transfers that get there.

    Only the leavers' experts move. Each goes, among survivors below their `capacity` (max experts
    a rank can host, from the memory model; None = unbounded), to one that already holds its
    weights (`holding`: rank -> experts in its memory; no bytes move), else to the survivor hosting
    the fewest experts at that moment (ties: lowest rank). No plan moves fewer bytes. Pure and
    deterministic: every rank computes the same plan from the same inputs.
    """
    leaving_set = set(leaving)
    unknown = sorted(leaving_set - set(placement.ranks))
    if unknown:
        raise ValueError(f"ranks {unknown} are not in the EP group {placement.ranks}")
    survivors = [r for r in placement.ranks if r not in leaving_set]
    if not survivors:
        raise ValueError("every rank of the EP group cannot leave: someone must hold the experts")
    capacity = capacity or {}
    hosted = Counter(placement.owner)
    load = {r: hosted[r] for r in survivors}
    for r in survivors:
        if r in capacity and load[r] > capacity[r]:
            raise ValueError(f"rank {r} already hosts {load[r]} experts, over its capacity {capacity[r]}")
    held = {r: set((holding or {}).get(r, ())) for r in survivors}
    limit = {r: capacity.get(r, placement.num_experts) for r in survivors}
    owner = list(placement.owner)
    transfers = []
    for expert, src in enumerate(placement.owner):
        if src not in leaving_set:
            continue
        # the survivor with room hosting the fewest (ties: lowest rank; `survivors` ascend),
        # among those holding the expert's weights first
        fewest = holder = None
        for r in survivors:
            if load[r] >= limit[r]:
                continue
            if fewest is None or load[r] < load[fewest]:
                fewest = r
            if expert in held[r] and (holder is None or load[r] < load[holder]):
                holder = r
        if fewest is None:
            raise ValueError(
                f"survivors {survivors} cannot host expert {expert}: every one is at its capacity "
                f"{[capacity.get(r) for r in survivors]} experts; the floor is reached, fewer ranks "
                "may leave"
            )
        dst = fewest if holder is None else holder
        owner[expert] = dst
        load[dst] += 1
        if holder is None:
            transfers.append(Transfer(expert=expert, src=src, dst=dst))
    return Placement(owner=tuple(owner), ranks=tuple(survivors)), transfers


def floor_size(num_experts: int, max_experts_per_rank: int) -> int:
    """The fewest ranks that can host every expert when each holds at most `max_experts_per_rank`."""
    if max_experts_per_rank < 1:
        raise ValueError("a rank must be able to host at least one expert")
    return -(-num_experts // max_experts_per_rank)
