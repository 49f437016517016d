"""The step loop: plan -> generate -> release -> resync -> reward -> advantages -> train ->
checkpoint -> log. `Job.step()` reads as that sentence; the objects it calls do the work.

Every rank runs the same loop (SPMD). Rollout results are gathered on every rank after resync and
split evenly by request id for training, so training sees the same data whatever rank generated
it: a step after a static rollout and one after an elastic rollout give the same weights.

Failures: every phase runs under `Job.phase`, which marks an exception with the rank, the phase
and the step (`error_origin`), so the entry point prints one line that says where it happened.
Collectives have timeouts (parallel.timeout_s), so a dead or hung peer ends as such an error.
A restarted job continues from `checkpoint.dir/latest` (checkpoint.resume=auto).

Where the weights come from, first match wins: a resume (`checkpoint.dir/latest` with
checkpoint.resume=auto, or `checkpoint.load`: weights, optimizer, step, data cursor, companions),
then `checkpoint.init_from` (weights only, e.g. a converted HF checkpoint: fresh optimizer and
schedule, step 0), then the random init of `model.seed`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from flexfloor.checkpoint import (CheckpointError, iter_name, load_checkpoint, read_meta,
                                  resolve_checkpoint, rng_state, save_checkpoint, set_rng_state)
from flexfloor.config import Algorithm, Config, NanPolicy, Resume, config_to_dict
from flexfloor.data import compute_score, load_prompts, sft_response
from flexfloor.faults import FaultPhase, inject
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.elastic import ReleaseListener, RolloutLayout, membership_for, resync
from flexfloor.rollout.engine import RolloutEngine
from flexfloor.rollout.metrics import rollout_metrics
from flexfloor.rollout.offload import HostOffload, OffloadOnRelease, ResidentSet
from flexfloor.rollout.scheduler import MemoryModel, PromptGroup, Scheduler, prediction_accuracy
from flexfloor.rollout.types import Request, SamplingParams
from flexfloor.tokenizer import check_vocab, load_tokenizer
from flexfloor.trainer import algorithms as alg
from flexfloor.trainer.actor import Actor, Sample, split_even
from flexfloor.trainer.critic import Critic
from flexfloor.trainer.optim import build_train_state


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


@dataclass
class DataCursor:
    """Where the run is in the prompt stream: epoch and position, reshuffled each epoch."""

    num_prompts: int
    seed: int
    shuffle: bool
    epoch: int = 0
    position: int = 0

    def order(self, epoch: int) -> list[int]:
        idx = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def next(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position >= self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
            take = self.order(self.epoch)[self.position : self.position + n - len(out)]
            out += take
            self.position += len(take)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def gather_all(parallel, items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank."""
    parts = [None] * parallel.world_size
    dist.all_gather_object(parts, items, group=parallel.world_group)
    return [x for part in parts for x in part]


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
        start, init_from = self._start_checkpoint(), cfg.checkpoint.init_from
        with self.phase("checkpoint load"):
            if start:
                self._load(start)
            elif init_from:
                self._init_from(init_from)
        self.log = RunLog(cfg, self.rank, resumed_step=self.step_index)
        if start:
            ignored = f"; checkpoint.init_from={init_from} ignored" if init_from else ""
            self.log.say(f"resumed from {iter_name(self.step_index)} ({start}){ignored}")
        elif init_from:
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
        self.examples = load_prompts(cfg.data.train_files, cfg.data.synthetic_num_prompts,
                                     cfg.data.synthetic_seed)
        self.prompt_ids = [self._encode_prompt(e) for e in self.examples]
        self.model = build_model(cfg.model, self.parallel)
        self.train_state = build_train_state(self.model, cfg.trainer, self.parallel,
                                             total_steps=cfg.trainer.steps)
        self.actor = Actor(self.train_state, cfg.trainer, self.parallel,
                           valid_vocab=self.tokenizer.vocab_size)
        self.critic = (Critic(cfg.model, cfg.trainer, self.parallel, total_steps=cfg.trainer.steps)
                       if cfg.trainer.algorithm == Algorithm.PPO else None)
        self.reference = None  # the frozen policy the KL is measured to (after the warm start)
        self.layout = RolloutLayout.gather(self.model, self.parallel)
        self.moe = self.layout.moe(self.model, self.parallel)
        memory = MemoryModel.of_model(self.model, kv_budget_tokens=cfg.rollout.kv_budget_tokens)
        self.engine = RolloutEngine(
            self.model, self.moe, rank=self.rank, max_batch_size=cfg.rollout.max_batch_size,
            kv_budget_bytes=memory.kv_budget_bytes, progress=cfg.rollout.progress,
            valid_vocab=self.tokenizer.vocab_size,
        )
        self.scheduler = Scheduler(cfg.scheduler.placement, prior_quantile=cfg.scheduler.prior_quantile,
                                   memory=memory, max_batch_size=cfg.rollout.max_batch_size,
                                   max_share=cfg.scheduler.max_share,
                                   load_cap=cfg.scheduler.load_cap)
        self.cursor = DataCursor(len(self.examples), cfg.data.synthetic_seed, cfg.data.shuffle)
        self.sampling = SamplingParams.from_rollout_config(cfg.rollout, eos_id=self.tokenizer.eos_id)

    def _start_checkpoint(self) -> str | None:
        """checkpoint.resume=auto: the newest complete checkpoint of checkpoint.dir (a restarted
        job continues); else checkpoint.load."""
        c = self.cfg.checkpoint
        if c.resume == Resume.AUTO and c.dir and os.path.isfile(os.path.join(c.dir, "latest")):
            return c.dir
        return c.load

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        if self.needs_warm_start():
            self.warm_start()
        while not self.done():
            self.step()
        self.log.close(self)

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
            plan = self.scheduler.plan(groups, range(self.parallel.world_size))
            listener = self._release_listener()
            membership = membership_for(self.cfg.elastic.release_policy, self.parallel,
                                        self.layout, self.cfg.elastic,
                                        scheduler_cfg=self.cfg.scheduler, step=k,
                                        on_event=listener)
        with self.phase("rollout", k):                       # generate + release
            out = self.engine.generate(plan.assignment[self.rank], membership)
        with self.phase("resync", k):                        # resync
            resync_s = resync(self.moe, self.layout, self.parallel, membership, step=k,
                              on_event=listener)
            if isinstance(listener, OffloadOnRelease):
                out.record.extra.update(listener.take_stats())
            results = gather_all(self.parallel, out.results)
            records = gather_all(self.parallel, [out.record.as_dict()])
        with self.phase("train", k):
            rewards = self.rewards(results)                  # reward
            samples = self.advantages(results, rewards)      # advantages
            train_metrics = self.train(samples)              # train
        self.scheduler.observe(results)
        self.step_index += 1
        metrics = self.step_metrics(results, rewards, records, plan, train_metrics,
                                    time.perf_counter() - t0, resync_s, membership)
        self.log.write(metrics, records)                     # log
        if self._should_save():
            with self.phase("checkpoint save"):
                self.save()                                  # checkpoint
        return metrics

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

    def rewards(self, results) -> dict[str, float]:
        by_uid = {e.uid: e for e in self.examples}
        out = {}
        for r in results:
            ex = by_uid[r.prompt_uid]
            ids = [t for t in r.token_ids if t != self.tokenizer.eos_id]
            out[r.request_id] = compute_score(ex.data_source, self.tokenizer.decode(ids), ex.ground_truth)
        return out

    def advantages(self, results, rewards) -> list[Sample]:
        """Samples in request-id order (the same on every rank). GRPO: group-normalised rewards
        here; PPO: GAE in `train`, once the critic has valued this rank's share."""
        results = sorted(results, key=lambda r: (r.prompt_uid, r.sample_index))
        scores = [rewards[r.request_id] for r in results]
        samples = [Sample(r.prompt_ids, r.token_ids, score=s) for r, s in zip(results, scores)]
        if self.cfg.trainer.algorithm == Algorithm.GRPO:
            adv = alg.grpo_advantages(torch.tensor(scores, dtype=torch.float64),
                                      torch.tensor([r.prompt_uid for r in results]),
                                      std_norm=self.cfg.trainer.adv_std_norm)
            for smp, a in zip(samples, adv.tolist()):
                smp.advantage = a
        return samples

    def train(self, samples: list[Sample]) -> dict:
        cfg = self.cfg.trainer
        mine = split_even(samples, self.parallel.world_size)[self.rank]
        global_tokens = sum(len(s.response_ids) for s in samples)
        batches = self.actor.micro_batches(mine)
        # old-policy log-probs recomputed on the training forward (the engine's are at the
        # sampling temperature, from the KV-cache path)
        for s, lp in zip(mine, self.actor.logprobs(batches)):
            s.old_logprobs = lp
        inject(FaultPhase.TRAIN, self.rank, self.step_index + 1)
        ref = self.actor.logprobs(batches, model=self.reference) if self.reference else None
        metrics: dict = {}
        values = None
        if cfg.algorithm == Algorithm.PPO:
            values = self.critic.values(batches)
            returns = self._gae(mine, values, ref)
        for _ in range(cfg.ppo_epochs):
            metrics = self.actor.train_policy(
                batches, global_tokens=global_tokens,
                ref_logprobs=ref if cfg.algorithm == Algorithm.GRPO else None)
            if not metrics["actor/applied"]:
                self._non_finite(metrics)
            if values is not None:
                metrics.update(self.critic.train(batches, values, returns,
                                                 global_tokens=global_tokens))
        return metrics

    def _gae(self, samples: list[Sample], values, ref) -> list[list[float]]:
        """PPO: per-token rewards (the score on the last token, minus the KL to the reference
        when trainer.kl_coef > 0), GAE, advantages whitened over every rank's tokens."""
        cfg = self.cfg.trainer
        returns, flat = [], []
        for i, s in enumerate(samples):
            n = len(s.response_ids)
            mask = torch.ones(1, n, dtype=torch.float64)
            kl = None
            if ref is not None:
                kl = alg.kl_penalty(torch.tensor([s.old_logprobs], dtype=torch.float64),
                                    torch.tensor([ref[i]], dtype=torch.float64),
                                    estimator=cfg.kl_estimator)
            rew = alg.token_level_rewards(torch.tensor([s.score], dtype=torch.float64), mask,
                                          kl=kl, kl_coef=cfg.kl_coef)
            adv, ret = alg.gae(rew, torch.tensor([values[i]], dtype=torch.float64), mask,
                               gamma=cfg.gamma, lam=cfg.gae_lambda)
            s.advantages = adv[0].tolist()
            returns.append(ret[0].tolist())
            flat += s.advantages
        stats = torch.tensor([sum(flat), sum(a * a for a in flat), float(len(flat))], dtype=torch.float64)
        dist.all_reduce(stats, group=self.parallel.world_group)
        mean = stats[0] / stats[2].clamp(min=1)
        std = (stats[1] / stats[2].clamp(min=1) - mean ** 2).clamp(min=0).sqrt()
        for s in samples:
            s.advantages = [(a - float(mean)) / (float(std) + 1e-8) for a in s.advantages]
        return returns

    def warm_start(self) -> None:
        """Supervised steps on correct answers before RL (cached in the run folder's parent)."""
        with self.phase("warm start"):
            self._warm_start()

    def _warm_start(self) -> None:
        cfg = self.cfg
        cache = os.path.join(os.path.dirname(os.path.abspath(cfg.logging.run_dir)), "sft_cache",
                             _warm_start_key(cfg))
        if os.path.exists(os.path.join(cache, "latest")):
            load_checkpoint(cache, model=self.model, model_cfg=cfg.model)
            self.train_state.optimizer.reload_model_params()  # fp32 main params of a bf16 model
            self.log.say(f"warm start: loaded the cached supervised model from {cache}")
            return
        import dataclasses

        from tqdm import tqdm

        rng = random.Random(cfg.data.synthetic_seed + 17)
        steps = cfg.trainer.sft_warmup_steps
        sft_cfg = dataclasses.replace(cfg.trainer, lr=cfg.trainer.sft_lr, min_lr=0.0,
                                      lr_warmup_steps=min(10, steps // 10))
        sft = Actor(build_train_state(self.model, sft_cfg, self.parallel, total_steps=steps,
                                      ddp=self.train_state.model),
                    sft_cfg, self.parallel, valid_vocab=self.tokenizer.vocab_size)
        bar = tqdm(range(steps), desc="warm start (supervised)", disable=self.rank != 0,
                   dynamic_ncols=True, mininterval=2.0)
        per_step = cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt
        for _ in bar:
            picks = [rng.randrange(len(self.examples)) for _ in range(per_step)]
            samples = [Sample(self.prompt_ids[i],
                              self.tokenizer.encode(sft_response(self.examples[i])) + [self.tokenizer.eos_id])
                       for i in picks]
            loss = sft.train_sft(split_even(samples, self.parallel.world_size)[self.rank])
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        # RL keeps its own optimizer and schedule (untouched so far); the cache holds the weights
        self.train_state.optimizer.reload_model_params()
        save_checkpoint(cache, 0, model=self.model, model_cfg=cfg.model)
        self.log.say(f"warm start: {steps} supervised steps, cached in {cache}")

    # ------------------------------------------------------------------ bookkeeping

    def step_metrics(self, results, rewards, records, plan, train_metrics, step_s, resync_s,
                     membership) -> dict:
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
            "timing/resync_s": resync_s,
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
        resident = ResidentSet(self.model, self.train_state, self.moe, self.engine, tuple(also))
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

    def _should_save(self) -> bool:
        c = self.cfg.checkpoint
        if not c.dir:
            return False
        last = self.step_index == self.cfg.trainer.steps
        return last or (c.save_interval > 0 and self.step_index % c.save_interval == 0)

    def save(self) -> None:
        extra = {
            "step": self.step_index,
            "cursor": self.cursor.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train_state": self.train_state.state_dict(),
            "config": config_to_dict(self.cfg),
        }
        root, keep = self.cfg.checkpoint.dir, self.cfg.checkpoint.keep_last
        # the critic and the reference first: the policy's checkpoint, written last, is the one
        # whose presence marks the step complete
        for name, model, optimizer in self._companions():
            save_checkpoint(os.path.join(root, name), self.step_index, model=model,
                            model_cfg=self.cfg.model, optimizer=optimizer, keep_last=keep)
        path = save_checkpoint(root, self.step_index, model=self.model, model_cfg=self.cfg.model,
                               optimizer=self.train_state.optimizer, extra_state=extra,
                               keep_last=keep)
        self.log.say(f"checkpoint: {path}")

    def _companions(self):
        """(sub-folder, model, optimizer) saved beside the policy: the critic, the reference."""
        out = []
        if self.critic is not None:
            out.append(("critic", self.critic.module, self.critic.state.optimizer))
        if self.reference is not None:
            out.append(("reference", self.reference, None))
        return out

    def _init_from(self, path: str) -> None:
        """checkpoint.init_from: the model's weights only. The optimizer, the LR schedule, the
        data cursor and this rank's RNG stay as a new run sets them up; the critic stays fresh;
        the KL reference is frozen from these weights at the first step (after a warm start)."""
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint.init_from={path} does not exist; give a checkpoint "
                                  "root (e.g. the --out of tools/convert_checkpoint.py) or an iter_N")
        rng = rng_state()  # load_checkpoint restores the saving job's RNG: not ours to take
        try:
            load_checkpoint(path, model=self.model, model_cfg=self.cfg.model)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (checkpoint.init_from={path})") from e
        set_rng_state(rng)
        self.train_state.optimizer.reload_model_params()  # fp32 main params of a bf16 model

    def _load(self, path: str) -> None:
        try:
            if not read_meta(path)["has_optimizer"]:
                raise CheckpointError(
                    f"{resolve_checkpoint(path)} holds weights only (no optimizer state, e.g. a "
                    "converted HF checkpoint): there is no training run to resume; to start one "
                    f"from these weights, set checkpoint.init_from={path} and checkpoint.load=null")
            step, extra = load_checkpoint(path, model=self.model, model_cfg=self.cfg.model,
                                          optimizer=self.train_state.optimizer)
        except CheckpointError as e:
            if path != self.cfg.checkpoint.load:  # found by checkpoint.resume=auto
                raise CheckpointError(
                    f"{e} (found in checkpoint.dir={path} by checkpoint.resume=auto; to start "
                    "afresh, use another checkpoint.dir or set checkpoint.resume=off)") from e
            raise
        if self.cfg.trainer.kl_coef > 0:
            self.reference = build_model(self.cfg.model, self.parallel)
            self.reference.requires_grad_(False)
        root = os.path.dirname(os.path.abspath(resolve_checkpoint(path)))
        for name, model, optimizer in self._companions():
            load_checkpoint(os.path.join(root, name, iter_name(step)), model=model,
                            model_cfg=self.cfg.model, optimizer=optimizer)
        self.train_state.load_state_dict(extra["train_state"])
        self.cursor.load_state_dict(extra["cursor"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step_index = step

    def close(self) -> None:
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


def _warm_start_key(cfg: Config) -> str:
    import hashlib

    d = config_to_dict(cfg)
    key = {k: d[k] for k in ("model", "data")}
    key["sft"] = {k: d["trainer"][k] for k in ("sft_warmup_steps", "sft_lr", "prompts_per_step",
                                               "micro_batch_size")}
    key["samples"] = d["rollout"]["samples_per_prompt"]
    key["world"] = d["parallel"]["world_size"]
    if cfg.checkpoint.init_from:  # the weights it starts from, by content (the files' sha256)
        key["init_from"] = read_meta(cfg.checkpoint.init_from)["files"]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class RunLog:
    """metrics.jsonl, TensorBoard, a per-step line and the release timeline plot (rank 0)."""

    def __init__(self, cfg: Config, rank: int, resumed_step: int = 0):
        self.rank = rank
        self.run_dir = cfg.logging.run_dir
        self.cfg = cfg
        self.history: list[dict] = []
        self.timelines: list[list[dict]] = []
        self.writer = None
        if rank != 0:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self._keep_steps_up_to(resumed_step)
        with open(os.path.join(self.run_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(cfg), f, indent=1)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))

    def _keep_steps_up_to(self, step: int) -> None:
        """metrics.jsonl describes this run: lines of steps after the one it starts from (a
        crashed attempt's steps that no checkpoint holds, an earlier run's) are dropped."""
        if not os.path.exists(self.metrics_path):
            return
        keep = []
        with open(self.metrics_path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        keep.append(line)
                except (ValueError, KeyError, TypeError):
                    pass  # a line torn by the crash (or blank): the resumed run must not die on it
        tmp = self.metrics_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, self.metrics_path)

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[flexfloor] {text}", flush=True)

    def write(self, metrics: dict, records: list[dict]) -> None:
        if self.rank != 0:
            return
        self.history.append(metrics)
        self.timelines.append(records)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.writer.add_scalar(k, v, metrics["step"])
        release = " ".join(f"r{i}:{t:.2f}s" for i, t in enumerate(metrics["rollout/release_s"]))
        print(
            f"step {metrics['step']:>4} | reward {metrics['reward/mean']:.3f} "
            f"(solved {metrics['reward/solved']:.2f}) | len mean {metrics['response_length/mean']:.1f} "
            f"max {metrics['response_length/max']} | tok/occ-worker-s "
            f"{metrics['rollout/tokens_per_occupied_worker_second']:.0f} | tail "
            f"{metrics['rollout/tail_fraction']:.2f} | released {metrics['rollout/released_ranks']} "
            f"| release {release} | {metrics['timing/step_s']:.1f}s",
            flush=True,
        )

    def close(self, job: Job) -> None:
        if self.rank != 0:
            return
        if self.writer is not None:
            self.writer.close()
        if self.cfg.logging.timeline_plot and self.timelines:
            from flexfloor.rollout.timeline import plot_rank_timeline

            path = os.path.join(self.run_dir, "timeline.png")
            plot_rank_timeline({"last step": self.timelines[-1]}, path,
                               title=f"release timeline, step {self.history[-1]['step']}")
        if self.history:
            first, last = self.history[0], self.history[-1]
            self.say(f"reward {first['reward/mean']:.3f} (step {first['step']}) -> "
                     f"{last['reward/mean']:.3f} (step {last['step']})")
        self.say(f"run folder: {os.path.abspath(self.run_dir)} (metrics.jsonl, tensorboard/, "
                 "timeline.png)")
