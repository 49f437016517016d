"""Soak: many rollouts with random lengths, seeds, sampling and release orders on 4 gloo ranks.

Usage: torchrun --nproc-per-node 4 tests/workers/soak.py OUT_DIR ROLLOUTS

Each round draws (the same on every rank) a workload: prompts with 1-3 samples each, every
sample's response length, the rank each prompt group runs on (so who leaves when), greedy or
sampled decoding, the seed, the floor (elastic.min_active_ranks) and whether last requests may
migrate. It runs the round statically and elastically (float64, so batch composition cannot
move a last bit) and records, per rank, what the invariants need: tokens, the layout after
resync, KV bytes, hosted experts, live tensor bytes and RSS.
"""

import dataclasses
import gc
import random
import time
from collections import Counter

import psutil
import torch

from flexfloor.config import (ElasticConfig, ModelConfig, ReleasePolicy, RolloutConfig,
                              SchedulerConfig)
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.survivors import live_process_groups
from flexfloor.rollout.types import Request, SamplingParams

from _harness import gather, run, timed


def workload(round_: int, world: int):
    """The round's requests for every rank, and its knobs; a function of the round only.
    Round 0 warms up every path (each rank decodes, releases, migrates), so that what is built
    once on first use (rotary tables, ...) exists before memory is compared."""
    if round_ == 0:
        per_rank = {r: [Request(prompt_uid=r, sample_index=0, prompt_ids=(1, 2, 3),
                                max_new_tokens=48, target_len=30 - 8 * r, step=0)]
                    for r in range(world)}
        return per_rank, {r: 1 for r in range(world)}, {"min_active_ranks": 1, "migrate": 1}
    rng = random.Random(7919 * round_ + 1)
    sampling = (SamplingParams(greedy=True) if rng.random() < 0.4 else
                SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]),
                               top_k=rng.choice([0, 20])))
    seed = rng.randrange(1 << 30)
    per_rank = {r: [] for r in range(world)}
    prompts = {}
    for uid in range(rng.randint(3, 8)):
        n = rng.randint(1, 3)
        prompts[uid] = n
        prompt = tuple(rng.randrange(1, 128) for _ in range(rng.randint(2, 10)))
        rank = rng.randrange(world)  # some ranks get nothing and leave at the first boundary
        for s in range(n):
            length = max(1, min(48, int(rng.lognormvariate(2.3, 0.8))))
            per_rank[rank].append(Request(prompt_uid=uid, sample_index=s, prompt_ids=prompt,
                                          max_new_tokens=48, target_len=length,
                                          sampling=sampling, seed=seed, step=round_))
    knobs = {"min_active_ranks": rng.choice([1, 1, 2]), "migrate": rng.choice([0, 0, 2])}
    return per_rank, prompts, knobs


def live_storages() -> dict[int, tuple[int, str]]:
    """Every tensor storage Python can reach (parameters, caches, borrowed experts), by address:
    its bytes, and the shape and dtype of one tensor on it."""
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.data_ptr() not in seen or st.nbytes() > seen[st.data_ptr()][0]:
                seen[st.data_ptr()] = (st.nbytes(), f"{tuple(obj.shape)} {obj.dtype}")
    return seen


def settled_storages(tries: int = 3) -> dict[int, tuple[int, str]]:
    """`live_storages()` once two readings a moment apart agree: a tensor that a collective or
    an exception's frame holds for an instant is gone by the second, one that outlives its
    rollout is in both."""
    last = live_storages()
    for _ in range(tries):
        gc.collect()
        time.sleep(0.05)
        now = live_storages()
        if sum(v[0] for v in now.values()) == sum(v[0] for v in last.values()):
            return now
        last = now
    return last


def added(before: dict[int, tuple[int, str]], after: dict[int, tuple[int, str]]) -> list[int]:
    """Addresses of the storages in `after` beyond `before`'s, compared by (bytes, shape, dtype)
    (a cache rebuilt at every resync lands elsewhere: not an addition)."""
    extra = Counter(after.values()) - Counter(before.values())
    picked = []
    for a, sig in sorted(after.items(), key=lambda kv: kv[0] in before):
        if extra[sig] > 0:
            extra[sig] -= 1
            picked.append(a)
    return picked


def described(storages: dict[int, tuple[int, str]], addresses) -> list[str]:
    """What a leak report names for each storage at `addresses`: bytes, shape, dtype, holders."""
    holders = {a: set() for a in addresses}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() in holders:
            holders[obj.untyped_storage().data_ptr()] |= {
                type(h).__name__ for h in gc.get_referrers(obj)} - {"list", "frame"}
    return sorted(f"{storages[a][0]} B {storages[a][1]} held by {','.join(sorted(h)) or '?'}"
                  for a, h in holders.items())


def main(out, rollouts):
    with timed("soak: world, model and stack"):
        par = Parallel.build(timeout_s=60)
        rank, world = par.rank, par.world_size
        model = build_model(ModelConfig(), par, params_dtype="float64")
        stack = RolloutStack.build(par, model,
                                   rollout=RolloutConfig(max_batch_size=4, progress=False))
    layout, moe = stack.layout, stack.moe
    start_placement = layout.placement.as_dict()
    groups_at_start = live_process_groups()
    own = [sorted(h) for h in moe.hosted]
    proc = psutil.Process()
    rounds, baseline = [], None
    t_start = time.perf_counter()
    for i in range(int(rollouts)):
        per_rank, prompts, knobs = workload(i, world)
        mine = per_rank[rank]
        t0 = time.perf_counter()
        run = stack.start(ReleasePolicy.STATIC, step=i)
        static = run.generate(mine)
        run.resync()
        # the round's floor and migration: the same stack under the round's config sections
        knobbed = dataclasses.replace(
            stack, elastic=ElasticConfig(min_active_ranks=knobs["min_active_ranks"]),
            scheduler=SchedulerConfig(migrate=knobs["migrate"] > 0,
                                      migrate_max_requests=knobs["migrate"]))
        run = knobbed.start(ReleasePolicy.ELASTIC, step=i)
        m = run.membership
        elastic = run.generate(mine)
        run.resync()
        gc.collect()
        storages = settled_storages()
        if i == 1:  # round 0 warmed every path up: from here on nothing may be added
            baseline = storages
        rounds.append({
            "prompts": prompts, "knobs": knobs,
            "static": {r.request_id: r.token_ids for r in static.results},
            "elastic": {r.request_id: r.token_ids for r in elastic.results},
            "release_step": elastic.record.release_step,
            "shrinks": [t.get("active") for t in m.timeline if "active" in t],
            "placement_restored": moe.placement.as_dict() == start_placement,
            "group_restored": moe.group is layout.group,
            "own_experts_only": [sorted(h) for h in moe.hosted] == own,
            # every group this process holds beyond the start is one of the layout's survivor
            # groups (kept for the next rollouts, one per set): none leaks
            "survivor_groups_left": live_process_groups() - groups_at_start - sum(
                g is not None for g in [*layout.survivors.prebuilt.values(),
                                        *layout.survivors.late.values()]),
            "tensor_bytes": sum(v[0] for v in storages.values()),
            "storages_added": [] if baseline is None else described(storages, added(baseline,
                                                                                     storages)),
            "rss": proc.memory_info().rss,
            "seconds": time.perf_counter() - t0,
        })
    return {"ranks": gather(rounds), "seconds": time.perf_counter() - t_start}


if __name__ == "__main__":
    run(main)
