"""The PPO critic: a separate Megatron-Core GPT trunk (same shape as the policy, its own weights)
with a value head, trained with the clipped value loss on GAE returns."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from flexfloor.model import build_model, causal_positions
from flexfloor.trainer import algorithms as alg
from flexfloor.trainer.actor import Sample, pad_batch, place_per_token
from flexfloor.trainer.optim import build_train_state


class ValueModel(torch.nn.Module):
    """GPT trunk (no output layer) -> RMSNorm -> Linear(H, 1): one value per position."""

    def __init__(self, trunk, hidden_size: int, eps: float):
        super().__init__()
        self.trunk = trunk
        self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.head = torch.nn.Linear(hidden_size, 1, bias=True)
        with torch.no_grad():  # start from V = 0: no bias in the first advantages
            self.head.weight.zero_()
            self.head.bias.zero_()
        self.to(next(trunk.parameters()).dtype)

    @property
    def config(self):
        return self.trunk.config

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron dist-checkpointing view: the trunk's own, plus the (replicated) head."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.trunk.sharded_state_dict(prefix=f"{prefix}trunk.", metadata=metadata)
        for name in ("norm", "head"):
            sub = getattr(self, name).state_dict(keep_vars=True)
            sd.update(make_sharded_tensors_for_checkpoint(sub, prefix=f"{prefix}{name}."))
        return sd

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(tokens, causal_positions(tokens), attention_mask=None)  # (S, B, H)
        return self.head(self.norm(hidden)).squeeze(-1).transpose(0, 1)  # (B, S)


class Critic:
    def __init__(self, model_cfg, trainer_cfg, parallel, *, total_steps: int):
        trunk = build_model(dataclasses.replace(model_cfg, seed=model_cfg.seed + 1), parallel,
                            post_process=False)
        self.module = ValueModel(trunk, model_cfg.hidden_size, model_cfg.norm_epsilon).to(parallel.device)
        cfg = dataclasses.replace(trainer_cfg, lr=trainer_cfg.critic_lr, min_lr=0.0)
        self.state = build_train_state(self.module, cfg, parallel, total_steps=total_steps)
        self.cfg = trainer_cfg
        self.parallel = parallel
        self.device = parallel.device

    def _values(self, model, samples: Sequence[Sample]) -> tuple[torch.Tensor, dict]:
        b = pad_batch(samples, device=self.device)
        return model(b["tokens"])[:, :-1].float(), b  # value of the state before each target

    @torch.no_grad()
    def values(self, batches: list[list[Sample]]) -> list[list[float]]:
        """Per-token values of each response, micro-batch by micro-batch (the same count on every
        rank: the MoE layers exchange tokens)."""
        self.module.eval()
        out = []
        for mb in batches:
            if not mb:
                self._empty(self.module)
                continue
            v, _ = self._values(self.module, mb)
            for i, s in enumerate(mb):
                start = len(s.prompt_ids) - 1
                out.append(v[i, start : start + len(s.response_ids)].tolist())
        return out

    def _empty(self, model):
        return model(torch.zeros(1, 2, dtype=torch.long, device=self.device)).sum() * 0.0

    def train(self, batches: list[list[Sample]], old_values: list[list[float]],
              returns: list[list[float]], *, global_tokens: int) -> dict:
        """One optimizer step of the clipped value loss (token mean over every rank's tokens)."""
        model = self.state.model
        model.module.train()
        self.state.zero_grad()
        dp = self.parallel.world_size
        total, i = 0.0, 0
        for mb in batches:
            if not mb:
                self._empty(model).backward()
                continue
            v, b = self._values(model, mb)
            old = place_per_token(mb, old_values[i : i + len(mb)], v)
            ret = place_per_token(mb, returns[i : i + len(mb)], v)
            i += len(mb)
            loss = alg.value_loss(v, old, ret, b["mask"], clip_eps=self.cfg.value_clip_eps,
                                  agg=alg.LossAgg.TOKEN_MEAN)
            share = float(b["mask"].sum()) / global_tokens
            (loss * share * dp).backward()
            total += float(loss) * share
        t = torch.tensor([total], device=self.device)
        dist.all_reduce(t, group=self.parallel.world_group)
        applied, grad_norm = self.state.step()
        return {"critic/loss": float(t), "critic/grad_norm": grad_norm}
