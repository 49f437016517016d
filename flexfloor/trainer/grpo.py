"""GRPO: group-relative advantages (no critic), the clipped policy loss, an optional KL to the
reference policy in the loss."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from flexfloor.config import TrainerConfig
from flexfloor.trainer import algorithms as alg
from flexfloor.trainer.actor import Actor, Sample


class GRPO:
    """The estimator object the step loop calls: `advantages` on every rank's samples, then
    `update` on this rank's share; `companions` are the models saved beside the policy."""

    def __init__(self, cfg: TrainerConfig, actor: Actor):
        self.cfg = cfg
        self.actor = actor

    def companions(self) -> list[tuple[str, torch.nn.Module, object]]:
        return []

    def advantages(self, samples: list[Sample]) -> None:
        """Each response's reward minus its group's mean (over the group's std with
        trainer.adv_std_norm); `samples` are every rank's, groups keyed by `group`."""
        adv = alg.grpo_advantages(torch.tensor([s.score for s in samples], dtype=torch.float64),
                                  torch.tensor([s.group for s in samples]),
                                  std_norm=self.cfg.adv_std_norm)  # (B,)
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a

    def update(self, mine: Sequence[Sample], *, global_tokens: int, reference=None,
               on_skipped: Callable[[dict], None]) -> dict:
        """trainer.ppo_epochs optimizer steps of the policy on this rank's share."""
        batches = self.actor.micro_batches(mine)
        metrics = self.actor.set_old_logprobs(batches)
        ref = self.actor.logprobs(batches, model=reference) if reference is not None else None
        for _ in range(self.cfg.ppo_epochs):
            step = self.actor.train_policy(batches, global_tokens=global_tokens, ref_logprobs=ref)
            if not step["actor/applied"]:
                on_skipped(step)
        return {**metrics, **step}
