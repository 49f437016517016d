"""MoE layers routed by placement, re-bindable to a new EP group at run time.

Megatron-Core's `MoELayer` gives EP rank i a contiguous block of experts fixed when the layer is
built, and its dispatcher derives all-to-all splits from that layout; it also cannot take a step
with zero tokens. `PlacedMoE` runs the same layers' own router, experts and shared experts, but
sends each (token, expert) pair to the rank that the current `Placement` names, so any expert ->
rank map works (8 experts on 3 ranks, 6 on 4), a rank with no tokens still takes part in every
exchange, and `rebind()` switches to a new group and placement without rebuilding the model.

A layer's forward is Megatron's MoELayer shape: route (its own router) -> dispatch -> compute ->
combine. Per layer and step, over the EP group: one all-to-all of per-(rank, expert) counts (the
split sizes, the layer's one host read), one of token rows with their routing probabilities
(router dtype, bytes appended to each row), one of expert outputs back; none on a group of one
rank. Rows are sorted by (owner, expert) once (one stable sort); the experts run as raw GEMMs on
their own weights (no copies): grouped over the layer's stacked own experts, and on a lone rank
that hosts only those (EP=1) with the group offsets taken on the device, so the layer reads
nothing on the host. Each token's output is the sum of its top-k expert outputs in ascending
expert order, whatever rank computed them, so the result does not depend on the placement. The
collectives live in `flexfloor.rollout.collectives` (buffers on the group's device).

A step padded to a bucket (the engine's `static_decode`) passes its real rows (`valid`) and takes
the fixed-capacity dispatch instead (`dispatch_fixed`, like DeepEP's low-latency mode): padding
keyed past the last expert, equal-split slabs of T*k rows per rank, the rows sorted by expert on
the device, grouped GEMMs over the stacks that hold every expert placed on this rank
(`_placed_stack`: its own, and after a shrink its borrowed ones, stacked at `rebind`), fixed
slabs back: shapes that follow from T alone and no host read. Where torch has no grouped GEMM
for the dtype (float64 on CPU) the experts' counts are read on the host there.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexfloor.rollout.collectives import exchange_counts, exchange_rows, exchange_rows_back
from megatron_ext import cpu_kernels
from megatron_ext.placement import Placement


class PlacementError(RuntimeError):
    pass


def _clone(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of an expert module that shares (does not copy) its process groups."""
    memo = {}
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, dist.ProcessGroup):
                memo[id(v)] = v
    return copy.deepcopy(module, memo)


@dataclass
class Routed:
    """The router's choice for T tokens: top-k experts per token, ascending, and their
    probabilities."""

    x: torch.Tensor  # [T, H] the layer's input
    experts: torch.Tensor  # [T, k] int64; ascending when k > 2 (two terms add alike either way)
    probs: torch.Tensor  # [T, k] router dtype


@dataclass
class ExpertStack:
    """A layer's own experts `first .. first + count - 1` as stacked weights: projection name ->
    [count, out, in], views of the experts' own parameters."""

    first: int
    count: int
    weights: dict[str, torch.Tensor]
    # the same as [count, in, out] views: `torch._grouped_mm`'s second operand, made once
    operands: dict[str, torch.Tensor] = field(init=False)

    def __post_init__(self):
        self.operands = {name: w.transpose(1, 2) for name, w in self.weights.items()}


@dataclass
class BorrowedStack:
    """Borrowed experts `ids` of a layer (ascending, all below or all above its own stack's
    range) stacked: projection name -> [n, out, in]; their modules' weights are views of it
    (`flexfloor.model.stack_experts`, in the own stack's layout: the same GEMMs, bit for bit)."""

    ids: tuple
    weights: dict[str, torch.Tensor]
    index: torch.Tensor  # [n] the ids on the device (their counts: one index_select)
    operands: dict[str, torch.Tensor] = field(init=False)

    def __post_init__(self):
        self.operands = {name: w.transpose(1, 2) for name, w in self.weights.items()}


