"""Tail consolidation in the engine: the requests still running on a rank, or on a whole replica,
move to ranks that stay, so the giver leaves now rather than when its last request ends.

The decision is `flexfloor.rollout.consolidate.decide` (the function the simulator drives); this
module feeds it what the engine knows and carries its moves out:
- within a replica (one lockstep EP group, one clock): every rank is a giver or a taker of its
  own (`within_replica`: each rank stands for a "replica" of one rank in the decision's state).
  The ranks share their running requests in one gather, every rank computes the same moves,
  the engine's migration gather carries the requests (`RolloutEngine._migrate`) and the release
  decision lets the givers go at the same boundary. Moves are kept only when every giver
  really leaves (memory floor, prebuilt survivor groups); otherwise nothing moves.
- across replicas (independent EP groups on their own clocks, no world collective during a
  rollout; `elastic.consolidate_across`, off by default: which step of the taker a hand-over
  lands at depends on the replicas' timing, so the ranks' steps vary from run to run, never the
  tokens): `Mailbox`, a protocol on the job's key-value store. Each replica's leader (the
  lowest rank of its current group) posts its ranks' states and its clock at every boundary;
  a replica that may give (nothing queued, few running; or, with the correction, nothing
  queued at a check of its end) closes its own inbox, reads the
  others' latest states, decides with itself as the only giver, claims each taker's inbox
  (compare-and-set "open" -> "busy:<giver>"), writes the requests and reopens it; a taker's
  leader reads its inbox at every boundary and its group learns the arrivals in the gather it
  does anyway; a replica closes its inbox ("open" -> "closed") before it leaves (busy: it steps
  on and retries) and re-reads it after closing. No request is lost: a request is written
  only into an inbox held busy by its giver, and a closed inbox was read after closing.

How a moved request gets its K/V to the taker (`MoveKind`, `elastic.move_kv`): inside a replica,
by the decision's prices (`MoveCosts.prices`: the model's KV bytes per token over
`elastic.kv_link_bytes_per_s` against a re-prefill at `elastic.reprefill_s_per_token`; `transfer`
or `reprefill` force one). The migration's gather carries the request as before, and one
all-to-all over the group at that boundary (one per boundary, not per request:
`RolloutEngine._migrate`) the stored K/V of every request moved with it (`BlockPool.export_kv`);
the taker stores it in its own blocks and decodes on at its next step. A re-prefill recomputes prompt + what it produced on the taker.
Either way the sampling stream is keyed by position: the same tokens. Across replicas a move
always re-prefills: the mailbox is the job's key-value store, a channel for small pickled
values, not for tensors (`REPREFILL_ONLY`). Clocks are engine steps and a step costs 1
(`UNIT_STEP`), and on that clock neither kind costs the moved request a step (the taker decodes
it at its next step, or the adopting step prefills and samples it), so the prices choose the
kind and the step-cost bound becomes "no taker ends after the rollout's predicted end"
(`OnStepClock`).
Across replicas each replica's clock is its own step count as its leader last posted it (a
taker has stepped on since: the bound holds up to that staleness); a moved request then runs
at the taker's steps. With a plan by modelled seconds (`scheduler.plan_seconds`) the clock is
the replica's modelled seconds instead (`ModelledClock`: each step priced by
elastic.pace_model's cost model from every rank's traced load, as `price_trace` prices it),
the decision projects on the plan's per-rank step cost and a move's re-prefill costs the
taker the cost model's prefill seconds, before any of its requests steps on: the simulator's
GPU scenarios' clock and prices.
A request's remaining tokens are predicted from what the engine knows: the median of its
siblings finished on this rank in this rollout, corrected once it outlives them, and with none
finished its cap (`remaining_tokens`). With `elastic.plan_estimates` (off by default; measured
in docs/launch.md) the trainer and the benchmark pass the rollout's plan instead
(`RunningEstimates`), predicted as the simulator predicts them: its prompt's history,
distrusted once the samples finished on this rank prove it wrong, else the longest of its
siblings finished on this rank, else the prior; corrected once it outlives that
(`remaining_estimate`). Inside a replica every estimate is the cap
(below). A workload's `target_len` is never read as a prediction.

Across replicas the engine can run the simulator's hedges (flexfloor/sim/scenarios.py,
`tail_consolidation`) on its own clock: `elastic.consolidate_taker_hedge` (a taker counts its own
running requests at that times their estimate, and those whose estimate is a bound, the cap, or
known wrong, outlived their siblings, at their cap: `worst_tokens`) and
`elastic.consolidate_correct` (the online correction, `ConsolidationState.end_bound_s`, with the
end to keep on the replicas' clock: the plan's `finish_bound`, `end_to_keep`, in engine steps or
a plan by seconds' modelled seconds; a late replica's leader checks it from half that end on,
every hundredth of it, hands its longest requests over and stays: `Across.CORRECT`). Of the
simulator's GPU hedges the engine lacks `no_denser` (a leaving replica's requests only to ranks
stepping no dearer than its fullest once the history proves wrong) and `gather`. Inside a
replica neither hedge nor correction applies: every estimate there is the request's cap, a
bound, on one clock, so a hedge on it only refuses moves that fit, and the replica's end is its
longest request's wherever in the group it runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from flexfloor.config import ElasticConfig, MoveKV
from flexfloor.rollout.collectives import CollectiveError, gather_objects
from flexfloor.rollout.consolidate import (
    Consolidation,
    ConsolidationRules,
    ConsolidationState,
    Move,
    MoveKind,
    MovePrices,
    RankState,
    Running,
    StepCost,
    decide,
    remaining_estimate,
)
from flexfloor.rollout.kv import blocks_for


def UNIT_STEP(n: int, ctx: float) -> float:  # noqa: N802  (a constant StepCost)
    """A step costs 1 whatever its batch: the engine's clock is its step count."""
    return 1.0


