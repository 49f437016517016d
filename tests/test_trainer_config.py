"""The trainer's and data's config fields: defaults, refusals naming the field and the fix."""

import pytest

from flexfloor.config import ConfigError, RolloutIS, load_config


def _error(*overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return info.value


def test_defaults_dual_clip_on_rollout_is_off_no_validation():
    t = load_config(None, []).trainer
    assert t.clip_ratio_c == 3.0 and t.rollout_is is RolloutIS.NONE and t.val_interval == 0
    assert load_config(None, ["trainer.clip_ratio_c=null"]).trainer.clip_ratio_c is None
    t = load_config(None, ["trainer.rollout_is=truncated", "trainer.rollout_is_cap=1.5"]).trainer
    assert t.rollout_is is RolloutIS.TRUNCATED and t.rollout_is_cap == 1.5


def test_grpo_with_one_sample_per_prompt_is_refused_at_start_up():
    e = _error("rollout.samples_per_prompt=1", "trainer.micro_batch_size=1")
    assert e.field == "rollout.samples_per_prompt" and "learns nothing" in str(e)
    assert "samples_per_prompt >= 2" in str(e)
    # PPO learns from one sample per prompt (its critic is the baseline)
    load_config(None, ["rollout.samples_per_prompt=1", "trainer.micro_batch_size=1",
                       "trainer.algorithm=ppo"])


@pytest.mark.parametrize("overrides, field, says", [
    (["trainer.clip_ratio_c=1.0"], "trainer.clip_ratio_c", "above 1"),
    (["trainer.rollout_is=clipped"], "trainer.rollout_is", "truncated"),
    (["trainer.rollout_is_cap=0"], "trainer.rollout_is_cap", "> 0"),
    (["trainer.val_interval=-1"], "trainer.val_interval", ">= 0"),
    (["trainer.val_samples=0"], "trainer.val_samples", "> 0"),
    (["data.val_size=4", "data.val_files=[v.parquet]"], "data.val_size", "data.val_files=[]"),
    (["data.source=reasoning_gym"], "data.task", "data.task=basic_arithmetic"),
    (["data.source=parquet"], "data.train_files", "parquet"),
    (["data.source=synthetic", "data.train_files=[a.parquet]"], "data.train_files",
     "data.source=parquet"),
    (["reward.custom_fn=my_reward.py"], "reward.custom_fn", "file.py:function"),
])
def test_bad_trainer_and_data_fields_name_the_field(overrides, field, says):
    e = _error(*overrides)
    assert e.field == field and says in str(e), str(e)
