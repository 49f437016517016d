"""One rollout on N simulated ranks: the engine's step semantics, the real release decision.

Each rank mirrors `RolloutEngine.generate`: admit requests in the order given while a batch slot
and KV room are free (a request reserves prompt + response tokens; borrowed experts take room),
one step feeds each running request its pending tokens (the prompt at admission, one token after)
and yields one token per running request, finished requests free their room. All active ranks
step in lockstep; a step's time comes from the cost model. At each step boundary (and once before
the first step) the active ranks' `StepReport` goes to the membership:
- static: every rank stays until no rank has work (the verl-like baseline);
- elastic: `ElasticMembership.decide` (flexfloor/rollout/elastic.py): the object the engine uses,
  so migration, the memory floor and the leavers are decided by the same code.

Between events (a request finishing, a rank able to admit) nothing in a report changes but the
remaining-token counts, which fall by one everywhere, so the decision repeats: the simulation jumps
over such steps at once and prices them by the trapezoid of the step cost at both ends (exact with
`UnitCost`). Only with `check_interval_steps` = 1: other intervals step one by one.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from flexfloor.rollout.elastic import RankLimits
from flexfloor.rollout.engine import StepReport
from flexfloor.rollout.types import RankRecord
from flexfloor.sim.cost import RankLoad

UNBOUNDED_KV = 1 << 62  # what an engine without a KV budget reports as free


class SimError(RuntimeError):
    pass


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    prompt_uid: int
    prompt_len: int
    length: int  # response tokens it will produce

    @property
    def reserved_tokens(self) -> int:
        """The KV reservation: prompt + response (the engine's `max_total_tokens` of a request
        with `target_len`)."""
        return self.prompt_len + self.length


@dataclass
class _Run:
    req: SimRequest
    done_at: int  # the global step whose token is its last
    start: int  # global step count when admitted, less the tokens it had already (migration)
    pending: int  # tokens it feeds its first step on a rank (prompt, or all so far: migration)


@dataclass
class _Rank:
    rank: int
    queue: deque
    record: RankRecord
    running: list = field(default_factory=list)  # _Run, sorted by done_at
    kv_used: int = 0
    ctx_base: int = 0  # sum over running of (prompt_len - start): context = ctx_base + n * step
    pending: int = 0  # tokens the next step feeds
    # attention pairs the next step adds beyond one token per request against its context (a
    # prompt of p tokens: p * (p + 1) / 2 pairs instead of p)
    extra_pairs: float = 0.0

    def remaining(self, step: int) -> int:
        return self.running[-1].done_at - step if self.running else 0

    def context(self, step: int) -> int:
        return self.ctx_base + len(self.running) * step

    def add(self, run: _Run) -> None:
        bisect.insort(self.running, run, key=_done_at)
        self.ctx_base += run.req.prompt_len - run.start
        self.pending += run.pending
        self.extra_pairs += run.pending * (run.pending + 1) / 2 - run.pending


@dataclass
class SimOutput:
    records: list[dict]  # RankRecord.as_dict() per rank
    total_tokens: int
    num_responses: int
    lengths: dict[int, list[int]]  # prompt uid -> its response lengths
    timeline: list[dict]


def simulate_rollout(assignment: dict[int, Sequence[SimRequest]], membership, cost, *,
                     limits: RankLimits, placement) -> SimOutput:
    """Run one rollout. `membership`: None for static EP, or an `ElasticMembership` (its
    `parallel` unused); `placement`: the starting expert placement over every rank;
    `limits`: batch slots, KV budget, bytes per KV token and per expert, as the engine's."""
    ranks = {r: _Rank(r, deque(reqs), RankRecord(rank=r, requests=len(reqs)))
             for r, reqs in sorted(assignment.items())}
    active = sorted(ranks)
    requests_total = sum(len(v) for v in assignment.values())
    budget = limits.kv_budget_bytes
    step = 0  # global steps done (every active rank has done them all)
    now = 0.0
    tokens_total = finished_total = 0
    lengths: dict[int, list[int]] = {}
    timeline: list[dict] = []
    elastic = membership is not None
    quiet = False  # the last boundary decided nothing: the next identical one may be skipped
    floor_hit = False
    hosted = Counter(placement.owner)

    def report() -> StepReport:
        rs = [ranks[r] for r in active]
        return StepReport(
            has_work=[bool(x.running or x.queue) for x in rs], finished=finished_total,
            tokens=tokens_total, requests=requests_total,
            running=[len(x.running) for x in rs], queued=[len(x.queue) for x in rs],
            remaining=[x.remaining(step) for x in rs],
            kv_free=[budget - x.kv_used if budget is not None else UNBOUNDED_KV for x in rs])

    def admit(x: _Rank, dry: bool = False) -> bool:
        """The engine's admission loop; dry: only say whether one would be admitted."""
        admitted = False
        while x.queue and len(x.running) < limits.max_batch_size:
            req = x.queue[0]
            need = req.reserved_tokens * limits.kv_bytes_per_token
            if budget is not None and x.kv_used + need > budget:
                if not x.running and not dry:
                    raise SimError(f"rank {x.rank}: request {req.request_id} needs {need} KV bytes "
                                   f"and only {budget - x.kv_used} are free with nothing running")
                break
            if dry:
                return True
            x.queue.popleft()
            x.kv_used += need
            x.add(_Run(req, done_at=step + req.length, start=step, pending=req.prompt_len))
            admitted = True
        x.record.kv_peak_bytes = max(x.record.kv_peak_bytes, x.kv_used)
        return admitted

    def loads(at_step: int) -> list[RankLoad]:
        out = []
        for r in active:
            x = ranks[r]
            ctx = x.context(at_step)
            out.append(RankLoad(r, x.pending, ctx, hosted[r], ctx + x.extra_pairs))
        return out

    def boundary() -> bool:
        """The membership's decision after a step; False ends the rollout."""
        nonlocal placement, active, now, quiet, floor_hit, hosted
        rep = report()
        if not any(rep.has_work):
            return False
        if not elastic:
            quiet = True
            return True
        decision = membership.decide(placement, rep, limits)
        floor_hit = decision.floor_hit
        if floor_hit:
            for r in active:
                ex = ranks[r].record.extra
                ex["floor_hits"] = ex.get("floor_hits", 0) + 1
        quiet = not decision.migrate and not decision.leaving
        for giver, taker in sorted(decision.migrate.items()):
            g, t = ranks[giver], ranks[taker]
            for run in g.running:
                run.pending = run.req.prompt_len + step - run.start  # re-prefill there
                g.kv_used -= run.req.reserved_tokens * limits.kv_bytes_per_token
                t.kv_used += run.req.reserved_tokens * limits.kv_bytes_per_token
                t.add(run)
            g.record.extra["migrated_out"] = g.record.extra.get("migrated_out", 0) + len(g.running)
            t.record.extra["adopted"] = t.record.extra.get("adopted", 0) + len(g.running)
            g.running, g.ctx_base, g.pending, g.extra_pairs = [], 0, 0, 0.0
            timeline.append({"step": step, "migrated": {giver: taker}})
        if decision.leaving:
            now += cost.shrink_seconds(decision.transfers, placement.owner)
            for tr in decision.transfers:  # borrowed weights take KV room on the survivor
                ranks[tr.dst].kv_used += limits.expert_nbytes
            for r in decision.leaving:
                rec = ranks[r].record
                rec.release_s = now
                rec.extra["release_step"] = rec.steps
            placement = decision.placement
            hosted = Counter(placement.owner)
            active = list(placement.ranks)
            timeline.append({"step": step, "time_s": now, "leaving": list(decision.leaving),
                             "active": list(active), "moved_experts": len(decision.transfers)})
        return True

    keep = boundary()  # before the first step: ranks without work leave at once
    while keep:
        for r in active:
            admit(ranks[r])
        dt = cost.step_seconds(loads(step), placement.owner)
        step += 1
        now += dt
        _advance(ranks, active, step, now, 1)
        for r in active:
            x = ranks[r]
            while x.running and x.running[0].done_at <= step:
                run = x.running.pop(0)
                x.ctx_base -= run.req.prompt_len - run.start
                x.kv_used -= run.req.reserved_tokens * limits.kv_bytes_per_token
                x.record.local_finish_s = now
                x.record.extra["local_finish_step"] = x.record.steps
                lengths.setdefault(run.req.prompt_uid, []).append(run.req.length)
                finished_total += 1
            x.pending = len(x.running)
        tokens_total = sum(x.record.tokens for x in ranks.values())
        keep = boundary()
        if not keep or not quiet or (elastic and membership.check_interval_steps != 1):
            continue
        # fast-forward over steps where nothing can change: no admission, no finish
        if any(ranks[r].queue and admit(ranks[r], dry=True) for r in active):
            continue
        nxt = min((ranks[r].running[0].done_at for r in active if ranks[r].running),
                  default=step + 1)
        skip = nxt - step - 1
        if skip <= 0:
            continue
        first = cost.step_seconds(loads(step), placement.owner)
        last = cost.step_seconds(loads(step + skip - 1), placement.owner)
        step += skip
        now += skip * (first + last) / 2
        _advance(ranks, active, step, now, skip)
        tokens_total = sum(x.record.tokens for x in ranks.values())
        if floor_hit:  # the engine counts the floor at every boundary it meets it
            for r in active:
                ex = ranks[r].record.extra
                ex["floor_hits"] = ex.get("floor_hits", 0) + skip
    for r in active:  # not released early: occupied to the end
        rec = ranks[r].record
        rec.release_s = now
        rec.extra["release_step"] = rec.steps
    for x in ranks.values():
        if x.running or x.queue:
            raise SimError(f"rank {x.rank} left with {len(x.running)} running and "
                           f"{len(x.queue)} queued requests")
    if finished_total != requests_total:
        raise SimError(f"{finished_total} responses for {requests_total} requests")
    return SimOutput(records=[ranks[r].record.as_dict() for r in sorted(ranks)],
                     total_tokens=tokens_total, num_responses=finished_total, lengths=lengths,
                     timeline=timeline)


def _done_at(run: _Run) -> int:
    return run.done_at


def _advance(ranks, active, step: int, now: float, n: int) -> None:
    """n lockstep steps done by every active rank (each running request: one token per step)."""
    for r in active:
        x = ranks[r]
        rec = x.record
        rec.steps += n
        if x.running:
            rec.busy_steps += n
            rec.tokens += n * len(x.running)
        x.pending = len(x.running)
        x.extra_pairs = 0.0


def initial_state(num_experts: int, world: int, training_ep: Optional[int] = None):
    """The rollout's starting placement and what each rank holds: Megatron's contiguous training
    layout at `training_ep` (default: the largest size dividing both), replicated over the
    expert-data-parallel ranks; the rollout uses every rank."""
    import math

    from megatron_ext.placement import contiguous_placement, initial_placement

    ep = training_ep or math.gcd(world, num_experts)
    if world % ep or num_experts % ep:
        raise ValueError(f"training EP size {ep} must divide the world {world} and the experts "
                         f"{num_experts}")
    train = contiguous_placement(num_experts, range(ep))
    holding = {r: train.experts_of(r % ep) for r in range(world)}
    return initial_placement(num_experts, holding), holding