# across replicas (the mailbox carries no tensors), and `within_replica`'s default (what the
# simulator's replay of a replica applies): a transfer's time is unbounded, a re-prefill costs
# the taker no extra step (the step that adopts a request prefills it and samples its next token)
REPREFILL_ONLY = MovePrices(kv_bytes_per_token=1, transfer_bytes_per_s=sys.float_info.min,
                            reprefill_s_per_token=0.0)


@dataclass(frozen=True)
class OnStepClock(MovePrices):
    """Real prices on the engine's step clock: they choose a move's kind (its KV bytes over the
    link, or its re-prefill), and either kind costs the moved request no engine step (a
    transfer lands before the taker's next step, a re-prefill runs in it), so a move's seconds
    on that clock are 0."""

    def of(self, cached_tokens: int) -> tuple[MoveKind, float]:
        return super().of(cached_tokens)[0], 0.0


@dataclass(frozen=True)
class MoveCosts:
    """How a move inside a replica travels (elastic.move_kv, elastic.kv_link_bytes_per_s,
    elastic.reprefill_s_per_token)."""

    mode: MoveKV
    link_bytes_per_s: float
    reprefill_s_per_token: float

    @classmethod
    def of(cls, elastic_cfg) -> "MoveCosts":
        """The config's (the section's defaults when no config was given)."""
        elastic_cfg = ElasticConfig() if elastic_cfg is None else elastic_cfg
        return cls(mode=elastic_cfg.move_kv, link_bytes_per_s=elastic_cfg.kv_link_bytes_per_s,
                   reprefill_s_per_token=elastic_cfg.reprefill_s_per_token)

    def prices(self, kv_bytes_per_token: int) -> OnStepClock:
        """The decision's prices for a model of `kv_bytes_per_token` (K and V, every layer):
        auto as configured; transfer: a re-prefill never wins; reprefill: a transfer never
        does."""
        link, pre = self.link_bytes_per_s, self.reprefill_s_per_token
        if self.mode == MoveKV.TRANSFER:
            pre = math.inf
        elif self.mode == MoveKV.REPREFILL:
            link = sys.float_info.min
        return OnStepClock(kv_bytes_per_token=kv_bytes_per_token, transfer_bytes_per_s=link,
                           reprefill_s_per_token=pre)


