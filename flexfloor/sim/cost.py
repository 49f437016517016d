"""What a lockstep EP step costs, what a shrink costs, and how much KV cache a rank holds.

A step of the active EP group takes the slowest active rank's time (every MoE layer's all-to-all
waits for all of them), plus the engine's host overhead per step (scheduling, sampling, launches
of the captured graphs). One rank's time, roofline style (max of the FLOP time and the bytes time
for each part):
- dense part (attention projections, the output head, shared experts: every rank holds them,
  data-parallel attention) over its own new tokens; nothing when it has none;
- attention over its requests' cached context: KV bytes read, QK^T/PV FLOPs (each new token
  against its own request's context: a decoding request's context, a prompt's triangle);
- the experts it hosts over the tokens routed to them from every active rank: expert GEMM FLOPs,
  and the weight bytes of the hosted experts that receive at least one token (an expert of
  popularity p is idle with probability (1 - topk p)^T for T tokens in the step; popularity is
  uniform, or Zipf with `CostParams.zipf_s` > 0);
- a floor per layer for the kernels that run whatever the batch (`layer_floor_s`);
- the MoE all-to-all, dispatch and combine at every MoE layer (`a2a_seconds`): inside one node,
  the bytes over NVLink at DeepEP's published intranode rate (about 155 GB/s on H800's 200 GB/s
  NVLink, scaled to the accelerator's NVLink); a group spanning nodes, at DeepEP's published
  low-latency rates for its EP size (`DEEPEP_LOW_LATENCY`, scaled to the accelerator's network);
  never under `a2a_floor_s` per collective.
Ranks are packed `gpus_per_node` to a node in rank order. A shrink costs the expert bytes moved
(per-link bandwidth, all transfers in parallel) and the survivors' group: a group built ahead
(`GroupSource.PREBUILT`: a switch, `switch_s`; the engine builds the groups its plan implies before
decoding, flexfloor/rollout/survivors.py) or a new communicator (`GroupSource.NEW`, what a release
off the plan costs: `group_create_s`).

`UnitCost` prices every step at 1 and a shrink at 0: the simulator then counts engine steps, and
its figures equal the real engine's exactly (tests/test_sim.py).
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from flexfloor.rollout.consolidate import MoveKind
from flexfloor.rollout.types import StepTrace, TracedLoad
from flexfloor.sim.hardware import ACCELERATORS, UNIT_ACCELERATOR, Accelerator, ModelShape

# DeepEP's published low-latency kernels (deepseek-ai/DeepEP README, H800, CX7 400 Gb/s RDMA per
# GPU, 128 tokens per rank, hidden 7168, top-8, FP8 dispatch and BF16 combine): EP size ->
# (dispatch seconds, dispatch GB/s, combine seconds, combine GB/s). The bytes a rank moves over the
# rate its EP size achieves gives the time; at the reference load that is the published time.
DEEPEP_LOW_LATENCY = {
    8: (77e-6, 98e9, 114e-6, 127e9),
    16: (118e-6, 63e9, 195e-6, 74e9),
    32: (155e-6, 48e9, 273e-6, 53e9),
    64: (173e-6, 43e9, 314e-6, 46e9),
    128: (192e-6, 39e9, 369e-6, 39e9),
}
DEEPEP_NETWORK_BYTES_PER_S = 50e9  # the 400 Gb/s NIC per GPU those figures were measured on
# DeepEP's normal kernels inside one H800 node: about 155 GB/s of NVLink's 200 GB/s per direction
DEEPEP_INTRANODE_FRACTION = 155e9 / 200e9


class GroupSource(enum.Enum):
    """Where the survivors' EP group comes from at a shrink."""

    PREBUILT = "prebuilt"  # built ahead (a split of the rollout's group): a switch
    NEW = "new"  # a new communicator per shrink: NCCL init
    # as the engine does (flexfloor/rollout/survivors.py): the survivor sets the plan implies
    # built ahead (a switch); a shrink the plan did not foresee goes to the nearest prebuilt
    # superset (the other leavers stay idle in it), else builds a new communicator (kept for
    # later shrinks to the same set)
    PLANNED = "planned"


