"""Typed, nested run configuration: dataclasses in, YAML and command-line overrides on top.

A run is described by one `Config` with the sections model, parallel, rollout, elastic, scheduler,
trainer, data, checkpoint and logging. `load_config(path, overrides)` reads a YAML file whose top
level maps section names to {field: value}, applies the overrides, and validates the result.

Override syntax: one `section.field=value` per item, applied in order after the file, e.g.

    trainer.lr=1e-5                         a number
    rollout.greedy=true                     a bool
    rollout.stop_token_ids=[1,2]            a list of ints
    data.train_files=[a.parquet,b.parquet]  a list of strings
    elastic.release_policy=static           an enum, by its value
    checkpoint.dir=null                     null for an optional field

The value is parsed as YAML, so numbers, bools, lists and null work as in a file; quote a string
that YAML would read as something else (`data.tokenizer='123'`). `1e-5` reads as a float both in
files and in overrides.

Model presets: `model.preset` names an entry of MODEL_PRESETS. Its values are the base of the
model section; every key the user sets in the model section (file or override) wins over it.

Every problem raises ConfigError, whose message starts with the full dotted field name and ends
with the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config problem; `field` is the dotted name (e.g. "trainer.lr")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# elastic.pace_model's value that turns the pace rule off
PACE_OFF = "none"


class ReleasePolicy(enum.Enum):
    STATIC = "static"  # every rank stays in the EP group until the rollout ends
    ELASTIC = "elastic"  # ranks whose work is done release their experts and leave


class MoveKV(enum.Enum):
    """How a running request that moves to another rank of its EP group gets its K/V there
    (tail consolidation, migration); across replicas a move always re-prefills."""

    AUTO = "auto"  # the cheaper: its KV bytes over elastic.kv_link_bytes_per_s, or its re-prefill
    TRANSFER = "transfer"  # its KV blocks are sent; it decodes on at the taker's next step
    REPREFILL = "reprefill"  # recomputed on the taker from prompt + what it had produced


class PlacementPolicy(enum.Enum):
    BASELINE = "baseline"  # prompts spread round-robin, no length prediction
    FLEXFLOOR = "flexfloor"  # longest predicted work on the ranks meant to stay


class Algorithm(enum.Enum):
    GRPO = "grpo"
    PPO = "ppo"


class LossAgg(enum.Enum):
    TOKEN_MEAN = "token_mean"  # mean over all response tokens of the micro-batch
    SEQ_MEAN = "seq_mean"  # mean over tokens of each response, then over responses


class KLEstimator(enum.Enum):
    K1 = "k1"  # log(pi / ref)
    K3 = "k3"  # ref/pi - log(ref/pi) - 1: non-negative, lower variance


class RolloutIS(enum.Enum):
    """Importance-sampling correction of the policy loss for the engine/trainer mismatch."""

    NONE = "none"  # the loss as is
    TRUNCATED = "truncated"  # each token's loss times min(exp(old - engine log-prob), cap)


class DataSource(enum.Enum):
    AUTO = "auto"  # data.train_files when given, else the synthetic task
    SYNTHETIC = "synthetic"  # the running-sum task (data.synthetic_*)
    PARQUET = "parquet"  # verl-format data.train_files
    REASONING_GYM = "reasoning_gym"  # a reasoning-gym task (data.task, data.size), offline


class NanPolicy(enum.Enum):
    SKIP = "skip"  # drop the step's update and continue
    STOP = "stop"  # raise


class QKNorm(enum.Enum):
    """RMSNorm of queries and keys (after the projection, before RoPE)."""

    NONE = "none"  # Mixtral, DeepSeek
    PER_HEAD = "per_head"  # over each head's dim, weight [head_dim] (Qwen3)
    FULL_WIDTH = "full_width"  # over all heads at once, weight [heads * head_dim] (OLMoE)


class Resume(enum.Enum):
    AUTO = "auto"  # continue from checkpoint.dir/latest when it exists (a restarted job)
    OFF = "off"  # start from checkpoint.load (or a random init) whatever checkpoint.dir holds


class Backend(enum.Enum):
    AUTO = "auto"  # nccl with CUDA, gloo otherwise
    GLOO = "gloo"
    NCCL = "nccl"


# Shapes only (no weights). Values of the HF configs of the named checkpoints.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=64,
                 num_attention_heads=4, num_query_groups=2, kv_channels=None, num_experts=8,
                 moe_router_topk=2, shared_expert_ffn_hidden_size=None, vocab_size=128,
                 max_seq_len=256),
    "qwen3-30b-a3b": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
                          moe_ffn_hidden_size=768, num_attention_heads=32, num_query_groups=4,
                          kv_channels=128, num_experts=128, moe_router_topk=8,
                          shared_expert_ffn_hidden_size=None, vocab_size=151936,
                          max_seq_len=40960, rotary_base=1000000, norm_epsilon=1e-6,
                          qk_norm=QKNorm.PER_HEAD, moe_router_norm_topk=True),
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                         moe_ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                         kv_channels=None, num_experts=8, moe_router_topk=2,
                         shared_expert_ffn_hidden_size=None, vocab_size=32000,
                         max_seq_len=32768, rotary_base=1000000, norm_epsilon=1e-5,
                         qk_norm=QKNorm.NONE, moe_router_norm_topk=True),
    "olmoe-1b-7b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=1024,
                        moe_ffn_hidden_size=1024, num_attention_heads=16, num_query_groups=16,
                        kv_channels=None, num_experts=64, moe_router_topk=8,
                        shared_expert_ffn_hidden_size=None, vocab_size=50304,
                        max_seq_len=4096, rotary_base=10000, norm_epsilon=1e-5,
                        qk_norm=QKNorm.FULL_WIDTH, moe_router_norm_topk=False),
    # DeepSeek-V2-Lite uses multi-head latent attention (MLA); here it is approximated by standard
    # attention of the same head count and head dim. ffn_hidden_size is its first, dense layer.
    "deepseek-v2-lite": dict(num_layers=27, hidden_size=2048, ffn_hidden_size=10944,
                             moe_ffn_hidden_size=1408, num_attention_heads=16,
                             num_query_groups=16, kv_channels=None, num_experts=64,
                             moe_router_topk=6, shared_expert_ffn_hidden_size=2816,
                             vocab_size=102400, max_seq_len=32768, rotary_base=10000,
                             norm_epsilon=1e-6, qk_norm=QKNorm.NONE, moe_router_norm_topk=False),
}

PARAMS_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


def _positive(section: str, obj: Any, *names: str) -> None:
    """Each named field must be > 0 (an optional one may also be None)."""
    for n in names:
        v = getattr(obj, n)
        _require(v is None or v > 0, f"{section}.{n}",
                 f"must be > 0, got {v!r}; set {section}.{n} to a positive value")


def _non_negative(section: str, obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(v >= 0, f"{section}.{n}",
                 f"must be >= 0, got {v!r}; set {section}.{n} to 0 or more")


MAX_SEED = 2**31 - 1  # seeds feed torch's and numpy's generators, and int64 RNG keys with offsets
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # beyond a week a timeout is a hang, and timedelta overflows


def _at_most(section: str, obj: Any, limit: float, *names: str) -> None:
    shown = int(limit) if float(limit).is_integer() else limit
    for n in names:
        v = getattr(obj, n)
        _require(v is None or v <= limit, f"{section}.{n}",
                 f"must be <= {shown}, got {v!r}; set {section}.{n} to at most {shown}")


def _not_blank(section: str, obj: Any, *names: str) -> None:
    """Each named optional path must be None (not set) or name something: '' is not 'off'."""
    for n in names:
        v = getattr(obj, n)
        _require(v is None or bool(str(v).strip()), f"{section}.{n}",
                 f"is empty; give a path, or null to leave {section}.{n} unset")


def _in_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    left = "(" if lo_open else "["
    _require(ok, name, f"must be in {left}{lo}, {hi}], got {value!r}; set {name} inside that range")


@dataclass
class ModelConfig:
    """Model shapes. The preset is applied by config_from_dict/load_config, not by __init__."""

    preset: str = "tiny"  # key of MODEL_PRESETS; its values are the base of this section
    num_layers: int = 2  # transformer layers, each with an MoE MLP
    hidden_size: int = 64  # model width
    ffn_hidden_size: int = 128  # dense MLP width (layers that are not MoE)
    moe_ffn_hidden_size: int = 64  # width of one expert's MLP
    num_attention_heads: int = 4  # query heads
    num_query_groups: int = 2  # key/value heads (GQA); equal to heads for plain MHA
    kv_channels: int | None = None  # head dim; None = hidden_size / num_attention_heads
    num_experts: int = 8  # routed experts per MoE layer
    moe_router_topk: int = 2  # experts each token is routed to
    shared_expert_ffn_hidden_size: int | None = None  # total width of shared experts; None = none
    vocab_size: int = 128  # embedding rows
    max_seq_len: int = 256  # longest prompt + response, in tokens
    rotary_base: int = 10000  # RoPE theta
    norm_epsilon: float = 1e-6  # RMSNorm epsilon
    qk_norm: QKNorm = QKNorm.NONE  # RMSNorm of queries and keys: none, per_head, full_width
    # True: softmax over the top-k router logits (= the top-k probabilities renormalised to sum
    # 1: Mixtral, Qwen3-30B-A3B); False: softmax over all experts, top-k kept as they are (OLMoE)
    moe_router_norm_topk: bool = True
    params_dtype: str = "float32"  # one of PARAMS_DTYPES
    init_method_std: float = 0.02  # std of the random init (no checkpoint loaded)
    moe_aux_loss_coeff: float = 0.0  # router load-balancing loss weight
    seed: int = 1234  # seed of the random init

    def validate(self) -> None:
        _positive("model", self, "num_layers", "hidden_size", "ffn_hidden_size",
                  "moe_ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "num_experts", "moe_router_topk", "shared_expert_ffn_hidden_size", "vocab_size",
                  "max_seq_len", "rotary_base", "norm_epsilon", "init_method_std")
        _non_negative("model", self, "moe_aux_loss_coeff", "seed")
        _at_most("model", self, MAX_SEED, "seed")
        _require(self.params_dtype in PARAMS_DTYPES, "model.params_dtype",
                 f"{self.params_dtype!r} is not supported; use one of: {', '.join(PARAMS_DTYPES)}")
        _require(self.moe_router_topk <= self.num_experts, "model.moe_router_topk",
                 f"routes each token to {self.moe_router_topk} experts but model.num_experts is "
                 f"{self.num_experts}; set model.moe_router_topk <= {self.num_experts}")
        if self.kv_channels is None:  # an explicit head dim frees hidden_size from the heads
            _require(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
                     f"{self.hidden_size} is not divisible by model.num_attention_heads="
                     f"{self.num_attention_heads}; change one of them or set model.kv_channels")
        _require(self.num_attention_heads % self.num_query_groups == 0,
                 "model.num_query_groups",
                 f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                 f"{self.num_query_groups} query groups; set model.num_query_groups to a divisor "
                 f"of {self.num_attention_heads}")


@dataclass
class ParallelConfig:
    world_size: int | None = None  # number of workers; None = whatever the launcher started
    expert_parallel_size: int | None = None  # ranks of the training EP group; None = all ranks
    expert_tensor_parallel_size: int = 1  # tensor parallelism inside an expert (only 1 for now)
    backend: Backend = Backend.AUTO  # torch.distributed backend
    timeout_s: float = 300.0  # every collective's timeout; resync: the longest wait without progress

    def validate(self) -> None:
        _positive("parallel", self, "world_size", "expert_parallel_size", "timeout_s")
        _at_most("parallel", self, MAX_TIMEOUT_S, "timeout_s")
        _require(self.expert_tensor_parallel_size == 1, "parallel.expert_tensor_parallel_size",
                 f"{self.expert_tensor_parallel_size} is not supported yet; set it to 1")


@dataclass
class RolloutConfig:
    samples_per_prompt: int = 8  # responses generated per prompt (the GRPO group size)
    max_new_tokens: int = 128  # response length cap
    temperature: float = 1.0  # sampling temperature; 0 behaves as greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling mass; 1 = off
    greedy: bool = False  # argmax decoding, ignores temperature/top_k/top_p
    stop_token_ids: list[int] = field(default_factory=list)  # end a response at any of these
    max_batch_size: int = 64  # requests decoded at once, per rank
    kv_budget_tokens: int | None = None  # KV-cache capacity per rank in tokens; None = unlimited
    kv_block_tokens: int = 16  # tokens per KV block (the pool holds kv_budget_tokens // this)
    seed: int = 0  # base of the per-request RNG streams
    progress: bool = True  # show a progress line while generating
    # engine replicas: R EP groups of world / R ranks, each holding every expert, each decoding
    # its own requests (flexfloor/rollout/replicas.py); 1 = one world-wide group
    replicas: int = 1
    # decode-only steps padded to power-of-two batch buckets, with fixed shapes and no host
    # read inside the layer stack (the MoE layers' fixed-capacity dispatch): capture-ready for
    # CUDA graphs; the same tokens (docs/engine.md). Off: every step eager, sized to its batch
    static_decode: bool = False
    # float32 rollouts on CPU run FlexFloor's C kernels (megatron_ext/cpu_kernels.py: every
    # expert GEMM, and the attention of decode-only steps; built on first use with the machine's
    # C compiler); false: torch's (MKL GEMMs, SDPA). The same tokens; log-probs differ in the
    # last bits
    cpu_kernels: bool = True

    def validate(self) -> None:
        _positive("rollout", self, "samples_per_prompt", "max_new_tokens", "max_batch_size",
                  "kv_budget_tokens", "kv_block_tokens", "replicas")
        _non_negative("rollout", self, "temperature", "top_k", "seed")
        _at_most("rollout", self, MAX_SEED, "seed")
        _in_range("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        for i, t in enumerate(self.stop_token_ids):
            _require(t >= 0, f"rollout.stop_token_ids[{i}]",
                     f"token ids are >= 0, got {t}; remove it or use a valid token id")


@dataclass
class ElasticConfig:
    release_policy: ReleasePolicy = ReleasePolicy.ELASTIC  # static EP or early release
    min_active_ranks: int = 1  # an EP group (each replica's) never shrinks below this many ranks
    check_interval_steps: int = 1  # engine steps between agreements on who is done
    # a released rank parks its weights, gradient buffers and optimizer state in host memory
    # until resync, freeing its accelerator; None = on with CUDA, off on CPU
    offload_on_release: bool | None = None
    # tail consolidation (flexfloor/rollout/tails.py): at a step boundary a rank (within its
    # replica) or a whole replica (across replicas) with no queued request and at most
    # consolidate_max_requests running hands them to ranks that stay, re-prefilled there with
    # the same position-keyed randomness (the same tokens), and leaves now. Inside a replica
    # its steps are a function of the requests (one clock); false: the paper's release alone
    consolidate: bool = True
    consolidate_max_requests: int = 8  # most running requests a rank or replica hands over
    consolidate_reserve_blocks: int = 0  # KV blocks a taker keeps free beyond what it takes
    # also across replicas (rollout.replicas > 1), through an inbox per replica on the job's
    # store. Off by default: the replicas run on their own clocks, so which step a hand-over
    # lands at (and so each rank's steps) depends on their timing; the tokens never do
    consolidate_across: bool = False
    # across replicas, the simulator's hedge and online correction (flexfloor/rollout/tails.py,
    # on the engine's step clock, or with scheduler.plan_seconds on modelled seconds): a taker
    # counts its own running requests at this times their estimate when it takes requests, and
    # those that outlived their siblings up to their cap (1.0: as estimated; the simulator's
    # GPU scenarios run 1.25)
    consolidate_taker_hedge: float = 1.0
    # across replicas, a replica predicted past the plan's end (the static baseline's, in steps,
    # or in modelled seconds with scheduler.plan_seconds) hands its longest requests to
    # replicas running anyway and stays; a leaving replica's requests count half as long again
    # on their takers (the simulator's `correct`)
    consolidate_correct: bool = False
    # predict each running request as the simulator does, from the rollout's plan (its prompt's
    # history, distrusted once the samples finished prove it wrong; then its longest sibling
    # finished, then the prior: `tails.RunningEstimates`) in the decisions across replicas and
    # the pace rule; false: from its siblings finished on its rank, else its cap. Off by default:
    # where history is weak it kept requests from crossing replicas that crossed without it
    # (docs/launch.md)
    plan_estimates: bool = False
    # a request moved inside a replica: its KV blocks sent, or re-prefilled (same tokens)
    move_kv: MoveKV = MoveKV.AUTO
    # the link the ranks of a replica share, bytes/s (auto prices a KV transfer over it): gloo
    # between local processes measured 0.3 GB/s on the 2-core CI machine; NVLink ~ 4e11
    kv_link_bytes_per_s: float = 3e8
    # the engine's prefill, seconds per token (auto prices a re-prefill at it): the tiny model on
    # that CPU ~3e-5; the decisions need the same value on every rank, so it is stated, not timed
    reprefill_s_per_token: float = 3e-5
    # the pace rule (flexfloor/rollout/release.py, `Pace`): a survivor of a shrink hosts more
    # experts and reads their weights every step, so on an accelerator its later steps are
    # slower; with an accelerator of the cost model named here (H100, H800, H200, A100; or unit)
    # a shrink is refused when the survivors' predicted remaining steps at their post-shrink
    # step cost would end the replica later than it ends without the shrink. "none": off
    pace_model: str = PACE_OFF
    # the model shape the pace model prices: a model preset or deepseek-v3; null: the run's
    pace_model_shape: str | None = None

    def validate(self) -> None:
        _positive("elastic", self, "min_active_ranks", "check_interval_steps",
                  "consolidate_max_requests", "kv_link_bytes_per_s", "reprefill_s_per_token")
        from flexfloor.sim.hardware import ACCELERATORS, UNIT_ACCELERATOR, ModelShape

        kinds = [PACE_OFF, *sorted(ACCELERATORS), UNIT_ACCELERATOR]
        _require(self.pace_model in kinds, "elastic.pace_model",
                 f"{self.pace_model!r} is not allowed; use one of: {', '.join(kinds)} "
                 f"({PACE_OFF!r}: the pace rule off)")
        if self.pace_model_shape is not None:
            try:
                ModelShape.from_preset(self.pace_model_shape)
            except ValueError as e:
                raise ConfigError("elastic.pace_model_shape",
                                  f"{e}, or null for the run's model") from None
        _require(isinstance(self.move_kv, MoveKV), "elastic.move_kv",
                 f"{self.move_kv!r} is not allowed; use one of: "
                 + ", ".join(m.value for m in MoveKV))
        _non_negative("elastic", self, "consolidate_reserve_blocks")
        _require(self.consolidate_taker_hedge >= 1.0, "elastic.consolidate_taker_hedge",
                 f"must be >= 1, got {self.consolidate_taker_hedge!r} (a taker's own requests "
                 "counted at less than their estimate); set it to 1 (off) or more")
        across = self.consolidate and self.consolidate_across
        for name, on in (("consolidate_taker_hedge", self.consolidate_taker_hedge != 1.0),
                         ("consolidate_correct", self.consolidate_correct)):
            _require(across or not on, f"elastic.{name}",
                     "applies across replicas only; set elastic.consolidate=true and "
                     f"elastic.consolidate_across=true, or leave elastic.{name} at its default")
        _require(across or self.pace_model != PACE_OFF or not self.plan_estimates,
                 "elastic.plan_estimates", "is read by the decisions across replicas and the "
                 "pace rule only; set elastic.consolidate_across=true or elastic.pace_model, or "
                 "leave elastic.plan_estimates at false")

    def offloads(self, device) -> bool:
        """Whether a released rank offloads on `device` (`offload_on_release`, resolved)."""
        return device.type == "cuda" if self.offload_on_release is None else self.offload_on_release


@dataclass
class SchedulerConfig:
    placement: PlacementPolicy = PlacementPolicy.FLEXFLOOR  # how prompt groups go to ranks
    prior_quantile: float = 0.5  # quantile of past lengths used for prompts with no history
    migrate: bool = False  # move a rank's last requests to a survivor so it can leave earlier
    migrate_max_requests: int = 2  # most requests a rank may hand over to leave
    # FlexFloor placement: most prompt groups a rank takes, in fair shares (the ranks meant to
    # stay take more of the long work); on accelerators 1.0 (see flexfloor/sim/scenarios.py)
    max_share: float = 2.0
    # FlexFloor placement: a rank's predicted peak of cached KV tokens at most this times the
    # baseline's fullest rank's; None = no cap. On accelerators (memory-bound decode, lockstep
    # steps at the fullest rank's pace) 0.7 keeps steps as fast as the baseline's
    load_cap: float | None = None
    # FlexFloor across replicas by modelled seconds, the simulator's GPU policy: each replica's
    # lockstep steps priced by its batch, context and the experts they read, at the step cost
    # of elastic.pace_model's accelerator, and bounded by the static baseline's end priced the
    # same way; the replicas' decisions across replicas (elastic.consolidate_across) then run
    # on modelled seconds too. False: by predicted steps (a step costs the same whatever it
    # decodes, as on CPU)
    plan_seconds: bool = False

    def validate(self) -> None:
        _in_range("scheduler.prior_quantile", self.prior_quantile, 0.0, 1.0)
        _non_negative("scheduler", self, "migrate_max_requests")
        _positive("scheduler", self, "max_share", "load_cap")


@dataclass
class TrainerConfig:
    algorithm: Algorithm = Algorithm.GRPO  # advantage estimator and whether a critic is trained
    steps: int = 20  # training steps (one rollout each)
    prompts_per_step: int = 8  # prompts per rollout, over all ranks
    micro_batch_size: int = 8  # responses per forward/backward
    lr: float = 1e-4  # peak learning rate of the actor
    min_lr: float = 0.0  # learning rate at the end of the cosine decay
    lr_warmup_steps: int = 0  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay
    clip_grad: float = 1.0  # global grad-norm clip; 0 = off
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    ppo_epochs: int = 1  # passes over each rollout's data
    clip_eps: float = 0.2  # policy ratio clip
    kl_coef: float = 0.0  # weight of the KL to the reference policy; 0 = no reference model
    kl_estimator: KLEstimator = KLEstimator.K3  # which KL approximation
    entropy_coef: float = 0.0  # weight of the entropy bonus
    adv_std_norm: bool = True  # GRPO: divide group-centred rewards by the group std
    loss_agg: LossAgg = LossAgg.TOKEN_MEAN  # how token losses become one number
    gamma: float = 1.0  # PPO discount
    gae_lambda: float = 1.0  # PPO GAE lambda
    critic_lr: float = 1e-4  # PPO critic learning rate
    value_clip_eps: float = 0.2  # PPO value clip
    nan_policy: NanPolicy = NanPolicy.STOP  # what a non-finite loss or grad norm does
    sft_warmup_steps: int = 0  # supervised steps on the data before RL
    sft_lr: float = 1e-3  # peak learning rate of the supervised warm start (cosine to 0)
    # dual-clip: the loss of a token with a negative advantage is capped at -A * clip_ratio_c
    # (verl's default 3.0); null turns it off
    clip_ratio_c: float | None = 3.0
    rollout_is: RolloutIS = RolloutIS.NONE  # correction for the engine's log-probs
    rollout_is_cap: float = 2.0  # the largest truncated importance weight (rollout_is=truncated)
    val_interval: int = 0  # validate every N steps and at the end; 0 = never
    val_samples: int = 1  # responses per val prompt: 1 = greedy, more = sampled as in training

    def validate(self) -> None:
        _positive("trainer", self, "steps", "prompts_per_step", "micro_batch_size", "lr", "sft_lr",
                  "ppo_epochs", "clip_eps", "critic_lr", "value_clip_eps", "rollout_is_cap",
                  "val_samples")
        _non_negative("trainer", self, "val_interval")
        if self.clip_ratio_c is not None:
            _require(self.clip_ratio_c > 1.0, "trainer.clip_ratio_c",
                     f"must be above 1 (the ratio the cap starts at), got {self.clip_ratio_c}; "
                     "e.g. 3.0, or null to turn dual-clip off")
        _non_negative("trainer", self, "min_lr", "lr_warmup_steps", "weight_decay", "clip_grad",
                      "kl_coef", "entropy_coef", "sft_warmup_steps")
        _require(self.min_lr <= self.lr, "trainer.min_lr",
                 f"{self.min_lr} is above trainer.lr={self.lr}; set trainer.min_lr <= trainer.lr")
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            _require(0 <= v < 1, f"trainer.{name}", f"must be in [0, 1), got {v}; e.g. 0.9")
        _in_range("trainer.gamma", self.gamma, 0.0, 1.0)
        _in_range("trainer.gae_lambda", self.gae_lambda, 0.0, 1.0)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # verl-format parquet; [] = synthetic
    synthetic_num_prompts: int = 64  # size of the synthetic task's prompt set
    synthetic_seed: int = 0  # seed of the generated task (synthetic or reasoning_gym)
    tokenizer: str | None = None  # tokenizer path; None = the bundled one
    max_prompt_len: int = 128  # in tokens; a longer prompt is an error that names it
    shuffle: bool = True  # reshuffle prompts every epoch
    source: DataSource = DataSource.AUTO  # where the prompts come from
    val_files: list[str] = field(default_factory=list)  # verl-format parquet of held-out prompts
    val_size: int = 0  # generated sources: prompts held out for validation (never trained on)
    task: str | None = None  # data.source=reasoning_gym: the task name, e.g. basic_arithmetic
    size: int = 256  # data.source=reasoning_gym: training prompts generated

    def validate(self) -> None:
        _positive("data", self, "synthetic_num_prompts", "max_prompt_len", "size")
        _non_negative("data", self, "val_size")
        for name in ("train_files", "val_files"):
            for i, f in enumerate(getattr(self, name)):
                _require(bool(f.strip()), f"data.{name}[{i}]",
                         "is empty; remove it or give a parquet path")
        _require(not (self.val_files and self.val_size), "data.val_size",
                 f"{self.val_size} held-out prompts and data.val_files are both set; validate on "
                 "the files (data.val_size=0) or on a held-out split (data.val_files=[])")
        if self.source == DataSource.REASONING_GYM:
            _require(bool(self.task), "data.task",
                     "is not set; data.source=reasoning_gym needs a task name, e.g. "
                     "data.task=basic_arithmetic")
        if self.source == DataSource.PARQUET:
            _require(bool(self.train_files), "data.train_files",
                     "is empty; data.source=parquet needs verl-format parquet files")
        if self.source in (DataSource.SYNTHETIC, DataSource.REASONING_GYM):
            _require(not self.train_files, "data.train_files",
                     f"is set but data.source={self.source.value} generates its prompts; set "
                     "data.train_files=[] or data.source=parquet")


@dataclass
class RewardConfig:
    # verl's custom reward function, "path/to/file.py:function", called as
    # function(data_source, solution_str, ground_truth, extra_info) for every data_source;
    # None = the registered reward of each data_source (flexfloor.data.reward)
    custom_fn: str | None = None

    def validate(self) -> None:
        if self.custom_fn is not None:
            path, sep, name = self.custom_fn.rpartition(":")
            _require(bool(sep and path.strip() and name.strip()), "reward.custom_fn",
                     f"{self.custom_fn!r} is not 'path/to/file.py:function'; e.g. "
                     "reward.custom_fn=my_reward.py:compute_score")


@dataclass
class CheckpointConfig:
    dir: str | None = None  # where checkpoints go; None = no checkpoints
    save_interval: int = 0  # save every N steps; 0 = only at the end
    load: str | None = None  # a training checkpoint to resume (weights, optimizer, step, data)
    # weights only (e.g. a converted HF checkpoint): fresh optimizer, step 0. A resume (load, or
    # checkpoint.dir/latest with resume=auto) wins over it. None with no load = random init
    init_from: str | None = None
    keep_last: int = 2  # older checkpoints are deleted
    resume: Resume = Resume.AUTO  # auto: checkpoint.dir/latest, when present, wins over load
    # SIGTERM/SIGINT: the step in progress and a checkpoint must be done within this many
    # seconds of the signal (flexfloor/preemption.py); else the worker exits 1 without one
    preempt_grace_s: float = 60.0

    def validate(self) -> None:
        _non_negative("checkpoint", self, "save_interval")
        _not_blank("checkpoint", self, "dir", "load", "init_from")
        _positive("checkpoint", self, "keep_last", "preempt_grace_s")
        _require(not (self.load and self.init_from), "checkpoint.init_from",
                 f"{self.init_from!r} and checkpoint.load={self.load!r} are both set; "
                 "checkpoint.load resumes a training run (optimizer, step, data), "
                 "checkpoint.init_from starts a new one from weights only: set one of them "
                 "to null")

    def holds_checkpoint(self) -> bool:
        """checkpoint.dir holds a complete checkpoint (its `latest`)."""
        return bool(self.dir) and os.path.isfile(os.path.join(self.dir, "latest"))

    def resumes_from_dir(self) -> bool:
        """checkpoint.resume=auto and checkpoint.dir holds a checkpoint: the run resumes from
        it, and checkpoint.load / checkpoint.init_from are not read."""
        return self.resume == Resume.AUTO and self.holds_checkpoint()


@dataclass
class LoggingConfig:
    run_dir: str = "runs/latest"  # metrics, timelines and plots of the run
    tensorboard: bool = True  # write TensorBoard event files
    timeline_plot: bool = True  # plot each rollout's per-rank timeline
    log_interval: int = 1  # steps between metric lines

    def validate(self) -> None:
        _require(bool(self.run_dir.strip()), "logging.run_dir", "is empty; give a directory")
        _positive("logging", self, "log_interval")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """Field ranges of every section, then the combinations that cannot run."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        m, p, r, t = self.model, self.parallel, self.rollout, self.trainer
        world = p.world_size
        ep = p.expert_parallel_size if p.expert_parallel_size is not None else world
        if world is not None and ep is not None:
            _require(ep <= world, "parallel.expert_parallel_size",
                     f"{ep} EP ranks but parallel.world_size={world}; set "
                     f"parallel.expert_parallel_size <= {world} or launch more workers")
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            _require(world % ep == 0, "parallel.expert_parallel_size",
                     f"parallel.world_size={world} is not a multiple of {ep}; set "
                     f"parallel.expert_parallel_size to one of {divisors}")
        if world is not None:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            _require(world % r.replicas == 0, "rollout.replicas",
                     f"{r.replicas} replicas do not divide parallel.world_size={world} (each "
                     f"replica is an EP group of world / replicas ranks); set rollout.replicas "
                     f"to one of {divisors}")
            per_replica = world // r.replicas
            _require(self.elastic.min_active_ranks <= per_replica, "elastic.min_active_ranks",
                     f"{self.elastic.min_active_ranks} is more than the {per_replica} ranks of a "
                     f"replica (parallel.world_size / rollout.replicas); set "
                     f"elastic.min_active_ranks <= {per_replica} or rollout.replicas lower")
        if self.scheduler.plan_seconds:
            _require(self.elastic.pace_model != PACE_OFF, "scheduler.plan_seconds",
                     "needs a cost model to price the steps with; set elastic.pace_model to an "
                     "accelerator (e.g. elastic.pace_model=H800) or scheduler.plan_seconds=false")
            _require(r.replicas > 1, "scheduler.plan_seconds",
                     "places across replicas and there is one (rollout.replicas=1); set "
                     "rollout.replicas > 1 or scheduler.plan_seconds=false")
        if ep is not None:
            _require(m.num_experts >= ep, "model.num_experts",
                     f"{m.num_experts} experts are fewer than the {ep} EP ranks "
                     f"(parallel.expert_parallel_size); set parallel.expert_parallel_size <= "
                     f"{m.num_experts} or use a model with more experts")
            _require(self.elastic.min_active_ranks <= ep, "elastic.min_active_ranks",
                     f"{self.elastic.min_active_ranks} is more than the {ep} EP ranks "
                     f"(parallel.expert_parallel_size); set elastic.min_active_ranks <= {ep}")
        longest = self.data.max_prompt_len + r.max_new_tokens
        room = m.max_seq_len - self.data.max_prompt_len  # new tokens that fit after a prompt
        split = (f"keep data.max_prompt_len + rollout.max_new_tokens <= {m.max_seq_len} (e.g. "
                 f"data.max_prompt_len={(m.max_seq_len + 1) // 2} rollout.max_new_tokens="
                 f"{m.max_seq_len // 2}) or " if m.max_seq_len >= 2 else "")
        _require(room >= 1, "data.max_prompt_len",
                 f"prompts of up to {self.data.max_prompt_len} tokens leave no room for a "
                 f"response in model.max_seq_len={m.max_seq_len}; {split}raise "
                 f"model.max_seq_len to at least {longest}")
        _require(longest <= m.max_seq_len, "rollout.max_new_tokens",
                 f"{r.max_new_tokens} new tokens after prompts of up to data.max_prompt_len="
                 f"{self.data.max_prompt_len} exceed model.max_seq_len={m.max_seq_len}; set "
                 f"rollout.max_new_tokens <= {room}")
        if r.kv_budget_tokens is not None:
            bt = r.kv_block_tokens
            whole = -(-longest // bt) * bt  # the KV pool counts whole blocks
            _require(r.kv_budget_tokens >= whole, "rollout.kv_budget_tokens",
                     f"{r.kv_budget_tokens} tokens cannot hold one request of up to {longest} "
                     f"(data.max_prompt_len + rollout.max_new_tokens) in blocks of {bt} "
                     f"(rollout.kv_block_tokens); set it >= {whole}")
        for i, tok in enumerate(r.stop_token_ids):
            _require(tok < m.vocab_size, f"rollout.stop_token_ids[{i}]",
                     f"{tok} is outside model.vocab_size={m.vocab_size}; use an id below it")
        _require(t.algorithm != Algorithm.GRPO or r.samples_per_prompt >= 2,
                 "rollout.samples_per_prompt",
                 f"{r.samples_per_prompt} with trainer.algorithm=grpo: a group of one response has "
                 "advantage 0 and learns nothing; set rollout.samples_per_prompt >= 2 (e.g. 8) or "
                 "trainer.algorithm=ppo")
        global_batch = t.prompts_per_step * r.samples_per_prompt
        _require(t.micro_batch_size <= global_batch, "trainer.micro_batch_size",
                 f"{t.micro_batch_size} is larger than the {global_batch} responses of a step "
                 f"(trainer.prompts_per_step * rollout.samples_per_prompt); set "
                 f"trainer.micro_batch_size <= {global_batch}")

    def resolve_world(self, world_size: int) -> Config:
        """A validated copy for `world_size` workers; EP defaults to all of them."""
        _require(isinstance(world_size, int) and world_size > 0, "parallel.world_size",
                 f"the launcher reported {world_size!r} workers; start at least one")
        configured = self.parallel.world_size
        _require(configured in (None, world_size), "parallel.world_size",
                 f"the config says {configured} but {world_size} workers were launched; set "
                 f"parallel.world_size={world_size} (or null) or launch {configured} workers")
        cfg = copy.deepcopy(self)
        cfg.parallel.world_size = world_size
        if cfg.parallel.expert_parallel_size is None:
            cfg.parallel.expert_parallel_size = world_size
        cfg.validate()
        return cfg


# ---------------------------------------------------------------------------------------------
# Generic typed loading: one walk over dataclass fields, driven by their type hints.

_TYPE_HINTS = {int: "write a whole number without quotes (true/false are not numbers)",
               float: "write a number without quotes, e.g. 0.5 or 1e-5",
               bool: "write true or false",
               str: "write text; quote it if YAML would read it as a number or bool"}


def _unknown(name: str, what: str, key: Any, valid: list[str], valid_label: str) -> ConfigError:
    guess = difflib.get_close_matches(str(key), valid, n=1)
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    return ConfigError(name, f"unknown {what}; {hint}valid {valid_label}: {', '.join(valid)}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, checking every key and value."""
    if data is None:  # an empty section in YAML
        data = {}
    what = "key" if prefix else "section"
    if not isinstance(data, dict):
        raise ConfigError(prefix or "config", f"expected a mapping of {what}s, got "
                          f"{type(data).__name__} {data!r}; write `name: value` lines")
    hints = get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if key not in valid:
            raise _unknown(name, what, key, valid, f"keys of {prefix}" if prefix else "sections")
        kwargs[key] = _convert(value, hints[key], name)
    return cls(**kwargs)


def _convert(value: Any, tp: Any, name: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # only Optional[X] is used
        if value is None:
            return None
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _convert(value, inner, name)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        allowed = [e.value for e in tp]
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as bools
            words = ("on", "yes", "true") if value else ("off", "no", "false")
            value = next((w for w in words if w in allowed), value)
        if value not in allowed:
            raise ConfigError(name, f"{value!r} is not allowed; use one of: {', '.join(allowed)}")
        return tp(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(name, f"expected a list, got {type(value).__name__} {value!r}; "
                              "write a list, e.g. [1, 2] or []")
        return [_convert(v, get_args(tp)[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str) and \
            value.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
        value = float(value)  # YAML's own words are .inf and .nan: refused below, by name
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(name, f"expected {tp.__name__}, got {type(value).__name__} "
                          f"{value!r}; {_TYPE_HINTS[tp]}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}; write a number such "
                          "as 0.5 or 1e-5 (.inf and .nan are not accepted)")
    return value


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list):
        return [_to_plain(v) for v in obj]
    return obj


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` (no dot) as a float, as YAML 1.2 does."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _apply_preset(tree: dict) -> dict:
    """Preset values under the model keys the user set explicitly."""
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), (dict, type(None))):
        return tree  # _build reports the wrong type
    model = dict(tree.get("model") or {})
    preset = model.get("preset", ModelConfig.preset)
    if not isinstance(preset, str):
        raise ConfigError("model.preset", f"expected str, got {type(preset).__name__} "
                          f"{preset!r}; use one of: {', '.join(MODEL_PRESETS)}")
    if preset not in MODEL_PRESETS:
        raise _unknown("model.preset", f"preset {preset!r}", preset, list(MODEL_PRESETS), "presets")
    return {**tree, "model": {**MODEL_PRESETS[preset], **model}}


def config_from_dict(d: dict) -> Config:
    """Typed, validated Config from plain data (the shape config_to_dict returns)."""
    cfg = _build(Config, _apply_preset(d if d is not None else {}), "")
    cfg.validate()
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """Plain, YAML-serialisable data; config_from_dict(config_to_dict(c)) == c."""
    return _to_plain(cfg)


def _apply_override(tree: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    key = key.strip()
    path = key.split(".")
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(key or override, f"override {override!r} is not "
                          "section.field=value; write it like trainer.lr=1e-5")
    try:
        value = yaml.load(raw, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", e)
        raise ConfigError(key, f"value {raw!r} is not valid YAML ({problem}); quote it or fix "
                          "the brackets") from None
    node = tree
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(path[:depth + 1]), f"is a value, not a section, so "
                              f"{key} cannot be set; override {'.'.join(path[:depth + 1])} itself")
        node = child
    node[path[-1]] = value


def _where(path: str, mark) -> str:
    """`file:line:column` (1-based) of a YAML node or error mark."""
    return f"{path}:{mark.line + 1}:{mark.column + 1}"


def _check_duplicate_keys(node, path: str, prefix: str = "") -> None:
    """YAML keeps the last of two equal keys without a word; a config must not."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        name = f"{prefix}.{key}" if prefix else str(key)
        if key is not None and key in seen:
            raise ConfigError(name, f"is set twice, at {_where(path, seen[key])} and "
                              f"{_where(path, key_node.start_mark)}; keep one of them")
        if key is not None:
            seen[key] = key_node.start_mark
        _check_duplicate_keys(value_node, path, name)


def _read_yaml(path: str) -> Any:
    """The YAML file's data; every problem (missing, a directory, bad syntax, a key set twice)
    is a ConfigError that says where (file:line:column) and what to do."""
    if os.path.isdir(path):
        raise ConfigError("--config", f"{path} is a directory; give a YAML file, e.g. "
                          "examples/configs/grpo_tiny.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError("--config", f"{path} does not exist; give the path of a YAML file, "
                          "e.g. examples/configs/grpo_tiny.yaml") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--config", f"{path} cannot be read as text ({e}); give a YAML "
                          "file") from None
    try:
        _check_duplicate_keys(yaml.compose(text, Loader=_YamlLoader), path)
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = _where(path, mark) if mark is not None else path
        problem = " ".join(str(e.problem or e.context or e).split())
        hint = ("indent with spaces: YAML does not accept tabs" if "'\\t'" in problem
                else "fix the YAML syntax there")
        raise ConfigError(where, f"{problem}; {hint}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, f"not valid YAML ({e}); fix the syntax") from None


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML at `path` (None = defaults), apply `section.field=value` overrides, validate."""
    tree: Any = {}
    if path is not None:
        tree = _read_yaml(path)
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError("config", f"{path} holds a {type(tree).__name__}, not a mapping of "
                              "sections; write `section:` lines with `field: value` under them")
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        _apply_override(tree, item)
    return config_from_dict(tree)
