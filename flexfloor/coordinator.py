"""The step loop: plan -> generate -> release -> resync -> reward -> advantages -> train ->
validate -> log -> checkpoint. `Job.step()` reads as that sentence; the objects it calls do the
work.

Every rank runs the same loop (SPMD). Rollout results are gathered on every rank after resync and
split evenly by request id for training, so training sees the same data whatever rank generated
it: a step after a static rollout and one after an elastic rollout give the same weights.

Failures: every phase runs under `Job.phase`, which marks an exception with the rank, the phase
and the step (`error_origin`), so the entry point prints one line that says where it happened.
Collectives have timeouts (parallel.timeout_s), so a dead or hung peer ends as such an error.
A restarted job continues from `checkpoint.dir/latest` (checkpoint.resume=auto).

The objects: the rollout stack (flexfloor.rollout.stack: layout, MoE, engine, and per rollout
the release policy's membership), the estimator (flexfloor.trainer.grpo / ppo: advantages and
the update), the checkpoint manager (flexfloor.trainer.checkpointing: what is saved, when,
where a run starts from), the warm start (flexfloor.trainer.warm_start) and the run log
(flexfloor.runlog).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from flexfloor.checkpoint import hold_checkpoint_dir, iter_name
from flexfloor.config import Algorithm, Config, NanPolicy, ReleasePolicy, config_to_dict
from flexfloor.data import Scorer, load_data
from flexfloor.data.cursor import DataCursor
from flexfloor.faults import FaultPhase, inject
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.elastic import ReleaseListener
from flexfloor.rollout.metrics import rollout_metrics
from flexfloor.rollout.offload import HostOffload, OffloadOnRelease, ResidentSet
from flexfloor.rollout.replicas import held_to_end, route_least_outstanding
from flexfloor.rollout.scheduler import PromptGroup, RolloutPlan, Scheduler, prediction_accuracy
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.tails import RunningEstimates, end_to_keep
from flexfloor.rollout.types import Request, SamplingParams
from flexfloor.tokenizer import check_vocab, load_tokenizer
from flexfloor.runlog import RunLog
from flexfloor.trainer.actor import Actor, Sample, logprob_temperature, split_even
from flexfloor.trainer.checkpointing import CheckpointManager, Start
from flexfloor.trainer.critic import Critic
from flexfloor.trainer.grpo import GRPO
from flexfloor.trainer.optim import build_train_state
from flexfloor.trainer.ppo import PPO
from flexfloor.trainer.warm_start import warm_start


class TrainingError(RuntimeError):
    pass


def error_origin(exc: BaseException) -> str | None:
    """"rank R, phase 'P', step S" of an exception raised inside `Job.phase`, else None."""
    return getattr(exc, "flexfloor_origin", None)


@contextlib.contextmanager
def _phase(rank: int, name: str, step: int):
    try:
        yield
    except Exception as e:
        if error_origin(e) is None:
            e.flexfloor_origin = f"rank {rank}, phase '{name}', step {step}"
            e.add_note(f"[flexfloor] in {e.flexfloor_origin}")
        raise


def plan_rollout(scheduler: Scheduler, groups: list[PromptGroup], *, policy: ReleasePolicy,
                 replicas, step_cost=None) -> RolloutPlan:
    """Where each request runs. Elastic: the scheduler's placement (`scheduler.placement`),
    across the replicas by modelled seconds with `step_cost` (`scheduler.plan_seconds`:
    `flexfloor.rollout.elastic.plan_step_cost`), else by predicted steps.
    Static (`elastic.release_policy=static`): the baseline users run, the benchmark's `static`
    mode: each sample to the replica, then the rank, with the fewest outstanding requests
    (`route_least_outstanding` over `replicas`, the rollout's EP groups), whatever
    `scheduler.placement`; the scheduler's predictions stay in the plan (its accuracy metrics),
    its expected finishes do not (a static rollout builds no survivor group)."""
    ranks = [r for g in replicas for r in g]
    # inside each replica: its static bound, its releases and memory floor (as the benchmark)
    plan = scheduler.plan(groups, ranks, replicas=replicas, step_cost=step_cost)
    if policy == ReleasePolicy.STATIC:
        plan = dataclasses.replace(plan, assignment=route_least_outstanding(groups, replicas),
                                   expected_finish={})
    return plan


def gather_all(parallel, items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank."""
    parts = [None] * parallel.world_size
    dist.all_gather_object(parts, items, group=parallel.world_group)
    return [x for part in parts for x in part]


@dataclass
class Rollout:
    """One rollout's results (every rank's, on every rank) and how it ran."""

    results: list  # flexfloor.rollout.types.Result, in request order
    records: list[dict]  # RankRecord.as_dict() of each rank
    plan: RolloutPlan
    membership: object  # the release policy's membership of this rollout
    resync_s: float


class Job:
    """One RL post-training run on this rank."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", "0"))
        self.step_index = 0
        # told when this rank is released from a rollout and when it rejoins at resync
        # (flexfloor.rollout.elastic.ReleaseListener); a launcher sets it, e.g. to lend devices
        self.on_release_event: ReleaseListener | None = None
        with self.phase("set-up"):
            self._set_up(cfg)
            self.dir_lock = (hold_checkpoint_dir(cfg.checkpoint.dir, rank=self.rank,
                                                 say=lambda t: print(f"[flexfloor] {t}"))
                             if cfg.checkpoint.dir else None)
        start, init_from = self.checkpoints.start_point(), cfg.checkpoint.init_from
        with self.phase("checkpoint load"):
            if start.kind == Start.RESUME:
                self._resume(start.path)
            elif start.kind == Start.INIT_FROM:
                self.checkpoints.init_from(start.path, model=self.model,
                                           optimizer=self.train_state.optimizer)
        self.log = RunLog(cfg, self.rank, resumed_step=self.step_index)
        if self._data_note:
            self.log.say(self._data_note)
        if start.kind == Start.RESUME:
            ignored = f"; checkpoint.init_from={init_from} ignored" if init_from else ""
            self.log.say(f"resumed from {iter_name(self.step_index)} ({start.path}){ignored}")
        elif start.kind == Start.INIT_FROM:
            self.log.say(f"initialised the weights from checkpoint.init_from={init_from} "
                         "(fresh optimizer, step 0)")
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            why = ("no complete checkpoint in checkpoint.dir yet" if cfg.checkpoint.dir else
                   "no checkpoint.dir to resume from (set it and checkpoint.save_interval)")
            self.log.say(f"restarted by the launcher, {why}: starting from step 0")

    def phase(self, name: str, step: int | None = None):
        """Context of one phase: an exception leaving it names the rank, the phase and the step
        (1-based as logged; default: the last step done, 0 before the first)."""
        return _phase(self.rank, name, self.step_index if step is None else step)

    def _set_up(self, cfg: Config) -> None:
        self.parallel = Parallel.build(
            expert_parallel_size=cfg.parallel.expert_parallel_size,
            backend=cfg.parallel.backend.value,
            timeout_s=cfg.parallel.timeout_s,
        )
        self.rank = self.parallel.rank
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        check_vocab(self.tokenizer, cfg.model.vocab_size)
        self.scorer = Scorer(cfg.reward.custom_fn)
        data = load_data(cfg.data)
        self.examples, self.val_examples = data.train, data.val  # val: never trained on
        self.scorer.check(e.data_source for e in self.examples + self.val_examples)
        self.prompt_ids = [self._encode_prompt(e) for e in self.examples]
        self.val_prompt_ids = [self._encode_prompt(e) for e in self.val_examples]
        self._data_note = data.note
        self.model = build_model(cfg.model, self.parallel)
        self.train_state = build_train_state(self.model, cfg.trainer, self.parallel,
                                             total_steps=cfg.trainer.steps)
        self.sampling = SamplingParams.from_rollout_config(cfg.rollout,
                                                           eos_id=self.tokenizer.eos_id)
        # the actor's log-probs and loss are under the distribution the engine samples from
        self.actor = Actor(self.train_state, cfg.trainer, self.parallel,
                           valid_vocab=self.tokenizer.vocab_size,
                           temperature=logprob_temperature(self.sampling))
        self.critic = None  # PPO's value model
        if cfg.trainer.algorithm == Algorithm.PPO:
            self.critic = Critic(cfg.model, cfg.trainer, self.parallel,
                                 total_steps=cfg.trainer.steps)
            self.algorithm = PPO(cfg.trainer, self.actor, self.critic, self.parallel)
        else:
            self.algorithm = GRPO(cfg.trainer, self.actor)
        self.reference = None  # the frozen policy the KL is measured to (after the warm start)
        self.checkpoints = CheckpointManager(cfg.checkpoint, cfg.model,
                                             total_steps=cfg.trainer.steps)
        self.stack = RolloutStack.build(self.parallel, self.model, rollout=cfg.rollout,
                                        elastic=cfg.elastic, scheduler=cfg.scheduler,
                                        valid_vocab=self.tokenizer.vocab_size)
        self.scheduler = Scheduler(cfg.scheduler.placement, prior_quantile=cfg.scheduler.prior_quantile,
                                   memory=self.stack.memory,
                                   max_batch_size=cfg.rollout.max_batch_size,
                                   max_share=cfg.scheduler.max_share,
                                   load_cap=cfg.scheduler.load_cap)
        # scheduler.plan_seconds: the replicas' steps priced at elastic.pace_model's step cost
        self.plan_cost = self.stack.plan_step_cost() if cfg.scheduler.plan_seconds else None
        self.cursor = DataCursor(len(self.examples), cfg.data.synthetic_seed, cfg.data.shuffle)
        self.cursor.check(cfg.trainer.prompts_per_step)

    # ------------------------------------------------------------------ the loop

    def run(self, stop=None) -> None:
        """The whole run; `stop()` (every rank, after each step: flexfloor.preemption) ends it
        early, the run then unfinished (`done()` False)."""
        if self.needs_warm_start() and not self.warm_start(stop):
            return
        while not self.done():
            self.step()
            if stop is not None and not self.done() and stop():
                return
        self.log.close()

    def needs_warm_start(self) -> bool:
        """A new run (step 0) with trainer.sft_warmup_steps begins with the supervised warm
        start; a resumed one does not."""
        return self.step_index == 0 and bool(self.cfg.trainer.sft_warmup_steps)

    def done(self) -> bool:
        return self.step_index >= self.cfg.trainer.steps

    def step(self) -> dict:
        t0 = time.perf_counter()
        k = self.step_index + 1
        with self.phase("plan", k):
            self._freeze_reference()
            groups = self.next_prompt_groups()               # data
        roll = self.rollout(groups, k)                       # plan + generate + release + resync
        with self.phase("train", k):
            rewards = self.rewards(roll.results)             # reward
            samples = self.advantages(roll.results, rewards)  # advantages
            train_metrics = self.train(samples)              # train
        self.scheduler.observe(roll.results)
        self.step_index += 1
        metrics = self.step_metrics(roll, rewards, train_metrics, time.perf_counter() - t0)
        if self._should_validate():
            with self.phase("validate"):
                metrics.update(self.validate())              # validate
        self.log.write(metrics, roll.records)                # log
        if self.checkpoints.should_save(self.step_index):
            with self.phase("checkpoint save"):
                self.save()                                  # checkpoint
            inject(FaultPhase.SAVED, self.rank, self.step_index)
        return metrics

    def rollout(self, groups: list[PromptGroup], k: int) -> Rollout:
        """Plan the groups onto the ranks, generate (ranks released as their work ends), resync;
        every rank gets every result."""
        policy = self.cfg.elastic.release_policy
        with self.phase("plan", k):
            plan = plan_rollout(self.scheduler, groups, policy=policy,
                                replicas=self.stack.layout.topology.replicas,
                                step_cost=self.plan_cost)
            run = self.stack.start(policy, step=k, on_event=self._release_listener(),
                                   expected_finish=plan.expected_finish,
                                   end_bound=end_to_keep(plan),
                                   modelled_clock=plan.by_seconds,
                                   estimates=(RunningEstimates.of_plan(
                                       plan, self.scheduler.predictor)
                                       if self.cfg.elastic.plan_estimates else None))
        with self.phase("rollout", k):
            out = run.generate(plan.assignment[self.rank])
        with self.phase("resync", k):
            resync_s = run.resync()
            if isinstance(run.on_event, OffloadOnRelease):
                out.record.note(**run.on_event.take_stats())
            # in request order, not rank order: every metric then is the same whatever the
            # placement (a mean over rank order would round differently per layout)
            results = sorted(gather_all(self.parallel, out.results),
                             key=lambda r: (r.prompt_uid, r.sample_index))
            records = gather_all(self.parallel, [out.record.as_dict()])
            if not run.elastic and self.stack.layout.replicated:
                records = held_to_end(records)  # a replica done waits for the slowest one
        return Rollout(results, records, plan, run.membership, resync_s)

    # ------------------------------------------------------------------ phases

    def next_prompt_groups(self) -> list[PromptGroup]:
        cfg = self.cfg
        groups = []
        for idx in self.cursor.next(cfg.trainer.prompts_per_step):
            ex = self.examples[idx]
            reqs = tuple(
                Request(prompt_uid=ex.uid, sample_index=s, prompt_ids=self.prompt_ids[idx],
                        max_new_tokens=cfg.rollout.max_new_tokens, sampling=self.sampling,
                        seed=cfg.rollout.seed, step=self.step_index)
                for s in range(cfg.rollout.samples_per_prompt)
            )
            groups.append(PromptGroup(ex.uid, reqs))
        return groups

    def rewards(self, results, examples=None) -> dict[str, float]:
        """The score of each result (by request id) against its prompt in `examples` (default:
        the training prompts)."""
        by_uid = {e.uid: e for e in (self.examples if examples is None else examples)}
        out = {}
        for r in results:
            ids = [t for t in r.token_ids if t != self.tokenizer.eos_id]
            out[r.request_id] = self.scorer(by_uid[r.prompt_uid], self.tokenizer.decode(ids))
        return out

    def validate(self) -> dict:
        """Every val prompt with the same engine: greedy (trainer.val_samples=1) or sampled as in
        training; the scheduler's length history is not told (val prompts are not its data)."""
        cfg = self.cfg
        n = cfg.trainer.val_samples
        sampling = (dataclasses.replace(self.sampling, greedy=True) if n == 1 else self.sampling)
        groups = [PromptGroup(ex.uid, tuple(
            Request(prompt_uid=ex.uid, sample_index=s, prompt_ids=ids,
                    max_new_tokens=cfg.rollout.max_new_tokens, sampling=sampling,
                    seed=cfg.rollout.seed, step=self.step_index) for s in range(n)))
            for ex, ids in zip(self.val_examples, self.val_prompt_ids)]
        roll = self.rollout(groups, self.step_index)
        scores = list(self.rewards(roll.results, self.val_examples).values())
        return {
            "val/reward/mean": float(np.mean(scores)),
            "val/solved": float(np.mean([s == 1.0 for s in scores])),
            "val/response_length/mean": float(np.mean([len(r.token_ids) for r in roll.results])),
        }

    def _should_validate(self) -> bool:
        every = self.cfg.trainer.val_interval
        return bool(every and self.val_examples) and (
            self.step_index % every == 0 or self.step_index == self.cfg.trainer.steps)

    def advantages(self, results, rewards) -> list[Sample]:
        """Every rank's samples in request-id order (the same on every rank), with the
        estimator's advantages (PPO's come in `train`, once the critic has valued them)."""
        results = sorted(results, key=lambda r: (r.prompt_uid, r.sample_index))
        samples = [Sample(r.prompt_ids, r.token_ids, score=rewards[r.request_id],
                          group=r.prompt_uid, rollout_logprobs=r.logprobs) for r in results]
        self.algorithm.advantages(samples)
        return samples

    def train(self, samples: list[Sample]) -> dict:
        """The estimator's update on this rank's share (an even split by request id)."""
        mine = split_even(samples, self.parallel.world_size)[self.rank]
        inject(FaultPhase.TRAIN, self.rank, self.step_index + 1)
        return self.algorithm.update(mine, global_tokens=sum(len(s.response_ids) for s in samples),
                                     reference=self.reference, on_skipped=self._non_finite)

    def warm_start(self, stop=None) -> bool:
        """Supervised steps on correct answers of the training prompts before RL (cached);
        `stop()` ends it early (False)."""
        with self.phase("warm start"):
            return warm_start(self.cfg, model=self.model, train_state=self.train_state,
                              parallel=self.parallel, examples=self.examples,
                              prompt_ids=self.prompt_ids, tokenizer=self.tokenizer,
                              say=self.log.say, stop=stop)

    # ------------------------------------------------------------------ bookkeeping

    def step_metrics(self, rollout: Rollout, rewards, train_metrics, step_s) -> dict:
        results, records, plan = rollout.results, rollout.records, rollout.plan
        roll = rollout_metrics(records, results)
        lengths = [len(r.token_ids) for r in results]
        realised = {}
        for r in results:
            realised[r.prompt_uid] = max(realised.get(r.prompt_uid, 0), len(r.token_ids))
        acc = prediction_accuracy(plan.predicted, realised)
        scores = list(rewards.values())
        m = {
            "step": self.step_index,
            "reward/mean": float(np.mean(scores)),
            "reward/max": float(np.max(scores)),
            "reward/solved": float(np.mean([s == 1.0 for s in scores])),
            "response_length/mean": float(np.mean(lengths)),
            "response_length/max": int(np.max(lengths)),
            "rollout/tokens_per_occupied_worker_second": roll["tokens_per_occupied_worker_second"],
            "rollout/tokens_per_occupied_worker_step": roll["tokens_per_occupied_worker_step"],
            "rollout/tail_fraction": roll["tail_fraction"],
            "rollout/released_ranks": roll["released_ranks"],
            "rollout/occupied_worker_steps": roll["occupied_worker_steps"],
            "rollout/wall_seconds": roll["rollout_wall_seconds"],
            "rollout/release_s": [p["release_s"] for p in roll["per_rank"]],
            "rollout/steps": [r["steps"] for r in records],  # engine steps each rank took part in
            "rollout/local_finish_s": [p["local_finish_s"] for p in roll["per_rank"]],
            "scheduler/spearman": acc["spearman"],
            "scheduler/mae": acc["mae"],
            "data/epoch": self.cursor.epoch,  # the cursor after this step's prompts
            "data/position": self.cursor.position,
            "timing/resync_s": rollout.resync_s,
            "timing/step_s": step_s,
        }
        m.update({k: v for k, v in train_metrics.items() if not isinstance(v, bool)})
        return m

    def _release_listener(self):
        """What hears this rank's release and rejoin: the launcher's listener, behind the
        offload of this rank's weights and optimizer state when `elastic.offload_on_release`."""
        if not self.cfg.elastic.offloads(self.parallel.device):
            return self.on_release_event
        also = []
        if self.critic is not None:
            also.append(ResidentSet(self.critic.module, self.critic.state))
        if self.reference is not None:
            also.append(ResidentSet(self.reference))
        resident = ResidentSet(self.model, self.train_state, self.stack.moe, self.stack.engine,
                               tuple(also))
        return OffloadOnRelease(HostOffload(resident, self.parallel.device),
                                then=self.on_release_event)

    def _freeze_reference(self) -> None:
        """trainer.kl_coef > 0: a frozen copy of the starting policy (after the warm start; a
        resumed run loads it from the checkpoint)."""
        if self.cfg.trainer.kl_coef <= 0 or self.reference is not None:
            return
        self.reference = build_model(self.cfg.model, self.parallel)
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.requires_grad_(False)

    def _non_finite(self, metrics) -> None:
        msg = (f"step {self.step_index + 1}: non-finite loss or gradient ({metrics.get('actor/loss')}); "
               "the update was not applied")
        if self.cfg.trainer.nan_policy == NanPolicy.STOP:
            raise TrainingError(msg + "; set trainer.nan_policy=skip to skip such steps")
        self.log.say(msg + " (trainer.nan_policy=skip)")

    def save(self) -> None:
        extra = {
            "step": self.step_index,
            "cursor": self.cursor.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train_state": self.train_state.state_dict(),
            "config": config_to_dict(self.cfg),
        }
        path = self.checkpoints.save(self.step_index, model=self.model,
                                     optimizer=self.train_state.optimizer, extra=extra,
                                     companions=self._companions())
        self.log.say(f"checkpoint: {path}")

    def _companions(self):
        """(sub-folder, model, optimizer) saved beside the policy: the estimator's (the
        critic), the reference."""
        out = list(self.algorithm.companions())
        if self.reference is not None:
            out.append(("reference", self.reference, None))
        return out

    def _resume(self, path: str) -> None:
        if self.cfg.trainer.kl_coef > 0:  # its weights come from the checkpoint
            self.reference = build_model(self.cfg.model, self.parallel)
            self.reference.requires_grad_(False)
        step, extra = self.checkpoints.resume(path, model=self.model,
                                              optimizer=self.train_state.optimizer,
                                              companions=self._companions())
        self.train_state.load_state_dict(extra["train_state"])
        self.cursor.load_state_dict(extra["cursor"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step_index = step

    def close(self) -> None:
        if self.dir_lock is not None:
            self.dir_lock.release()
        self.stack.close()
        self.parallel.destroy()

    def _encode_prompt(self, example) -> tuple[int, ...]:
        ids = ([self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []) + \
            self.tokenizer.encode(example.prompt)
        if len(ids) > self.cfg.data.max_prompt_len:
            raise TrainingError(
                f"prompt uid {example.uid} has {len(ids)} tokens, more than data.max_prompt_len="
                f"{self.cfg.data.max_prompt_len}; raise data.max_prompt_len (with "
                "model.max_seq_len) or remove the prompt from the data")
        return tuple(ids)
