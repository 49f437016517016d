"""The bad-input catalogue: every bad input of issues 9 and 17, how it is refused, and the tests
that cover it.

Each error names the problem and the fix, and is raised before anything is written: config
problems before any worker starts (exit code 2), data, tokenizer and checkpoint problems while
the Job is set up (before the run folder exists), a failed checkpoint write or a NaN loss at its
step (never silently). CATALOGUE holds, for each input, how it is refused and the tests that
cover it (here or elsewhere); the catalogue tests check every entry's behaviour (config: exit 2,
the field, the fix, nothing written; job: rank, phase and step, the fix, no run folder) and that
every named test exists.
"""

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from distributed import REPO, Worker
from flexfloor.config import ConfigError, load_config

@dataclass(frozen=True)
class Bad:
    """One bad input: what it is, how it is refused, and the tests that cover it.

    `config` entries are refused by the entry point before any worker starts: exit 2, one
    `config error: FIELD: ...` line, nothing written (`overrides`, or `yaml` written as the
    --config file; "{dir}" as --config means a directory). `job` entries are refused while the
    Job starts (or at their step): `job` names the case of tests/workers/fault_inputs.py, which
    records the error's origin (rank, phase, step; the entry point prints it on one line and
    exits 1) and whether the run folder was written."""

    tests: tuple
    says: tuple  # phrases of the message: the field (or file:line:column) and the fix
    field: str = ""  # config: the ConfigError's field
    overrides: tuple = ()
    yaml: str | None = None
    world: int = 1
    job: str = ""  # job: the fault_inputs case
    phase: str = "set-up"
    step: int = 0


