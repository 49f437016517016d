"""The cluster simulator: with every step costing 1 it must count exactly the steps the real
engine takes (per rank, per epoch, every mode, with 1 and 2 replicas, release order included) for
the same lengths and policies; and the paper-like scenario must meet the paper's targets."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from distributed import BENCH_TWO_REPLICAS
from flexfloor.rollout.types import StepTrace
from flexfloor.sim.cost import (
    CostParams, RankLoad, RooflineCost, UnitCost, kv_budget_bytes, linear_step_cost, price_trace,
)
from flexfloor.sim.hardware import ACCELERATORS, ModelShape
from flexfloor.sim.scenarios import SCENARIOS, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_RANK = ("steps", "busy_steps", "tokens", "requests", "release_step", "local_finish_step")

# the benchmark's flags -> the same workload and policies as scenario overrides
CASES = {
    # two replicas of 2 ranks, the five modes
    # (test_bench reads the same run: distributed.BENCH_TWO_REPLICAS)
    "lognormal": (list(BENCH_TWO_REPLICAS),
                  dict(num_prompts=12, samples_per_prompt=4, length_params={"median": 8.0},
                       max_len=60, replicas=2)),
    # KV budget and batch limit: admission waves, borrowed experts against the budget, the
    # memory floor; and migration of a rank's last requests
    "tight+migrate": (["--num-prompts", "12", "--samples-per-prompt", "4", "--length-median", "8",
                       "--max-len", "60", "--kv-budget-tokens", "600", "--max-batch-size", "8",
                       "--migrate-max-requests", "2",
                       # one world-wide group: static_chunks would repeat single_group
                       "--modes", "static,replica_release,single_group,elastic"],
                      dict(num_prompts=12, samples_per_prompt=4, length_params={"median": 8.0},
                           max_len=60, kv_budget_tokens=600, max_batch_size=8,
                           migrate_max_requests=2)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def engine_and_sim(request, bench):
    flags, overrides = CASES[request.param]
    real = bench.run("--nproc", "4", "--epochs", "3", "--repeats", "1", *flags).report
    sim = run(SCENARIOS["tiny-cpu"].with_overrides(epochs=3, **overrides))
    return request.param, real, sim


def test_unit_cost_simulation_equals_the_real_engine_step_for_step(engine_and_sim):
    case, bench, sim = engine_and_sim
    # every mode the benchmark ran, under the same name (the same placement and hold rule)
    assert len(bench["modes"]) >= 4
    for real, simulated in zip(bench["per_epoch"], sim["per_epoch"], strict=True):
        for mode in bench["modes"]:
            sim_mode = mode
            got = [{k: r.get(k) for k in PER_RANK} for r in simulated[sim_mode]["per_rank"]]
            want = [{k: r.get(k) for k in PER_RANK} for r in real[mode]["per_rank"]]
            assert got == want, (case, real["epoch"], mode)
            assert simulated[sim_mode]["occupied_worker_steps"] == real[mode]["occupied_worker_steps"]
            assert simulated[sim_mode]["total_response_tokens"] == real[mode]["total_response_tokens"]
            # the engine's step traces priced at 1 a step: the simulator's unit-cost seconds
            traces = {r["rank"]: StepTrace.from_dict(r["trace"]) for r in real[mode]["per_rank"]}
            unit = price_trace(traces, UnitCost(),
                               held_steps={r["rank"]: r["steps"] for r in real[mode]["per_rank"]})
            assert [unit.occupied_s[r] for r in sorted(traces)] == [
                r["release_s"] for r in simulated[sim_mode]["per_rank"]], (case, mode)
            assert unit.rollout_s == simulated[sim_mode]["rollout_wall_seconds"]
    # release order: ranks sorted by the step they left at
    last = sim["per_epoch"][-1]["elastic"]["per_rank"]
    order = sorted(range(4), key=lambda r: (last[r]["release_step"], r))
    real_last = bench["per_epoch"][-1]["elastic"]["per_rank"]
    assert order == sorted(range(4), key=lambda r: (real_last[r]["release_step"], r))
    for base in bench["ratios_vs"]:
        assert sim["ratios_vs"][base]["tokens_per_occupied_worker_step"] == pytest.approx(
            bench["ratios_vs"][base]["tokens_per_occupied_worker_step"])


def test_the_validation_cases_exercise_release_waves_floor_and_migration(engine_and_sim):
    case, bench, sim = engine_and_sim
    elastic = [e["elastic"] for e in sim["per_epoch"]]
    if case == "lognormal":
        assert any(m["released_ranks"] >= 2 for m in elastic)  # several ranks leave early
    else:
        # a rank ran more requests than its batch limit, so some waited for room: waves; the
        # KV budget holds ranks back (memory floor) but a rank's last requests migrate
        assert max(r["requests"] for m in elastic for r in m["per_rank"]) > 8
        assert any("migrated" in t for m in elastic for t in m["timeline"])


def test_paper_like_reports_every_mode_and_the_paper_targets(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    # two steps (the second planned from history) instead of three: the same properties
    proc = subprocess.run([sys.executable, "tools/simulate.py", "--scenario", "paper-like",
                           "--epochs", "2", "--out", str(out), "--plot", str(png)],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        rep = json.load(f)
    assert rep["modes"] == ["static", "static_chunks", "replica_release", "single_group", "elastic"]
    for mode in rep["modes"]:
        assert {"total_response_tokens", "occupied_worker_seconds", "occupied_worker_steps",
                "modelled_occupied_gpu_seconds", "modelled_rollout_seconds", "tail_fraction",
                "rollout_wall_seconds", "rollout_wall_steps", "tokens_per_occupied_worker_second",
                "groups_created_during_rollout", "per_rank"} <= set(rep[mode])
        assert len(rep[mode]["per_rank"]) == 64
        assert rep[mode]["total_response_tokens"] == rep["static"]["total_response_tokens"]
        assert rep[mode]["modelled_occupied_gpu_seconds"] == rep[mode]["occupied_worker_seconds"]
    assert set(rep["ratios_vs"]) == {"static", "static_chunks", "replica_release", "single_group"}
    # 8 replicas x EP8, a replica's ranks all on one node: a replica leaves whole, so no new
    # group is built (a shrink inside it would cost a new communicator, 2 s)
    assert rep["elastic"]["groups_created_during_rollout"] == 0
    assert rep["scenario"]["replicas"] == 8 and rep["cost_params"]["group_source"] == "new"
    # the paper's throughput figure against its baseline (one world-wide group, held), and the
    # release protocol near its bound; every target is printed, met or not
    assert rep["ratios_vs"]["single_group"]["tokens_per_occupied_worker_second"] >= 1.65
    assert rep["ratios"]["elastic_over_ideal"] >= 0.85
    assert len(rep["targets"]) == 4 and all(f"target {n}" in proc.stdout for n in rep["targets"])
    assert png.stat().st_size > 0
    # the timeline tool reads the same report
    png2 = tmp_path / "again.png"
    proc = subprocess.run([sys.executable, "tools/plot_timeline.py", str(out), "--out", str(png2),
                           "--epoch", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and png2.stat().st_size > 0, proc.stderr


def test_list_and_bad_scenario():
    proc = subprocess.run([sys.executable, "tools/simulate.py", "--list"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "paper-like" in proc.stdout and "tiny-cpu" in proc.stdout
    proc = subprocess.run([sys.executable, "tools/simulate.py", "--scenario", "nope", "--out",
                           "x.json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "paper-like" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--sweep", "--sweep-gpus", "16,abc"], "--sweep-gpus '16,abc': write positive ints"),
    (["--sweep", "--sweep-sigmas", "0.4,-1"], "--sweep-sigmas '0.4,-1': write positive floats"),
    (["--sweep", "--sweep-sigmas", "nan,inf"], "--sweep-sigmas 'nan,inf': write positive floats"),
    (["--sweep", "--sweep-gpus", "16,12"], "--sweep-gpus 12: replicas=8 must divide gpus=12"),
    (["--plot", "PLOT.xyz"], "--plot PLOT.xyz: cannot write a .xyz image"),
    (["--dense-replicas", "9"], "--dense-replicas 9: must be at most replicas (8)"),
    (["--dense-replicas", "0"], "--dense-replicas 0: must be at least 1"),
    (["--lane-requests", "5"], "--lane-requests 5: the lanes are the replicas past the first "
                               "dense_replicas; set dense_replicas below replicas (8)"),
    (["--dense-replicas", "6", "--lane-requests", "4096"],
     "--lane-requests 4096: must be fewer than a step's requests (num_prompts x "
     "samples_per_prompt = 4096), so that the dense replicas hold the rest"),
    (["--sweep", "--dense-replicas", "6"], "--sweep with --dense-replicas: the sweep scales"),
])
def test_bad_sweep_and_plot_fail_before_the_run(tmp_path, flags, message, capsys):
    """Refused before the simulation (seconds to minutes), not after it; nothing written."""
    from tools.simulate import main

    flags = [str(tmp_path / f) if f.startswith("PLOT") else f for f in flags]
    try:
        code = main(["--scenario", "paper-like", "--out", str(tmp_path / "s.json"), *flags])
    except SystemExit as e:
        code = e.code
    assert code == 2 and message.replace("PLOT", str(tmp_path / "PLOT")) in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_sweep_runs_each_cluster_size_and_tail(tmp_path):
    from tools.simulate import main

    out = tmp_path / "s.json"
    assert main(["--scenario", "tiny-cpu", "--epochs", "1", "--out", str(out), "--sweep",
                 "--sweep-gpus", "4,8", "--sweep-sigmas", "0.4,0.8"]) == 0
    with open(out) as f:
        rows = json.load(f)["sweep"]
    n = SCENARIOS["tiny-cpu"].num_prompts
    assert [(r["gpus"], r["sigma"], r["num_prompts"]) for r in rows] == [
        (4, 0.4, n), (4, 0.8, n), (8, 0.4, 2 * n), (8, 0.8, 2 * n)]  # prompts scale with GPUs
    # a heavier tail at the same size: a longer p99 against the median
    assert rows[1]["p99_over_p50"] > rows[0]["p99_over_p50"]


def test_cost_model_directions():
    """Shrinking moves the MoE exchange onto NVLink (cheaper), hosting more experts reads more
    weights (dearer), more cached context reads more KV (dearer)."""
    shape = ModelShape.from_preset("qwen3-30b-a3b")
    cost = RooflineCost(ACCELERATORS["H800"], shape)
    e = shape.num_experts

    def owner(ranks):
        return [ranks[i % len(ranks)] for i in range(e)]

    # the same 8 ranks' work: inside one node (a group shrunk onto NVLink) and spread over 8
    # nodes (the exchange over the network, at DeepEP's rates)
    one_node, spread = list(range(8)), list(range(0, 64, 8))
    narrow = [RankLoad(r, 256, 256 * 2000, e // 8) for r in one_node]
    across = [RankLoad(r, 256, 256 * 2000, e // 8) for r in spread]
    assert cost.step_seconds(narrow, owner(one_node)) < cost.step_seconds(across, owner(spread))
    light = [RankLoad(r, 8, 1000, e // 8) for r in range(8)]
    heavy = [RankLoad(r, 8, 400000, e // 8) for r in range(8)]
    assert cost.step_seconds(light, owner(list(range(8)))) < cost.step_seconds(heavy, owner(list(range(8))))
    # memory: the KV budget falls by one expert's bytes per expert hosted; a model that does
    # not fit says so
    b2 = kv_budget_bytes(ACCELERATORS["H800"], shape, 2)
    assert b2 - kv_budget_bytes(ACCELERATORS["H800"], shape, 3) == shape.expert_bytes
    with pytest.raises(ValueError, match="does not fit"):
        kv_budget_bytes(ACCELERATORS["H800"], ModelShape.from_preset("deepseek-v3"), 256,
                        CostParams())
    assert shape.total_params == pytest.approx(30.5e9, rel=0.05)  # Qwen3-30B-A3B


def test_linear_step_cost_prices_each_batch_size_once_when_asked():
    """The step cost is priced per batch size on first use (scalar or array), each at most
    once, and equals the eager interpolation: priced at no context plus the per-token slope;
    batches above `max_batch` at its price, an empty one at 0."""
    import numpy as np

    asked = []

    def priced(n, ctx):
        asked.append(n)
        return 1.0 + 0.5 * n + 1e-6 * ctx

    cost = linear_step_cost(priced, max_batch=8)
    assert asked == []
    assert cost(3, 1000) == pytest.approx(1.0 + 1.5 + 1e-3)
    assert cost(np.array([3, 0, 12, 5, 5]), np.array([0, 0, 10, 10, 20])).tolist() == pytest.approx(
        [2.5, 0.0, 5.0 + 1e-5, 3.5 + 1e-5, 3.5 + 2e-5])
    assert sorted(set(asked)) == [3, 5, 8] and len(asked) == 6  # two contexts each, once
    with pytest.raises(ValueError, match="a step of -1 requests"):
        cost(np.array([2, -1]), np.array([0, 0]))
    assert cost(8, 0) == 5.0 and sorted(set(asked)) == [3, 5, 8]  # the max batch's row kept


def test_a_trace_file_is_replayed_as_given(tmp_path):
    import numpy as np

    from flexfloor.rollout.workload import save_lengths

    lengths = np.random.default_rng(5).integers(1, 90, size=(2, 10, 3))
    trace = tmp_path / "lengths.json"
    save_lengths(str(trace), lengths)
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "tools/simulate.py", "--scenario", "tiny-cpu",
                           "--length-file", str(trace), "--num-prompts", "10",
                           "--samples-per-prompt", "3", "--epochs", "2", "--max-len", "100",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(out) as f:
        rep = json.load(f)
    digests = []
    for e, entry in enumerate(rep["per_epoch"]):
        # responses_sha256: a digest of each prompt's response lengths, those of the file
        rows = [(uid, sorted(int(n) for n in lengths[e, uid])) for uid in range(10)]
        digests.append(hashlib.sha256(json.dumps(rows).encode()).hexdigest())
        for mode in rep["modes"]:
            assert entry[mode]["responses_sha256"] == digests[e], (e, mode)
        for mode in ("static", "elastic"):
            assert entry[mode]["total_response_tokens"] == int(lengths[e].sum())
    assert rep["elastic"]["total_response_tokens"] == int(lengths[1].sum())  # summary: epoch 2
    assert rep["elastic"]["responses_sha256"] == hashlib.sha256(digests[1].encode()).hexdigest()


def test_a_length_file_above_max_len_is_refused_not_clipped(tmp_path):
    """A JSON length file is a replay: a length above --max-len is one line naming the largest,
    where it is and the fix, status 2, nothing printed before it or written (QA's repro)."""
    trace, out = tmp_path / "l2.json", tmp_path / "l2out.json"
    lengths = [[[300] * 8 for _ in range(16)] for _ in range(2)]
    lengths[1][3][5] = 5000
    lengths[0][0][0] = 4000
    trace.write_text(json.dumps({"lengths": lengths}))
    proc = subprocess.run([sys.executable, "tools/simulate.py", "--scenario", "paper-like",
                           "--gpus", "16", "--replicas", "4", "--num-prompts", "16", "--max-len",
                           "2048", "--epochs", "2", "--length-file", str(trace), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [
        f"simulate: length file {trace}: its largest length, 5000 at lengths[1][3][5] (epoch 1, "
        "prompt 3, sample 5), is above --max-len 2048 (2 of 256 lengths are); a length file is "
        "replayed as given, not clipped: pass --max-len 5000 or more, or cap the file's lengths "
        "at 2048"], proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("lengths, message", [
    # [prompts][samples]: the same every epoch, told in the file's own indices
    ([[3, 4], [90, 61]], "its largest length, 90 at lengths[1][0] (prompt 1, sample 0), is above "
                         "--max-len 60 (2 of 4 lengths are)"),
    ([[3, 4], [0, 6]], "lengths[1][0] (prompt 1, sample 0) is 0; lengths must be whole numbers "
                       "of at least 1 (1 of 4 are not): fix the file (--length-file)"),
    ([[[3, 2.5], [1, 6]]], "lengths[0][0][1] (epoch 0, prompt 0, sample 1) is 2.5; lengths must "
                           "be whole numbers of at least 1"),
    ([[[3, 4], [1, 6]], [[3, 4], [1, -7]]], "lengths[1][1][1] (epoch 1, prompt 1, sample 1) is "
                                            "-7; lengths must be whole numbers of at least 1"),
])
def test_a_bad_length_in_a_length_file_is_refused_naming_where(tmp_path, capsys, lengths,
                                                               message):
    from tools.simulate import main

    trace = tmp_path / "l.json"
    trace.write_text(json.dumps({"lengths": lengths}))
    code = main(["--scenario", "tiny-cpu", "--num-prompts", "2", "--samples-per-prompt", "2",
                 "--epochs", "2", "--max-len", "60", "--length-file", str(trace), "--out",
                 str(tmp_path / "s.json")])
    got = capsys.readouterr()
    assert code == 2 and got.out == "" and len(got.err.splitlines()) == 1, got
    assert got.err.startswith(f"simulate: length file {trace}: ") and message in got.err, got.err
    assert os.listdir(tmp_path) == ["l.json"]


def test_a_length_file_at_max_len_is_replayed_as_given(tmp_path):
    """The bound is inclusive, and only the part used counts (a longer file's rest is unread)."""
    from flexfloor.sim.scenarios import prepare

    trace = tmp_path / "l.json"
    trace.write_text(json.dumps({"lengths": [[[60, 1, 9999]] * 3] * 2}))  # sample 2 not used
    sc = SCENARIOS["tiny-cpu"].with_overrides(num_prompts=3, samples_per_prompt=2, epochs=2,
                                              max_len=60, length_dist="file",
                                              length_params={"path": str(trace)})
    assert prepare(sc).lengths.tolist() == [[[60, 1]] * 3] * 2


@pytest.mark.parametrize("flags, message", [
    (["--length-file", "/nope.json"],
     "simulate: length file /nope.json: No such file or directory (--length-file)"),
    (["--accelerator", "H900"],
     "simulate: --accelerator 'H900': unknown; choose one of ['A100', 'H100', 'H200', 'H800']"),
    (["--model", "nope"], "simulate: --model 'nope': unknown; choose one of ['deepseek-v2-lite', "),
    (["--accelerator", "H900", "--kv-budget-tokens", "100"], "simulate: --accelerator 'H900'"),
    (["--kv-budget-tokens", "100"], "simulate: --kv-budget-tokens 100: 100 tokens per rank "
     "cannot hold the longest request (2648 tokens: a prompt of up to 600 and a response of "
     "2048); give at least 2648, or shorten the responses"),
    (["--sweep", "--length-file", "L.json"], "simulate: --sweep with --length-file: the sweep "
     "draws lognormal lengths of each --sweep-sigmas, not the file's"),
    # a size of the sweep that cannot run: refused before the main run, not after it
    (["--model", "mixtral-8x7b", "--sweep", "--sweep-gpus", "16,4", "--sweep-sigmas", "0.4"],
     "simulate: --sweep-gpus 4: mixtral-8x7b does not fit NVIDIA H800 SXM5 80GB"),
    (["--length-file", "L.json", "--length-sigma", "1"],
     "simulate: --length-median/--length-sigma with --length-file: the file gives the lengths"),
])
def test_a_bad_input_is_its_error_line_alone(tmp_path, capsys, flags, message):
    """Checked before the run's header line (`simulate: paper-like: ... on 16 H800 ...`) and
    its notes are printed: the error alone on stderr, nothing on stdout, status 2, no --out."""
    from tools.simulate import main

    (tmp_path / "L.json").write_text(json.dumps({"lengths": [[100] * 8] * 16}))
    flags = [str(tmp_path / f) if f == "L.json" else f for f in flags]
    code = main(["--scenario", "paper-like", "--gpus", "16", "--replicas", "4", "--num-prompts",
                 "16", "--max-len", "2048", "--epochs", "2", "--out", str(tmp_path / "s.json"),
                 *flags])
    got = capsys.readouterr()
    assert code == 2 and got.out == "" and len(got.err.splitlines()) == 1, got
    assert got.err.startswith(message), got.err
    assert os.listdir(tmp_path) == ["L.json"]


# a small paper-like cluster (4 replicas x EP8 of H800, 128 requests): a second or two of CPU
SMALL = dict(gpus=16, replicas=4, num_prompts=16, max_len=2048, epochs=2, targets={},
             length_params={"median": 400.0, "sigma": 0.6})


@pytest.mark.parametrize("seed", [1, 2])
def test_elastic_rollout_is_no_longer_than_static(seed):
    """The placement's bounds (predicted and cap-run ends within static's) and the
    consolidation's (a taker's end within the rollout's, only short tails move) keep FlexFloor's
    rollout within static's while it still releases replicas early."""
    rep = run(SCENARIOS["paper-like"].with_overrides(seed=seed, **SMALL))
    assert rep["elastic"]["total_response_tokens"] == rep["static"]["total_response_tokens"]
    entry = rep["per_epoch"][-1]  # planned from history
    assert any("consolidated" in t for t in entry["elastic"]["timeline"])
    assert entry["elastic"]["rollout_wall_seconds"] <= entry["static"]["rollout_wall_seconds"]
    assert rep["ratios"]["tokens_per_occupied_worker_second"] >= 1.3


def test_two_tiers_puts_the_longest_on_the_lanes_and_the_rest_on_the_dense_replicas():
    """The analysis placement: the N longest round robin over the lanes (the replicas past the
    first K), the rest over the first K, every request once, each rank's longest first."""
    from flexfloor.rollout.scheduler import PromptGroup
    from flexfloor.rollout.types import Request
    from flexfloor.sim.scenarios import two_tiers

    lengths = [[300, 40, 900, 75], [5, 610, 220, 1000], [130, 130, 860, 12]]
    groups = [PromptGroup(uid, tuple(Request(prompt_uid=uid, sample_index=i, prompt_ids=(1, 2),
                                             max_new_tokens=1024, target_len=n)
                                     for i, n in enumerate(ls)))
              for uid, ls in enumerate(lengths)]
    replicas = [(0, 1), (2, 3), (4, 5)]
    out = two_tiers(groups, replicas, 2, 3, lambda q: q.target_len)
    got = {r: [q.target_len for q in reqs] for r, reqs in out.items()}
    assert sorted(n for ns in got.values() for n in ns) == sorted(sum(lengths, []))
    assert got[4] == [1000, 860] and got[5] == [900]  # the 3 longest, round robin
    dense = {r: got[r] for r in (0, 1, 2, 3)}
    assert max(map(len, dense.values())) - min(map(len, dense.values())) <= 1
    assert all(ns == sorted(ns, reverse=True) for ns in got.values())
    # round robin over the dense replicas first, then their ranks: 610 (next longest) on
    # replica 0's first rank, 300 on replica 1's first rank
    assert got[0][0] == 610 and got[2][0] == 300
    # no lanes: every request on the first K replicas, the others given nothing
    out = two_tiers(groups, replicas, 1, 0, lambda q: q.target_len)
    assert len(out[0]) + len(out[1]) == 12 and not any(out[r] for r in (2, 3, 4, 5))


def test_two_tiers_replaces_the_elastic_placement_and_keeps_the_tokens():
    """`dense_replicas` places the elastic mode's requests on the first K replicas: the others
    are released at once, holding nothing, and every response is the same as static's."""
    sc = SCENARIOS["paper-like"].with_overrides(seed=1, **SMALL)
    rep = run(sc.with_overrides(dense_replicas=2))
    for entry in rep["per_epoch"]:
        assert entry["elastic"]["responses_sha256"] == entry["static"]["responses_sha256"]
        idle = [x for x in entry["elastic"]["per_rank"] if x["rank"] >= 8]
        assert len(idle) == 8 and all(x["tokens"] == 0 and x["release_s"] == 0 for x in idle)
    lanes = run(sc.with_overrides(oracle=True, dense_replicas=3, lane_requests=6))
    entry = lanes["per_epoch"][-1]
    assert entry["elastic"]["responses_sha256"] == entry["static"]["responses_sha256"]
    assert sum(x["tokens"] > 0 for x in entry["elastic"]["per_rank"] if x["rank"] >= 12) >= 4


def test_simulate_says_when_elastic_is_the_two_tier_placement(tmp_path, capsys):
    from tools.simulate import main

    small = ["--gpus", "16", "--replicas", "4", "--num-prompts", "16", "--max-len", "2048",
             "--length-median", "400", "--epochs", "1"]
    assert main(["--scenario", "paper-like", *small, "--oracle", "1", "--dense-replicas", "3",
                 "--lane-requests", "6", "--out", str(tmp_path / "a.json")]) == 0
    assert ("note: elastic is the two-tier analysis placement, not FlexFloor's: the 6 longest "
            "requests (by their exact lengths) on the last 1 replica, the rest on the first 3"
            in capsys.readouterr().out)
    assert main(["--scenario", "paper-like", *small, "--dense-replicas", "2",
                 "--out", str(tmp_path / "b.json")]) == 0
    assert ("every request on the first 2 replicas, the others released at once"
            in capsys.readouterr().out)
    assert main(["--scenario", "paper-like", *small, "--dense-replicas", "1", "--lane-requests",
                 "9", "--out", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert "(by the estimates) on the last 3 replicas, the rest on the first replica" in out
    rep = json.load(open(tmp_path / "d.json"))
    plan = rep["per_epoch"][0]["plan"]  # not the policy's placement's predicted ends
    assert plan["placement"] == "two_tiers" and "replica_end_s" not in plan
    assert main(["--scenario", "paper-like", *small, "--out", str(tmp_path / "c.json")]) == 0
    assert "two-tier" not in capsys.readouterr().out


def test_a_shrink_inside_a_replica_keeps_the_pace_rule_and_the_planned_groups():
    """A floor below the replica's 4 ranks (`--min-active-ranks 1`), seed 2, step 2: every shrink
    the floor allows leaves a survivor hosting more experts, and the rollout ends a third after
    static's; under the pace rule (`Scenario.shrink_pace`, the default: a shrink only within
    the end to keep, and only where it saves occupied seconds) it ends within static's. With
    `GroupSource.PLANNED` (seed 3) the plan's survivor sets are built ahead, as the engine
    does: fewer groups are created during the rollout than there are shrinks, and those that
    are cost a new communicator each (`NEW`: every one; `PREBUILT`: none)."""
    from flexfloor.sim.cost import CostParams, GroupSource

    sc = SCENARIOS["paper-like"].with_overrides(min_active_ranks=1, **SMALL)
    spans = {}
    for pace in (True, False):
        rep = run(sc.with_overrides(seed=2, shrink_pace=pace))
        assert rep["elastic"]["total_response_tokens"] == rep["static"]["total_response_tokens"]
        step2 = rep["per_epoch"][1]
        spans[pace] = (step2["elastic"]["rollout_wall_seconds"]
                       / step2["static"]["rollout_wall_seconds"])
    assert spans[True] <= 1.0 < 1.2 < spans[False]
    got = {}
    for source in (GroupSource.PLANNED, GroupSource.NEW, GroupSource.PREBUILT):
        step2 = run(sc.with_overrides(seed=3, shrink_pace=False),
                    params=CostParams(group_source=source))["per_epoch"][1]["elastic"]
        shrinks = len([t for t in step2["timeline"] if "leaving" in t])
        got[source] = (shrinks, step2["groups_created_during_rollout"],
                       step2["rollout_wall_seconds"])
    (p_shrinks, p_made, p_end), (n_shrinks, n_made, n_end), (_, all_made, _) = got.values()
    assert 0 < p_made < p_shrinks and n_made == n_shrinks > 0 and p_end < n_end
    assert all_made == 0  # PREBUILT: every survivor set was built ahead


def test_where_history_proves_wrong_hand_overs_go_no_denser():
    """History correlation 0.8 (a fifth of the prompts' lengths redrawn), seed 6, step 2: the
    rollout ends after static's when leaving replicas hand their tails to the taker within the
    bound made from that history; once the history is unproven (`LengthHistory.unproven`) they
    hand over only to ranks no denser than their fullest (`ConsolidationRules.no_denser`), and
    it ends within static's. Run without the distrust rule, whose half inside the rollout also
    acts here (`test_once_history_proves_wrong_mid_rollout_hand_overs_predict_without_it`): this
    pins `no_denser` alone."""
    sc = SCENARIOS["paper-like"].with_overrides(seed=6, history_correlation=0.8,
                                                **dict(SMALL, epochs=4))
    assert sc.no_denser  # the GPU scenarios' default
    spans = {}
    for on in (True, False):
        rep = run(sc.with_overrides(no_denser=on, distrust=False))
        assert rep["elastic"]["total_response_tokens"] == rep["static"]["total_response_tokens"]
        step2 = rep["per_epoch"][1]
        spans[on] = (step2["elastic"]["rollout_wall_seconds"]
                     / step2["static"]["rollout_wall_seconds"])
    assert spans[True] <= 1.0 < spans[False]


def test_after_history_proves_wrong_the_next_rollout_is_placed_as_statics():
    """History correlation 0.8, seed 7: step 2 proves the history wrong (a fifth of the prompts
    redrawn); step 3, packed by it anyway, ends 1.39x after static's (`--distrust 0`). Placed as
    static (`Scheduler.distrust_wrong_history`, the default), its consolidation predicting from
    siblings and the prior, not that history, it ends with static's."""
    sc = SCENARIOS["paper-like"].with_overrides(seed=7, history_correlation=0.8,
                                                **dict(SMALL, epochs=3))
    assert sc.distrust  # the Scheduler's default
    spans, distrusted = {}, {}
    for on in (True, False):
        rep = run(sc.with_overrides(distrust=on))
        assert rep["elastic"]["total_response_tokens"] == rep["static"]["total_response_tokens"]
        step3 = rep["per_epoch"][2]
        spans[on] = (step3["elastic"]["rollout_wall_seconds"]
                     / step3["static"]["rollout_wall_seconds"])
        distrusted[on] = [e["plan"]["distrusted"] for e in rep["per_epoch"]]
    assert distrusted == {True: [False, False, True], False: [False, False, False]}
    assert spans[True] <= 1.0 + 1e-9 < 1.3 < spans[False]


def test_once_history_proves_wrong_mid_rollout_hand_overs_predict_without_it():
    """History correlation 0.8, seed 2, step 2 (the first plan from history: nothing yet to
    judge it by): predicting the running requests from the history throughout, the hand-overs
    misplace its short prompts that run long and the rollout ends 1.28x after static's; once the
    finished samples prove the history wrong (`LengthHistory.unproven`), predicting them from
    siblings and the prior, it ends 1.09x after."""
    sc = SCENARIOS["paper-like"].with_overrides(seed=2, history_correlation=0.8,
                                                **dict(SMALL, epochs=4))
    spans = {}
    for on in (True, False):
        rep = run(sc.with_overrides(distrust=on))
        assert rep["elastic"]["total_response_tokens"] == rep["static"]["total_response_tokens"]
        step2 = rep["per_epoch"][1]
        assert not step2["plan"]["distrusted"]
        spans[on] = (step2["elastic"]["rollout_wall_seconds"]
                     / step2["static"]["rollout_wall_seconds"])
    assert spans[True] < 1.1 < 1.25 < spans[False]


def test_heldout_reports_every_rollout_and_refuses_an_unknown_workload(tmp_path):
    """tools/heldout.py: one workload, one seed: its three scored rollouts in the JSON, the
    summary counted from them; an unknown workload name fails naming the choices."""
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, "tools/heldout.py", "--only", "corr0.8", "--seeds",
                           "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())["corr0.8"]
    spans = rep["rollouts"][0]["makespan"]
    assert len(spans) == 3 and rep["summary"]["rollouts"] == 3
    assert rep["summary"]["late"] == sum(s > 1.0 for s in spans)
    assert rep["summary"]["makespan_max"] == max(spans)
    assert "corr0.8" in proc.stdout
    assert rep["min_active_ranks"] is None and rep["group_source"] == "new"
    proc = subprocess.run([sys.executable, "tools/heldout.py", "--only", "nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "corr0.5" in proc.stderr
    # the shrink inside a replica: its floor and groups are recorded with the figures, which
    # match one rollout of the simulator's own scenario with the same settings
    from flexfloor.sim.cost import CostParams, GroupSource
    from tools import heldout

    proc = subprocess.run([sys.executable, "tools/heldout.py", "--only", "small", "--seeds", "1",
                           "--min-active-ranks", "1", "--group-source", "planned", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())["small"]
    assert rep["min_active_ranks"] == 1 and rep["group_source"] == "planned"
    direct = heldout.one("small", 0, min_active_ranks=1,
                         params=CostParams(group_source=GroupSource.PLANNED))
    assert rep["rollouts"][0]["makespan"] == direct["makespan"]
    assert direct["makespan"] != heldout.one("small", 0)["makespan"]


def test_a_group_made_late_is_a_switch_in_the_next_rollout():
    """With the engine's groups (`prebuilt_sets`: the plan's order 3, 2, 1 built ahead), rank 1
    finishing before rank 2 leaves (0, 2), which no group built ahead holds: the rollout makes
    it, and the next rollout, sharing `late_sets` as the engine's layout keeps its groups,
    switches to it."""
    from flexfloor.rollout.release import RankLimits, ReleaseRules
    from flexfloor.sim.cost import UnitCost
    from flexfloor.sim.rollout import SimRequest, simulate_rollout
    from megatron_ext.placement import initial_placement

    placement = initial_placement(8, {r: [2 * r, 2 * r + 1] for r in range(4)})
    limits = RankLimits(kv_bytes_per_token=1, max_seq_len=256, max_batch_size=8,
                        kv_budget_bytes=None, expert_nbytes=1)
    lengths = {0: 40, 1: 10, 2: 25, 3: 5}
    assignment = {r: [SimRequest(f"r{r}", r, 4, n)] for r, n in lengths.items()}
    late: set = set()
    made = []
    for _ in range(2):
        out = simulate_rollout(assignment, ReleaseRules(min_active_ranks=1), UnitCost(),
                               limits=limits, placement=placement,
                               prebuilt_sets={(0, 1, 2), (0, 1), (0,)}, late_sets=late)
        assert [t["active"] for t in out.timeline if "leaving" in t] == [[0, 1, 2], [0, 2], [0]]
        made.append(out.groups_created)
    assert made == [1, 0] and (0, 2) in late


def test_a_shrink_the_pace_rule_refused_is_asked_again_at_the_next_step():
    """As the engine asks it: the estimates and the end to keep move with every step, not only
    at a finish. Here the first shrink asked (rank 3 done at step 5) is priced with a 100 s
    stall, every later one with none: it is made at step 6, not at the next finish (25)."""
    from flexfloor.rollout.release import Pace, RankLimits, ReleaseRules
    from flexfloor.sim.cost import UnitCost
    from flexfloor.sim.rollout import SimRequest, rollout_steps
    from megatron_ext.placement import initial_placement

    placement = initial_placement(8, {r: [2 * r, 2 * r + 1] for r in range(4)})
    limits = RankLimits(kv_bytes_per_token=1, max_seq_len=256, max_batch_size=8,
                        kv_budget_bytes=None, expert_nbytes=1)
    lengths = {0: 40, 1: 30, 2: 25, 3: 5}
    assignment = {r: [SimRequest(f"r{r}", r, 4, n)] for r, n in lengths.items()}
    asked = []

    def stall(before, after, transfers):
        asked.append(len(after.ranks))
        return 100.0 if len(asked) == 1 else 0.0

    rules = ReleaseRules(min_active_ranks=1,
                         pace=Pace(lambda p, busy: (lambda n, ctx: 1.0), stall))
    gen = rollout_steps(assignment, rules, UnitCost(), limits=limits, placement=placement,
                        estimates=lambda: (lambda req, produced: float(req.length - produced)))
    try:
        next(gen)
        while True:
            gen.send(False)
    except StopIteration as done:
        out = done.value
    shrinks = [(t["step"], t["leaving"]) for t in out.timeline if "leaving" in t]
    assert shrinks == [(6, [3]), (25, [2]), (30, [1])]
    assert asked[:2] == [3, 3]  # the same shrink, refused, then asked again
