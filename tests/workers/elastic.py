"""Elastic-EP cases on 4 gloo workers, one launch: static vs elastic tokens for shrink sequences
4->2->1, 4->3->1, 4->3->2->1 with 8 and 6 experts, greedy and sampled; resync restores the
training layout; released ranks take no further step.

Usage: torchrun --nproc-per-node 4 tests/workers/elastic.py OUT_DIR
"""

import dataclasses
import os

import torch

from flexfloor.config import (ElasticConfig, ModelConfig, ReleasePolicy, RolloutConfig,
                              SchedulerConfig)
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

from _harness import gather, run, timed

# the response length of each rank's longest request: who finishes when
SEQUENCES = {"4-2-1": [30, 20, 10, 10], "4-3-1": [30, 20, 20, 10], "4-3-2-1": [40, 30, 20, 10]}
SAMPLING = {"greedy": SamplingParams(greedy=True), "sampled": SamplingParams(temperature=1.0, top_p=0.95)}


def requests(rank, longest, sampling):
    g = torch.Generator().manual_seed(rank)
    lengths = [longest, max(1, longest - 3), 4]
    return [Request(prompt_uid=rank * 10 + i, sample_index=0, seed=11, step=1,
                    prompt_ids=tuple(torch.randint(1, 128, (4 + i,), generator=g).tolist()),
                    max_new_tokens=64, target_len=n, sampling=sampling)
            for i, n in enumerate(lengths)]


def stack_of(par, model, *, migrate=0, kv_budget_tokens=None, pace_model="none"):
    """The rollout stack of `model`; `migrate` > 0: a rank's last `migrate` requests may move
    to a staying rank (scheduler.migrate_max_requests); `pace_model`: elastic.pace_model
    (priced for qwen3-30b-a3b's shape). The paper's release alone: tail consolidation (on by
    default) would change the shrink sequences these cases pin."""
    return RolloutStack.build(
        par, model, rollout=RolloutConfig(max_batch_size=8, kv_budget_tokens=kv_budget_tokens,
                                          progress=False),
        elastic=ElasticConfig(consolidate=False, pace_model=pace_model,
                              pace_model_shape="qwen3-30b-a3b"),
        scheduler=SchedulerConfig(migrate=migrate > 0, migrate_max_requests=migrate))


def static_vs_elastic(stack, reqs, *, expected_finish=None):
    """The same requests under the static and the elastic policy; every rank's view, gathered.
    `expected_finish` (rank -> predicted steps): the plan the survivor groups are built from."""
    case = {}
    for policy in (ReleasePolicy.STATIC, ReleasePolicy.ELASTIC):
        with timed(f"elastic: {policy.value} rollout"):
            run = stack.start(policy, expected_finish=expected_finish)
            # each rank's rollout clock starts at its generate call; the ranks leave the last
            # resync up to its poll apart (0.1 s), more than the 10 steps between two releases
            # that test_elastic orders by release_s: they start together here
            torch.distributed.barrier()
            out = run.generate(reqs)
            run.resync(timeout_s=60)
        case[policy.value] = {"tokens": {r.request_id: r.token_ids for r in out.results},
                              "record": out.record.as_dict(),
                              "timeline": getattr(run.membership, "timeline", [])}
        if policy == ReleasePolicy.ELASTIC:
            case["groups"] = run.membership.group_record()
            case["paced_refusals"] = run.membership.paced_refusals
    return gather(case)


def main(out):
    rank = int(os.environ["RANK"])
    results = {}
    probe = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(50 + rank))
    for experts, train_ep in ((8, 4), (6, 2)):
        model_cfg = dataclasses.replace(ModelConfig(), num_experts=experts)
        with timed(f"elastic: e{experts} world, model and stack"):
            par = Parallel.build(expert_parallel_size=train_ep, timeout_s=60)
            model = build_model(model_cfg, par)
            stack = stack_of(par, model)
        before = forward_logits(model, probe).detach()
        for seq, lengths in SEQUENCES.items():
            for kind, sampling in SAMPLING.items():
                results[f"e{experts}_{seq}_{kind}"] = static_vs_elastic(
                    stack, requests(rank, lengths[rank], sampling),
                    expected_finish=dict(enumerate(map(float, lengths))))
        if experts == 8:
            # beyond the paper: ranks hand their last two requests to rank 0 and leave early
            for dtype in ("float32", "float64"):
                m = build_model(model_cfg, par, params_dtype=dtype) if dtype == "float64" else model
                migrating = stack_of(par, m, migrate=2)
                results[f"migrate_{dtype}"] = static_vs_elastic(
                    migrating, requests(rank, SEQUENCES["4-3-2-1"][rank], SAMPLING["sampled"]))
                migrating.close()
            # a KV budget whose free room holds about two borrowed experts per survivor: the
            # group stops shrinking at its memory floor (2 ranks), tokens unchanged
            per_expert = stack.moe.expert_nbytes
            budget = 2 * per_expert + 60 * stack.engine.kv_bytes_per_token + per_expert // 2
            bounded = stack_of(par, model,
                               kv_budget_tokens=budget // stack.engine.kv_bytes_per_token)
            results["memory_floor"] = static_vs_elastic(
                bounded, requests(rank, SEQUENCES["4-3-2-1"][rank], SAMPLING["greedy"]))
            bounded.close()
            # the pace rule (elastic.pace_model): unit cost never refuses (the shrinks of
            # e8_4-3-2-1_greedy); H800 refuses the shrinks whose survivors would end later
            for pace_model in ("unit", "H800"):
                paced = stack_of(par, model, pace_model=pace_model)
                results[f"paced_{pace_model}"] = static_vs_elastic(
                    paced, requests(rank, SEQUENCES["4-3-2-1"][rank], SAMPLING["greedy"]),
                    expected_finish=dict(enumerate(map(float, SEQUENCES["4-3-2-1"]))))
                paced.close()
        after = forward_logits(model, probe).detach()
        results[f"e{experts}_resync_logits_equal"] = gather(bool(torch.equal(before, after)))
        results[f"e{experts}_initial_placement"] = stack.layout.placement.as_dict()
        stack.close()
        del model, stack
    return results


if __name__ == "__main__":
    run(main)
