"""In-process generation on the training weights: data-parallel attention, expert-parallel MoE.

Each rank decodes its own requests; every MoE layer exchanges tokens with the expert owners over
the EP group, so all ranks of the group step in lockstep. The engine runs Megatron-Core's own
modules of the `GPTModel` (embedding, layer norms, QKV/projection linears, rotary embedding, the
MoE layer's router and expert weights, the output layer) with its own KV cache: Megatron's static
inference context holds one sequence offset for the whole batch and cannot batch requests at
different positions (continuous batching).

A step is a handful of batched operations: one forward over every new token of this rank
(prefill chunks and decode tokens together) with, per layer, one attention call for all running
requests reading K/V from the rank's block pool (`flexfloor.rollout.kv`): as one view of the
pool's lanes when every request sits in its lane, else gathered through the block tables (SDPA
with grouped-query attention: no copy of the cache per head), and the MoE layer as
route -> dispatch -> compute -> combine (`megatron_ext.elastic_moe`); then one batched sampling
call (`flexfloor.rollout.sampling`) and one device-to-host copy of the new tokens. In float32 on
CPU (rollout.cpu_kernels, the default) every expert GEMM (prefill's too: an expert's rows are the
same bits on every path) and a decode-only step's attention run FlexFloor's C kernels
(`megatron_ext.cpu_kernels`: each expert weight streams once with the next one prefetched, each
request reads only its own positions); the attention of prefill and mixed steps, the dense
GEMMs, other dtypes and CUDA take SDPA and torch's GEMMs.

Per-request determinism: positions are per request (padding only masks, never shifts a
position), and each draw comes from a counter-based stream keyed by the request and the position,
so tokens do not depend on the rank, batch, placement, preemption or migration. torch's CPU
kernels (the dense GEMMs, SDPA) may still sum in another order for another batch shape (the last
bit of a logit); tests that compare batch compositions run in float64.

Capture-ready decode (`static_decode`, rollout.static_decode; docs/engine.md): a decode-only step
(on every rank of the EP group) is padded to a bucket: rows to a power of two up to
`max_batch_size`, the span to a power of two of blocks, the lanes read to a power of two;
padding rows write their K/V to the pool's scratch block, see position 0 only, reach no expert
and their logits are dropped; the MoE layers take the fixed-capacity dispatch. Such a step's
layer stack (`_layer_stack`, after the host-built index tensors) then has shapes that follow
from its bucket alone and reads nothing on the host where the experts run grouped: what a CUDA
graph would replay (`flexfloor.rollout.capture` audits it). Prefill and mixed steps stay eager.
The capture itself is not done.

A step:   admit (slots + free KV blocks over a watermark) -> take the blocks this step's tokens
          need (preempting the youngest request when the pool runs out) -> forward -> sample ->
          finish (blocks freed) -> step boundary
The step boundary is where the membership decides who goes on: `StaticMembership` (the verl-like
baseline) keeps every rank stepping, with empty batches when it has no work, until all are done.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from flexfloor.model import FullWidthRMSNorm
from flexfloor.rollout.collectives import (  # noqa: F401  (re-exported: the engine's errors)
    CollectiveError,
    collective_phase,
    exchange_bytes,
    gather_objects,
    group_device,
    share_rows,
)
from flexfloor.rollout.consolidate import MoveKind, MovePrices
from flexfloor.rollout.kv import BlockPool, blocks_for, watermark_blocks
from flexfloor.rollout.release import ReleaseDecision
from flexfloor.rollout.sampling import sample
from flexfloor.rollout.survivors import live_process_groups
from flexfloor.rollout.types import (
    FinishReason, MoveTrace, RankRecord, Request, Result, RolloutError, ShrinkTrace, StepTrace,
    TracedLoad,
)
from megatron_ext import cpu_kernels

__all__ = ["RolloutEngine", "RolloutError", "CollectiveError", "collective_phase",
           "StaticMembership", "StepReport", "kv_bytes_per_token"]

DEFAULT_BLOCK_TOKENS = 16  # rollout.kv_block_tokens
PAD_TOKEN = 0  # the token of a padded decode step's padding rows (`static_decode`)


def _power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()


def decode_bucket(requests: int, max_batch_size: int) -> int:
    """The rows a padded decode step of `requests` runs with (`static_decode`): the smallest
    power of two that holds them, at most `max_batch_size` (rollout.max_batch_size): the batch
    sizes a CUDA graph would be captured for, as vLLM's are."""
    return min(_power_of_two(requests), max(max_batch_size, requests))


def kv_bytes_per_token(model_config) -> int:
    """Bytes of K and V one token holds over all layers (Megatron TransformerConfig)."""
    head_dim = model_config.kv_channels or model_config.hidden_size // model_config.num_attention_heads
    groups = model_config.num_query_groups or model_config.num_attention_heads
    elem = torch.empty((), dtype=model_config.params_dtype).element_size()
    return 2 * model_config.num_layers * groups * head_dim * elem


def _is_plain_linear(module) -> bool:
    """Megatron's own Column/RowParallelLinear (not a transformer-engine one, which may fuse a
    norm into the projection)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return type(module) in (ColumnParallelLinear, RowParallelLinear)


def _linear(module, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A Megatron linear at TP=1 as one raw GEMM on its own weight (no autograd-function
    wrappers); other linears (transformer-engine) through their own forward. `residual`: added
    to the output. A plain linear without a bias takes `_linear_call`'s faster path instead."""
    if not _is_plain_linear(module):
        y, bias = module(x)
        y = y if bias is None else y + bias
    else:
        y = F.linear(x, module.weight)
        y = y if module.bias is None else y + module.bias
    return y if residual is None else residual + y


@functools.lru_cache(maxsize=None)
def _norm_scalars(width: int, eps: Optional[float], dtype: torch.dtype):
    """The width and eps of `rms_norm` as 0-dim CPU tensors of `dtype` (eps None: the dtype's
    machine epsilon, as `F.rms_norm`), made once: a Python scalar operand costs a cast per op."""
    eps = torch.finfo(dtype).eps if eps is None else eps
    with torch.inference_mode(False):
        return torch.tensor(width, dtype=dtype), torch.tensor(eps, dtype=dtype)


def rms_norm(x: torch.Tensor, width: int, weight: Optional[torch.Tensor],
             eps: Optional[float]) -> torch.Tensor:
    """`F.rms_norm(x, (width,), weight, eps)` over x's last dim (of `width`). On CPU in float32
    and float64 as the ops its CPU path runs, bit for bit (x * x summed, divided by the width,
    plus eps, rsqrt; x times that, times the weight) with the width and eps as cached 0-dim
    tensors: 7 ops instead of ~16 (an upcast, casts of Python scalars, result-type checks), and
    it runs ~17 times a decode step. Elsewhere (CUDA's fused kernel, half types) `F.rms_norm`."""
    if (not x.is_cpu or x.dtype not in (torch.float32, torch.float64)
            or (weight is not None and weight.dtype != x.dtype)):
        return F.rms_norm(x, (width,), weight, eps)
    n, e = _norm_scalars(width, eps, x.dtype)
    y = x * (x * x).sum(-1, keepdim=True).div_(n).add_(e).rsqrt_()
    return y if weight is None else y.mul_(weight)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """A torch `RMSNorm` module's own `F.rms_norm` (as `rms_norm`) without the module call
    around it (a `FullWidthRMSNorm` over its input's last two dims, as its forward does); any
    other norm through its forward."""
    if type(module) is torch.nn.RMSNorm and len(module.normalized_shape) == 1:
        return rms_norm(x, module.normalized_shape[0], module.weight, module.eps)
    if type(module) is FullWidthRMSNorm:
        return rms_norm(x.flatten(-2), module.normalized_shape[0], module.weight,
                        module.eps).view_as(x)
    return module(x)