@dataclass(frozen=True)
class TailRules:
    """The consolidation knobs of the config (elastic.consolidate_*) and the floor."""

    max_requests: int = 8  # most running requests a rank or replica hands over to leave
    reserve_blocks: int = 0  # KV blocks a taker keeps free beyond what it takes
    floor: int = 1  # ranks of a replica that stay whatever fits (elastic.min_active_ranks)
    across: bool = False  # also between replicas (the mailbox)
    # across replicas only (module doc): a taker's own requests at this times their estimate
    # (elastic.consolidate_taker_hedge), and the online correction (elastic.consolidate_correct)
    taker_hedge: float = 1.0
    correct: bool = False

    @classmethod
    def of(cls, elastic_cfg, floor: int) -> Optional["TailRules"]:
        """None when consolidation is off (or no config was given)."""
        if elastic_cfg is None or not elastic_cfg.consolidate:
            return None
        return cls(max_requests=elastic_cfg.consolidate_max_requests,
                   reserve_blocks=elastic_cfg.consolidate_reserve_blocks, floor=floor,
                   across=elastic_cfg.consolidate_across,
                   taker_hedge=elastic_cfg.consolidate_taker_hedge,
                   correct=elastic_cfg.consolidate_correct)

    def within_rules(self) -> ConsolidationRules:
        """Inside a replica (`within_replica`): the floor's ranks stay, no hedge (every
        estimate there is the request's cap, a bound, on one clock: module doc)."""
        return ConsolidationRules(min_replicas=self.floor, reserve_blocks=self.reserve_blocks,
                                  max_requests=self.max_requests, hedged=False)

    def across_rules(self) -> ConsolidationRules:
        """Between replicas (`across_replicas`): the hedged rules, with the taker's hedge and,
        with the correction, a leaving replica's requests counted half as long again on their
        takers (the simulator's rules with `Scenario.correct`)."""
        return ConsolidationRules(min_replicas=1, reserve_blocks=self.reserve_blocks,
                                  max_requests=self.max_requests, taker_hedge=self.taker_hedge,
                                  evacuation_hedge=1.5 if self.correct else 1.0)


# --------------------------------------------------------------------------------------------
# pure pieces (no process group)


def remaining_tokens(max_new_tokens: int, produced: int, siblings: Sequence[int]) -> float:
    """Predicted tokens still to come: from the median length of the siblings already finished
    (the same prompt, this rollout), corrected once the request outlives it
    (`remaining_estimate`); with no sibling finished, up to `max_new_tokens` (nothing known: a
    move must then fit even if the request runs to its cap)."""
    if not siblings:
        return float(max(1, max_new_tokens - produced))
    return remaining_estimate(float(statistics.median(siblings)), produced, max_new_tokens)


def worst_tokens(max_new_tokens: int, produced: int, siblings: Sequence[int]) -> Optional[float]:
    """The most a request may still produce where its estimate (`remaining_tokens`) is a bound
    or known wrong: up to its cap with no sibling finished (the estimate is the cap) or once it
    has outlived its siblings' median; None while the siblings' median is still ahead of it.
    A taker counts its own such requests at this (`consolidate.Running.worst`)."""
    if siblings and produced < statistics.median(siblings):
        return None
    return float(max(1, max_new_tokens - produced))


