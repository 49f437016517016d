"""Rollout topology: R engine replicas, each one EP group of world / R ranks holding every expert.

Users deploy rollout as several replicas (one EP group per node, say) and route each sample to
the replica with the fewest outstanding requests. `ReplicaTopology` is that layout as a value,
built once per job, collectively: the replica groups (consecutive ranks: replica i holds ranks
i*n .. (i+1)*n - 1, n = world / R), each replica's expert placement and the expert transfers that
fill it. The training layout is independent: a rank's training shard may hold fewer experts than
its replica placement assigns it, so at every rollout start it borrows the others from a rank
that holds them (`megatron_ext.resharding.transfer_experts`), and resync drops them. Inside a
replica, release, shrink and migration work as in one world-wide group; a replica whose requests
are done leaves the rollout whole.

The placement of each mode (`Mode`), shared by the benchmark and the simulator:
- `static`: verl today: each sample routed to the replica, then the rank, with the fewest
  outstanding requests at submission (`route_least_outstanding`), every rank held to the end;
- `static_chunks`: verl's legacy SPMD split: equal contiguous chunks over the ranks, all held;
- `replica_release`: as `static`, but a replica is released when its own requests are done;
- `single_group`: one world-wide EP group, contiguous chunks, all held (the paper's setting);
- `elastic`: FlexFloor's placement over every rank, release inside each replica.
R = 1 is one world-wide group: the topology is the rollout layout of today, with no transfer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from megatron_ext.placement import Placement, Transfer

if TYPE_CHECKING:  # the modes and pure decisions import without torch (the benchmark's parent)
    import torch.distributed as dist

    from flexfloor.rollout.types import Request

Ranks = tuple[int, ...]  # sorted global ranks


class Mode(enum.Enum):
    STATIC = "static"
    STATIC_CHUNKS = "static_chunks"
    REPLICA_RELEASE = "replica_release"
    SINGLE_GROUP = "single_group"
    ELASTIC = "elastic"


MODES = [m.value for m in Mode]
BASELINES = [m for m in MODES if m != Mode.ELASTIC.value]
HELD = {Mode.STATIC, Mode.STATIC_CHUNKS, Mode.SINGLE_GROUP}  # every rank to the rollout's end


# --------------------------------------------------------------------------------------------
# pure decisions (no process group)


def replica_ranks(world_size: int, replicas: int) -> list[Ranks]:
    """The R replicas' ranks: consecutive blocks of world / R. 4 ranks, R = 2 -> (0, 1), (2, 3)."""
    if replicas < 1 or world_size % replicas:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"rollout.replicas={replicas} does not divide the {world_size} workers "
                         f"(each replica is an EP group of workers / replicas ranks); set it to "
                         f"one of {divisors}")
    size = world_size // replicas
    return [tuple(range(i * size, (i + 1) * size)) for i in range(replicas)]


