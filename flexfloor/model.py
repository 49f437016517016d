"""Build Megatron-Core's `GPTModel` with MoE layers from a `ModelConfig`.

On CPU the local spec (`SequentialMLP` experts, torch norms); on GPU the transformer-engine spec
when transformer-engine imports. The same weights serve the trainer and the rollout engine.

Weights are initialised by a pure function of (seed, parameter name), with expert parameters named
by their *global* expert id, so a model built at EP=1, 2 or 4 holds exactly the same numbers:
layouts can be compared bit for bit and re-sharded without a checkpoint round trip.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from flexfloor.config import QKNorm
from megatron_ext import cpu_compat

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def transformer_config(model_cfg, *, ep_size: int, params_dtype: Optional[str] = None):
    """Megatron-Core `TransformerConfig` for the model section of a FlexFloor config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype_name = params_dtype or model_cfg.params_dtype
    if dtype_name not in DTYPES:
        raise ValueError(
            f"model.params_dtype={dtype_name!r} is not supported; use one of {sorted(DTYPES)}"
        )
    dtype = DTYPES[dtype_name]
    if model_cfg.num_experts % ep_size != 0:
        raise ValueError(
            f"model.num_experts={model_cfg.num_experts} is not divisible by the training EP size "
            f"{ep_size}: the training layout gives each rank the same number of experts; set "
            "parallel.expert_parallel_size to a divisor of model.num_experts"
        )
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.kv_channels,
        num_moe_experts=model_cfg.num_experts,
        moe_router_topk=model_cfg.moe_router_topk,
        moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model_cfg.shared_expert_ffn_hidden_size,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if model_cfg.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_router_dtype="fp64" if dtype == torch.float64 else "fp32",
        # softmax over all experts then top-k (no renormalisation) vs top-k logits then softmax
        moe_router_pre_softmax=not model_cfg.moe_router_norm_topk,
        qk_layernorm=model_cfg.qk_norm != QKNorm.NONE,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=model_cfg.init_method_std,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # initialize_weights() does it, layout-independently
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        moe_permute_fusion=False,
    )


class FullWidthRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over all heads of a token at once (OLMoE's q/k norm), weight [heads * head_dim].

    Megatron applies q/k norms to [S, B, heads, head_dim] and builds them with hidden_size =
    head_dim (a per-head norm, as Qwen3 has); `heads` widens this one to the whole projection.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, heads: int):
        super().__init__(heads * hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


def layer_spec(model_cfg, *, use_te: Optional[bool] = None):
    """The transformer layer spec: transformer-engine on GPU when available, local otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    if use_te is None:
        use_te = have_transformer_engine()
    qk = model_cfg.qk_norm != QKNorm.NONE
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model_cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=qk
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=model_cfg.num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
            qk_layernorm=qk,
        )
    if model_cfg.qk_norm == QKNorm.FULL_WIDTH:
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = ModuleSpec(module=FullWidthRMSNorm,
                                      params={"heads": model_cfg.num_attention_heads})
        attn.k_layernorm = ModuleSpec(module=FullWidthRMSNorm,
                                      params={"heads": model_cfg.num_query_groups})
    return spec


def build_model(model_cfg, parallel, *, params_dtype: Optional[str] = None, use_te=None,
                post_process: bool = True):
    """A `GPTModel` on `parallel.device` with experts sharded over `parallel`'s EP group.

    `post_process=False` gives the trunk only (hidden states after the last layer, before the
    final norm and the output layer): the body of a critic."""
    from megatron.core.models.gpt import GPTModel

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_compat.apply()
    ep_group_size = parallel.pg_collection.ep.size()
    if ep_group_size != parallel.ep_size:
        # Megatron-Core never compares expert_model_parallel_size with the group it is handed
        raise ValueError(
            f"the EP group passed to the model has {ep_group_size} ranks but the configured EP size "
            f"is {parallel.ep_size} (parallel.expert_parallel_size); build both from one Parallel"
        )
    # Dropout is 0 everywhere, so the tracker only has to exist; on CPU the inference tracker
    # avoids CUDA RNG states altogether.
    model_parallel_cuda_manual_seed(
        model_cfg.seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True
    )
    config = transformer_config(model_cfg, ep_size=parallel.ep_size, params_dtype=params_dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model_cfg, use_te=use_te),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_seq_len,
        pre_process=True,
        post_process=post_process,
        parallel_output=False,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=model_cfg.rotary_base,
        pg_collection=parallel.pg_collection,
    ).to(parallel.device)
    num_local = model_cfg.num_experts // parallel.ep_size
    first = parallel.ep_rank * num_local
    initialize_weights(
        model,
        seed=model_cfg.seed,
        num_layers=model_cfg.num_layers,
        std=model_cfg.init_method_std,
        local_expert_ids=list(range(first, first + num_local)),
    )
    stack_expert_weights(model)
    return model


def stack_expert_weights(model) -> None:
    """Store each layer's local expert weights as one stacked tensor per projection
    (`stack_experts`), so the rollout's expert GEMMs can run grouped over the stack
    (`megatron_ext.elastic_moe.stacked_weights`) on the trainer's own weights. Only the storage
    moves: the parameters stay the same objects, so call it before the optimizer and DDP wrap
    them (as `build_model` does); values are unchanged. Megatron's own linears get the stack
    [experts, in, out]; others (transformer-engine's, whose kernels may want their weight
    row-major) [experts, out, in]."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for layer in model.decoder.layers:
        experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None)
        if experts:
            plain = all(type(e.linear_fc1) is ColumnParallelLinear
                        and type(e.linear_fc2) is RowParallelLinear for e in experts)
            stack_experts(experts, transposed=plain)


