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
- the step-cost bound: a lockstep replica steps at its fullest rank's pace, so a taker replica's
  predicted end with the move (its clock, or later when the KV it takes has not arrived by then
  (transfers leave at the giver's clock, one after another; they overlap the taker's decoding),
  or its clock plus a re-prefill's seconds; then its longest remaining work at its pace, plus
  what each request moved in slows its steps for as long as it runs) must stay within the
  rollout's predicted end before the move: a release never lengthens the rollout;
- among takers that keep the bound, the one whose replica is planned to stay longest (latest
  predicted end), then the least loaded rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from flexfloor.rollout.kv import blocks_for

# a rank's step: (requests decoding on it, their cached tokens) -> seconds (scheduler.StepCost)
StepCost = Callable[[int, float], float]


class MoveKind(enum.Enum):
    KV_TRANSFER = "kv_transfer"  # its KV blocks sent to the taker, decoding resumes there
    REPREFILL = "reprefill"  # recomputed on the taker from prompt + what it had produced


@dataclass(frozen=True)
class Running:
    """One running request at the boundary."""

    request_id: str
    cached_tokens: int  # prompt + produced: what its KV holds
    remaining: float  # predicted tokens still to produce (see `remaining_estimate`)


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
    """The staying side's load as moves are promised: per rank (requests, cached tokens, free
    blocks), per replica its longest remaining work and when it can go on."""

    n: dict
    ctx: dict
    free: dict
    longest: dict
    ready: dict  # replica -> when it can step with what it was promised (its clock, or later)
    sent: dict  # replica -> seconds of KV transfers promised to it (one after another)
    extra: dict  # replica -> seconds its steps slow down while the requests moved in run

    def copy(self) -> "_Load":
        return _Load(dict(self.n), dict(self.ctx), dict(self.free), dict(self.longest),
                     dict(self.ready), dict(self.sent), dict(self.extra))


def decide(state: ConsolidationState, rules: ConsolidationRules, step_cost: StepCost,
           prices: MovePrices, givers: Optional[Sequence[int]] = None) -> Consolidation:
    """The consolidation at this boundary, from the shared state alone (see the module doc).
    `givers`: the replicas that may give (None: any; the simulator, whose replicas run on their
    own clocks, lets only the one at the earliest clock give)."""
    by_replica: dict[int, list[RankState]] = {}
    for r in state.ranks:
        by_replica.setdefault(r.replica, []).append(r)
    live = [i for i, rs in sorted(by_replica.items()) if any(r.running or r.queued for r in rs)]
    if len(live) <= rules.min_replicas:
        return Consolidation()
    ranks = [r for rs in by_replica.values() for r in rs]
    load = _Load(n={r.rank: len(r.running) for r in ranks},
                 ctx={r.rank: float(sum(q.cached_tokens for q in r.running)) for r in ranks},
                 free={r.rank: r.kv_free_blocks for r in ranks},
                 longest={i: max((q.remaining for r in by_replica[i] for q in r.running),
                                 default=0.0) for i in live},
                 ready={i: state.now_s[i] for i in live}, sent={i: 0.0 for i in live},
                 extra={i: 0.0 for i in live})
    pace0 = {i: _pace(by_replica[i], load, step_cost) for i in live}

    def end(i: int, ld: _Load) -> float:
        """Replica i's predicted end: when it can go on (its clock, or the arrival of the KV it
        was promised, or its clock plus the re-prefills), then its longest work at its fullest
        rank's pace now, plus what each request moved in slows its steps while it runs."""
        return ld.ready[i] + ld.longest[i] * pace0[i] + ld.extra[i]

    rollout_end = max(end(i, load) for i in live)
    size = {i: sum(len(r.running) for r in by_replica[i]) for i in live}
    candidates = [i for i in live if (givers is None or i in givers)
                  and not any(r.queued for r in by_replica[i])
                  and 0 < size[i] <= rules.max_requests]
    candidates.sort(key=lambda i: (size[i], end(i, load), i))
    giving: list[int] = []
    moves: list[Move] = []
    for g in candidates:
        if len(live) - len(giving) - 1 < rules.min_replicas:
            break
        if any(m.dst in {r.rank for r in by_replica[g]} for m in moves):
            continue  # it takes requests in this decision: it stays
        staying = [i for i in live if i != g and i not in giving]
        trial = load.copy()
        got = _evacuate(by_replica[g], state.now_s[g], staying, by_replica, trial, end,
                        rollout_end, state, rules, prices, step_cost)
        if got is not None:
            moves += got
            giving.append(g)
            load = trial
    return Consolidation(moves=moves, leaving_replicas=sorted(giving))


def _pace(ranks: Sequence[RankState], load: _Load, step_cost: StepCost) -> float:
    """A lockstep replica's step: its fullest rank's."""
    return max((float(step_cost(load.n[r.rank], load.ctx[r.rank])) for r in ranks
                if load.n[r.rank]), default=0.0)


def _evacuate(giver: Sequence[RankState], giver_now: float, staying, by_replica, load: _Load,
              end, rollout_end, state: ConsolidationState, rules: ConsolidationRules,
              prices: MovePrices, step_cost: StepCost) -> Optional[list[Move]]:
    """Every running request of `giver` onto ranks of `staying` replicas within the bounds,
    longest first, promising them in `load`; None when one does not fit (then `load` is to be
    dropped)."""
    reqs = sorted(((q, r.rank) for r in giver for q in r.running),
                  key=lambda x: (-x[0].remaining, x[0].request_id))
    order = sorted(staying, key=lambda i: (-end(i, load), i))  # planned to stay longest first
    moves = []
    for q, src in reqs:
        kind, secs = prices.of(q.cached_tokens)
        need = blocks_for(int(q.cached_tokens + q.remaining) + 1, state.block_tokens)
        move = None
        for i in order:
            for r in sorted(by_replica[i], key=lambda r: (load.n[r.rank], load.ctx[r.rank], r.rank)):
                k = r.rank
                if load.n[k] + 1 > state.max_batch:
                    continue
                if load.free[k] is not None and load.free[k] - need < rules.reserve_blocks:
                    continue
                before = (load.n[k], load.ctx[k], load.longest[i], load.ready[i], load.sent[i],
                          load.extra[i])
                slower = -_pace(by_replica[i], load, step_cost)
                load.n[k], load.ctx[k] = load.n[k] + 1, load.ctx[k] + q.cached_tokens
                slower += _pace(by_replica[i], load, step_cost)
                load.extra[i] += slower * min(q.remaining, load.longest[i])
                if q.remaining > load.longest[i]:  # it outlasts the replica's own work
                    load.extra[i] += (q.remaining - load.longest[i]) * _pace(by_replica[i], load,
                                                                              step_cost)
                load.longest[i] = max(load.longest[i], q.remaining)
                if kind == MoveKind.KV_TRANSFER:  # sent from the giver's clock, in turn
                    load.sent[i] += secs
                    load.ready[i] = max(load.ready[i], giver_now + load.sent[i])
                else:  # the taker's prefill step
                    load.ready[i] += secs
                if end(i, load) <= rollout_end:
                    if load.free[k] is not None:
                        load.free[k] -= need
                    move = Move(q.request_id, src, k, kind, secs,
                                giver_now + load.sent[i] if kind == MoveKind.KV_TRANSFER else 0.0)
                    break
                (load.n[k], load.ctx[k], load.longest[i], load.ready[i], load.sent[i],
                 load.extra[i]) = before
            if move:
                break
        if move is None:
            return None
        moves.append(move)
    return moves