def replica_placement(num_experts: int, ranks: Sequence[int],
                      holding: Mapping[int, Sequence[int]]) -> tuple[Placement, list[Transfer]]:
    """One replica's placement over `ranks` and the transfers that fill it.

    holding: every rank of the world -> the experts in its memory (its training shard). Experts
    per rank are balanced (at most ceil(E / |ranks|)); each expert goes to the least loaded rank
    of the replica that holds it with room left, else to the least loaded rank of the replica
    (ties: the lowest rank), which borrows it from a holder outside: the holder sending the fewest
    so far (ties: the lowest rank). Pure: the same on every rank. 8 experts, 4 training shards of
    2 [0 1 | 2 3 | 4 5 | 6 7], replica (0, 1): rank 0 hosts 0 1 4 6, rank 1 hosts 2 3 5 7, and
    borrows 5 and 7 from ranks 2 and 3.
    """
    ranks = tuple(sorted(ranks))
    if not ranks:
        raise ValueError("a replica needs at least one rank")
    cap = -(-num_experts // len(ranks))
    load = {r: 0 for r in ranks}
    sends = {r: 0 for r in holding}
    owner, transfers = [], []
    for e in range(num_experts):
        holders = [r for r in ranks if e in set(holding.get(r, ())) and load[r] < cap]
        dst = min(holders or ranks, key=lambda r: (load[r], r))
        owner.append(dst)
        load[dst] += 1
        if not holders:
            sources = [r for r in sorted(holding) if e in set(holding[r])]
            if not sources:
                raise ValueError(f"expert {e} is held by no rank: the training layout does not "
                                 "cover the model")
            src = min(sources, key=lambda r: (sends[r], r))
            sends[src] += 1
            transfers.append(Transfer(expert=e, src=src, dst=dst))
    return Placement(owner=tuple(owner), ranks=ranks), transfers


def route_least_outstanding(groups, replicas: Sequence[Ranks]) -> dict[int, list[Request]]:
    """verl's agent loop: the whole batch submitted at once, each sample to the replica with the
    fewest outstanding requests, and inside it to the rank with the fewest (data-parallel
    attention's balancing). rank -> its requests in submission order."""
    from flexfloor.rollout.scheduler import least_outstanding

    reqs = [r for g in groups for r in g.requests]
    to_replica = least_outstanding([("submit", r.request_id) for r in reqs], len(replicas))
    out: dict[int, list[Request]] = {r: [] for g in replicas for r in g}
    for i, ranks in enumerate(replicas):
        mine = [r for r in reqs if to_replica[r.request_id] == i]
        to_rank = least_outstanding([("submit", r.request_id) for r in mine], len(ranks))
        for r in mine:
            out[ranks[to_rank[r.request_id]]].append(r)
    return out


def mode_assignments(groups, replicas: Sequence[Ranks], *, chunks,
                     flexfloor) -> dict[Mode, dict[int, list[Request]]]:
    """Every mode's rank -> requests for one rollout (the simulator's choices): `chunks` and
    `flexfloor` are the `RolloutPlan`s of the BASELINE and FLEXFLOOR schedulers over every rank."""
    routed = route_least_outstanding(groups, replicas)
    return {Mode.STATIC: routed, Mode.REPLICA_RELEASE: routed,
            Mode.STATIC_CHUNKS: chunks.assignment, Mode.SINGLE_GROUP: chunks.assignment,
            Mode.ELASTIC: flexfloor.assignment}


def held_to_end(records: list[dict]) -> list[dict]:
    """A held mode's per-rank records over several replicas: every rank occupied to the end of
    the slowest replica, its steps counted as that replica's (the simulator's hold rule)."""
    end = max(r["release_s"] for r in records)
    steps = max(r["steps"] for r in records)
    return [{**r, "release_s": end, "steps": steps, "release_step": steps} for r in records]


# --------------------------------------------------------------------------------------------
# the topology value


@dataclass
class ReplicaTopology:
    """The rollout's R replicas on this rank: every replica's ranks and placement, this rank's
    replica group, and the transfers each rollout start runs.

    Lifecycle: `build` (collective over the world, once per job) -> per rollout, the layout's
    `start` runs `transfers` (collective over the world) and binds the MoE to `group`, resync
    drops the borrowed experts -> `destroy` with the job's groups.
    """

    rank: int
    replicas: tuple[Ranks, ...]
    placements: tuple[Placement, ...]
    transfers: tuple[Transfer, ...]  # every replica's, in one list (the same on every rank)
    holding: dict[int, list[int]]  # rank -> experts in memory during a rollout (shard + borrowed)
    group: Optional[dist.ProcessGroup]  # this rank's replica EP group
    _owned: list[dist.ProcessGroup] = field(default_factory=list, repr=False)

    @property
    def count(self) -> int:
        return len(self.replicas)

    @property
    def ranks_per_replica(self) -> int:
        return len(self.replicas[0])

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica

    @property
    def index(self) -> int:
        """This rank's replica."""
        return self.replica_of(self.rank)

    @property
    def ranks(self) -> Ranks:
        return self.replicas[self.index]

    @property
    def placement(self) -> Placement:
        return self.placements[self.index]

    @classmethod
    def build(cls, *, rank: int, world_size: int, replicas: int, num_experts: int,
              holding: Mapping[int, Sequence[int]], world_group, timeout,
              world_placement: Placement) -> "ReplicaTopology":
        """Every rank of the world calls this with the same arguments (`holding` gathered): the
        replica groups are created here, in replica order. R = 1: the world group and
        `world_placement` (the rollout layout of today), nothing to fetch."""
        import torch.distributed as dist

        groups = replica_ranks(world_size, replicas)
        if replicas == 1:
            return cls(rank=rank, replicas=(groups[0],), placements=(world_placement,),
                       transfers=(), holding={r: list(e) for r, e in holding.items()},
                       group=world_group)
        placements, transfers = [], []
        for ranks in groups:
            placement, moves = replica_placement(num_experts, ranks, holding)
            placements.append(placement)
            transfers += moves
        mine, owned = None, []
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine = group
                owned.append(group)
        during = {r: sorted(set(holding[r]) | set(p.experts_of(r)))
                  for p in placements for r in p.ranks}
        return cls(rank=rank, replicas=tuple(groups), placements=tuple(placements),
                   transfers=tuple(transfers), holding=during, group=mine, _owned=owned)

    def destroy(self) -> None:
        import torch.distributed as dist

        for group in self._owned:
            dist.destroy_process_group(group)
        self._owned.clear()
