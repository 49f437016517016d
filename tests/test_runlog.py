"""The run log: strict-JSON metrics.jsonl (NaN/inf as null, named under non_finite) and an
end-of-run summary that covers the whole run, also after a restart. No process group."""

import json
import math

from flexfloor.config import Config
from flexfloor.runlog import RunLog


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def _metrics(step: int, reward: float, **extra) -> dict:
    m = {"step": step, "reward/mean": reward, "reward/solved": 0.0, "response_length/mean": 3.0,
         "response_length/max": 4, "rollout/tokens_per_occupied_worker_second": 1.0,
         "rollout/tail_fraction": 0.0, "rollout/released_ranks": 0, "rollout/release_s": [0.1],
         "timing/step_s": 1.0}
    m.update(extra)
    return m


def _log(tmp_path, resumed_step=0) -> RunLog:
    cfg = Config()
    cfg.logging.run_dir = str(tmp_path / "run")
    cfg.logging.tensorboard = False
    cfg.logging.timeline_plot = False
    return RunLog(cfg, 0, resumed_step=resumed_step)


def test_non_finite_metrics_are_null_and_named(tmp_path):
    log = _log(tmp_path)
    log.write(_metrics(1, 0.5, **{"actor/loss": float("nan"), "actor/grad_norm": math.inf,
                                  "rollout/release_s": [0.1, float("-inf")]}), [])
    log.write(_metrics(2, 0.6, **{"actor/loss": 0.25}), [])
    lines = open(log.metrics_path).read().splitlines()
    first, second = _strict(lines[0]), _strict(lines[1])
    assert first["actor/loss"] is None and first["actor/grad_norm"] is None
    assert first["rollout/release_s"] == [0.1, None]
    assert first["non_finite"] == ["rollout/release_s", "actor/loss", "actor/grad_norm"]
    assert "non_finite" not in second and second["actor/loss"] == 0.25


def test_summary_after_a_restart_covers_the_whole_run(tmp_path, capsys):
    log = _log(tmp_path)
    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3)]:  # step 3: after the last checkpoint
        log.write(_metrics(step, reward, **({"val/reward/mean": 0.15, "val/solved": 0.0}
                                            if step == 2 else {})), [])
    with open(log.metrics_path, "a") as f:
        f.write('{"step": 4, "rew')  # torn by the crash
    restarted = _log(tmp_path, resumed_step=2)  # resumed from the step-2 checkpoint
    restarted.write(_metrics(3, 0.35), [])
    capsys.readouterr()
    restarted.close()
    out = capsys.readouterr().out
    assert "reward 0.100 (step 1) -> 0.350 (step 3)" in out
    assert "val reward 0.150 (step 2)" in out
    steps = [_strict(line)["step"] for line in open(restarted.metrics_path)]
    assert steps == [1, 2, 3]
    # the crashed attempt's step 3 (reward 0.3) is kept aside, not lost
    old = (tmp_path / "run" / "superseded" / "1" / "metrics.jsonl").read_text().splitlines()
    assert [_strict(line)["reward/mean"] for line in old[:3]] == [0.1, 0.2, 0.3]


def test_a_new_run_in_a_used_folder_keeps_the_earlier_runs_log(tmp_path, capsys):
    first = _log(tmp_path)
    first.write(_metrics(1, 0.1), [])
    first.write(_metrics(2, 0.2), [])
    for n in (1, 2):  # two later fresh runs in the same folder
        again = _log(tmp_path)
        assert open(again.metrics_path).read() == ""  # this run's log starts empty
        again.write(_metrics(1, 0.5 + n), [])
    assert "kept in" in capsys.readouterr().out
    aside = tmp_path / "run" / "superseded"
    assert [_strict(line)["reward/mean"] for line in
            (aside / "1" / "metrics.jsonl").read_text().splitlines()] == [0.1, 0.2]
    assert [_strict(line)["reward/mean"] for line in
            (aside / "2" / "metrics.jsonl").read_text().splitlines()] == [1.5]
    assert (aside / "1" / "config.json").exists() and (aside / "2" / "config.json").exists()


def test_tensorboard_shows_one_run_after_a_restart_and_a_new_run(tmp_path):
    """TensorBoard, read back as its event reader reads it, holds one value per step: the
    resumed run's for the steps after its checkpoint (a crashed attempt's are purged), and a
    new run's in a used folder (the earlier run's purged), as metrics.jsonl does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def log(resumed_step=0):
        cfg = Config()
        cfg.logging.run_dir = str(tmp_path / "run")
        cfg.logging.timeline_plot = False
        return RunLog(cfg, 0, resumed_step=resumed_step)

    def scalars():
        events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
        events.Reload()
        return [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")]

    first = log()
    for step in (1, 2, 3):
        first.write(_metrics(step, step / 10), [])
    first.writer.close()
    resumed = log(resumed_step=2)  # step 3 is done again
    resumed.write(_metrics(3, 0.35), [])
    resumed.writer.close()
    assert scalars() == [(1, 0.1), (2, 0.2), (3, 0.35)]
    fresh = log()
    fresh.write(_metrics(1, 0.9), [])
    fresh.writer.close()
    assert scalars() == [(1, 0.9)]
