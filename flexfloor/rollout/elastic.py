"""The release protocol: ranks whose own responses are done leave the rollout at step boundaries.

At every step boundary the active ranks agree on who is done (one small all-gather). When some
are, every active rank computes the same plan (a pure function: new placement + transfers), the
leavers send their experts to the survivors over the current group, the survivors build a group
of their own (created by survivors only) and re-bind the MoE layers to it. Leavers record their
release time and return from the rollout: they take part in no further rollout collective. After
the rollout, `resync()` brings every rank back to the training layout.

The release policy is a value: `ReleasePolicy.STATIC` (the verl-like baseline, `StaticMembership`)
or `ReleasePolicy.ELASTIC` (`ElasticMembership`).

Released ranks wait at resync on the job's store, not in a collective: the wait lasts as long as
the survivors keep making progress (they post a heartbeat), and fails with an error naming the
rank, the phase and the step only when nothing moves for `parallel.timeout_s`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from flexfloor.config import ReleasePolicy
from flexfloor.faults import FaultPhase, inject
from flexfloor.rollout.engine import CollectiveError, StaticMembership, share_step_state
from megatron_ext.elastic_moe import PlacedMoE
from megatron_ext.placement import initial_placement, plan_shrink
from megatron_ext.resharding import transfer_experts


def choose_leavers(ranks, has_work, min_active_ranks: int) -> list[int]:
    """Who leaves at a step boundary: every done rank, except the lowest idle ones the floor
    (`min_active_ranks`) still needs. Pure, so the simulator (`flexfloor.sim`) decides exactly
    as the engine does."""
    done = [r for r, w in zip(ranks, has_work) if not w]
    working = [r for r, w in zip(ranks, has_work) if w]
    keep_idle = max(0, min_active_ranks - len(working))
    return done[keep_idle:]


# A release listener, told when this rank leaves a rollout and when it is back after resync:
# fn(event, rank, time_s, engine_step) with event "released" or "rejoined" (engine_step -1).
# A launcher passes one to lend a released worker's devices to other work until resync
# (flexfloor/launch/ray.py); it is a value handed to membership_for and resync, not a global.
ReleaseListener = Callable[[str, int, float, int], None]


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


@dataclass
class ReleaseDecision:
    """Who hands requests to whom, who leaves, and the placement and transfers after it."""

    migrate: dict = field(default_factory=dict)  # giving rank -> taking rank
    leaving: list = field(default_factory=list)
    placement: object = None  # megatron_ext.placement.Placement after the shrink
    transfers: list = field(default_factory=list)
    floor_hit: bool = False  # some could leave, but the survivors could not hold the experts


@dataclass
class ElasticMembership:
    """Shrinks the EP group as ranks finish, down to `min_active_ranks` (the floor).

    `capacity` (global rank -> most experts it can host) comes from the memory model; None means
    every survivor can host any number.
    """

    parallel: object  # flexfloor.parallel.Parallel
    min_active_ranks: int = 1
    check_interval_steps: int = 1
    capacity: Optional[dict[int, int]] = None
    holding: Optional[dict[int, list[int]]] = None  # rank -> experts in its memory at start
    rollout_id: str = "0"  # the same on every rank, unique in the job: names survivor groups
    migrate_max_requests: int = 0  # > 0: a rank's last requests may move to a staying rank
    step: Optional[int] = None  # the training step (names errors and faults)
    heartbeat_key: str = ""  # store counter the active ranks bump; released ranks watch it
    on_event: ReleaseListener | None = None  # told "released" when this rank leaves
    timeline: list[dict] = field(default_factory=list)  # one entry per shrink
    _boundaries: int = 0
    _last_beat: float = 0.0
    _groups: list = field(default_factory=list)  # survivors' groups this rank created

    def close(self) -> None:
        """Destroy the survivors' groups of this rollout (at resync, after re-binding)."""
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups.clear()

    def step_boundary(self, engine, has_work):
        inject(FaultPhase.ROLLOUT, engine.rank, self.step, engine.record.steps)
        self._heartbeat()
        report = share_step_state(engine.moe.group, has_work, engine)
        if not any(report.has_work):
            return False, report
        t0 = time.perf_counter()
        decision = self.decide(engine.moe.placement, report, RankLimits.of(engine))
        plan_s = time.perf_counter() - t0
        if decision.migrate:
            self._migrate(engine, decision.migrate)
        if decision.floor_hit:
            engine.record.extra["floor_hits"] = engine.record.extra.get("floor_hits", 0) + 1
        if not decision.leaving:
            return True, report
        self._release(engine, decision, plan_s)
        return engine.rank not in decision.leaving, report

    def _heartbeat(self) -> None:
        """Tell the released ranks waiting at resync that the rollout still moves (at most
        every HEARTBEAT_S: one store round trip)."""
        now = time.monotonic()
        if self.heartbeat_key and now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            _store().add(self.heartbeat_key, 1)

    def decide(self, placement, report, limits: "RankLimits") -> "ReleaseDecision":
        """The release decision at one step boundary, from the shared report alone: no
        collective, the same on every rank. The simulator (`flexfloor.sim`) calls it too."""
        self._boundaries += 1
        if self._boundaries % self.check_interval_steps:
            return ReleaseDecision()
        ranks = list(placement.ranks)
        has = list(report.has_work)
        migrate = {}
        if self.migrate_max_requests > 0:
            migrate = self.migration_plan(ranks, report, limits)
            has = [w and r not in migrate for r, w in zip(ranks, has)]
        leaving = choose_leavers(ranks, has, self.min_active_ranks)
        if not leaving:
            return ReleaseDecision(migrate=migrate)
        try:
            new_placement, transfers = plan_shrink(
                placement, leaving, capacity=self.capacity_now(placement, report, limits),
                holding=self.holding)
        except ValueError:
            # the floor: survivors cannot hold every expert; nobody leaves this time
            return ReleaseDecision(migrate=migrate, floor_hit=True)
        return ReleaseDecision(migrate=migrate, leaving=leaving, placement=new_placement,
                               transfers=transfers)

    def migration_plan(self, ranks, report, limits: "RankLimits") -> dict[int, int]:
        """Beyond the paper: a rank whose last few requests (<= migrate_max_requests, none
        queued) will end no later than the work of a rank that stays hands them to that rank
        (re-prefilled there, same RNG stream: the same tokens) and leaves now. Returns
        {giving rank: taking rank}; a pure function of the shared report."""
        has = list(report.has_work)
        n = len(ranks)
        order = sorted(range(n), key=lambda i: (-report.remaining[i], ranks[i]))
        if len([i for i in range(n) if has[i]]) <= self.min_active_ranks:
            return {}
        plan: dict[int, int] = {}  # giver index -> taker index
        kv_taken: dict[int, int] = {}  # taker index -> KV bytes promised
        n_taken: dict[int, int] = {}  # taker index -> requests promised
        for i in range(n):
            if i in n_taken or not (0 < report.running[i] <= self.migrate_max_requests
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
        if len([i for i in range(n) if has[i] and i not in plan]) < self.min_active_ranks:
            return {}
        return {ranks[i]: ranks[j] for i, j in sorted(plan.items())}

    def capacity_now(self, placement, report, limits: "RankLimits") -> Optional[dict[int, int]]:
        """Most experts each active rank can host now: a fixed `capacity`, or, under a KV
        budget, what it hosts plus what its free KV memory can hold (a borrowed expert takes
        KV room from the survivor's requests). A rank with queued requests borrows nothing: the
        room is theirs. None: unbounded."""
        if self.capacity is not None:
            return self.capacity
        if limits.kv_budget_bytes is None:
            return None
        per = limits.expert_nbytes
        return {r: len(placement.experts_of(r)) + (max(0, free) // per if queued == 0 else 0)
                for r, free, queued in zip(placement.ranks, report.kv_free, report.queued)}

    def _migrate(self, engine, plan: dict[int, int]) -> None:
        """Carry out a migration plan: givers export their running requests, takers adopt."""
        ranks = list(engine.moe.placement.ranks)
        payload = engine.export_running() if engine.rank in plan else []
        everyone = [None] * len(ranks)
        dist.all_gather_object(everyone, payload, group=engine.moe.group)
        mine = [p for giver, taker in sorted(plan.items()) if taker == engine.rank
                for p in everyone[ranks.index(giver)]]
        if mine:
            engine.adopt(mine)
        self.timeline.append({"step": engine.record.steps, "migrated": dict(plan)})

    def _release(self, engine, decision: "ReleaseDecision", plan_s: float) -> None:
        """Transfer the leavers' experts, then switch: leavers record their release, survivors
        build their group and re-bind."""
        moe, record = engine.moe, engine.record
        leaving, new_placement, transfers = decision.leaving, decision.placement, decision.transfers
        t1 = time.perf_counter()
        stats = transfer_experts(moe, transfers, moe.group)
        engine.kv_used += stats["received"] * moe.expert_nbytes  # borrowed weights take KV room
        t2 = time.perf_counter()
        now = engine.elapsed()
        if engine.rank in leaving:
            record.release_s = now
            record.extra["release_step"] = record.steps
            moe.drop_borrowed()
            if self.on_event is not None:
                self.on_event("released", engine.rank, now, record.steps)
        else:
            ranks = list(new_placement.ranks)
            name = f"rollout{self.rollout_id}/ep_" + "_".join(map(str, ranks))
            group = self.parallel.new_subgroup(ranks, name=name)
            self._groups.append(group)
            moe.rebind(group, new_placement)
        t3 = time.perf_counter()
        extra = record.extra
        extra["plan_s"] = extra.get("plan_s", 0.0) + plan_s
        extra["transfer_s"] = extra.get("transfer_s", 0.0) + (t2 - t1)
        extra["switch_s"] = extra.get("switch_s", 0.0) + (t3 - t2)
        extra["sent_bytes"] = extra.get("sent_bytes", 0) + stats["sent_bytes"]
        self.timeline.append({"step": record.steps, "time_s": now, "leaving": list(leaving),
                              "active": list(new_placement.ranks),
                              "moved_experts": len(transfers)})


@dataclass
class RolloutLayout:
    """The rollout's starting point: every rank in one EP group (data-parallel attention over
    all ranks), each expert served by one rank that holds it in its training shard."""

    group: dist.ProcessGroup
    placement: object  # megatron_ext.placement.Placement
    holding: dict[int, list[int]]
    layout_id: int = 0  # unique in the job
    rollouts: int = 0  # elastic rollouts started (every rank counts the same)
    resyncs: int = 0  # resyncs done (every rank counts the same): names the arrival counter

    @property
    def heartbeat_key(self) -> str:
        return f"flexfloor/heartbeat/{self.layout_id}"

    @classmethod
    def gather(cls, model, parallel) -> "RolloutLayout":
        """One all-gather of which experts each rank holds; same result on every rank."""
        from torch.distributed import distributed_c10d as c10d

        mine = list(model.decoder.layers[0].mlp.local_expert_indices)
        # a job-unique id (the store outlives every group): names this layout's survivor groups
        layout_id = c10d._get_default_store().add("flexfloor/layouts", 1) if parallel.rank == 0 else None
        everyone = [None] * parallel.world_size
        dist.all_gather_object(everyone, (mine, layout_id), group=parallel.world_group)
        holding = {r: list(e) for r, (e, _) in enumerate(everyone)}
        placement = initial_placement(model.config.num_moe_experts, holding)
        return cls(group=parallel.world_group, placement=placement, holding=holding,
                   layout_id=everyone[0][1])

    def moe(self, model, parallel) -> PlacedMoE:
        return PlacedMoE(model, rank=parallel.rank, group=self.group, placement=self.placement)


def membership_for(policy: ReleasePolicy, parallel, layout: RolloutLayout, elastic_cfg=None,
                   capacity=None, scheduler_cfg=None, step: Optional[int] = None,
                   on_event: ReleaseListener | None = None):
    """The membership value for a release policy (a fresh one per rollout); `step`, the
    training step, names errors and faults; `on_event` is told when this rank is released
    (a static membership releases nobody)."""
    if policy == ReleasePolicy.STATIC:
        return StaticMembership()
    layout.rollouts += 1
    return ElasticMembership(
        rollout_id=f"{layout.layout_id}.{layout.rollouts}",
        parallel=parallel,
        min_active_ranks=elastic_cfg.min_active_ranks if elastic_cfg else 1,
        check_interval_steps=elastic_cfg.check_interval_steps if elastic_cfg else 1,
        capacity=capacity,
        holding=layout.holding,
        migrate_max_requests=(scheduler_cfg.migrate_max_requests
                              if scheduler_cfg is not None and scheduler_cfg.migrate else 0),
        step=step,
        heartbeat_key=layout.heartbeat_key,
        on_event=on_event,
    )


HEARTBEAT_S = 0.5  # how often the active ranks of an elastic rollout post progress


def _store():
    """The job's key-value store (torchrun's agent store, one per launch attempt)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def resync(moe: PlacedMoE, layout: RolloutLayout, parallel, membership, *,
           timeout_s: Optional[float] = None, step: Optional[int] = None,
           on_event: ReleaseListener | None = None) -> float:
    """Every rank back to the starting layout after a rollout. Returns seconds spent here.

    Released ranks arrive early and wait here, outside every rollout collective: each rank adds
    itself to this resync's arrival counter on the job's store and waits until every rank has.
    The wait has no fixed bound: it fails only when nothing moves (no heartbeat from the ranks
    still decoding, no new arrival) for `timeout_s` (default: `parallel.timeout_s`), so survivors
    may decode for as long as their responses need. Survivors drop borrowed experts and re-bind
    the MoE layers to the full group and the starting placement; the model's own expert weights
    (the training shards) never left any rank. `step` (the training step) names errors;
    `on_event` is told "rejoined" once this rank is back (released or not).
    """
    t0 = time.perf_counter()
    moe.drop_borrowed()
    released = [t["step"] for t in getattr(membership, "timeline", [])
                if parallel.rank in t.get("leaving", ())]
    if released:
        inject(FaultPhase.RESYNC, parallel.rank, step)
    layout.resyncs += 1
    timeout_s = parallel.timeout.total_seconds() if timeout_s is None else timeout_s
    where = (f"rank {parallel.rank}, phase 'resync'" + (f", step {step}" if step is not None else "")
             + (f" (released at engine step {released[0]})" if released else ""))
    _wait_for_every_rank(f"flexfloor/resync/{layout.layout_id}.{layout.resyncs}",
                         layout.heartbeat_key, parallel.world_size, timeout_s, where)
    moe.rebind(layout.group, layout.placement)
    membership.close()
    if on_event is not None:
        on_event("rejoined", parallel.rank, time.perf_counter() - t0, -1)
    return time.perf_counter() - t0


def _wait_for_every_rank(key: str, heartbeat_key: str, world: int, timeout_s: float,
                         where: str) -> None:
    """Add this rank to `key`'s count; return once it reaches `world`. Fails when neither the
    count nor the heartbeat counter moved for `timeout_s`."""
    store = _store()
    try:
        if store.add(key, 1) == world:
            store.set(key + "/all", "1")  # wakes the waiting ranks at once
            return
        # store.wait returns the moment the last rank arrives; between waits, look for progress
        # (each timed-out wait logs a c10d warning, so not too often)
        slice_s = min(30.0, timeout_s / 4)
        last, since = None, time.monotonic()
        while True:
            try:
                store.wait([key + "/all"], datetime.timedelta(seconds=slice_s))
                return
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise
            now = (store.add(key, 0), store.add(heartbeat_key, 0))
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > timeout_s:
                raise CollectiveError(
                    f"{where}: no progress for {timeout_s:.0f} s (parallel.timeout_s): {now[0]} of "
                    f"{world} ranks are back and the ranks still decoding posted no heartbeat; a "
                    "peer died or hangs")
    except CollectiveError:
        raise
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(f"{where}: the job's store failed ({type(e).__name__}: {e})") from e
