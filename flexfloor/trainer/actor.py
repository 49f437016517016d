"""The actor: forward/backward through Megatron-Core on the very weights the engine generates with.

Training layout: every rank is a data-parallel rank; experts are sharded over the training EP
group (Megatron's MoE layer and its all-to-all); Megatron DDP reduces gradients; Megatron's
optimizer steps. Sequences are right-padded (positions 0..S-1 per sequence, so padding never
shifts a real token), in micro-batches with gradient accumulation. Every rank runs the same
number of micro-batches (the MoE all-to-all needs all of them each time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexfloor.config import RolloutIS
from flexfloor.model import causal_positions
from flexfloor.trainer import algorithms as alg
from flexfloor.trainer.optim import TrainState


@dataclass
class Sample:
    """One response to train on: prompt + response tokens and what the loss needs per token."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float = 0.0  # GRPO: one per response
    group: int = 0  # the prompt it answers (GRPO's group)
    old_logprobs: Sequence[float] | None = None  # recomputed on the training forward
    score: float = 0.0  # the reward of the whole response
    advantages: Sequence[float] | None = None  # PPO: one per response token (GAE)
    rollout_logprobs: Sequence[float] | None = None  # the engine's, one per response token


def pad_batch(samples: Sequence[Sample], *, device) -> dict[str, torch.Tensor]:
    """tokens (B, S), response mask over the *target* positions (B, S-1), index of the first
    target position of each response."""
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    s_max = max(len(x) for x in seqs)
    tokens = torch.zeros(len(seqs), s_max, dtype=torch.long)
    mask = torch.zeros(len(seqs), s_max - 1)
    for i, (seq, smp) in enumerate(zip(seqs, samples)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        start = len(smp.prompt_ids) - 1  # logits at t predict token t + 1
        mask[i, start : start + len(smp.response_ids)] = 1.0
    return {"tokens": tokens.to(device), "mask": mask.to(device)}


def place_per_token(mb: Sequence[Sample], values, like: torch.Tensor) -> torch.Tensor:
    """Per-response-token values at the target positions of a padded batch (B, S-1)."""
    out = torch.zeros_like(like)
    for i, (s, v) in enumerate(zip(mb, values)):
        start = len(s.prompt_ids) - 1
        out[i, start : start + len(s.response_ids)] = torch.tensor(list(v), dtype=like.dtype)
    return out


def logprob_temperature(sampling) -> float:
    """The temperature of the distribution the engine's log-probs are under (SamplingParams):
    the sampling temperature, 1 for greedy decoding (the engine reports those at 1)."""
    if sampling.greedy or sampling.temperature == 0.0:
        return 1.0
    return sampling.temperature


def split_even(items: list, parts: int) -> list[list]:
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(items[start : start + n])
        start += n
    return out


class Actor:
    """Policy updates on a `TrainState` (DDP-wrapped GPTModel + optimizer + LR schedule)."""

    def __init__(self, state: TrainState, trainer_cfg, parallel, *, valid_vocab: int | None = None,
                 temperature: float = 1.0):
        self.state = state
        self.valid_vocab = valid_vocab  # the engine samples only below it; so does the loss
        # log-probs, entropy and the loss are under softmax(logits / temperature): the policy the
        # engine samples from (logprob_temperature); 1 for the supervised warm start
        self.temperature = temperature
        self.cfg = trainer_cfg
        self.parallel = parallel
        self.device = parallel.device

    @property
    def module(self):
        return self.state.model.module

    def micro_batches(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        """The same number of micro-batches on every rank (collectives in the MoE layers)."""
        n = max(1, math.ceil(len(samples) / self.cfg.micro_batch_size))
        counts = torch.tensor([n], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.parallel.world_group)
        return split_even(list(samples), int(counts))

    def _logits(self, model, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens, causal_positions(tokens), attention_mask=None)  # (B, S, V)
        logits = logits[:, :-1, : self.valid_vocab]  # (B, S-1, V)
        return logits if self.temperature == 1.0 else logits / self.temperature

    @torch.no_grad()
    def logprobs(self, batches: list[list[Sample]], model=None) -> list[list[float]]:
        """Per-token log-probs of each response under the current weights (old-policy recompute),
        or under `model` (the frozen reference)."""
        model = model or self.module
        model.eval()
        out: list[list[float]] = []
        for mb in batches:
            if not mb:
                self._empty_forward(model)
                continue
            b = pad_batch(mb, device=self.device)
            lp = alg.token_logprobs(self._logits(model, b["tokens"]).float(), b["tokens"][:, 1:])
            for i, s in enumerate(mb):
                start = len(s.prompt_ids) - 1
                out.append(lp[i, start : start + len(s.response_ids)].tolist())
        return out

    def set_old_logprobs(self, batches: list[list[Sample]]) -> dict:
        """Each sample's old-policy log-probs, recomputed on the training forward at the
        sampling temperature like the engine's (which come from the KV-cache path); returns
        their gap to the engine's, a diagnostic (`logprob_diff`)."""
        for s, lp in zip([s for mb in batches for s in mb], self.logprobs(batches)):
            s.old_logprobs = lp
        return self.logprob_diff([s for mb in batches for s in mb])

    def logprob_diff(self, samples: Sequence[Sample]) -> dict:
        """|old log-prob - engine log-prob| over every rank's response tokens (this rank's share
        in `samples`): rollout/logprob_diff_mean and rollout/logprob_diff_max."""
        total, count, peak = 0.0, 0.0, 0.0
        for s in samples:
            d_sum, d_max, n = alg.logprob_diff(
                torch.tensor([list(s.old_logprobs)]), torch.tensor([list(s.rollout_logprobs)]),
                torch.ones(1, len(s.response_ids)))
            total, count, peak = total + float(d_sum), count + float(n), max(peak, float(d_max))
        sums = torch.tensor([total, count], dtype=torch.float64, device=self.device)
        peak = torch.tensor([peak], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.parallel.world_group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.parallel.world_group)
        return {"rollout/logprob_diff_mean": float(sums[0] / sums[1].clamp(min=1)),
                "rollout/logprob_diff_max": float(peak[0])}

    def _empty_forward(self, model=None):
        """A rank with no samples in this micro-batch still enters the MoE all-to-alls."""
        model = model or self.module
        tokens = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        return self._logits(model, tokens).sum() * 0.0

    def train_policy(self, batches: list[list[Sample]], *, global_tokens: int,
                     ref_logprobs: Sequence[Sequence[float]] | None = None) -> dict:
        """One optimizer step of the clipped policy loss over `samples` (this rank's share).

        `global_tokens` = response tokens over all ranks. Each micro-batch's loss is rescaled by
        its share of the global batch, so token-mean (or sequence-mean) aggregation is exact
        across micro-batches and ranks (Megatron DDP averages gradients over data-parallel ranks).
        With `ref_logprobs` (per sample, per token) the KL to the reference policy is added.
        """
        cfg = self.cfg
        model = self.state.model
        model.module.train()
        self.state.zero_grad()
        dp = self.parallel.world_size
        global_seqs = torch.tensor([float(sum(len(mb) for mb in batches))], device=self.device)
        dist.all_reduce(global_seqs, group=self.parallel.world_group)
        token_mean = alg.LossAgg(cfg.loss_agg) == alg.LossAgg.TOKEN_MEAN
        total_loss, stats_acc, n_mb, offset = 0.0, {}, 0, 0
        for mb in batches:
            if not mb:
                self._empty_forward(model).backward()
                continue
            b = pad_batch(mb, device=self.device)
            mask = b["mask"]  # (B, S-1)
            logits = self._logits(model, b["tokens"]).float()  # (B, S-1, V)
            logp = alg.token_logprobs(logits, b["tokens"][:, 1:])  # (B, S-1)
            old = place_per_token(mb, [s.old_logprobs for s in mb], logp)
            adv = place_per_token(mb, [s.advantages if s.advantages is not None
                                       else [s.advantage] * len(s.response_ids) for s in mb], logp)
            is_weight = None
            if cfg.rollout_is == RolloutIS.TRUNCATED:
                rollout = place_per_token(mb, [s.rollout_logprobs for s in mb], logp)
                is_weight = alg.truncated_is_weight(old, rollout, cap=cfg.rollout_is_cap)
            loss, stats = alg.policy_loss(logp, old, adv, mask, clip_eps=cfg.clip_eps,
                                          clip_ratio_c=cfg.clip_ratio_c, is_weight=is_weight,
                                          agg=cfg.loss_agg)
            if is_weight is not None:
                stats["is_weight_mean"] = alg.aggregate(is_weight, mask, alg.LossAgg.TOKEN_MEAN)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * alg.aggregate(
                    alg.entropy_from_logits(logits), mask, cfg.loss_agg)
            if ref_logprobs is not None:
                ref = place_per_token(mb, ref_logprobs[offset : offset + len(mb)], logp)
                kl = alg.aggregate(alg.kl_penalty(logp, ref, estimator=cfg.kl_estimator), mask,
                                   cfg.loss_agg)
                loss = loss + cfg.kl_coef * kl
                stats["kl_ref"] = kl.detach()
            share = float(mask.sum()) / global_tokens if token_mean else len(mb) / float(global_seqs)
            (loss * share * dp).backward()
            total_loss += float(loss) * share
            for k, v in stats.items():
                stats_acc[k] = stats_acc.get(k, 0.0) + float(v)
            n_mb += 1
            offset += len(mb)
        loss_t = torch.tensor([total_loss], device=self.device)
        dist.all_reduce(loss_t, group=self.parallel.world_group)
        if not math.isfinite(float(loss_t)):
            self.state.zero_grad()
            return {"actor/loss": float(loss_t), "actor/applied": False}
        applied, grad_norm = self.state.step()
        out = {"actor/loss": float(loss_t), "actor/grad_norm": grad_norm, "actor/applied": applied,
               "actor/lr": self.state.optimizer.param_groups[0]["lr"]}
        out.update({f"actor/{k}": v / max(1, n_mb) for k, v in stats_acc.items()})
        return out

    def train_sft(self, samples: Sequence[Sample]) -> float:
        """One supervised step (cross-entropy on response tokens): the warm start."""
        model = self.state.model
        model.module.train()
        self.state.zero_grad()
        tokens = torch.tensor([float(sum(len(s.response_ids) for s in samples))],
                              device=self.device)
        dist.all_reduce(tokens, group=self.parallel.world_group)
        dp = self.parallel.world_size
        total = 0.0
        for mb in self.micro_batches(samples):
            if not mb:
                self._empty_forward(model).backward()
                continue
            b = pad_batch(mb, device=self.device)
            logits = self._logits(model, b["tokens"]).float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["tokens"][:, 1:].reshape(-1),
                                 reduction="none").view_as(b["mask"])
            loss = (ce * b["mask"]).sum() / float(tokens) * dp
            loss.backward()
            total += float(loss) / dp
        loss_t = torch.tensor([total], device=self.device)
        dist.all_reduce(loss_t, group=self.parallel.world_group)
        self.state.step()
        return float(loss_t)
