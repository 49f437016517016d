"""Trainer cases on 2 gloo workers, one launch: GRPO steps change the weights with finite losses;
a step after a static rollout equals one after an elastic rollout; resume after step k equals
the uninterrupted run at step k+1; PPO; the trainer's log-probs against the engine's at T = 1
and T = 0.7, truncated IS; validation on held-out prompts at its interval; the reduced gradient
of a GRPO step on 2 workers against the single-process gradient of the same batch.

Usage: torchrun --nproc-per-node 2 tests/workers/trainer.py OUT_DIR
"""

import dataclasses
import json
import multiprocessing
import os

import torch
import torch.distributed as dist

from flexfloor.config import load_config
from flexfloor.coordinator import Job
from flexfloor.data import make_synthetic_prompts, write_examples
from flexfloor.model import build_model, causal_positions
from flexfloor.parallel import Parallel
from flexfloor.trainer import algorithms as alg
from flexfloor.trainer.actor import pad_batch, place_per_token

import _rewards  # noqa: F401 - registers test/sevens
from _harness import gather, run

BASE = [
    "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.micro_batch_size=4",
    "trainer.lr=1e-3", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
    "rollout.progress=false", "data.synthetic_num_prompts=16", "data.max_prompt_len=100",
    "logging.tensorboard=false", "logging.timeline_plot=false",
]


def data_file(out):
    return os.path.join(out, "sevens.parquet")


def job(out, *overrides):
    cfg = load_config(None, BASE + [f"logging.run_dir={out}/run",
                                    f"data.train_files=[{data_file(out)}]"] + list(overrides))
    return Job(cfg.resolve_world(dist.get_world_size()))


