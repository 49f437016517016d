"""The release protocol: ranks whose own responses are done leave the rollout at step boundaries.

At every step boundary the active ranks agree on who is done (one small all-gather). Every active
rank then computes the same decision (`flexfloor.rollout.release.decide`, a pure function:
migration, leavers, new placement + transfers) and the engine applies it: migration (a moved
request takes its K/V along or is re-prefilled, as the membership's `MoveCosts` price it:
`elastic.move_kv`), then
`ElasticMembership.shrink`, where the leavers send their experts to the survivors over the
current group and the survivors switch to their group and re-bind the MoE layers to it. The
survivors' groups are built ahead: `membership_for` creates every group the rollout plan implies
(`flexfloor.rollout.survivors`) collectively before decoding starts, and they live with the
`RolloutLayout` (reused by the next rollouts, destroyed with the job's groups); a release the plan
did not foresee keeps some would-be leavers idle in the nearest prebuilt group. Leavers record their release time and return from the rollout:
they take part in no further rollout collective. After the rollout, `resync()` brings every rank
back to the training layout.

The release policy is a value: `ReleasePolicy.STATIC` (the verl-like baseline, `StaticMembership`)
or `ReleasePolicy.ELASTIC` (`ElasticMembership`).

With R replicas (`rollout.replicas`, `flexfloor.rollout.replicas`), all of this happens inside
each replica's EP group: `RolloutLayout.start` borrows the experts of the replica placement that
a training shard lacks and binds the replica's group, the survivor groups are planned per
replica, a replica whose requests are done leaves whole (its ranks wait at resync), and resync
drops the borrowed experts and binds the world-wide training view again.

Released ranks wait at resync on the job's store, not in a collective: the wait lasts as long as
the survivors keep making progress (they post a heartbeat), and fails with an error naming the
rank, the phase and the step only when nothing moves for `parallel.timeout_s`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from flexfloor.config import PACE_OFF, ReleasePolicy
from flexfloor.faults import FaultPhase, inject
from flexfloor.rollout.collectives import CollectiveError, gather_objects
from flexfloor.rollout.consolidate import MovePrices
from flexfloor.rollout.engine import Boundary, ShrinkStats, StaticMembership, share_step_state
from flexfloor.rollout.release import (  # noqa: F401  (RankLimits, choose_leavers: re-exported)
    Pace,
    RankLimits,
    ReleaseDecision,
    ReleaseRules,
    choose_leavers,
    decide,
    under_pace,
)
from flexfloor.rollout.replicas import ReplicaTopology, replica_ranks
from flexfloor.rollout.survivors import SurvivorGroups, planned_survivor_sets
from flexfloor.rollout.tails import (
    Across, Mailbox, ModelledClock, MoveCosts, RunningEstimates, TailRules, after_moves,
    mailbox_for, may_give_within, rank_state, within_replica,
)
from megatron_ext.elastic_moe import PlacedMoE
from megatron_ext.placement import initial_placement
from megatron_ext.resharding import transfer_experts


# A release listener, told when this rank leaves a rollout and when it is back after resync:
# fn(event, rank, time_s, engine_step) with event "released" or "rejoined" (engine_step -1).
# A launcher passes one to lend a released worker's devices to other work until resync
# (flexfloor/launch/ray.py); it is a value handed to membership_for and resync, not a global.
ReleaseListener = Callable[[str, int, float, int], None]


def pace_work(states, ranks, moves=(), tails: Optional[TailRules] = None) -> list:
    """The pace rule's `release.Work` from every rank's `RankState` (`tails.rank_state`):
    per rank of `ranks`, in order, (remaining tokens, cached tokens) of each request running
    there, a request of `moves` on its taker. With the correction (elastic.consolidate_correct)
    each is counted as the consolidation's takers count their own: its worst where its
    prediction is known wrong (`Running.worst`), else elastic.consolidate_taker_hedge times its
    estimate, as the simulator's rule counts them; else at its estimate. Pure."""
    hedged = tails is not None and tails.correct
    taker = {m.request_id: m.dst for m in moves}
    work = {r: [] for r in ranks}
    for st in states:
        for q in st.running:
            n = q.remaining
            if hedged:
                n = q.worst if q.worst is not None else tails.taker_hedge * q.remaining
            work[taker.get(q.request_id, st.rank)].append((n, q.cached_tokens))
    return [work[r] for r in ranks]


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
    rollout_id: str = "0"  # the same on every rank, unique in the job
    migrate_max_requests: int = 0  # > 0: a rank's last requests may move to a staying rank
    step: Optional[int] = None  # the training step (names errors and faults)
    heartbeat_key: str = ""  # store counter the active ranks bump; released ranks watch it
    replicas: int = 1  # the rollout's replicas (rollout.replicas); this is one of them
    on_event: ReleaseListener | None = None  # told "released" when this rank leaves
    timeline: list[dict] = field(default_factory=list)  # one entry per shrink
    groups: Optional[SurvivorGroups] = None  # the layout's survivor groups (None: the simulator)
    tails: Optional[TailRules] = None  # tail consolidation (flexfloor/rollout/tails.py); None: off
    mailbox: Optional[Mailbox] = None  # across replicas (R > 1 with consolidation on)
    # how a request moved inside the group travels: its K/V sent or re-prefilled (elastic.move_kv)
    move_costs: MoveCosts = field(default_factory=lambda: MoveCosts.of(None))
    # elastic.pace_model: the cost model a shrink's pace is priced with (`Pace`); None: off
    pace_cost: object = None
    # each running request's prediction from the rollout's plan (`tails.RunningEstimates`), for
    # the pace rule and the decisions across replicas; None: its siblings, else its cap
    estimates: Optional[RunningEstimates] = None
    paced_refusals: int = 0  # boundaries where a shrink was refused for its pace
    _pace: Optional[Pace] = None
    _boundaries: int = 0
    _last_beat: float = 0.0

    def close(self) -> None:
        """End of the rollout (at resync, after re-binding). The survivors' groups stay: they
        belong to the layout and serve the next rollouts."""

    def group_record(self) -> dict:
        """This rank's survivor-group figures for its rollout record: groups created after
        decoding started (0 when the plan held) and each shrink's switch time."""
        return {"groups_created_during_rollout": self.groups.created_during_rollout,
                "switch_s_per_shrink": [t["switch_s"] for t in self.timeline if "switch_s" in t]}

    def step_boundary(self, engine, has_work) -> Boundary:
        """Share the step state and decide; the engine applies the decision (migration,
        `shrink`, its own record)."""
        inject(FaultPhase.ROLLOUT, engine.rank, self.step, engine.record.steps)
        self._last_beat = _heartbeat(self.heartbeat_key, self._last_beat)
        report = share_step_state(engine.moe.group, has_work, engine)
        t0 = time.perf_counter()
        states, arrivals, arrived = None, [], False
        if self.mailbox is not None:
            across = self.mailbox.boundary(engine, report, self.tails)
            if across.action == Across.WAIT:
                return Boundary(across.report)
            if across.action == Across.HAND_OVER:
                self.timeline.append({"step": engine.record.steps, "handed_over": {
                    m.request_id: m.dst for m in across.moves}})
                return Boundary(across.report, ReleaseDecision(hand_over=across.moves))
            if across.action == Across.CORRECT:
                self.timeline.append({"step": engine.record.steps, "corrected": {
                    m.request_id: m.dst for m in across.moves}})
                self._hand_part_over(engine, across.moves)
                # the group decides its releases at the next boundary, on its new state
                return Boundary(across.report)
            report, states, arrivals = across.report, across.states, across.arrivals
            arrived = across.arrived  # the group's, where `arrivals` are this rank's own
        if not any(report.has_work):
            self._replica_leaves(engine)
            return Boundary(report, arrivals=arrivals)
        placement, limits = engine.moe.placement, RankLimits.of(engine)
        prices = self.move_costs.prices(engine.kv_bytes_per_token)
        self._boundaries += 1
        decision = self._paced(engine, self._decide_at(placement, report, limits), placement)
        # migration (scheduler.migrate) is the older form of the same move: not both at once
        # (decided alike on every rank: `_within` gathers)
        if (self.tails is not None and not arrived and not self.migrate_max_requests
                and may_give_within(report, self.tails)):
            decision = self._within(engine, report, decision, states, placement, limits, prices)
        if decision.migrate:
            self.timeline.append({"step": engine.record.steps, "migrated": dict(decision.migrate)})
        if decision.moves:
            self.timeline.append({"step": engine.record.steps, "consolidated": {
                m.request_id: m.dst for m in decision.moves}})
        return Boundary(report, decision, plan_s=time.perf_counter() - t0, arrivals=arrivals,
                        prices=prices)

    def _replica_leaves(self, engine) -> None:
        """This replica's requests are done: it leaves the rollout whole. Unless it is the last
        replica to end (the rollout ends with it), its ranks are released as a shrink's leavers
        are: the timeline says so (resync names it) and `on_event` hears it (a launcher lends
        the workers, offload parks their weights). The replicas' leaders count the replicas
        done on the job's store, so which one ends last is the wall clock's call (a replica of
        fewer steps may end after a faster one); the tokens and step counts never depend on it.
        Collective over the replica's group."""
        if self.replicas <= 1:
            return
        ranks = list(engine.moe.placement.ranks)
        done = (_store().add(f"flexfloor/replicas_done/{self.rollout_id}", 1)
                if engine.rank == ranks[0] else None)
        if gather_objects(engine.moe.group, done)[0] >= self.replicas:
            return
        now, step = engine.rollout.elapsed(), engine.record.steps
        self.timeline.append({"step": step, "time_s": now, "replica_left": ranks})
        if self.on_event is not None:
            self.on_event("released", engine.rank, now, step)

    # ---------------------------------------------------------------- tail consolidation

    def _within(self, engine, report, decision: ReleaseDecision, states, placement,
                limits: RankLimits, prices) -> ReleaseDecision:
        """Consolidation inside the group (tails.within_replica): the ranks' running requests
        (gathered here unless the mailbox gather already brought them), the same moves on every
        rank, each with its K/V or re-prefilled as `prices` say, and the release decision once
        they are done; kept only when every giver then leaves, else `decision` as it was."""
        if states is None:
            # one clock: the bound always holds, so each request's cap is prediction enough
            # (and what the simulator reproduces: tools/simulate.py's tiny-cpu)
            states = gather_objects(engine.moe.group,
                                    rank_state(engine, self.replica, siblings=False))
        cons = within_replica(states, self.tails, max_batch=engine.max_batch_size,
                              block_tokens=engine.block_tokens, prices=prices)
        if not cons.moves:
            return decision
        ranks = list(placement.ranks)
        cached = {q.request_id: q.cached_tokens for s in states for q in s.running}
        moved = after_moves(report, ranks, cons.moves, cached, engine.block_bytes,
                            engine.block_tokens)
        after = self._paced(engine, self._decide_at(placement, moved, limits), placement,
                            cons.moves)
        if not set(cons.leaving_replicas) <= set(after.leaving):
            return decision
        after.moves = cons.moves
        return after

    def _paced(self, engine, decision: ReleaseDecision, placement, moves=()) -> ReleaseDecision:
        """`decision` under the pace rule (elastic.pace_model, `release.Pace`): when it shrinks
        the group, one gather of every rank's running requests, each predicted from the plan
        (`estimates`), else from its siblings finished on its rank, else its cap
        (`tails.rank_state`), with `moves` (tail consolidation inside the group) on their
        takers and, with the correction, hedged as the takers count theirs (`pace_work`); then
        the shrink priced with them and the end to keep (`end_to_keep_s`: `release.under_pace`,
        no second plan).
        Collective over the group (every rank proposes the same shrink)."""
        if self.pace_cost is None or not decision.leaving:
            return decision
        if self._pace is None:
            self._pace = pace_of(self.pace_cost, engine.max_batch_size,
                                 creates=None if self.groups is None else self.groups.creates)
        states = gather_objects(engine.moe.group,
                                rank_state(engine, self.replica, estimates=self.estimates))
        paced = under_pace(self.rules, placement, decision,
                           pace_work(states, placement.ranks, moves, self.tails),
                           self.end_to_keep_s())
        self.paced_refusals += paced.paced
        return paced

    def end_to_keep_s(self) -> Optional[float]:
        """The seconds this replica may still take for a shrink that slows it (`release.decide`'s
        `end_s`): the rollout's end to keep less the replica's modelled clock, where the replicas
        keep modelled seconds (a plan by seconds, `ModelledClock`) and the correction keeps that
        end (elastic.consolidate_correct), as the simulator passes it. None elsewhere (an end in
        engine steps cannot be set against the rule's seconds): a shrink that slows the replica
        is then refused. The same on every rank of the replica (their clock is shared). A
        replica that has shrunk leaves its stalls off that clock (`ModelledClock`), so the room
        is overstated by them."""
        m = self.mailbox
        if (m is None or m.clock is None or m.end_bound is None or self.tails is None
                or not self.tails.correct):
            return None
        return m.end_bound - m.clock.seconds

    @property
    def replica(self) -> int:
        """This rank's replica (0 without the mailbox: within a replica it is not read)."""
        return self.mailbox.replica if self.mailbox is not None else 0

    def hand_over(self, engine, payloads: list[dict], moves) -> None:
        """A giving replica's ranks pass their exported requests to the leader (one gather),
        which writes them into the claimed inboxes and reopens them. This replica's inbox stays
        closed: it leaves (unless it hands part over, `_hand_part_over`)."""
        everyone = gather_objects(engine.moe.group, payloads)
        if engine.rank == engine.moe.placement.ranks[0]:
            self.mailbox.send(moves, [p for part in everyone for p in part])

    def _hand_part_over(self, engine, moves) -> None:
        """The correction (tails.Across.CORRECT): each rank exports its requests among `moves`
        (re-prefilled on their takers, as every move across replicas), the leader writes them
        into the claimed inboxes and reopens this replica's own: it stays with the others.
        Collective over the replica's group."""
        ids = {m.request_id for m in moves if m.src == engine.rank}
        payloads = engine.export_running(moves, across=True, only=ids) if ids else []
        engine.rollout.record.migrated_across += len(payloads)
        self.hand_over(engine, payloads, moves)
        if engine.rank == engine.moe.placement.ranks[0]:
            self.mailbox.reopen()

    @property
    def rules(self) -> ReleaseRules:
        return ReleaseRules(min_active_ranks=self.min_active_ranks,
                            check_interval_steps=self.check_interval_steps,
                            capacity=self.capacity, holding=self.holding,
                            migrate_max_requests=self.migrate_max_requests, pace=self._pace)

    def decide(self, placement, report, limits: RankLimits) -> ReleaseDecision:
        """The release decision at the next step boundary (`flexfloor.rollout.release.decide`,
        pure: no collective, the same on every rank). The simulator (`flexfloor.sim`) calls it
        too."""
        self._boundaries += 1
        return self._decide_at(placement, report, limits)

    def _decide_at(self, placement, report, limits: RankLimits) -> ReleaseDecision:
        """The release decision at the current boundary (counted by the caller), before the
        pace rule (`_paced`). With survivor groups built ahead, when the plan
        did not foresee these leavers only the ranks outside the nearest prebuilt superset
        leave (the others stay idle in it, stepping with empty batches:
        `SurvivorGroups.leavers_for`), fitted before the shrink is planned and paced. Pure, the
        same on every rank."""
        return decide(self.rules, placement, report, limits, self._boundaries,
                      fit=None if self.groups is None else self.groups.leavers_for)

    def shrink(self, moe: PlacedMoE, decision: ReleaseDecision, *, now: float,
               step: int) -> ShrinkStats:
        """Carry out a decision's shrink on this rank: transfer the leavers' experts over the
        current group, then switch: a leaver drops what it borrowed (and tells `on_event`), the
        survivors take their prebuilt group (a late one, counted, only off plan) and re-bind the
        MoE layers. Collective over the group."""
        t1 = time.perf_counter()
        stats = transfer_experts(moe, decision.transfers, moe.group)
        t2 = time.perf_counter()
        leaving = moe.rank in decision.leaving
        if leaving:
            moe.drop_borrowed()
        else:
            switch = self.groups.switch(moe.placement.ranks, decision.leaving)
            if switch.ranks != tuple(decision.placement.ranks):
                raise RuntimeError(f"rank {moe.rank}, phase 'rollout', step {self.step}: survivors "
                                   f"{list(decision.placement.ranks)} got group {switch.ranks}")
            moe.rebind(switch.group, decision.placement)
            if self.mailbox is not None:  # the others see it shrunk now, not a step later
                self.mailbox.shrunk(decision.placement.ranks)
        switch_s = time.perf_counter() - t2  # a leaver's offload (on_event) is not the switch
        if leaving and self.on_event is not None:
            self.on_event("released", moe.rank, now, step)
        self.timeline.append({"step": step, "time_s": now, "leaving": list(decision.leaving),
                              "active": list(decision.placement.ranks),
                              "moved_experts": len(decision.transfers), "switch_s": switch_s})
        return ShrinkStats(borrowed_bytes=stats["received"] * moe.expert_nbytes,
                           sent_bytes=stats["sent_bytes"], transfer_s=t2 - t1, switch_s=switch_s)


