"""The GRPO step loop on 2 real gloo workers (the session's 2-worker launch): updates,
static == elastic, resume."""

import math

import pytest

from distributed import Worker

WORKER = Worker("trainer.py", 2)


@pytest.fixture(scope="module")
def res(shared):
    return shared.run(WORKER).results


def test_two_grpo_steps_change_the_weights_with_finite_losses(res):
    for rank in res:
        assert all(math.isfinite(x) for x in rank["losses"])
        assert rank["changed"] == [True, True]


def test_step_after_static_rollout_equals_step_after_elastic(res):
    assert [r["static_equals_elastic"] for r in res] == [True, True]


def test_resume_continues_exactly(res):
    for r in res:
        assert r["resumed_step"] == 1
        assert r["resumed_cursor"] == {"epoch": 0, "position": 4, "deferred": []}
        assert r["resumed_history_uids"] == 4  # the length history came back too
        assert r["resume_equals_uninterrupted"] is True
        assert r["helpers_after_save"] == []  # the write results came back in process


def test_ppo_trains_actor_and_critic_with_a_frozen_reference(res):
    for r in res:
        assert all(math.isfinite(x) for x in r["ppo_losses"])
        assert r["ppo_actor_changed"] and r["ppo_critic_changed"]
        assert r["ppo_kl_ref_frozen"] is True  # the reference is the starting policy, unchanged
        assert r["ppo_resume_equals_uninterrupted"] is True  # critic + reference came back too


VAL_KEYS = ["val/response_length/mean", "val/reward/mean", "val/solved"]


def test_trainer_logprobs_equal_the_engines_at_the_sampling_temperature(res):
    for r in res:
        assert r["diff_t1"][1] < 1e-5, r["diff_t1"]  # T = 1 (fp32, same tokens)
        assert r["diff_t07"][1] < 1e-5, r["diff_t07"]  # T = 0.7
        assert 0 < r["diff_t07"][0] <= r["diff_t07"][1] or r["diff_t07"][1] == 0
        assert r["diff_t07_dropped"] > 1e-2  # the check sees a dropped temperature


def test_truncated_importance_sampling_runs_with_weights_near_one(res):
    for r in res:
        assert abs(r["is_weight_mean"] - 1.0) < 1e-4 and r["is_changed"]


def test_validation_at_the_interval_on_prompts_never_trained_on(res):
    for r in res:
        assert r["val_steps"] == [[], VAL_KEYS, VAL_KEYS]  # steps 2 (interval) and 3 (the end)
        assert r["val_disjoint"] and r["trained_uids_are_train"] and r["trained_no_val_uid"]
        assert 0 < r["val_count"] <= r["val_in_file"]
    assert res[0]["val_lines"] == [[], VAL_KEYS, VAL_KEYS]


def test_distributed_grpo_gradient_equals_the_single_process_gradient(res):
    for r in res:
        assert r["nonzero_advantages"] > 0 and r["grad_scale"] > 1e-4
        assert r["grad_diff"] <= 1e-5 * r["grad_scale"], (r["grad_diff"], r["grad_scale"])


def test_a_plan_by_modelled_seconds_trains_to_the_same_weights(res):
    """scheduler.plan_seconds with elastic.pace_model=H800 on 2 replicas, consolidation across
    them and the correction on modelled seconds: the job plans by seconds (static's end bounds
    it: at most 24 new tokens, milliseconds a step on an H800, so well under a second, where a
    plan by steps would bound it by steps) and trains to case 1's weights; with history for
    every prompt (the next epoch) its replicas decide on modelled clocks that price every step
    and keep the plan's end (no correction is forced: whether one comes is the lengths'), each
    running request predicted from the plan (elastic.plan_estimates), every prompt from its
    history."""
    for r in res:
        assert r["seconds_plan_equals_elastic"] is True
        by_seconds, bound = r["seconds_plan"]
        assert by_seconds and 0 < bound < 1.0
        # in the next epoch (every prompt with history) the job ran the replicas on modelled
        # clocks (every step of the rank priced, in seconds of the same order as the plan's)
        # and they kept the plan's end
        clock = r["seconds_clock"]
        assert clock["kind"] == "ModelledClock" and clock["end_bound"] == bound, clock
        assert clock["priced"] == clock["steps"] > 0 and 0 < clock["seconds"] < 1.0, clock
        assert r["seconds_estimates"] is True