def stacked_weights(weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """[n, out, in] view of n equally shaped weights [out, in] that lie one after another in one
    storage, each stored whole either row-major or transposed ([in, out] row-major, as
    `flexfloor.model.stack_expert_weights` stores them); None otherwise."""
    w0 = weights[0]
    if w0.dim() != 2 or not _dense(w0):
        return None
    step = w0.numel() * w0.element_size()
    for i, w in enumerate(weights):
        if (w.shape != w0.shape or w.dtype != w0.dtype or w.stride() != w0.stride()
                or w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr()
                or w.data_ptr() != w0.data_ptr() + i * step):
            return None
    return w0.detach().as_strided((len(weights),) + tuple(w0.shape),
                                  (w0.numel(),) + tuple(w0.stride()))


def _dense(w: torch.Tensor) -> bool:
    """Whether a 2-D tensor's elements fill one block of memory, row- or column-major."""
    rows, cols = w.shape
    return w.stride() in ((cols, 1), (1, rows))


_GROUPED_MM: dict[tuple, bool] = {}


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for this device and dtype (tried once on tiny inputs and
    checked against `F.linear`; e.g. no float64 kernel, or a GPU generation without one)."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.ones(4, 16, dtype=dtype, device=device)
                w = torch.ones(2, 16, 16, dtype=dtype, device=device)
                offs = torch.tensor([1, 4], dtype=torch.int32, device=device)
                ok = bool((torch._grouped_mm(a, w.transpose(1, 2), offs=offs) == 16).all())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM[key] = ok
    return _GROUPED_MM[key]


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                after: Optional[torch.Tensor] = None, kernels: bool = True) -> torch.Tensor:
    """The experts' grouped GEMM (rows offs[e-1] .. offs[e]-1 of x through w[e] [in, out]):
    with `kernels`, in float32 on CPU, FlexFloor's kernel (`megatron_ext.cpu_kernels`; `after`,
    the weight the next GEMM reads, is prefetched), else `torch._grouped_mm`."""
    if kernels and cpu_kernels.handles(x, w):
        return cpu_kernels.grouped_mm(x, w, offs, after=after)
    return torch._grouped_mm(x, w, offs=offs)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, kernels: bool = True) -> torch.Tensor:
    """One expert's projection `F.linear(x, weight)`, through the grouped GEMM's kernel where
    that runs (`kernels`, float32 CPU): an expert's rows are the same bits on every path."""
    out = cpu_kernels.linear(x, weight) if kernels else None
    return F.linear(x, weight) if out is None else out


@dataclass
class Dispatched:
    """The handle a dispatch returns: what compute reads and what combine needs to undo it."""

    order: torch.Tensor  # [T*k] (token, k) pair -> its row in the sent rows
    send_splits: Optional[list[int]]  # rows sent to each rank of the group; None: a lone rank
    recv_splits: Optional[list[int]]  # rows received from each
    per_expert: Optional[list[int]]  # received rows per expert (all E); None: not read on the host
    counts: torch.Tensor  # [E] received rows per expert, on the device
    rows: torch.Tensor  # [N, H] received rows sorted by expert
    probs: torch.Tensor  # [N] their routing probabilities
    by_expert: Optional[torch.Tensor]  # [N] received order -> sorted order; None: already sorted
    x: torch.Tensor  # [T, H] the layer's input (for shared experts)
    # the fixed-capacity dispatch (`dispatch_fixed`): rows per slab (one slab per rank of the
    # group; a lone rank's one slab is its T*k pairs), None: sizes read on the host
    cap: Optional[int] = None
    row_pad: Optional[torch.Tensor] = None  # [N, 1] sorted rows that are padding or filler
    back_index: Optional[torch.Tensor] = None  # [T*k] sorted pair -> its row in the slabs back
    pair_pad: Optional[torch.Tensor] = None  # [T*k, 1] sorted pairs of padding rows