def _qk_norm(module):
    """A q/k norm module, or None where there is none: Megatron builds an `IdentityOp` when
    `qk_layernorm` is off (a module call per head tensor, and RoPE then ran apart)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return None if module is None or type(module) is IdentityOp else module


def _paired_norms(q_norm, k_norm, head_dim: int) -> bool:
    """Whether the q and k norms are both a torch `RMSNorm` over one head with the same eps:
    then they run as one normalisation of q and k together and a multiply by each's weight,
    bit for bit the two calls (`F.rms_norm` scales by its weight last)."""
    return (type(q_norm) is torch.nn.RMSNorm and type(k_norm) is torch.nn.RMSNorm
            and tuple(q_norm.normalized_shape) == tuple(k_norm.normalized_shape) == (head_dim,)
            and q_norm.eps == k_norm.eps and q_norm.weight is not None
            and k_norm.weight is not None)


def paired_norm_weight(q_norm, k_norm, r: int) -> torch.Tensor:
    """[r+1, D]: the q norm's weight for each of a group's r query heads, then the k norm's
    (the multiply of `qk_norm_rope`'s paired norms)."""
    D = q_norm.weight.shape[-1]
    return torch.cat([q_norm.weight.expand(r, D), k_norm.weight.view(1, D)])


def qk_norm_rope(mixed: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor,
                 weight: Optional[torch.Tensor] = None):
    """The fused projection's rows per query group, mixed [T, G, r+2, D] ([r query heads, k, v]
    of each group), -> q [T, G*r, D] and k [T, G, D] after their norms (None: none) and RoPE
    (cos, signed sin [T, 1, rot]), and v [T, G, D]; k and v are strided views. Per-head norms
    (`_paired_norms`) and RoPE run once over the query heads and keys together (the same
    products as apart, bit for bit: tests/test_experts.py); other norms apart. `weight`: the
    paired norms' `paired_norm_weight`, when the caller keeps it (else built here)."""
    T, G, r, D = mixed.shape[0], mixed.shape[1], mixed.shape[2] - 2, mixed.shape[3]
    qk, v = mixed[:, :, : r + 1], mixed[:, :, r + 1]  # [T, G, r+1, D]: q heads, then k
    if q_norm is not None or k_norm is not None:
        if not _paired_norms(q_norm, k_norm, D):  # e.g. full-width norms (OLMoE): apart,
            q, k = qk[:, :, :r].reshape(T, -1, D), qk[:, :, r]  # then one RoPE of both
            q = q if q_norm is None else _norm(q_norm, q)
            k = k if k_norm is None else _norm(k_norm, k)
            qk = _rope(torch.cat((q, k), dim=1), cos, sin)  # [T, G*r + G, D]
            return qk[:, : G * r], qk[:, G * r:], v
        if weight is None:
            weight = paired_norm_weight(q_norm, k_norm, r)  # [r+1, D]
        qk = rms_norm(qk, D, None, q_norm.eps).mul_(weight)
    qk = _rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))  # one RoPE for q and k
    return qk[:, :, :r].reshape(T, -1, D), qk[:, :, r], v