CATALOGUE = {
    "unknown config key (with a suggestion)": Bad(
        ("test_bad_inputs::test_unknown_config_key", "test_bad_inputs::test_entry_point_bad_config",
         "test_config::test_unknown_key_suggests_the_close_one",
         "test_config::test_unknown_key_in_yaml_file", "test_config::test_unknown_section"),
        ("did you mean 'steps'?",), field="trainer.stpes", overrides=("trainer.stpes=3",)),
    "wrong type": Bad(("test_bad_inputs::test_wrong_type", "test_config::test_wrong_type"),
                      ("expected float, got str 'fast'",), field="trainer.lr",
                      overrides=("trainer.lr=fast",)),
    "EP size larger than world": Bad(
        ("test_bad_inputs::test_ep_larger_than_world", "test_config::test_ep_larger_than_world"),
        ("set parallel.expert_parallel_size <= 2 or launch more workers",),
        field="parallel.expert_parallel_size", overrides=("parallel.expert_parallel_size=4",),
        world=2),
    "too few experts for the floor": Bad(
        ("test_bad_inputs::test_too_few_experts_for_the_floor",
         "test_config::test_experts_fewer_than_ep_ranks"),
        ("fewer than the 4 EP ranks",), field="model.num_experts",
        overrides=("model.num_experts=2", "model.moe_router_topk=1"), world=4),
    "memory budget that cannot hold the floor": Bad(
        ("test_bad_inputs::test_memory_budget_that_cannot_hold_a_request",
         "test_config::test_kv_budget_must_hold_one_request",
         "test_elastic::test_memory_floor_stops_the_shrink_and_keeps_tokens"),
        ("set it >= 240",), field="rollout.kv_budget_tokens",
        overrides=("rollout.kv_budget_tokens=200", "data.max_prompt_len=100",
                   "rollout.max_new_tokens=128")),
    "tokenizer file that does not exist": Bad(
        ("test_bad_inputs::test_catalogue_config_entry_exits_2_naming_the_field",
         "test_bad_inputs::test_example_script_config_error_exits_2_printed_once"),
        ("/nope/tok.json: no such file or folder", "data.tokenizer=null for the bundled one"),
        field="data.tokenizer", overrides=("data.tokenizer=/nope/tok.json",)),
    "prompt file that does not exist": Bad(
        ("test_bad_inputs::test_catalogue_config_entry_exits_2_naming_the_field",),
        ("/nope.parquet: no such file", "verl-format parquet file"),
        field="data.train_files[0]", overrides=("data.train_files=[/nope.parquet]",)),
    "reward function file that does not exist": Bad(
        ("test_bad_inputs::test_catalogue_config_entry_exits_2_naming_the_field",),
        ("file /nope.py not found", "reward.custom_fn=my_reward.py:compute_score"),
        field="reward.custom_fn", overrides=("reward.custom_fn=/nope.py:f",)),
    "reasoning-gym task that does not exist (with a suggestion)": Bad(
        ("test_bad_inputs::test_catalogue_config_entry_exits_2_naming_the_field",
         "test_data::test_reasoning_gym_source_round_trips_through_parquet_and_scores_with_its_"
         "own_scorer"),
        ("'basic_arithmatic' is not a reasoning-gym task; did you mean 'basic_arithmetic'?",),
        field="data.task", overrides=("data.source=reasoning_gym", "data.task=basic_arithmatic")),
    "checkpoint to load or start from that does not exist": Bad(
        ("test_bad_inputs::test_catalogue_config_entry_exits_2_naming_the_field",),
        ("/nope/ckpt: does not exist; give a checkpoint root", "checkpoint.load=null"),
        field="checkpoint.load", overrides=("checkpoint.load=/nope/ckpt",)),
    "malformed YAML (file, line, column)": Bad(
        ("test_bad_inputs::test_yaml_syntax_error_names_file_line_column",),
        ("expected ',' or ']'", "fix the YAML syntax there"), field="{file}:3:1",
        yaml="trainer:\n  steps: [3\n"),
    "tab in YAML": Bad(("test_bad_inputs::test_yaml_tab_names_file_line_column",),
                       ("indent with spaces",), field="{file}:2:1", yaml="trainer:\n\tsteps: 3\n"),
    "duplicate YAML key": Bad(("test_bad_inputs::test_yaml_duplicate_key_refused",),
                              ("is set twice, at {file}:2:3 and {file}:3:3; keep one of them",),
                              field="trainer.steps", yaml="trainer:\n  steps: 3\n  steps: 4\n"),
    "a directory as --config": Bad(("test_bad_inputs::test_config_path_is_a_directory_or_missing",
                                    "test_bad_inputs::test_example_script_config_error_exits_2_"
                                    "printed_once"),
                                   ("is a directory; give a YAML file",), field="--config",
                                   yaml="{dir}"),
    "non-finite number": Bad(("test_bad_inputs::test_non_finite_numbers_refused_by_field",
                              "test_bad_inputs::test_example_script_config_error_exits_2_"
                              "printed_once"),
                             ("must be a finite number, got inf",), field="parallel.timeout_s",
                             overrides=("parallel.timeout_s=.inf",)),
    "context too short for prompts (a suggestion that can be followed)": Bad(
        ("test_bad_inputs::test_suggestions_can_be_followed",
         "test_config::test_max_new_tokens_reaches_max_seq_len"),
        ("data.max_prompt_len=25 rollout.max_new_tokens=25", "model.max_seq_len to at least 256"),
        field="data.max_prompt_len", overrides=("model.max_seq_len=50",)),
    "prompt longer than the context": Bad(
        ("test_bad_inputs::test_prompt_longer_than_the_context",
         "test_config::test_max_new_tokens_reaches_max_seq_len",
         "test_engine::test_bad_input_fails_on_every_rank_and_empty_returns_at_once"),
        ("more than data.max_prompt_len=8", "raise data.max_prompt_len"), job="prompt_too_long"),
    "empty data set": Bad(("test_bad_inputs::test_empty_data_set",
                           "test_bad_inputs::test_entry_point_bad_data",
                           "test_data::test_read_empty_data_set"),
                          ("has 0 rows", "needs at least one prompt"), job="empty_data"),
    "parquet file with missing columns": Bad(
        ("test_bad_inputs::test_parquet_missing_columns", "test_data::test_read_missing_columns",
         "test_data::test_read_missing_nested_field"),
        ("missing column(s) ['reward_model', 'extra_info']",), job="missing_columns"),
    "parquet cell of the wrong type (file, row, column)": Bad(
        ("test_bad_inputs::test_parquet_type_error_names_file_row_and_column",
         "test_bad_inputs::test_parquet_plain_string_prompt_is_the_prompt_text"),
        ("type.parquet row 0, column prompt: expected a list of chat messages", "got int 7"),
        job="parquet_type"),
    "empty prompt (by row)": Bad(("test_bad_inputs::test_parquet_empty_prompt_refused_by_row",),
                                 ("empty_prompt.parquet row 1, column prompt: the prompt is empty",
                                  "remove the row"), job="parquet_empty_prompt"),
    "tokenizer vocabulary does not match the model": Bad(
        ("test_bad_inputs::test_tokenizer_vocabulary_mismatch", "test_data::test_check_vocab"),
        ("tokenizer vocab_size 101 does not fit the model's vocab_size 64",
         "set the model config's vocab_size to at least 101"), job="tokenizer_vocab"),
    "checkpoint.dir that cannot be written": Bad(
        ("test_bad_inputs::test_checkpoint_dir_not_writable_refused_at_start",),
        ("cannot hold checkpoints (NotADirectoryError", "give a directory this job can create"),
        job="ckpt_dir_unwritable"),
    "checkpoint.dir in use by another job": Bad(
        ("test_bad_inputs::test_second_job_on_a_checkpoint_dir_is_refused_and_a_stale_lock_taken"
         "_over", "test_faults::test_no_process_of_the_job_outlives_it"),
        ("is in use by another job (pid", "started 2026-01-01T00:00:00Z",
         "use another checkpoint.dir or stop that job"), job="ckpt_dir_in_use"),
    "checkpoint of another model shape": Bad(
        ("test_bad_inputs::test_checkpoint_of_another_model_shape",
         "test_foundation::test_bad_checkpoints_are_refused_with_the_reason"),
        ("another model shape (model.num_layers: checkpoint 3 vs config 2)",
         "set checkpoint.resume=off"), job="checkpoint_shape", phase="checkpoint load"),
    "truncated checkpoint": Bad(
        ("test_bad_inputs::test_truncated_checkpoint",
         "test_foundation::test_bad_checkpoints_are_refused_with_the_reason",
         "test_checkpoint_crash::test_crash_mid_save_keeps_previous_checkpoint",
         "test_bad_inputs::test_orphan_checkpoint_newer_than_latest_is_replaced",
         "test_faults::test_half_written_checkpoint_was_never_loaded"),
        ("__0_0.distcp has 500 bytes, the manifest says 1000", "load an earlier checkpoint"),
        job="checkpoint_truncated", phase="checkpoint load"),
    "checkpoint write failure (disk full)": Bad(
        ("test_bad_inputs::test_checkpoint_write_failure_is_one_error_naming_rank_phase_step",),
        ("iter_0000001.tmp failed (", "MiB free there)", "free space or fix the permissions"),
        job="save_fails", phase="checkpoint save", step=1),
    "NaN loss (skip or stop)": Bad(("test_bad_inputs::test_nan_loss_stops",
                                    "test_bad_inputs::test_nan_loss_skips_loudly"),
                                   ("step 1: non-finite loss", "trainer.nan_policy=skip"),
                                   job="nan_stop", phase="train", step=1),
}


