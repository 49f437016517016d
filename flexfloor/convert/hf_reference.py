"""The `transformers` side of the peer comparison: tiny random models of each family, greedy
decoding. Used by tests/workers/convert.py and tools/bench_vs_hf.py; needs `transformers`.

A tiny model is built from its config class (no download) and every weight is redrawn, norms
included (around 1, not exactly 1), so a swapped or missing tensor changes the logits.
"""

from __future__ import annotations

import time

import torch

# Small shapes that still exercise what differs between families: GQA (2 query groups), an
# explicit head_dim unequal to hidden/heads (Qwen3), renormalised top-k or not (OLMoE).
_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
TINY = {
    "mixtral": dict(_COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                    rope_theta=1e6),
    "qwen3_moe": dict(_COMMON, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                      num_experts_per_tok=2, head_dim=32, norm_topk_prob=True),
    "olmoe": dict(_COMMON, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=False),
}


# `small`: the same families 4x wider, 2x deeper, 8x the vocabulary (benchmarks)
SMALL_SCALE = dict(hidden_size=4, intermediate_size=4, moe_intermediate_size=4, head_dim=2,
                   num_hidden_layers=2, vocab_size=8)


def tiny_hf_model(family: str, seed: int = 0, dtype=torch.float32, *, size: str = "tiny"):
    """A randomly initialised `transformers` model of `family` (an HF model_type)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY[family])
    if size == "small":
        kw.update({k: kw[k] * f for k, f in SMALL_SCALE.items() if k in kw})
    theta = kw.pop("rope_theta", 10000.0)
    config = AutoConfig.for_model(family, **kw)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(noise * (0.3 if name.endswith("gate.weight") else 0.05))
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy continuation of each prompt (one at a time: no padding), and the decode seconds."""
    out, seconds = [], 0.0
    for p in prompts:
        ids = torch.tensor([p])
        t0 = time.perf_counter()
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=model.config.pad_token_id)
        seconds += time.perf_counter() - t0
        out.append(seq[0, len(p):].tolist())
    return out, seconds
