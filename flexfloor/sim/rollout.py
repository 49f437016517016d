"""One rollout on N simulated ranks: the engine's step semantics, the real release decision.

Each rank mirrors `RolloutEngine.generate`: admit requests in the order given while a batch slot
and KV room are free (borrowed experts take room), one step feeds each running request its pending
tokens (the prompt at admission, one token after) and yields one token per running request,
finished requests free their room. KV is reserved one of two ways (`kv_block_tokens`):
- None: a request reserves prompt + response tokens at admission;
- B tokens per block: a request holds the blocks its cached tokens fill, allocated as tokens are
  produced. With `exact_blocks` the engine's pool (flexfloor/rollout/kv.py) is counted block for
  block: admission needs its prefill's blocks over the pool's watermark, each step takes the
  blocks its tokens need in admission order, and when the pool runs out the request admitted last
  is preempted (its blocks freed, queued first again, re-prefilled with what it had produced: the
  same tokens); a migrated request is queued first on its taker, as the engine adopts it.
  Without, each request holds half a block of unfilled room on average (no pass over the
  requests per step: the accelerator scenarios, where unit-cost equality is not claimed). All
  active ranks
step in lockstep; a step's time comes from the cost model. At each step boundary (and once before
the first step) the active ranks' `StepReport` is decided on:
- static: every rank stays until no rank has work (the verl-like baseline);
- elastic: `flexfloor.rollout.release.decide`, the pure function the engine's membership calls,
  so migration, the memory floor and the leavers are decided by the same code.

Between events (a request finishing, a rank able to admit) nothing in a report changes but the
remaining-token counts, which fall by one everywhere, so the decision repeats: the simulation jumps
over such steps at once and prices them by the trapezoid of the step cost at both ends (exact with
`UnitCost`). Only with `check_interval_steps` = 1: other intervals step one by one.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from flexfloor.rollout.engine import StepReport
from flexfloor.rollout.kv import blocks_for, watermark_blocks
from flexfloor.rollout.release import RankLimits, ReleaseRules, decide, under_pace
from flexfloor.rollout.survivors import creates_group, leavers_for
from flexfloor.rollout.types import RankRecord
from flexfloor.sim.cost import GroupSource, RankLoad

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
    seq: int = 0  # admission order on its rank (the engine's running list; youngest last)
    blocks: int = 0  # KV blocks it holds (exact block accounting only)

    def cached(self, step: int) -> int:
        """Tokens in its KV cache once `step` global steps are done (prompt and produced)."""
        return self.req.prompt_len + step - self.start


@dataclass(frozen=True)
class _Preempted:
    """A request preempted for KV blocks, back in the queue with what it had produced."""

    req: SimRequest
    produced: int


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
    used_blocks: int = 0  # exact block accounting: blocks in the running requests' tables
    withheld_blocks: int = 0  # exact block accounting: room borrowed experts took

    def block_bytes(self, step: int, block: int, kv_bytes: int) -> int:
        """KV bytes of the blocks its running requests hold after `step` global steps, with the
        next step's token: their cached tokens plus, on average, half a block each of room not
        yet filled (the exact count would cost a pass over the requests at every step)."""
        n = len(self.running)
        return int((self.context(step) + n + n * (block - 1) / 2) * kv_bytes)

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
    groups_created: int = 0  # survivors' groups built during the rollout (one per shrink)


def simulate_rollout(assignment: dict[int, Sequence[SimRequest]], rules: Optional[ReleaseRules],
                     cost, *,
                     limits: RankLimits, placement, kv_block_tokens: Optional[int] = None,
                     exact_blocks: bool = False, prebuilt_sets: Optional[set] = None,
                     late_sets: Optional[set] = None) -> SimOutput:
    """Run one rollout of one EP group. `rules`: None for static EP, or the elastic policy,
    decided at every boundary by `flexfloor.rollout.release.decide` as the engine does; `placement`: the starting expert placement over
    the group's ranks; `limits`: batch slots, KV budget, bytes per KV token and per expert, as the
    engine's; `kv_block_tokens`: None to reserve prompt + response at admission, else the block
    size of a pool that allocates as tokens are produced; `exact_blocks`: count every request's
    blocks as the engine's pool does (flexfloor/rollout/kv.py: admission by free blocks over the
    watermark, the youngest preempted, borrowed experts withheld in whole blocks), a pass over
    the running requests per step; else half a block per request on average. `prebuilt_sets`,
    `late_sets`: as `rollout_steps`'. The pace rule (`rules.pace`) needs the estimates of a
    replica driver (`simulate_replicas`): a group simulated alone makes every shrink its floor
    allows."""
    gen = rollout_steps(assignment, rules, cost, limits=limits, placement=placement,
                        kv_block_tokens=kv_block_tokens, exact_blocks=exact_blocks,
                        prebuilt_sets=prebuilt_sets, late_sets=late_sets)
    try:
        next(gen)
        while True:
            gen.send(False)
    except StopIteration as done:
        return done.value


@dataclass
class GroupView:
    """A running group's face to a driver of several groups (`rollout_steps`), valid while the
    generator waits at a boundary: its clock, each rank's running requests, and moves out and
    in (the driver tells the generator, on resuming it, that its requests changed)."""

    now: object  # () -> its clock, seconds
    finished: object  # () -> responses finished so far
    ranks: object  # () -> {rank: (running [(SimRequest, produced)], queued count, kv free bytes)}
    export: object  # (rank, ids=None) -> [(SimRequest, produced)]: its running requests
    # (those of the set of request ids `ids`), removed
    adopt: object  # (rank, [(SimRequest, produced)], kv_transfer: bool, ready_s)
    lengths: dict  # prompt uid -> lengths finished here so far
    # the driver's next check of this group (seconds on its clock): steps where nothing changes
    # are jumped over only up to it, so the group yields there; None: to the next event
    wake_s: Optional[float] = None


def rollout_steps(assignment: dict[int, Sequence[SimRequest]], rules: Optional[ReleaseRules],
                  cost, *, limits: RankLimits, placement, kv_block_tokens: Optional[int] = None,
                  exact_blocks: bool = False, every_boundary: bool = False,
                  estimates=None, end_to_keep_s: Optional[float] = None,
                  prebuilt_sets: Optional[set] = None, late_sets: Optional[set] = None):
    """`simulate_rollout` as a generator: it yields a `GroupView` at every step boundary with
    work (after the release decision) and is resumed with `send(changed)`: True when a driver
    moved requests out of or into it (the boundary is then decided again). Returns the
    `SimOutput`. Steps where no request finishes or is admitted are jumped over, unless
    `every_boundary` (a driver that may move requests at any boundary, as the engine's
    consolidation inside a replica does). With the pace rule (`rules.pace`), `estimates`: () ->
    (SimRequest, produced) -> its predicted remaining tokens, asked once per shrink decided (the
    `work` the rule predicts the survivors' end from), and `end_to_keep_s` (seconds on this
    group's clock, or None): the end a slower shrink must keep (`release.slows_replica`).
    `prebuilt_sets`: the survivor sets built ahead (`GroupSource.PLANNED`, as the engine's
    `survivors.SurvivorGroups`, kept across the job's rollouts): a shrink the plan did not
    foresee goes to the nearest prebuilt superset, else to a group created late, priced as
    created the first time and added to `late_sets` (the job's, kept across rollouts: a switch
    the next time; never a superset to go to, as the engine's `SurvivorGroups.late`; None: kept
    by no later rollout); None: every shrink priced as `CostParams.group_source` says."""
    ranks = {r: _Rank(r, deque(reqs), RankRecord(rank=r, requests=len(reqs)))
             for r, reqs in sorted(assignment.items())}
    if prebuilt_sets is not None and late_sets is None:
        late_sets = set()  # this rollout's own, read by nothing after it
    active = sorted(ranks)
    requests_total = sum(len(v) for v in assignment.values())
    budget = limits.kv_budget_bytes
    step = 0  # global steps done (every active rank has done them all)
    now = 0.0
    tokens_total = finished_total = 0
    lengths: dict[int, list[int]] = {}
    timeline: list[dict] = []
    elastic = rules is not None
    boundaries = 0  # step boundaries with work (the engine's count for check_interval_steps)
    quiet = False  # the last boundary decided nothing: the next identical one may be skipped
    floor_hit = False
    hosted = Counter(placement.owner)
    groups_created = 0
    kvb = limits.kv_bytes_per_token
    exact = exact_blocks and kv_block_tokens is not None
    if exact:
        block_nbytes = kvb * kv_block_tokens
        capacity = None if budget is None else budget // block_nbytes  # the engine's pool
        watermark = watermark_blocks(capacity)
    seq = 0

    def blocks_at(x: _Rank, at_step: int) -> int:
        """Exact: blocks in use plus withheld once every running request holds what the step
        after `at_step` global steps needs."""
        return x.withheld_blocks + sum(max(run.blocks, blocks_for(run.cached(at_step), kv_block_tokens))
                                       for run in x.running)

    def kv_in_use(x: _Rank, at_step: int) -> int:
        if exact:
            return blocks_at(x, at_step) * block_nbytes
        if kv_block_tokens is None:
            return x.kv_used
        return x.kv_used + x.block_bytes(at_step, kv_block_tokens, kvb)

    def reserve(req: SimRequest) -> int:
        """KV bytes a request takes at admission and keeps to its end (none with blocks: they
        are counted from its cached tokens)."""
        return req.reserved_tokens * kvb if kv_block_tokens is None else 0

    def admission_need(item) -> int:
        """KV bytes free for admitting `item` (a request, or a preempted one: blocks only)."""
        if kv_block_tokens is None:
            return item.reserved_tokens * kvb
        cached = item.req.prompt_len + item.produced if isinstance(item, _Preempted) else item.prompt_len
        return -(-(cached + 1) // kv_block_tokens) * kv_block_tokens * kvb

    def report() -> StepReport:
        rs = [ranks[r] for r in active]
        return StepReport(
            has_work=[bool(x.running or x.queue) for x in rs], finished=finished_total,
            tokens=tokens_total, requests=requests_total,
            running=[len(x.running) for x in rs], queued=[len(x.queue) for x in rs],
            remaining=[x.remaining(step) for x in rs],
            kv_free=[UNBOUNDED_KV if budget is None else
                     (capacity - x.withheld_blocks - x.used_blocks) * block_nbytes if exact else
                     budget - kv_in_use(x, step) for x in rs])

    def admit(x: _Rank, dry: bool = False) -> bool:
        """The engine's admission loop; dry: only say whether one would be admitted."""
        nonlocal seq
        admitted = False
        while x.queue and len(x.running) < limits.max_batch_size:
            item = x.queue[0]
            if exact:  # the engine's `_admit`: the prefill's blocks over the watermark
                cached = item.req.prompt_len + item.produced if isinstance(item, _Preempted) else item.prompt_len
                nb = blocks_for(cached, kv_block_tokens)
                free = None if capacity is None else capacity - x.withheld_blocks - x.used_blocks
                if free is not None and free - nb < (watermark if x.running else 0):
                    if not x.running and not dry:
                        raise SimError(f"rank {x.rank}: request {item_id(item)} needs {nb} KV "
                                       f"blocks and only {free} are free with nothing running")
                    break
                if dry:
                    return True
                x.queue.popleft()
                req, produced = (item.req, item.produced) if isinstance(item, _Preempted) else (item, 0)
                seq += 1
                x.used_blocks += nb
                x.add(_Run(req, done_at=step + req.length - produced, start=step - produced,
                           pending=req.prompt_len + produced, seq=seq, blocks=nb))
                admitted = True
                continue
            need = admission_need(item)
            used = kv_in_use(x, step)
            if budget is not None and used + need > budget:
                if not x.running and not dry:
                    raise SimError(f"rank {x.rank}: request {item_id(item)} needs {need} KV bytes "
                                   f"and only {budget - used} are free with nothing running")
                break
            if dry:
                return True
            x.queue.popleft()
            if isinstance(item, _Preempted):  # re-prefilled with what it had produced
                req, produced = item.req, item.produced
            else:
                req, produced = item, 0
            x.kv_used += reserve(req)
            seq += 1
            x.add(_Run(req, done_at=step + req.length - produced, start=step - produced,
                       pending=req.prompt_len + produced, seq=seq))
            admitted = True
        return admitted

    def preempt(x: _Rank) -> None:
        """Blocks pool: while the next step needs more blocks than are free, the request admitted
        last goes back to the queue's head (vLLM's recompute preemption)."""
        if kv_block_tokens is None or budget is None:
            return
        if exact:  # the engine's `_take_blocks`, in admission order
            order = sorted(x.running, key=lambda r: r.seq)
            i = 0
            while i < len(order):
                run = order[i]
                need = blocks_for(run.cached(step), kv_block_tokens) - run.blocks
                if need <= 0 or capacity - x.withheld_blocks - x.used_blocks >= need:
                    run.blocks += max(0, need)
                    x.used_blocks += max(0, need)
                    i += 1
                    continue
                victim = order.pop()  # the youngest (possibly run itself)
                drop(x, victim)
                x.used_blocks -= victim.blocks
                victim.blocks = 0
            return
        while len(x.running) > 1 and kv_in_use(x, step) > budget:
            drop(x, max(x.running, key=lambda r: r.seq))

    def drop(x: _Rank, last: _Run) -> None:
        """Preempt `last`: back to the queue's head with what it had produced."""
        x.running.remove(last)
        x.ctx_base -= last.req.prompt_len - last.start
        if last.cached(step) == last.pending:  # admitted (or adopted) for this step
            x.pending -= last.pending
            x.extra_pairs -= last.pending * (last.pending + 1) / 2 - last.pending
        else:
            x.pending -= 1
        x.queue.appendleft(_Preempted(last.req, step - last.start))
        x.record.preempted += 1

    def loads(at_step: int) -> list[RankLoad]:
        out = []
        for r in active:
            x = ranks[r]
            ctx = x.context(at_step)
            out.append(RankLoad(r, x.pending, ctx, hosted[r], ctx + x.extra_pairs))
        return out

    def boundary() -> bool:
        """The release decision after a step; False ends the rollout."""
        nonlocal placement, active, now, quiet, floor_hit, hosted, groups_created, boundaries
        rep = report()
        if not any(rep.has_work):
            return False
        if not elastic:
            quiet = True
            return True
        boundaries += 1
        # with groups built ahead, the engine's fit: only the ranks outside the nearest
        # prebuilt superset of the survivors leave (`ElasticMembership._decide_at`)
        fit = (None if prebuilt_sets is None else
               lambda active, leaving: leavers_for(active, leaving, prebuilt_sets))
        decision = decide(rules, placement, rep, limits, boundaries, fit=fit)
        if decision.leaving and rules.pace is not None and estimates is not None:
            decision = under_pace(rules, placement, decision, work_now(),
                                  end_s=None if end_to_keep_s is None else end_to_keep_s - now)
        floor_hit = decision.floor_hit
        if floor_hit:
            for r in active:
                ranks[r].record.floor_hits += 1
        # a shrink the pace rule refused is asked again at the next step, as the engine does:
        # its estimates and the end to keep move with every step, not only at a finish
        quiet = not decision.migrate and not decision.leaving and not decision.paced
        if exact:  # the engine's export/adopt: the taker queues them first, re-prefilled later
            adopted: dict[int, list] = {}
            for giver, taker in sorted(decision.migrate.items()):
                g = ranks[giver]
                runs = sorted(g.running, key=lambda r: r.seq)
                adopted.setdefault(taker, []).extend(_Preempted(r.req, step - r.start) for r in runs)
                g.used_blocks -= sum(r.blocks for r in runs)
                g.record.migrated_out += len(runs)
                g.running, g.ctx_base, g.pending, g.extra_pairs = [], 0, 0, 0.0
                timeline.append({"step": step, "migrated": {giver: taker}})
            for taker, items in adopted.items():
                t = ranks[taker]
                t.queue.extendleft(reversed(items))
                t.record.adopted += len(items)
        for giver, taker in sorted(decision.migrate.items()) if not exact else ():
            g, t = ranks[giver], ranks[taker]
            for run in g.running:
                run.pending = run.req.prompt_len + step - run.start  # re-prefill there
                g.kv_used -= reserve(run.req)
                t.kv_used += reserve(run.req)
                t.add(run)
            g.record.migrated_out += len(g.running)
            t.record.adopted += len(g.running)
            g.running, g.ctx_base, g.pending, g.extra_pairs = [], 0, 0, 0.0
            timeline.append({"step": step, "migrated": {giver: taker}})
        if decision.leaving:
            built = None
            if prebuilt_sets is not None:
                survivors = tuple(sorted(decision.placement.ranks))
                built = not creates_group(placement.ranks, survivors, prebuilt_sets, late_sets)
                late_sets.add(survivors)  # created now: a switch at a later rollout
            now += cost.shrink_seconds(decision.transfers, placement.owner, prebuilt=built)
            if built is None:  # every set built ahead (GroupSource.PREBUILT), else none
                params = getattr(cost, "params", None)
                built = params is not None and params.group_source == GroupSource.PREBUILT
            groups_created += not built
            if exact:  # the engine's `withhold`: each survivor's borrowed bytes in whole blocks
                got = Counter(tr.dst for tr in decision.transfers)
                for dst, n in got.items():
                    if dst not in decision.leaving:
                        ranks[dst].withheld_blocks += blocks_for(n * limits.expert_nbytes, block_nbytes)
            for tr in decision.transfers if not exact else ():  # borrowed weights take KV room
                ranks[tr.dst].kv_used += limits.expert_nbytes
            for r in decision.leaving:
                rec = ranks[r].record
                rec.release_s = now
                rec.release_step = rec.steps
            placement = decision.placement
            hosted = Counter(placement.owner)
            active = list(placement.ranks)
            timeline.append({"step": step, "time_s": now, "leaving": list(decision.leaving),
                             "active": list(active), "moved_experts": len(decision.transfers)})
        return True

    def work_now() -> list:
        """Each active rank's running requests, in placement order: (predicted remaining
        tokens, cached tokens) each (`release.Work`, as the engine's pace rule counts them)."""
        est = estimates()
        return [[(est(run.req, step - run.start), run.cached(step)) for run in ranks[r].running]
                for r in placement.ranks]

    def ranks_now() -> dict:
        return {r: ([(run.req, step - run.start) for run in ranks[r].running], len(ranks[r].queue),
                    report_free(ranks[r])) for r in active}

    def report_free(x: _Rank) -> int:
        if budget is None:
            return UNBOUNDED_KV
        if exact:
            return (capacity - x.withheld_blocks - x.used_blocks) * block_nbytes
        return budget - kv_in_use(x, step)

    def export(rank: int, ids: Optional[set] = None) -> list:
        """Its running requests (those of `ids`: None, all) leave the rank (their tokens so far
        stay counted here)."""
        nonlocal requests_total
        x = ranks[rank]
        gone = [run for run in sorted(x.running, key=lambda r: r.seq)
                if ids is None or run.req.request_id in ids]
        out = [(run.req, step - run.start) for run in gone]
        requests_total -= len(out)
        x.used_blocks -= sum(run.blocks for run in gone)  # exact blocks: the pool's free
        for run in gone:
            x.kv_used -= reserve(run.req)
        x.record.migrated_out += len(out)
        if ids is None or len(gone) == len(x.running):
            x.running, x.ctx_base, x.pending, x.extra_pairs = [], 0, 0, 0.0
            return out
        for run in gone:  # at a boundary each running request feeds the next step one token
            x.running.remove(run)
            x.ctx_base -= run.req.prompt_len - run.start
            x.pending -= 1
        return out

    def adopt(rank: int, items: list, kv_transfer: bool, ready_s: float) -> None:
        """Requests moved in: their KV transferred (decoding resumes at the next step, once the
        KV has arrived at `ready_s`: the group waits if it is not there by its clock) or queued
        first to be re-prefilled with what they had produced."""
        nonlocal now, seq, requests_total
        x = ranks[rank]
        requests_total += len(items)
        if kv_transfer:
            now = max(now, ready_s)
            for req, produced in items:
                seq += 1
                x.kv_used += reserve(req)
                x.add(_Run(req, done_at=step + req.length - produced, start=step - produced,
                           pending=1, seq=seq))
        else:
            x.queue.extendleft(reversed([_Preempted(req, produced) for req, produced in items]))
        x.record.adopted += len(items)

    view = GroupView(now=lambda: now, finished=lambda: finished_total, ranks=ranks_now,
                     export=export, adopt=adopt, lengths=lengths)
    keep = boundary()  # before the first step: ranks without work leave at once
    while keep:
        if (yield view):  # a driver moved requests: decide this boundary again
            keep = boundary()
            if not keep:
                break
        for r in active:
            x = ranks[r]
            admit(x)
            preempt(x)
            x.record.kv_peak_bytes = max(x.record.kv_peak_bytes, kv_in_use(x, step))
            if exact and budget is None:  # unbounded: no preempt
                for run in x.running:
                    nb = blocks_for(run.cached(step), kv_block_tokens)
                    x.used_blocks += nb - run.blocks
                    run.blocks = nb
        dt = cost.step_seconds(loads(step), placement.owner)
        step += 1
        now += dt
        _advance(ranks, active, step, now, 1)
        for r in active:
            x = ranks[r]
            while x.running and x.running[0].done_at <= step:
                run = x.running.pop(0)
                x.used_blocks -= run.blocks
                x.ctx_base -= run.req.prompt_len - run.start
                x.kv_used -= reserve(run.req)
                x.record.local_finish_s = now
                x.record.local_finish_step = x.record.steps
                lengths.setdefault(run.req.prompt_uid, []).append(run.req.length)
                finished_total += 1
            x.pending = len(x.running)
        tokens_total = sum(x.record.tokens for x in ranks.values())
        keep = boundary()
        if (not keep or not quiet or every_boundary
                or (elastic and rules.check_interval_steps != 1)):
            continue
        # fast-forward over steps where nothing can change: no admission, no finish
        if any(ranks[r].queue and admit(ranks[r], dry=True) for r in active):
            continue
        nxt = min((ranks[r].running[0].done_at for r in active if ranks[r].running),
                  default=step + 1)
        skip = nxt - step - 1
        if kv_block_tokens is not None and budget is not None and skip > 0:
            fits = ((lambda x, s: blocks_at(x, s) <= capacity) if exact else
                    (lambda x, s: kv_in_use(x, s) <= budget))
            skip = _steps_within(ranks, active, step, skip, fits)
        if skip <= 0:
            continue
        first = cost.step_seconds(loads(step), placement.owner)
        if view.wake_s is not None:  # no further than the driver's next check
            skip = min(skip, max(0, int((view.wake_s - now) / first)) if first > 0 else skip)
            if skip <= 0:
                continue
        last = cost.step_seconds(loads(step + skip - 1), placement.owner)
        step += skip
        now += skip * (first + last) / 2
        _advance(ranks, active, step, now, skip)
        if exact:  # the blocks the skipped steps took (they only grow between events)
            for r in active:
                x = ranks[r]
                for run in x.running:
                    nb = max(run.blocks, blocks_for(run.cached(step - 1), kv_block_tokens))
                    x.used_blocks += nb - run.blocks
                    run.blocks = nb
                x.record.kv_peak_bytes = max(x.record.kv_peak_bytes,
                                             (x.used_blocks + x.withheld_blocks) * block_nbytes)
        tokens_total = sum(x.record.tokens for x in ranks.values())
        boundaries += skip  # the skipped boundaries decide nothing new (every one is checked)
        if floor_hit:  # the engine counts the floor at every boundary it meets it
            for r in active:
                ranks[r].record.floor_hits += skip
    for r in active:  # not released early: occupied to the end
        rec = ranks[r].record
        rec.release_s = now
        rec.release_step = rec.steps
    for x in ranks.values():
        if x.running or x.queue:
            raise SimError(f"rank {x.rank} left with {len(x.running)} running and "
                           f"{len(x.queue)} queued requests")
    if finished_total != requests_total:
        raise SimError(f"{finished_total} responses for {requests_total} requests")
    return SimOutput(records=[ranks[r].record.as_dict() for r in sorted(ranks)],
                     total_tokens=tokens_total, num_responses=finished_total, lengths=lengths,
                     timeline=timeline, groups_created=groups_created)


def item_id(item) -> str:
    return item.req.request_id if isinstance(item, _Preempted) else item.request_id


def _steps_within(ranks, active, step: int, skip: int, fits) -> int:
    """Most steps (<= skip) every active rank can take with `fits(rank, step)` holding at each
    of them (KV blocks only grow between events: a binary search)."""
    def ok(n):
        return all(fits(ranks[r], step + n) for r in active)

    lo, hi = 0, skip
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


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


def replica_state(num_experts: int, ranks: Sequence[int], training_ep: Optional[int] = None):
    """`initial_state` of one EP group over `ranks` (a replica holding every expert)."""
    from megatron_ext.placement import Placement

    placement, holding = initial_state(num_experts, len(ranks), training_ep)
    ranks = tuple(sorted(ranks))
    return (Placement(owner=tuple(ranks[r] for r in placement.owner), ranks=ranks),
            {ranks[r]: experts for r, experts in holding.items()})


@dataclass(frozen=True)
class TailConsolidation:
    """What the driver of several replicas needs to consolidate their tails: the decision's
    rules, a rank's step cost, the prices of a move, and each running request's predicted
    remaining tokens (request, produced, the lengths finished so far by prompt uid) -> tokens.
    The lengths are one decision's: a dict made for it and not grown while it lasts, so the
    callables may judge it once (by identity) however many requests they are asked about."""

    rules: object  # flexfloor.rollout.consolidate.ConsolidationRules
    step_cost: object  # scheduler.StepCost
    prices: object  # consolidate.MovePrices
    remaining: object  # (SimRequest, produced, {uid: [lengths]}) -> float
    block_tokens: int = 16
    # the rollout's end the correction keeps (`ConsolidationState.end_bound_s`); None: none
    end_bound_s: Optional[float] = None
    # consolidation inside each replica as the engine does it (flexfloor.rollout.tails:
    # `within_replica`, unit step cost); None: across replicas only
    within: object = None  # flexfloor.rollout.tails.TailRules
    # (request, produced, lengths finished by uid) -> the most it may still produce where its
    # prediction is known wrong, else None (`consolidate.Running.worst`); None: never known
    worst: object = None
    # with no end to keep and `ConsolidationRules.gather`: each replica checked this many
    # seconds apart (on its clock) for long work to gather (`consolidate._gather`); None: never
    gather_every_s: Optional[float] = None
    # (lengths finished by uid) -> whether the length history has proved wrong in this rollout
    # (`LengthHistory.unproven`), asked at each decision: a decision it says so for runs with
    # `ConsolidationRules.no_denser`; None: never
    unproven: object = None


def simulate_replicas(groups: Sequence[dict], cost, *, limits: RankLimits,
                      kv_block_tokens: Optional[int], consolidation: TailConsolidation,
                      exact_blocks: bool = False) -> list[SimOutput]:
    """Several replicas, each an EP group on its own clock (`rollout_steps`), with their tails
    consolidated: the replica whose clock is earliest is advanced to its next boundary; there
    `flexfloor.rollout.consolidate.decide` runs on every replica's latest state with that
    replica as the only possible giver (the others' clocks are no earlier, so a moved request
    never resumes before it left). groups: dicts of `rollout_steps`' assignment, rules and
    placement. Returns each replica's `SimOutput`, in order."""
    def estimates():
        """(request, produced) -> its remaining tokens as the pace rule of a shrink counts them:
        as the consolidation's takers count their own (`ConsolidationRules.taker_hedge` times
        the estimate, or its worst where its prediction is known wrong), from the lengths
        finished so far on every replica."""
        finished: dict[int, list[int]] = {}
        for got in [*(v.lengths for v in views.values()), *(o.lengths for o in outs.values())]:
            for uid, ls in got.items():
                finished.setdefault(uid, []).extend(ls)
        tc, hedge = consolidation, consolidation.rules.taker_hedge

        def est(req, produced: int) -> float:
            worst = tc.worst(req, produced, finished) if tc.worst else None
            return worst if worst is not None else hedge * tc.remaining(req, produced, finished)
        return est

    gens = [rollout_steps(g["assignment"], g["rules"], cost, limits=limits,
                          placement=g["placement"], kv_block_tokens=kv_block_tokens,
                          exact_blocks=exact_blocks,
                          every_boundary=consolidation.within is not None,
                          estimates=estimates, end_to_keep_s=consolidation.end_bound_s,
                          prebuilt_sets=g.get("prebuilt"), late_sets=g.get("late"))
            for g in groups]
    replica_of = {r: i for i, g in enumerate(groups) for r in g["assignment"]}
    views: dict[int, GroupView] = {}
    outs: dict[int, SimOutput] = {}
    changed = {i: False for i in range(len(gens))}
    seen: dict[int, int] = {}  # replica -> responses finished everywhere at its last decision
    moves_log: dict[int, list] = {i: [] for i in range(len(gens))}
    bound = consolidation.end_bound_s
    gather = (consolidation.gather_every_s
              if bound is None and consolidation.rules.gather else None)
    checked: dict[int, float] = {}  # replica -> its clock when its end is checked next
    from flexfloor.rollout.consolidate import FinishMemo

    memo = FinishMemo(consolidation.step_cost)  # the replicas that did not step since: known

    def advance(i: int, first: bool = False) -> None:
        try:
            views[i] = next(gens[i]) if first else gens[i].send(changed[i])
        except StopIteration as done:
            outs[i] = done.value
            views.pop(i, None)
        changed[i] = False

    for i in range(len(gens)):
        advance(i, first=True)
    while views:
        i = min(views, key=lambda k: (views[k].now(), k))
        if consolidation.within is not None:
            _consolidate_within(views[i], consolidation, changed, i, limits)
        finished = sum(v.finished() for v in views.values())
        # the check of its end (the correction): from half the bound on, a hundredth of it
        # apart, whether or not a request finished (a misprediction shows as a long request
        # outlives it, between finishes)
        due = bound is not None and views[i].now() >= checked.get(i, bound / 2)
        if gather is not None:  # no end to keep: a check for long work to gather
            due = views[i].now() >= checked.get(i, gather)
        if (seen.get(i) != finished or due) and len(views) > consolidation.rules.min_replicas:
            seen[i] = finished
            mine = views[i].ranks()
            n = sum(len(run) for run, _, _ in mine.values())
            if due:
                checked[i] = views[i].now() + (bound / 100 if gather is None else gather)
            if all(q == 0 for _, q, _ in mine.values()) and n:
                # it may give all (few requests left), or, at a check of its end, hand its
                # longest over (the correction)
                if n <= consolidation.rules.max_requests or due:
                    _consolidate(i, views, replica_of, consolidation, changed, moves_log,
                                 limits, correct=due, memo=memo)
        if i in views and (bound is not None or gather is not None):
            views[i].wake_s = checked.get(i, bound / 2 if gather is None else gather)
        advance(i)
    for i, out in outs.items():
        out.timeline.extend(moves_log[i])
    return [outs[i] for i in range(len(gens))]


def _consolidate_within(view: GroupView, tc: TailConsolidation, changed: dict, i: int,
                        limits: RankLimits) -> None:
    """The engine's consolidation inside one replica at this boundary (`tails.within_replica`
    when `tails.may_give_within`), applied: each giver's requests out, queued first on their
    takers (re-prefilled), in the engine's order (givers by rank, each in admission order).
    The release decision then lets the givers go when the replica's boundary is decided again.
    Unlike the engine, moves are not undone when the release keeps a giver (memory floor)."""
    from types import SimpleNamespace

    from flexfloor.rollout import consolidate as cons
    from flexfloor.rollout import tails

    ranks = view.ranks()
    if not ranks:
        return
    order = sorted(ranks)
    shared = SimpleNamespace(
        has_work=[bool(ranks[r][0] or ranks[r][1]) for r in order],
        running=[len(ranks[r][0]) for r in order], queued=[ranks[r][1] for r in order])
    if not tails.may_give_within(shared, tc.within):
        return
    block_bytes = tc.block_tokens * limits.kv_bytes_per_token
    lengths = dict(view.lengths)  # this decision's (the group's own dict grows as it runs)
    states = [cons.RankState(r, i, tuple(cons.Running(req.request_id, req.prompt_len + produced,
                                                      tc.remaining(req, produced, lengths))
                                         for req, produced in ranks[r][0]), ranks[r][1],
                             None if ranks[r][2] >= UNBOUNDED_KV else ranks[r][2] // block_bytes)
              for r in order]
    d = tails.within_replica(states, tc.within, max_batch=limits.max_batch_size,
                             block_tokens=tc.block_tokens)
    if not d.moves:
        return
    to = {m.request_id: m.dst for m in d.moves}
    taken: dict[int, list] = {}
    for src in sorted({m.src for m in d.moves}):
        for req, produced in view.export(src):
            taken.setdefault(to[req.request_id], []).append((req, produced))
    for dst, items in taken.items():
        view.adopt(dst, items, False, 0.0)
    changed[i] = True


def _consolidate(giver: int, views: dict, replica_of: dict, tc: TailConsolidation,
                 changed: dict, moves_log: dict, limits: RankLimits, correct: bool,
                 memo=None) -> None:
    """One decision at `giver`'s boundary, applied: its requests out, into the takers.
    `correct`: its end is checked against the end to keep (the correction) at this one;
    `memo`: the replicas' finishes known so far (`consolidate.FinishMemo`)."""
    from flexfloor.rollout import consolidate as cons

    finished: dict[int, list[int]] = {}
    for v in views.values():
        for uid, ls in v.lengths.items():
            finished.setdefault(uid, []).extend(ls)
    block_bytes = tc.block_tokens * limits.kv_bytes_per_token
    states, by_id = [], {}
    for k, v in sorted(views.items()):
        for rank, (running, queued, free) in sorted(v.ranks().items()):
            rs = []
            for req, produced in running:
                by_id[req.request_id] = (req, produced)
                rs.append(cons.Running(req.request_id, req.prompt_len + produced,
                                       tc.remaining(req, produced, finished),
                                       tc.worst(req, produced, finished) if tc.worst else None))
            states.append(cons.RankState(rank, k, tuple(rs), queued,
                                         None if free >= UNBOUNDED_KV else free // block_bytes))
    sizes = Counter(replica_of.values())
    shrunk = frozenset(k for k, v in views.items() if len(v.ranks()) < sizes[k])
    state = cons.ConsolidationState(tuple(states), {k: v.now() for k, v in views.items()},
                                    limits.max_batch_size, tc.block_tokens, tc.end_bound_s,
                                    correct=correct, shrunk=shrunk)
    rules = tc.rules
    if tc.unproven is not None and not rules.no_denser and tc.unproven(finished):
        rules = dataclasses.replace(rules, no_denser=True)
    decision = cons.decide(state, rules, tc.step_cost, tc.prices, givers=[giver], memo=memo)
    if not decision.moves:
        return
    gone, leaving = {}, giver in decision.leaving_replicas
    for src in sorted({m.src for m in decision.moves}):
        ids = None if leaving else {m.request_id for m in decision.moves if m.src == src}
        gone.update({req.request_id: (req, produced)
                     for req, produced in views[giver].export(src, ids)})
    for m in decision.moves:
        k = replica_of[m.dst]
        views[k].adopt(m.dst, [gone[m.request_id]], m.kind == cons.MoveKind.KV_TRANSFER,
                       m.ready_s)
        changed[k] = True
    changed[giver] = True
    kinds = Counter(m.kind.value for m in decision.moves)
    moves_log[giver].append({"time_s": views[giver].now(),
                             "consolidated" if leaving else "corrected": len(decision.moves),
                             "to_replicas": sorted({replica_of[m.dst] for m in decision.moves}),
                             **dict(kinds)})
