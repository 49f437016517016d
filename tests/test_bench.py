"""The rollout benchmark end to end on 4 gloo workers as 2 replicas, small: the JSON contract of the
README for every mode, identical responses across the five modes, fewer occupied worker-steps with
release, and the timeline plot. The run is the one tests/test_sim.py replays in the simulator
(distributed.BENCH_TWO_REPLICAS, one launch for both)."""

import json

import pytest

from distributed import BENCH_TWO_REPLICAS

EPOCHS = 3
FLAGS = ("--nproc", "4", "--epochs", str(EPOCHS), "--repeats", "1", *BENCH_TWO_REPLICAS)
NUM_PROMPTS = int(FLAGS[FLAGS.index("--num-prompts") + 1])
FIELDS = ("total_response_tokens", "occupied_worker_seconds", "occupied_worker_steps",
          "tail_fraction", "rollout_wall_seconds", "tokens_per_occupied_worker_second",
          "responses_sha256", "per_rank", "modelled_occupied_gpu_seconds",
          "modelled_rollout_seconds", "tokens_per_modelled_occupied_gpu_second")
RATIOS = ("tokens_per_occupied_worker_second", "tokens_per_occupied_worker_step",
          "rollout_wall_seconds")
MODES = ["static", "static_chunks", "replica_release", "single_group", "elastic"]


@pytest.fixture(scope="module")
def run(bench):
    done = bench.run(*FLAGS)
    return done.report, done.plot, done.proc.stdout


def test_json_has_the_design_contract(run):
    report, _, _ = run
    assert report["modes"] == MODES  # every mode by default
    assert report["setup"]["replica_ranks"] == [[0, 1], [2, 3]]
    for mode in MODES:
        assert all(k in report[mode] for k in FIELDS), sorted(report[mode])
        per_rank = report[mode]["per_rank"]
        assert [r["rank"] for r in per_rank] == [0, 1, 2, 3]
        assert all(set(r) >= {"rank", "local_finish_s", "release_s", "steps"} for r in per_rank)
    assert set(report["ratios"]) >= set(RATIOS)
    assert set(report["ratios_vs"]) == set(MODES) - {"elastic"}
    assert all(set(r) >= set(RATIOS) for r in report["ratios_vs"].values())
    assert report["ratios_vs"]["static"] == report["ratios"]
    assert report["summary_epochs"] == list(range(2, EPOCHS + 1))
    assert [e["epoch"] for e in report["per_epoch"]] == list(range(1, EPOCHS + 1))
    assert report["caveat"] and "tail_stats" in report["workload"]
    assert set(report["reconfiguration"]) >= {"plan_s", "transfer_s", "switch_s", "sent_bytes"}


def test_identical_responses_and_fewer_occupied_steps(run):
    report, _, _ = run
    assert report["identical_responses"] is True
    assert all(e["sha_match"] for e in report["per_epoch"])
    for mode in MODES:
        assert report[mode]["responses_sha256"] == report["elastic"]["responses_sha256"], mode
        assert report[mode]["total_response_tokens"] == report["elastic"]["total_response_tokens"]
    assert report["elastic"]["occupied_worker_steps"] <= report["static"]["occupied_worker_steps"]
    # held modes: every rank occupied to the end of the slowest replica
    for mode in ("static", "static_chunks", "single_group"):
        assert len({r["steps"] for r in report[mode]["per_rank"]}) == 1, mode
    # replica_release lets a replica go at its own end: never more than static
    assert (report["replica_release"]["occupied_worker_steps"]
            <= report["static"]["occupied_worker_steps"])
    # epochs 2.. place from history: the predictor saw every prompt before
    for e in report["per_epoch"][1:]:
        assert e["predictor"]["sources"]["history"] == NUM_PROMPTS, e["epoch"]


def test_the_predictors_accuracy_is_reported_per_evidence(run):
    """Each epoch reports Spearman and MAE of the history's and the siblings' predictions apart,
    as the simulator does: the history's over the prompts that have some (none in epoch 1, then
    all of them: the plan's predictions, so its figures are the `predictor`'s), the siblings'
    over every prompt (each from the shorter half of its samples)."""
    import math

    report, _, stdout = run
    for e in report["per_epoch"]:
        acc = e["prediction_accuracy"]
        assert set(acc) == {"history", "siblings"}
        assert acc["siblings"]["n"] == NUM_PROMPTS
        assert acc["siblings"]["mae"] >= 0 and -1 <= acc["siblings"]["spearman"] <= 1
        if e["epoch"] == 1:
            assert acc["history"]["n"] == 0
            continue
        assert acc["history"]["n"] == NUM_PROMPTS
        for k in ("spearman", "mae"):
            assert math.isclose(acc["history"][k], e["predictor"][k], rel_tol=1e-12), k
    assert stdout.count("history spearman") >= 2 * EPOCHS  # each epoch's line, and the summary