@dataclass
class RunningEstimates:
    """How long a running request will be, from its rollout's plan: what the decisions across
    replicas and the pace rule read, in the engine (`rank_state`) and in the simulator
    (flexfloor/sim/scenarios.py, `tail_consolidation`): one rule for both. A prompt with
    history: the plan's prediction (its longest sample last time), unless the history has proved
    wrong in this rollout (`LengthHistory.unproven` of the samples finished so far, with
    `distrust`); then, as a prompt without history: the longest of its siblings finished, else
    the prior. A plan placed as static (`RolloutPlan.distrusted`): no prompt's history counts.
    `finished`: prompt uid -> the lengths of its samples finished so far (the engine: on this
    rank; the simulator: anywhere), one dict per decision (judged once, by identity)."""

    predictor: object  # scheduler.Predictor
    predicted: dict  # prompt uid -> the plan's prediction (`RolloutPlan.predicted`)
    per_request: dict  # request id -> the plan's prediction (`RolloutPlan.per_request`)
    with_history: frozenset  # prompt uids predicted from their own history
    distrusted: bool = False
    distrust: bool = True
    _verdict: list = field(default_factory=lambda: [None, False], repr=False)
    _untrusting: object = field(default=None, repr=False)  # the predictor without history

    @classmethod
    def of_plan(cls, plan, predictor, *, distrust: bool = True) -> "RunningEstimates":
        if plan.distrusted:  # the last rollout proved the history wrong: siblings and the prior
            predictor = replace(predictor, trust_history=False)
        with_history = frozenset(uid for uid in plan.predicted
                                 if predictor.trust_history and predictor.history.last(uid))
        return cls(predictor, dict(plan.predicted), dict(plan.per_request), with_history,
                   plan.distrusted, distrust,
                   _untrusting=replace(predictor, trust_history=False))

    def history_wrong(self, finished: dict) -> bool:
        """Whether the history has proved wrong in this rollout, from `finished`."""
        if not (self.distrust and self.with_history):
            return False
        if self._verdict[0] is not finished:
            self._verdict[:] = [finished, self.predictor.history.unproven(finished)]
        return self._verdict[1]

    def length(self, uid: int, request_id: str, finished: dict) -> float:
        """The predicted length of request `request_id` of prompt `uid`."""
        if (self.history_wrong(finished) if uid in self.with_history else finished.get(uid)):
            return self._untrusting.predict(uid, finished.get(uid, ()))[0]
        if self.distrusted:  # the prior, not the plan's (history's) prediction
            return self.predictor.predict(uid)[0]
        return self.predicted.get(uid, self.per_request.get(request_id, 0.0))

    def running(self, uid: int, request_id: str, produced: int, cap: int,
                finished: dict) -> tuple[float, Optional[float]]:
        """(tokens still to come, the most it may still produce) of a request that produced
        `produced`: its length less that (`remaining_estimate`: corrected once it outlives its
        length); and once it has outlived its length (known wrong) up to its cap, else None
        (`Running.worst`)."""
        n = self.length(uid, request_id, finished)
        return (remaining_estimate(n, produced, cap),
                float(cap - produced) if produced >= n else None)


def end_to_keep(plan) -> Optional[float]:
    """The rollout's end the correction keeps: the plan's `finish_bound` (the static baseline's
    predicted end), in engine steps, or for a plan by modelled seconds
    (`scheduler.plan_seconds`, `plan.by_seconds`) in those seconds (the replicas then run on a
    `ModelledClock`), where some prompt was predicted from its history; else None (from the
    prior alone it is a guess: the simulator's rule, flexfloor/sim/scenarios.py)."""
    if plan is None or plan.finish_bound is None or not plan.sources.get("history"):
        return None
    return float(plan.finish_bound)


@dataclass
class ModelledClock:
    """A replica's clock in modelled seconds, for a plan by seconds (`scheduler.plan_seconds`):
    each step of the replica priced by the cost model (elastic.pace_model) as `price_trace`
    prices it, from every rank's traced load, which the step report carries
    (`StepReport.traced`: no collective of its own), so every rank of the replica keeps the
    same clock. The decision then projects ends on the plan's per-rank step cost and prices a
    move's re-prefill in the cost model's seconds, as the simulator's GPU scenarios do. Not on
    it, unlike `price_trace`: a shrink's stall and a KV transfer inside the replica (the GPU
    policy's floor is the whole replica, so it neither shrinks nor moves inside; with a lower
    floor a shrunk replica's clock runs behind its modelled seconds by each stall). Across
    replicas a move re-prefills, which the taker's traced prefill tokens price."""

    cost: object  # the cost model (`elastic.pace_cost_of`)
    step_cost: StepCost  # a rank's step, the decision's projections (the plan's, per rank)
    prices: MovePrices  # a move across replicas: re-prefilled, at the cost model's prefill
    seconds: float = 0.0
    priced: int = 0  # steps of this replica priced so far

    def advance(self, report, trace) -> None:
        """Price the step that just ran (`report.traced`, every rank's), once; `trace`: this
        rank's (the group and placement the step ran in)."""
        from flexfloor.sim.cost import traced_step_seconds

        if trace.steps == self.priced:
            return
        if trace.steps != self.priced + 1 or not report.traced:
            raise ValueError(f"the modelled clock priced {self.priced} steps and the trace "
                             f"holds {trace.steps}: it prices one step at each boundary")
        self.seconds += traced_step_seconds(report.traced, trace.group_at(self.priced).owner,
                                            trace, self.cost)
        self.priced += 1


