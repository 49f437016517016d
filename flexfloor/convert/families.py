"""Hugging Face <-> FlexFloor names, tensors and configs of the MoE families.

One `Family` per HF `model_type` (Mixtral, Qwen3-MoE, OLMoE). `rules()` lists how each Megatron
parameter, named as `flexfloor.model` names it (experts by their *global* id), is made of HF
tensors. `from_hf` and `to_hf` walk the same rules in opposite directions (concatenations one
way, splits of the same sizes the other), so they are inverse by construction and a round trip
is bit for bit. Pure functions of tensors and configs: no files, no process groups.

Megatron's layout, where it differs from HF's:
  linear_qkv   per query group g: [q heads of g, k_g, v_g] rows, HF has q, k, v apart
  linear_fc1   [gate; up] rows (gated linear unit: silu(first half) * second half)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from flexfloor.config import ModelConfig, QKNorm


class ConversionError(ValueError):
    """A checkpoint that does not fit the model it is converted to; the message names tensors."""


Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter <-> the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    pack: Callable[[Tensors], torch.Tensor]  # HF tensors -> Megatron tensor
    unpack: Callable[[torch.Tensor], Tensors]  # Megatron tensor -> HF tensors (new storage)


def _copy_rule(megatron: str, hf: str, shape: tuple[int, ...]) -> Rule:
    return Rule(megatron, (hf,), (shape,), lambda ts: ts[0], lambda t: [t.clone()])


def _fc1_rule(megatron: str, gate: str, up: str, ffn: int, hidden: int) -> Rule:
    return Rule(megatron, (gate, up), ((ffn, hidden),) * 2,
                lambda ts: torch.cat(ts, dim=0),
                lambda t: [x.clone() for x in torch.split(t, ffn, dim=0)])


def _qkv_rule(megatron: str, q: str, k: str, v: str, *, heads: int, groups: int, head_dim: int,
              hidden: int) -> Rule:
    rep = heads // groups

    def pack(ts: Tensors) -> torch.Tensor:
        qq, kk, vv = ts
        per_group = [qq.view(groups, rep * head_dim, hidden), kk.view(groups, head_dim, hidden),
                     vv.view(groups, head_dim, hidden)]
        return torch.cat(per_group, dim=1).reshape(groups * (rep + 2) * head_dim, hidden)

    def unpack(t: torch.Tensor) -> Tensors:
        qq, kk, vv = torch.split(t.view(groups, (rep + 2) * head_dim, hidden),
                                 [rep * head_dim, head_dim, head_dim], dim=1)
        return [x.reshape(-1, hidden).clone() for x in (qq, kk, vv)]

    shapes = ((heads * head_dim, hidden), (groups * head_dim, hidden), (groups * head_dim, hidden))
    return Rule(megatron, (q, k, v), shapes, pack, unpack)


def head_dim_of(cfg: ModelConfig) -> int:
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


# The config values FlexFloor's model does not implement: key -> the only value it supports.
_COMMON_ONLY = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "rope_scaling": None}


@dataclass(frozen=True)
class Family:
    """An HF MoE family: its names, config keys and the features it uses."""

    model_type: str  # HF config.model_type
    architecture: str  # HF config.architectures[0]
    preset: str  # the closest entry of MODEL_PRESETS (the base of the model section)
    moe: str  # HF module of the MoE block in a layer
    expert: tuple[str, str, str]  # HF names of an expert's gate, up and down projections
    qk_norm: QKNorm
    num_experts_key: str  # as the published checkpoints name it (transformers reads either)
    expert_ffn_key: str  # HF key of one expert's width
    norm_topk_key: Optional[str]  # HF key of top-k renormalisation; None: always renormalised
    only: Mapping[str, object] = dataclasses.field(default_factory=dict)  # unsupported features

    # ---------------------------------------------------------------- configs

    def model_config(self, hf: Mapping) -> ModelConfig:
        """The FlexFloor model section for an HF config (validated)."""
        self._check_supported(hf)
        heads = hf["num_attention_heads"]
        groups = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        if self.qk_norm == QKNorm.FULL_WIDTH and head_dim * heads != hf["hidden_size"]:
            raise ConversionError(f"{self.model_type}: head_dim {head_dim} x {heads} heads != "
                                  f"hidden_size {hf['hidden_size']}; its q/k norms assume equality")
        theta = rope_theta(hf)
        if float(theta) != int(theta):
            raise ConversionError(f"rope theta {theta} is not an integer; model.rotary_base is one")
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        fields = dict(
            preset=self.preset,
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            moe_ffn_hidden_size=hf[self.expert_ffn_key],
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            num_experts=hf.get(self.num_experts_key) or hf[_other_experts_key(self.num_experts_key)],
            moe_router_topk=hf["num_experts_per_tok"],
            shared_expert_ffn_hidden_size=None,
            vocab_size=hf["vocab_size"],
            max_seq_len=hf["max_position_embeddings"],
            rotary_base=int(theta),
            norm_epsilon=float(hf["rms_norm_eps"]),
            params_dtype=str(dtype).replace("torch.", ""),
            qk_norm=self.qk_norm.value,
            moe_router_norm_topk=bool(hf[self.norm_topk_key]) if self.norm_topk_key else True,
        )
        return model_config_from_dict(fields)

    def hf_config(self, cfg: ModelConfig, base: Optional[Mapping] = None) -> dict:
        """An HF config.json for `cfg`: `base` (the source checkpoint's config, if any) with every
        key that describes the model set from `cfg`; values that already agree are kept as they
        are (10000.0 stays a float), so HF -> FlexFloor -> HF gives back the same config."""
        if cfg.qk_norm != self.qk_norm:
            raise ConversionError(f"model.qk_norm={cfg.qk_norm.value} but {self.model_type} has "
                                  f"{self.qk_norm.value} q/k norms: this model was not built as "
                                  f"{self.model_type}; {_family_with(cfg.qk_norm)}")
        if self.norm_topk_key is None and not cfg.moe_router_norm_topk:
            raise ConversionError(f"{self.model_type} always renormalises the top-k router "
                                  "probabilities; model.moe_router_norm_topk must be true")
        if cfg.shared_expert_ffn_hidden_size:
            raise ConversionError(f"{self.model_type} has no shared experts; "
                                  "model.shared_expert_ffn_hidden_size must be null")
        out = dict(base or {})
        want = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            self.expert_ffn_key: cfg.moe_ffn_hidden_size,  # Mixtral, OLMoE: the same key, wins
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups,
            "head_dim": head_dim_of(cfg),
            self._experts_key(out): cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_epsilon,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }
        if self.norm_topk_key:
            want[self.norm_topk_key] = cfg.moe_router_norm_topk
        if not out.get("head_dim") and head_dim_of(cfg) * cfg.num_attention_heads == cfg.hidden_size:
            del want["head_dim"]  # implied by hidden_size / heads, as the source left it
        for key, value in want.items():
            if out.get(key) != value:
                out[key] = value
        if "rope_theta" in out and "rope_parameters" not in out:  # transformers 4.x layout
            if out["rope_theta"] != cfg.rotary_base:
                out["rope_theta"] = cfg.rotary_base
        else:
            rope = dict(out.get("rope_parameters") or {"rope_type": "default"})
            if rope.get("rope_theta") != cfg.rotary_base:
                rope["rope_theta"] = cfg.rotary_base
            out["rope_parameters"] = rope
        dtype_key = "torch_dtype" if "torch_dtype" in out and "dtype" not in out else "dtype"
        out[dtype_key] = cfg.params_dtype
        return out

    def _experts_key(self, base: Mapping) -> str:
        other = _other_experts_key(self.num_experts_key)
        return other if other in base and self.num_experts_key not in base else self.num_experts_key

    def _check_supported(self, hf: Mapping) -> None:
        if hf.get("model_type") != self.model_type:
            raise ConversionError(f"config.json has model_type {hf.get('model_type')!r}, "
                                  f"expected {self.model_type!r}")
        only = {**_COMMON_ONLY, **self.only}
        bad = [f"{k}={hf[k]!r} (supported: {v!r})" for k, v in only.items()
               if k in hf and hf[k] != v and not (v is None and not hf[k])]
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            bad.append(f"rope_parameters.rope_type={rope['rope_type']!r} (supported: 'default')")
        if bad:
            raise ConversionError(f"{self.model_type} checkpoint uses features FlexFloor's model "
                                  f"does not implement: {', '.join(bad)}")

    # ---------------------------------------------------------------- tensors

    def rules(self, cfg: ModelConfig, expert_ids: Iterable[int], *, dense: bool = True) -> list[Rule]:
        """Rules for the experts `expert_ids` of every layer, plus (dense=True) every parameter
        that is not an expert's."""
        h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.moe_ffn_hidden_size
        heads, groups, hd = cfg.num_attention_heads, cfg.num_query_groups, head_dim_of(cfg)
        out: list[Rule] = []
        if dense:
            out.append(_copy_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                                  (v, h)))
        for i in range(cfg.num_layers):
            m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            if dense:
                a = p + "self_attn."
                out += [
                    _copy_rule(m + "input_layernorm.weight", p + "input_layernorm.weight", (h,)),
                    _qkv_rule(m + "self_attention.linear_qkv.weight", a + "q_proj.weight",
                              a + "k_proj.weight", a + "v_proj.weight", heads=heads,
                              groups=groups, head_dim=hd, hidden=h),
                    _copy_rule(m + "self_attention.linear_proj.weight", a + "o_proj.weight",
                               (h, heads * hd)),
                    _copy_rule(m + "pre_mlp_layernorm.weight", p + "post_attention_layernorm.weight",
                               (h,)),
                    _copy_rule(m + "mlp.router.weight", p + self.moe + ".gate.weight",
                               (cfg.num_experts, h)),
                ]
                if self.qk_norm != QKNorm.NONE:
                    wide = self.qk_norm == QKNorm.FULL_WIDTH
                    out += [
                        _copy_rule(m + "self_attention.q_layernorm.weight", a + "q_norm.weight",
                                   (heads * hd if wide else hd,)),
                        _copy_rule(m + "self_attention.k_layernorm.weight", a + "k_norm.weight",
                                   (groups * hd if wide else hd,)),
                    ]
            gate, up, down = self.expert
            for e in expert_ids:
                me, pe = f"{m}mlp.experts.experts_global.{e}.", f"{p}{self.moe}.experts.{e}."
                out += [
                    _fc1_rule(me + "linear_fc1.weight", f"{pe}{gate}.weight", f"{pe}{up}.weight",
                              f, h),
                    _copy_rule(me + "linear_fc2.weight", f"{pe}{down}.weight", (h, f)),
                ]
        if dense:
            out += [
                _copy_rule("decoder.final_layernorm.weight", "model.norm.weight", (h,)),
                _copy_rule("output_layer.weight", "lm_head.weight", (v, h)),
            ]
        return out

    def check_hf_shapes(self, shapes: Mapping[str, Sequence[int]], cfg: ModelConfig) -> None:
        """Every tensor the model needs is there with its shape, and nothing else is: one error
        naming every offending tensor, before anything is read or written."""
        want = {k: s for r in self.rules(cfg, range(cfg.num_experts)) for k, s in zip(r.hf, r.hf_shapes)}
        have = {k: tuple(s) for k, s in shapes.items() if not k.endswith("rotary_emb.inv_freq")}
        problems = [f"{k}: checkpoint shape {list(have[k])}, model expects {list(s)}"
                    for k, s in want.items() if k in have and have[k] != s]
        missing = sorted(set(want) - set(have))
        unexpected = sorted(set(have) - set(want))
        if missing:
            problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:8])}")
        if unexpected:
            problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:8])}")
        if not problems:
            return
        hint = ""
        emb = have.get("model.embed_tokens.weight")
        if emb is not None and emb[0] != cfg.vocab_size:
            hint = (f"; the vocabulary differs: model.embed_tokens.weight has {emb[0]} rows, "
                    f"model.vocab_size is {cfg.vocab_size} (use the checkpoint's own config.json, "
                    "or set model.vocab_size to match)")
        raise ConversionError(f"{self.model_type} checkpoint does not fit the model: "
                              + "; ".join(problems) + hint)

    def from_hf(self, read: Callable[[str], torch.Tensor], cfg: ModelConfig,
                expert_ids: Iterable[int], *, dense: bool = True) -> dict[str, torch.Tensor]:
        """Megatron tensors (global names) of `expert_ids` (+ the dense ones) from HF tensors."""
        out = {}
        for rule in self.rules(cfg, expert_ids, dense=dense):
            parts = [read(k) for k in rule.hf]
            for k, t, s in zip(rule.hf, parts, rule.hf_shapes):
                if tuple(t.shape) != s:
                    raise ConversionError(f"{k}: checkpoint shape {list(t.shape)}, model expects {list(s)}")
            out[rule.megatron] = rule.pack(parts)
        return out

    def to_hf(self, state: Mapping[str, torch.Tensor], cfg: ModelConfig,
              expert_ids: Iterable[int], *, dense: bool = True) -> dict[str, torch.Tensor]:
        """HF tensors from Megatron tensors (global names) of `expert_ids` (+ the dense ones)."""
        out = {}
        for rule in self.rules(cfg, expert_ids, dense=dense):
            if rule.megatron not in state:
                raise ConversionError(f"{rule.megatron} is missing from the FlexFloor model")
            out.update(zip(rule.hf, rule.unpack(state[rule.megatron])))
        return out