def test_modelled_seconds_price_every_traced_step(run):
    """The JSON's per-rank step traces priced again: with every step at 1 they give each rank's
    occupied steps; with the default cost model, the JSON's modelled seconds."""
    from flexfloor.rollout.types import StepTrace
    from flexfloor.sim.cost import UnitCost, cost_model, price_trace

    report, _, _ = run
    assert (report["setup"]["accelerator"], report["setup"]["model_shape"]) == ("H800",
                                                                              "qwen3-30b-a3b")
    assert report["setup"]["cpu_seconds_warning"] is None or "CPU cores" in report["setup"][
        "cpu_seconds_warning"]
    for mode in ("static", "elastic"):
        occupied_s = rollout_s = 0.0  # the summary's epochs, each priced on its own, added up
        for entry in report["per_epoch"]:
            if entry["epoch"] not in report["summary_epochs"]:
                continue
            epoch = entry[mode]
            traces = {r["rank"]: StepTrace.from_dict(r["trace"]) for r in epoch["per_rank"]}
            steps = {r["rank"]: r["steps"] for r in epoch["per_rank"]}
            unit = price_trace(traces, UnitCost(), held_steps=steps)
            assert unit.occupied_s == {r: float(n) for r, n in steps.items()}
            priced = price_trace(traces, cost_model("H800", "qwen3-30b-a3b"), held_steps=steps)
            occupied_s += sum(priced.occupied_s.values())
            rollout_s += priced.rollout_s
            assert [r["modelled_occupied_s"] for r in epoch["per_rank"]] == pytest.approx(
                [priced.occupied_s[r] for r in sorted(steps)])
            # a step samples one token per running request: one per decoding one, one per
            # prefill
            decode = sum(sum(t.decode_tokens) for t in traces.values())
            prefill = sum(sum(t.prefill_tokens) for t in traces.values())
            assert decode < epoch["total_response_tokens"] <= decode + prefill
        assert occupied_s == pytest.approx(report[mode]["modelled_occupied_gpu_seconds"])
        assert rollout_s == pytest.approx(report[mode]["modelled_rollout_seconds"])
    assert set(report["ratios"]) >= {"tokens_per_modelled_occupied_gpu_second",
                                     "modelled_rollout_seconds"}


def test_table_and_plot(run, tmp_path, capsys):
    report, png, stdout = run
    assert f"epoch {EPOCHS}/{EPOCHS}" in stdout and "tokens_per_occupied_worker_step" in stdout
    assert "tokens_per_modelled_occupied_gpu_second" in stdout
    header = next(line for line in stdout.splitlines()
                  if line.startswith(f"epochs 2..{EPOCHS} "))
    assert header.split()[2:] == MODES + ["elastic/static"]  # a column per mode
    assert all(f"elastic / {b}" in stdout for b in MODES[:-1])
    assert png.exists() and png.stat().st_size > 0
    # the timeline tool reads the benchmark's JSON too (its main, in this process)
    from tools.plot_timeline import main as plot_main

    src, out = tmp_path / "b.json", tmp_path / "t.png"
    src.write_text(json.dumps(report))
    assert plot_main([str(src), "--out", str(out), "--epoch", "1"]) == 0, capsys.readouterr().err
    assert out.stat().st_size > 0
    assert plot_main([str(src), "--out", str(out), "--epoch", "9"]) == 2
    assert "no epoch 9" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--length-dist", "uniform", "--length-median", "6"], "--length-median does not apply"),
    (["--modes", "static,fast"], "unknown"),
    (["--kv-budget-tokens", "50"], "cannot hold the longest request"),
    (["--accelerator", "TPU"], "--accelerator/--model-shape: accelerator 'TPU' unknown"),
    (["--replicas", "3"], "--replicas 3 must divide --nproc 4"),
    (["--migrate-max-requests", "-3"], "--migrate-max-requests must be at least 0"),
    (["--correct"], "elastic.consolidate_correct: applies across replicas only"),
    (["--plan-estimates"], "elastic.plan_estimates: is read by the decisions across replicas"),
    (["--consolidate-across", "--taker-hedge", "0.5"],
     "elastic.consolidate_taker_hedge: must be >= 1"),
    (["--plan-seconds"], "--plan-seconds: scheduler.plan_seconds: places across replicas and "
     "there is one (rollout.replicas=1)"),
])
def test_bad_options_fail_before_launching(tmp_path, flags, message, capsys):
    # the command's own main, in this process (no interpreter start per case): a refusal returns
    # 2 or exits 2 (argparse) before anything is launched
    from tools.bench_rollout import main

    try:
        code = main(["--out", str(tmp_path / "b.json"), *flags])
    except SystemExit as e:
        code = e.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def _is_worker(p) -> bool:
    """Whether psutil process `p` is a benchmark worker (False once it has ended)."""
    import psutil

    try:
        cmd = p.cmdline()
    except psutil.Error:  # ended (or a zombie) between the listing and this read
        return False
    return "--worker" in cmd and "torch.distributed.run" not in cmd


def test_a_terminated_benchmark_leaves_no_worker_and_keeps_the_earlier_report(tmp_path):
    """SIGTERM to the benchmark once its workers run: torchrun and every worker end with it,
    the report an earlier run left at --out is untouched and no partial one is left beside it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from distributed import REPO

    out = tmp_path / "b.json"
    out.write_text('{"earlier": true}')
    proc = subprocess.Popen([sys.executable, "tools/bench_rollout.py", "--nproc", "2",
                             "--epochs", "3", "--out", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    workers = []
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
        workers = [p for p in parent.children(recursive=True) if _is_worker(p)]
        time.sleep(0.2)
    assert len(workers) == 2, "the workers never started"
    launched = parent.children(recursive=True)  # torchrun and the workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    gone, alive = psutil.wait_procs(launched, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    assert out.read_text() == '{"earlier": true}'
    assert os.listdir(tmp_path) == ["b.json"]