def across_replicas(states: Sequence[RankState], clocks: dict, giver: int, rules: TailRules, *,
                    max_batch: int, block_tokens: int, end_bound: Optional[float] = None,
                    correct: bool = False, clock: Optional[ModelledClock] = None,
                    shrunk: frozenset = frozenset()) -> Consolidation:
    """The decision of replica `giver` at its boundary, from every replica's latest ranks'
    states and clock (`clocks`: replica -> its clock, engine steps, or with `clock` modelled
    seconds, projected on its step cost and prices): it gives everything and leaves
    (`leaving_replicas`), or, with `correct` and `end_bound` (`end_to_keep`, on the same
    clock), hands its longest requests over and stays (`corrected_replicas`), or nothing
    moves. `shrunk`: the replicas with fewer ranks than they started with, which give but never
    take (`ConsolidationState.shrunk`). Pure."""
    bound = end_bound if rules.correct else None
    state = ConsolidationState(tuple(states), dict(clocks), max_batch, block_tokens,
                               end_bound_s=bound, correct=correct and bound is not None,
                               shrunk=frozenset(shrunk))
    step_cost, prices = ((UNIT_STEP, REPREFILL_ONLY) if clock is None
                         else (clock.step_cost, clock.prices))
    return decide(state, rules.across_rules(), step_cost, prices, givers=[giver])


def may_give_within(report, rules: TailRules) -> bool:
    """From the shared step report alone: some rank could hand its requests over (nothing
    queued, 1..max_requests running) and more ranks have work than the floor keeps."""
    working = sum(report.has_work)
    return working > rules.floor and any(
        q == 0 and 0 < n <= rules.max_requests for n, q in zip(report.running, report.queued))


def within_replica(states: Sequence[RankState], rules: TailRules, *, max_batch: int,
                   block_tokens: int, prices: MovePrices = REPREFILL_ONLY) -> Consolidation:
    """The moves inside one lockstep group: each rank a giver or taker of its own (one clock).
    `leaving_replicas` are then the giving ranks. `prices` choose each move's kind, on the step
    clock (`MoveCosts.prices`; the default re-prefills every move)."""
    ranks = tuple(replace(s, replica=s.rank) for s in states)
    state = ConsolidationState(ranks, {s.rank: 0.0 for s in ranks}, max_batch, block_tokens)
    return decide(state, rules.within_rules(), UNIT_STEP, prices)


def after_moves(report, ranks: Sequence[int], moves: Sequence[Move], cached: dict,
                block_bytes: int, block_tokens: int):
    """The step report as it is once `moves` are done: the givers without work, each taker
    with the requests it takes and the KV room their re-prefill takes. `cached`: request id
    -> its cached tokens. Pure."""
    has, running = list(report.has_work), list(report.running)
    remaining, kv_free = list(report.remaining), list(report.kv_free)
    for src in {m.src for m in moves}:
        i = ranks.index(src)
        has[i], running[i], remaining[i] = False, 0, 0
    for m in moves:
        j = ranks.index(m.dst)
        has[j] = True
        running[j] += 1
        remaining[j] = max(remaining[j], report.remaining[ranks.index(m.src)])
        kv_free[j] -= blocks_for(cached[m.request_id] + 1, block_tokens) * block_bytes
    return replace(report, has_work=has, running=running, remaining=remaining, kv_free=kv_free)


def rank_state(engine, replica: int, *, siblings: bool = True,
               estimates: Optional[RunningEstimates] = None) -> RankState:
    """This rank's running requests, queue and free KV blocks, as the decision reads them.
    With `estimates` (the rollout's plan) each request is predicted as `RunningEstimates`
    says, from the samples finished on this rank; else, with `siblings`, from the siblings
    finished on this rank (`remaining_tokens`); else each request's cap."""
    st = engine.rollout
    finished: dict[int, list[int]] = {}
    for res in st.results if siblings or estimates is not None else ():
        finished.setdefault(res.prompt_uid, []).append(len(res.token_ids))
    running = []
    for r in st.running:
        q, produced = r.request, len(r.tokens)
        if estimates is not None:
            remaining, worst = estimates.running(q.prompt_uid, q.request_id, produced,
                                                 q.max_new_tokens, finished)
        else:
            sib = finished.get(q.prompt_uid, ())
            remaining = remaining_tokens(q.max_new_tokens, produced, sib)
            worst = worst_tokens(q.max_new_tokens, produced, sib)
        running.append(Running(q.request_id, r.position, remaining, worst))
    return RankState(engine.rank, replica, tuple(running), len(st.queue), st.pool.free_blocks)