def _other_experts_key(key: str) -> str:
    return "num_local_experts" if key == "num_experts" else "num_experts"


def rope_theta(hf: Mapping) -> float:
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConversionError("config.json has no rope theta (rope_parameters.rope_theta)")
    return theta


MIXTRAL = Family(
    model_type="mixtral", architecture="MixtralForCausalLM", preset="mixtral-8x7b",
    moe="block_sparse_moe", expert=("w1", "w3", "w2"), qk_norm=QKNorm.NONE,
    num_experts_key="num_local_experts", expert_ffn_key="intermediate_size", norm_topk_key=None,
    only={"sliding_window": None},
)
QWEN3_MOE = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", preset="qwen3-30b-a3b",
    moe="mlp", expert=("gate_proj", "up_proj", "down_proj"), qk_norm=QKNorm.PER_HEAD,
    num_experts_key="num_experts", expert_ffn_key="moe_intermediate_size",
    norm_topk_key="norm_topk_prob",
    only={"use_sliding_window": False, "mlp_only_layers": [], "decoder_sparse_step": 1},
)
OLMOE = Family(
    model_type="olmoe", architecture="OlmoeForCausalLM", preset="olmoe-1b-7b",
    moe="mlp", expert=("gate_proj", "up_proj", "down_proj"), qk_norm=QKNorm.FULL_WIDTH,
    num_experts_key="num_experts", expert_ffn_key="intermediate_size",
    norm_topk_key="norm_topk_prob", only={"clip_qkv": None},
)
FAMILIES = {f.model_type: f for f in (MIXTRAL, QWEN3_MOE, OLMOE)}


