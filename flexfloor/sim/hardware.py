"""Accelerators, clusters and model shapes for the simulator: published figures, no measurement.

Figures are the vendors' data-sheet peaks (dense BF16 tensor FLOP/s, HBM bandwidth and size,
NVLink bandwidth per GPU and direction) and the usual per-GPU network injection of clusters built
with them (one 400 Gb/s NIC per H100/H800/H200, 200 Gb/s per A100). `CostParams` (flexfloor/sim/
cost.py) holds the efficiency factors that turn peaks into achieved rates.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense tensor-core peak
    nvlink_bytes_per_s: float  # per GPU, one direction
    network_bytes_per_s: float  # per GPU, one direction, across nodes
    gpus_per_node: int = 8


UNIT_ACCELERATOR = "unit"  # sim.cost's `cost_model` name for UnitCost: every step 1, a shrink 0

ACCELERATORS: dict[str, Accelerator] = {
    "H100": Accelerator("NVIDIA H100 SXM5 80GB", 80 * GiB, 3.35e12, 989e12, 450e9, 50e9),
    # the export part: H100 compute and HBM, NVLink cut to 400 GB/s (both directions)
    "H800": Accelerator("NVIDIA H800 SXM5 80GB", 80 * GiB, 3.35e12, 989e12, 200e9, 50e9),
    "H200": Accelerator("NVIDIA H200 SXM5 141GB", 141 * GiB, 4.8e12, 989e12, 450e9, 50e9),
    "A100": Accelerator("NVIDIA A100 SXM4 80GB", 80 * GiB, 2.039e12, 312e12, 300e9, 25e9),
}


@dataclass(frozen=True)
class ModelShape:
    """What the cost and memory models need of a MoE model (bf16 weights and KV by default)."""

    name: str
    num_layers: int
    hidden_size: int
    num_experts: int
    topk: int
    expert_params: int  # one routed expert, one layer
    dense_params: int  # everything a data-parallel attention rank holds besides routed experts
    kv_bytes_per_token: int  # K and V over all layers
    attention_flops_per_ctx_token: int  # per new token, per cached token (QK^T and PV, all layers)
    dtype_bytes: int = 2
    embedding_params: int = 0  # the input embedding, in dense_params: a step reads one row a token

    @property
    def expert_bytes(self) -> int:
        """One routed expert over all layers (what moves when a rank releases it)."""
        return self.expert_params * self.num_layers * self.dtype_bytes

    @property
    def dense_bytes(self) -> int:
        return self.dense_params * self.dtype_bytes

    @property
    def dense_read_bytes(self) -> int:
        """Dense weights a decode step reads: all but the input embedding."""
        return (self.dense_params - self.embedding_params) * self.dtype_bytes

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params * self.num_layers * self.num_experts

    @classmethod
    def from_preset(cls, name: str, presets: dict | None = None) -> "ModelShape":
        """The shape of a FlexFloor model preset (flexfloor.config.MODEL_PRESETS), or
        `deepseek-v3` (not a trainable preset here: its MLA attention is given as totals)."""
        if name == "deepseek-v3":
            return DEEPSEEK_V3
        if presets is None:
            from flexfloor.config import MODEL_PRESETS as presets
        if name not in presets:
            raise ValueError(f"unknown model {name!r}; choose one of "
                             f"{sorted([*presets, 'deepseek-v3'])}")
        return cls.from_config(name, presets[name])

    @classmethod
    def from_config(cls, name: str, p: dict, dtype_bytes: int = 2) -> "ModelShape":
        layers, hidden = p["num_layers"], p["hidden_size"]
        heads, groups = p["num_attention_heads"], p["num_query_groups"]
        head_dim = p.get("kv_channels") or hidden // heads
        attention = hidden * heads * head_dim * 2 + hidden * groups * head_dim * 2  # q, o, k, v
        shared = 3 * hidden * (p.get("shared_expert_ffn_hidden_size") or 0)
        router = hidden * p["num_experts"]
        dense = layers * (attention + shared + router) + 2 * p["vocab_size"] * hidden
        return cls(
            name=name, num_layers=layers, hidden_size=hidden, num_experts=p["num_experts"],
            topk=p["moe_router_topk"], expert_params=3 * hidden * p["moe_ffn_hidden_size"],
            dense_params=dense, kv_bytes_per_token=2 * layers * groups * head_dim * dtype_bytes,
            attention_flops_per_ctx_token=4 * layers * heads * head_dim, dtype_bytes=dtype_bytes,
            embedding_params=p["vocab_size"] * hidden,
        )


# DeepSeek-V3-sized (671B total, 37B active): 61 layers (58 MoE), 256 routed experts of width
# 2048, top-8, one shared expert; MLA caches a 512 + 64 latent per token and layer. The three
# dense layers and the shared experts are counted in dense_params, spread over all 61 layers as an
# approximation.
DEEPSEEK_V3 = ModelShape(
    name="deepseek-v3", num_layers=61, hidden_size=7168, num_experts=256, topk=8,
    expert_params=3 * 7168 * 2048 * 58 // 61, dense_params=16_500_000_000,
    kv_bytes_per_token=61 * (512 + 64) * 2, attention_flops_per_ctx_token=4 * 61 * 128 * (512 + 64),
    embedding_params=129280 * 7168,
)
