"""flexfloor.config: loading, overrides, presets, and errors that name the field and the fix."""

import os
from pathlib import Path

import pytest
import yaml

from flexfloor.config import (
    MODEL_PRESETS,
    Algorithm,
    Backend,
    Config,
    ConfigError,
    ElasticConfig,
    KLEstimator,
    LossAgg,
    NanPolicy,
    PlacementPolicy,
    ReleasePolicy,
    SchedulerConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _write(tmp_path, data) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def _error(overrides, path=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


# --- defaults, loading, overrides -----------------------------------------------------------

def test_defaults_are_valid_and_match_tiny_preset():
    cfg = Config()
    cfg.validate()
    assert load_config(None) == cfg
    for key, value in MODEL_PRESETS["tiny"].items():
        assert getattr(cfg.model, key) == value, key
    assert cfg.elastic.release_policy is ReleasePolicy.ELASTIC
    assert cfg.trainer.algorithm is Algorithm.GRPO
    assert cfg.rollout.stop_token_ids == [] and cfg.rollout.stop_token_ids is not \
        Config().rollout.stop_token_ids


def test_yaml_file_is_read(tmp_path):
    path = _write(tmp_path, """
trainer:
  lr: 1e-5            # no dot: still a float
  steps: 3
rollout:
  greedy: true
  stop_token_ids: [3, 4]
scheduler:
  placement: baseline
checkpoint:
  dir: ckpt
logging:            # an empty section keeps the defaults
""")
    cfg = load_config(path)
    assert cfg.trainer.lr == 1e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.steps == 3
    assert cfg.rollout.greedy is True
    assert cfg.rollout.stop_token_ids == [3, 4]
    assert cfg.scheduler.placement is PlacementPolicy.BASELINE
    assert cfg.checkpoint.dir == "ckpt"
    assert cfg.logging.run_dir == "runs/latest"


def test_overrides_parse_numbers_bools_lists_enums_and_null(tmp_path):
    path = _write(tmp_path, {"trainer": {"lr": 0.001, "steps": 5}, "checkpoint": {"dir": "x"}})
    cfg = load_config(path, [
        "trainer.lr=1e-5",
        "trainer.clip_grad=2",  # an int is fine for a float field
        "rollout.greedy=true",
        "rollout.stop_token_ids=[1,2]",
        "data.train_files=[a.parquet,b.parquet]",
        "elastic.release_policy=static",
        "trainer.algorithm=ppo",
        "trainer.loss_agg=seq_mean",
        "trainer.kl_estimator=k1",
        "trainer.nan_policy=skip",
        "parallel.backend=gloo",
        "checkpoint.dir=null",
        "data.tokenizer=tok/tokenizer.json",
    ])
    assert cfg.trainer.lr == 1e-5
    assert cfg.trainer.steps == 5  # from the file, untouched
    assert cfg.trainer.clip_grad == 2.0 and isinstance(cfg.trainer.clip_grad, float)
    assert cfg.rollout.greedy is True
    assert cfg.rollout.stop_token_ids == [1, 2]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.elastic.release_policy is ReleasePolicy.STATIC
    assert cfg.trainer.algorithm is Algorithm.PPO
    assert cfg.trainer.loss_agg is LossAgg.SEQ_MEAN
    assert cfg.trainer.kl_estimator is KLEstimator.K1
    assert cfg.trainer.nan_policy is NanPolicy.SKIP
    assert cfg.parallel.backend is Backend.GLOO
    assert cfg.checkpoint.dir is None
    assert cfg.data.tokenizer == "tok/tokenizer.json"


def test_later_override_wins():
    assert load_config(None, ["trainer.steps=3", "trainer.steps=7"]).trainer.steps == 7


@pytest.mark.parametrize("bad", ["trainer.lr", "lr=1e-5", "trainer.=1", ".lr=1"])
def test_malformed_override(bad):
    err = _error([bad])
    assert "section.field=value" in str(err)


def test_override_with_broken_yaml_names_the_field():
    err = _error(["rollout.stop_token_ids=[1,2"])
    assert err.field == "rollout.stop_token_ids"
    assert "not valid YAML" in str(err)


# --- round trip -----------------------------------------------------------------------------

def test_dict_round_trip_is_exact(tmp_path):
    cfg = load_config(None, ["model.preset=deepseek-v2-lite", "rollout.stop_token_ids=[7]",
                             "data.train_files=[x.parquet]", "trainer.algorithm=ppo",
                             "parallel.world_size=4", "rollout.kv_budget_tokens=4096"])
    d = config_to_dict(cfg)
    assert d["trainer"]["algorithm"] == "ppo"  # enums become their values
    assert config_from_dict(d) == cfg
    assert config_to_dict(config_from_dict(d)) == d
    # Plain data: safe_dump accepts it and the file loads back to the same config.
    text = yaml.safe_dump(d)
    assert load_config(_write(tmp_path, text)) == cfg


def test_config_from_dict_does_not_alias_input():
    d = config_to_dict(Config())
    cfg = config_from_dict(d)
    cfg.rollout.stop_token_ids.append(5)
    assert d["rollout"]["stop_token_ids"] == []


# --- unknown keys, types, enums -------------------------------------------------------------

def test_unknown_key_suggests_the_close_one():
    err = _error(["trainer.lr_warmup_step=3"])
    assert err.field == "trainer.lr_warmup_step"
    assert "did you mean 'lr_warmup_steps'?" in str(err)
    assert "valid keys of trainer:" in str(err) and "sft_warmup_steps" in str(err)


def test_unknown_key_in_yaml_file(tmp_path):
    err = _error([], _write(tmp_path, {"rollout": {"temprature": 0.7}}))
    assert str(err).startswith("rollout.temprature: unknown key")
    assert "did you mean 'temperature'?" in str(err)


def test_unknown_section():
    err = _error(["trainr.lr=1e-5"])
    assert err.field == "trainr"
    assert "unknown section" in str(err) and "did you mean 'trainer'?" in str(err)
    assert "model, parallel, rollout" in str(err)


def test_top_level_must_be_a_mapping(tmp_path):
    err = _error([], _write(tmp_path, "- a\n- b\n"))
    assert "not a mapping of sections" in str(err)


@pytest.mark.parametrize("override, field, expected, given", [
    ("trainer.steps='20'", "trainer.steps", "expected int", "got str '20'"),
    ("trainer.steps=true", "trainer.steps", "expected int", "got bool True"),
    ("trainer.steps=2.5", "trainer.steps", "expected int", "got float 2.5"),
    ("trainer.lr=fast", "trainer.lr", "expected float", "got str 'fast'"),
    ("trainer.lr=false", "trainer.lr", "expected float", "got bool False"),
    ("rollout.greedy=1", "rollout.greedy", "expected bool", "got int 1"),
    ("logging.run_dir=3", "logging.run_dir", "expected str", "got int 3"),
    ("rollout.stop_token_ids=[1,x]", "rollout.stop_token_ids[1]", "expected int", "got str 'x'"),
    ("rollout.stop_token_ids=[1,true]", "rollout.stop_token_ids[1]", "expected int",
     "got bool True"),
    ("rollout.stop_token_ids=5", "rollout.stop_token_ids", "expected a list", "got int 5"),
    ("data.train_files=[a.parquet,3]", "data.train_files[1]", "expected str", "got int 3"),
    ("parallel.world_size=four", "parallel.world_size", "expected int", "got str 'four'"),
])
def test_wrong_type(override, field, expected, given):
    err = _error([override])
    assert err.field == field
    assert expected in str(err) and given in str(err)


def test_section_must_be_a_mapping(tmp_path):
    err = _error([], _write(tmp_path, "trainer: 3\n"))
    assert err.field == "trainer"
    assert "expected a mapping of keys, got int 3" in str(err)


def test_optional_fields_accept_null():
    cfg = load_config(None, ["model.kv_channels=null", "rollout.kv_budget_tokens=null",
                             "parallel.world_size=null", "data.tokenizer=null"])
    assert cfg.model.kv_channels is None and cfg.rollout.kv_budget_tokens is None
    assert cfg.parallel.world_size is None and cfg.data.tokenizer is None


def test_null_for_required_field_is_an_error():
    err = _error(["trainer.steps=null"])
    assert err.field == "trainer.steps" and "got NoneType None" in str(err)


@pytest.mark.parametrize("override, allowed", [
    ("elastic.release_policy=dynamic", "static, elastic"),
    ("scheduler.placement=random", "baseline, flexfloor"),
    ("trainer.algorithm=dpo", "grpo, ppo"),
    ("trainer.loss_agg=sum", "token_mean, seq_mean"),
    ("trainer.kl_estimator=k2", "k1, k3"),
    ("trainer.nan_policy=ignore", "skip, stop"),
    ("parallel.backend=mpi", "auto, gloo, nccl"),
])
def test_bad_enum_lists_allowed_values(override, allowed):
    err = _error([override])
    assert err.field == override.split("=")[0]
    assert f"use one of: {allowed}" in str(err)


# --- range checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("override, field", [
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.temperature=-0.1", "rollout.temperature"),
    ("rollout.samples_per_prompt=0", "rollout.samples_per_prompt"),
    ("rollout.stop_token_ids=[-1]", "rollout.stop_token_ids[0]"),
    ("trainer.lr=0", "trainer.lr"),
    ("trainer.min_lr=1", "trainer.min_lr"),
    ("trainer.adam_beta2=1.0", "trainer.adam_beta2"),
    ("trainer.gae_lambda=1.1", "trainer.gae_lambda"),
    ("model.num_layers=0", "model.num_layers"),
    ("model.params_dtype=int8", "model.params_dtype"),
    ("model.kv_channels=-8", "model.kv_channels"),
    ("parallel.world_size=0", "parallel.world_size"),
    ("parallel.expert_tensor_parallel_size=2", "parallel.expert_tensor_parallel_size"),
    ("scheduler.prior_quantile=1.5", "scheduler.prior_quantile"),
    ("elastic.check_interval_steps=0", "elastic.check_interval_steps"),
    ("elastic.consolidate_taker_hedge=0.8", "elastic.consolidate_taker_hedge"),
    ("elastic.consolidate_correct=true", "elastic.consolidate_correct"),  # needs _across
    ("elastic.plan_estimates=true", "elastic.plan_estimates"),  # needs _across or pace_model
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("logging.log_interval=0", "logging.log_interval"),
])
def test_range_checks_name_the_field(override, field):
    err = _error([override])
    assert err.field == field
    assert str(err).startswith(f"{field}: ")