def _family_with(qk_norm: QKNorm) -> str:
    """Which family has `qk_norm` (the fix of a --family that does not match a model's layout)."""
    names = [f.model_type for f in FAMILIES.values() if f.qk_norm == qk_norm]
    kind = "without q/k norms" if qk_norm == QKNorm.NONE else f"with {qk_norm.value} q/k norms"
    if not names:
        return f"no supported family is one {kind} ({', '.join(FAMILIES)})"
    return " or ".join(f"the family {kind} is {n} (--family {n})" for n in names)


def family_of(name_or_config) -> Family:
    """The family of an HF model_type (or config dict holding one)."""
    name = name_or_config.get("model_type") if isinstance(name_or_config, Mapping) else name_or_config
    if name not in FAMILIES:
        raise ConversionError(f"model_type {name!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def model_config_dict(cfg: ModelConfig) -> dict:
    """Plain data of a model section (YAML/JSON-ready); `model_config_from_dict` inverts it."""
    return {**dataclasses.asdict(cfg), "qk_norm": cfg.qk_norm.value}


def model_config_from_dict(d: Mapping) -> ModelConfig:
    cfg = ModelConfig(**{**d, "qk_norm": QKNorm(d.get("qk_norm", "none"))})
    cfg.validate()
    return cfg
