"""Survivor groups built ahead: the EP groups a rollout can shrink to, created before decoding.

With NCCL a new communicator costs seconds per rank; a rollout of a large batch shrinks dozens of
times. The rollout plan already says who is meant to leave when (`RolloutPlan.expected_finish`),
so every survivor set it implies is created collectively before the first decode step, by every
rank of the world in the same order (plain `new_group`: no naming questions, one store round per
group), and kept for the next rollouts while the shape repeats. Inside the decode loop a shrink
only looks its group up.

A release the plan did not foresee (a rank finishing earlier than predicted) takes the nearest
prebuilt group: the smallest one inside the active ranks that contains every survivor. The ranks
of that group that wanted to leave stay idle-but-present (they step with empty batches) until a
later boundary lets them go; they leave from a group the plan holds. Only when no prebuilt group
is smaller than the active one is a group created during the rollout, by its members only, and
counted in `groups_created_during_rollout` (0 whenever the plan held).

That late group needs a name its members agree on. torch's `new_group(...,
use_local_synchronization=True)` hashes the ranks with the number of groups the calling process
holds, which differs between ranks that were members of different earlier groups (their
rendezvous keys then never meet: a hang), and `split_group` needs an NCCL default group bound to
a device. So the late group is built with an explicit name (`name_prefix`, unique in the job, plus
its ranks) through the helper `new_group` itself uses: the one private call left, off the planned
path. Each such set is created once per job and kept, so no name is reused after a destroy.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch.distributed as dist

from flexfloor.rollout.collectives import gather_objects

Ranks = tuple[int, ...]  # sorted global ranks


def live_process_groups() -> int:
    """Process groups this process holds now (torch's registry): counting what a rollout
    created, independently of who created it."""
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def planned_survivor_sets(expected_finish: Mapping[int, float], *, floor: int = 1) -> list[Ranks]:
    """Every survivor set a plan implies, largest first: ranks leave in order of predicted finish
    (ties: the higher rank first, as the release keeps the lowest idle ranks), down to `floor`
    ranks. 4 ranks finishing at 40, 30, 20, 10 steps -> (0, 1, 2), (0, 1), (0,)."""
    ranks = sorted(expected_finish)
    order = sorted(ranks, key=lambda r: (expected_finish[r], -r))  # who leaves first
    floor = max(1, floor)
    return [tuple(sorted(order[k:])) for k in range(1, len(ranks) - floor + 1)]


def creates_group(active: Sequence[int], survivors: Sequence[int], prebuilt, late=()) -> bool:
    """Whether the shrink of `active` to `survivors` creates a group when it is carried out
    (`SurvivorGroups.switch`): not when the survivors' set is `prebuilt`, or a prebuilt superset
    takes them (some leavers stay idle in it), or a group made `late` earlier holds exactly
    them. Pure: what the pace rule prices a shrink's switch by."""
    active, survivors = tuple(sorted(active)), tuple(sorted(survivors))
    if survivors in prebuilt or survivors in late:
        return False
    return nearest_prebuilt(active, survivors, list(prebuilt)) is None


def nearest_prebuilt(active: Ranks, survivors: Ranks, prebuilt: Sequence[Ranks]) -> Optional[Ranks]:
    """The smallest prebuilt group inside `active` that contains every survivor and is smaller
    than `active` (ties: the one with the lowest ranks); None when there is none. Pure."""
    want, within = set(survivors), set(active)
    fits = [g for g in prebuilt if want <= set(g) <= within and len(g) < len(active)]
    return min(fits, key=lambda g: (len(g), g)) if fits else None


def leavers_for(active: Sequence[int], leaving: Sequence[int], prebuilt) -> list[int]:
    """Who really leaves when `leaving` want to leave `active`, given the `prebuilt` survivor
    sets (pure): everyone asked when the survivors' set is prebuilt (or none is near), else only
    the ranks outside the nearest prebuilt superset (`nearest_prebuilt`); the others stay idle
    in it."""
    active = tuple(sorted(active))
    survivors = tuple(r for r in active if r not in set(leaving))
    if survivors in prebuilt:
        return sorted(leaving)
    near = nearest_prebuilt(active, survivors, list(prebuilt))
    return sorted(leaving) if near is None else [r for r in active if r not in near]


@dataclass(frozen=True)
class Switch:
    """How one shrink is carried out: who really leaves, the survivors' ranks and their group
    (None on a rank outside it), and whether the group had to be created now."""

    leaving: tuple[int, ...]
    ranks: Ranks
    group: Optional[dist.ProcessGroup]
    created: bool
    kept_idle: tuple[int, ...] = ()  # ranks that wanted to leave but stay in `ranks` for now


@dataclass
class SurvivorGroups:
    """The survivors' groups of one job: built ahead from plans, looked up at each shrink.

    Lifecycle: `prepare(sets)` before a rollout's first step (collective over the world) ->
    `switch(...)` at each shrink (no collective when the plan held) -> the next rollout's
    `prepare` reuses what exists -> `destroy()` with the job's groups.
    """

    rank: int
    world_size: int
    timeout: datetime.timedelta
    name_prefix: str = "0"  # unique in the job (the rollout layout's id): names late groups
    prebuilt: dict[Ranks, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    late: dict[Ranks, dist.ProcessGroup] = field(default_factory=dict)  # made during rollouts
    # every survivor set made late in this job that this rank knows of: all the ranks of the
    # shrink that made it (members or not: each calls `switch`), and after the next `prepare`
    # every rank. `creates` reads it, so every rank of a group prices a shrink alike: a rank
    # that had left when a set was made would otherwise price its switch as a creation
    known_late: set = field(default_factory=set)
    created_during_rollout: int = 0  # this rollout's late groups (this rank took part in)
    created_ahead: int = 0  # groups `prepare` created, over the job

    def prepare(self, sets: Sequence[Ranks]) -> int:
        """Create every set not built yet, collectively: every rank of the world calls this with
        the same sets (the plan is computed identically everywhere) before decoding starts.
        Resets the rollout's late-group count, and shares the sets made late so far with every
        rank (`known_late`). Returns how many groups were created."""
        self.created_during_rollout = 0
        everyone = gather_objects(None, sorted(self.known_late))  # over the world
        self.known_late.update(tuple(s) for sets in everyone for s in sets)
        made = 0
        for ranks in sorted({tuple(sorted(s)) for s in sets}, key=lambda s: (-len(s), s)):
            if ranks in self.prebuilt or not ranks:
                continue
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"survivor set {ranks} names ranks {bad} outside the world of "
                                 f"{self.world_size}")
            group = dist.new_group(list(ranks), timeout=self.timeout)
            self.prebuilt[ranks] = group if self.rank in ranks else None
            made += 1
        self.created_ahead += made
        return made

    def leavers_for(self, active: Sequence[int], leaving: Sequence[int]) -> list[int]:
        """Who really leaves when `leaving` want to leave `active` (pure, the same on every rank:
        it reads only the prebuilt sets): everyone asked when the survivors' group is prebuilt
        (or none is near), else only the ranks outside the nearest prebuilt superset; the
        others stay idle in it."""
        return leavers_for(active, leaving, self.prebuilt)

    def creates(self, active: Sequence[int], survivors: Sequence[int]) -> bool:
        """Whether `switch` would create the survivors' group (`creates_group`), from the sets
        built ahead and those made late that every rank knows of (`known_late`): pure, the same
        on every rank of `active`."""
        return creates_group(active, survivors, self.prebuilt, self.known_late)

    def switch(self, active: Sequence[int], leaving: Sequence[int]) -> Switch:
        """The group the survivors of `active` minus `leaving` switch to (every rank of `active`
        calls this with the same arguments; pure but for a late creation): the prebuilt one, else
        the nearest prebuilt superset (some leavers stay idle), else a new one made by its
        members, counted."""
        active = tuple(sorted(active))
        survivors = tuple(r for r in active if r not in set(leaving))
        if not survivors:
            raise ValueError(f"every active rank {active} would leave: the floor is at least 1")
        if survivors in self.prebuilt:
            return Switch(tuple(sorted(leaving)), survivors, self.prebuilt[survivors], False)
        near = nearest_prebuilt(active, survivors, list(self.prebuilt))
        if near is not None:
            kept = tuple(r for r in near if r not in survivors)
            return Switch(tuple(r for r in active if r not in near), near, self.prebuilt[near],
                          False, kept_idle=kept)
        self.known_late.add(survivors)
        group = self.late.get(survivors)
        created = group is None and self.rank in survivors
        if created:
            group = self._late_group(survivors)
            self.late[survivors] = group
            self.created_during_rollout += 1
        return Switch(tuple(sorted(leaving)), survivors,
                      group if self.rank in survivors else None, created)

    def _late_group(self, ranks: Ranks) -> dist.ProcessGroup:
        """A group created by its members only, with an explicit name (see the module doc)."""
        from torch.distributed import distributed_c10d as c10d

        name = f"flexfloor/survivors/{self.name_prefix}/" + "_".join(map(str, ranks))
        pg, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(self.rank), list(ranks), dist.get_backend(),
            c10d._get_default_store(), name, timeout=self.timeout)
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
        return pg

    def destroy(self) -> None:
        for group in list(self.prebuilt.values()) + list(self.late.values()):
            if group is not None:
                dist.destroy_process_group(group)
        self.prebuilt.clear()
        self.late.clear()
        self.known_late.clear()