def weights(j):
    return {n: p.detach().clone() for n, p in j.model.named_parameters()}


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def main(out):
    Parallel.build()  # the world (the harness tears it down)
    if dist.get_rank() == 0:
        examples = [dataclasses.replace(e, data_source="test/sevens")
                    for e in make_synthetic_prompts(16, 0)]
        write_examples(examples, data_file(out))
    dist.barrier()
    res = {}
    # 1. two GRPO steps (elastic) change the weights; losses finite
    j = job(out, "elastic.release_policy=elastic")
    w0 = weights(j)
    m1 = j.step()
    w1 = weights(j)
    m2 = j.step()
    w2 = weights(j)
    res["losses"] = [m1["actor/loss"], m2["actor/loss"]]
    res["changed"] = [not same(w0, w1), not same(w1, w2)]
    res["released"] = [m1["rollout/released_ranks"], m2["rollout/released_ranks"]]
    res["rewards"] = [m1["reward/mean"], m2["reward/mean"]]
    j.parallel.destroy()

    # 2. a step after a static rollout gives the same weights as after an elastic one
    j = job(out, "elastic.release_policy=static")
    j.step()
    j.step()
    res["static_equals_elastic"] = same(weights(j), w2)
    j.parallel.destroy()

    # 3. resume: save at step 1, reload in a fresh job, step: equals the uninterrupted step 2
    ckpt = f"{out}/ckpt"
    j = job(out, f"checkpoint.dir={ckpt}", "checkpoint.save_interval=1")
    j.step()
    # the save's writer processes are gone, and no multiprocessing Manager was started for it
    res["helpers_after_save"] = [p.name for p in multiprocessing.active_children()]
    j.parallel.destroy()
    j = job(out, f"checkpoint.load={ckpt}")
    res["resumed_step"] = j.step_index
    res["resumed_cursor"] = j.cursor.state_dict()
    res["resumed_history_uids"] = len(j.scheduler.history.lengths)
    j.step()
    res["resume_equals_uninterrupted"] = same(weights(j), w2)
    j.parallel.destroy()

    # 4. PPO with a critic and a KL to the reference: two steps, then resume in a fresh job
    ppo = ["trainer.algorithm=ppo", "trainer.kl_coef=0.05", "trainer.kl_estimator=k1",
           "trainer.gae_lambda=0.95", "trainer.critic_lr=1e-3"]
    j = job(out, *ppo, f"checkpoint.dir={out}/ppo", "checkpoint.save_interval=1")
    a0, c0 = weights(j), {n: p.detach().clone() for n, p in j.critic.module.named_parameters()}
    p1 = j.step()
    p2 = j.step()
    res["ppo_losses"] = [p1["actor/loss"], p1["critic/loss"], p2["actor/loss"], p2["critic/loss"]]
    res["ppo_actor_changed"] = not same(a0, weights(j))
    res["ppo_critic_changed"] = not same(c0, {n: p.detach().clone() for n, p in j.critic.module.named_parameters()})
    res["ppo_kl_ref_frozen"] = same(a0, {n: p.detach().clone() for n, p in j.reference.named_parameters()})
    ppo_w2 = weights(j)
    j.parallel.destroy()
    j = job(out, *ppo, f"checkpoint.load={out}/ppo/iter_0000001")
    j.step()
    res["ppo_resume_equals_uninterrupted"] = same(weights(j), ppo_w2)
    j.parallel.destroy()

    # 5. the trainer's old log-probs are the engine's (same tokens, fp32) at T = 1 (case 1) and
    #    T = 0.7, with truncated IS (weights ~1 then); an actor that dropped the temperature
    #    (step 2, the bug put back) would be far off
    res["diff_t1"] = [m1["rollout/logprob_diff_mean"], m1["rollout/logprob_diff_max"]]
    j = job(out, "rollout.temperature=0.7", "trainer.rollout_is=truncated",
            "trainer.rollout_is_cap=2.0")
    w = weights(j)
    m = j.step()
    res["diff_t07"] = [m["rollout/logprob_diff_mean"], m["rollout/logprob_diff_max"]]
    res["is_weight_mean"] = m["actor/is_weight_mean"]
    res["is_changed"] = not same(w, weights(j))
    j.actor.temperature = 1.0  # the bug: log-probs of the raw logits
    res["diff_t07_dropped"] = j.step()["rollout/logprob_diff_max"]
    j.parallel.destroy()

    # 6. the reduced gradient of a GRPO step on 2 data-parallel workers (micro-batches of 4)
    #    equals the single-process gradient of the whole batch in one forward/backward
    j = job(out, "parallel.expert_parallel_size=1", "elastic.release_policy=static",
            "trainer.clip_grad=0", "trainer.ppo_epochs=1")
    single = build_model(j.cfg.model, j.parallel)  # unwrapped, no process group in its math
    single.load_state_dict(j.model.state_dict())
    roll = j.rollout(j.next_prompt_groups(), 1)
    samples = j.advantages(roll.results, j.rewards(roll.results))
    j.train(samples)  # the job's own split, micro-batches, loss scaling and DDP all-reduce
    b = pad_batch(samples, device=j.parallel.device)
    logits = single(b["tokens"], causal_positions(b["tokens"]), attention_mask=None)
    logp = alg.token_logprobs(logits[:, :-1, : j.tokenizer.vocab_size].float(), b["tokens"][:, 1:])
    adv = place_per_token(samples, [[s.advantage] * len(s.response_ids) for s in samples], logp)
    loss, _ = alg.policy_loss(logp, logp.detach(), adv, b["mask"], clip_eps=0.2, agg="token_mean")
    loss.backward()
    reduced = dict(j.model.named_parameters())
    diff = max(float((p.grad - reduced[n].main_grad).abs().max())
               for n, p in single.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in single.parameters())
    res["grad_diff"], res["grad_scale"] = diff, scale
    res["nonzero_advantages"] = sum(1 for s in samples if s.advantage != 0)
    j.parallel.destroy()

    # 7. validation on held-out files every 2 steps and at the end; never trained on
    val = [dataclasses.replace(e, data_source="test/sevens", uid=1000 + e.uid)
           for e in make_synthetic_prompts(40, 0)[16:]]
    val_file = os.path.join(out, "sevens_val.parquet")
    if dist.get_rank() == 0:
        write_examples(val, val_file)
    dist.barrier()
    j = job(out, "trainer.steps=3", "trainer.val_interval=2", f"data.val_files=[{val_file}]",
            f"logging.run_dir={out}/val_run")
    res["val_steps"] = [sorted(k for k in j.step() if k.startswith("val/")) for _ in range(3)]
    train_prompts = {e.prompt for e in j.examples}
    res["val_disjoint"] = not train_prompts & {e.prompt for e in j.val_examples}
    res["val_count"] = len(j.val_examples)
    res["val_in_file"] = len(val)
    seen = set(j.scheduler.history.lengths)  # the uids whose responses were trained on
    res["trained_uids_are_train"] = seen <= {e.uid for e in j.examples}
    res["trained_no_val_uid"] = not seen & {e.uid for e in j.val_examples}
    j.parallel.destroy()
    if dist.get_rank() == 0:
        with open(f"{out}/val_run/metrics.jsonl") as f:
            res["val_lines"] = [sorted(k for k in json.loads(line) if k.startswith("val/"))
                                for line in f]

    # 8. scheduler.plan_seconds: placed by modelled seconds over 2 replicas of 1 rank (the pace
    #    rule on too), with consolidation across replicas and the online correction on the
    #    replicas' modelled clocks; the plan is by seconds and the weights are case 1's (tokens
    #    depend neither on placement nor on moves); in the next epoch (history for every
    #    prompt) the replicas keep the plan's end on their modelled clocks, predicting their
    #    running requests from the plan (elastic.plan_estimates)
    j = job(out, "elastic.release_policy=elastic", "rollout.replicas=2",
            "scheduler.plan_seconds=true", "elastic.pace_model=H800",
            "elastic.consolidate_across=true", "elastic.consolidate_correct=true",
            "elastic.consolidate_taker_hedge=1.25", "elastic.plan_estimates=true")
    j.step()
    j.step()
    res["seconds_plan_equals_elastic"] = same(weights(j), w2)
    j.step()
    j.step()  # the data's 16 prompts seen: the next rollout's have history, so an end to keep
    roll = j.rollout(j.next_prompt_groups(), 5)
    plan = roll.plan
    res["seconds_plan"] = [plan.by_seconds, plan.finish_bound]
    box = roll.membership.mailbox  # the replica's clock and the end it keeps: the plan's
    res["seconds_clock"] = {"kind": type(box.clock).__name__, "priced": box.clock.priced,
                            "seconds": box.clock.seconds, "end_bound": box.end_bound,
                            "steps": roll.records[dist.get_rank()]["steps"]}
    est = box.estimates  # the plan's, read by the mailbox and the pace rule alike
    res["seconds_estimates"] = (est is not None and est is roll.membership.estimates
                                and est.predicted == plan.predicted
                                and est.with_history == (frozenset() if plan.distrusted
                                                         else frozenset(plan.predicted)))
    j.parallel.destroy()

    return gather(res)


if __name__ == "__main__":
    run(main)
