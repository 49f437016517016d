"""Requests, results and per-rank rollout records: the engine's vocabulary as data."""

from __future__ import annotations

import enum
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Optional, Sequence

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
class GroupSpan:
    """The EP group a rank stepped in from `from_step` on: its ranks and the expert -> rank map."""

    from_step: int
    ranks: tuple[int, ...]  # sorted global ranks
    owner: tuple[int, ...]  # owner[e] = rank running expert e


@dataclass
class ShrinkTrace:
    """One shrink this rank took part in, at the boundary after `step` steps (0: before the
    first), in the group it had then."""

    step: int
    ranks: tuple[int, ...]  # the group before the shrink
    sent_bytes: int  # expert weights this rank sent
    received_bytes: int  # expert weights it received (borrowed)
    groups_created: int  # process groups the shrink created on this rank (0: one built ahead)


@dataclass
class MoveTrace:
    """A running request that changed rank at the boundary after `step` steps of the rank that
    records it (the giver, and the taker when it adopts): tail consolidation or migration.
    `kind` (a `flexfloor.rollout.consolidate.MoveKind` value) says how its K/V got there:
    "kv_transfer", `kv_tokens` tokens of K/V (`kv_bytes` bytes) sent to the taker at that
    boundary, which decodes on at its next step (priced as those bytes over the link the two
    ranks share); "reprefill", the taker recomputes `tokens` (prompt + produced), priced as that
    step's prefill tokens."""

    step: int
    request_id: str
    src: int  # giving rank (-1: unknown to the taker)
    dst: int  # taking rank (-1: unknown to the giver)
    tokens: int
    across: bool = False  # between replicas
    kind: str = "reprefill"
    kv_tokens: int = 0  # tokens of K/V sent (0: re-prefilled)
    kv_bytes: int = 0  # bytes of K/V sent, the traced model's


@dataclass(frozen=True)
class TracedLoad:
    """One rank's traced step (a `StepTrace` entry), what a cost model prices
    (`flexfloor.sim.cost.traced_step_seconds`): small enough to share at every boundary."""

    rank: int
    new_tokens: int  # decode + prefill
    kv_tokens: int
    attention_pairs: int
    experts_touched: int  # summed over the MoE layers