# --- presets --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_loads(name):
    # Big presets need no workers to load; with world_size unset EP is not checked yet.
    cfg = load_config(None, [f"model.preset={name}"])
    for key, value in MODEL_PRESETS[name].items():
        assert getattr(cfg.model, key) == value, key


def test_preset_values_and_explicit_keys_win(tmp_path):
    cfg = load_config(None, ["model.preset=qwen3-30b-a3b"])
    assert (cfg.model.num_layers, cfg.model.num_experts, cfg.model.moe_router_topk) == (48, 128, 8)
    assert cfg.model.kv_channels == 128 and cfg.model.vocab_size == 151936

    cfg = load_config(None, ["model.preset=tiny", "model.num_layers=3"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 64

    # The override order does not matter: explicit keys always beat the preset.
    cfg = load_config(None, ["model.num_layers=3", "model.preset=mixtral-8x7b"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 4096

    path = _write(tmp_path, {"model": {"preset": "olmoe-1b-7b", "num_experts": 32}})
    cfg = load_config(path)
    assert cfg.model.num_experts == 32 and cfg.model.num_layers == 16


def test_unknown_preset_suggests():
    err = _error(["model.preset=qwen3-30b"])
    assert err.field == "model.preset"
    assert "did you mean 'qwen3-30b-a3b'?" in str(err) and "deepseek-v2-lite" in str(err)


# --- impossible combinations ----------------------------------------------------------------

def test_ep_larger_than_world():
    err = _error(["parallel.world_size=4", "parallel.expert_parallel_size=8"])
    assert err.field == "parallel.expert_parallel_size"
    assert "set parallel.expert_parallel_size <= 4 or launch more workers" in str(err)


def test_world_not_multiple_of_ep():
    err = _error(["parallel.world_size=6", "parallel.expert_parallel_size=4"])
    assert err.field == "parallel.expert_parallel_size"
    assert "[1, 2, 3, 6]" in str(err)


def test_experts_fewer_than_ep_ranks():
    err = _error(["parallel.expert_parallel_size=16"])
    assert err.field == "model.num_experts"
    assert "fewer than the 16 EP ranks" in str(err)
    assert "parallel.expert_parallel_size <= 8" in str(err)


def test_experts_fewer_than_world_when_ep_is_all_ranks():
    err = _error(["parallel.world_size=16"])
    assert err.field == "model.num_experts"


def test_topk_above_num_experts():
    err = _error(["model.moe_router_topk=9"])
    assert err.field == "model.moe_router_topk"
    assert "model.moe_router_topk <= 8" in str(err)


def test_hidden_not_divisible_by_heads():
    err = _error(["model.hidden_size=66"])
    assert err.field == "model.hidden_size"
    assert "model.num_attention_heads=4" in str(err)
    # An explicit head dim removes the constraint.
    cfg = load_config(None, ["model.hidden_size=66", "model.kv_channels=16"])
    assert cfg.model.hidden_size == 66


def test_heads_not_divisible_by_query_groups():
    err = _error(["model.num_query_groups=3"])
    assert err.field == "model.num_query_groups"
    assert "divisor of 4" in str(err)


def test_min_active_ranks_above_ep():
    err = _error(["parallel.expert_parallel_size=2", "elastic.min_active_ranks=3"])
    assert err.field == "elastic.min_active_ranks"
    assert "elastic.min_active_ranks <= 2" in str(err)


def test_max_new_tokens_reaches_max_seq_len():
    err = _error(["rollout.max_new_tokens=256"])
    assert err.field == "rollout.max_new_tokens"
    assert "model.max_seq_len=256" in str(err)
    # Prompt and response together must fit too.
    err = _error(["data.max_prompt_len=200", "rollout.max_new_tokens=100"])
    assert err.field == "rollout.max_new_tokens" and "<= 56" in str(err)


def test_kv_budget_must_hold_one_request():
    err = _error(["rollout.kv_budget_tokens=100"])  # 128 prompt + 128 new tokens
    assert err.field == "rollout.kv_budget_tokens" and ">= 256" in str(err)


def test_stop_token_outside_vocab():
    err = _error(["rollout.stop_token_ids=[1,128]"])
    assert err.field == "rollout.stop_token_ids[1]"
    assert "model.vocab_size=128" in str(err)


def test_micro_batch_above_global_batch():
    err = _error(["trainer.prompts_per_step=2", "rollout.samples_per_prompt=2",
                  "trainer.micro_batch_size=5"])
    assert err.field == "trainer.micro_batch_size"
    assert "trainer.micro_batch_size <= 4" in str(err)


# --- resolve_world --------------------------------------------------------------------------

def test_resolve_world_defaults_ep_to_all_ranks():
    cfg = load_config(None)
    resolved = cfg.resolve_world(4)
    assert resolved.parallel.world_size == 4 and resolved.parallel.expert_parallel_size == 4
    assert cfg.parallel.world_size is None and cfg.parallel.expert_parallel_size is None


def test_resolve_world_keeps_explicit_ep():
    resolved = load_config(None, ["parallel.expert_parallel_size=2"]).resolve_world(8)
    assert resolved.parallel.expert_parallel_size == 2


def test_resolve_world_validates():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["parallel.expert_parallel_size=4"]).resolve_world(6)
    assert info.value.field == "parallel.expert_parallel_size"
    with pytest.raises(ConfigError) as info:
        load_config(None).resolve_world(16)  # tiny has 8 experts
    assert info.value.field == "model.num_experts"


def test_resolve_world_rejects_a_different_configured_world():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["parallel.world_size=4"]).resolve_world(8)
    assert info.value.field == "parallel.world_size"
    assert "parallel.world_size=8" in str(info.value)


# --- examples -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, algorithm", [("grpo_tiny", Algorithm.GRPO),
                                             ("ppo_tiny", Algorithm.PPO)])
