"""Starting RL from a converted Hugging Face checkpoint: `checkpoint.init_from` (weights only).

tests/workers/init_from.py on 2 gloo workers (the session's 2-worker launch): a tiny random `transformers`
Qwen3-MoE model, converted with the CLI, trained with the example config and the model section
of the converter's model.yaml.
"""

import math

import pytest

from distributed import Worker
from flexfloor.config import ConfigError, load_config

WORKER = Worker("init_from.py", 2, timeout=300)

TOL = 1e-5  # fp32 logits, max |FlexFloor - transformers|


@pytest.fixture(scope="module")
def launch(shared):
    run = shared.run(WORKER)
    return run.results, run.proc.stdout, str(run.out)


@pytest.fixture(scope="module")
def res(launch):
    return launch[0]


def test_weights_come_from_the_converted_checkpoint(res):
    for r in res:
        print(f"max|diff| {r['logits_max_abs_diff']:.3g} (logits up to {r['logits_max_abs']:.3g})")
        assert r["logits_max_abs"] > 0.1 and r["logits_max_abs_diff"] <= TOL
        assert r["start_step"] == 0 and r["start_cursor"] == {"epoch": 0, "position": 0,
                                                                  "deferred": []}
        assert r["optimizer_fresh"]


def test_a_grpo_step_trains_with_the_converted_weights_as_kl_reference(res):
    for r in res:
        assert r["step"] == 1 and math.isfinite(r["loss"])
        assert r["changed"] and r["reference_is_init"]
        assert r["warm_start_key_differs"]  # a random init's cached warm start is not reused


def test_a_resume_wins_over_init_from_and_says_so(launch):
    res, stdout, d = launch
    for r in res:
        assert r["resumed_step"] == 1 and r["resumed_equals_trained"]
    assert f"initialised the weights from checkpoint.init_from={d}/ckpt" in stdout
    assert f"resumed from iter_0000001 ({d}/run_ckpt); checkpoint.init_from={d}/ckpt ignored" in stdout


def test_bad_starts_are_refused_by_field(res):
    for r in res:
        load = r["load_converted_error"]
        assert "CheckpointError" in load and "holds weights only" in load
        assert "checkpoint.init_from=" in load and "checkpoint.load=null" in load
        shape = r["other_shape_error"]
        assert "another model shape (model.num_layers: checkpoint 2 vs config 1)" in shape
        assert "checkpoint.init_from=" in shape


def test_load_and_init_from_together_are_a_config_error():
    with pytest.raises(ConfigError, match=r"checkpoint\.init_from: .*checkpoint\.load=.*set one "
                                          r"of them to null") as e:
        load_config(None, ["checkpoint.load=runs/a", "checkpoint.init_from=runs/b"])
    assert e.value.field == "checkpoint.init_from"
