"""Rollout-engine cases on 4 gloo workers, one launch.

Writes, per case, every result (tokens, log-probs, finish reason) gathered on rank 0, plus the
no-cache full-recompute reference computed at EP=1 (each rank alone, the stock Megatron forward).

Usage: torchrun --nproc-per-node 4 tests/workers/engine.py OUT_DIR
"""

import os

import torch
import torch.nn.functional as F

from flexfloor.config import ModelConfig, ReleasePolicy, RolloutConfig
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel
from flexfloor.rollout.engine import RolloutError
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

from _harness import gather, run, timed, write

MODEL = ModelConfig()
GREEDY = SamplingParams(greedy=True)
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
TEMPERED = SamplingParams(temperature=0.7, top_k=20)


def workload(sampling, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        plen = int(torch.randint(3, 12, (1,), generator=g))
        prompt = tuple(torch.randint(1, MODEL.vocab_size, (plen,), generator=g).tolist())
        reqs.append(Request(prompt_uid=i // 2, sample_index=i % 2, prompt_ids=prompt,
                            max_new_tokens=int(torch.randint(4, 20, (1,), generator=g)),
                            sampling=sampling, seed=7, step=3))
    return reqs


def mine(reqs, rank, world, shift=0):
    return [r for i, r in enumerate(reqs) if (i + shift) % world == rank]


def stack_of(par, model, *, max_batch_size=64, kv_budget_tokens=None):
    """The rollout stack in EP groups of the training EP size: world / EP replicas (EP 1: each
    rank alone runs the stock layer)."""
    return RolloutStack.build(par, model, rollout=RolloutConfig(
        replicas=par.world_size // par.ep_size, max_batch_size=max_batch_size,
        kv_budget_tokens=kv_budget_tokens, progress=False))


def decode(stack, reqs):
    """A static rollout of this rank's requests."""
    run = stack.start(ReleasePolicy.STATIC)
    out = run.generate(reqs)
    run.resync(timeout_s=60)
    return out


def decode_once(par, model, reqs, **engine):
    """`decode` on a stack of its own (`engine`: its batch size, KV budget)."""
    stack = stack_of(par, model, **engine)
    try:
        return decode(stack, reqs)
    finally:
        stack.close()


def gathered(out):
    rows = [dict(id=r.request_id, tokens=r.token_ids, logprobs=r.logprobs,
                 reason=r.finish_reason.value, rank=r.rank) for r in out.results]
    return gather({"results": rows, "record": out.record.as_dict()})


def recompute(model, results_by_rank, temperature=1.0):
    """Teacher-forced full forward (no cache) over prompt + response: argmax and log-probs
    (at temperature 1, and at `temperature`)."""
    ref = {}
    for r in results_by_rank:
        seq = list(r.prompt_ids) + r.token_ids
        logits = forward_logits(model, torch.tensor([seq[:-1]]))[0].double()
        resp = logits[len(r.prompt_ids) - 1:]
        picked = torch.tensor(r.token_ids).view(-1, 1)
        ref[r.request_id] = {
            "argmax": resp.argmax(-1).tolist(),
            "logprobs_t1": F.log_softmax(resp, -1).gather(1, picked).view(-1).tolist(),
            "logprobs_t": F.log_softmax(resp / temperature, -1).gather(1, picked).view(-1).tolist(),
            "logprobs": r.logprobs,
        }
    return ref


def main(out_dir):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    greedy, sampled = workload(GREEDY), workload(SAMPLED, seed=1)

    for dtype in ("float32", "float64"):
        for ep in (1, 2, 4):
            with timed(f"engine: {dtype} ep{ep} world, model and stack"):
                par = Parallel.build(expert_parallel_size=ep, timeout_s=60)
                model = build_model(MODEL, par, params_dtype=dtype)
                stack = stack_of(par, model)
            with timed(f"engine: {dtype} ep{ep} greedy + sampled"):
                out_greedy = decode(stack, mine(greedy, rank, world))
                out_sampled = decode(stack, mine(sampled, rank, world))
            write(out_dir, f"greedy_{dtype}_ep{ep}.json", gathered(out_greedy))
            write(out_dir, f"sampled_{dtype}_ep{ep}.json", gathered(out_sampled))
            if dtype == "float64" and ep == 4:
                with timed(f"engine: {dtype} ep4 batch sizes and KV budgets"):
                    # other batch sizes and another assignment of requests to ranks
                    for bs in (1, 3):
                        write(out_dir, f"sampled_{dtype}_ep4_bs{bs}.json", gathered(decode_once(
                            par, model, mine(sampled, rank, world, shift=1), max_batch_size=bs)))
                    # all 16 requests on one rank, decoded as one batch of 16
                    write(out_dir, "sampled_float64_ep4_bs16.json", gathered(decode_once(
                        par, model, sampled if rank == 0 else [], max_batch_size=16)))
                    # a KV budget that holds about two requests at once
                    out = decode_once(par, model, mine(greedy, rank, world), kv_budget_tokens=2 * 32)
                    write(out_dir, "kv_budget.json", {"budget": 2 * 32 * run_kv_bytes(model),
                                                      "parts": gathered(out)})
                    # a pool of 3 blocks for 4 requests of up to 2 blocks each: running requests
                    # are preempted and re-prefilled later
                    out = decode_once(par, model, mine(sampled, rank, world), kv_budget_tokens=3 * 16)
                    write(out_dir, "preempted.json", {"budget": 3 * 16 * run_kv_bytes(model),
                                                      "parts": gathered(out)})
            if ep == 1:
                with timed(f"engine: {dtype} ep1 no-cache reference"):
                    # no-cache reference of the EP=1 rollouts above: each rank ran the stock layer
                    # alone
                    ref = recompute(model, out_greedy.results)
                    refs = recompute(model, out_sampled.results)
                    outt = decode(stack, mine(workload(TEMPERED, seed=2), rank, world))
                    reft = recompute(model, outt.results, temperature=TEMPERED.temperature)
                    write(out_dir, f"reference_{dtype}.json",
                          gather({"greedy": ref, "sampled": refs, "tempered": reft}))
            stack.close()
            del model, stack

    # bad input: a prompt longer than the context; an empty rollout
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)
    model = build_model(MODEL, par)
    stack = stack_of(par, model)
    errors = {}
    long = Request(prompt_uid=99, sample_index=0, prompt_ids=tuple([5] * MODEL.max_seq_len),
                   max_new_tokens=4, sampling=GREEDY)
    try:
        decode(stack, [long] if rank == 0 else [])
    except RolloutError as e:
        errors["long_prompt"] = str(e)
    errors["refused_on_every_rank"] = all(gather("long_prompt" in errors))
    # a request that can never fit the KV budget (one block of 16 tokens)
    big = Request(prompt_uid=98, sample_index=0, prompt_ids=tuple([5] * 12), max_new_tokens=8,
                  sampling=GREEDY)
    try:
        decode_once(par, model, [big] if rank == 1 else [], kv_budget_tokens=16)
    except RolloutError as e:
        errors["never_fits"] = str(e)
    out = decode(stack, [])
    stack.close()
    errors["empty_steps"] = out.record.steps
    errors["empty_results"] = len(out.results)
    write(out_dir, "errors.json", errors)


def run_kv_bytes(model):
    from flexfloor.rollout.engine import kv_bytes_per_token
    return kv_bytes_per_token(model.config)


if __name__ == "__main__":
    run(main)