class PlacedMoE:
    """The MoE layers of a `GPTModel`, run with experts placed by a `Placement`.

    `hosted[layer][expert]` is the expert module this rank runs: the model's own local experts
    (shared with the trainer, no copy) plus, after a shrink, borrowed copies.
    """

    def __init__(self, model, *, rank: int, group: dist.ProcessGroup, placement: Placement):
        self.rank = rank
        self.layers = [layer.mlp for layer in model.decoder.layers]
        self.topk = model.config.moe_router_topk
        self.num_experts = model.config.num_moe_experts
        self.hidden = model.config.hidden_size
        self.device = next(model.parameters()).device
        cfg = model.config
        # Megatron's fused activation kernels (GPU): keep its own forward for the experts then
        self._fused_activation = bool(cfg.bias_activation_fusion or cfg.use_te_activation_func)
        # routing probabilities travel in the router's dtype (fp64 for fp64 models)
        self.prob_dtype = torch.float64 if model.config.moe_router_dtype == "fp64" else torch.float32
        self.hosted: list[dict[int, torch.nn.Module]] = [
            {e: m for e, m in zip(mlp.local_expert_indices, mlp.experts.local_experts)}
            for mlp in self.layers
        ]
        self.group: Optional[dist.ProcessGroup] = None
        self.placement: Optional[Placement] = None
        # hosted experts that received rows, every layer of every step: a host count the
        # engine's per-step trace reads (`experts_touched`); the layers' device counts wait in
        # `_touched_counts` until then, so the layer stack itself reads nothing on the host
        self._touched = 0
        self._touched_counts: list[torch.Tensor] = []
        self._stacks: dict[int, Optional[ExpertStack]] = {}  # layer -> own experts stacked
        # per (layer, dtype): `_whole_stack`'s answer, and per (layer, training) whether the
        # router is a plain top-k one: checks of module attributes, kept off the per-step path
        self._whole: dict[tuple, Optional[ExpertStack]] = {}
        self._plain_router: dict[tuple, bool] = {}
        self._routers = [mlp.router for mlp in self.layers]
        self._expert_config = [next(iter(h.values())).config for h in self.hosted]
        self._dtype = next(model.parameters()).dtype
        # restack a shrunk rank's borrowed experts at `rebind` (`_placed_stack`), for the
        # fixed-capacity path of padded steps: set by an engine with `static_decode`; the eager
        # path runs borrowed experts one GEMM each and needs no restacking
        self.stack_borrowed = False
        # float32 expert GEMMs on CPU through FlexFloor's kernel (`_grouped_mm`); set by the
        # engine (rollout.cpu_kernels)
        self.cpu_kernels = True
        self.rebind(group, placement)

    # ---------------------------------------------------------------- layout

    def rebind(self, group: dist.ProcessGroup, placement: Placement) -> None:
        """Switch to `group` and `placement`. This rank must already host its experts in it."""
        ranks = tuple(dist.get_process_group_ranks(group))
        if tuple(sorted(ranks)) != placement.ranks or list(ranks) != sorted(ranks):
            raise PlacementError(
                f"EP group ranks {ranks} do not match the placement's ranks {placement.ranks}: the "
                "configured EP layout and the process group disagree"
            )
        if placement.num_experts != self.num_experts:
            raise PlacementError(
                f"placement covers {placement.num_experts} experts, the model has {self.num_experts}"
            )
        want = set(placement.experts_of(self.rank))
        for li, hosted in enumerate(self.hosted):
            if not want.issubset(hosted):
                raise PlacementError(
                    f"rank {self.rank} layer {li}: placement assigns experts {sorted(want)} but it "
                    f"hosts {sorted(hosted)}; transfer the missing experts before rebinding"
                )
        self.group, self.placement = group, placement
        self.group_size = len(ranks)
        self._whole.clear()
        # expert -> index of its owner in the group, on the model's device (indexed by device ids)
        self._owner_index = torch.tensor([placement.group_index(r) for r in placement.owner],
                                         device=self.device)
        if self.stack_borrowed and any(
                set(placement.experts_of(self.rank)) - set(mlp.local_expert_indices)
                for mlp in self.layers):  # borrowed experts placed here: stack them now, at
            probe = torch.empty(0, dtype=self._dtype, device=self.device)  # the step boundary
            for li in range(len(self.layers)):
                self._placed_stack(li, probe)

    def host(self, layer: int, expert: int, state: dict[str, torch.Tensor]) -> None:
        """Host a borrowed expert: a copy of a local expert module loaded with `state`."""
        module = _clone(next(iter(self.hosted[layer].values())))
        params = dict(module.named_parameters())
        if set(params) != set(state):
            raise PlacementError(
                f"expert {expert} layer {layer}: got tensors {sorted(state)}, expected {sorted(params)}"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
        self.hosted[layer][expert] = module
        self._whole.clear()

    def drop_borrowed(self) -> None:
        """Forget every hosted expert that is not one of the model's own (resync)."""
        for mlp, hosted in zip(self.layers, self.hosted):
            own = set(mlp.local_expert_indices)
            for e in [e for e in hosted if e not in own]:
                del hosted[e]
        self._whole.clear()

    def forget_stacks(self) -> None:
        """Drop the stacked expert views (rebuilt from the parameters at the next step): after
        the experts' storage was replaced."""
        self._stacks.clear()
        self._whole.clear()

    @property
    def experts_touched(self) -> int:
        """Hosted experts that received rows so far, summed over layers and steps (one host read
        of the layers' pending device counts)."""
        if self._touched_counts:
            self._touched += int(torch.stack(self._touched_counts).count_nonzero())
            self._touched_counts.clear()
        return self._touched

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's weights over all layers (what hosting a borrowed one costs)."""
        return sum(sum(p.nbytes for p in next(iter(h.values())).parameters()) for h in self.hosted)

    def expert_state(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's weights by parameter name (what a transfer moves)."""
        return {n: p.detach() for n, p in self.hosted[layer][expert].named_parameters()}

    # ---------------------------------------------------------------- forward
    #
    # Megatron's MoELayer shape: route -> dispatch -> compute -> combine, each replaceable; the
    # dispatch returns a handle that compute and combine consume.

    @torch.no_grad()
    def forward(self, layer: int, hidden: torch.Tensor,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [T, ..., H] (T may be 0) -> MoE output of the same shape. Collective over the
        group. `valid` [T] bool: the real rows of a step padded to a bucket (the engine's
        `static_decode`; every rank of the group passes one, with the same T): the
        fixed-capacity path (`dispatch_fixed`), whose shapes follow from T alone and which reads
        nothing on the host where the placed experts are one stack (`_placed_stack`);
        padding rows reach no expert and get zeros."""
        x = hidden.reshape(-1, self.hidden)  # [T, H]
        routed = self.route(layer, x)
        if valid is None:
            stack = self._whole_stack(layer, x)
            handle = self.dispatch(routed, host_counts=stack is None)
        else:
            stack, borrowed = self._placed_stack(layer, x) or (None, ())
            handle = self.dispatch_fixed(routed, valid)
            rows = self.compute(layer, handle, stack, borrowed)
            return self.combine(layer, handle, rows).view(hidden.shape)
        rows = self.compute(layer, handle, stack)
        out = self.combine(layer, handle, rows)
        return out.view(hidden.shape)

    def route(self, layer: int, x: torch.Tensor) -> "Routed":
        """Megatron's router: each token's top-k experts (ascending) and their probabilities.
        A plain top-k router runs as raw ops (`_raw_topk`); any other through its own forward."""
        t = x.shape[0]
        if t == 0:
            empty = torch.empty(0, self.topk, dtype=torch.long, device=x.device)
            return Routed(x, empty, torch.empty(0, self.topk, dtype=self.prob_dtype, device=x.device))
        router = self._routers[layer]
        key = (layer, router.training)
        if key not in self._plain_router:
            self._plain_router[key] = _plain_topk_router(router)
        if self._plain_router[key]:
            probs, top = _raw_topk(router, x)  # [T, k] x2, in top-k order
            if self.topk > 2:  # the combine sums a token's k outputs in ascending expert order
                top, order = top.sort(dim=1)
                probs = probs.gather(1, order)
            if probs.dtype != self.prob_dtype:
                probs = probs.to(self.prob_dtype)
            return Routed(x, top, probs)
        probs, routing_map = router(x.view(t, 1, self.hidden))  # [T, E] x2
        # the k chosen experts of each token in ascending order, without a host sync (nonzero)
        experts = torch.topk(routing_map.to(torch.int8), self.topk, dim=1).indices.sort(dim=1).values
        return Routed(x, experts, probs.gather(1, experts).to(self.prob_dtype))  # [T, k] x2

    def dispatch(self, routed: "Routed", *, host_counts: bool = True) -> "Dispatched":
        """Send each (token, expert) row to the expert's owner, rows sorted by (owner, expert,
        token) in one stable sort. The per-(rank, expert) counts are exchanged once and read on
        the host once (the split sizes); rows and probabilities then travel in one all-to-all.
        A lone rank exchanges nothing and reads nothing on the host unless `host_counts`
        (compute runs one GEMM per expert: it needs the rows of each)."""
        x, experts = routed.x, routed.experts
        k, E = self.topk, self.num_experts
        size = self.group_size
        flat = experts.reshape(-1)  # [T*k], token-major: pair i is token i // k
        key = flat if size == 1 else self._owner_index[flat] * E + flat  # [T*k] (owner, expert)
        order = torch.argsort(key, stable=True)  # token order kept within an expert
        # [size * E] (destination, expert); a step sized by its batch is never captured: on
        # CPU bincount, one op instead of `_count`'s three
        counts = torch.bincount(key, minlength=size * E) if key.is_cpu else _count(key, size * E)
        send_x = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        send_p = routed.probs.reshape(-1).index_select(0, order)
        if size == 1:  # a lone rank (EP=1, or the last survivor): nothing to exchange
            per_expert = counts.tolist() if host_counts else None  # the layer's one host read
            return Dispatched(order, None, None, per_expert, counts, send_x, send_p, None, x)
        counts = counts.view(size, E)  # [destination, expert]
        recv_counts = exchange_counts(counts, self.group)  # [source, expert]
        table = torch.cat([counts.sum(1), recv_counts.view(-1)]).tolist()  # one host read
        send_splits, recv_per = table[:size], table[size:]
        recv_splits = [sum(recv_per[i * E:(i + 1) * E]) for i in range(size)]
        recv_x, recv_p = exchange_rows(send_x, send_p, recv_splits, send_splits, self.group)
        # received rows come grouped by source, then expert: sort them by expert once
        row_expert = torch.arange(E, device=x.device).repeat(size).repeat_interleave(
            recv_counts.view(-1), output_size=sum(recv_splits))
        by_expert = torch.argsort(row_expert, stable=True)
        per_expert = [sum(recv_per[s * E + e] for s in range(size)) for e in range(E)]
        return Dispatched(order, send_splits, recv_splits, per_expert, recv_counts.sum(0),
                          recv_x[by_expert], recv_p[by_expert], by_expert, x)

    def dispatch_fixed(self, routed: "Routed", valid: torch.Tensor) -> "Dispatched":
        """The fixed-capacity dispatch of a step padded to a bucket (like DeepEP's low-latency
        mode): every shape follows from T alone, nothing is read on the host, and the real rows
        reach their experts in the order `dispatch` gives them (the same expert GEMMs, bit for
        bit). valid [T] bool: the real rows; a padding row's pairs are keyed past the last
        (owner, expert), so they sort last, are counted nowhere and go nowhere. Over a group,
        each rank sends every rank a slab of cap = T*k rows (the most it can send one rank): its
        rows for that rank first, sorted by (expert, token), then filler; the slabs, their
        probabilities and the [rank, expert] counts travel in equal-split all-to-alls, and the
        receiver sorts the slab rows by expert on the device (filler keyed past the last
        expert). Every rank of the group must pass the same T."""
        x, experts = routed.x, routed.experts
        k, E, size = self.topk, self.num_experts, self.group_size
        flat = experts.reshape(-1)  # [P = T*k], token-major
        cap = flat.numel()
        end = size * E  # the key past the last (owner, expert): padding
        key = flat if size == 1 else self._owner_index[flat] * E + flat
        key = torch.where(valid.unsqueeze(1).expand(-1, k).reshape(-1), key, end)  # [P]
        order = torch.argsort(key, stable=True)  # padding last, token order within an expert
        counts = _count(key, end + 1)[:end]  # [size * E], padding not counted
        key_sorted = key.index_select(0, order)
        pair_pad = (key_sorted == end).unsqueeze(1)  # [P, 1]
        send_x = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # [P, H]
        send_p = routed.probs.reshape(-1).index_select(0, order)
        if size == 1:  # the one slab is the sorted pairs: nothing to exchange
            return Dispatched(order, None, None, None, counts, send_x, send_p, None, x,
                              cap=cap, row_pad=pair_pad)
        dev = x.device
        counts = counts.view(size, E)  # [destination, expert]
        sent = counts.sum(1)  # [size] rows for each rank
        first = sent.cumsum(0) - sent  # [size] where each rank's rows start in the sorted ones
        slot = torch.arange(cap, device=dev)
        take = torch.where(slot.unsqueeze(0) < sent.unsqueeze(1), first.unsqueeze(1) + slot,
                           0).view(-1)  # [size * cap] sorted row of each slab row (filler: 0)
        recv_counts = exchange_counts(counts, self.group)  # [source, expert]
        recv_x, recv_p = exchange_rows(send_x.index_select(0, take),
                                       send_p.index_select(0, take), None, None, self.group)
        # a source's slab holds its rows in expert order: each slab row's expert from the
        # source's cumulative counts (filler: E, past the last expert)
        bounds = recv_counts.cumsum(1)  # [source, E]
        row_expert = torch.searchsorted(bounds, slot.expand(size, cap).contiguous(),
                                        right=True).view(-1)  # [size * cap]
        by_expert = torch.argsort(row_expert, stable=True)  # (expert, source, token) order
        # combine: sorted pair j comes back in its destination's slab, at j - first[dest]
        dest = torch.div(key_sorted, E, rounding_mode="floor").clamp_(max=size - 1)
        back_index = torch.where(pair_pad.view(-1), 0,
                                 dest * cap + slot - first.index_select(0, dest))
        return Dispatched(order, None, None, None, recv_counts.sum(0),
                          recv_x.index_select(0, by_expert), recv_p.index_select(0, by_expert),
                          by_expert, x, cap=cap,
                          row_pad=(row_expert.index_select(0, by_expert) == E).unsqueeze(1),
                          back_index=back_index, pair_pad=pair_pad)

    def compute(self, layer: int, handle: "Dispatched", stack: Optional["ExpertStack"] = None,
                borrowed: tuple = ()) -> torch.Tensor:
        """Expert MLPs over the rows sorted by expert; the activation and the probability
        scaling run once over every row. With `stack` (every expert of the layer is one of the
        model's own, stored stacked: `_whole_stack`) one grouped GEMM per projection over the
        stacked weights (views of the trainer's parameters), the group offsets from the device
        counts: no host read. Otherwise only the experts that received rows run: the stacked
        own ones grouped where torch has a grouped GEMM for the dtype and device, the others
        (borrowed ones) as raw GEMMs on their own weights. Returns rows in received order.
        A fixed-capacity handle's padding and filler rows (sorted last) come out as zeros; with
        `borrowed` (`BorrowedStack`s: a shrunk layer's borrowed experts) its rows run grouped
        per stack (`_grouped_segments`); its experts read their counts on the host only where
        they are not stacked (a dtype without a grouped GEMM)."""
        rows, probs = handle.rows, handle.probs
        self._touched_counts.append(handle.counts)
        if stack is not None and borrowed:
            lo, hi = stack.first, stack.first + stack.count
            counts = handle.counts
            segments = [(counts.index_select(0, b.index), b.operands) for b in borrowed
                        if b.ids[0] < lo]
            segments.append((counts[lo:hi], stack.operands))
            segments += [(counts.index_select(0, b.index), b.operands) for b in borrowed
                         if b.ids[0] >= hi]
            out = self._grouped_segments(layer, rows, probs, segments)
        elif stack is not None:
            # [count] one past each stacked expert's rows; rows past the last: not computed
            counts = handle.counts
            if stack.count != counts.shape[0]:  # not every expert of the layer: its range
                counts = counts[stack.first:stack.first + stack.count]
            offs = counts.cumsum(0, dtype=torch.int32)
            h = _grouped_mm(rows, stack.operands["linear_fc1"], offs,
                            after=stack.operands["linear_fc2"], kernels=self.cpu_kernels)
            h = self._activation(self._expert_config[layer], h, probs)  # [N, F]
            out = _grouped_mm(h, stack.operands["linear_fc2"], offs, kernels=self.cpu_kernels)
        else:
            per_expert = handle.per_expert
            if per_expert is None:  # a fixed-capacity handle: the fallback's host read
                per_expert = handle.counts.tolist()
            n = sum(per_expert)
            out = self._hosted_experts(layer, rows[:n], probs[:n], per_expert)
            if n < rows.shape[0]:  # padding and filler rows after the real ones
                out = torch.cat([out, out.new_zeros(rows.shape[0] - n, out.shape[1])])
        if handle.row_pad is not None:
            out.masked_fill_(handle.row_pad, 0.0)  # out is this call's own tensor
        if handle.by_expert is not None:  # back to the order rows arrived in
            out = torch.empty_like(out).index_copy_(0, handle.by_expert, out)
        return out

    def _grouped_segments(self, layer: int, rows: torch.Tensor, probs: torch.Tensor,
                          segments: list) -> torch.Tensor:
        """Rows sorted by expert through several stacks: `segments` (counts [g] of each of a
        stack's experts, its operands) in ascending expert order, each a range of the rows. A
        segment's rows are brought to row 0 by a device gather (its start: the counts before
        it), run through its grouped GEMMs (each expert's rows the same matrix as alone) and
        gathered back; rows past the last segment are left as they come (filler)."""
        n = rows.shape[0]
        i = torch.arange(n, device=rows.device)
        out, start = None, None  # start None: row 0, known on the host
        for counts, operands in segments:
            offs = counts.cumsum(0, dtype=torch.int32)
            if start is None:
                seg_rows, seg_probs = rows, probs
            else:
                take = (i + start).clamp_(max=n - 1)
                seg_rows, seg_probs = rows.index_select(0, take), probs.index_select(0, take)
            h = _grouped_mm(seg_rows, operands["linear_fc1"], offs,
                            after=operands["linear_fc2"], kernels=self.cpu_kernels)
            h = self._activation(self._expert_config[layer], h, seg_probs)  # [N, F]
            o = _grouped_mm(h, operands["linear_fc2"], offs, kernels=self.cpu_kernels)
            if start is None:
                out, start = o, offs[-1].long()
            else:  # later segments take the rows from their start on
                o = o.index_select(0, (i - start).clamp_(min=0))
                out = torch.where((i >= start).unsqueeze(1), o, out)
                start = start + offs[-1]
        return out

    def _hosted_experts(self, layer: int, rows: torch.Tensor, probs: torch.Tensor,
                        per_expert: list[int]) -> torch.Tensor:
        """The experts that received rows (sorted by expert, `per_expert` of each, read on the
        host): the stacked own ones grouped where a grouped GEMM runs, the others one raw GEMM
        each, or Megatron's own forward per expert (biases, fused kernels)."""
        hosted = self.hosted[layer]
        groups = []  # (expert, module, first row, rows) of each expert that received rows
        start = 0
        for e, n in enumerate(per_expert):
            if n == 0:
                continue
            module = hosted.get(e)
            if module is None:
                raise PlacementError(f"rank {self.rank} received tokens for expert {e} it does "
                                     f"not host (layer {layer})")
            groups.append((e, module, start, n))
            start += n
        if not groups:
            return torch.empty_like(rows)
        if self._raw_experts(groups[0][1]):
            stack = self._stack(layer, rows)
            h = self._project(rows, groups, per_expert, stack, "linear_fc1",
                              kernels=self.cpu_kernels)
            h = self._activation(groups[0][1].config, h, probs)  # [N, F]
            return self._project(h, groups, per_expert, stack, "linear_fc2",
                                 kernels=self.cpu_kernels)
        # biases or fused kernels: Megatron's own forward per expert
        return torch.cat([m(rows[s:s + n], probs[s:s + n])[0] for _, m, s, n in groups])

    def _whole_stack(self, layer: int, x: torch.Tensor) -> Optional["ExpertStack"]:
        """The layer's stacked own experts when they are all of its experts, hosted alone (no
        borrowed ones), raw, and a grouped GEMM runs for `x`'s dtype and device: then every row
        this rank receives is for the stack (the placement gives it every expert). Kept per
        layer and dtype until the hosted experts or the group change."""
        if x.shape[0] == 0:
            return None
        key = (layer, x.dtype)
        if key not in self._whole:
            self._whole[key] = self._find_whole_stack(layer, x)
        return self._whole[key]

    def _placed_stack(self, layer: int, x: torch.Tensor) -> Optional[tuple]:
        """(the layer's stacked own experts, `BorrowedStack`s of the borrowed experts the
        placement gives this rank: () before any shrink) when a grouped GEMM runs for `x`'s
        dtype and device and every placed expert is stacked: every row the fixed-capacity
        dispatch brings is then for one of the stacks. None otherwise (the host-read
        fallback). At EP=1 before a shrink, `_whole_stack`. Built at `rebind` once a shrink
        placed borrowed experts here (their weights restacked: outside the decode step), kept
        per layer and dtype until the hosted experts or the group change."""
        key = (layer, x.dtype, "placed")
        if key not in self._whole:
            mlp = self.layers[layer]
            stack = (self._stack(layer, x) if self._raw_experts(mlp.experts.local_experts[0])
                     else None)
            found = None
            if stack is not None:
                lo, hi = stack.first, stack.first + stack.count
                ids = sorted(e for e in self.placement.experts_of(self.rank) if not lo <= e < hi)
                borrowed = self._stack_borrowed(layer, ids, lo, hi) if ids else ()
                found = None if borrowed is None else (stack, borrowed)
            self._whole[key] = found
        return self._whole[key]

    def _stack_borrowed(self, layer: int, ids: list[int], lo: int, hi: int) -> Optional[tuple]:
        """The borrowed experts `ids` of a layer (outside its own stack's range lo .. hi-1) as
        one `BorrowedStack` below the range and one above (either may be absent); their
        modules' weights move into the stacks (no second copy). None: some are not raw."""
        from flexfloor.model import stack_experts

        hosted = self.hosted[layer]
        if any(e not in hosted or not self._raw_experts(hosted[e]) for e in ids):
            return None
        own = self.layers[layer].experts.local_experts[0].linear_fc1.weight
        transposed = own.stride() == (1, own.shape[0])  # the own stack's layout
        out = []
        with torch.inference_mode(False), torch.no_grad():
            for part in ([e for e in ids if e < lo], [e for e in ids if e >= hi]):
                if not part:
                    continue
                modules = [hosted[e] for e in part]
                stack_experts(modules, transposed=transposed)
                weights = {name: stacked_weights([getattr(m, name).weight for m in modules])
                           for name in ("linear_fc1", "linear_fc2")}
                if any(w is None for w in weights.values()):
                    return None
                out.append(BorrowedStack(tuple(part), weights,
                                         torch.tensor(part, device=self.device)))
        return tuple(out)

    def _find_whole_stack(self, layer: int, x: torch.Tensor) -> Optional["ExpertStack"]:
        mlp = self.layers[layer]
        if (len(self.hosted[layer]) != self.num_experts
                or len(mlp.local_expert_indices) != self.num_experts
                or not self._raw_experts(mlp.experts.local_experts[0])):
            return None
        return self._stack(layer, x)

    def grouped_layers(self, dtype: torch.dtype) -> int:
        """Layers whose own experts run as grouped GEMMs for rows of `dtype` (the rest: one GEMM
        per expert). Benchmarks report it."""
        probe = torch.empty(0, dtype=dtype, device=self.device)
        return sum(self._stack(li, probe) is not None for li in range(len(self.layers)))

    def _stack(self, layer: int, rows: torch.Tensor) -> Optional["ExpertStack"]:
        """The layer's own experts as stacked weights, when they are stored stacked and a
        grouped GEMM runs for these rows' dtype and device (else None: one GEMM per expert)."""
        if not _grouped_mm_runs(rows.device, rows.dtype):
            return None
        if layer not in self._stacks:
            self._stacks[layer] = self._build_stack(layer)
        return self._stacks[layer]

    def _build_stack(self, layer: int) -> Optional["ExpertStack"]:
        # views created outside inference mode: they outlive the rollout step that asks first
        with torch.inference_mode(False), torch.no_grad():
            mlp = self.layers[layer]
            ids = list(mlp.local_expert_indices)
            experts = list(mlp.experts.local_experts)
            fc1 = stacked_weights([m.linear_fc1.weight for m in experts])
            fc2 = stacked_weights([m.linear_fc2.weight for m in experts])
            contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
            if fc1 is None or fc2 is None or not contiguous:
                return None
            return ExpertStack(ids[0], len(ids), {"linear_fc1": fc1, "linear_fc2": fc2})

    @staticmethod
    def _project(x: torch.Tensor, groups, per_expert: list[int], stack: Optional["ExpertStack"],
                 name: str, kernels: bool = True) -> torch.Tensor:
        """One projection (`name`) of every expert's rows of x (sorted by expert): the stacked
        experts' rows in one grouped GEMM, the others one raw GEMM each, in expert order;
        `kernels`: FlexFloor's CPU kernel where it runs (`_grouped_mm`)."""
        if stack is None:
            return torch.cat([_expert_linear(x[s:s + n], getattr(m, name).weight, kernels)
                              for _, m, s, n in groups])
        first, count = stack.first, stack.count
        inside = [g for g in groups if first <= g[0] < first + count]
        before = [g for g in groups if g[0] < first]
        after = [g for g in groups if g[0] >= first + count]
        parts = [_expert_linear(x[s:s + n], getattr(m, name).weight, kernels)
                 for _, m, s, n in before]
        if inside:
            lo = inside[0][2]
            hi = inside[-1][2] + inside[-1][3]
            counts = torch.tensor(per_expert[first:first + count], dtype=torch.int32)
            offs = counts.cumsum(0, dtype=torch.int32).to(x.device)
            parts.append(_grouped_mm(x[lo:hi], stack.operands[name], offs, kernels=kernels))
        parts += [_expert_linear(x[s:s + n], getattr(m, name).weight, kernels)
                  for _, m, s, n in after]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _raw_experts(self, module) -> bool:
        """Whether Megatron's `MLP.forward` of these experts runs as raw ops (no biases, no
        fused activation kernel); every hosted expert of a layer is built alike."""
        return (module.linear_fc1.bias is None and module.linear_fc2.bias is None
                and not self._fused_activation)

    @staticmethod
    def _activation(cfg, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Megatron's `MLP.forward` between fc1 and fc2 (h [n, F or 2F], p [n]): GLU activation,
        then the scaling by the routing probability (same order, same math)."""
        if cfg.gated_linear_unit:
            a, b = torch.chunk(h, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                a, b = a.clamp(min=None, max=val), b.clamp(min=-val, max=val)
            if cfg.glu_linear_offset:  # adding 0.0 changes no value that reaches the output
                b = b + cfg.glu_linear_offset
            h = cfg.activation_func(a) * b
        else:
            h = cfg.activation_func(h)
        out = h * p.unsqueeze(-1)
        return out if out.dtype == h.dtype else out.to(h.dtype)

    def combine(self, layer: int, handle: "Dispatched", rows: torch.Tensor) -> torch.Tensor:
        """Expert outputs back to their tokens (one all-to-all), then one scatter into [T, k, H]
        and a sum over k in ascending expert order (k > 2; two terms add alike in either
        order): the same whatever rank computed them."""
        if handle.back_index is not None:  # fixed slabs back; each sorted pair's row of them
            back = exchange_rows_back(rows, None, None, self.group).index_select(
                0, handle.back_index).masked_fill_(handle.pair_pad, 0.0)
        elif handle.send_splits is None:
            back = rows
        else:
            back = exchange_rows_back(rows, handle.send_splits, handle.recv_splits, self.group)
        t = handle.order.numel() // self.topk
        mlp = self.layers[layer]
        if t == 0:
            return back.new_empty(0, self.hidden)
        slots = torch.empty_like(back).index_copy_(0, handle.order, back).view(
            t, self.topk, self.hidden)  # [T, k, H]
        # two terms: one add, the same value as the sum (its reduction over a middle dim costs more)
        out = slots[:, 0] + slots[:, 1] if self.topk == 2 else slots.sum(dim=1)
        if mlp.use_shared_expert:
            x = handle.x
            out = out + mlp.shared_experts(x.view(t, 1, self.hidden)).view(t, self.hidden)
        return out


def _count(key: torch.Tensor, n: int) -> torch.Tensor:
    """[n] occurrences of each value 0..n-1 in key (int64): `torch.bincount(key, minlength=n)`
    with a shape fixed by n (bincount's grows with the largest value: a host read on CUDA)."""
    return torch.zeros(n, dtype=torch.long, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))


# ------------------------------------------------------------------------------------------------
# the router as raw ops


def _plain_topk_router(router) -> bool:
    """Whether Megatron's `TopKRouter.forward` in eval reduces to gating -> score function ->
    top-k -> normalisation -> scaling (`_raw_topk`): no sinkhorn, grouped top-k, token dropping,
    input jitter, forced balancing, fused kernel, replay or transformer-engine GEMM."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    if type(router) is not TopKRouter or router.training:
        return False
    cfg = router.config
    return (router.routing_type != "sinkhorn" and not cfg.moe_router_group_topk
            and cfg.moe_expert_capacity_factor is None and cfg.moe_input_jitter_eps is None
            and not cfg.moe_router_force_load_balancing and not cfg.moe_router_fusion
            and getattr(router, "router_replay", None) is None
            and router.score_function in ("softmax", "sigmoid")
            and (getattr(moe_utils, "te_general_gemm", None) is None
                 or cfg.moe_router_dtype == "fp64"))


def _softmax_fp32(t: torch.Tensor) -> torch.Tensor:
    """Megatron's `torch.softmax(t, dim=-1, dtype=torch.float32).type_as(t)`, without the two
    casts (no-ops in value) where t is float32 already."""
    if t.dtype == torch.float32:
        return torch.softmax(t, dim=-1)
    return torch.softmax(t, dim=-1, dtype=torch.float32).type_as(t)


def _raw_topk(router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's `router_gating_linear` + `topk_routing_with_score_function` (x [T, H]) as raw
    ops: returns the top-k probabilities and expert indices [T, k] x2, in top-k order."""
    cfg, k = router.config, router.topk
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(cfg.moe_router_dtype, x.dtype)
    w = router.weight
    w = w if w.dtype == dtype else w.to(dtype)
    x = x if x.dtype == dtype else x.to(dtype)
    if router.bias is None:
        logits = F.linear(x, w)  # [T, E]: x @ w.t() in one call
    else:
        logits = torch.addmm(router.bias.to(dtype), x, w.t())
    if router.score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            probs, top = torch.topk(_softmax_fp32(logits), k=k, dim=1)
        else:
            scores, top = torch.topk(logits, k=k, dim=1)
            probs = _softmax_fp32(scores)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if router.expert_bias is not None:
            router._maintain_float32_expert_bias()
            _, top = torch.topk(scores + router.expert_bias, k=k, dim=1)
            scores = torch.gather(scores, dim=1, index=top).type_as(logits)
        else:
            scores, top = torch.topk(scores, k=k, dim=1)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else scores
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    return probs, top