def stack_experts(experts, *, transposed: bool = True) -> None:
    """Every expert's `linear_fc1.weight` [F', H] becomes a view of one stacked tensor, in the
    given order (likewise `linear_fc2`); the parameter keeps its shape [out, in] and its
    values. `transposed`: the stack is [experts, H, F'] and each parameter its transposed view
    (strides (1, out)): a GEMM of a few rows with the weight [in, out] row-major is the layout
    this CPU's sgemm runs fastest (the rollout's grouped expert GEMMs, and training's
    F.linear alike: `x @ W.t()` with W.t() contiguous); code that needs a weight flat takes
    `.contiguous()` or `reshape`. Else the stack is [experts, F', H], each parameter row-major."""
    for name in ("linear_fc1", "linear_fc2"):
        params = [getattr(e, name).weight for e in experts]
        if transposed:
            stacked = torch.stack([p.detach().t() for p in params])  # [experts, in, out]
            for p, view in zip(params, stacked):
                p.data = view.t()  # [out, in], strides (1, out)
        else:
            stacked = torch.stack([p.detach() for p in params])  # [experts, out, in]
            for p, view in zip(params, stacked):
                p.data = view


def global_param_name(name: str, local_expert_ids: Sequence[int]) -> str:
    """The layout-independent name of a parameter: local expert index -> global expert id."""

    def to_global(m: re.Match) -> str:
        return f".experts_global.{local_expert_ids[int(m.group(1))]}."

    return _LOCAL_EXPERT.sub(to_global, name)


@torch.no_grad()
def initialize_weights(
    model: torch.nn.Module,
    *,
    seed: int,
    num_layers: int,
    std: float,
    local_expert_ids: Sequence[int],
) -> None:
    """Deterministic, layout-independent init: each tensor from its own seeded generator.

    Norm weights are ones; output projections (`linear_proj`, `linear_fc2`) use Megatron's scaled
    std / sqrt(2 * num_layers); every other matrix normal(0, std).
    """
    scaled_std = std / math.sqrt(2.0 * num_layers)
    for name, param in model.named_parameters():
        gname = global_param_name(name, local_expert_ids)
        if any("norm" in part for part in name.split(".")[-2:]):
            param.fill_(1.0)
            continue
        if name.endswith(".bias"):
            param.zero_()
            continue
        sigma = scaled_std if ("linear_proj" in name or "linear_fc2" in name) else std
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{gname}".encode()))
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * sigma
        param.copy_(values.to(param.dtype))


def causal_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Position ids 0..S-1 for a [B, S] token batch."""
    b, s = tokens.shape
    return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Causal LM logits [B, S, V] for tokens [B, S] (no padding: every row is full)."""
    return model(tokens, causal_positions(tokens), attention_mask=None)
