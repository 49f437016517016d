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

from flexfloor.config import ModelConfig, PlacementPolicy, ReleasePolicy
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel
from flexfloor.rollout.elastic import RolloutLayout, membership_for, resync
from flexfloor.rollout.engine import RolloutEngine
from flexfloor.rollout.replicas import Mode, mode_assignments
from flexfloor.rollout.scheduler import LengthHistory, PromptGroup, Scheduler
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


def rollout(engine, layout, par, policy, requests, expected_finish=None):
    """One rollout of this rank's requests on `layout`; this rank's view."""
    start = layout.start(engine.moe)
    during = {"hosted": hosted(engine.moe),
              "group": dist.get_process_group_ranks(engine.moe.group)}
    membership = membership_for(policy, par, layout, expected_finish=expected_finish)
    out = engine.generate(requests, membership)
    resync(engine.moe, layout, par, membership, timeout_s=60)
    view = {"tokens": {r.request_id: r.token_ids for r in out.results},
            "record": out.record.as_dict(), "start": start, "during": during,
            "timeline": getattr(membership, "timeline", []),
            "after": {"hosted": hosted(engine.moe),
                      "group": dist.get_process_group_ranks(engine.moe.group),
                      "placement": engine.moe.placement.as_dict()}}
    if policy == ReleasePolicy.ELASTIC:
        view["groups"] = membership.group_record()
    return view


def main(out):
    rank = int(os.environ["RANK"])
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)  # training shards of 2 experts
    model = build_model(dataclasses.replace(ModelConfig(), num_experts=8), par)
    probe = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(50 + rank))
    before = forward_logits(model, probe).detach()
    layouts = {1: RolloutLayout.gather(model, par), 2: RolloutLayout.gather(model, par, replicas=2)}
    engines = {r: RolloutEngine(model, lay.moe(model, par), rank=rank, max_batch_size=8)
               for r, lay in layouts.items()}
    results = {"own_experts": list(model.decoder.layers[0].mlp.local_expert_indices),
               "replica_placements": [p.as_dict() for p in layouts[2].topology.placements],
               "world_placement": layouts[1].placement.as_dict()}
    world = range(par.world_size)
    for kind, sampling in SAMPLING.items():
        groups = prompt_groups(sampling)
        chunks = Scheduler(PlacementPolicy.BASELINE, max_batch_size=8).plan(groups, world)
        flexfloor = Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), max_batch_size=8)
        plan = flexfloor.plan(groups, world)
        assign = mode_assignments(groups, layouts[2].topology.replicas, chunks=chunks,
                                  flexfloor=plan)
        case = {}
        for mode in Mode:
            r = 1 if mode == Mode.SINGLE_GROUP else 2
            policy = ReleasePolicy.ELASTIC if mode == Mode.ELASTIC else ReleasePolicy.STATIC
            case[mode.value] = rollout(engines[r], layouts[r], par, policy,
                                       assign[mode][rank], plan.expected_finish)
        # R = 1 elastic: FlexFloor's placement shrinking the world-wide group
        case["r1_elastic"] = rollout(engines[1], layouts[1], par, ReleasePolicy.ELASTIC,
                                     assign[Mode.ELASTIC][rank], plan.expected_finish)
        results[kind] = gather(case)
    # a shrink inside each replica: rank 1 leaves replica (0, 1), rank 3 leaves (2, 3)
    longest = [24, 6, 16, 4]
    reqs = [Request(prompt_uid=100 + rank, sample_index=0, seed=5, step=2,
                    prompt_ids=(3, 4, 5 + rank), max_new_tokens=32, target_len=longest[rank])]
    expected = {r: float(n) for r, n in enumerate(longest)}
    results["shrink"] = gather({
        "static": rollout(engines[1], layouts[1], par, ReleasePolicy.STATIC, reqs),
        "elastic": rollout(engines[2], layouts[2], par, ReleasePolicy.ELASTIC, reqs, expected)})
    # replicas need their start: membership_for refuses without it; a bad R fails up front
    try:
        membership_for(ReleasePolicy.STATIC, par, layouts[2])
        results["no_start"] = None
    except RuntimeError as e:
        results["no_start"] = str(e)
    try:
        RolloutLayout.gather(model, par, replicas=3)
        results["bad_replicas"] = None
    except ValueError as e:
        results["bad_replicas"] = str(e)
    results["logits_unchanged"] = gather(bool(torch.equal(before, forward_logits(model, probe))))
    for lay in layouts.values():
        lay.close()
    return results


if __name__ == "__main__":
    run(main)