def test_catalogue_is_complete():
    assert len(CATALOGUE) == 28
    for name, bad in CATALOGUE.items():
        assert bool(bad.field) != bool(bad.job), name  # a config entry or a job entry
        for ref in bad.tests:
            module, fn = ref.split("::")
            assert hasattr(importlib.import_module(module), fn), (name, ref)
    print(f"bad inputs covered: {len(CATALOGUE)}, by "
          f"{len({t for b in CATALOGUE.values() for t in b.tests})} tests")


@pytest.mark.parametrize("name", [n for n, b in CATALOGUE.items() if b.field])
def test_catalogue_config_entry_exits_2_naming_the_field(name, tmp_path, monkeypatch, capfd):
    """The entry point (flexfloor.train.main, as torchrun runs it): exit 2, one line that
    starts with the field, each phrase of the fix, nothing written."""
    from flexfloor import train

    bad = CATALOGUE[name]
    work = tmp_path / "work"
    work.mkdir()
    argv = [f"logging.run_dir={work / 'run'}", f"checkpoint.dir={work / 'ckpt'}",
            *bad.overrides]
    file = ""
    if bad.yaml == "{dir}":
        file = str(tmp_path)
    elif bad.yaml is not None:
        file = str(tmp_path / "bad.yaml")
        (tmp_path / "bad.yaml").write_text(bad.yaml)
    if file:
        argv = ["--config", file, *argv]
    monkeypatch.setenv("WORLD_SIZE", str(bad.world))
    monkeypatch.chdir(work)
    assert train.main(argv) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {bad.field.format(file=file)}: ")
    for phrase in bad.says:
        assert phrase.format(file=file) in lines[0], (name, lines[0])
    assert os.listdir(work) == []


