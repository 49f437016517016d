"""PPO: a critic, GAE on per-token rewards (the score on the last token, minus the KL to the
reference when trainer.kl_coef > 0), advantages whitened over every rank's tokens, the clipped
policy and value losses."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flexfloor.config import TrainerConfig
from flexfloor.trainer import algorithms as alg
from flexfloor.trainer.actor import Actor, Sample
from flexfloor.trainer.critic import Critic


class PPO:
    def __init__(self, cfg: TrainerConfig, actor: Actor, critic: Critic, parallel):
        self.cfg = cfg
        self.actor = actor
        self.critic = critic
        self.parallel = parallel

    def companions(self) -> list[tuple[str, torch.nn.Module, object]]:
        return [("critic", self.critic.module, self.critic.state.optimizer)]

    def advantages(self, samples: list[Sample]) -> None:
        """Nothing yet: GAE needs the critic's values of this rank's share (`update`)."""

    def update(self, mine: Sequence[Sample], *, global_tokens: int, reference=None,
               on_skipped: Callable[[dict], None]) -> dict:
        batches = self.actor.micro_batches(mine)
        metrics = self.actor.set_old_logprobs(batches)
        ref = self.actor.logprobs(batches, model=reference) if reference is not None else None
        values = self.critic.values(batches)
        returns = self._gae(mine, values, ref)
        for _ in range(self.cfg.ppo_epochs):
            step = self.actor.train_policy(batches, global_tokens=global_tokens)
            if not step["actor/applied"]:
                on_skipped(step)
            step.update(self.critic.train(batches, values, returns, global_tokens=global_tokens))
        return {**metrics, **step}

    def _gae(self, samples: Sequence[Sample], values, ref) -> list[list[float]]:
        """Sets each sample's per-token advantages (GAE, whitened over every rank's tokens);
        returns the per-token returns (the critic's targets)."""
        cfg = self.cfg
        returns = []
        for i, s in enumerate(samples):
            mask = torch.ones(1, len(s.response_ids), dtype=torch.float64)  # (1, T)
            kl = None
            if ref is not None:
                kl = alg.kl_penalty(torch.tensor([s.old_logprobs], dtype=torch.float64),
                                    torch.tensor([ref[i]], dtype=torch.float64),
                                    estimator=cfg.kl_estimator)  # (1, T)
            rew = alg.token_level_rewards(torch.tensor([s.score], dtype=torch.float64), mask,
                                          kl=kl, kl_coef=cfg.kl_coef)  # (1, T)
            adv, ret = alg.gae(rew, torch.tensor([values[i]], dtype=torch.float64), mask,
                               gamma=cfg.gamma, lam=cfg.gae_lambda)  # (1, T) each
            s.advantages = adv[0].tolist()
            returns.append(ret[0].tolist())
        mean, std = self._token_stats([a for s in samples for a in s.advantages])
        for s in samples:
            s.advantages = [(a - mean) / (std + 1e-8) for a in s.advantages]
        return returns

    def _token_stats(self, flat: list[float]) -> tuple[float, float]:
        """Mean and (population) std of a per-token quantity over every rank's tokens."""
        stats = torch.tensor([sum(flat), sum(a * a for a in flat), float(len(flat))],
                             dtype=torch.float64, device=self.parallel.device)
        dist.all_reduce(stats, group=self.parallel.world_group)
        mean = stats[0] / stats[2].clamp(min=1)
        std = (stats[1] / stats[2].clamp(min=1) - mean ** 2).clamp(min=0).sqrt()
        return float(mean), float(std)
