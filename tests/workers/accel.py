"""Accelerator-readiness cases on 4 gloo workers, one launch: one memory model for fp32 and bf16;
offload on release (live bytes, bit-identical resync, training after an offloading rollout equals
training after a static one); survivor groups built ahead from a plan (no group created on plan,
the nearest prebuilt group off plan, a late group only as the last resort).

Usage: torchrun --nproc-per-node 4 tests/workers/accel.py OUT_DIR
"""

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flexfloor.config import (ModelConfig, PlacementPolicy, ReleasePolicy, RolloutConfig,
                              TrainerConfig)
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel
from flexfloor.rollout.engine import DEFAULT_BLOCK_TOKENS, RolloutError
from flexfloor.rollout.offload import HostOffload, OffloadOnRelease, ResidentSet, resident_bytes
from flexfloor.rollout.scheduler import LengthHistory, MemoryModel, PromptGroup, Scheduler
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.survivors import SurvivorGroups, planned_survivor_sets
from flexfloor.rollout.types import Request, SamplingParams
from flexfloor.trainer.optim import build_train_state

from _harness import gather, run

LONGEST = [12, 9, 6, 3]  # each rank's longest response: a 4 -> 3 -> 2 -> 1 rollout
BUDGET_TOKENS = 48  # three whole KV blocks of the engine's default 16 tokens


def requests(rank, sampling, longest=LONGEST):
    g = torch.Generator().manual_seed(rank)
    lengths = [longest[rank], max(1, longest[rank] - 2)]
    return [Request(prompt_uid=rank * 10 + i, sample_index=0, seed=5, step=1,
                    prompt_ids=tuple(torch.randint(1, 128, (4 + i,), generator=g).tolist()),
                    max_new_tokens=32, target_len=n, sampling=sampling)
            for i, n in enumerate(lengths)]


