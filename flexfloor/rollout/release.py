"""The release decision at a step boundary, as a pure function of the shared step state.

Every active rank computes the same `ReleaseDecision` from the same `StepReport` (no collective,
no process group): who hands its running requests to whom (migration), who leaves, and the
placement and expert transfers after the shrink. `ElasticMembership` (flexfloor/rollout/elastic.py)
applies it in the engine; the simulator (flexfloor/sim/) calls the same function, so both decide
alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from flexfloor.rollout.scheduler import StepCost, lockstep_end
from megatron_ext.placement import plan_shrink


@dataclass(frozen=True)
class RankLimits:
    """What the release decision needs to know of the engines (the same on every rank)."""

    kv_bytes_per_token: int
    max_seq_len: int
    max_batch_size: int
    kv_budget_bytes: Optional[int]  # a rank's KV room hosting only its own experts; None: unbounded
    expert_nbytes: int  # one expert's weights over all layers

    @classmethod
    def of(cls, engine) -> "RankLimits":
        return cls(kv_bytes_per_token=engine.kv_bytes_per_token, max_seq_len=engine.max_seq_len,
                   max_batch_size=engine.max_batch_size, kv_budget_bytes=engine.kv_budget_bytes,
                   expert_nbytes=engine.moe.expert_nbytes)


@dataclass(frozen=True)
class ReleaseRules:
    """The elastic policy's knobs (elastic.* and scheduler.migrate_* of the config)."""

    min_active_ranks: int = 1  # the floor
    check_interval_steps: int = 1  # decide at every n-th step boundary
    capacity: Optional[dict] = None  # rank -> most experts it can host; None: from the KV room
    holding: Optional[dict] = None  # rank -> experts in its memory at start
    migrate_max_requests: int = 0  # > 0: a rank's last requests may move to a staying rank
    # elastic.pace_model: a shrink does not slow the replica's end (`decide`'s `end_s` allows
    # a slower one within the end to keep that saves occupied seconds)
    pace: Optional["Pace"] = None


@dataclass(frozen=True)
class Pace:
    """The pace rule of a shrink (elastic.pace_model): after a shrink each survivor hosts more
    experts and reads their weights every step, so on an accelerator its later steps are slower;
    a shrink is refused when the survivors' predicted remaining work at their post-shrink step
    cost, after the stall of its expert transfers (`shrink_cost`), would end the replica later
    than it ends without the shrink (`slows_replica`), unless, given the seconds the replica
    may still take (`end_s`), the survivors end within them and the shrink saves occupied
    seconds.
    `group_cost`: (a placement, the ranks of its group that decode) -> the step cost of a rank
    that decodes (`StepCost`: its requests, their cached tokens -> seconds; the others step with
    empty batches, their experts still computing the tokens routed to them; the cost model's,
    `elastic.pace_of`). With a step that costs the same whatever the group (the CPU's engine
    steps, `UnitCost`) the survivors' end is the unshrunk one and the rule never refuses."""

    group_cost: Callable[[object, tuple], StepCost]
    # (the placement before the shrink, the survivors' placement, its expert transfers) -> the
    # seconds the survivors stall: the transfers, then their group switched to or created
    # (the cost model's, `elastic.pace_of`): a shrink that ships more expert weights
    # than the survivors' remaining steps win back ends the replica later; None: free
    shrink_cost: Optional[Callable[[object, object, list], float]] = None


# per rank of the group, in placement order: (remaining tokens, cached tokens) of each request
# running on it, the remaining ones predicted (`tails.remaining_tokens`)
Work = Sequence[Sequence[tuple[float, int]]]


@dataclass
class ReleaseDecision:
    """Who hands requests to whom, who leaves, and the placement and transfers after it. An
    empty decision (the default) means: everybody stays, nothing moves."""

    migrate: dict = field(default_factory=dict)  # giving rank -> taking rank
    # tail consolidation (flexfloor/rollout/tails.py), consolidate.Move each: inside the group
    # (`moves`: every running request of each giver to its own taker, then the givers leave)
    # or to other replicas (`hand_over`: this whole replica's requests; it then leaves whole)
    moves: list = field(default_factory=list)
    hand_over: list = field(default_factory=list)
    leaving: list = field(default_factory=list)
    placement: object = None  # megatron_ext.placement.Placement after the shrink
    transfers: list = field(default_factory=list)
    floor_hit: bool = False  # some could leave, but the survivors could not hold the experts
    paced: bool = False  # some could leave, but the survivors would end later (`Pace`)

    def stays(self, rank: int) -> bool:
        return rank not in self.leaving