def test_example_configs_load(name, algorithm):
    cfg = load_config(str(EXAMPLES / f"{name}.yaml"))
    assert cfg.trainer.algorithm is algorithm
    assert cfg.elastic.release_policy is ReleasePolicy.ELASTIC
    assert cfg.model.preset == "tiny" and cfg.model.num_experts == 8
    assert cfg.parallel.world_size == 4
    assert cfg.resolve_world(4).parallel.expert_parallel_size == 4
    # the main job's rollout: 2 replicas of 2 ranks, tail consolidation inside each
    assert cfg.rollout.replicas == 2 and cfg.elastic.consolidate
    assert not cfg.elastic.consolidate_across
    assert ElasticConfig().consolidate and not ElasticConfig().consolidate_across  # defaults
    # the simulator's hedge and correction: off by default, across replicas only
    assert ElasticConfig().consolidate_taker_hedge == 1.0
    assert not ElasticConfig().consolidate_correct
    cfg = load_config(None, ["elastic.consolidate_across=true", "elastic.consolidate_correct=true",
                             "elastic.consolidate_taker_hedge=1.25"])
    assert cfg.elastic.consolidate_correct and cfg.elastic.consolidate_taker_hedge == 1.25
    # the plan's estimates: off by default, read across replicas or by the pace rule
    assert not ElasticConfig().plan_estimates
    assert load_config(None, ["elastic.pace_model=unit",
                              "elastic.plan_estimates=true"]).elastic.plan_estimates


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs"))))
def test_every_example_config_loads(name):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "configs", name)
    cfg = load_config(path, [])
    world = cfg.parallel.world_size or cfg.parallel.expert_parallel_size or 4
    assert cfg.resolve_world(world).parallel.world_size == world


