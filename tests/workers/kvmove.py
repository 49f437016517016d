"""Moves that take their K/V along, on 4 gloo workers, one launch (shared with the session's
other 4-worker tests): the same requests under the static policy and under the elastic one,
fp32, greedy and sampled, with
- tail consolidation inside the group (R = 1), every move a KV transfer (elastic.move_kv=
  transfer), one request moved twice, under a KV budget;
- the same with every move re-prefilled (elastic.move_kv=reprefill);
- the migration at release (scheduler.migrate: ranks hand their last requests to rank 0), every
  move a KV transfer.

Usage: torchrun --nproc-per-node 4 tests/workers/kvmove.py OUT_DIR
"""

import dataclasses
import os

import torch
from _harness import gather, rollout_outcome as rollout, run

from flexfloor.config import (ElasticConfig, ModelConfig, MoveKV, ReleasePolicy, RolloutConfig,
                              SchedulerConfig)
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

SAMPLING = {"greedy": SamplingParams(greedy=True),
            "sampled": SamplingParams(temperature=1.0, top_p=0.95)}
# Response lengths per rank, one prompt per request. CPU GEMMs of fewer than 4 rows take
# another kernel (a row's last bit then depends on its batch), so every rank steps with 4 or more
# requests whenever it decodes, in the static and the elastic run alike: the log-probs then
# compare bit for bit and a K/V transfer that is not exact shows.
# Consolidation: rank 3's four requests go to rank 0 at the first boundary with running
# requests (the others run five: only rank 3 may give); once rank 0's own five end (6 tokens)
# it hands rank 3's four on, to rank 1: each of them moves twice and decodes on for 14 more
# tokens after its second move.
CONSOLIDATE = {0: [6] * 5, 1: [30] * 5, 2: [28] * 5, 3: [20] * 4}
# migration (scheduler.migrate): rank 1 runs four (the others five) and hands them to rank 0
# (the most work left) at the first boundary
MIGRATE = {0: [40] * 5, 1: [12] * 4, 2: [30] * 5, 3: [20] * 5}
MAX_NEW = 48
# per rank: room for four moved requests to their cap (the migration plan's need) beside the
# borrowed experts of a shrink; nothing is preempted
BUDGET_TOKENS = 1536


def requests(lengths, rank, sampling):
    g = torch.Generator().manual_seed(200 + rank)
    return [Request(prompt_uid=rank * 10 + i, sample_index=0, seed=5, step=1,
                    prompt_ids=tuple(torch.randint(1, 128, (3 + i,), generator=g).tolist()),
                    max_new_tokens=MAX_NEW, target_len=n, sampling=sampling)
            for i, n in enumerate(lengths[rank])]


def main(out):
    rank = int(os.environ["RANK"])
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)
    model = build_model(dataclasses.replace(ModelConfig(), num_experts=8), par)
    rollout_cfg = RolloutConfig(replicas=1, max_batch_size=10, kv_budget_tokens=BUDGET_TOKENS,
                                progress=False)

    def stack(move_kv, migrate=False):
        return RolloutStack.build(
            par, model, rollout=rollout_cfg,
            elastic=ElasticConfig(consolidate=not migrate, consolidate_max_requests=4,
                                  move_kv=move_kv),
            scheduler=SchedulerConfig(migrate=migrate, migrate_max_requests=4))

    stacks = {"transfer": stack(MoveKV.TRANSFER), "reprefill": stack(MoveKV.REPREFILL),
              "migrate": stack(MoveKV.TRANSFER, migrate=True)}
    results = {"budget_bytes": BUDGET_TOKENS * stacks["transfer"].engine.kv_bytes_per_token,
               "kv_bytes_per_token": stacks["transfer"].engine.kv_bytes_per_token}
    for kind, sampling in SAMPLING.items():
        reqs = requests(CONSOLIDATE, rank, sampling)
        case = {"static": rollout(stacks["transfer"], ReleasePolicy.STATIC, reqs),
                "transfer": rollout(stacks["transfer"], ReleasePolicy.ELASTIC, reqs)}
        if kind == "sampled":
            case["reprefill"] = rollout(stacks["reprefill"], ReleasePolicy.ELASTIC, reqs)
        results[f"consolidate_{kind}"] = gather(case)
        reqs = requests(MIGRATE, rank, sampling)
        results[f"migrate_{kind}"] = gather({
            "static": rollout(stacks["migrate"], ReleasePolicy.STATIC, reqs),
            "transfer": rollout(stacks["migrate"], ReleasePolicy.ELASTIC, reqs)})
    for s in stacks.values():
        s.close()
    return results


if __name__ == "__main__":
    run(main)