def choose_leavers(ranks, has_work, min_active_ranks: int) -> list[int]:
    """Who leaves at a step boundary: every done rank, except the lowest idle ones the floor
    (`min_active_ranks`) still needs."""
    done = [r for r, w in zip(ranks, has_work) if not w]
    working = [r for r, w in zip(ranks, has_work) if w]
    keep_idle = max(0, min_active_ranks - len(working))
    return done[keep_idle:]


def decide(rules: ReleaseRules, placement, report, limits: RankLimits,
           boundary: int, work: Optional[Work] = None,
           end_s: Optional[float] = None,
           fit: Optional[Callable[[Sequence[int], list], list]] = None) -> ReleaseDecision:
    """The decision at the `boundary`-th step boundary (counted from 1) of a rollout, from the
    shared report alone: the same on every rank. `work` (every rank's running requests, the same
    on every rank): what the pace rule (`rules.pace`) predicts the survivors' end from; without
    it, or without the rule, a shrink is never refused for its pace. `end_s`: the seconds from
    now the replica may still take (the rollout's end to keep less its clock): a shrink that
    slows the replica is then made when its survivors still end within them and it saves
    occupied seconds (`slows_replica`); None: a shrink never slows the replica. `fit`: (the
    active ranks, the ranks that want to leave) -> who really leaves (with survivor groups built
    ahead, `survivors.leavers_for`: only the ranks outside the nearest prebuilt superset), before
    the shrink is planned and paced, so the rule prices the shrink that is carried out."""
    if boundary % rules.check_interval_steps:
        return ReleaseDecision()
    ranks = list(placement.ranks)
    has = list(report.has_work)
    migrate = {}
    if rules.migrate_max_requests > 0:
        migrate = migration_plan(rules, ranks, report, limits)
        has = [w and r not in migrate for r, w in zip(ranks, has)]
    leaving = choose_leavers(ranks, has, rules.min_active_ranks)
    if leaving and fit is not None:
        leaving = list(fit(ranks, leaving))
    if not leaving:
        return ReleaseDecision(migrate=migrate)
    try:
        new_placement, transfers = plan_shrink(
            placement, leaving, capacity=capacity_now(rules, placement, report, limits),
            holding=rules.holding)
    except ValueError:
        # the floor: survivors cannot hold every expert; nobody leaves this time
        return ReleaseDecision(migrate=migrate, floor_hit=True)
    return under_pace(rules, placement, ReleaseDecision(
        migrate=migrate, leaving=leaving, placement=new_placement, transfers=transfers),
        work, end_s)


def under_pace(rules: ReleaseRules, placement, decision: ReleaseDecision,
               work: Optional[Work], end_s: Optional[float] = None) -> ReleaseDecision:
    """`decision` (`decide`'s at this boundary, made without `work`) under the pace rule: its
    shrink refused (`paced`, its migration kept) when `slows_replica` says the survivors would
    end later than allowed; unchanged without the rule, without `work` or without a shrink.
    What `decide` does with `work`, without planning the shrink again. Pure."""
    if rules.pace is None or work is None or not decision.leaving:
        return decision
    if slows_replica(rules.pace, placement, decision.placement,
                     migrated_work(placement.ranks, work, decision.migrate), decision.transfers,
                     end_s=end_s):
        return ReleaseDecision(migrate=decision.migrate, paced=True)
    return decision