@dataclass
class RolloutLayout:
    """The rollout's starting point and its topology.

    `group` / `placement`: the training layout's view, every rank in one EP group (data-parallel
    attention over all ranks), each expert served by one rank that holds it in its training
    shard; resync comes back to it. `topology` (`flexfloor.rollout.replicas`): the R replicas a
    rollout runs on; R = 1 is that same world-wide group. Lifecycle per rollout: `start(moe)`
    (R > 1: fetch the borrowed experts, bind each replica's group) -> `membership_for` ->
    generate -> `resync`.
    """

    group: dist.ProcessGroup
    placement: object  # megatron_ext.placement.Placement
    holding: dict[int, list[int]]
    survivors: SurvivorGroups  # the survivors' groups built ahead, kept across rollouts
    topology: ReplicaTopology = None  # None only for values built by hand: gather sets it
    layout_id: int = 0  # unique in the job
    rollouts: int = 0  # elastic rollouts started (every rank counts the same)
    resyncs: int = 0  # resyncs done (every rank counts the same): names the arrival counter
    started: bool = False  # `start` ran and no resync since (R > 1)
    # the run's model as the cost model reads it (MODEL_PRESETS' keys: `model_shape_of`); what
    # elastic.pace_model prices unless elastic.pace_model_shape names another
    model_shape: Optional[dict] = None

    @property
    def heartbeat_key(self) -> str:
        return f"flexfloor/heartbeat/{self.layout_id}"

    @property
    def replicated(self) -> bool:
        return self.topology is not None and self.topology.count > 1

    @classmethod
    def gather(cls, model, parallel, *, replicas: int = 1) -> "RolloutLayout":
        """One all-gather of which experts each rank holds; same result on every rank. With
        `replicas` > 1 (rollout.replicas), the replica groups are created here too (collective
        over the world)."""
        from torch.distributed import distributed_c10d as c10d

        replica_ranks(parallel.world_size, replicas)  # a bad R fails before any collective
        mine = list(model.decoder.layers[0].mlp.local_expert_indices)
        # a job-unique id (the store outlives every group): names this layout's survivor groups
        layout_id = c10d._get_default_store().add("flexfloor/layouts", 1) if parallel.rank == 0 else None
        everyone = gather_objects(parallel.world_group, (mine, layout_id))
        holding = {r: list(e) for r, (e, _) in enumerate(everyone)}
        placement = initial_placement(model.config.num_moe_experts, holding)
        survivors = SurvivorGroups(rank=parallel.rank, world_size=parallel.world_size,
                                   timeout=parallel.timeout, name_prefix=str(everyone[0][1]))
        topology = ReplicaTopology.build(
            rank=parallel.rank, world_size=parallel.world_size, replicas=replicas,
            num_experts=model.config.num_moe_experts, holding=holding,
            world_group=parallel.world_group, timeout=parallel.timeout, world_placement=placement)
        return cls(group=parallel.world_group, placement=placement, holding=holding,
                   survivors=survivors, topology=topology, layout_id=everyone[0][1],
                   model_shape=model_shape_of(model))

    def moe(self, model, parallel) -> PlacedMoE:
        return PlacedMoE(model, rank=parallel.rank, group=self.group, placement=self.placement)

    def start(self, moe: PlacedMoE) -> dict:
        """The rollout's start (every rank of the world, before `membership_for`): with
        replicas, each rank borrows the experts of its replica placement that its training shard
        lacks (one batch of transfers over the world) and binds the MoE layers to its replica
        group. R = 1: nothing to do. Returns the transfer's stats and seconds."""
        if not self.replicated:
            return {"sent_bytes": 0, "received": 0, "start_s": 0.0}
        t0 = time.perf_counter()
        stats = transfer_experts(moe, list(self.topology.transfers), self.group)
        moe.rebind(self.topology.group, self.topology.placement)
        self.started = True
        return {**stats, "start_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Destroy the survivors' and the replicas' groups (at job end; destroying the world
        does it too)."""
        self.survivors.destroy()
        if self.topology is not None:
            self.topology.destroy()


@dataclass
class ReplicaStaticMembership(StaticMembership):
    """Static EP inside one replica of several: as `StaticMembership`, and the ranks still
    decoding post the heartbeat that the replicas already done wait on at resync."""

    heartbeat_key: str = ""
    _last_beat: float = 0.0

    def step_boundary(self, engine, has_work) -> Boundary:
        self._last_beat = _heartbeat(self.heartbeat_key, self._last_beat)
        return super().step_boundary(engine, has_work)


def membership_for(policy: ReleasePolicy, parallel, layout: RolloutLayout, elastic_cfg=None,
                   capacity=None, scheduler_cfg=None, step: Optional[int] = None,
                   on_event: ReleaseListener | None = None,
                   expected_finish: Optional[dict[int, float]] = None,
                   end_bound: Optional[float] = None,
                   clock: Optional[ModelledClock] = None,
                   estimates: Optional[RunningEstimates] = None):
    """The membership value for a release policy (a fresh one per rollout); `step`, the
    training step, names errors and faults; `on_event` is told when this rank is released
    (a static membership releases nobody).

    With replicas (`layout.topology`), after `layout.start(moe)`: the membership of this rank's
    replica (static: held by its own replica only; the floor is per replica).

    Elastic: tail consolidation (flexfloor/rollout/tails.py) as `elastic_cfg.consolidate`
    says: inside each replica, and with `consolidate_across` across replicas through the job's
    store when R > 1; None (no config given) leaves it off. Collective over the world, before
    decoding. Every survivor group the plan implies (`expected_finish`, rank -> predicted
    steps to its finish, the same on every rank: the scheduler's `RolloutPlan.expected_finish`;
    each replica's ranks leave in their own order) down to the floor is created now, unless an
    earlier rollout of the layout built it. Without a plan nothing is built ahead: each shrink's
    group is then created during the rollout (counted). `end_bound`: the rollout's end to keep
    (`tails.end_to_keep` of the plan), read by the correction across replicas
    (`elastic.consolidate_correct`); None: no correction. `clock`: the replicas' clock across
    replicas in modelled seconds (`modelled_clock`; a plan by seconds, `end_bound` in those
    seconds); None: in engine steps. `estimates`: each running request's prediction from the
    plan (`tails.RunningEstimates.of_plan`), read by the pace rule and the decisions across
    replicas; None: its siblings finished on its rank, else its cap."""
    if layout.replicated and not layout.started:
        raise RuntimeError(f"rank {parallel.rank}: rollout.replicas={layout.topology.count} needs "
                           "layout.start(moe) before membership_for (it fetches the replicas' "
                           "experts)")
    if policy == ReleasePolicy.STATIC:
        if layout.replicated:
            return ReplicaStaticMembership(heartbeat_key=layout.heartbeat_key)
        return StaticMembership()
    layout.rollouts += 1
    topo = layout.topology
    floor = elastic_cfg.min_active_ranks if elastic_cfg else 1
    if topo is not None:
        floor = min(floor, topo.ranks_per_replica)  # the floor is per replica
    if expected_finish is not None:
        if sorted(expected_finish) != list(range(parallel.world_size)):
            raise ValueError(f"expected_finish names ranks {sorted(expected_finish)}; the plan "
                             f"must give one finish per rank 0..{parallel.world_size - 1}")
        replicas = topo.replicas if topo is not None else (tuple(range(parallel.world_size)),)
        layout.survivors.prepare([s for ranks in replicas for s in planned_survivor_sets(
            {r: expected_finish[r] for r in ranks}, floor=floor)])
    else:
        layout.survivors.prepare([])  # resets the rollout's late-group count
    rollout_id = f"{layout.layout_id}.{layout.rollouts}"
    tails = TailRules.of(elastic_cfg, floor)
    mailbox = None
    if tails is not None and tails.across and layout.replicated:
        mailbox = mailbox_for(_store(), rollout_id, topo, parallel.rank, parallel.timeout,
                              end_bound=end_bound, clock=clock, estimates=estimates)
    return ElasticMembership(
        groups=layout.survivors,
        rollout_id=rollout_id,
        tails=tails,
        mailbox=mailbox,
        move_costs=MoveCosts.of(elastic_cfg),
        pace_cost=pace_cost_of(elastic_cfg, layout.model_shape),
        parallel=parallel,
        min_active_ranks=floor,
        check_interval_steps=elastic_cfg.check_interval_steps if elastic_cfg else 1,
        capacity=capacity,
        holding=topo.holding if topo is not None else layout.holding,
        migrate_max_requests=(scheduler_cfg.migrate_max_requests
                              if scheduler_cfg is not None and scheduler_cfg.migrate else 0),
        step=step,
        heartbeat_key=layout.heartbeat_key,
        replicas=topo.count if topo is not None else 1,
        on_event=on_event,
        estimates=estimates,
    )


def model_shape_of(model) -> dict:
    """The Megatron-Core model's shape in `flexfloor.config.MODEL_PRESETS`' keys (what
    `flexfloor.sim.hardware.ModelShape.from_config` reads)."""
    c = model.config
    return {"num_layers": c.num_layers, "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads, "num_query_groups": c.num_query_groups,
            "kv_channels": c.kv_channels, "num_experts": c.num_moe_experts,
            "moe_router_topk": c.moe_router_topk, "moe_ffn_hidden_size": c.moe_ffn_hidden_size,
            "shared_expert_ffn_hidden_size": c.moe_shared_expert_intermediate_size,
            "vocab_size": model.vocab_size}


def pace_cost_of(elastic_cfg, model_shape: Optional[dict]):
    """The cost model elastic.pace_model prices a shrink's pace with: its accelerator and
    elastic.pace_model_shape (a preset), or the run's own shape (`model_shape`); None when the
    rule is off (or no config was given)."""
    if elastic_cfg is None or elastic_cfg.pace_model == PACE_OFF:
        return None
    from flexfloor.sim.cost import RooflineCost, cost_model
    from flexfloor.sim.hardware import ACCELERATORS, ModelShape

    if elastic_cfg.pace_model_shape is not None or model_shape is None:
        return cost_model(elastic_cfg.pace_model, elastic_cfg.pace_model_shape or "tiny")
    cost = cost_model(elastic_cfg.pace_model, "tiny")  # the accelerator's kind (or unit)
    if not isinstance(cost, RooflineCost):
        return cost
    return RooflineCost(ACCELERATORS[elastic_cfg.pace_model],
                        ModelShape.from_config("the run's model", model_shape))


def _priced_placement(placement, cost):
    """`placement` with the engine's experts stretched to the cost model's
    (`sim.cost.model_owner`)."""
    from megatron_ext.placement import Placement
    from flexfloor.sim.cost import model_owner

    return Placement(owner=tuple(model_owner(placement.owner, cost)),
                     ranks=tuple(placement.ranks))


def _require_cost(cost, what: str) -> None:
    if cost is None:
        raise ValueError(f"{what} needs a cost model: set elastic.pace_model to an "
                         "accelerator (e.g. elastic.pace_model=H800)")


def plan_step_cost(cost, placement, max_batch: int):
    """The scheduler's step cost for a plan by modelled seconds (`scheduler.plan_seconds`): a
    rank's step in a replica with every rank loaded alike, and the step's shared part
    (`sim.scenarios.rank_step_cost`, what the simulator's GPU scenarios plan with), priced on a
    replica's `placement` (the first: every replica holds every expert alike), the engine's
    experts stretched to the cost model's (`sim.cost.model_owner`). `cost`: `pace_cost_of`'s."""
    from flexfloor.sim.scenarios import rank_step_cost

    _require_cost(cost, "a plan by modelled seconds")
    return rank_step_cost(cost, _priced_placement(placement, cost), tuple(placement.ranks),
                          max_batch)


def modelled_clock(cost, placement, step_cost) -> ModelledClock:
    """A replica clock in modelled seconds for one rollout of a plan by seconds
    (`tails.ModelledClock`, at 0): `cost` (`pace_cost_of`'s) prices the steps, the plan's
    per-rank step cost (`step_cost`: `plan_step_cost`'s on `placement`) projects the decision's
    ends and a move's re-prefill is priced as the simulator prices it
    (`sim.scenarios.reprefill_seconds_per_token` on `placement`, the engine's experts stretched
    to the cost model's); a move across replicas never transfers K/V (the mailbox carries no
    tensors)."""
    from flexfloor.sim.scenarios import reprefill_seconds_per_token

    _require_cost(cost, "a modelled clock")
    prices = MovePrices(kv_bytes_per_token=1, transfer_bytes_per_s=sys.float_info.min,
                        reprefill_s_per_token=reprefill_seconds_per_token(
                            cost, _priced_placement(placement, cost)))
    return ModelledClock(cost, step_cost.per_rank, prices)


def pace_of(cost, max_batch: int, creates=None) -> Pace:
    """The pace rule's step cost of an EP group from a cost model: a decoding rank's step with
    every decoding rank of its group loaded alike and the others at empty batches (their experts
    compute what is routed to them), the engine's experts stretched to the cost model's; each
    (group, decoding ranks) priced once (`sim.cost.linear_step_cost`, as
    `sim.scenarios.rank_step_cost`, which loads every rank of the group). A shrink's stall:
    its expert transfers, each of the engine's experts standing for its share of the cost
    model's, sent and received at once, then the survivors' group (the cost model's
    `measured_shrink_seconds`, as `price_trace` prices a shrink): created where `creates`
    (active ranks, survivors -> whether the switch creates their group:
    `survivors.creates_group` on the groups built so far) says so, else switched to."""
    from flexfloor.sim.cost import (RankLoad, linear_step_cost, model_owner,
                                    traced_shrink_seconds)

    priced: dict = {}

    def group_cost(placement, busy: tuple):
        key = (tuple(placement.owner), tuple(placement.ranks), tuple(busy))
        if key not in priced:
            owner = model_owner(placement.owner, cost)
            hosted = {r: owner.count(r) for r in placement.ranks}

            def at(n: int, ctx: float) -> float:
                return cost.step_seconds(
                    [RankLoad(r, n if r in busy else 0, int(ctx) if r in busy else 0, hosted[r],
                              ctx if r in busy else 0.0) for r in placement.ranks], owner)

            priced[key] = linear_step_cost(at, max_batch)
        return priced[key]

    def shrink_cost(placement, new_placement, transfers: list) -> float:
        moved: dict = {}
        for t in transfers:
            for r in (t.src, t.dst):
                moved[r] = moved.get(r, 0) + 1
        created = int(creates is not None and creates(placement.ranks, new_placement.ranks))
        return traced_shrink_seconds(moved, len(placement.owner), placement.ranks, created, cost)

    return Pace(group_cost, shrink_cost)


HEARTBEAT_S = 0.5  # how often the active ranks of an elastic rollout post progress
RESYNC_POLL_S = 0.1  # how often a rank waiting at resync looks whether every rank is back


def _heartbeat(key: str, last: float) -> float:
    """Tell the released ranks waiting at resync that the rollout still moves (at most every
    HEARTBEAT_S: one store round trip). Returns the time of the last beat."""
    now = time.monotonic()
    if key and now - last >= HEARTBEAT_S:
        _store().add(key, 1)
        return now
    return last


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
    may decode for as long as their responses need. Every rank drops its borrowed experts (a
    shrink's, and with replicas those `start` fetched) and re-binds the MoE layers to the full
    group and the starting placement; the model's own expert weights
    (the training shards) never left any rank. `step` (the training step) names errors;
    `on_event` is told "rejoined" once this rank is back (released or not).
    """
    t0 = time.perf_counter()
    moe.drop_borrowed()
    released = [t["step"] for t in getattr(membership, "timeline", [])
                if parallel.rank in t.get("leaving", t.get("replica_left", ()))]
    if released:
        inject(FaultPhase.RESYNC, parallel.rank, step)
    layout.resyncs += 1
    timeout_s = parallel.timeout.total_seconds() if timeout_s is None else timeout_s
    where = (f"rank {parallel.rank}, phase 'resync'" + (f", step {step}" if step is not None else "")
             + (f" (released at engine step {released[0]})" if released else ""))
    _wait_for_every_rank(_store(), f"flexfloor/resync/{layout.layout_id}.{layout.resyncs}",
                         layout.heartbeat_key, parallel.world_size, timeout_s, where)
    moe.rebind(layout.group, layout.placement)
    layout.started = False
    membership.close()
    if on_event is not None:
        on_event("rejoined", parallel.rank, time.perf_counter() - t0, -1)
    return time.perf_counter() - t0


def _wait_for_every_rank(store, key: str, heartbeat_key: str, world: int, timeout_s: float,
                         where: str) -> None:
    """Add this rank to `key`'s count on `store`; return once it reaches `world`. Fails when
    neither the count nor the heartbeat counter moved for `timeout_s`."""
    try:
        if store.add(key, 1) == world:
            store.set(key + "/all", "1")  # the waiting ranks see it at their next look
            return
        # A non-blocking look every RESYNC_POLL_S, not a blocking store.wait: Python runs a
        # signal's handler only between its own calls, so a SIGTERM (the launcher stopping the
        # survivors of a dead peer, a preemption) would wait out the whole store.wait. Progress
        # is looked for every slice_s.
        slice_s = min(30.0, timeout_s / 4)
        last, since = None, time.monotonic()
        looked = since
        while not store.check([key + "/all"]):
            time.sleep(RESYNC_POLL_S)
            if time.monotonic() - looked < slice_s:
                continue
            looked = time.monotonic()
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
