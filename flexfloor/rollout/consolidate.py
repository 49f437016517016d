"""Tail consolidation: at a step boundary, move the requests still running on a replica that
could leave onto replicas that stay, so it leaves now rather than when its last request ends.

A pure function of the shared step state (no collective, no process group): every replica
computes the same `Consolidation` from the same `ConsolidationState`, and the simulator
(flexfloor/sim/) drives the same function. A moved request keeps its tokens: its KV blocks are
transferred where that is cheaper than recomputing them, else it is re-prefilled on its taker
with what it had produced, and sampling is keyed by (seed, step, uid, sample, position), so it
produces the same tokens wherever it runs.

The rules, in order:
- a replica gives only when it has no queued request and all of its running requests find a
  taker (a partial move frees no rank); the replicas with the fewest running requests give
  first, and at least `min_replicas` replicas stay;
- a taker is a rank of a staying replica with a free batch slot and the KV room for the request
  to its predicted end plus `reserve_blocks` (the memory floor: borrowed room is never taken
  from the taker's own requests);
- the step-cost bound: a taker replica's predicted end with the move (when it can go on: its
  clock, or later when the KV it takes has not arrived by then (transfers leave at the giver's
  clock, one after another; they overlap the taker's decoding), or its clock plus a
  re-prefill's seconds; then `replica_finish` of its running work: lockstep at its fullest
  rank's pace, each rank's context growing as it decodes) must stay within the rollout's
  predicted end before the move: a release never lengthens the rollout;
- hedges against wrong estimates: the replica that ends the rollout never gives, takers have
  nothing queued (their queue's lengths are unknown here), and a replica gives only when each
  of its requests has at most `TAIL_SHARE` of the rollout's longest remaining tokens left
  (`ConsolidationRules.hedged`; off where the estimates are bounds on one clock: inside one
  replica the engine estimates each request up to its cap);
- a replica that has shrunk inside (`ConsolidationState.shrunk`) never takes: the bound prices
  a taker as a full replica;
- takers from the replica planned to stay longest (latest predicted end): each takes the most
  of the giver's longest requests that keep its bound, each on its least loaded rank;
- a taker's own work may run past its prediction too (`ConsolidationRules.taker_hedge`): its
  own running requests are then counted at that times their estimate for its bound, and those
  already known mispredicted (`Running.worst`) at their worst;
- where the estimates have proved wrong (`ConsolidationRules.no_denser`), a leaving replica's
  request goes only to a taker rank whose step with it is no dearer than the giver's fullest
  rank's step.

The other direction, the online correction (`ConsolidationState.end_bound_s`, the static
baseline's predicted end): a replica whose predicted end with its running work is past that
bound (a misprediction found online: `remaining_estimate`) hands its longest requests to
replicas that are running anyway (nothing queued, not leaving), as many as its end needs to come
within the bound, each taker within the bound with them, the one planned to stay longest first
(held anyway: the least extra occupancy); it stays and ends sooner. Hedged: a taker's end is
taken with each moved request's estimate doubled (the requests that move are the ones whose
estimates were wrong), and only a move that brings the giver's end in is made. Where no taker
takes its longest (they would run about as long anywhere), the late replica is lightened
instead (`ConsolidationRules.lighten`): its other requests go to takers that then still end
before it would have, so it steps faster.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from flexfloor.rollout.kv import blocks_for
from flexfloor.rollout.scheduler import lockstep_end

# a rank's step: (requests decoding on it, their cached tokens) -> seconds (scheduler.StepCost)
StepCost = Callable[[int, float], float]

# a giver's requests move only while each has at most this share of the longest remaining
# tokens of the rollout left (predictions of remaining tokens err by a fifth and more)
TAIL_SHARE = 0.5


class MoveKind(enum.Enum):
    KV_TRANSFER = "kv_transfer"  # its KV blocks sent to the taker, decoding resumes there
    REPREFILL = "reprefill"  # recomputed on the taker from prompt + what it had produced


@dataclass(frozen=True)
class Running:
    """One running request at the boundary."""

    request_id: str
    cached_tokens: int  # prompt + produced: what its KV holds
    remaining: float  # predicted tokens still to produce (see `remaining_estimate`)
    # where its prediction is known wrong (it outlived it), the most it may still produce (its
    # cap): a taker counts its own such requests so (`ConsolidationRules.taker_hedge`); None:
    # as estimated
    worst: Optional[float] = None


@dataclass(frozen=True)
class RankState:
    rank: int
    replica: int
    running: tuple[Running, ...]
    queued: int
    kv_free_blocks: Optional[int]  # None: unbounded


@dataclass(frozen=True)
class ConsolidationState:
    """What every replica knows at a boundary: each rank's requests and room, each replica's
    clock (replicas step independently), the limits."""

    ranks: tuple[RankState, ...]
    now_s: dict  # replica -> its clock, seconds
    max_batch: int
    block_tokens: int = 16
    # the rollout's end to keep (the static baseline's predicted end, seconds on the replicas'
    # clocks): a replica predicted to end past it hands its longest requests to replicas held
    # anyway (the correction, module doc); None: no correction (the engine's)
    end_bound_s: Optional[float] = None
    correct: bool = True  # the correction is decided at this boundary (with an end to keep)
    # replicas that have shrunk inside (fewer ranks than they started with): they may give but
    # never take, since the step-cost bound prices every taker as a full replica and a shrunk
    # one's ranks host more experts and step slower
    shrunk: frozenset = frozenset()


@dataclass(frozen=True)
class MovePrices:
    """What a move costs: the KV over the link between replicas, or the prefill on the taker."""

    kv_bytes_per_token: int
    transfer_bytes_per_s: float
    reprefill_s_per_token: float

    def of(self, cached_tokens: int) -> tuple[MoveKind, float]:
        kv = cached_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s
        pre = cached_tokens * self.reprefill_s_per_token
        return (MoveKind.KV_TRANSFER, kv) if kv <= pre else (MoveKind.REPREFILL, pre)


@dataclass(frozen=True)
class ConsolidationRules:
    min_replicas: int = 1  # replicas that stay whatever fits
    reserve_blocks: int = 0  # KV blocks a taker keeps free (the memory floor)
    max_requests: int = 256  # most requests one replica hands over to leave
    # the hedges against wrong estimates (module doc); off where every remaining estimate is a
    # bound (a request's cap) and the givers and takers step on one clock (inside one replica)
    hedged: bool = True
    # a taker's end counts each request it takes at this times its estimate: when a replica
    # leaves (1: as estimated), and in the correction (the requests whose estimates were wrong)
    evacuation_hedge: float = 1.0
    correction_hedge: float = 2.0
    # the correction lightens a late replica whose longest requests no taker takes (`_pull_in`)
    lighten: bool = True
    # a taker's own running requests counted at this times their estimate when it takes (its
    # own may run past their predictions, and what it took would then end late with them), and
    # those known mispredicted at their `Running.worst`; 1.0: as estimated (the engine's)
    taker_hedge: float = 1.0
    # where there is no end to keep (no history: the placement was static's), gather at each
    # check the requests known long (by their siblings done) onto the replicas that end later,
    # within the rollout's predicted end, so the others leave early (`_gather`); off: the
    # engine's
    gather: bool = False
    # a leaving replica hands a request only to a taker rank whose step with it (the step cost
    # of its requests and their cached tokens, the promised ones included) is no dearer than the
    # giver's fullest rank's step now: no hand-over piles work onto a rank denser than the one
    # it leaves. Off by default; the simulator sets it where the length history has proved
    # wrong in the rollout (`LengthHistory.unproven`): there hand-overs early in the tail, onto
    # the only taker within a bound made from that history, ended the rollout after static's
    no_denser: bool = False


@dataclass(frozen=True)
class Move:
    request_id: str
    src: int  # giving rank
    dst: int  # taking rank
    kind: MoveKind
    seconds: float  # the move's time (transfer, or the re-prefill's estimate)
    ready_s: float = 0.0  # KV transfer: when its KV has arrived (the giver's clock, then in turn)


@dataclass
class Consolidation:
    """Who moves where, and the replicas that leave once their requests are gone. Empty (the
    default): nothing moves."""

    moves: list[Move] = field(default_factory=list)
    leaving_replicas: list[int] = field(default_factory=list)
    # replicas that hand part of their requests over and stay (the correction)
    corrected_replicas: list[int] = field(default_factory=list)


def remaining_estimate(predicted_len: float, produced: int, cap: int) -> float:
    """Predicted tokens still to come of a request that has produced `produced`: its prediction
    less what it produced, and once it outlives its prediction (the prediction was wrong), half
    as much again as it has produced (online correction), never past the cap."""
    left = cap - produced
    if predicted_len > produced:
        return float(min(left, predicted_len - produced))
    return float(max(1, min(left, produced // 2)))


@dataclass
class _Load:
    """The staying side's load as moves are promised: per rank its running work (remaining
    tokens, cached tokens) and free blocks, per replica when it can go on."""

    work: dict  # rank -> [(remaining, cached)]
    free: dict
    ready: dict  # replica -> when it can step with what it was promised (its clock, or later)
    sent: dict  # replica -> seconds of KV transfers promised to it (one after another)

    def copy(self, ranks: Sequence[int] = ()) -> "_Load":
        """A copy in which the work of `ranks` may change: their lists are copied, the others'
        are shared (never changed in place: a change copies its ranks first)."""
        work = dict(self.work)
        for r in ranks:
            work[r] = list(work[r])
        return _Load(work, dict(self.free), dict(self.ready), dict(self.sent))

    def adopt(self, other: "_Load") -> None:
        self.work, self.free, self.ready, self.sent = other.work, other.free, other.ready, other.sent


class FinishMemo:
    """`replica_finish` of a replica's running work, remembered by that work, for one step
    cost: a driver deciding at every boundary of several replicas asks again about the ones that
    have not stepped since (their requests and estimates unchanged). Holds at most `limit`."""

    def __init__(self, step_cost: StepCost, limit: int = 4096):
        self.step_cost = step_cost
        self.limit = limit
        self._known: dict = {}

    def finish(self, work: Sequence[Sequence[tuple]]) -> float:
        """The replica's finish (seconds from when it can go on): work per rank,
        [(remaining, cached)]."""
        key = tuple(tuple(w) for w in work)
        got = self._known.get(key)
        if got is None:
            got = lockstep_end(work, self.step_cost)
            if len(self._known) >= self.limit:
                self._known.clear()
            self._known[key] = got
        return got


def decide(state: ConsolidationState, rules: ConsolidationRules, step_cost: StepCost,
           prices: MovePrices, givers: Optional[Sequence[int]] = None,
           memo: Optional[FinishMemo] = None) -> Consolidation:
    """The consolidation at this boundary, from the shared state alone (see the module doc).
    `givers`: the replicas that may give (None: any; the simulator, whose replicas run on their
    own clocks, lets only the one at the earliest clock give). `memo`: replica finishes known
    from earlier boundaries (of this `step_cost`), or None."""
    if memo is None:
        memo = FinishMemo(step_cost)
    elif memo.step_cost is not step_cost:
        raise ValueError("decide: memo was made for another step_cost; make one FinishMemo "
                         "per step cost")
    by_replica: dict[int, list[RankState]] = {}
    for r in state.ranks:
        by_replica.setdefault(r.replica, []).append(r)
    live = [i for i, rs in sorted(by_replica.items()) if any(r.running or r.queued for r in rs)]
    if len(live) <= rules.min_replicas:
        return Consolidation()
    load = _Load(work={r.rank: [(q.remaining, q.cached_tokens) for q in r.running]
                       for rs in by_replica.values() for r in rs},
                 free={r.rank: r.kv_free_blocks for rs in by_replica.values() for r in rs},
                 ready={i: state.now_s[i] for i in live}, sent={i: 0.0 for i in live})

    def end(i: int, ld: _Load) -> float:
        """Replica i's predicted end: when it can go on (its clock, or the arrival of the KV it
        was promised, or its clock plus the re-prefills), then its running work in lockstep at
        its fullest rank's pace, each rank's context growing as it decodes (`replica_finish`)."""
        return ld.ready[i] + memo.finish([ld.work[r.rank] for r in by_replica[i]])

    # each rank's own running work as a taker counts it (`ConsolidationRules.taker_hedge`;
    # with 1.0 as estimated: `end`)
    own = {} if rules.taker_hedge == 1.0 else {
        r.rank: [(q.worst if q.worst is not None else rules.taker_hedge * q.remaining,
                  q.cached_tokens) for q in r.running] for r in state.ranks}

    def counting(own_of: dict):
        """Replica i's end as a taker: its own running requests (the first entries of each
        rank's work: promises are appended) counted as `own_of` says, what it was promised as
        promised."""
        def at(i: int, ld: _Load) -> float:
            return ld.ready[i] + memo.finish([own_of[r.rank] + ld.work[r.rank][len(own_of[r.rank]):]
                                              for r in by_replica[i]])
        return at

    taker_end = end if rules.taker_hedge == 1.0 else counting(own)

    ends = {i: end(i, load) for i in live}
    rollout_end = max(ends.values())
    # room for mispredictions: a request moves only while it has at most this share of the
    # longest remaining work left, so a wrong estimate of it cannot outlast the rollout
    longest = max((q.remaining for r in state.ranks for q in r.running), default=0.0)
    size = {i: sum(len(r.running) for r in by_replica[i]) for i in live}
    # a taker's end with a replica's requests: within the rollout's predicted end, and never
    # past the end to keep (the correction's bound) where there is one
    taken_bound = (rollout_end if state.end_bound_s is None
                   else min(rollout_end, state.end_bound_s))
    candidates = [i for i in live if (givers is None or i in givers)
                  and not any(r.queued for r in by_replica[i])
                  and 0 < size[i] <= rules.max_requests
                  and (ends[i] < rollout_end or not rules.hedged)]  # the rollout's ender stays
    candidates.sort(key=lambda i: (size[i], ends[i], i))
    giving: list[int] = []
    moves: list[Move] = []
    for g in candidates:
        if len(live) - len(giving) - 1 < rules.min_replicas:
            break
        if any(m.dst in {r.rank for r in by_replica[g]} for m in moves):
            continue  # it takes requests in this decision: it stays
        # takers: replicas with nothing queued (their queue's lengths are not known here), the
        # one planned to stay longest first
        if rules.hedged and any(q.remaining > TAIL_SHARE * longest
                                for r in by_replica[g] for q in r.running):
            continue
        staying = sorted((i for i in live if i != g and i not in giving
                          and i not in state.shrunk
                          and not (rules.hedged and any(r.queued for r in by_replica[i]))),
                         key=lambda i: (-ends[i], i))
        trial = load.copy()
        # the densest step the giver's ranks take now: no taker rank may step dearer with a
        # request handed to it (`ConsolidationRules.no_denser`)
        densest = (max(step_cost(len(r.running), float(sum(q.cached_tokens for q in r.running)))
                       for r in by_replica[g]) if rules.no_denser else None)
        got = _evacuate(by_replica[g], state.now_s[g], staying, by_replica, trial, taker_end,
                        taken_bound, state, rules, prices,
                        densest=None if densest is None else (step_cost, densest))
        if got is not None:
            moves += got
            giving.append(g)
            load = trial
            for i in _replicas_of(got, by_replica):
                ends[i] = end(i, load)
    corrected: list[int] = []
    bound = state.end_bound_s
    def hand_each(order, may_take, hand) -> None:
        """Each replica g of `order`, unless it takes requests in this decision, hands requests
        over (`hand(g, takers)`) and stays: takers the replicas that may take (`may_take(g,
        i)`), not giving, nothing queued, the one planned to stay longest first."""
        for g in order:
            if any(m.dst in {r.rank for r in by_replica[g]} for m in moves):
                continue  # it takes requests in this decision
            takers = sorted((i for i in live if i != g and i not in giving and may_take(g, i)
                             and i not in state.shrunk
                             and not any(r.queued for r in by_replica[i])),
                            key=lambda i: (-ends[i], i))
            got = hand(g, takers)
            if got:
                moves.extend(got)
                corrected.append(g)
                for i in _replicas_of(got, by_replica) | {g}:
                    ends[i] = end(i, load)

    if bound is not None and state.correct:  # the correction: a late replica hands over
        late = [i for i in live if (givers is None or i in givers) and i not in giving
                and ends[i] > bound and not any(r.queued for r in by_replica[i])]
        hand_each(sorted(late, key=lambda i: (-ends[i], i)), lambda g, i: i not in late,
                  lambda g, takers: _pull_in(g, by_replica, takers, load, end, taker_end, bound,
                                             state, rules, prices))
    elif rules.gather and state.correct:  # no end to keep: gather the long work
        # a gatherer counts a taker's own requests at `taker_hedge` times their estimate, not
        # at their worst (with no history nearly every request outlived its prior)
        gather_end = counting({r.rank: [(rules.taker_hedge * q.remaining, q.cached_tokens)
                                        for q in r.running] for r in state.ranks})
        hand_each(sorted((i for i in live if (givers is None or i in givers) and i not in giving
                          and not any(r.queued for r in by_replica[i])),
                         key=lambda i: (ends[i], i)),
                  lambda g, i: (ends[i], -i) > (ends[g], -g),  # the replicas that end later
                  lambda g, takers: _gather(g, by_replica, takers, load, end, gather_end,
                                            rollout_end, state, rules, prices))
    return Consolidation(moves=moves, leaving_replicas=sorted(giving),
                         corrected_replicas=sorted(corrected))


def _replicas_of(moves: Sequence[Move], by_replica) -> set:
    where = {r.rank: i for i, rs in by_replica.items() for r in rs}
    return {where[m.dst] for m in moves}


def _evacuate(giver: Sequence[RankState], giver_now: float, staying, by_replica, load: _Load,
              end, rollout_end, state: ConsolidationState, rules: ConsolidationRules,
              prices: MovePrices, densest: Optional[tuple] = None) -> Optional[list[Move]]:
    """Every running request of `giver` onto ranks of `staying` replicas within the bounds,
    promising them in `load` (`end`: a taker's end); None when one does not fit (then `load` is
    to be dropped). `densest`: (step cost, seconds): no taker rank's step with what it takes
    may cost more (`ConsolidationRules.no_denser`); None: no such bound."""
    left = sorted(((q, r.rank) for r in giver for q in r.running),
                  key=lambda x: (-x[0].remaining, x[0].request_id))
    moves, left = _hand_over(left, giver_now, staying, by_replica, load, end, rollout_end,
                             state, rules, prices, hedge=rules.evacuation_hedge, densest=densest)
    return None if left else moves


def _hand_over(left: list, giver_now: float, staying, by_replica, load: _Load, end, bound,
               state: ConsolidationState, rules: ConsolidationRules, prices: MovePrices,
               hedge: float = 1.0, densest: Optional[tuple] = None) -> tuple[list[Move], list]:
    """`left` ([(Running, src rank)], longest first) onto ranks of `staying` replicas, promising
    them in `load`. Each taker, in turn, takes the most of the longest requests left that keep
    its predicted end (`end`: a taker's) within `bound` (a binary search: more requests never end sooner), each
    counted `hedge` times its remaining estimate; a second pass offers the rest (shorter ones)
    again; `densest` as `_evacuate`'s. Returns (the moves, the requests no taker took)."""
    moves: list[Move] = []
    for i in list(staying) * 2:
        if not left:
            break
        if end(i, load) > bound:
            continue  # past the bound already: more work never ends sooner
        ranks = [r.rank for r in by_replica[i]]
        # the first k of `left` go where the first k of all of them go (each to its least
        # loaded rank in turn): placed once, each probe of the search takes a prefix
        placed = _placed_in_turn(left, i, ranks, load, giver_now, state, rules, prices, hedge,
                                 densest)

        def place(k: int) -> Optional[tuple[_Load, list[Move]]]:
            """The first k of `left` onto replica i; None when one has no rank with a slot and
            KV room or the replica would end past the bound."""
            if k > len(placed):
                return None
            ld = load.copy(ranks)
            for p in placed[:k]:
                ld.work[p.move.dst].append(p.entry)
                if ld.free[p.move.dst] is not None:
                    ld.free[p.move.dst] -= p.blocks
            if k:
                ld.ready[i], ld.sent[i] = placed[k - 1].ready, placed[k - 1].sent
            if end(i, ld) > bound:
                return None
            return ld, [p.move for p in placed[:k]]

        lo, best = _most(place, min(len(left), len(placed)))
        if best is None:
            continue
        ld, out = best
        load.adopt(ld)
        moves += out
        left = left[lo:]
    return moves, left


def _most(fits: Callable[[int], object], n: int) -> tuple[int, object]:
    """The largest k in 1..n with `fits(k)` not None, and that value ((0, None) when none):
    `fits` holds up to some k and not after (more requests never end sooner). Doubling from 1,
    then halving between the last k that fit and the first that did not: a few probes when few
    fit (a taker near its bound), as many as a plain halving when most do."""
    lo, best, k = 0, None, 1
    while k <= n:
        got = fits(k)
        if got is None:
            break
        lo, best, k = k, got, 2 * k
    hi = min(k, n + 1) - 1  # fits(hi + 1) is None, or hi = n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = fits(mid)
        if got is None:
            hi = mid - 1
        else:
            lo, best = mid, got
    return lo, best


@dataclass(frozen=True)
class _Placed:
    """One request promised to a taker rank: its entry in the rank's work, the KV blocks it
    takes, and the replica's (ready, sent) once it and those before it are promised."""

    move: Move
    entry: tuple  # (hedged remaining, cached)
    blocks: int
    ready: float
    sent: float


def _placed_in_turn(left: list, i: int, ranks: Sequence[int], load: _Load, giver_now: float,
                    state: ConsolidationState, rules: ConsolidationRules, prices: MovePrices,
                    hedge: float, densest: Optional[tuple] = None) -> list[_Placed]:
    """`left` onto replica i's `ranks` one after another, each to its least loaded rank with a
    batch slot and KV room (and, with `densest` = (step cost, seconds), whose step with it costs
    no more than those seconds), until one finds none: the promises in order (`_hand_over`
    takes a prefix). `load` is not changed."""
    size = {r: len(load.work[r]) for r in ranks}
    ctx = {r: sum(c for _, c in load.work[r]) for r in ranks}
    free = {r: load.free[r] for r in ranks}
    ready, sent = load.ready[i], load.sent[i]
    out: list[_Placed] = []
    for q, src in left:
        need = blocks_for(int(q.cached_tokens + hedge * q.remaining) + 1, state.block_tokens)
        ok = [r for r in ranks if size[r] < state.max_batch
              and (free[r] is None or free[r] - need >= rules.reserve_blocks)
              and (densest is None
                   or densest[0](size[r] + 1, float(ctx[r] + q.cached_tokens)) <= densest[1])]
        if not ok:
            break
        k_rank = min(ok, key=lambda r: (size[r], ctx[r], r))
        ctx[k_rank] += q.cached_tokens
        size[k_rank] += 1
        if free[k_rank] is not None:
            free[k_rank] -= need
        kind, secs = prices.of(q.cached_tokens)
        if kind == MoveKind.KV_TRANSFER:  # sent from the giver's clock, in turn
            sent += secs
            ready = max(ready, giver_now + sent)
            at = giver_now + sent
        else:  # the taker's prefill step
            ready += secs
            at = 0.0
        out.append(_Placed(Move(q.request_id, src, k_rank, kind, secs, at),
                           (hedge * q.remaining, q.cached_tokens), need, ready, sent))
    return out


def _pull_in(g: int, by_replica, takers, load: _Load, end, taker_end, bound: float,
             state: ConsolidationState, rules: ConsolidationRules, prices: MovePrices
             ) -> list[Move]:
    """The correction (module doc), for a replica g predicted past `bound`: the fewest of its
    longest requests whose leaving brings its predicted end within the bound (a binary search:
    fewer requests never end later), handed to `takers` within the bound; where no taker takes
    them (its longest would run as long elsewhere), g is lightened instead: its other requests,
    longest first, to takers that then still end before g would have, so that g steps faster
    and no taker ends later than g would have. Hedged (`correction_hedge`); the moves, promised
    in `load`, or none when they would not bring g's end in."""
    if not takers:
        return []
    mine = sorted(((q, r.rank) for r in by_replica[g] for q in r.running),
                  key=lambda x: (-x[0].remaining, x[0].request_id))

    def without(ld: _Load, gone) -> _Load:
        ld = ld.copy([r.rank for r in by_replica[g]])
        for q, src in gone:
            ld.work[src].remove((q.remaining, q.cached_tokens))
        return ld

    before = end(g, load)

    def hand(give: list, within: float, hedge: float) -> list[Move]:
        """`give` to the takers within `within`, kept only if g's end comes in."""
        trial = load.copy()
        moves, _ = _hand_over(give[:rules.max_requests], state.now_s[g], takers, by_replica,
                              trial, taker_end, within, state, rules, prices, hedge=hedge)
        if not moves:
            return []
        moved = {m.request_id for m in moves}
        trial = without(trial, [(q, src) for q, src in mine if q.request_id in moved])
        if end(g, trial) >= before:
            return []
        load.adopt(trial)
        return moves

    lo, hi = 1, len(mine)  # the fewest k with g's end within the bound without its first k
    while lo < hi:
        mid = (lo + hi) // 2
        if end(g, without(load, mine[:mid])) <= bound:
            hi = mid
        else:
            lo = mid + 1
    # at most `max_requests` at once (the rest at later checks)
    return (hand(list(mine[:lo]), bound, rules.correction_hedge)
            or (rules.lighten and hand(list(mine[1:]), before, rules.evacuation_hedge)) or [])


def _gather(g: int, by_replica, takers, load: _Load, end, taker_end, bound: float,
            state: ConsolidationState, rules: ConsolidationRules, prices: MovePrices
            ) -> list[Move]:
    """Replica g's longest requests to `takers` (replicas that end later than g, the latest
    first), each taker within `bound` (the rollout's predicted end: nothing ends later) with
    each moved estimate counted `correction_hedge` times (the moved ones are the long ones,
    whose estimates err most), kept only if g's predicted end comes in by more than the moves
    cost the takers: so the long work gathers on the replicas that stay and g leaves sooner.
    The moves, promised in `load`, or none."""
    if not takers:
        return []
    mine = sorted(((q, r.rank) for r in by_replica[g] for q in r.running),
                  key=lambda x: (-x[0].remaining, x[0].request_id))
    before = end(g, load)
    trial = load.copy()
    moves, _ = _hand_over(mine[:rules.max_requests], state.now_s[g], takers, by_replica, trial,
                          taker_end, bound, state, rules, prices, hedge=rules.correction_hedge)
    if not moves:
        return []
    moved = {m.request_id for m in moves}
    trial = trial.copy([r.rank for r in by_replica[g]])
    for q, src in mine:
        if q.request_id in moved:
            trial.work[src].remove((q.remaining, q.cached_tokens))
    # what g's ranks save against what the takers' ranks grow (as estimated, unhedged)
    grown = sum((end(i, trial) - end(i, load)) * len(by_replica[i])
                for i in _replicas_of(moves, by_replica))
    if (before - end(g, trial)) * len(by_replica[g]) <= grown:
        return []
    load.adopt(trial)
    return moves