def rope_terms(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's RoPE frequencies [..., rot] -> (cos, signed sin) in `dtype` for `_rope`: the
    sine with the sign of its first half flipped."""
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's non-interleaved RoPE (`_apply_rotary_pos_emb_bshd`) on t [T, ..., D] with the
    terms of `rope_terms` (cos, signed sin [T, 1, rot]): rotate_half(t) * sin equals
    roll(t, rot/2) * signed sin, the same products bit for bit, in one op instead of three."""
    rot = cos.shape[-1]
    if rot == t.shape[-1]:
        return t * cos + torch.roll(t, rot // 2, dims=-1) * sin
    t, t_pass = t[..., :rot], t[..., rot:]
    t = t * cos + torch.roll(t, rot // 2, dims=-1) * sin
    return torch.cat((t, t_pass), dim=-1)


# --------------------------------------------------------------------------------------------
# membership: who keeps stepping


@dataclass
class StepReport:
    """What ranks share at a step boundary (one small all-gather)."""

    has_work: list[bool]
    finished: int  # responses finished, all ranks
    tokens: int  # response tokens produced, all ranks
    requests: int  # responses asked for, all ranks
    running: list[int]  # per rank of the group: requests decoding now
    queued: list[int]  # per rank: requests waiting for admission
    remaining: list[int]  # per rank: most tokens a running request may still produce
    kv_free: list[int]  # per rank: KV bytes free
    # per rank: the step that just ran, as traced (`TracedLoad`; empty before the first step):
    # what a modelled clock prices (`tails.ModelledClock`)
    traced: list = field(default_factory=list)


@dataclass
class Boundary:
    """A membership's answer at a step boundary: the shared report and the release decision
    the engine then applies (default: everybody stays, nothing moves)."""

    report: StepReport
    decision: ReleaseDecision = field(default_factory=ReleaseDecision)
    plan_s: float = 0.0  # seconds the decision took
    arrivals: list = field(default_factory=list)  # requests another replica handed this rank
    # how the requests of the decision's migration plan travel (`decision.migrate`: the moves
    # of `decision.moves` carry their kind); None: re-prefilled
    prices: Optional[MovePrices] = None


@dataclass
class ShrinkStats:
    """What carrying out a shrink cost this rank."""

    borrowed_bytes: int  # expert weights it received (they take KV room)
    sent_bytes: int
    transfer_s: float
    switch_s: float


class Membership(Protocol):
    """Decides at each step boundary who keeps stepping; the engine applies the decision."""

    def step_boundary(self, engine: "RolloutEngine", has_work: bool) -> Boundary:
        """Called by every active rank after every step (and once before the first)."""
        ...

    def shrink(self, moe, decision: ReleaseDecision, *, now: float, step: int) -> ShrinkStats:
        """Carry out a decision's shrink (expert transfers, the survivors' group)."""
        ...


def share_step_state(group, has_work: bool, engine: "RolloutEngine") -> StepReport:
    """One all-gather of every rank's step state (this rollout's counters and its last traced
    step)."""
    st = engine.rollout
    trace = st.record.trace
    last = trace.load(engine.rank, trace.steps - 1) if trace.steps else TracedLoad(engine.rank,
                                                                                 0, 0, 0, 0)
    table = share_rows(group, [int(has_work), st.finished, st.tokens, st.requests,
                               len(st.running), len(st.queue), st.remaining_bound(),
                               engine.kv_free_bytes(), *dataclasses.astuple(last)])
    cols = list(zip(*table))
    return StepReport(has_work=[bool(x) for x in cols[0]], finished=sum(cols[1]),
                      tokens=sum(cols[2]), requests=sum(cols[3]), running=list(cols[4]),
                      queued=list(cols[5]), remaining=list(cols[6]), kv_free=list(cols[7]),
                      traced=[TracedLoad(*row[8:]) for row in table] if trace.steps else [])


class StaticMembership:
    """Static EP (the baseline): a rank with nothing left still enters every step's collectives
    (empty batches) until no rank of the group has work."""

    def step_boundary(self, engine, has_work) -> Boundary:
        return Boundary(share_step_state(engine.moe.group, has_work, engine))

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# per-rollout state


@dataclass
class _Running:
    """One request in this rollout: its tokens so far and where its K/V live."""

    request: Request
    admitted_s: Optional[float] = None  # first admitted (None: still queued)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # tokens to feed at the next step
    blocks: list[int] = field(default_factory=list)  # block table: positions in block order
    length: int = 0  # tokens whose K/V are stored
    lane: Optional[int] = None  # the pool lane its blocks fill from the start (None: anywhere)

    @property
    def position(self) -> int:
        """Index in the sequence of the token this request samples next."""
        return len(self.request.prompt_ids) + len(self.tokens)

    def restart(self) -> None:
        """Back to no stored K/V: the next admission re-prefills prompt + tokens so far."""
        self.blocks, self.length, self.lane = [], 0, None
        self.pending = list(self.request.prompt_ids) + self.tokens

    def resume(self, blocks: list[int], length: int) -> None:
        """Its K/V moved in with it, `length` tokens (everything but its last sampled token)
        stored in `blocks`: the next step feeds that token and samples on."""
        if length != self.position - 1:
            raise RolloutError(f"request {self.request.request_id}: {length} tokens of K/V moved "
                               f"in, its position is {self.position} (a move sends all but the "
                               "last sampled token)")
        self.blocks, self.length = blocks, length
        self.pending = [self.tokens[-1]]


@dataclass
class Rollout:
    """Everything one `generate()` call owns: queue, running requests, KV pool, counters, record."""

    record: RankRecord
    pool: BlockPool
    t0: float
    requests: int  # responses asked of this rank
    queue: deque = field(default_factory=deque)  # of _Running, waiting for admission
    running: list = field(default_factory=list)  # of _Running, in admission order
    results: list = field(default_factory=list)
    finished: int = 0
    tokens: int = 0
    migrated_out: list = field(default_factory=list)  # request ids handed to another rank
    adopted: list = field(default_factory=list)  # requests taken over from another rank
    plan: Optional["_Plan"] = None  # what the steps read of the model

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def remaining_bound(self) -> int:
        """Most tokens any running request of this rank may still produce."""
        return max((r.request.max_total_tokens - r.position for r in self.running), default=0)


@dataclass
class RolloutOutput:
    results: list[Result]
    record: RankRecord


@dataclass
class _Batch:
    """Index tensors of one forward, shared by every layer. T new tokens of B requests, Q the
    most new tokens of one request, L = blocks * block_tokens the longest block table's span."""

    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    new_slots: torch.Tensor  # [T] pool slot each new token's K/V goes to
    tables: Optional[torch.Tensor]  # [B * blocks] block tables padded with block 0; None: lanes
    mask: torch.Tensor  # [R, 1, Q, L] additive (0 / -inf), causal over each request's own context
    query_index: Optional[torch.Tensor]  # [B, Q] new token of each query row; None: T == B
    out_index: Optional[torch.Tensor]  # [T] row of each new token in [B*Q]; None: T == B
    last: Optional[torch.Tensor]  # [B] index of each request's last new token; None: T == B
    # attention rows R: B requests, K/V gathered through the tables; or, when every request is
    # in a pool lane, `lanes` rows read as a view of the pool (`BlockPool.lane_view`), request b
    # in row lane_rows[b] (None: row b), the other rows idle (mask 0, output dropped)
    lanes: Optional[int] = None
    lane_rows: Optional[torch.Tensor] = None  # [B]
    # a decode step padded to a bucket (`static_decode`): [rows] True for the B real rows
    # (first), False for padding; None: an eager step
    valid: Optional[torch.Tensor] = None
    # what the padded step's shapes follow from: (rows, lanes or None: gathered, span in blocks)
    bucket: Optional[tuple] = None


@dataclass
class _LayerPlan:
    """One decoder layer's modules and what the step reads of them, looked up once per rollout
    (each module attribute read is a Python call; a step made ~100)."""

    attn: object  # the layer's self-attention (its linear_qkv, for `_qkv`)
    input_norm: object  # callable: `_norm_call`
    qkv: object  # callable: `_linear_call` of linear_qkv; None: not Megatron's own linear
    q_norm: object  # per-head or full-width q/k norms (None: none)
    k_norm: object
    pair_weight: Optional[torch.Tensor]  # the paired q/k norms' `paired_norm_weight`
    proj: object  # callable (x, residual): `_linear_call` of linear_proj
    scale: float  # the attention's softmax scale
    pre_mlp_norm: object


@dataclass
class _Plan:
    """What a rollout's steps read of the model, looked up once per rollout."""

    layers: list  # of _LayerPlan
    final_norm: object  # callable: `_norm_call` of the final layer norm
    output_weight: torch.Tensor


def _linear_call(module):
    """`_linear(module, x, residual)` as a callable of (x, residual=None), a plain linear's
    weight (and its transpose) read once."""
    if not _is_plain_linear(module) or module.bias is not None:
        return functools.partial(_linear, module)
    w = module.weight
    wt = w.t()

    def call(x, residual=None):
        return F.linear(x, w) if residual is None else torch.addmm(residual, x, wt)
    return call


def _norm_call(module):
    """`_norm(module, x)` as a callable of x, its weight and eps read once."""
    if type(module) is torch.nn.RMSNorm and len(module.normalized_shape) == 1:
        return functools.partial(rms_norm, width=module.normalized_shape[0],
                                 weight=module.weight, eps=module.eps)
    return functools.partial(_norm, module)


# CPU attention with several intra-op threads splits its work by the batch's shape, so a row's
# last bits differ alone and in a larger batch: placement-independent tokens need one thread
CPU_THREADS_WARNING = (
    "rollout engine on CPU with {threads} intra-op threads: attention splits its work by the "
    "batch's shape, so a request's last bits, and so a sampled token, may depend on its batch "
    "and placement; run one thread per rank (OMP_NUM_THREADS=1, torchrun's default) for "
    "placement-independent tokens")


@functools.lru_cache(maxsize=None)
def _say_if_kernels_missing(rank: int) -> None:
    """One line on stderr (rank 0, once per process) when rollout.cpu_kernels asks for the C
    kernels and they cannot be built or loaded: the runs' examples ignore Python warnings, and
    decoding on torch's kernels is about a third slower."""
    why = cpu_kernels.unavailable_reason()
    if why is not None and rank == 0:
        print(f"[flexfloor] warning: rollout.cpu_kernels: {why}", file=sys.stderr, flush=True)


class RolloutEngine:
    """Token-only generation on a Megatron-Core `GPTModel` (the trainer's own weights).

    Lifecycle: build once per model; `generate()` per rollout creates a `Rollout` (queue,
    running requests, KV block pool, record) that lives only inside that call.
    """

    def __init__(
        self,
        model,
        moe,
        *,
        rank: int,
        max_batch_size: int = 64,
        kv_budget_bytes: Optional[int] = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        progress: bool = False,
        valid_vocab: Optional[int] = None,
        kv_lanes: bool = True,
        static_decode: bool = False,
        cpu_kernels: bool = True,
    ):
        self.model = model
        self.moe = moe  # megatron_ext.elastic_moe.PlacedMoE over the current EP group
        self.config = model.config
        self.rank = rank
        self.max_batch_size = max_batch_size
        self.kv_budget_bytes = kv_budget_bytes
        self.block_tokens = block_tokens
        self.progress = progress
        # the tokenizer's vocabulary when the model's is padded beyond it: never sample padding
        self.valid_vocab = valid_vocab
        # requests' blocks in pool lanes, read by attention as views (False: always gathered
        # through the block tables; the same tokens, for tests and A/B runs)
        self.kv_lanes = kv_lanes
        # decode-only steps padded to buckets, with fixed shapes and no host read in the layer
        # stack (`_static_batch`; rollout.static_decode): what a CUDA graph would replay
        self.static_decode = static_decode
        if static_decode:  # a shrunk rank's borrowed experts stacked at rebind, off the step
            moe.stack_borrowed = True
        # float32 CPU steps on FlexFloor's C kernels (`megatron_ext.cpu_kernels`): the decode
        # attention here, the expert GEMMs in the MoE layers (rollout.cpu_kernels)
        self.cpu_kernels = cpu_kernels
        moe.cpu_kernels = cpu_kernels
        self.max_seq_len = model.max_sequence_length
        cfg = self.config
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.groups = cfg.num_query_groups or cfg.num_attention_heads
        self.heads = cfg.num_attention_heads
        self.device = next(model.parameters()).device
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            warnings.warn(CPU_THREADS_WARNING.format(threads=torch.get_num_threads()),
                          RuntimeWarning, stacklevel=2)
        self.dtype = cfg.params_dtype
        if cpu_kernels and self.device.type == "cpu" and self.dtype == torch.float32:
            _say_if_kernels_missing(rank)
        self.kv_bytes_per_token = kv_bytes_per_token(cfg)
        self.block_bytes = self.kv_bytes_per_token * block_tokens
        # blocks of the budget (rounded down: the pool never exceeds it); None: unbounded
        self.capacity_blocks = None if kv_budget_bytes is None else kv_budget_bytes // self.block_bytes
        self._freqs = None
        self._check_supported(cfg)
        self.rollout: Optional[Rollout] = None  # the rollout in progress (memberships read it)

    @staticmethod
    def _check_supported(cfg) -> None:
        """The raw dense path reproduces Megatron's modules for this layout only."""
        unsupported = [name for name, bad in (
            ("tensor_model_parallel_size > 1", cfg.tensor_model_parallel_size > 1),
            ("rotary_interleaved", cfg.rotary_interleaved),
            ("apply_rope_fusion", cfg.apply_rope_fusion),
            ("multi_latent_attention", cfg.multi_latent_attention),
        ) if bad]
        if unsupported:
            raise RolloutError(f"the rollout engine does not support {', '.join(unsupported)} "
                               "in the model config")

    # ---------------------------------------------------------------- validation

    def check_requests(self, requests: Sequence[Request]) -> None:
        seen = set()
        vocab = self.model.vocab_size
        for r in requests:
            if r.request_id in seen:
                raise RolloutError(f"request {r.request_id} appears twice in one rollout")
            seen.add(r.request_id)
            if not r.prompt_ids:
                raise RolloutError(f"request {r.request_id} has an empty prompt")
            if len(r.prompt_ids) >= self.max_seq_len:
                raise RolloutError(
                    f"request {r.request_id}: prompt of {len(r.prompt_ids)} tokens does not fit the "
                    f"context of {self.max_seq_len} (model.max_seq_len); shorten it or raise "
                    "data.max_prompt_len / model.max_seq_len"
                )
            if r.max_total_tokens > self.max_seq_len:
                raise RolloutError(
                    f"request {r.request_id}: prompt {len(r.prompt_ids)} + up to "
                    f"{r.max_total_tokens - len(r.prompt_ids)} new tokens exceeds the context of "
                    f"{self.max_seq_len} (model.max_seq_len); lower rollout.max_new_tokens"
                )
            bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise RolloutError(f"request {r.request_id}: token ids {bad[:5]} outside vocab {vocab}")
            if self.capacity_blocks is not None:
                need = blocks_for(r.max_total_tokens, self.block_tokens)
                if need > self.capacity_blocks:
                    raise RolloutError(
                        f"request {r.request_id} needs up to {r.max_total_tokens} tokens of KV "
                        f"cache ({need} blocks of {self.block_tokens}), more than the rank's "
                        f"budget of {self.capacity_blocks * self.block_tokens} tokens "
                        "(rollout.kv_budget_tokens, whole rollout.kv_block_tokens blocks); raise "
                        "the budget or lower rollout.max_new_tokens"
                    )

    def _check_on_every_rank(self, requests: Sequence[Request]) -> None:
        """Validate locally, then agree: a request one rank refuses fails the rollout on every
        rank at once (instead of leaving the others waiting in a collective)."""
        import torch.distributed as dist

        try:
            self.check_requests(requests)
            problem = None
        except RolloutError as e:
            problem = str(e)
        group = self.moe.group
        problems = gather_objects(group, problem)
        ranks = dist.get_process_group_ranks(group)
        bad = [f"rank {r}: {p}" for r, p in zip(ranks, problems) if p is not None]
        if bad:
            raise RolloutError("rollout refused; " + "; ".join(bad))

    # ---------------------------------------------------------------- forward

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE terms of each position [T] -> cos, signed sin [T, 1, rot] (`rope_terms`) of
        Megatron's frequencies, taken once per engine for every position of the context."""
        if self._freqs is None:
            # normal tensors, not inference ones: Megatron caches `rotary_pos_emb`'s result and
            # the trainer's forward may ask it for the same length
            with torch.inference_mode(False), torch.no_grad():
                freqs = self.model.rotary_pos_emb(self.max_seq_len)[:, 0]  # [S, 1, rot]
                self._freqs = rope_terms(freqs, self.dtype)
        cos, sin = self._freqs
        return cos[positions], sin[positions]

    def _batch(self, running: list[_Running], pool: BlockPool) -> _Batch:
        """Index tensors of one step, built once on the host and copied to the device once each.
        A decode-only step (one new token per request, T == B) needs no query/output gathers."""
        bt = self.block_tokens
        lens = [len(r.pending) for r in running]
        q_max = max(lens)
        dev = self.device
        as_long = dict(dtype=torch.long, device=dev)
        width = max(len(r.blocks) for r in running)
        lanes = [r.lane for r in running]
        if None in lanes:
            lanes, tables = None, torch.tensor(
                [b for r in running for b in r.blocks + [0] * (width - len(r.blocks))], **as_long)
        else:
            tables = None
        if q_max == 1:  # decode only: query b is token b, at the position after the stored ones
            stored = [r.length for r in running]
            ids = [r.pending[0] for r in running]
            new_slots = [r.blocks[n // bt] * bt + n % bt for r, n in zip(running, stored)]
            host = torch.tensor([ids, stored, new_slots], **as_long)  # [3, B]: one copy
            positions = host[1]
            seen = torch.arange(width * bt, device=dev).unsqueeze(0) <= positions.unsqueeze(1)
            return self._in_lanes(_Batch(
                tokens=host[0].view(1, -1), positions=positions.view(1, -1), new_slots=host[2],
                tables=tables, mask=self._additive(seen).view(len(running), 1, 1, -1),
                query_index=None, out_index=None, last=None), lanes)
        ids, pos, new_slots = [], [], []
        for r, n in zip(running, lens):
            ids.extend(r.pending)
            pos.extend(range(r.length, r.length + n))
            new_slots.extend(pool.slots(r.blocks, r.length, r.length + n))
        j = torch.arange(width * bt, device=dev)  # [L]
        p0 = torch.tensor([r.length for r in running], device=dev)  # [B] stored before this step
        ctx = torch.tensor([r.length + n for r, n in zip(running, lens)], device=dev)  # [B]
        i = torch.arange(q_max, device=dev)
        n_new = torch.tensor(lens, device=dev)
        valid_q = i.unsqueeze(0) < n_new.unsqueeze(1)  # [B, Q]
        ends = torch.cumsum(n_new, 0)  # [B] one past each request's last new token
        query_index = torch.where(valid_q, (ends - n_new).unsqueeze(1) + i, 0)
        qpos = torch.where(valid_q, p0.unsqueeze(1) + i, 0)  # padding rows see position 0
        out_index = torch.tensor([b * q_max + t for b, n in enumerate(lens) for t in range(n)],
                                 **as_long)
        seen = (j.view(1, 1, -1) <= qpos.unsqueeze(2)) & (j.view(1, 1, -1) < ctx.view(-1, 1, 1))
        return self._in_lanes(_Batch(
            tokens=torch.tensor(ids, **as_long).view(1, -1),
            positions=torch.tensor(pos, **as_long).view(1, -1),
            new_slots=torch.tensor(new_slots, **as_long), tables=tables,
            mask=self._additive(seen).unsqueeze(1), query_index=query_index, out_index=out_index,
            last=ends - 1), lanes)

    @staticmethod
    def _in_lanes(batch: _Batch, lanes: Optional[list[int]]) -> _Batch:
        """The batch's attention rows as pool lanes (`lanes`: each request's lane; None: keep
        the gathered rows): request b in row lanes[b] of lanes 0 .. max(lanes), idle rows
        unmasked (they read finite stale or zero K/V; their output is dropped)."""
        if lanes is None:
            return batch
        batch.lanes = max(lanes) + 1
        if lanes != list(range(len(lanes))):
            rows = torch.tensor(lanes, dtype=torch.long, device=batch.mask.device)
            batch.lane_rows = rows
            batch.mask = batch.mask.new_zeros((batch.lanes,) + batch.mask.shape[1:]).index_copy_(
                0, rows, batch.mask)
        return batch

    def _additive(self, seen: torch.Tensor) -> torch.Tensor:
        """A boolean attention mask as the additive one (0 / -inf) SDPA would make of it in every
        layer: once per step here. Every row sees its position 0 at least: no row is all -inf."""
        return torch.full(seen.shape, float("-inf"), dtype=self.dtype,
                          device=seen.device).masked_fill_(seen, 0.0)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Megatron's `LanguageModelEmbedding` of tokens [1, T] -> [T, H]: at TP=1 in eval, with
        no position or token-type embedding, sequence parallelism or fp32 residual, that is
        `F.embedding` on the word embedding's weight (its module call adds a TP reduction, a
        transpose and an identity dropout); any other embedding through its forward."""
        emb = self.model.embedding
        if (emb.training or emb.add_position_embedding or emb.tokentype_embeddings is not None
                or emb.reduce_scatter_embeddings or emb.word_embeddings.tp_group.size() > 1
                or self.config.sequence_parallel or self.config.fp32_residual_connection):
            return emb(input_ids=tokens, position_ids=positions).view(-1, self.config.hidden_size)
        return F.embedding(tokens.view(-1), emb.word_embeddings.weight)

    def _plan(self) -> _Plan:
        """The rollout's `_Plan`, built once per rollout (the weights do not change inside
        one)."""
        r = self.heads // self.groups
        out = []
        for layer in self.model.decoder.layers:
            attn = layer.self_attention
            q_norm = _qk_norm(getattr(attn, "q_layernorm", None))
            k_norm = _qk_norm(getattr(attn, "k_layernorm", None))
            plain = _is_plain_linear(attn.linear_qkv)
            paired = (plain and q_norm is not None and k_norm is not None
                      and _paired_norms(q_norm, k_norm, self.head_dim))
            out.append(_LayerPlan(
                attn=attn, input_norm=_norm_call(layer.input_layernorm),
                qkv=_linear_call(attn.linear_qkv) if plain else None,
                q_norm=q_norm, k_norm=k_norm,
                pair_weight=paired_norm_weight(q_norm, k_norm, r) if paired else None,
                proj=_linear_call(attn.linear_proj), scale=attn.core_attention.softmax_scale,
                pre_mlp_norm=_norm_call(layer.pre_mlp_layernorm)))
        return _Plan(out, _norm_call(self.model.decoder.final_layernorm), self._output_weight())

    @torch.inference_mode()
    def forward(self, running: list[_Running], pool: BlockPool,
                plan: Optional[_Plan] = None) -> torch.Tensor:
        """One forward over the pending tokens of every running request (their blocks already
        taken); returns the logits of each request's last new token [B, V] and stores the new
        K/V in the pool.

        In inference mode (less bookkeeping per op than no_grad): the pool, the weights and
        everything else that outlives the step are created outside it (the RoPE table and the
        expert stacks too); what it creates (the logits, the step's tensors) is only read
        afterwards.

        Every rank of the EP group must call this once per step, even with no requests: the MoE
        all-to-all needs all of them. `plan`: the rollout's `_plan` (None: built here). With
        `static_decode`, a decode-only step (on every rank of the group) is padded to a bucket
        (`_static_batch`); the host-built index tensors are made first, then the layer stack
        (`_layer_stack`) runs on the device alone.
        """
        rows = self._static_rows(running)
        if not running:
            return self._empty_step(rows)
        plan = self._plan() if plan is None else plan
        batch = (self._batch(running, pool) if rows is None
                 else self._static_batch(running, pool, rows))
        logits = self._layer_stack(plan, batch, pool)
        for r in running:
            r.length += len(r.pending)
        if batch.valid is not None:  # the padding rows' logits: dropped
            logits = logits[: len(running)]
        if self.valid_vocab is not None:
            logits = logits[:, : self.valid_vocab]
        return logits.float() if logits.dtype != torch.float64 else logits

    def _layer_stack(self, plan: _Plan, batch: _Batch, pool: BlockPool) -> torch.Tensor:
        """Embedding to logits over one step's `batch` (its index tensors built): per layer
        attention over the pool and the MoE layer; stores the new K/V. Logits [rows, V]: one per
        request (B, or a padded step's bucket rows). A padded step's shapes follow from its
        `bucket` alone and nothing in it reads on the host (where the experts run grouped)."""
        # request rows: one per new token in a decode step, else the query rows' requests
        B = batch.tokens.shape[1] if batch.query_index is None else batch.query_index.shape[0]
        L = batch.mask.shape[3]
        G, D, heads = self.groups, self.head_dim, self.heads
        blocks = pool.k.shape[1] // self.block_tokens
        x = self._embed(batch.tokens, batch.positions)  # [T, H]
        rope = self._rotary(batch.positions[0])  # cos, signed sin [T, 1, rot], every layer
        # a decode-only step in float32 on CPU: FlexFloor's decode attention (each request reads
        # its own positions 0 .. position, `megatron_ext.cpu_kernels`), else SDPA
        lengths = None
        if (self.cpu_kernels and batch.query_index is None and self.device.type == "cpu"
                and self.dtype == torch.float32 and cpu_kernels.available()):
            lengths = batch.positions[0] + 1
        stores = pool.k.unbind(0), pool.v.unbind(0)  # per layer [slots, G, D]
        if batch.lanes is not None:  # the lanes as views of the pool: [R, G, L, D] per layer
            lane_keys, lane_values = pool.lane_views(batch.lanes, L // self.block_tokens)
        else:  # per layer [blocks, block_tokens, G, D], gathered through the block tables
            keys_of = pool.k.view(-1, blocks, self.block_tokens, G, D).unbind(0)
            values_of = pool.v.view(-1, blocks, self.block_tokens, G, D).unbind(0)
        for li, lp in enumerate(plan.layers):
            # q [T, heads, D], k and v [T, groups, D], RoPE applied
            q, k, v = self._qkv(lp, lp.input_norm(x), *rope)
            stores[0][li].index_copy_(0, batch.new_slots, k)
            stores[1][li].index_copy_(0, batch.new_slots, v)
            if batch.lanes is not None:
                keys, values = lane_keys[li], lane_values[li]
            else:  # whole blocks through the block tables: [B, L, G, D] -> [B, G, L, D]
                keys = keys_of[li].index_select(0, batch.tables).view(B, L, G, D)
                values = values_of[li].index_select(0, batch.tables).view(B, L, G, D)
                keys, values = keys.transpose(1, 2), values.transpose(1, 2)
            if lengths is not None and cpu_kernels.runs_attention(q, keys):
                o = cpu_kernels.decode_attention(q.reshape(B, heads, D), keys, values, lengths,
                                                 lp.scale if lp.scale is not None else D ** -0.5,
                                                 rows=batch.lane_rows).view(B, heads * D)
            else:
                o = self._sdpa(lp.scale, q, keys, values, batch)
            x = lp.proj(o, x)
            x = x + self.moe.forward(li, lp.pre_mlp_norm(x), batch.valid)
        h = plan.final_norm(x if batch.last is None else x[batch.last])
        return F.linear(h, plan.output_weight)  # [B or rows, V]

    def _sdpa(self, scale: Optional[float], q: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """SDPA of the step's query rows (q [T, heads, D]) over keys and values [R, G, L, D]
        with the step's mask: one call for every request, prefill chunks and decode tokens
        together. Returns [T, heads * D], one row per new token."""
        B = batch.tokens.shape[1] if batch.query_index is None else batch.query_index.shape[0]
        Q, heads, D = batch.mask.shape[2], self.heads, self.head_dim
        if batch.query_index is None:  # decode only: query b is token b, Q == 1
            queries = q.view(B, heads, 1, D)
        else:
            queries = q[batch.query_index].view(B, Q, heads, D).transpose(1, 2)
        if batch.lane_rows is not None:  # request b in row lane_rows[b]
            queries = queries.new_zeros((batch.lanes,) + queries.shape[1:]).index_copy_(
                0, batch.lane_rows, queries)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask,
                                           scale=scale, enable_gqa=True)  # [R, heads, Q, D]
        if batch.lane_rows is not None:
            o = o.index_select(0, batch.lane_rows)
        o = o.transpose(1, 2).reshape(B * Q, heads * D)
        return o if batch.out_index is None else o[batch.out_index]

    def _qkv(self, lp: "_LayerPlan", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Megatron's `get_query_key_value_tensors` at TP=1 and RoPE as raw ops on `linear_qkv`'s
        weight (h [T, H], cos and signed sin [T, 1, rot] -> q [T, heads, D], k and v [T, groups,
        D], possibly strided views): the fused projection viewed per query group as
        [q heads..., k, v], then `qk_norm_rope`. A transformer-engine projection (its input
        norm fused in) goes through Megatron's call."""
        if lp.qkv is None:
            q, k, v = lp.attn.get_query_key_value_tensors(h.unsqueeze(1), None)[:3]
            return _rope(q[:, 0], cos, sin), _rope(k[:, 0], cos, sin), v[:, 0]
        r, D = self.heads // self.groups, self.head_dim
        mixed = lp.qkv(h).view(-1, self.groups, r + 2, D)  # [T, G, r+2, D]
        return qk_norm_rope(mixed, lp.q_norm, lp.k_norm, cos, sin, lp.pair_weight)

    def _output_weight(self) -> torch.Tensor:
        if self.model.share_embeddings_and_output_weights:
            return self.model.shared_embedding_or_output_weight()
        return self.model.output_layer.weight

    def _empty_step(self, rows: Optional[int] = None) -> torch.Tensor:
        """A step with no own tokens: still enter every MoE layer's all-to-all, with 0 tokens,
        or in a step the group pads (`_static_rows`) with `rows` padding rows (zeros: they
        reach no expert)."""
        x = torch.zeros(rows or 0, 1, self.config.hidden_size, dtype=self.dtype,
                        device=self.device)
        valid = None if rows is None else torch.zeros(rows, dtype=torch.bool, device=self.device)
        for li in range(len(self.model.decoder.layers)):
            self.moe.forward(li, x, valid)
        return torch.empty(0, self.model.vocab_size, device=self.device)

    # ---------------------------------------------------------------- padded decode steps

    def _static_rows(self, running: list[_Running]) -> Optional[int]:
        """The rows this step is padded to (`static_decode`), or None: an eager step. A step is
        padded when it is decode-only on every rank of the group (one new token per request; an
        empty rank counts as one); its rows are the bucket (`decode_bucket`) of the group's
        largest batch, the same on every rank, so the MoE layers' slabs have one size. Over a
        group of several ranks: one small all-gather per step, before the layer stack (prefill
        and mixed steps stay eager, as vLLM's do)."""
        if not self.static_decode:
            return None
        decode = all(len(r.pending) == 1 for r in running)
        rows = decode_bucket(len(running), self.max_batch_size) if decode and running else 0
        if self.moe.group_size > 1:
            table = share_rows(self.moe.group, [int(not decode), rows])
            if any(eager for eager, _ in table):
                return None
            rows = max(n for _, n in table)
        return rows or None

    def _static_batch(self, running: list[_Running], pool: BlockPool, rows: int) -> _Batch:
        """A decode-only step padded to `rows`: the B requests in rows 0 .. B-1, then padding
        rows (token `PAD_TOKEN` at position 0, their K/V written to the pool's scratch slot, a
        mask that sees position 0 only, their logits dropped). The span is rounded up to a
        power of two of blocks (at most a lane, or the context). When every request sits in a
        lane, attention reads a power of two of lanes as views (enough for every request's lane
        and for the rows: the padding rows take idle lanes), else it gathers through block
        tables (a padding row's: the scratch block). The step's shapes follow from its `bucket`
        (rows, lanes, span) alone."""
        bt, dev, B = self.block_tokens, self.device, len(running)
        pad = rows - B
        stored = [r.length for r in running]
        width = max(len(r.blocks) for r in running)
        lanes = [r.lane for r in running]
        count = None  # lanes read as views; None: gathered through the block tables
        if None not in lanes:
            need = max(rows, max(lanes) + 1)
            count = min(_power_of_two(need), pool.stored_blocks // pool.lane_blocks)
            count = count if count >= need else None
        cap = pool.lane_blocks if count is not None else blocks_for(self.max_seq_len, bt)
        span = min(_power_of_two(width), cap)
        scratch = pool.scratch_slot
        ids = [r.pending[0] for r in running] + [PAD_TOKEN] * pad
        positions = stored + [0] * pad
        new_slots = [r.blocks[n // bt] * bt + n % bt for r, n in zip(running, stored)]
        new_slots += [scratch] * pad
        tables = None
        if count is None:
            row_of, seen_at = list(range(rows)), positions
            tables = torch.tensor(
                [b for r in running for b in r.blocks + [0] * (span - len(r.blocks))]
                + [scratch // bt] * (span * pad), dtype=torch.long, device=dev)
        else:
            taken = set(lanes)
            row_of = lanes + [lane for lane in range(count) if lane not in taken][:pad]
            seen_at = [0] * count  # idle lanes too: position 0 only
            for row, p in zip(row_of, positions):
                seen_at[row] = p
        host = torch.tensor([ids, positions, new_slots, row_of], dtype=torch.long, device=dev)
        seen_at = torch.tensor(seen_at, dtype=torch.long, device=dev)
        seen = torch.arange(span * bt, device=dev).unsqueeze(0) <= seen_at.unsqueeze(1)
        return _Batch(
            tokens=host[0].view(1, -1), positions=host[1].view(1, -1), new_slots=host[2],
            tables=tables, mask=self._additive(seen).view(seen.shape[0], 1, 1, -1),
            query_index=None, out_index=None, last=None, lanes=count,
            lane_rows=None if count is None else host[3],
            valid=torch.arange(rows, device=dev) < B, bucket=(rows, count, span))

    # ---------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], membership: Membership) -> RolloutOutput:
        """Generate every request of this rank; returns exactly one result per request.

        All ranks of the EP group (`self.moe.group`) must call it together (with their own requests, possibly
        none). Requests are admitted in the order given when a slot and KV blocks are free.
        """
        with collective_phase(self.rank, "request check"):
            self._check_on_every_rank(requests)
        self.model.eval()
        pool = BlockPool(num_layers=len(self.model.decoder.layers), groups=self.groups,
                         head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                         block_tokens=self.block_tokens, capacity=self.capacity_blocks,
                         lane_blocks=self._lane_blocks(requests), scratch=self.static_decode)
        if pool.lane_blocks is not None:  # the lanes the first admissions open, in one go
            lanes = min(len(requests), self.max_batch_size)
            if self.static_decode:  # a padded step's lanes: its rows' bucket (`_static_batch`)
                lanes = decode_bucket(lanes, self.max_batch_size) if lanes else 0
            pool.reserve(lanes * pool.lane_blocks)
        trace = StepTrace(num_experts=self.moe.num_experts, num_layers=len(self.moe.layers),
                          expert_bytes=self.moe.expert_nbytes, block_tokens=self.block_tokens)
        trace.enter_group(self.moe.placement.ranks, self.moe.placement.owner)
        st = self.rollout = Rollout(record=RankRecord(rank=self.rank, requests=len(requests),
                                                      trace=trace),
                                    pool=pool, t0=time.perf_counter(), requests=len(requests),
                                    plan=self._plan())
        st.queue.extend(_Running(r, pending=list(r.prompt_ids)) for r in requests)
        record = st.record
        try:
            bar = self._progress_bar()
            with collective_phase(self.rank, "rollout start", 0):
                keep, report = self._boundary(membership, st)  # nobody has work: no step
            while keep:
                self._admit(st)
                self._take_blocks(st)
                record.kv_peak_bytes = max(record.kv_peak_bytes, pool.peak * pool.block_bytes)
                running = st.running
                # the step's trace from host counts: contexts before the forward stores them
                contexts = [(r.length, len(r.pending)) for r in running]
                touched = self.moe.experts_touched
                trace.enter_group(self.moe.placement.ranks, self.moe.placement.owner)
                with collective_phase(self.rank, "decode (MoE all-to-all)", record.steps):
                    logits = self.forward(running, pool, st.plan)
                trace.add_step(contexts, self.moe.experts_touched - touched)
                record.steps += 1
                if running:
                    record.busy_steps += 1
                    self._sample(st, logits)
                with collective_phase(self.rank, "step boundary (release)", record.steps):
                    keep, report = self._boundary(membership, st)
                if bar is not None:
                    now = st.elapsed()
                    bar.total = report.requests
                    bar.set_postfix(tok_s=f"{report.tokens / max(now, 1e-9):.0f}",
                                    active=len(report.has_work), refresh=False)
                    bar.update(report.finished - bar.n)
            if record.release_step is None:  # not released early: occupied to the end
                record.release_s = st.elapsed()
                record.release_step = record.steps
            if bar is not None:
                bar.close()
            if st.has_work:
                raise RolloutError(
                    f"rank {self.rank} left the rollout with {len(st.running)} running and "
                    f"{len(st.queue)} queued requests"
                )
            # an adopted request may move on again (to a rank that stays longer): owed by that
            # one; and one this rank gave may come back (a correction's giver stays): each move
            # out cancels one of its own or one arrival
            owed = list(requests) + st.adopted
            for rid in st.migrated_out:
                owed.remove(next(r for r in owed if r.request_id == rid))
            self._check_complete(owed, st.results)
            if pool.used:  # every finish, preemption and migration gives its blocks back
                raise RolloutError(f"rank {self.rank}: {pool.used} KV blocks still held after "
                                   "every request ended")
            return RolloutOutput(results=st.results, record=record)
        finally:
            self.rollout = None  # the pool and every request go with the rollout

    def _boundary(self, membership: Membership, st: Rollout) -> tuple[bool, StepReport]:
        """Ask the membership and apply its decision: migrate, count the floor, shrink (a
        leaver records its release). Returns (this rank keeps stepping, the report)."""
        b = membership.step_boundary(self, st.has_work)
        d, record = b.decision, st.record
        if b.arrivals:
            self.adopt(b.arrivals, across=True)
        if not any(b.report.has_work):
            return False, b.report
        if d.hand_over:  # every request of this replica goes to other replicas: it leaves whole
            payloads = self.export_running(d.hand_over, across=True)
            record.migrated_across += len(payloads)
            membership.hand_over(self, payloads, d.hand_over)
            record.release_s, record.release_step = st.elapsed(), record.steps
            return False, b.report
        if d.migrate or d.moves:
            self._migrate(st, d.migrate, d.moves, b.prices)
        if d.floor_hit:
            record.floor_hits += 1
        if not d.leaving:
            return True, b.report
        now = st.elapsed()
        before, groups = self.moe.placement.ranks, live_process_groups()
        shrink = membership.shrink(self.moe, d, now=now, step=record.steps)
        record.trace.shrinks.append(ShrinkTrace(
            record.steps, before, shrink.sent_bytes, shrink.borrowed_bytes,
            live_process_groups() - groups))
        if self.rank in d.leaving:
            record.release_s = now
            record.release_step = record.steps
        else:
            st.pool.withhold(shrink.borrowed_bytes)  # borrowed weights take KV room
        record.plan_s += b.plan_s
        record.transfer_s += shrink.transfer_s
        record.switch_s += shrink.switch_s
        record.sent_bytes += shrink.sent_bytes
        return self.rank not in d.leaving, b.report

    def _migrate(self, st: Rollout, plan: dict[int, int], moves: Sequence = (),
                 prices: Optional[MovePrices] = None) -> None:
        """Carry out a migration plan ({giver: taker}: all of a giver's running requests, each
        travelling as `prices` say) and per-request moves (consolidate.Move: request -> its
        taker, and its kind): givers export their running requests, takers adopt theirs. One
        gather over the group carries the requests; when any moves with its K/V, one
        all-to-all carries every such request's K/V (on the group's device) as well."""
        ranks = list(self.moe.placement.ranks)
        to = {m.request_id: m.dst for m in moves}
        givers = sorted(set(plan) | {m.src for m in moves})
        payload = (self.export_running(moves, prices=prices, taker=plan.get(self.rank, -1))
                   if self.rank in givers else [])
        kv = {p["request"].request_id: p.pop("kv") for p in payload if "kv" in p}
        everyone = gather_objects(self.moe.group, payload)
        dst = [[to.get(p["request"].request_id, plan.get(giver)) for p in part]
               for giver, part in zip(ranks, everyone)]
        mine = [p for part, where in zip(everyone, dst) for p, d in zip(part, where)
                if d == self.rank]
        if any(p["kv_tokens"] for part in everyone for p in part):
            received = self._exchange_kv(everyone, dst, kv, st.pool)
            for p in mine:
                if p["kv_tokens"]:
                    p["kv"] = received[p["request"].request_id]
        if mine:
            self.adopt(mine)

    def _exchange_kv(self, everyone: list[list[dict]], dst: list[list[int]], kv: dict,
                     pool: BlockPool) -> dict:
        """The moved requests' K/V in one all-to-all over the group, each rank's to each taker
        in payload order: `everyone[i]` the payloads of the i-th rank of the group, `dst[i]`
        their takers, `kv` this rank's exported tensors by request id. Returns the K/V sent to
        this rank, by request id ([2, layers, tokens, groups, head_dim] each)."""
        ranks = list(self.moe.placement.ranks)
        me = ranks.index(self.rank)
        nbytes = lambda p: math.prod(pool.kv_shape(p["kv_tokens"])) * pool.k.element_size()
        device = group_device(self.moe.group)
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        parts = [[kv[p["request"].request_id].reshape(-1).view(torch.uint8).to(device)
                  for p, d in zip(everyone[me], dst[me]) if p["kv_tokens"] and d == j]
                 for j in ranks]
        parts = [torch.cat(x) if x else empty for x in parts]
        incoming = [[p for p, d in zip(part, where) if p["kv_tokens"] and d == self.rank]
                    for part, where in zip(everyone, dst)]
        got = exchange_bytes(parts, [sum(map(nbytes, ps)) for ps in incoming], self.moe.group)
        out = {}
        for ps, flat in zip(incoming, got):
            for p, chunk in zip(ps, flat.split([nbytes(p) for p in ps])):
                out[p["request"].request_id] = chunk.view(pool.k.dtype).view(
                    pool.kv_shape(p["kv_tokens"]))
        return out

    def _admit(self, st: Rollout) -> None:
        """Admit queued requests (in order) while a batch slot and their prefill's blocks are
        free, keeping a watermark of free blocks for the running requests' next tokens."""
        pool = st.pool
        watermark = watermark_blocks(pool.capacity)
        while st.queue and len(st.running) < self.max_batch_size:
            r = st.queue[0]
            need = blocks_for(len(r.pending), self.block_tokens)
            if not pool.can_allocate(need, keep=watermark if st.running else 0):
                if not st.running:  # nothing will free room: fail instead of spinning
                    raise RolloutError(
                        f"rank {self.rank}: request {r.request.request_id} needs {need} KV blocks "
                        f"and only {pool.free_blocks} are free with nothing running (borrowed "
                        "experts hold the rest); raise rollout.kv_budget_tokens or "
                        "elastic.min_active_ranks")
                break
            st.queue.popleft()
            fits = pool.lane_blocks is not None and blocks_for(
                r.request.max_total_tokens, self.block_tokens) <= pool.lane_blocks
            self._extend(r, pool, need, pool.open_lane() if fits else None)
            if r.admitted_s is None:
                r.admitted_s = st.elapsed()
            st.running.append(r)

    def _take_blocks(self, st: Rollout) -> None:
        """Give every running request the blocks its pending tokens need; when the pool runs
        out, preempt the youngest running request (re-queued first, re-prefilled later from its
        position: its tokens do not change)."""
        pool, bt = st.pool, self.block_tokens
        i = 0
        while i < len(st.running):
            r = st.running[i]
            if r.length + len(r.pending) <= len(r.blocks) * bt:  # its blocks hold them
                i += 1
                continue
            need = blocks_for(r.length + len(r.pending), bt) - len(r.blocks)
            if pool.can_allocate(need):
                self._extend(r, pool, need, r.lane)
                i += 1
                continue
            victim = st.running.pop()  # the youngest (possibly r itself)
            pool.free(victim.blocks)
            victim.restart()
            st.queue.appendleft(victim)
            st.record.preempted += 1

    @staticmethod
    def _extend(r: _Running, pool: BlockPool, n: int, lane: Optional[int]) -> None:
        """Give r n more blocks, the next ones of `lane` where they are free; r stays in the
        lane only while its table is the lane's first blocks in order."""
        start = len(r.blocks)
        new = pool.allocate(n, lane=lane, start=start)
        first = None if lane is None else lane * pool.lane_blocks + start
        r.lane = lane if first is not None and new == list(range(first, first + n)) else None
        r.blocks += new

    def _lane_blocks(self, requests: Sequence[Request]) -> Optional[int]:
        """The pool's lane width: the blocks the longest request of this rank may need (None:
        no requests). Requests adopted later that need more are stored outside lanes."""
        longest = max((r.max_total_tokens for r in requests), default=0)
        return (blocks_for(longest, self.block_tokens) or None) if self.kv_lanes else None

    def _sample(self, st: Rollout, logits: torch.Tensor) -> None:
        """One batched draw for every running request; one device-to-host copy of the results
        (none on CPU: both read as they are)."""
        running = st.running
        tokens, logprobs = sample(logits, [r.request for r in running],
                                  [r.position for r in running])
        if tokens.is_cpu:
            drawn = tokens.tolist(), logprobs.tolist()
        else:
            drawn = torch.stack([tokens.double(), logprobs]).cpu().tolist()  # the step's one copy
        now = st.elapsed()
        still = []
        for r, token, logprob in zip(running, map(int, drawn[0]), drawn[1]):
            r.tokens.append(token)
            r.logprobs.append(logprob)
            r.pending = [token]
            reason = self._finish_reason(r, token)
            if reason is None:
                still.append(r)
                continue
            req = r.request
            st.results.append(Result(
                request_id=req.request_id, prompt_uid=req.prompt_uid,
                sample_index=req.sample_index, prompt_ids=req.prompt_ids,
                token_ids=r.tokens, logprobs=r.logprobs, finish_reason=reason,
                rank=self.rank, admitted_s=r.admitted_s, finished_s=now,
            ))
            st.pool.free(r.blocks)
            r.blocks = []
            st.record.local_finish_s = now
            st.record.local_finish_step = st.record.steps
            st.finished += 1
        st.tokens += len(running)
        st.record.tokens += len(running)
        st.running = still

    # ---------------------------------------------------------------- migration

    def export_running(self, moves: Sequence = (), *, across: bool = False,
                       prices: Optional[MovePrices] = None, taker: int = -1,
                       only: Optional[set] = None) -> list[dict]:
        """Hand over every running request (the queue must be empty), or those whose ids are in
        `only` (the others run on here, in their admission order): its tokens so far, and,
        when it moves with its K/V (its move's kind; else as `prices` say; never `across`),
        its stored K/V as "kv" (`BlockPool.export_kv`: for the taker's pool, not for a pickle)
        with "kv_tokens" its length (0: the taker re-prefills). Its randomness is keyed by
        position, so nothing else travels. Its blocks are freed: this rank then has no work and
        can be released. `moves` (consolidate.Move) name each request's taker and kind, `taker`
        that of the others (-1: unknown here); `across`: to another replica."""
        st = self.rollout
        if st.queue:
            raise RolloutError(f"rank {self.rank}: cannot migrate with {len(st.queue)} queued")
        to = {m.request_id: m.dst for m in moves}
        kinds = {m.request_id: m.kind for m in moves}
        out, stay = [], []
        for r in st.running:
            rid = r.request.request_id
            if only is not None and rid not in only:
                stay.append(r)
                continue
            if across:  # the mailbox carries no tensors
                kind = MoveKind.REPREFILL
            elif rid in kinds:
                kind = kinds[rid]
            else:  # the migration plan's: as the prices say
                kind = MoveKind.REPREFILL if prices is None else prices.of(r.position)[0]
            p = {"request": r.request, "tokens": r.tokens, "logprobs": r.logprobs,
                 "admitted_s": r.admitted_s, "src": self.rank, "kv_tokens": 0}
            if kind == MoveKind.KV_TRANSFER:
                p["kv"], p["kv_tokens"] = st.pool.export_kv(r.blocks, r.length), r.length
            out.append(p)
            st.pool.free(r.blocks)
            st.migrated_out.append(rid)
            st.record.trace.moves.append(MoveTrace(
                st.record.steps, rid, self.rank, to.get(rid, taker), r.position, across=across,
                kind=kind.value, kv_tokens=p["kv_tokens"],
                kv_bytes=p["kv_tokens"] * self.kv_bytes_per_token))
        st.running = stay
        st.record.migrated_out += len(out)
        return out

    def adopt(self, payloads: list[dict], *, across: bool = False) -> None:
        """Continue requests another rank started. One that brings its K/V ("kv", from
        `_migrate`'s exchange) is stored in this rank's pool (`BlockPool.import_kv`: refused
        when its blocks do not fit) and decodes on at the next step; the others are queued
        first and re-prefilled (prompt + tokens so far) at admission. Either way they sample
        from the same position-keyed stream, so the tokens are those the other rank would have
        produced. `across`: from another replica."""
        st = self.rollout
        requeued = []
        for p in payloads:
            r = _Running(p["request"], p["admitted_s"], tokens=list(p["tokens"]),
                         logprobs=list(p["logprobs"]))
            if "kv" not in p:
                r.restart()
                requeued.append(r)
                continue
            if len(st.running) >= self.max_batch_size:
                raise RolloutError(f"rank {self.rank}: request {r.request.request_id} moved in "
                                   f"with its K/V and all {self.max_batch_size} batch slots are "
                                   "taken (rollout.max_batch_size): the move's decision should "
                                   "have seen that")
            r.resume(st.pool.import_kv(p["kv"], request_id=r.request.request_id), p["kv_tokens"])
            st.running.append(r)
        st.queue.extendleft(reversed(requeued))
        for p in payloads:
            kv_tokens = p.get("kv_tokens", 0) if "kv" in p else 0
            st.record.trace.moves.append(MoveTrace(
                st.record.steps, p["request"].request_id, p.get("src", -1), self.rank,
                len(p["request"].prompt_ids) + len(p["tokens"]), across=across,
                kind=(MoveKind.KV_TRANSFER if kv_tokens else MoveKind.REPREFILL).value,
                kv_tokens=kv_tokens, kv_bytes=kv_tokens * self.kv_bytes_per_token))
        st.adopted.extend(p["request"] for p in payloads)
        st.record.adopted += len(payloads)
        if across:
            st.record.adopted_across += len(payloads)

    def kv_free_bytes(self) -> int:
        return self.rollout.pool.free_bytes()

    def elapsed(self) -> float:
        """Seconds since this rollout started on this rank."""
        return self.rollout.elapsed()

    @property
    def record(self) -> RankRecord:
        """The record of the rollout in progress."""
        return self.rollout.record

    @property
    def running(self) -> list:
        return self.rollout.running if self.rollout is not None else []

    @property
    def queue(self) -> deque:
        return self.rollout.queue if self.rollout is not None else deque()

    @staticmethod
    def _finish_reason(r: _Running, token: int) -> Optional[FinishReason]:
        req = r.request
        n = len(r.tokens)
        if req.target_len is not None:
            return FinishReason.TARGET if n >= req.target_len else None
        if req.sampling.eos_id is not None and token == req.sampling.eos_id:
            return FinishReason.EOS
        if token in req.sampling.stop_token_ids:
            return FinishReason.STOP
        if n >= req.max_new_tokens:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _check_complete(requests: Sequence[Request], results: list[Result]) -> None:
        want = sorted(r.request_id for r in requests)
        got = sorted(r.request_id for r in results)
        if want != got:
            missing = sorted(set(want) - set(got))
            extra = [g for g in got if got.count(g) > 1 or g not in want]
            raise RolloutError(f"rollout results do not match requests: missing {missing[:5]}, "
                               f"duplicated or unknown {sorted(set(extra))[:5]}")

    def _progress_bar(self):
        if not self.progress or self.rank != 0:
            return None
        from tqdm import tqdm

        return tqdm(desc="rollout", unit="resp", total=None, leave=False, dynamic_ncols=True,
                    mininterval=1.0)
