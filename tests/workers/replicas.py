"""Engine replicas on 4 gloo workers, one launch: the same requests in every mode (R = 1 and
R = 2 replicas of 2 ranks, the five modes of the benchmark, greedy and sampled); a replica
released whole; a shrink inside each replica; the borrowed experts of the replica placement
fetched at start and dropped at resync.

Usage: torchrun --nproc-per-node 4 tests/workers/replicas.py OUT_DIR
"""

import dataclasses
import os

import torch
import torch.distributed as dist
from _harness import gather, run

from flexfloor.config import (ElasticConfig, ModelConfig, PlacementPolicy, ReleasePolicy,
                              RolloutConfig, SchedulerConfig)
from flexfloor.coordinator import plan_rollout
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel
from flexfloor.rollout.elastic import membership_for
from flexfloor.rollout.replicas import Mode, mode_assignments
from flexfloor.rollout.scheduler import LengthHistory, PromptGroup, Scheduler
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

SAMPLING = {"greedy": SamplingParams(greedy=True),
            "sampled": SamplingParams(temperature=1.0, top_p=0.95)}
# the response lengths of each prompt's two samples: in submission order, least-outstanding
# routing alternates the replicas (0, 1, 0, ...), so replica 0 gets the short ones
LENGTHS = [(4, 18), (3, 16), (5, 20), (4, 12), (2, 14), (3, 10)]


def prompt_groups(sampling):
    g = torch.Generator().manual_seed(7)
    return [PromptGroup(uid, tuple(
        Request(prompt_uid=uid, sample_index=s, seed=5, step=1, sampling=sampling,
                prompt_ids=tuple(torch.randint(1, 128, (4 + uid % 3,), generator=g).tolist()),
                max_new_tokens=32, target_len=n)
        for s, n in enumerate(lens))) for uid, lens in enumerate(LENGTHS)]


def hosted(moe):
    return [sorted(h) for h in moe.hosted]


def rollout(stack, policy, requests, expected_finish=None):
    """One rollout of this rank's requests on `stack` (`policy` None: its elastic section's, as
    the job starts its rollouts); this rank's view."""
    events = []  # what a launcher hears: this rank's release and rejoin
    run = stack.start(policy, expected_finish=expected_finish,
                      on_event=lambda event, rank, time_s, step: events.append([event, step]))
    during = {"hosted": hosted(stack.moe), "group": dist.get_process_group_ranks(stack.moe.group)}
    out = run.generate(requests)
    run.resync(timeout_s=60)
    view = {"tokens": {r.request_id: r.token_ids for r in out.results},
            "record": out.record.as_dict(), "start": run.started, "during": during,
            "timeline": getattr(run.membership, "timeline", []), "events": events,
            "after": {"hosted": hosted(stack.moe),
                      "group": dist.get_process_group_ranks(stack.moe.group),
                      "placement": stack.moe.placement.as_dict()}}
    view["membership"] = type(run.membership).__name__
    if run.elastic:
        view["groups"] = run.membership.group_record()
    return view


def stack_configs(par, model):
    """A stack's config sections reach its rollouts whole: the elastic section's policy, floor
    and check interval, the scheduler section's migration; `start`'s step."""
    stack = RolloutStack.build(
        par, model, rollout=RolloutConfig(progress=False),
        elastic=ElasticConfig(min_active_ranks=3, check_interval_steps=4),
        scheduler=SchedulerConfig(migrate=True, migrate_max_requests=5))
    seen = {}
    for name, elastic in (("elastic", stack.elastic),
                          ("static", ElasticConfig(release_policy=ReleasePolicy.STATIC))):
        run = dataclasses.replace(stack, elastic=elastic).start(step=7)  # the section's policy
        run.generate([])
        run.resync(timeout_s=60)
        m = run.membership
        seen[name] = {"membership": type(m).__name__, "step": getattr(m, "step", None),
                      **{k: getattr(m, k, None) for k in (
                          "min_active_ranks", "check_interval_steps", "migrate_max_requests")}}
    stack.close()
    return seen