# --------------------------------------------------------------------------------------------
# across replicas: the mailbox on the job's store

OPEN, CLOSED = "open", "closed"


class Across(enum.Enum):
    """What the mailbox settled for a replica at one boundary (`Mailbox.boundary`)."""

    DECIDE = "decide"  # the release decision as usual (with any arrivals counted)
    WAIT = "wait"  # done, but a giver holds this replica's inbox busy: step on idle and retry
    HAND_OVER = "hand_over"  # this replica gives every running request away and leaves whole
    CORRECT = "correct"  # this replica hands its longest requests over and stays (the correction)


@dataclass
class MailboxBoundary:
    """The mailbox's outcome at one boundary, the same on every rank of the replica; the
    membership applies it."""

    action: Across
    report: object  # the step report: arrivals queued on their takers (WAIT: only the leader works)
    states: list  # every rank's RankState, from the replica's gather
    arrivals: list = field(default_factory=list)  # the payloads this rank adopts
    # requests arrived at some rank of the replica (the same on every rank, unlike `arrivals`)
    arrived: bool = False
    moves: list = field(default_factory=list)  # HAND_OVER, CORRECT: each request's taker (Move)


@dataclass
class Mailbox:
    """One replica's side of the consolidation protocol across replicas (module doc). Every
    rank of the replica holds one; only the current leader touches the store, and the group
    shares what it read (`consumed`) so a later leader goes on from there.

    Keys under `flexfloor/tails/<rollout id>/`: status/<i> ("open", "busy:<giver>", "closed"),
    count/<i> (messages committed), msg/<i>/<n> (a list of (taker rank, request payload)),
    state/<i> (the leader's last post: (clock, [RankState])).
    """

    store: object  # torch.distributed.Store
    rollout_id: str
    replica: int
    replicas: int
    ranks_per_replica: int
    rank: int
    timeout_s: float
    # the rollout's end to keep (`end_to_keep`), on this replica's clock; None: no correction
    end_bound: Optional[float] = None
    # the replicas' clocks in modelled seconds (a plan by seconds); None: in engine steps
    clock: Optional[ModelledClock] = None
    # each running request's prediction from the rollout's plan; None: siblings, else its cap
    estimates: Optional[RunningEstimates] = None
    consumed: int = 0  # messages of this replica's inbox already read
    opened: bool = False
    claimed: list = field(default_factory=list)  # taker replicas this leader holds busy
    _busy_since: Optional[float] = None
    _check_at: Optional[float] = None  # when this replica's end is next checked (its clock)

    def now(self, engine) -> float:
        """This replica's clock: its modelled seconds (`clock`), else its engine steps."""
        return self.clock.seconds if self.clock is not None else float(engine.record.steps)

    def correction_due(self, clock: float, rules: TailRules) -> bool:
        """Whether this replica's end is checked against the end to keep at `clock` (`now`):
        from half that end on, a hundredth of it apart (at least a step apart on the step
        clock; the simulator's checks). The same on every rank of the replica (its ranks step
        together and keep the same clock)."""
        if not rules.correct or self.end_bound is None:
            return False
        if self._check_at is None:
            self._check_at = self.end_bound / 2
        if clock < self._check_at:
            return False
        gap = self.end_bound / 100
        self._check_at = clock + (gap if self.clock is not None else max(1.0, gap))
        return True

    def key(self, kind: str, i: int, n: Optional[int] = None) -> str:
        return f"flexfloor/tails/{self.rollout_id}/{kind}/{i}" + ("" if n is None else f"/{n}")

    def _where(self, phase: str) -> str:
        return f"rank {self.rank}, phase 'tail consolidation ({phase})', replica {self.replica}"

    def _call(self, phase: str, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:
            raise CollectiveError(f"{self._where(phase)}: the job's store failed "
                                  f"({type(e).__name__}: {e})") from e

    def open(self) -> None:
        """The inbox exists and takes requests (once, by the first leader)."""
        if not self.opened:
            self._call("open", self.store.compare_set, self.key("status", self.replica), "", OPEN)
            self.opened = True

    def take_mail(self) -> list:
        """Every (taker rank, payload) committed to this inbox since the last read."""
        s = self.store
        n = int(self._call("read inbox", s.add, self.key("count", self.replica), 0))
        out = []
        for k in range(self.consumed, n):
            out += pickle.loads(self._call("read inbox", s.get, self.key("msg", self.replica, k)))
        self.consumed = n
        return out

    def close(self) -> bool:
        """Close the inbox before leaving (or giving): False while a giver holds it busy (step
        on and retry); an error naming the rank when it stays busy past the timeout."""
        got = self._call("close inbox", self.store.compare_set, self.key("status", self.replica),
                         OPEN, CLOSED).decode()
        if got == CLOSED:
            self._busy_since = None
            return True
        now = time.monotonic()
        self._busy_since = self._busy_since or now
        if now - self._busy_since > self.timeout_s:
            raise CollectiveError(f"{self._where('close inbox')}: the inbox stayed {got!r} for "
                                  f"{self.timeout_s:.0f} s (parallel.timeout_s): its giver died "
                                  "or hangs")
        return False

    def reopen(self) -> None:
        self._call("reopen inbox", self.store.set, self.key("status", self.replica), OPEN)

    def post(self, clock: float, states: Sequence[RankState]) -> None:
        self._call("post state", self.store.set, self.key("state", self.replica),
                   pickle.dumps((clock, list(states))))

    def shrunk(self, survivors: Sequence[int]) -> None:
        """After a shrink inside this replica, on each survivor: the new leader posts the
        survivors' states of the last boundary's post at once. Until the next boundary's post,
        the other replicas' leaders would read every rank the replica started the step with,
        count it whole and hand it requests (a shrunk replica gives but never takes)."""
        key = self.key("state", self.replica)
        if self.rank != min(survivors) or not self.store.check([key]):
            return
        clock, states = pickle.loads(self._call("read states", self.store.get, key))
        keep = set(survivors)
        self.post(clock, [s for s in states if s.rank in keep])

    def plan(self, clock: float, states: Sequence[RankState], rules: TailRules, *, max_batch: int,
             block_tokens: int, correct: bool = False) -> Consolidation:
        """The leader of a replica that may give or check its end (`correct`; its own inbox
        closed): the others' latest states, `across_replicas` with this replica the only giver,
        and a claim on every taker's inbox (all or none). Returns the decision (no moves:
        nothing moves now)."""
        s = self.store
        ranks, now = list(states), {self.replica: float(clock)}
        for i in range(self.replicas):
            if i == self.replica or not s.check([self.key("state", i), self.key("status", i)]):
                continue
            if self._call("read states", s.get, self.key("status", i)).decode() != OPEN:
                continue
            their_clock, theirs = pickle.loads(self._call("read states", s.get,
                                                          self.key("state", i)))
            ranks += theirs
            now[i] = float(their_clock)
        if len(now) < 2:
            return Consolidation()
        # a replica posts its group's states: fewer than it started with once it has shrunk
        shrunk = frozenset(i for i in now
                           if sum(s.replica == i for s in ranks) < self.ranks_per_replica)
        d = across_replicas(ranks, now, self.replica, rules, max_batch=max_batch,
                            block_tokens=block_tokens, end_bound=self.end_bound, correct=correct,
                            clock=self.clock, shrunk=shrunk)
        if not d.moves:
            return Consolidation()
        me = f"busy:{self.replica}"
        for t in sorted({self.replica_of(m.dst) for m in d.moves}):
            got = self._call("claim inbox", s.compare_set, self.key("status", t), OPEN, me)
            if got.decode() != me:
                self.release_claims()
                return Consolidation()
            self.claimed.append(t)
        return d

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica

    def boundary(self, engine, report, rules: TailRules) -> MailboxBoundary:
        """This replica's side of the protocol at a step boundary, on every rank of its group:
        the leader reads the inbox and closes it when the replica is done, may give or checks
        its end (`correction_due`); one gather shares what it read and every rank's state; the
        leader posts the state; a replica that may give or checks its end (and closed its
        inbox) plans with the others' states and, when a move fits, hands everything over
        (HAND_OVER) or its longest requests (CORRECT). Collective over the replica's group."""
        ranks = list(engine.moe.placement.ranks)
        leader = ranks[0]
        if self.clock is not None:
            self.clock.advance(report, engine.record.trace)
        now = self.now(engine)
        done = not any(report.has_work)
        can_give = not any(report.queued) and 0 < sum(report.running) <= rules.max_requests
        due = (self.correction_due(now, rules) and not any(report.queued)
               and sum(report.running) > 0)
        plans = can_give or due  # it may hand requests over at this boundary
        mail, closed = [], False
        if engine.rank == leader:
            self.open()
            mail = self.take_mail()
            if done or (plans and not mail):
                closed = self.close()
                if closed:
                    mail += self.take_mail()  # committed before the close
            else:  # no wait on a busy inbox goes on: a later one is timed from its own start
                self._busy_since = None
        everyone = gather_objects(engine.moe.group, (rank_state(engine, self.replica,
                                                                estimates=self.estimates),
                                                     (mail, closed, self.consumed, due, plans)))
        states = [s for s, _ in everyone]
        # the leader's view for every rank: what follows branches into collectives, and a
        # modelled clock is a float each rank sums on its own
        mail, closed, self.consumed, due, plans = everyone[0][1]
        dst = [t if t in ranks else leader for t, _ in mail]  # a taker since released: leader
        arrivals = [p for t, (_, p) in zip(dst, mail) if t == engine.rank]
        if mail:
            has, queued = list(report.has_work), list(report.queued)
            for t in dst:
                has[ranks.index(t)] = True
                queued[ranks.index(t)] += 1
            report = dataclasses.replace(report, has_work=has, queued=queued)
        if engine.rank == leader:
            self.post(now, states)
            if closed and (mail or not (done or plans)):
                self.reopen()  # work arrived: this replica stays
        usual = MailboxBoundary(Across.DECIDE, report, states, arrivals, arrived=bool(mail))
        if mail:
            return usual
        if done and not closed:
            idle = dataclasses.replace(report, has_work=[r == leader for r in ranks])
            return MailboxBoundary(Across.WAIT, idle, states)
        if not (plans and closed) or done:
            return usual
        d = (self.plan(now, states, rules, max_batch=engine.max_batch_size,
                       block_tokens=engine.block_tokens, correct=due)
             if engine.rank == leader else None)
        d = gather_objects(engine.moe.group, d)[0]
        if not d.moves:
            if engine.rank == leader:
                self.reopen()
            return usual
        if self.replica in d.leaving_replicas:
            return MailboxBoundary(Across.HAND_OVER, report, states, moves=d.moves)
        return MailboxBoundary(Across.CORRECT, report, states, moves=d.moves)

    def send(self, moves: Sequence[Move], payloads: Sequence[dict]) -> None:
        """Write each claimed taker's requests (one message each), then reopen its inbox."""
        by_id = {p["request"].request_id: p for p in payloads}
        for t in self.claimed:
            mail = [(m.dst, by_id[m.request_id]) for m in moves if self.replica_of(m.dst) == t]
            n = int(self._call("send", self.store.add, self.key("count", t), 0))
            self._call("send", self.store.set, self.key("msg", t, n), pickle.dumps(mail))
            self._call("send", self.store.add, self.key("count", t), 1)  # committed
        self.release_claims()

    def release_claims(self) -> None:
        for t in self.claimed:
            self._call("release claim", self.store.compare_set, self.key("status", t),
                       f"busy:{self.replica}", OPEN)
        self.claimed = []


def mailbox_for(store, rollout_id: str, topology, rank: int, timeout,
                end_bound: Optional[float] = None,
                clock: Optional[ModelledClock] = None,
                estimates: Optional[RunningEstimates] = None) -> Mailbox:
    timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return Mailbox(store=store, rollout_id=rollout_id, replica=topology.index,
                   replicas=topology.count, ranks_per_replica=topology.ranks_per_replica,
                   rank=rank, timeout_s=float(timeout_s), end_bound=end_bound, clock=clock,
                   estimates=estimates)