def slows_replica(pace: Pace, placement, new_placement, work: Work, transfers=(),
                  end_s: Optional[float] = None) -> bool:
    """Whether the survivors (`new_placement`) would end their running `work` later than the
    group of `placement` ends it unshrunk: each group in lockstep at its fullest rank's pace,
    each rank's context growing as it decodes (`scheduler.replica_finish`), every step priced
    at that group's step cost, the survivors first stalled for the shrink's expert `transfers`
    (`Pace.shrink_cost`). The leavers have no work (they are done, or handed theirs over:
    `migrated_work`). With `end_s` (seconds from now the replica may take: the rollout's end to
    keep), a later end is allowed when it is within `end_s` and the leavers' seconds held to the
    unshrunk end exceed what the survivors add: a replica that does not end the rollout trades
    a slower tail for ranks released now. Pure."""
    ranks = list(placement.ranks)
    survivors = [work[ranks.index(r)] for r in new_placement.ranks]
    before = lockstep_end(work, pace.group_cost(placement, _busy(placement.ranks, work)))
    after = lockstep_end(survivors, pace.group_cost(new_placement,
                                                    _busy(new_placement.ranks, survivors)))
    if pace.shrink_cost is not None and any(survivors):  # idle survivors wait for nothing
        after += pace.shrink_cost(placement, new_placement, list(transfers))
    if after <= before * (1 + 1e-9):
        return False
    if end_s is None or after > end_s:
        return True
    leavers = len(ranks) - len(new_placement.ranks)
    return leavers * before <= len(new_placement.ranks) * (after - before)


def _busy(ranks, work: Work) -> tuple:
    return tuple(r for r, w in zip(ranks, work) if w)


def migrated_work(ranks, work: Work, migrate: dict[int, int]) -> list[list[tuple[float, int]]]:
    """`work` once each giver of `migrate` (giving rank -> taking rank) handed its requests to
    its taker."""
    ranks = list(ranks)
    out = [list(w) for w in work]
    for src, dst in migrate.items():
        out[ranks.index(dst)] += out[ranks.index(src)]
        out[ranks.index(src)] = []
    return out


def migration_plan(rules: ReleaseRules, ranks, report, limits: RankLimits) -> dict[int, int]:
    """Beyond the paper: a rank whose last few requests (<= migrate_max_requests, none queued)
    will end no later than the work of a rank that stays hands them to that rank (re-prefilled
    there, same position-keyed randomness: the same tokens) and leaves now. Returns
    {giving rank: taking rank}."""
    has = list(report.has_work)
    n = len(ranks)
    order = sorted(range(n), key=lambda i: (-report.remaining[i], ranks[i]))
    if len([i for i in range(n) if has[i]]) <= rules.min_active_ranks:
        return {}
    plan: dict[int, int] = {}  # giver index -> taker index
    kv_taken: dict[int, int] = {}  # taker index -> KV bytes promised
    n_taken: dict[int, int] = {}  # taker index -> requests promised
    for i in range(n):
        if i in n_taken or not (0 < report.running[i] <= rules.migrate_max_requests
                                and report.queued[i] == 0):
            continue
        need = report.running[i] * limits.kv_bytes_per_token * limits.max_seq_len
        for j in order:  # the rank with the most work left takes them, if it has room
            if j == i or j in plan or not has[j] or report.remaining[j] < report.remaining[i]:
                continue
            if report.kv_free[j] - kv_taken.get(j, 0) < need:
                continue
            if report.running[j] + n_taken.get(j, 0) + report.running[i] > limits.max_batch_size:
                continue
            plan[i] = j
            kv_taken[j] = kv_taken.get(j, 0) + need
            n_taken[j] = n_taken.get(j, 0) + report.running[i]
            break
    if len([i for i in range(n) if has[i] and i not in plan]) < rules.min_active_ranks:
        return {}
    return {ranks[i]: ranks[j] for i, j in sorted(plan.items())}


def capacity_now(rules: ReleaseRules, placement, report, limits: RankLimits
                 ) -> Optional[dict[int, int]]:
    """Most experts each active rank can host now: a fixed `capacity`, or, under a KV budget,
    what it hosts plus what its free KV memory can hold beyond what its running requests will
    still write (a borrowed expert takes KV room from the survivor's requests; taking room they
    need would preempt them and lengthen the rollout for the release: the group then stays at
    its floor). A rank with queued requests borrows nothing: the room is theirs. None:
    unbounded."""
    if rules.capacity is not None:
        return rules.capacity
    if limits.kv_budget_bytes is None:
        return None
    per = limits.expert_nbytes
    hosted = Counter(placement.owner)
    return {r: hosted[r] + (
                max(0, free - running_need(running, remaining, limits)) // per
                if queued == 0 else 0)
            for r, free, queued, running, remaining in zip(
                placement.ranks, report.kv_free, report.queued, report.running, report.remaining)}


def running_need(running: int, remaining: int, limits: RankLimits) -> int:
    """KV bytes a rank's running requests may still write: each at most `remaining` tokens
    more (the report's bound for the longest of them)."""
    return running * remaining * limits.kv_bytes_per_token