@dataclass
class StepTrace:
    """What every engine step of one rank did, one entry per step from the host counts the
    engine holds at the step (no device read): the input a cost model prices
    (`flexfloor.sim.cost.price_trace`).

    Per step: decode tokens (one per decoding request), prefill tokens (prompts, re-prefills
    after preemption or adoption), KV tokens read (every running request's context after the
    step's tokens), with a block size the blocks those contexts fill (each request's in whole
    blocks of `block_tokens`: the fewest a paged pool can hold them in), attention pairs (new
    token, context token), hosted experts that received rows (summed over the MoE layers). The
    group and placement only where they change, shrinks where they happen. `num_experts` and
    `expert_bytes` are the traced model's.
    """

    num_experts: int = 0
    num_layers: int = 0
    expert_bytes: int = 0  # one expert over all layers
    block_tokens: int = 0  # the KV pool's block size (0: `kv_blocks` not traced)
    decode_tokens: list[int] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    kv_blocks: list[int] = field(default_factory=list)
    attention_pairs: list[int] = field(default_factory=list)
    experts_touched: list[int] = field(default_factory=list)
    groups: list[GroupSpan] = field(default_factory=list)
    shrinks: list[ShrinkTrace] = field(default_factory=list)
    moves: list[MoveTrace] = field(default_factory=list)  # requests moved out and in

    @property
    def steps(self) -> int:
        return len(self.decode_tokens)

    def enter_group(self, ranks: Sequence[int], owner: Sequence[int]) -> None:
        """Note the group the next step runs in (nothing when it is the current one)."""
        ranks, owner = tuple(ranks), tuple(owner)
        if not self.groups or (self.groups[-1].ranks, self.groups[-1].owner) != (ranks, owner):
            if self.groups and self.groups[-1].from_step == self.steps:
                self.groups.pop()  # replaced before any step ran in it
            self.groups.append(GroupSpan(self.steps, ranks, owner))

    def add_step(self, contexts: Sequence[tuple[int, int]], experts_touched: int) -> None:
        """contexts: (tokens already stored, new tokens) of every running request this step."""
        from flexfloor.rollout.kv import blocks_for  # kv imports this module

        decode = prefill = kv = pairs = blocks = 0
        bt = self.block_tokens
        for stored, new in contexts:
            if stored:
                decode += new
            else:
                prefill += new
            kv += stored + new
            pairs += new * stored + new * (new + 1) // 2
            if bt:
                blocks += blocks_for(stored + new, bt)
        self.decode_tokens.append(decode)
        self.prefill_tokens.append(prefill)
        self.kv_tokens.append(kv)
        if bt:
            self.kv_blocks.append(blocks)
        self.attention_pairs.append(pairs)
        self.experts_touched.append(experts_touched)

    def load(self, rank: int, step: int) -> TracedLoad:
        """Step `step` (0-based) of this trace, traced by `rank`."""
        return TracedLoad(rank, self.decode_tokens[step] + self.prefill_tokens[step],
                          self.kv_tokens[step], self.attention_pairs[step],
                          self.experts_touched[step])

    def group_at(self, step: int) -> GroupSpan:
        """The group step `step` (0-based) ran in, or the boundary after `step` steps saw."""
        for g in reversed(self.groups):
            if g.from_step <= step:
                return g
        raise ValueError(f"trace has no group for step {step}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTrace":
        d = dict(d)
        d["groups"] = [GroupSpan(g["from_step"], tuple(g["ranks"]), tuple(g["owner"]))
                       for g in d.get("groups", ())]
        d["shrinks"] = [ShrinkTrace(**{**x, "ranks": tuple(x["ranks"])})
                        for x in d.get("shrinks", ())]
        d["moves"] = [MoveTrace(**x) for x in d.get("moves", ())]
        return cls(**d)


# fields of a record left out of its JSON while unknown (None): a rank never released has no
# offload figures, the simulator no resident bytes
_OPTIONAL = ("release_step", "local_finish_step", "resync_s", "resident_bytes_before_release",
             "resident_bytes_after_release", "resident_bytes_after_resync", "offloaded_bytes",
             "rss_bytes_before_release", "rss_bytes_after_release", "offload_s", "restore_s")


@dataclass
class RankRecord:
    """What one rank did in one rollout; times in seconds from the rollout start.

    `as_dict()` is the JSON the tools gather and write (a contract: the names stay); fields in
    `_OPTIONAL` appear there once known. `note(**figures)` sets fields by name (what a membership,
    an offload listener or a tool reports) and refuses a name the record does not have.
    """

    rank: int
    start_s: float = 0.0  # its rollout began, on its decoding clock (< 0: transfers came first)
    local_finish_s: float = 0.0  # its last own response ended (0 when it had none)
    release_s: float = 0.0  # it left the rollout (static EP: the rollout end)
    steps: int = 0  # engine forward steps it took part in (its occupied worker-steps)
    busy_steps: int = 0  # steps with at least one own token
    tokens: int = 0  # response tokens it produced
    requests: int = 0
    kv_peak_bytes: int = 0
    release_step: Optional[int] = None  # steps done when it left (or at the end)
    local_finish_step: Optional[int] = None  # steps done when its last own response ended
    preempted: int = 0  # requests preempted for KV blocks (re-queued, re-prefilled)
    floor_hits: int = 0  # boundaries where the memory floor kept it stepping
    migrated_out: int = 0  # running requests handed to another rank
    adopted: int = 0  # requests taken over from another rank
    migrated_across: int = 0  # of migrated_out: handed to another replica (tail consolidation)
    adopted_across: int = 0  # of adopted: taken over from another replica
    plan_s: float = 0.0  # release decisions
    transfer_s: float = 0.0  # expert transfers at shrinks
    switch_s: float = 0.0  # switches to the survivors' groups
    sent_bytes: int = 0  # expert weights sent at shrinks
    start_sent_bytes: int = 0  # expert weights sent before the first step (replica layouts)
    groups_created_during_rollout: int = 0  # process groups built after decoding started
    switch_s_per_shrink: list[float] = field(default_factory=list)
    resync_s: Optional[float] = None  # seconds of the resync after the rollout
    # memory of the rank (bytes on its device) around its release, and the offload's figures
    resident_bytes_before_release: Optional[int] = None
    resident_bytes_after_release: Optional[int] = None
    resident_bytes_after_resync: Optional[int] = None
    offloaded_bytes: Optional[int] = None
    rss_bytes_before_release: Optional[int] = None
    rss_bytes_after_release: Optional[int] = None
    offload_s: Optional[float] = None
    restore_s: Optional[float] = None
    trace: StepTrace = field(default_factory=StepTrace)

    def note(self, **figures) -> None:
        names = {f.name for f in fields(self)} - {"rank", "trace"}
        unknown = sorted(set(figures) - names)
        if unknown:
            raise TypeError(f"RankRecord has no field {unknown}; add it to "
                            "flexfloor/rollout/types.py (RankRecord) to record it")
        for name, value in figures.items():
            setattr(self, name, value)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        for name in _OPTIONAL:
            if d[name] is None:
                del d[name]
        d["switch_s_per_shrink"] = list(self.switch_s_per_shrink)
        d["trace"] = self.trace.as_dict()
        return d
