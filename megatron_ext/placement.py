"""Expert placement as data: which rank hosts which expert, computed by pure functions.

A `Placement` maps every expert to exactly one rank of the active EP group. It is a plain value:
every rank computes the same one from the same inputs, and it is tested without process groups.
"""

from __future__ import annotations

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
