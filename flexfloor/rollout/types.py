"""Requests, results and per-rank rollout records: the engine's vocabulary as data."""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch


class RolloutError(RuntimeError):
    """A request or rollout the engine refuses or cannot finish; the message names it."""


class FinishReason(enum.Enum):
    EOS = "eos"  # the end-of-sequence token was sampled (it is kept in token_ids)
    STOP = "stop"  # one of the stop token ids was sampled (kept in token_ids)
    LENGTH = "length"  # max_new_tokens reached
    TARGET = "target"  # the request's target length reached (controlled workloads)


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    stop_token_ids: tuple[int, ...] = ()
    eos_id: Optional[int] = None

    @classmethod
    def from_rollout_config(cls, rollout_cfg, *, eos_id: Optional[int]) -> "SamplingParams":
        return cls(
            greedy=rollout_cfg.greedy,
            temperature=rollout_cfg.temperature,
            top_k=rollout_cfg.top_k,
            top_p=rollout_cfg.top_p,
            stop_token_ids=tuple(rollout_cfg.stop_token_ids),
            eos_id=eos_id,
        )


@dataclass(frozen=True)
class Request:
    """One response to generate: sample `sample_index` of prompt `prompt_uid`.

    `seed` and `step` with (prompt_uid, sample_index) key the request's own RNG stream, so its
    tokens do not depend on the rank, batch or step position it runs in. `target_len`, when set,
    makes the request ignore EOS/stop tokens and end after exactly that many tokens (controlled
    workloads for measuring system behaviour with a random model).
    """

    prompt_uid: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    step: int = 0
    target_len: Optional[int] = None

    @property
    def request_id(self) -> str:
        return f"{self.prompt_uid}/{self.sample_index}"

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens this request can generate: its KV-cache reservation."""
        new = self.max_new_tokens if self.target_len is None else self.target_len
        return len(self.prompt_ids) + new

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        key = f"{self.seed}:{self.step}:{self.prompt_uid}:{self.sample_index}".encode()
        return torch.Generator(device=device).manual_seed(zlib.crc32(key) * 2654435761 % (1 << 63))


@dataclass
class Result:
    request_id: str
    prompt_uid: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the sampling temperature
    finish_reason: FinishReason
    rank: int  # the rank that produced the last token
    admitted_s: float
    finished_s: float


@dataclass
class RankRecord:
    """What one rank did in one rollout; times in seconds from the rollout start."""

    rank: int
    start_s: float = 0.0
    local_finish_s: float = 0.0  # its last own response ended (0 when it had none)
    release_s: float = 0.0  # it left the rollout (static EP: the rollout end)
    steps: int = 0  # engine forward steps it took part in (its occupied worker-steps)
    busy_steps: int = 0  # steps with at least one own token
    tokens: int = 0  # response tokens it produced
    requests: int = 0
    kv_peak_bytes: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "rank", "start_s", "local_finish_s", "release_s", "steps", "busy_steps", "tokens",
            "requests", "kv_peak_bytes")}
        d.update(self.extra)
        return d