@dataclass(frozen=True)
class CostParams:
    """Efficiency and overhead assumptions (what a well-tuned decode path achieves)."""

    hbm_efficiency: float = 0.8  # achieved / peak HBM bandwidth
    flop_efficiency: float = 0.5  # achieved / peak tensor FLOP/s in decode-sized GEMMs
    link_efficiency: float = 0.7  # achieved / peak link bandwidth for expert transfers
    a2a_floor_s: float = 20e-6  # least time of one dispatch or combine, however few tokens
    host_overhead_s: float = 1.5e-3  # engine per step: scheduling, sampling, graph launches
    # per layer, at any batch: its ~16 kernels (norms, projections, router, attention, experts) at
    # ~5 us each even when captured in a graph
    layer_floor_s: float = 80e-6
    group_source: GroupSource = GroupSource.NEW
    switch_s: float = 0.02  # swap to a survivors' communicator built ahead
    # a new NCCL communicator: seconds at scale (NCCL's published ncclCommInit times)
    group_create_s: float = 2.0
    zipf_s: float = 0.0  # expert popularity ~ 1 / rank^s (0: uniform routing)
    hbm_usable_fraction: float = 0.9  # of HBM, the rest for the allocator and the runtime
    activation_reserve_bytes: float = 4 * (1 << 30)  # activations, logits, CUDA graphs

    def group_seconds(self, prebuilt: Optional[bool] = None) -> float:
        """What the survivors' group costs at one shrink: `prebuilt` says whether it was built
        ahead (None: as `group_source` says; `PLANNED` without it: a new one)."""
        if prebuilt is None:
            prebuilt = self.group_source == GroupSource.PREBUILT
        return self.switch_s if prebuilt else self.group_create_s


def expert_popularity(num_experts: int, zipf_s: float, seed: int = 0) -> np.ndarray:
    """Share of token-expert pairs each expert receives [E], summing to 1: uniform, or Zipf of
    exponent `zipf_s` over a fixed random order of the experts (hot experts are not contiguous)."""
    if zipf_s < 0:
        raise ValueError(f"zipf_s={zipf_s}: must be >= 0 (0: uniform routing)")
    w = 1.0 / np.arange(1, num_experts + 1) ** zipf_s
    w = w[np.random.default_rng([seed, 7]).permutation(num_experts)]
    return w / w.sum()


def a2a_seconds(nbytes: float, group_size: int, multi_node: bool, accel: Accelerator,
                params: CostParams) -> tuple[float, float]:
    """(dispatch, combine) seconds of one MoE layer's all-to-all for a rank moving `nbytes` each
    way, in an EP group of `group_size` ranks."""
    if group_size <= 1:
        return 0.0, 0.0
    if not multi_node:
        bw = accel.nvlink_bytes_per_s * DEEPEP_INTRANODE_FRACTION
        t = max(params.a2a_floor_s, nbytes / bw)
        return t, t
    _, disp_bw, _, comb_bw = _deepep_rates(group_size)
    scale = accel.network_bytes_per_s / DEEPEP_NETWORK_BYTES_PER_S
    return (max(params.a2a_floor_s, nbytes / (disp_bw * scale)),
            max(params.a2a_floor_s, nbytes / (comb_bw * scale)))


