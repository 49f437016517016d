"""Padded decode steps (rollout.static_decode) at EP=2 on 2 gloo workers, one launch.

Per dtype (float32: the experts run grouped; float64: no CPU grouped GEMM, the experts' counts
read on the host), the same requests with static_decode off and on, every layer stack audited
(`flexfloor.rollout.capture.audit_steps`); rank 1 runs out of requests first, so it takes
padded steps with no requests of its own. Then an elastic rollout (rank 1 released, rank 0
decodes on alone with borrowed experts, stacked at the shrink) and one where rank 1 hands its
last requests to rank 0, each with static_decode off and on. Writes every rank's tokens, log-probs and audited steps
(signatures as hashes) as results.json.

Usage: torchrun --nproc-per-node 2 tests/workers/capture.py OUT_DIR
"""

import hashlib
import os

import torch

from flexfloor.config import ElasticConfig, ModelConfig, ReleasePolicy, RolloutConfig, SchedulerConfig
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.capture import audit_steps
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

from _harness import gather, run, timed

MODEL = ModelConfig()
KINDS = (SamplingParams(greedy=True), SamplingParams(temperature=1.0, top_k=30, top_p=0.9))


def requests(rank: int, *, target: bool = False):
    """Rank 0: 6 requests, rank 1: 3 shorter ones (it runs out first); greedy and sampled."""
    g = torch.Generator().manual_seed(20 + rank)
    n, longest = (6, 24) if rank == 0 else (3, 9)
    out = []
    for i in range(n):
        plen = int(torch.randint(2, 11, (1,), generator=g))
        length = max(2, longest - 3 * i)
        out.append(Request(prompt_uid=rank * 10 + i, sample_index=0, seed=5, step=1,
                           prompt_ids=tuple(torch.randint(1, MODEL.vocab_size, (plen,),
                                                          generator=g).tolist()),
                           max_new_tokens=length if not target else 64,
                           target_len=length if target else None, sampling=KINDS[i % 2]))
    return out


def digest(signature) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()[:16]


def layer_check(moe, seed: int) -> dict:
    """Every MoE layer over 5 rows, eager, and padded to 8 rows with 3 padding rows of other
    values (`valid`): the real rows' outputs bit for bit, zeros for the padding. Collective over
    the group (every rank passes 8 padded rows). Also how many layers ran borrowed stacks."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(moe.layers[0].parameters()).dtype
    same, zero, borrowed = [], [], 0
    with torch.inference_mode():
        for li in range(len(moe.layers)):
            x = torch.randn(5, 1, moe.hidden, generator=g).to(dtype)
            pad = 100 * torch.randn(3, 1, moe.hidden, generator=g).to(dtype)
            eager = moe.forward(li, x)
            valid = torch.arange(8) < 5
            padded = moe.forward(li, torch.cat([x, pad]), valid)
            same.append(bool(torch.equal(padded[:5], eager)))
            zero.append(bool((padded[5:] == 0).all()))
            found = moe._placed_stack(li, x)
            borrowed += bool(found and found[1])
    return {"same": same, "zero": zero, "borrowed_layers": borrowed,
            "group": list(moe.placement.ranks)}


def rollout(stack, reqs, policy=ReleasePolicy.STATIC, *, seed: int = 0):
    """One rollout of this rank's requests, its layer stacks audited; in an elastic one, the
    survivor checks its MoE layers before the resync (`layer_check`: borrowed experts hosted)."""
    run_ = stack.start(policy)
    with audit_steps(stack.engine) as steps:
        out = run_.generate(reqs)
    survivor = None
    if policy == ReleasePolicy.ELASTIC and stack.moe.group_size == 1:  # the survivor, alone
        survivor = layer_check(stack.moe, seed)  # (a leaver keeps its old group, unused)
    run_.resync(timeout_s=60)
    return {
        "survivor_layers": survivor,
        "tokens": {r.request_id: r.token_ids for r in out.results},
        "logprobs": {r.request_id: r.logprobs for r in out.results},
        "steps": [{"bucket": s.bucket, "ranks": s.ranks, "positions": s.positions,
                   "tokens": s.tokens,
                   "flagged": sorted({f"{f.op}: {f.reason}" for f in s.flagged}),
                   "signature": digest(s.signature), "ops": s.ops} for s in steps],
        "record": {"steps": out.record.steps, "release_step": out.record.release_step,
                   "shrinks": len(out.record.trace.shrinks),
                   "migrated_out": out.record.migrated_out, "adopted": out.record.adopted},
    }


def stack_of(par, model, *, static: bool, migrate: bool = False):
    return RolloutStack.build(
        par, model, rollout=RolloutConfig(max_batch_size=8, progress=False,
                                          static_decode=static),
        elastic=ElasticConfig(consolidate=False),
        scheduler=SchedulerConfig(migrate=migrate, migrate_max_requests=2))


def main(out):
    rank = int(os.environ["RANK"])
    results = {}
    for dtype in ("float32", "float64"):
        with timed(f"capture: {dtype} world and model"):
            par = Parallel.build(expert_parallel_size=2, timeout_s=60)
            model = build_model(MODEL, par, params_dtype=dtype)
        for static in (False, True):
            with timed(f"capture: {dtype} static_decode={static}"):
                stack = stack_of(par, model, static=static)
                results[f"{dtype}_static{int(static)}"] = gather(rollout(stack, requests(rank)))
                if static:  # the EP=2 group: the fixed-capacity dispatch against `dispatch`
                    results[f"{dtype}_layers"] = gather(layer_check(stack.moe, 30 + rank))
                stack.close()
        if dtype == "float32":
            for static in (False, True):
                with timed(f"capture: shrink and migration, static_decode={static}"):
                    stack = stack_of(par, model, static=static)
                    results[f"elastic_static{int(static)}"] = gather(rollout(
                        stack, requests(rank, target=True), ReleasePolicy.ELASTIC))
                    stack.close()
                    stack = stack_of(par, model, static=static, migrate=True)
                    results[f"migrate_static{int(static)}"] = gather(rollout(
                        stack, requests(rank, target=True), ReleasePolicy.ELASTIC))
                    stack.close()
        par.destroy()
        del model
    return results


if __name__ == "__main__":
    run(main)