def memory_case(par, rank):
    """The same kv_budget_tokens admits the same tokens in the scheduler and the engine, in fp32
    and in bf16; the measured model equals the simulator's formula."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dataclasses.replace(ModelConfig(), params_dtype=dtype)
        model = build_model(cfg, par)
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(
            kv_budget_tokens=BUDGET_TOKENS, kv_block_tokens=DEFAULT_BLOCK_TOKENS, progress=False))
        memory, engine = stack.memory, stack.engine
        verdict = {}
        for total in (BUDGET_TOKENS, BUDGET_TOKENS + 1):
            req = Request(prompt_uid=0, sample_index=0, prompt_ids=(1, 2), max_new_tokens=total - 2)
            try:
                engine.check_requests([req])
                verdict[total] = "admitted"
            except RolloutError as e:
                verdict[total] = "refused: " + str(e)
        history = LengthHistory()
        for uid, n in enumerate([30, 20, 10, 5, 25, 15, 8, 3]):
            history.record(uid, [n, n])
        groups = [PromptGroup(uid, tuple(Request(prompt_uid=uid, sample_index=s, prompt_ids=(1, 2, 3),
                                                 max_new_tokens=40) for s in range(2)))
                  for uid in range(8)]
        plan = Scheduler(PlacementPolicy.FLEXFLOOR, history=history, memory=memory).plan(
            groups, range(4))
        out[dtype] = {
            "scheduler_kv_tokens": memory.kv_tokens(),
            "engine_kv_tokens": engine.capacity_blocks * engine.block_tokens,
            "kv_bytes_per_token": memory.kv_bytes_per_token,
            "engine_kv_bytes_per_token": engine.kv_bytes_per_token,
            "expert_bytes": memory.expert_bytes,
            "moe_expert_nbytes": engine.moe.expert_nbytes,
            "formula_equal": memory == MemoryModel.from_model_config(
                cfg, kv_budget_tokens=BUDGET_TOKENS, block_tokens=DEFAULT_BLOCK_TOKENS),
            "verdict": verdict,
            "plan": {r: [q.request_id for q in reqs] for r, reqs in plan.assignment.items()},
        }
        stack.close()
    return out


class Replica:
    """One model with its Megatron DDP, Adam and engine: what a rank of the job holds."""

    def __init__(self, par, rank):
        self.par, self.rank = par, rank
        self.model = build_model(ModelConfig(), par)
        self.train_state = build_train_state(self.model, TrainerConfig(lr=1e-2), par, total_steps=4)
        self.stack = RolloutStack.build(par, self.model,
                                        rollout=RolloutConfig(max_batch_size=8, progress=False))
        self.resident = ResidentSet(self.model, self.train_state, self.stack.moe,
                                    self.stack.engine)

    def train(self, token_rows):
        """One optimizer step of next-token loss on `token_rows` (this rank's share)."""
        ts = self.train_state
        ts.zero_grad()
        self.model.train()
        for row in token_rows:
            tokens = torch.tensor([row])
            logits = forward_logits(ts.model, tokens[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), tokens[0, 1:])
            loss.backward()
        applied, _ = ts.step()
        return applied

    def state_bytes(self):
        """Every offloadable storage's bytes (weights, grad buffers, optimizer state), cloned."""
        return [torch.empty(0, dtype=torch.uint8).set_(s).clone() for s in self.resident.offloadable()]

    def weights(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def offload_case(par, rank):
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    warm = [[1 + (rank * 7 + i) % 120 for i in range(10)]]
    static, elastic = Replica(par, rank), Replica(par, rank)
    for rep in (static, elastic):  # Adam state and grad buffers exist before the rollout
        rep.train(warm)
    res = {"start_equal": all(torch.equal(a, b) for a, b in zip(static.state_bytes(),
                                                                 elastic.state_bytes()))}

    # static rollout, then train on its responses
    run = static.stack.start(ReleasePolicy.STATIC)
    out_static = run.generate(requests(rank, sampling))
    run.resync(timeout_s=60)

    # elastic rollout with offload on release, then train on its responses
    listener = OffloadOnRelease(HostOffload(elastic.resident, par.device))
    before_state = elastic.state_bytes()
    run = elastic.stack.start(ReleasePolicy.ELASTIC, on_event=listener,
                              expected_finish=dict(enumerate(map(float, LONGEST))))
    groups = len(c10d._world.pg_map)  # after the groups built ahead
    out_elastic = run.generate(requests(rank, sampling))
    res["on_plan"] = {"groups_added": len(c10d._world.pg_map) - groups,
                      **run.membership.group_record(),
                      "built_ahead": elastic.stack.layout.survivors.created_ahead,
                      "leaving": [t["leaving"] for t in run.membership.timeline]}
    survivor_bytes = resident_bytes(elastic.resident, par.device)  # at its rollout end
    run.resync(timeout_s=60)
    stats = listener.take_stats()
    after_state = elastic.state_bytes()
    res["restored_bit_identical"] = (len(before_state) == len(after_state) and all(
        torch.equal(a, b) for a, b in zip(before_state, after_state)))
    res["stats"] = stats
    res["released"] = out_elastic.record.release_step is not None and bool(stats)
    res["survivor_bytes_at_end"] = survivor_bytes
    res["tokens_static"] = {r.request_id: r.token_ids for r in out_static.results}
    res["tokens_elastic"] = {r.request_id: r.token_ids for r in out_elastic.results}
    rows = {}
    for rep, out in ((static, out_static), (elastic, out_elastic)):
        rows[id(rep)] = sorted(list(r.prompt_ids) + list(r.token_ids) for r in out.results)
    for rep in (static, elastic):
        res.setdefault("applied", []).append(rep.train(rows[id(rep)]))
    ws, we = static.weights(), elastic.weights()
    res["trained_equal"] = all(torch.equal(ws[n], we[n]) for n in ws)
    res["trained_changed"] = any(not torch.equal(a, b) for a, b in zip(
        before_state, elastic.state_bytes()))
    res["optimizer_equal"] = all(torch.equal(a, b) for a, b in zip(static.state_bytes(),
                                                                    elastic.state_bytes()))
    res["off_plan"] = off_plan_rollout(static, par, rank, sampling)
    return res


def off_plan_rollout(rep, par, rank, sampling):
    """A plan that is wrong: it predicts rank 3, then 1, then 2 to finish (groups (0, 1, 2),
    (0, 2), (0,)), while 2 and 3 finish together, then 1. The release keeps 2 idle in (0, 1, 2),
    then needs (0, 1): created then by its members (counted); tokens as static's."""
    longest = [12, 9, 3, 3]
    run = rep.stack.start(ReleasePolicy.STATIC)
    static = run.generate(requests(rank, sampling, longest))
    run.resync(timeout_s=60)
    run = rep.stack.start(ReleasePolicy.ELASTIC, expected_finish={0: 12.0, 1: 3.0, 2: 9.0, 3: 1.0})
    groups = len(c10d._world.pg_map)
    out = run.generate(requests(rank, sampling, longest))
    mem = run.membership
    res = {"groups_added": len(c10d._world.pg_map) - groups, **mem.group_record(),
           "leaving": [t["leaving"] for t in mem.timeline],
           "active": [t["active"] for t in mem.timeline],
           "tokens_equal": ({r.request_id: r.token_ids for r in static.results}
                            == {r.request_id: r.token_ids for r in out.results}),
           "tokens": len(out.results)}
    run.resync(timeout_s=60)
    return res


def survivor_case(par, rank):
    groups = SurvivorGroups(rank=rank, world_size=par.world_size, timeout=par.timeout)
    expected = {0: 12.0, 1: 9.0, 2: 6.0, 3: 3.0}
    sets = planned_survivor_sets(expected)
    res = {"sets": sets, "made": groups.prepare(sets), "made_again": groups.prepare(sets)}
    before = len(c10d._world.pg_map)
    # on plan: 4 -> 3 -> 2 -> 1, every rank computes each switch while it is active
    on_plan = []
    for active, leaving in (((0, 1, 2, 3), [3]), ((0, 1, 2), [2]), ((0, 1), [1])):
        if rank not in active:
            break
        sw = groups.switch(active, leaving)
        if sw.group is not None:  # the group works: a sum over its members
            t = torch.tensor([rank + 1])
            dist.all_reduce(t, group=sw.group)
            on_plan.append((sw.ranks, int(t), sw.created))
        else:
            on_plan.append((sw.ranks, None, sw.created))
    res["on_plan"] = on_plan
    res["groups_added_on_plan"] = len(c10d._world.pg_map) - before
    res["created_on_plan"] = groups.created_during_rollout
    dist.barrier()
    # off plan: 1 and 3 finish first; (0, 2) is not prebuilt, (0, 1, 2) holds it: 3 leaves,
    # 1 stays idle
    sw = groups.switch((0, 1, 2, 3), [1, 3])
    res["off_plan_superset"] = {"leaving": sw.leaving, "ranks": sw.ranks, "kept": sw.kept_idle,
                                "created": sw.created}
    # off plan, no prebuilt group smaller than (0, 1, 2) holds (0, 2): created by 0 and 2 only
    late = None
    if rank in (0, 1, 2):
        sw = groups.switch((0, 1, 2), [1])
        if sw.group is not None:
            t = torch.tensor([rank + 1])
            dist.all_reduce(t, group=sw.group)
            late = (sw.ranks, int(t), sw.created)
    res["late"] = late
    res["created_late"] = groups.created_during_rollout
    # the pace rule's pricing of a shrink to (0, 2): a switch now on the ranks that took part
    # in making it (0, 2, and 1, which left), a creation on rank 3 until `prepare` shares it
    res["creates_late_before"] = groups.creates((0, 1, 2), (0, 2))
    groups.prepare(sets)
    res["creates_late_after"] = groups.creates((0, 1, 2, 3), (0, 2))
    dist.barrier()
    groups.destroy()
    return res


def job_case(out):
    """The coordinator's own wiring: one GRPO step with elastic.offload_on_release=true equals
    one with static release (same weights); the released ranks' records carry the offload."""
    from flexfloor.config import load_config
    from flexfloor.coordinator import Job

    base = ["trainer.steps=1", "trainer.prompts_per_step=4", "trainer.micro_batch_size=8",
            "trainer.lr=1e-2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
            "rollout.progress=false", "data.synthetic_num_prompts=8", "logging.tensorboard=false",
            "logging.timeline_plot=false", "parallel.timeout_s=60"]
    weights, records = {}, {}
    for name, extra in (("static", ["elastic.release_policy=static"]),
                        ("offload", ["elastic.offload_on_release=true"])):
        cfg = load_config(None, base + extra + [f"logging.run_dir={out}/run_{name}"])
        job = Job(cfg.resolve_world(dist.get_world_size()))
        job.step()
        weights[name] = {n: p.detach().clone() for n, p in job.model.named_parameters()}
        records[name] = job.log.timelines[-1] if job.log.timelines else []  # rank 0 logs
        job.log.close()
        job.parallel.barrier()
        del job
    return {"weights_equal": all(torch.equal(weights["static"][n], weights["offload"][n])
                                 for n in weights["static"]),
            "records": records["offload"]}


def main(out):
    rank = int(os.environ["RANK"])
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)
    results = {"memory": memory_case(par, rank), "offload": offload_case(par, rank),
               "survivors": survivor_case(par, rank)}
    results["job"] = job_case(out)
    return gather(results)


if __name__ == "__main__":
    run(main)
