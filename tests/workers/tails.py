"""Tail consolidation on 4 gloo workers, one launch: the same requests under the static policy
and under the elastic policy with consolidation on, at R = 1 (moves inside the world-wide group,
one of them chained: a request moved twice) and R = 2 (moves inside a replica and across
replicas through the job's store), greedy and sampled.

Usage: torchrun --nproc-per-node 4 tests/workers/tails.py OUT_DIR
"""

import dataclasses
import os

import torch
from _harness import gather, rollout_outcome as rollout, run

from flexfloor.config import ElasticConfig, ModelConfig, ReleasePolicy, RolloutConfig
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

SAMPLING = {"greedy": SamplingParams(greedy=True),
            "sampled": SamplingParams(temperature=1.0, top_p=0.95)}
# response lengths per rank, one prompt per request (no siblings: the engine predicts from the
# produced tokens alone, as the simulator's replay does).
# R = 1: rank 3's one request goes to rank 0 at the first boundary with running requests; rank
# 0 is down to two requests (its own long one and rank 3's) while ranks 1 and 2 still run
# three, so it hands both on: rank 3's request moves twice.
WORLD = {0: [26, 4, 4], 1: [30, 24, 18], 2: [28, 22, 16], 3: [20]}
# R = 2, replicas (0, 1) and (2, 3): replica 0 runs six long requests; ranks 2 and 3 run one
# prompt of three samples each (a list: one prompt's samples): two end after 2 tokens, so the
# third is predicted short from its siblings and replica 1 hands the two over. The replicas run
# on their own clocks (on a loaded machine one pair of processes can be tens of steps ahead of
# the other), so the hand-over must save steps wherever it lands: replica 1's tail (60 steps)
# is long, so it saves its ranks' steps even when replica 0 posts its first state tens of steps
# late; replica 0's work (90 steps) is longer still, so the moved requests (under 60 tokens
# left) end inside it even when replica 0 is tens of steps ahead (worked out in
# tests/test_tails.py, test_a_replica_hands_its_requests_to_the_other_and_leaves)
REPLICAS = {0: [90, 88, 86], 1: [89, 87, 85], 2: [[2, 2, 60]], 3: [[2, 2, 58]]}
CONSOLIDATE = {1: ElasticConfig(consolidate=True, consolidate_max_requests=2),
               # two ranks per replica stay: replica 1 can only give to replica 0, whenever its
               # leader sees replica 0's state (the replicas run on their own clocks)
               2: ElasticConfig(consolidate=True, consolidate_max_requests=2, min_active_ranks=2,
                                consolidate_across=True)}
MAX_NEW = {1: 48, 2: 96}  # the requests' cap at R = 1 and R = 2
# R = 2 again (sampled), with the simulator's hedge and correction (flexfloor/rollout/tails.py)
# and an end to keep that no replica passes (each checks its end from half that on: the
# correction's protocol runs, nothing is late). Replica 0's own requests have no finished
# sibling: their estimate is their cap, a bound, so the hedge adds nothing and replica 1 gives
HEDGED = dataclasses.replace(CONSOLIDATE[2], consolidate_correct=True,
                             consolidate_taker_hedge=1.25)
END_BOUND = 120.0  # engine steps: checked from step 60 on, every 1.2 steps; no replica is late


def requests(lengths, rank, sampling, step, max_new):
    g = torch.Generator().manual_seed(100 * step + rank)
    out = []
    for i, n in enumerate(lengths[rank]):
        prompt = tuple(torch.randint(1, 128, (3 + i,), generator=g).tolist())
        out += [Request(prompt_uid=rank * 10 + i, sample_index=s, seed=3, step=step,
                        prompt_ids=prompt, max_new_tokens=max_new, target_len=m,
                        sampling=sampling)
                for s, m in enumerate(n if isinstance(n, list) else [n])]
    return out


def main(out):
    rank = int(os.environ["RANK"])
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)
    model = build_model(dataclasses.replace(ModelConfig(), num_experts=8), par)
    stacks = {r: RolloutStack.build(par, model, elastic=CONSOLIDATE[r], rollout=RolloutConfig(
        replicas=r, max_batch_size=8, progress=False)) for r in (1, 2)}
    results = {"world": WORLD, "replicas": REPLICAS, "max_new_tokens": MAX_NEW[1]}
    for kind, sampling in SAMPLING.items():
        for r, lengths in ((1, WORLD), (2, REPLICAS)):
            reqs = requests(lengths, rank, sampling, step=r, max_new=MAX_NEW[r])
            runs = {"static": rollout(stacks[r], ReleasePolicy.STATIC, reqs),
                    "elastic": rollout(stacks[r], ReleasePolicy.ELASTIC, reqs)}
            if r == 2 and kind == "sampled":  # the same stack (layout, engine), other rules
                runs["hedged"] = rollout(dataclasses.replace(stacks[r], elastic=HEDGED),
                                         ReleasePolicy.ELASTIC, reqs, end_bound=END_BOUND)
            results[f"r{r}_{kind}"] = gather(runs)
    for stack in stacks.values():
        stack.close()
    return results


if __name__ == "__main__":
    run(main)