def _deepep_rates(group_size: int) -> tuple[float, float, float, float]:
    """DeepEP's figures at an EP size, log-linear between the published sizes, held at the ends."""
    sizes = sorted(DEEPEP_LOW_LATENCY)
    if group_size <= sizes[0]:
        return DEEPEP_LOW_LATENCY[sizes[0]]
    if group_size >= sizes[-1]:
        return DEEPEP_LOW_LATENCY[sizes[-1]]
    i = bisect.bisect_left(sizes, group_size)
    lo, hi = sizes[i - 1], sizes[i]
    f = (math.log2(group_size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    a, b = DEEPEP_LOW_LATENCY[lo], DEEPEP_LOW_LATENCY[hi]
    return tuple(x + f * (y - x) for x, y in zip(a, b))


@dataclass
class RankLoad:
    """One active rank in one step."""

    rank: int
    new_tokens: int  # tokens it feeds this step (1 per decoding request, the prompt at prefill)
    context_tokens: int  # cached tokens its requests attend over
    hosted_experts: int
    attention_pairs: float = 0.0  # (new token, cached token) pairs: its context when decoding
    # hosted experts that receive tokens (per layer), when measured; None: expected from the
    # step's tokens and the routing popularity
    touched_experts: Optional[float] = None


class UnitCost:
    """Every step costs 1 and a shrink 0: time is counted in engine steps."""

    unit = "steps"

    def step_seconds(self, loads: Sequence[RankLoad], owner: Sequence[int]) -> float:
        return 1.0

    def shrink_seconds(self, transfers, owner: Sequence[int],
                       prebuilt: Optional[bool] = None) -> float:
        return 0.0

    def measured_shrink_seconds(self, moved: Mapping[int, float], ranks: Sequence[int],
                                groups_created: int) -> float:
        return 0.0

    def kv_move_seconds(self, transfers: Sequence[tuple[int, int, int]]) -> float:
        return 0.0


@dataclass
class RooflineCost:
    accel: Accelerator
    model: ModelShape
    params: CostParams = CostParams()
    _shares: dict = field(default_factory=dict, repr=False)  # owner -> per-rank popularity

    unit = "s"

    def __post_init__(self):
        self.popularity = expert_popularity(self.model.num_experts, self.params.zipf_s)

    def node(self, rank: int) -> int:
        return rank // self.accel.gpus_per_node

    def _experts_by_rank(self, owner: Sequence[int]):
        """(ranks in order, index of each expert's rank, each rank's share of the pairs)."""
        key = tuple(owner)
        if key not in self._shares:
            if len(self._shares) > 256:
                self._shares.clear()
            ranks = sorted(set(key))
            index = np.array([ranks.index(r) for r in key])
            share = np.bincount(index, weights=self.popularity, minlength=len(ranks))
            self._shares[key] = ({r: i for i, r in enumerate(ranks)}, index, share)
        return self._shares[key]

    def step_seconds(self, loads: Sequence[RankLoad], owner: Sequence[int]) -> float:
        """owner: expert -> rank of the current placement (the active group)."""
        a, m, p = self.accel, self.model, self.params
        hbm = a.hbm_bytes_per_s * p.hbm_efficiency
        flops = a.bf16_flops * p.flop_efficiency
        total = sum(x.new_tokens for x in loads)
        k = m.topk
        position, index, share = self._experts_by_rank(owner)
        # experts receiving at least one of the step's tokens, per rank
        idle = (1.0 - np.minimum(1.0, k * self.popularity)) ** total
        touched = np.bincount(index, weights=1.0 - idle, minlength=len(share))
        multi_node = len({self.node(x.rank) for x in loads}) > 1
        hidden_bytes = m.hidden_size * m.dtype_bytes
        floor = m.num_layers * p.layer_floor_s
        slowest = 0.0
        for x in loads:
            t = floor
            if x.new_tokens:
                t += max(2 * m.dense_params * x.new_tokens / flops, m.dense_read_bytes / hbm)
                t += max(m.attention_flops_per_ctx_token * x.attention_pairs / flops,
                         x.context_tokens * m.kv_bytes_per_token / hbm)
            i = position.get(x.rank)
            mine = float(share[i]) if i is not None else 0.0
            pairs = total * k * mine  # token-expert pairs this rank computes
            busy = (x.touched_experts if x.touched_experts is not None else
                    float(touched[i]) if i is not None else 0.0)
            t += max(pairs * 2 * m.expert_params * m.num_layers / flops,
                     busy * m.expert_bytes / hbm)
            if len(loads) > 1:
                # its tokens out to the owners and back: the pairs that leave the rank, the larger
                # of what it sends and what it receives
                out_pairs = max(x.new_tokens * k * (1.0 - mine), pairs - x.new_tokens * k * mine)
                dispatch, combine = a2a_seconds(out_pairs * hidden_bytes, len(loads), multi_node,
                                                a, p)
                t += m.num_layers * (dispatch + combine)
            slowest = max(slowest, t)
        return slowest + p.host_overhead_s

    def shrink_seconds(self, transfers, owner: Sequence[int],
                       prebuilt: Optional[bool] = None) -> float:
        """Experts of the leavers to the survivors, all transfers at once (each rank's link
        carries what it sends and receives), then the survivors' group (`prebuilt`: whether it
        was built ahead; None: as `CostParams.group_source` says)."""
        load: dict[int, float] = {}
        for t in transfers:
            secs = self._expert_link_seconds(self.node(t.src) == self.node(t.dst))
            load[t.src] = load.get(t.src, 0.0) + secs
            load[t.dst] = load.get(t.dst, 0.0) + secs
        return max(load.values(), default=0.0) + self.params.group_seconds(prebuilt)

    def measured_shrink_seconds(self, moved: Mapping[int, float], ranks: Sequence[int],
                                groups_created: int) -> float:
        """A shrink the engine carried out: `moved` rank -> experts (of this model) it sent
        plus received, all at once, over NVLink when the group `ranks` sits on one node, else
        the network; then the group the code switched to: `groups_created` new communicators
        (`group_create_s` each) or, with none, one built ahead (`switch_s`)."""
        p = self.params
        same = len({self.node(r) for r in ranks}) == 1
        link = max(moved.values(), default=0.0) * self._expert_link_seconds(same)
        return link + (groups_created * p.group_create_s if groups_created else p.switch_s)

    def kv_move_seconds(self, transfers: Sequence[tuple[int, int, int]]) -> float:
        """The K/V of requests moved at one boundary, (giver, taker, tokens) each, in this
        model's K/V bytes, all at once (each rank's link carries what it sends and receives):
        over NVLink when the two ranks share a node, else the network (a taker of -1, not known:
        the network)."""
        a, load = self.accel, {}
        for src, dst, tokens in transfers:
            same = dst >= 0 and self.node(src) == self.node(dst)
            bw = (a.nvlink_bytes_per_s if same else a.network_bytes_per_s) * self.params.link_efficiency
            secs = tokens * self.model.kv_bytes_per_token / bw
            for r in (src, dst):
                load[r] = load.get(r, 0.0) + secs
        return max(load.values(), default=0.0)

    def _expert_link_seconds(self, same_node: bool) -> float:
        """One expert (all layers) over one link."""
        a = self.accel
        bw = (a.nvlink_bytes_per_s if same_node else a.network_bytes_per_s)
        return self.model.expert_bytes / (bw * self.params.link_efficiency)


def kv_budget_bytes(accel: Accelerator, model: ModelShape, hosted_experts: int,
                    params: CostParams = CostParams()) -> int:
    """KV room of a rank hosting `hosted_experts` (its share at the start): HBM it may use, less
    the dense weights, its experts and the activation reserve. Raises when nothing is left."""
    room = (accel.hbm_bytes * params.hbm_usable_fraction - model.dense_bytes
            - hosted_experts * model.expert_bytes - params.activation_reserve_bytes)
    if room < model.kv_bytes_per_token:
        need = (model.dense_bytes + hosted_experts * model.expert_bytes
                + params.activation_reserve_bytes) / (1 << 30)
        raise ValueError(
            f"{model.name} does not fit {accel.name}: the dense weights, {hosted_experts} experts "
            f"and the activation reserve need {need:.1f} GiB of "
            f"{accel.hbm_bytes * params.hbm_usable_fraction / (1 << 30):.1f} GiB usable; use more "
            "accelerators (fewer experts per rank) or larger ones")
    return int(room)


# --------------------------------------------------------------------------------------------
# modelled seconds of the real engine's steps

# `cost_model`'s name for UnitCost (every step 1, a shrink 0): in hardware.py, which the config
# reads without torch


def cost_model(accelerator: str, model_shape: str,
               params: CostParams = CostParams()) -> Union[RooflineCost, UnitCost]:
    """The cost model a tool names: an accelerator of `ACCELERATORS` and a model shape
    (`ModelShape.from_preset`), or `unit` (every step costs 1). Raises ValueError naming the
    choices."""
    if accelerator == UNIT_ACCELERATOR:
        return UnitCost()
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator {accelerator!r} unknown; choose one of "
                         f"{[*sorted(ACCELERATORS), UNIT_ACCELERATOR]}")
    return RooflineCost(ACCELERATORS[accelerator], ModelShape.from_preset(model_shape), params)


def linear_step_cost(priced, max_batch: int):
    """A `scheduler.StepCost` from `priced(n, ctx)` (a rank's step seconds with n requests
    reading ctx cached tokens): decoding, a step is linear in the cached tokens it reads, so it
    is priced once per batch size up to `max_batch` at two contexts and interpolated; larger
    batches at `max_batch`'s. Each batch size is priced the first time it is asked for (a pace
    rule's shrink proposal asks for a few only). Elementwise over numpy arrays (or on plain
    numbers); a negative batch size is refused (ValueError)."""
    ref = 1 << 20
    table = np.zeros((max_batch + 1, 2))  # batch size -> (seconds at no context, per token)
    known = np.zeros(max_batch + 1, dtype=bool)
    known[0] = True  # an empty batch costs nothing

    def step_cost(n, ctx):
        i = np.minimum(n, max_batch)
        if np.any(i < 0):  # row -1 is max_batch's: it would be priced wrong, not refused
            raise ValueError(f"a step of {np.min(i)} requests: a batch size is at least 0")
        if np.ndim(i):
            missing = np.unique(i[~known[i]]).tolist()
        else:
            missing = [] if known[i] else [int(i)]
        for m in missing:
            base = priced(m, 0)
            table[m] = base, (priced(m, m * ref) - base) / (m * ref)
            known[m] = True
        return table[i, 0] + table[i, 1] * ctx

    return step_cost


@dataclass(frozen=True)
class ModelledRollout:
    """One rollout's real steps priced by a cost model."""

    occupied_s: dict[int, float]  # rank -> modelled seconds until its release
    rollout_s: float  # the rank that stayed longest


def price_trace(traces: Mapping[int, StepTrace], cost, *,
                held_steps: Optional[Mapping[int, int]] = None) -> ModelledRollout:
    """Apply `cost` to every real step of one rollout. traces: rank -> its `StepTrace`;
    held_steps: rank -> the occupied steps its record counts (a rank held after its group
    ended, e.g. a static replica done early, counts more steps than it traced: it is occupied
    to the rollout's end).

    A step of a group prices the loads of all its ranks at that step (lockstep: every rank of
    the group traced it): new tokens, KV tokens read, attention pairs, hosted experts (the
    traced expert -> rank map stretched to the cost's model: its expert j runs where traced
    expert j * E_traced // E_model ran) and, when the traced model has the cost's expert and
    layer counts, the experts that really received rows. A shrink prices the expert bytes each
    rank sent and received (in the cost model's experts) and the groups the code created. A
    request moved with its K/V (`MoveTrace.kind` "kv_transfer", as its giver traced it) prices
    its tokens of K/V, in the cost model's bytes, over the link its two ranks share, at the
    boundary it moved at, for every rank of the group (the transfers run in one collective
    before the next step); a re-prefilled one is already in its taker's prefill tokens. A
    rank's occupied time: its steps, moves and shrinks until it left (the leaver pays its
    shrink)."""
    steps: dict[tuple, list] = {}  # (group ranks, step) -> [(rank, trace, k)]
    shrinks: dict[tuple, list] = {}  # (group ranks, boundary) -> [(rank, trace, ShrinkTrace)]
    for rank, tr in traces.items():
        for k in range(tr.steps):
            steps.setdefault((tr.group_at(k).ranks, k), []).append((rank, tr, k))
        for sh in tr.shrinks:
            shrinks.setdefault((sh.ranks, sh.step), []).append((rank, tr, sh))
    kv_moves: dict[tuple, list] = {}  # (group ranks, boundary) -> [(giver, taker, kv tokens)]
    for rank, tr in traces.items():
        for m in tr.moves:
            if m.src == rank and m.kind == MoveKind.KV_TRANSFER.value and m.step > 0:
                kv_moves.setdefault((tr.group_at(m.step - 1).ranks, m.step), []).append(
                    (m.src, m.dst, m.kv_tokens))
    step_s = {key: _step_seconds(key, rows, cost) for key, rows in steps.items()}
    shrink_s = {key: _shrink_seconds(key, rows, cost) for key, rows in shrinks.items()}
    move_s = {key: cost.kv_move_seconds(moved) for key, moved in kv_moves.items()}
    own = {}
    for rank, tr in traces.items():
        at = {sh.step: sh for sh in tr.shrinks}
        t = 0.0
        for k in range(tr.steps + 1):  # boundary k (after k steps), then step k
            if k:  # the K/V moved at this boundary, before its shrink
                t += move_s.get((tr.group_at(k - 1).ranks, k), 0.0)
            if k in at:
                t += shrink_s[(at[k].ranks, k)]
            if k < tr.steps:
                t += step_s[(tr.group_at(k).ranks, k)]
        own[rank] = t
    end = max(own.values(), default=0.0)
    held = {r for r, n in (held_steps or {}).items() if r in traces and n > traces[r].steps}
    return ModelledRollout({r: end if r in held else t for r, t in sorted(own.items())}, end)


def _step_seconds(key, rows, cost) -> float:
    ranks, k = key
    got = sorted(r for r, _, _ in rows)
    if got != list(ranks):
        raise ValueError(f"step {k} of the group {list(ranks)} was traced by ranks {got} only: "
                         "a lockstep step needs the trace of every rank of its group (gather "
                         "every rank's record)")
    _, tr, _ = rows[0]
    return traced_step_seconds([t.load(r, i) for r, t, i in rows],
                               tr.group_at(k).owner, tr, cost)


def traced_step_seconds(loads: Sequence[TracedLoad], traced_owner: Sequence[int], tr: StepTrace,
                        cost) -> float:
    """One lockstep step of a group from every rank's `TracedLoad`, its traced expert -> rank
    map and the traced model (`tr`: its expert and layer counts): `price_trace`'s step."""
    owner = model_owner(traced_owner, cost)
    hosted = {r: owner.count(r) for r in {ld.rank for ld in loads}}
    measured = isinstance(cost, RooflineCost) and (
        tr.num_experts, tr.num_layers) == (cost.model.num_experts, cost.model.num_layers)
    return cost.step_seconds(
        [RankLoad(ld.rank, ld.new_tokens, ld.kv_tokens, hosted[ld.rank], ld.attention_pairs,
                  ld.experts_touched / tr.num_layers if measured else None) for ld in loads],
        owner)


def _shrink_seconds(key, rows, cost) -> float:
    ranks, _ = key
    _, tr, _ = rows[0]
    per_expert = tr.expert_bytes or 1
    moved = {r: (sh.sent_bytes + sh.received_bytes) / per_expert for r, _, sh in rows}
    return traced_shrink_seconds(moved, tr.num_experts, ranks,
                                 max(sh.groups_created for _, _, sh in rows), cost)


def traced_shrink_seconds(moved: Mapping[int, float], traced_experts: int, ranks: Sequence[int],
                          groups_created: int, cost) -> float:
    """A shrink of the traced model priced by `cost`: `moved`, rank -> the traced experts it
    sent plus received, each standing for E_model / E_traced of the cost model's experts
    (`traced_experts`: E_traced); then the switch (`measured_shrink_seconds`)."""
    scale = (cost.model.num_experts / traced_experts
             if isinstance(cost, RooflineCost) and traced_experts else 1.0)
    return cost.measured_shrink_seconds({r: n * scale for r, n in moved.items()}, ranks,
                                        groups_created)


def model_owner(traced: Sequence[int], cost) -> list[int]:
    """A traced expert -> rank map stretched to the cost's model (UnitCost: as traced)."""
    if not isinstance(cost, RooflineCost):
        return list(traced)
    n, e = len(traced), cost.model.num_experts
    return [traced[j * n // e] for j in range(e)]