@pytest.mark.parametrize("name", [n for n, b in CATALOGUE.items() if b.job])
def test_catalogue_job_entry_is_refused_where_it_is_found(name, job_errors):
    """Found while the Job starts (or at its step): the error names the rank, the phase and
    the step, each phrase of the fix; no run folder written before it."""
    bad = CATALOGUE[name]
    res = job_errors[bad.job]
    assert res["origin"] == f"rank 0, phase '{bad.phase}', step {bad.step}", (name, res)
    text = res.get("message") or res.get("error")
    for phrase in bad.says:
        assert phrase in text, (name, text)
    if bad.step == 0:
        assert res["run_dir_written"] is False


def config_error(*overrides, world=None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        cfg = load_config(None, list(overrides))
        if world is not None:
            cfg.resolve_world(world)
    return e.value


# ------------------------------------------------------------------- config (no worker starts)


def test_unknown_config_key():
    e = config_error("trainer.stpes=3")
    assert e.field == "trainer.stpes" and "did you mean 'steps'?" in str(e)


def test_wrong_type():
    e = config_error("trainer.lr=fast")
    assert e.field == "trainer.lr" and "expected float, got str 'fast'" in str(e)


def test_ep_larger_than_world():
    e = config_error("parallel.expert_parallel_size=4", world=2)
    assert e.field == "parallel.expert_parallel_size"
    assert "set parallel.expert_parallel_size <= 2 or launch more workers" in str(e)


def test_too_few_experts_for_the_floor():
    # each rank of the EP group, down to the floor, must hold at least one expert
    e = config_error("model.num_experts=2", "model.moe_router_topk=1", world=4)
    assert e.field == "model.num_experts" and "fewer than the 4 EP ranks" in str(e)
    e = config_error("elastic.min_active_ranks=3", "parallel.expert_parallel_size=2", world=2)
    assert e.field == "elastic.min_active_ranks" and "set elastic.min_active_ranks <= 2" in str(e)


def test_memory_budget_that_cannot_hold_a_request():
    # borrowed experts take KV room, so the group stops shrinking where the budget ends (the
    # memory floor, test_elastic); a budget without room for one request cannot run at all
    e = config_error("rollout.kv_budget_tokens=200", "data.max_prompt_len=100",
                     "rollout.max_new_tokens=128")
    # 228 tokens in whole blocks of rollout.kv_block_tokens=16
    assert e.field == "rollout.kv_budget_tokens" and "set it >= 240" in str(e)


def test_entry_point_bad_config(tmp_path):
    """`python -m flexfloor.train` with a typo: exit 2, the message, nothing written."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flexfloor.train", "--config",
         os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml"), "trainer.stesp=3",
         f"logging.run_dir={run}"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2
    assert "trainer.stesp: unknown key; did you mean 'steps'?" in proc.stderr
    assert not run.exists() and os.listdir(tmp_path) == []


def test_entry_point_checks_the_run_and_checkpoint_folders_before_any_worker(tmp_path):
    """A run folder or checkpoint folder that cannot be made is a config error (exit 2) from
    `--check-config`, which the example scripts run before torchrun; nothing is created."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    one = ["parallel.world_size=1", "parallel.expert_parallel_size=1", "rollout.replicas=1"]
    for override, says in (
            (f"logging.run_dir={a_file}/run", f"logging.run_dir {a_file}/run: {a_file} is a file, "
                                              "so the folder cannot be made"),
            (f"checkpoint.dir={a_file}", f"checkpoint.dir {a_file}: is a file; give a folder"),
            (f"logging.run_dir={tmp_path}/new/nested", None)):
        proc = subprocess.run(
            [sys.executable, "-m", "flexfloor.train", "--check-config", "--config",
             os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml"), *one, override],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
            env=dict(os.environ, PYTHONPATH=REPO, WORLD_SIZE="1"))
        if says is None:
            assert proc.returncode == 0, proc.stderr
        else:
            assert proc.returncode == 2 and f"config error: {says}" in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


@pytest.mark.parametrize("override, says", [
    (None, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set: start FlexFloor with torchrun"),
    ("parallel.backend=nccl", "parallel.backend=nccl needs CUDA, and none is available"),
])
def test_entry_point_started_wrong_says_the_fix_without_a_traceback(tmp_path, override, says):
    """`python -m flexfloor.train` without torchrun, or asked for NCCL on a machine without
    CUDA: exit 1 with one line that says the fix, no traceback, no run folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flexfloor.train", "--config",
         os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml"),
         "parallel.world_size=1", "parallel.expert_parallel_size=1", "rollout.replicas=1",
         f"logging.run_dir={run}", *([override] if override else [])],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=dict(env, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("[flexfloor] error:")]
    assert len(errors) == 1 and "LaunchSetupError: " in errors[0] and says in errors[0], errors
    assert not run.exists()


def test_entry_point_bad_data(tmp_path):
    """A start-up error under torchrun: the worker exits non-zero with one line that names the
    rank, the phase and the problem; no run folder, no checkpoint."""
    from flexfloor.data import write_examples

    empty = tmp_path / "empty.parquet"
    write_examples([], empty)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
         "--standalone", "-m", "flexfloor.train",
         "--config", os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml"),
         "parallel.world_size=1", "parallel.expert_parallel_size=1", "rollout.replicas=1",
         f"data.train_files=[{empty}]", f"logging.run_dir={tmp_path / 'run'}",
         f"checkpoint.dir={tmp_path / 'ckpt'}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=180, env=env)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("[flexfloor] error:")]
    assert lines, proc.stderr[-3000:]
    assert all("phase 'set-up', step 0: ValueError:" in x and "has 0 rows" in x for x in lines)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------- found when the Job starts (1 worker)


WORKER = Worker("fault_inputs.py", 1, timeout=300)  # in the session's 1-worker launch


@pytest.fixture(scope="module")
def job_errors(shared):
    run = shared.run(WORKER)
    return dict(run.results, stdout=run.proc.stdout)


def refused_at_start(res, phase, *phrases):
    assert res["origin"] == f"rank 0, phase '{phase}', step 0"
    for p in phrases:
        assert p in res["message"], res["message"]
    assert res["run_dir_written"] is False  # nothing partial written


def test_prompt_longer_than_the_context(job_errors):
    refused_at_start(job_errors["prompt_too_long"], "set-up", "more than data.max_prompt_len=8",
                     "raise data.max_prompt_len")


def test_empty_data_set(job_errors):
    refused_at_start(job_errors["empty_data"], "set-up", "has 0 rows",
                     "needs at least one prompt")


def test_parquet_missing_columns(job_errors):
    refused_at_start(job_errors["missing_columns"], "set-up",
                     "missing column(s) ['reward_model', 'extra_info']")


def test_tokenizer_vocabulary_mismatch(job_errors):
    refused_at_start(job_errors["tokenizer_vocab"], "set-up",
                     "tokenizer vocab_size 101 does not fit the model's vocab_size 64",
                     "set the model config's vocab_size to at least 101")


def test_checkpoint_of_another_model_shape(job_errors):
    refused_at_start(job_errors["checkpoint_shape"], "checkpoint load",
                     "another model shape (model.num_layers: checkpoint 3 vs config 2)",
                     "set checkpoint.resume=off")


def test_truncated_checkpoint(job_errors):
    refused_at_start(job_errors["checkpoint_truncated"], "checkpoint load",
                     "__0_0.distcp has 500 bytes, the manifest says 1000",
                     "load an earlier checkpoint")


def test_nan_loss_stops(job_errors):
    res = job_errors["nan_stop"]
    assert res["origin"] == "rank 0, phase 'train', step 1"
    assert "step 1: non-finite loss" in res["error"] and "trainer.nan_policy=skip" in res["error"]
    assert res["weights_unchanged"] is True and res["checkpoints"] == []


def test_nan_loss_skips_loudly(job_errors):
    res = job_errors["nan_skip"]  # the step is logged with its NaN loss, the update dropped
    assert res["error"] is None and res["step_index"] == 1
    assert res["loss"] != res["loss"]  # NaN
    assert res["weights_unchanged"] is True
    assert ("[flexfloor] step 1: non-finite loss or gradient (nan); the update was not applied "
            "(trainer.nan_policy=skip)") in job_errors["stdout"]


def test_orphan_checkpoint_newer_than_latest_is_replaced(job_errors):
    assert job_errors["nan_skip"]["orphan_replaced"] is True


# ------------------------------------------------- config files (issue 17: read before workers)


def _yaml(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_file_error(path, *overrides) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return e.value


def test_yaml_syntax_error_names_file_line_column(tmp_path):
    path = _yaml(tmp_path, "trainer:\n  steps: [3\n")
    e = config_file_error(path)
    assert str(e).startswith(f"{path}:3:1: expected ',' or ']'") and "fix the YAML syntax" in str(e)


def test_yaml_tab_names_file_line_column(tmp_path):
    path = _yaml(tmp_path, "trainer:\n\tsteps: 3\n")
    e = config_file_error(path)
    assert e.field == f"{path}:2:1" and "indent with spaces" in str(e)


def test_yaml_duplicate_key_refused(tmp_path):
    path = _yaml(tmp_path, "trainer:\n  steps: 3\n  lr: 1.0e-4\n  steps: 4\n")
    e = config_file_error(path)
    assert e.field == "trainer.steps"
    assert f"set twice, at {path}:2:3 and {path}:4:3; keep one of them" in str(e)
    e = config_file_error(_yaml(tmp_path, "trainer: {steps: 3}\ntrainer: {lr: 1.0}\n", "s.yaml"))
    assert e.field == "trainer" and "set twice" in str(e)


def test_config_path_is_a_directory_or_missing(tmp_path):
    e = config_file_error(str(tmp_path))
    assert e.field == "--config" and "is a directory; give a YAML file" in str(e)
    e = config_file_error(str(tmp_path / "nope.yaml"))
    assert e.field == "--config" and "does not exist" in str(e)


def test_non_finite_numbers_refused_by_field(tmp_path):
    e = config_error("parallel.timeout_s=.inf")
    assert e.field == "parallel.timeout_s" and "must be a finite number, got inf" in str(e)
    e = config_file_error(_yaml(tmp_path, "trainer:\n  lr: .nan\n"))
    assert e.field == "trainer.lr" and "finite" in str(e)
    # the words without YAML's dot read as text: refused as numbers that are not finite, not
    # with the hint to drop quotes nobody wrote
    for word in ("inf", "-Infinity", "nan", "NaN"):
        e = config_error(f"trainer.lr={word}")
        assert e.field == "trainer.lr" and "must be a finite number" in str(e), str(e)
        assert "without quotes" not in str(e)


def test_out_of_range_seeds_timeouts_and_blank_paths_refused_by_field():
    """Values no generator or timer takes fail in the config, naming the field, not as an
    overflow deep in a worker; '' for an optional path is refused, not taken as unset (a run
    asked to save would otherwise save nothing)."""
    for override, field, says in (
            ("model.seed=4294967296", "model.seed", "must be <= 2147483647, got 4294967296"),
            ("rollout.seed=9223372036854775808", "rollout.seed", "must be <= "),
            ("parallel.timeout_s=1e12", "parallel.timeout_s", "must be <= 604800"),
            ("checkpoint.dir=''", "checkpoint.dir", "is empty; give a path, or null"),
            ("checkpoint.init_from=' '", "checkpoint.init_from", "is empty")):
        e = config_error(override)
        assert e.field == field and says in str(e), (override, str(e))
    cfg = load_config(None, [f"model.seed={2**31 - 1}", "rollout.seed=0",
                             "parallel.timeout_s=604800", "checkpoint.dir=null"])
    assert cfg.model.seed == 2**31 - 1 and cfg.checkpoint.dir is None


def test_suggestions_can_be_followed():
    """model.max_seq_len=50 (under data.max_prompt_len=128) must not suggest a negative
    rollout.max_new_tokens; following the suggestion gives a valid config."""
    e = config_error("model.max_seq_len=50")
    assert e.field == "data.max_prompt_len" and "-" not in str(e).split(";", 1)[1]
    assert "data.max_prompt_len=25 rollout.max_new_tokens=25" in str(e)
    load_config(None, ["model.max_seq_len=50", "data.max_prompt_len=25",
                       "rollout.max_new_tokens=25"])
    e = config_error("model.max_seq_len=200")
    assert e.field == "rollout.max_new_tokens" and "rollout.max_new_tokens <= 72" in str(e)
    load_config(None, ["model.max_seq_len=200", "rollout.max_new_tokens=72"])
    # YAML 1.1 reads off/on as bools: an enum that has the word takes it
    assert load_config(None, ["checkpoint.resume=off"]).checkpoint.resume.value == "off"


def test_example_script_config_error_exits_2_printed_once(tmp_path):
    """`bash examples/grpo_moe.sh` (through flexfloor.launch.local) checks the config once
    before torchrun starts any worker; so does flexfloor.launch.local in a user's own command.
    Under plain torchrun each node's local rank 0 alone prints it (torchrun adds its own
    failure summary)."""
    env = dict(os.environ, NPROC="4", RUN_DIR=str(tmp_path / "run"))
    # (what the check refuses is the catalogue's: here that the script checks once, first)
    for bad, says in (("data.tokenizer=/nope/tok.json",
                       "data.tokenizer: /nope/tok.json: no such file or folder"),):
        proc = subprocess.run(["bash", os.path.join(REPO, "examples", "grpo_moe.sh"), bad],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.count("config error:") == 1 and says in proc.stderr, proc.stderr
        assert "torch.distributed" not in proc.stderr + proc.stdout  # no worker started
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "grpo_moe.sh")],
                          capture_output=True, text=True, timeout=120,
                          env=dict(env, CONFIG=str(tmp_path)))
    assert proc.returncode == 2 and "is a directory; give a YAML file" in proc.stderr
    assert not (tmp_path / "run").exists()
    train = ["-m", "flexfloor.train", "--config", os.path.join(REPO, "examples", "configs",
             "grpo_tiny.yaml"), "parallel.world_size=2", "parallel.expert_parallel_size=2",
             f"logging.run_dir={tmp_path / 'run'}", "data.train_files=[/nope.parquet]"]
    says = "config error: data.train_files[0]: /nope.parquet: no such file; give the path"
    for launcher, code in (("flexfloor.launch.local", 2), ("torch.distributed.run", 1)):
        proc = subprocess.run([sys.executable, "-m", launcher, "--standalone",
                               "--nproc-per-node", "2", *train], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == code, (launcher, proc.stderr[-2000:])
        assert proc.stderr.count("config error:") == 1 and says in proc.stderr, proc.stderr
        if code == 2:  # checked before torchrun started a worker
            assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------- parquet cells (issue 17)


def _prompts_file(tmp_path, prompts, name="p.parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "x", "prompt": p, "reward_model": {"style": "rule",
             "ground_truth": "1"}, "extra_info": {"index": i, "split": "train"}}
            for i, p in enumerate(prompts)]
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_parquet_type_error_names_file_row_and_column(tmp_path):
    from flexfloor.data import read_examples

    path = _prompts_file(tmp_path, [5, 6])
    with pytest.raises(ValueError) as e:
        read_examples(path)
    assert str(e.value).startswith(f"{path} row 0, column prompt: expected a list of chat "
                                   "messages")
    assert "got int 5" in str(e.value)


def test_parquet_plain_string_prompt_is_the_prompt_text(tmp_path):
    from flexfloor.data import read_examples

    (ex,) = read_examples(_prompts_file(tmp_path, ["what is 1+1?"]))
    assert ex.prompt == "what is 1+1?"  # not iterated character by character


def test_parquet_empty_prompt_refused_by_row(tmp_path):
    from flexfloor.data import read_examples

    chat = ([{"role": "user", "content": "1+1="}], [{"role": "user", "content": "  "}])
    for name, prompts in (("chat", chat), ("text", ("1+1=", ""))):  # one type per column
        path = _prompts_file(tmp_path, list(prompts), name=f"{name}.parquet")
        with pytest.raises(ValueError) as e:
            read_examples(path)
        assert f"{path} row 1, column prompt: the prompt is empty" in str(e.value)


# ------------------------------------------------------ checkpoint.dir at start-up (issue 17)


def test_checkpoint_dir_not_writable_refused_at_start(tmp_path):
    from flexfloor.checkpoint import CheckpointError, lock_checkpoint_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError) as e:
        lock_checkpoint_dir(str(tmp_path / "file" / "ckpt"), print)
    assert f"checkpoint.dir={tmp_path / 'file' / 'ckpt'} cannot hold checkpoints" in str(e.value)
    assert "NotADirectoryError" in str(e.value)
    made = tmp_path / "new" / "ckpt"
    lock = lock_checkpoint_dir(str(made), print)  # created, probed, locked
    assert sorted(os.listdir(made)) == ["flexfloor.lock"]
    lock.release()
    assert os.listdir(made) == []


def test_second_job_on_a_checkpoint_dir_is_refused_and_a_stale_lock_taken_over(tmp_path,
                                                                               monkeypatch):
    from flexfloor.checkpoint import PREDECESSOR_ENV, CheckpointError, lock_checkpoint_dir
    from flexfloor.launch import ray as ray_launcher

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "flexfloor.lock"
        lock.write_text(json.dumps({"host": os.uname().nodename, "pid": other.pid,
                                    "started": "2026-01-01T00:00:00Z"}))
        with pytest.raises(CheckpointError) as e:
            lock_checkpoint_dir(str(tmp_path), print)
        assert (f"is in use by another job (pid {other.pid} on host {os.uname().nodename}, "
                "started 2026-01-01T00:00:00Z") in str(e.value)
        assert "use another checkpoint.dir or stop that job" in str(e.value)
    finally:
        other.kill()
        other.wait()
    said = []
    mine = lock_checkpoint_dir(str(tmp_path), said.append)  # its process is gone: stale
    assert said == [f"checkpoint.dir: took over the stale lock of pid {other.pid} on host "
                    f"{os.uname().nodename}, started 2026-01-01T00:00:00Z (that process is gone)"]
    owner = json.loads(lock.read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == os.uname().nodename
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "x"}))
    with pytest.raises(CheckpointError, match="locked by another job .pid 1 on host elsewhere"):
        lock_checkpoint_dir(str(tmp_path), print)
    mine.release()  # not ours any more: left alone
    assert lock.exists()
    # the Ray launcher's restart names the rank 0 it ended, which may have run on another host
    assert ray_launcher.PREDECESSOR_ENV == PREDECESSOR_ENV
    monkeypatch.setenv(PREDECESSOR_ENV, json.dumps({"host": "elsewhere", "pid": 2}))
    with pytest.raises(CheckpointError, match="locked by another job .pid 1 on host elsewhere"):
        lock_checkpoint_dir(str(tmp_path), print)  # another process of that host: refused
    monkeypatch.setenv(PREDECESSOR_ENV, json.dumps({"host": "elsewhere", "pid": 1}))
    said = []
    lock_checkpoint_dir(str(tmp_path), said.append).release()
    assert said == ["checkpoint.dir: took over the lock of pid 1 on host elsewhere, started x: "
                    "this job's rank 0 of the launch attempt before, ended by the launcher"]


def test_checkpoint_write_failure_is_one_error_naming_rank_phase_step(job_errors):
    """torch's CheckpointException is a BaseException: it must still leave the phase as the
    one-line error (rank, phase, step) that the entry point prints before exit 1."""
    res = job_errors["save_fails"]
    assert res["type"] == "CheckpointError", res
    assert res["origin"] == "rank 0, phase 'checkpoint save', step 1"
    assert "iter_0000001.tmp failed (" in res["message"] and "MiB free there): rank 0:" in res["message"]
    assert "free space or fix the permissions of checkpoint.dir" in res["message"]
    assert "\n" not in res["message"]
    # nothing half-written is loadable: no `latest`, only the unfinished .tmp and the lock
    assert res["checkpoints"] == ["flexfloor.lock", "iter_0000001.tmp"]



@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(143)],
                         ids=["keyboard_interrupt", "system_exit"])
def test_an_interrupt_during_a_save_stays_an_interrupt(interrupt, tmp_path):
    """torch's CheckpointException catches a rank's Ctrl-C or SIGTERM exit with every other
    failure: the save must leave with the interrupt, not as a disk's failure to fix."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from flexfloor.checkpoint import CheckpointError, _io

    path = str(tmp_path / "iter_0000001.tmp")
    wrapped = CheckpointException("save", {0: (interrupt, traceback.StackSummary())})
    with pytest.raises(type(interrupt)) as got, _io("saving", path, "fix"):
        raise wrapped
    assert got.value is interrupt
    with pytest.raises(CheckpointError, match=r"saving .* failed .*: rank 0: OSError: \[Errno 28\]"):
        with _io("saving", path, "fix"):
            raise CheckpointException("save", {0: (OSError(28, "No space left on device"),
                                                   traceback.StackSummary())})