def main(out):
    rank = int(os.environ["RANK"])
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)  # training shards of 2 experts
    model = build_model(dataclasses.replace(ModelConfig(), num_experts=8), par)
    probe = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(50 + rank))
    before = forward_logits(model, probe).detach()
    # the paper's release alone (no tail consolidation, on by default): the cases pin its steps
    stacks = {r: RolloutStack.build(par, model, elastic=ElasticConfig(consolidate=False),
                                    rollout=RolloutConfig(replicas=r, max_batch_size=8,
                                                          progress=False)) for r in (1, 2)}
    # the main job's sections: the default elastic one, and elastic.release_policy=static
    job = {name: dataclasses.replace(stacks[2], elastic=cfg) for name, cfg in (
        ("default", ElasticConfig()), ("static", ElasticConfig(release_policy=ReleasePolicy.STATIC)))}
    results = {"own_experts": list(model.decoder.layers[0].mlp.local_expert_indices),
               "replica_placements": [p.as_dict() for p in stacks[2].layout.topology.placements],
               "world_placement": stacks[1].layout.placement.as_dict()}
    world = range(par.world_size)
    for kind, sampling in SAMPLING.items():
        groups = prompt_groups(sampling)
        chunks = Scheduler(PlacementPolicy.BASELINE, max_batch_size=8).plan(groups, world)
        flexfloor = Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), max_batch_size=8)
        plan = flexfloor.plan(groups, world)
        assign = mode_assignments(groups, stacks[2].layout.topology.replicas, chunks=chunks,
                                  flexfloor=plan)
        case = {}
        for mode in Mode:
            r = 1 if mode == Mode.SINGLE_GROUP else 2
            policy = ReleasePolicy.ELASTIC if mode == Mode.ELASTIC else ReleasePolicy.STATIC
            case[mode.value] = rollout(stacks[r], policy, assign[mode][rank],
                                       plan.expected_finish)
        # R = 1 elastic: FlexFloor's placement shrinking the world-wide group
        case["r1_elastic"] = rollout(stacks[1], ReleasePolicy.ELASTIC, assign[Mode.ELASTIC][rank],
                                     plan.expected_finish)
        # the job's rollouts (its plan, the policy its elastic section names): by default
        # FlexFloor with tail consolidation; elastic.release_policy=static, the baseline
        replicas = stacks[2].layout.topology.replicas
        for name, policy in (("default", ReleasePolicy.ELASTIC), ("static", ReleasePolicy.STATIC)):
            job_plan = plan_rollout(flexfloor, groups, policy=policy, replicas=replicas)
            case[f"job_{name}"] = rollout(job[name], None, job_plan.assignment[rank],
                                          job_plan.expected_finish)
        results[kind] = gather(case)
    # a shrink inside each replica: rank 1 leaves replica (0, 1), rank 3 leaves (2, 3)
    longest = [24, 6, 16, 4]
    reqs = [Request(prompt_uid=100 + rank, sample_index=0, seed=5, step=2,
                    prompt_ids=(3, 4, 5 + rank), max_new_tokens=32, target_len=longest[rank])]
    expected = {r: float(n) for r, n in enumerate(longest)}
    results["shrink"] = gather({
        "static": rollout(stacks[1], ReleasePolicy.STATIC, reqs),
        "elastic": rollout(stacks[2], ReleasePolicy.ELASTIC, reqs, expected)})
    # replicas need their start (the stack's start does it): membership_for refuses without
    # it; a bad R fails up front
    try:
        membership_for(ReleasePolicy.STATIC, par, stacks[2].layout)
        results["no_start"] = None
    except RuntimeError as e:
        results["no_start"] = str(e)
    try:
        RolloutStack.build(par, model, rollout=RolloutConfig(replicas=3))
        results["bad_replicas"] = None
    except ValueError as e:
        results["bad_replicas"] = str(e)
    results["stack_configs"] = stack_configs(par, model)
    results["logits_unchanged"] = gather(bool(torch.equal(before, forward_logits(model, probe))))
    for stack in stacks.values():
        stack.close()
    return results


if __name__ == "__main__":
    run(main)