def test_the_gpu_example_runs_the_simulators_gpu_policy():
    """The GPU starting config is the rollout the simulator's paper-like figures are for: its
    replicas of one node, a floor of the whole replica, a plan by modelled seconds, consolidation
    across replicas with the GPU scenarios' taker hedge and online correction (on modelled
    seconds), and their placement limits."""
    from flexfloor.sim.scenarios import ON_GPUS, SCENARIOS

    cfg = load_config(str(EXAMPLES / "grpo_qwen3_30b_a3b_gpu.yaml")).resolve_world(64)
    sim = SCENARIOS["paper-like"]
    assert cfg.rollout.replicas == sim.replicas and sim.gpus == 64
    assert cfg.elastic.min_active_ranks == ON_GPUS["min_active_ranks"] == 64 // cfg.rollout.replicas
    assert cfg.elastic.consolidate and cfg.elastic.consolidate_across
    assert cfg.elastic.consolidate_taker_hedge == ON_GPUS["taker_hedge"]
    assert cfg.scheduler.plan_seconds and cfg.elastic.pace_model == sim.accelerator
    assert cfg.elastic.consolidate_correct and ON_GPUS["correct"]
    assert cfg.scheduler.max_share == ON_GPUS["max_share"]
    assert cfg.scheduler.load_cap == ON_GPUS["load_cap"]
    assert cfg.rollout.max_batch_size == sim.max_batch_size
    assert cfg.rollout.max_new_tokens == sim.max_len


@pytest.mark.parametrize("overrides, field, says", [
    (["scheduler.plan_seconds=true", "rollout.replicas=2", "parallel.world_size=4"],
     "scheduler.plan_seconds", "elastic.pace_model=H800"),
    (["scheduler.plan_seconds=true", "elastic.pace_model=H800", "parallel.world_size=4"],
     "scheduler.plan_seconds", "rollout.replicas > 1"),
])
def test_a_plan_by_seconds_needs_a_cost_model_and_replicas(overrides, field, says):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.field == field and says in str(info.value)
    ok = load_config(None, ["scheduler.plan_seconds=true", "elastic.pace_model=H800",
                            "rollout.replicas=2", "parallel.world_size=4"])
    assert ok.scheduler.plan_seconds and not SchedulerConfig().plan_seconds
    # the correction keeps the plan's end on the clock the plan gives it in (modelled seconds)
    both = load_config(None, ["scheduler.plan_seconds=true", "elastic.pace_model=H800",
                              "rollout.replicas=2", "parallel.world_size=4",
                              "elastic.consolidate_across=true", "elastic.consolidate_correct=true"])
    assert both.scheduler.plan_seconds and both.elastic.consolidate_correct
