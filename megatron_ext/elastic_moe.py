"""MoE layers routed by placement, re-bindable to a new EP group at run time.

Megatron-Core's `MoELayer` gives EP rank i a contiguous block of experts fixed when the layer is
built, and its dispatcher derives all-to-all splits from that layout; it also cannot take a step
with zero tokens. `PlacedMoE` runs the same layers' own router, experts and shared experts, but
sends each (token, expert) pair to the rank that the current `Placement` names, so any expert ->
rank map works (8 experts on 3 ranks, 6 on 4), a rank with no tokens still takes part in every
exchange, and `rebind()` switches to a new group and placement without rebuilding the model.

Per layer and step, over the EP group: one all-to-all of per-expert counts, one of token rows with
their routing probabilities (router dtype, bytes appended to each row), one of expert outputs back;
none on a group of one rank. Each token's output is the
sum of its top-k expert outputs in ascending expert order, whatever rank computed them, so the
result does not depend on the placement.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.placement import Placement


class PlacementError(RuntimeError):
    pass


def _all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def _exchange_rows(x: torch.Tensor, p: torch.Tensor, recv_splits, send_splits, group):
    """Token rows and their routing probabilities in one all-to-all: each row's bytes with its
    probability's bytes appended (exact whatever the two dtypes)."""
    n = x.shape[0]
    w = x.shape[1:].numel() * x.element_size()
    xb = x.contiguous().view(torch.uint8).reshape(n, w)
    pb = p.contiguous().view(torch.uint8).reshape(n, p.element_size())
    both = _all_to_all(torch.cat([xb, pb], dim=1), recv_splits, send_splits, group)
    rx = both[:, :w].contiguous().view(x.dtype).reshape(-1, *x.shape[1:])
    rp = both[:, w:].contiguous().view(p.dtype).reshape(-1)
    return rx, rp


def _clone(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of an expert module that shares (does not copy) its process groups."""
    memo = {}
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, dist.ProcessGroup):
                memo[id(v)] = v
    return copy.deepcopy(module, memo)


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
        # routing probabilities travel in the router's dtype (fp64 for fp64 models)
        self.prob_dtype = torch.float64 if model.config.moe_router_dtype == "fp64" else torch.float32
        self.hosted: list[dict[int, torch.nn.Module]] = [
            {e: m for e, m in zip(mlp.local_expert_indices, mlp.experts.local_experts)}
            for mlp in self.layers
        ]
        self.group: Optional[dist.ProcessGroup] = None
        self.placement: Optional[Placement] = None
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
        self._owner_index = torch.tensor([placement.group_index(r) for r in placement.owner])

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

    def drop_borrowed(self) -> None:
        """Forget every hosted expert that is not one of the model's own (resync)."""
        for mlp, hosted in zip(self.layers, self.hosted):
            own = set(mlp.local_expert_indices)
            for e in [e for e in hosted if e not in own]:
                del hosted[e]

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's weights over all layers (what hosting a borrowed one costs)."""
        return sum(sum(p.nbytes for p in next(iter(h.values())).parameters()) for h in self.hosted)

    def expert_state(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's weights by parameter name (what a transfer moves)."""
        return {n: p.detach() for n, p in self.hosted[layer][expert].named_parameters()}

    # ---------------------------------------------------------------- forward

    @torch.no_grad()
    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, 1, H] (T may be 0) -> MoE output [T, 1, H]. Collective over the group."""
        mlp = self.layers[layer]
        group, owner_index = self.group, self._owner_index
        size = dist.get_world_size(group)
        x = hidden.reshape(-1, self.hidden)
        t = x.shape[0]
        counts = torch.zeros(size, self.num_experts, dtype=torch.int64)
        if t:
            probs, routing_map = mlp.router(x.view(t, 1, self.hidden))  # [T, E], [T, E] bool
            tok, exp = routing_map.nonzero(as_tuple=True)  # token-major, experts ascending
            if tok.numel() != t * self.topk:
                raise PlacementError(f"router chose {tok.numel()} (token, expert) pairs for {t} tokens "
                                     f"with top-{self.topk}: token dropping is not supported")
            dest = owner_index[exp]
            order = torch.argsort(dest * (self.num_experts * t) + exp * t + tok)
            counts.index_put_((dest, exp), torch.ones_like(exp), accumulate=True)
            send_x = x[tok[order]]
            send_p = probs[tok[order], exp[order]].to(self.prob_dtype)
        else:
            order = torch.empty(0, dtype=torch.long)
            send_x = x
            send_p = torch.empty(0, dtype=self.prob_dtype)
        send_splits = counts.sum(1).tolist()
        if size == 1:  # a lone rank (EP=1, or the last survivor): nothing to exchange
            recv_counts, recv_splits, recv_x, recv_p = counts, send_splits, send_x, send_p
        else:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=group)  # [source, expert]
            recv_splits = recv_counts.sum(1).tolist()
            recv_x, recv_p = _exchange_rows(send_x, send_p, recv_splits, send_splits, group)

        row_expert = torch.repeat_interleave(
            torch.arange(self.num_experts).repeat(size), recv_counts.view(-1)
        )
        out_rows = torch.empty_like(recv_x)
        for e, module in sorted(self.hosted[layer].items()):
            idx = (row_expert == e).nonzero(as_tuple=True)[0]
            if idx.numel():
                y, _ = module(recv_x[idx], recv_p[idx])
                out_rows[idx] = y
        if recv_x.shape[0] and not set(row_expert.unique().tolist()) <= set(self.hosted[layer]):
            raise PlacementError(f"rank {self.rank} received tokens for experts it does not host")
        back = out_rows if size == 1 else _all_to_all(out_rows, send_splits, recv_splits, group)

        if t == 0:
            return hidden
        rows = torch.empty_like(back)
        rows[order] = back
        out = rows.view(t, self.topk, self.hidden).sum(dim=1)
        if mlp.use_shared_expert:
            out = out + mlp.shared_experts(x.view(t, 1, self.hidden)).view(t, self.hidden)
        return out.view(t, 1, self.hidden)
