"""The rollout stack of one model on one rank, wired in one place: the rollout layout (which
experts each rank holds, the replicas' groups, the survivors' groups), the MoE layers bound to
it, the engine, the memory model they and the scheduler count with, and per rollout the release
policy's membership.

    Parallel.build -> build_model -> RolloutStack.build(parallel, model, rollout=..., elastic=...,
    scheduler=...)                                     once per model (collective over the world)
    run = stack.start(policy, step=k, expected_finish=plan.expected_finish)   every rollout
    out = run.generate(my_requests)                                        (the world, together)
    run.resync()                                       every rank back to the training layout
    stack.close()                                      at the end (destroys the layout's groups)

The job (`flexfloor.coordinator`), the benchmark (`tools/bench_rollout.py`) and the test workers
build their rollouts here. The configs are the job's typed sections, passed whole: the elastic
section reaches `membership_for` as it is, so a field added there reaches the release policy
without this module changing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from flexfloor.config import ElasticConfig, ReleasePolicy, RolloutConfig, SchedulerConfig
from flexfloor.parallel import Parallel
from flexfloor.rollout.elastic import (
    ElasticMembership,
    ReleaseListener,
    RolloutLayout,
    membership_for,
    modelled_clock,
    pace_cost_of,
    plan_step_cost,
    resync,
)
from flexfloor.rollout.engine import Membership, RolloutEngine, RolloutOutput
from flexfloor.rollout.scheduler import MemoryModel
from flexfloor.rollout.types import Request
from megatron_ext.elastic_moe import PlacedMoE


@dataclass
class RolloutStack:
    """Layout -> MoE -> engine of one model, and the configs its rollouts run under.

    Lifecycle: `build` (collective over the world) -> per rollout `start` (a `StackRollout`:
    its membership) -> `StackRollout.generate` -> `StackRollout.resync` -> at the end `close`.
    """

    parallel: Parallel
    model: object  # the Megatron-Core GPTModel (the trainer's own weights)
    layout: RolloutLayout
    moe: PlacedMoE  # the model's MoE layers, bound to the layout
    engine: RolloutEngine
    memory: MemoryModel  # what the engine's KV budget is; the scheduler counts with it too
    # None: the release protocol's own defaults (`membership_for` without a config: no tail
    # consolidation), not those of an ElasticConfig()
    elastic: Optional[ElasticConfig] = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # built once, at first use: the plan's step cost, the modelled clock every rollout copies
    _plan_cost: object = field(default=None, init=False, repr=False)
    _clock: object = field(default=None, init=False, repr=False)

    @classmethod
    def build(cls, parallel: Parallel, model, *, rollout: RolloutConfig,
              elastic: Optional[ElasticConfig] = None,
              scheduler: Optional[SchedulerConfig] = None,
              valid_vocab: Optional[int] = None) -> "RolloutStack":
        """The stack of `model` on this rank, from the job's `rollout` section (replicas, batch,
        KV budget and blocks, progress, static_decode, cpu_kernels), `elastic` (release policy, floor,
        consolidation, ...; None: `membership_for`'s defaults) and `scheduler` (migration)
        sections; `valid_vocab`:
        the tokenizer's vocabulary when the model's embedding is padded beyond it. Collective
        over the world (the layout's gather)."""
        layout = RolloutLayout.gather(model, parallel, replicas=rollout.replicas)
        moe = layout.moe(model, parallel)
        memory = MemoryModel.of_model(model, kv_budget_tokens=rollout.kv_budget_tokens,
                                      block_tokens=rollout.kv_block_tokens)
        engine = RolloutEngine(model, moe, rank=parallel.rank,
                               max_batch_size=rollout.max_batch_size,
                               kv_budget_bytes=memory.kv_budget_bytes,
                               block_tokens=memory.block_tokens, progress=rollout.progress,
                               valid_vocab=valid_vocab, static_decode=rollout.static_decode,
                               cpu_kernels=rollout.cpu_kernels)
        return cls(parallel=parallel, model=model, layout=layout, moe=moe, engine=engine,
                   memory=memory, elastic=elastic,
                   scheduler=scheduler if scheduler is not None else SchedulerConfig())

    def start(self, policy: Optional[ReleasePolicy] = None, *, step: Optional[int] = None,
              on_event: ReleaseListener | None = None,
              expected_finish: Optional[dict[int, float]] = None,
              capacity: Optional[dict[int, int]] = None,
              end_bound: Optional[float] = None,
              modelled_clock: bool = False,
              estimates=None) -> "StackRollout":
        """One rollout's start, on every rank of the world: with replicas, each rank borrows the
        experts its replica placement lacks and binds its replica's group; then the membership
        of `policy` (default: the elastic section's `release_policy`), which for an elastic one
        builds the survivor groups the plan (`expected_finish`, rank -> predicted steps) implies.
        `step` (the training step) names errors and faults; `on_event` hears this rank's release
        and, at resync, its rejoin; `capacity`: rank -> most experts it can host; `end_bound`:
        the plan's end to keep (`tails.end_to_keep`; the correction's), in engine steps, or
        with `modelled_clock` (a plan by seconds: `RolloutPlan.by_seconds`) in modelled seconds,
        the clock the replicas then decide on across replicas (`elastic.modelled_clock` at the
        elastic section's `pace_model`); `estimates`: each running request's prediction from
        the plan (`tails.RunningEstimates.of_plan`), for the pace rule and the decisions across
        replicas."""
        if policy is None:
            policy = (self.elastic or ElasticConfig()).release_policy
        started = self.layout.start(self.moe)
        membership = membership_for(
            policy, self.parallel, self.layout, self.elastic, capacity=capacity,
            scheduler_cfg=self.scheduler, step=step, on_event=on_event,
            expected_finish=expected_finish, end_bound=end_bound,
            clock=self.modelled_clock() if modelled_clock else None, estimates=estimates)
        return StackRollout(self, membership, started, step=step, on_event=on_event)

    def plan_step_cost(self):
        """The scheduler's step cost for a plan by modelled seconds (`scheduler.plan_seconds`):
        `elastic.plan_step_cost` at the elastic section's `pace_model`, on the first replica's
        placement and the engine's batch limit (built once)."""
        if self._plan_cost is None:
            self._plan_cost = plan_step_cost(pace_cost_of(self.elastic, self.layout.model_shape),
                                             self.layout.topology.placements[0],
                                             self.engine.max_batch_size)
        return self._plan_cost

    def modelled_clock(self):
        """A fresh replica clock in modelled seconds for one rollout (`elastic.modelled_clock`,
        on the plan's step cost `plan_step_cost`): a copy at 0 of one built once."""
        if self._clock is None:
            self._clock = modelled_clock(pace_cost_of(self.elastic, self.layout.model_shape),
                                         self.layout.topology.placements[0],
                                         self.plan_step_cost())
        return dataclasses.replace(self._clock)

    def close(self) -> None:
        """Destroy the layout's groups (survivors', replicas'); the model and `parallel` stay."""
        self.layout.close()


@dataclass
class StackRollout:
    """One rollout of a `RolloutStack`, from its `start` to its `resync`."""

    stack: RolloutStack
    membership: Membership  # the release policy's (StaticMembership, ElasticMembership, ...)
    started: dict  # `RolloutLayout.start`'s figures: sent_bytes, received, start_s
    step: Optional[int] = None
    on_event: ReleaseListener | None = None

    @property
    def elastic(self) -> bool:
        return isinstance(self.membership, ElasticMembership)

    def generate(self, requests: Sequence[Request]) -> RolloutOutput:
        """This rank's requests (every rank of the world calls it, with its own, possibly none);
        an elastic rollout's record carries its survivor-group figures."""
        out = self.stack.engine.generate(requests, self.membership)
        if self.elastic:
            out.record.note(**self.membership.group_record())
        return out

    def resync(self, *, timeout_s: Optional[float] = None) -> float:
        """Every rank back to the training layout (`flexfloor.rollout.elastic.resync`); seconds
        spent there."""
        s = self.stack
        return resync(s.moe, s.layout, s.parallel, self.membership, timeout_s=timeout_s,
                      step=self.step, on_event=self.on_event)
