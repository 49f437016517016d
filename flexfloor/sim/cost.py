"""What a lockstep EP step costs, what a release costs, and how much KV cache a rank holds.

A step of the active EP group takes the slowest active rank's time (every MoE layer's all-to-all
waits for all of them), plus a fixed overhead. One rank's time, roofline style (max of the FLOP
time and the bytes time for each part):
- dense part (attention projections, embeddings, shared experts: every rank holds them, data-
  parallel attention) over its own new tokens; nothing when it has none;
- attention over its requests' cached context: KV bytes read, QK^T/PV FLOPs (each new token
  against its own request's context: a decoding request's context, a prompt's triangle);
- the experts it hosts over the tokens routed to them from every active rank: expert GEMM FLOPs,
  and the weight bytes of the hosted experts that receive at least one token (uniform routing:
  an expert is idle with probability (1 - topk/E)^T for T tokens in the step);
- the MoE all-to-all (dispatch + combine, every MoE layer): its tokens' hidden states to the
  ranks hosting their experts, over NVLink inside a node and the network across nodes, plus a
  per-collective latency (larger once the group spans nodes, and growing with its size).
Ranks are packed `gpus_per_node` to a node in rank order. A shrink costs the expert bytes moved
(per-link bandwidth, all transfers in parallel) and a group switch (communicators built ahead,
as DESIGN.md asks, so only the swap).

`UnitCost` prices every step at 1 and a shrink at 0: the simulator then counts engine steps, and
its figures equal the real engine's exactly (tests/test_sim.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from flexfloor.sim.hardware import Accelerator, ModelShape


@dataclass(frozen=True)
class CostParams:
    """Efficiency and overhead assumptions (what a well-tuned decode path achieves)."""

    hbm_efficiency: float = 0.8  # achieved / peak HBM bandwidth
    flop_efficiency: float = 0.5  # achieved / peak tensor FLOP/s in decode-sized GEMMs
    link_efficiency: float = 0.7  # achieved / peak NVLink and network bandwidth
    a2a_latency_intra_s: float = 30e-6  # one dispatch or combine inside a node (NVLink)
    a2a_latency_inter_s: float = 120e-6  # one dispatch or combine across nodes, 64 ranks (RDMA)
    # latency grows with the group (more peers, more messages): x(1 + this * log2(ranks / 64)),
    # i.e. 0.70x at 16 ranks and 1.30x at 256 (DeepEP's published low-latency kernels: about
    # 0.64x at 16 and 1.14x at 256 of their 64-rank figure)
    a2a_latency_per_doubling: float = 0.15
    step_overhead_s: float = 1.5e-3  # sampling, scheduling, launches (CUDA graphs) per step
    switch_s: float = 0.02  # swap to a survivors' communicator built ahead
    hbm_usable_fraction: float = 0.9  # of HBM, the rest for the allocator and the runtime
    activation_reserve_bytes: float = 4 * (1 << 30)  # activations, logits, CUDA graphs


@dataclass
class RankLoad:
    """One active rank in one step."""

    rank: int
    new_tokens: int  # tokens it feeds this step (1 per decoding request, the prompt at prefill)
    context_tokens: int  # cached tokens its requests attend over
    hosted_experts: int
    attention_pairs: float = 0.0  # (new token, cached token) pairs: its context when decoding


class UnitCost:
    """Every step costs 1 and a shrink 0: time is counted in engine steps."""

    unit = "steps"

    def step_seconds(self, loads: Sequence[RankLoad], owner: Sequence[int]) -> float:
        return 1.0

    def shrink_seconds(self, transfers, owner: Sequence[int]) -> float:
        return 0.0


@dataclass
class RooflineCost:
    accel: Accelerator
    model: ModelShape
    params: CostParams = CostParams()

    unit = "s"

    def node(self, rank: int) -> int:
        return rank // self.accel.gpus_per_node

    def step_seconds(self, loads: Sequence[RankLoad], owner: Sequence[int]) -> float:
        """owner: expert -> rank of the current placement (the active group)."""
        a, m, p = self.accel, self.model, self.params
        hbm = a.hbm_bytes_per_s * p.hbm_efficiency
        flops = a.bf16_flops * p.flop_efficiency
        total = sum(x.new_tokens for x in loads)
        E, k = m.num_experts, m.topk
        touched = 1.0 - (1.0 - k / E) ** total if total else 0.0
        nodes = {self.node(x.rank) for x in loads}
        multi_node = len(nodes) > 1
        inter = p.a2a_latency_inter_s * (1 + p.a2a_latency_per_doubling * math.log2(len(loads) / 64))
        latency = max(p.a2a_latency_intra_s, inter) if multi_node else p.a2a_latency_intra_s
        per_node = {}
        for r in owner:
            per_node[self.node(r)] = per_node.get(self.node(r), 0) + 1
        hidden_bytes = m.hidden_size * m.dtype_bytes
        slowest = 0.0
        for x in loads:
            t = 0.0
            if x.new_tokens:
                t += max(2 * m.dense_params * x.new_tokens / flops, m.dense_bytes / hbm)
                t += max(m.attention_flops_per_ctx_token * x.attention_pairs / flops,
                         x.context_tokens * m.kv_bytes_per_token / hbm)
            pairs = total * k * x.hosted_experts / E  # token-expert pairs this rank computes
            t += max(pairs * 2 * m.expert_params * m.num_layers / flops,
                     x.hosted_experts * touched * m.expert_bytes / hbm)
            if len(loads) > 1:
                # its tokens out to the owners (and back): share of experts on other ranks
                mine = x.hosted_experts / E
                same_node = (per_node.get(self.node(x.rank), 0) - x.hosted_experts) / E
                other_node = max(0.0, 1.0 - mine - same_node)
                out_pairs = max(x.new_tokens * k, pairs)  # what it sends or receives, the larger
                intra = out_pairs * same_node * hidden_bytes
                inter = out_pairs * other_node * hidden_bytes
                per_layer = (intra / (a.nvlink_bytes_per_s * p.link_efficiency)
                             + inter / (a.network_bytes_per_s * p.link_efficiency))
                t += 2 * m.num_layers * (per_layer + latency)  # dispatch and combine
            slowest = max(slowest, t)
        return slowest + p.step_overhead_s

    def shrink_seconds(self, transfers, owner: Sequence[int]) -> float:
        """Experts of the leavers to the survivors, all transfers at once; each rank's link
        carries what it sends and receives."""
        a, p = self.accel, self.params
        load: dict[int, float] = {}
        for t in transfers:
            same = self.node(t.src) == self.node(t.dst)
            bw = (a.nvlink_bytes_per_s if same else a.network_bytes_per_s) * p.link_efficiency
            secs = self.model.expert_bytes / bw
            load[t.src] = load.get(t.src, 0.0) + secs
            load[t.dst] = load.get(t.dst, 0.0) + secs
        return max(load.values(), default=0.0) + p.switch_s


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
