"""Rollout benchmark: FlexFloor against the baselines users run, on the same long-tailed workload,
in one run.

    python tools/bench_rollout.py --nproc 4 [--replicas R] --out b.json [--plot b.png]

The parent launches itself under torchrun (`--worker`); every worker builds the tiny MoE model and
runs, per epoch, every mode (`--modes`, default all five; `flexfloor.rollout.replicas.Mode`) on
the same prompts with the same per-request seeds, on R engine replicas of nproc / R ranks:
- static: each sample routed to the replica, then the rank, with the fewest outstanding requests
  (verl's agent loop), every rank held to the end of the rollout;
- static_chunks: `PlacementPolicy.BASELINE` (equal contiguous chunks over the ranks), all held;
- replica_release: as static, a replica released when its own requests are done;
- single_group: one world-wide EP group, contiguous chunks, static (the paper's setting);
- elastic: `PlacementPolicy.FLEXFLOOR` (length history -> placement) + `ReleasePolicy.ELASTIC`
  inside each replica.
The placements are the simulator's (`flexfloor.rollout.replicas.mode_assignments`). Requests
carry the workload's length as `target_len` (the model is random: EOS is ignored until then), so
every mode decodes exactly the same tokens, and the response digests must match.
After each epoch the FlexFloor scheduler observes every result, so from epoch 2 on it predicts
from history; the headline figures sum epochs 2..E (`summary_epochs`). Each epoch runs
`--repeats` times, alternating which mode goes first; timing figures are per-rank medians over
repeats (tokens, steps and digests are deterministic and checked equal across repeats).
Beyond the contract, each mode reports `rollout_wall_steps` (steps of the rank that stays
longest): the wall where each rank has its own accelerator. `ratios` is elastic / static,
`ratios_vs` elastic / each baseline run.

Rank 0 writes the JSON (its fields are a contract users and checks rely on); the parent prints a table, draws
the optional timeline plot, and exits non-zero when the workers fail (their exit code) or when any
epoch's responses differ between modes (3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from flexfloor.launch.reaper import remove_if_killed, start_reaper  # noqa: E402
from flexfloor.launch.stop import StopSignals  # noqa: E402
from flexfloor.outputs import (  # noqa: E402
    distinct, path_arg, stopped_line, writable, writable_image, write_json,
)
from flexfloor.rollout.metrics import chained_sha256, cpu_seconds_warning  # noqa: E402
from flexfloor.rollout.replicas import BASELINES, HELD, MODES, Mode  # noqa: E402
from flexfloor.sim.cost import cost_model  # noqa: E402
from flexfloor.rollout.workload import (  # noqa: E402
    DEFAULT_PARAMS, DISTRIBUTIONS, MIX_PARAMS, NOISE_PARAMS, dataset_batches, make_lengths,
    make_prompts, tail_stats,
)

EXIT_MISMATCH = 3
CAVEAT = (
    "On CPU the workers are processes sharing the machine's cores (4 workers on 2 cores in CI), "
    "so seconds are noisy and depend on how the OS shares the cores: a released worker frees CPU "
    "for the ones still decoding, and a lone survivor steps faster than four ranks in lockstep. "
    "The occupied worker-step ratio is deterministic and machine-independent: it is the firm "
    "figure. Where every rank has its own accelerator, the wall follows rollout_wall_steps (the "
    "steps of the rank that stays longest) more than the CPU seconds."
)
# the distribution parameters each --length-dist takes: workload keyword -> command-line flag
DIST_FLAGS = {
    "lognormal": {"median": "length_median", "sigma": "length_sigma"},
    "bimodal": {"short": "short", "long": "long", "long_frac": "long_frac"},
    "uniform": {"min_len": "min_len"},
    "file": {"path": "length_file"},
}


# --------------------------------------------------------------------------------------------
# command line and workload (shared by the parent and the workers)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="workers (ranks) to launch")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas: EP groups of nproc / replicas ranks, each holding "
                        "every expert (single_group always runs one world-wide group)")
    p.add_argument("--out", required=True, type=path_arg, help="JSON file the results go to")
    p.add_argument("--plot", default=None, type=path_arg,
                   help="PNG of the last epoch's per-rank timeline")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument("--samples-per-prompt", type=int, default=8)
    w.add_argument("--epochs", type=int, default=4)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--length-dist", default=None, choices=DISTRIBUTIONS,
                   help="response lengths (default: file with --length-file, else lognormal)")
    w.add_argument("--length-median", type=float, default=None, help="lognormal (default 16)")
    w.add_argument("--length-sigma", type=float, default=None, help="lognormal (default 1.2)")
    w.add_argument("--short", type=float, default=None, help="bimodal (default 8)")
    w.add_argument("--long", type=float, default=None, help="bimodal (default 160)")
    w.add_argument("--long-frac", type=float, default=None, help="bimodal (default 0.2)")
    w.add_argument("--min-len", type=float, default=None, help="uniform (default 1)")
    w.add_argument("--max-len", type=int, default=200,
                   help="every drawn response length is capped here (and uniform's upper "
                        "bound); a JSON --length-file with a length above it is refused")
    w.add_argument("--length-file", default=None, type=path_arg,
                   help="file: JSON {\"lengths\": [...]} or one base length per line "
                        "(see flexfloor/rollout/workload.py)")
    w.add_argument("--dataset-prompts", type=int, default=None,
                   help="prompts of the dataset each step draws --num-prompts from (a prompt "
                        "comes back once per D/B steps; default: --num-prompts, every step)")
    w.add_argument("--history-correlation", type=float, default=None,
                   help="how much a prompt's length one epoch tells of the next, 0-1 (default 1)")
    w.add_argument("--cap-fraction", type=float, default=None,
                   help="share of samples, drawn each epoch, that run to --max-len (default 0)")
    w.add_argument("--prompt-len", default="4-8", help="prompt tokens: N or LO-HI")
    w.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    r = p.add_argument_group("model and engine")
    r.add_argument("--num-experts", type=int, default=8, help="experts of the tiny preset")
    r.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="KV cache per rank, in tokens (default: holds everything)")
    r.add_argument("--max-batch-size", type=int, default=None,
                   help="requests decoded at once per rank (default: every request)")
    r.add_argument("--migrate-max-requests", type=int, default=0,
                   help="FlexFloor only: a rank with at most this many requests left (none "
                        "queued) hands them to a staying rank and leaves (0 = off)")
    b = p.add_argument_group("measurement")
    b.add_argument("--repeats", type=int, default=3, help="runs of each mode per epoch")
    b.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)}")
    c = p.add_argument_group("modelled seconds (every real step priced by the cost model)")
    c.add_argument("--accelerator", default="H800", help="H100, H800, H200, A100 or unit")
    c.add_argument("--model-shape", default="qwen3-30b-a3b", help="a model preset or deepseek-v3")
    c.add_argument("--pace-bound", action="store_true",
                   help="elastic: refuse a shrink whose survivors would end their replica later "
                        "at this cost model's step cost (elastic.pace_model); default off")
    c.add_argument("--plan-seconds", action="store_true",
                   help="elastic: place across the replicas by this cost model's modelled "
                        "seconds (scheduler.plan_seconds; with the pace rule, as the job runs "
                        "it: elastic.pace_model), not by predicted steps; needs --replicas > 1")
    t = p.add_argument_group("tail consolidation (elastic; inside each replica by default)")
    t.add_argument("--consolidate-across", action="store_true",
                   help="also hand a replica's last requests to another replica "
                        "(elastic.consolidate_across)")
    t.add_argument("--taker-hedge", type=float, default=1.0,
                   help="across replicas: a taker counts its own running requests at this times "
                        "their estimate (elastic.consolidate_taker_hedge; the simulator's GPU "
                        "scenarios: 1.25)")
    t.add_argument("--correct", action="store_true",
                   help="across replicas: the online correction against the plan's end, in "
                        "engine steps, or with --plan-seconds in modelled seconds "
                        "(elastic.consolidate_correct)")
    t.add_argument("--plan-estimates", action="store_true",
                   help="across replicas and in the pace rule: each running request predicted "
                        "from the plan (history, then siblings, then the prior) as the "
                        "simulator does (elastic.plan_estimates)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.cost = cost_model(args.accelerator, args.model_shape)
    except ValueError as e:
        p.error(f"--accelerator/--model-shape: {e}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES] or ([] if args.modes else ["(none)"])
    if bad:
        p.error(f"--modes {bad} unknown; use a comma-separated subset of {list(MODES)}")
    args.modes = [m for m in MODES if m in args.modes]  # static first, no duplicates
    if args.replicas < 1 or args.nproc % args.replicas:
        p.error(f"--replicas {args.replicas} must divide --nproc {args.nproc} (each replica is "
                f"an EP group of nproc / replicas ranks)")
    typed = args.prompt_len
    try:
        lo, _, hi = typed.partition("-")
        args.prompt_len = (int(lo), int(hi or lo))
    except ValueError:
        p.error(f"--prompt-len {typed!r}: write N or LO-HI, e.g. 4-8")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        p.error(f"--prompt-len {typed}: need 1 <= LO <= HI, e.g. 4-8")
    for name in ("nproc", "num_prompts", "samples_per_prompt", "epochs", "repeats", "max_len",
                 "num_experts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.migrate_max_requests < 0:
        p.error("--migrate-max-requests must be at least 0 (0 = off)")
    if args.dataset_prompts is not None and args.dataset_prompts < args.num_prompts:
        p.error(f"--dataset-prompts {args.dataset_prompts} must be at least --num-prompts "
                f"{args.num_prompts}")
    for name in ("history_correlation", "cap_fraction"):
        if getattr(args, name) is not None and not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    for name in ("kv_budget_tokens", "max_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1 (or left out)")
    if args.length_dist is None:  # a length file is the lengths, as in tools/simulate.py
        args.length_dist = "file" if args.length_file is not None else "lognormal"
    if args.length_dist == "file" and args.length_file is None:
        p.error("--length-dist file: give the file with --length-file PATH")
    others = {flag: d for d, flags in DIST_FLAGS.items() if d != args.length_dist
              for flag in flags.values()}
    given = [f for f in others if getattr(args, f) is not None
             and f not in DIST_FLAGS[args.length_dist].values()]
    if given:
        named = " and ".join("--" + f.replace("_", "-") for f in given)
        dists = sorted({others[f] for f in given})
        p.error(f"{named} {'does' if len(given) == 1 else 'do'} not apply to --length-dist "
                f"{args.length_dist}; drop {'it' if len(given) == 1 else 'them'}"
                + (f", or give --length-dist {dists[0]}" if len(dists) == 1 else ""))
    from flexfloor.config import Config, ConfigError, RolloutConfig, SchedulerConfig

    elastic = elastic_section(args)
    try:
        elastic.validate()
    except ConfigError as e:
        p.error(f"--taker-hedge/--correct/--plan-estimates: {e} (--consolidate-across sets "
                "elastic.consolidate_across, --pace-bound elastic.pace_model)")
    if args.plan_seconds:  # the job's own checks of scheduler.plan_seconds
        try:
            Config(rollout=RolloutConfig(replicas=args.replicas), elastic=elastic,
                   scheduler=SchedulerConfig(plan_seconds=True)).validate()
        except ConfigError as e:
            p.error(f"--plan-seconds: {e} (--replicas sets rollout.replicas)")
    return args


def elastic_section(args):
    """The elastic section the elastic mode runs under, from the flags: --pace-bound and
    --plan-seconds price the pace rule by the cost model the figures are priced with; the tail
    consolidation flags as given."""
    from flexfloor.config import ElasticConfig

    paced = args.pace_bound or args.plan_seconds
    return ElasticConfig(pace_model=args.accelerator if paced else ElasticConfig.pace_model,
                         pace_model_shape=args.model_shape if paced else None,
                         consolidate_across=args.consolidate_across,
                         consolidate_taker_hedge=args.taker_hedge,
                         consolidate_correct=args.correct, plan_estimates=args.plan_estimates)


def workload(args) -> np.ndarray:
    """The response lengths [epochs, dataset prompts, samples]: the same on every rank and the
    parent (epoch e is training step e; it reads the rows of the prompts it draws)."""
    params = {k: getattr(args, f) for k, f in DIST_FLAGS[args.length_dist].items()
              if getattr(args, f) is not None}
    params.update({k: getattr(args, k) for k in MIX_PARAMS if getattr(args, k) is not None})
    return make_lengths(args.length_dist, num_prompts=dataset_size(args),
                        samples_per_prompt=args.samples_per_prompt, epochs=args.epochs,
                        seed=args.seed, max_len=args.max_len, **params)


def workload_flag_named(message: str, args) -> str:
    """A workload error about a parameter given by a flag ("lognormal median=-5.0: ..."), told
    with the flag ("--length-median -5.0: ..."); any other as a workload error."""
    for key, flag in DIST_FLAGS[args.length_dist].items():
        for prefix in (f"{args.length_dist} {key}=", f"{key}="):
            if message.startswith(prefix) and getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} {message[len(prefix):]}"
    return f"workload: {message}"


def dataset_size(args) -> int:
    return args.dataset_prompts or args.num_prompts


def drawn_lengths(args, lengths) -> np.ndarray:
    """The lengths the steps roll out [epochs, prompts per step, samples]."""
    batches = dataset_batches(dataset_size(args), args.num_prompts, args.epochs, args.seed)
    return np.stack([lengths[e, batches[e]] for e in range(args.epochs)])


# --------------------------------------------------------------------------------------------
# the parent: launch, then report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # the worker's arguments come after "--" (see the launch below)
        argv = argv[1:]
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    try:  # before the workers start: a bad path costs a second, not the run
        out = writable(args.out, "--out")
        if args.plot:
            args.plot = writable_image(args.plot, "--plot")
        distinct(length_file=args.length_file, out=out, plot=args.plot)
    except ValueError as e:
        print(f"bench_rollout: {e}", file=sys.stderr)
        return 2
    try:
        lengths = drawn_lengths(args, workload(args))
    except (ValueError, OSError) as e:
        print(f"bench_rollout: {workload_flag_named(str(e), args)}", file=sys.stderr)
        return 2
    longest = args.prompt_len[1] + int(lengths.max())
    if args.kv_budget_tokens is not None and args.kv_budget_tokens < longest:
        print(f"bench_rollout: --kv-budget-tokens {args.kv_budget_tokens} cannot hold the longest "
              f"request alone ({longest} tokens: prompt + response); raise it", file=sys.stderr)
        return 2
    # torchrun and its workers end with this process, however it ends (SIGKILL too): they carry
    # the reaper's token (flexfloor/launch/reaper.py); SIGTERM ends it as an exception, so the
    # partial report below is removed
    start_reaper()
    # the workers write the report beside --out, renamed over it when they succeed: an earlier
    # report there stays until this run's replaces it, and a stale one never passes for it
    partial = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{os.getpid()}.partial")
    # stopped, the workers outlive this process by a moment (the reaper ends them after its
    # exit): one that writes the report then leaves it, so the reaper removes it after them
    remove_if_killed([partial, partial + ".tmp"])
    written = []  # what a stop leaves written
    with StopSignals((signal.SIGTERM, signal.SIGINT)) as stop:
        try:
            rc = stop.run(_launch, args, argv, lengths, out, partial, written)
        finally:  # the report, and the .tmp of a worker stopped inside its write
            for leftover in (partial, partial + ".tmp"):
                if os.path.exists(leftover):
                    os.remove(leftover)
    if stop.got:
        print(stopped_line("bench_rollout", written, stop.signum), file=sys.stderr)
        return 128 + stop.signum
    return rc


def _launch(args, argv, lengths, out: str, partial: str, written: list) -> int:
    """Run the workers (they write their report to `partial`), then print and keep it as
    `out` (each file kept goes into `written`)."""
    worker_argv = [*argv, f"--out={partial}"]  # the last --out wins: an absolute path
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           "--standalone",  # torchrun binds a free port
           # "--": torchrun's own parser must not read the benchmark's flags (--nproc is a
           # prefix of its --nproc-per-node)
           os.path.abspath(__file__), "--", "--worker", *worker_argv]
    tail = tail_stats(lengths)
    print(f"bench_rollout: {args.nproc} workers as {args.replicas} replicas, modes "
          f"{','.join(args.modes)}, {args.num_prompts} prompts x "
          f"{args.samples_per_prompt} samples, {args.epochs} epochs x {args.repeats} repeats; "
          f"{args.length_dist} lengths: p50 {tail['p50']:g}, p99 {tail['p99']:.0f}, "
          f"p99/p50 {tail['p99_over_p50']:.1f}, max {tail['max']}", flush=True)
    t0 = time.perf_counter()
    # a session of its own: a terminal's Ctrl-C reaches this process only, which ends torchrun
    # and the workers at once (each would print its own traceback of the others' end)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait()
    except BaseException:
        _kill_tree(proc)
        raise
    seconds = time.perf_counter() - t0
    if rc != 0 or not os.path.exists(partial):
        print(f"bench_rollout: the workers failed (exit code {rc}) after {seconds:.0f} s; "
              "see their output above", file=sys.stderr)
        return rc or 1
    os.replace(partial, out)
    written.append(out)
    with open(out) as f:
        report = json.load(f)
    print(format_report(report))
    print(f"took {seconds:.0f} s; results in {out}")
    if args.plot:
        plot_timeline(report, args.plot)
        written.append(args.plot)
        print(f"timeline plot in {args.plot}")
    if report.get("identical_responses") is False:
        bad = [e["epoch"] for e in report["per_epoch"] if not e.get("sha_match", True)]
        print(f"bench_rollout: the modes' responses DIFFER in epochs {bad}", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process under it, all at once, and wait for them: none is left
    to see the others go (and print a traceback of it)."""
    import psutil

    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:  # it has ended: its children are the reaper's
        procs = []
    for p in [*procs, proc]:
        try:
            p.kill()
        except (psutil.Error, OSError):
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def _fmt(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):  # NaN: no pair to rank
        return "-"
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"
    return str(x)


def format_report(report: dict) -> str:
    """The summary a person reads: a column per mode, elastic/static, and elastic against each
    baseline."""
    modes = [m for m in MODES if m in report]
    rat = report.get("ratios", {})
    rows = [
        ("total_response_tokens", None),
        ("occupied_worker_steps", None),
        ("tokens_per_occupied_worker_step", "tokens_per_occupied_worker_step"),
        ("occupied_worker_seconds", None),
        ("tokens_per_occupied_worker_second", "tokens_per_occupied_worker_second"),
        ("rollout_wall_seconds", "rollout_wall_seconds"),
        ("rollout_wall_steps", "rollout_wall_steps"),
        ("tail_fraction", None),
        ("modelled_occupied_gpu_seconds", None),
        ("tokens_per_modelled_occupied_gpu_second", "tokens_per_modelled_occupied_gpu_second"),
        ("modelled_rollout_seconds", "modelled_rollout_seconds"),
    ]
    epochs = report["summary_epochs"]
    head = f"epochs {epochs[0]}..{epochs[-1]}" if len(epochs) > 1 else f"epoch {epochs[0]}"
    lines = [f"\n{head:<36}" + "".join(f"{m:>16}" for m in modes)
             + (f"{'elastic/static':>16}" if rat else "")]
    for key, rkey in rows:
        line = f"{key:<36}" + "".join(f"{_fmt(report[m][key]):>16}" for m in modes)
        if rat:
            line += f"{_fmt(rat[rkey]) if rkey else '':>16}"
        lines.append(line)
    repeats = report.get("setup", {}).get("repeats", 1)
    lines.append(f"(seconds: per-rank medians over {repeats} repeats; steps, tokens: exact)")
    if report.get("setup", {}).get("cpu_seconds_warning"):
        lines.append(f"warning: {report['setup']['cpu_seconds_warning']}")
    for base, r in report.get("ratios_vs", {}).items():
        lines.append(f"elastic / {base:<16} tokens per occupied step x"
                     f"{_fmt(r['tokens_per_occupied_worker_step'])}, per occupied second x"
                     f"{_fmt(r['tokens_per_occupied_worker_second'])}, wall x"
                     f"{_fmt(r['rollout_wall_seconds'])} (in steps x{_fmt(r['rollout_wall_steps'])})")
    for e in report["per_epoch"]:
        parts = [f"{m} {e[m]['occupied_worker_steps']} steps" for m in modes]
        if "ratios" in e:
            r = e["ratios"]
            parts.append(f"ratios step {r['tokens_per_occupied_worker_step']:.2f} "
                         f"second {r['tokens_per_occupied_worker_second']:.2f} "
                         f"wall {r['rollout_wall_seconds']:.2f} "
                         f"(in steps {r['rollout_wall_steps']:.2f})")
        if "predictor" in e:
            parts.append(f"predictor spearman {_fmt(e['predictor']['spearman'], 2)} "
                         f"({max(e['predictor']['sources'], key=e['predictor']['sources'].get)})")
        if "prediction_accuracy" in e:
            parts.append(evidence_line(e["prediction_accuracy"]))
        tails = e.get("elastic", {}).get("tails")
        if tails:
            parts.append(f"elastic moved {tails['moved_within']} within, "
                         f"{tails['moved_across']} across ({tails['corrections']} corrections)")
        if "sha_match" in e:
            parts.append("same tokens" if e["sha_match"] else "TOKENS DIFFER")
        lines.append(f"  epoch {e['epoch']}: " + ", ".join(parts))
    if "reconfiguration" in report:
        rc = report["reconfiguration"]
        lines.append(f"reconfiguration (elastic, summed over ranks): plan {rc['plan_s']:.3f} s, "
                     f"transfer {rc['transfer_s']:.3f} s, switch {rc['switch_s']:.3f} s, "
                     f"{rc['sent_bytes'] / 2**20:.1f} MiB sent "
                     f"({100 * rc['fraction_of_occupied_seconds']:.1f}% of occupied time)")
    line = ceilings_line(report.get("ceilings", {}))
    if line:
        lines.append(line)
    if "identical_responses" in report:
        lines.append("responses identical in every epoch: "
                     + ("yes" if report["identical_responses"] else "NO"))
    lines.append(f"caveat: {report['caveat']}")
    return "\n".join(lines)


def plot_timeline(report: dict, path: str) -> None:
    """Per mode, per rank: busy (start -> local finish), occupied but idle (-> release) and
    released (-> rollout end), for the last epoch, in engine steps: the CPU seconds flatter a
    mode that releases workers (a released process frees a core) and are no headline."""
    from flexfloor.rollout.timeline import plot_rank_timeline, tail_fraction

    last = report["per_epoch"][-1]
    modes = {m: last[m]["per_rank"] for m in MODES if m in last}
    panels = {m: (f"{m}: {last[m]['occupied_worker_steps']} occupied worker-steps, "
                  f"{last[m]['modelled_occupied_gpu_seconds']:.2f} modelled occupied GPU-s, "
                  f"tail fraction {tail_fraction(modes[m], 'steps'):.2f}") for m in modes}
    title = f"rollout timeline, epoch {last['epoch']}"
    if "ratios" in report:
        r = report["ratios"]
        e = report["summary_epochs"]
        span = f"epochs {e[0]}..{e[-1]}" if len(e) > 1 else f"epoch {e[0]}"
        title += (f"\nelastic/static over {span}: tokens/occupied worker-step "
                  f"x{r['tokens_per_occupied_worker_step']:.2f}, tokens/modelled GPU-s "
                  f"x{r['tokens_per_modelled_occupied_gpu_second']:.2f},\nrollout steps "
                  f"x{r['rollout_wall_steps']:.2f}, modelled rollout "
                  f"x{r['modelled_rollout_seconds']:.2f}")
    plot_rank_timeline(modes, path, title=title, panel_titles=panels, unit="steps")


# --------------------------------------------------------------------------------------------
# the workers


def worker(args) -> None:
    """One rank: every epoch, both modes `--repeats` times; rank 0 writes the JSON."""
    bench = Bench(args)
    epochs = [bench.epoch(e) for e in range(1, args.epochs + 1)]
    report = summary(epochs, bench.kept, args)
    report["per_epoch"] = epochs
    report["workload"] = bench.workload_report()
    report["setup"] = bench.setup_report()
    report["caveat"] = CAVEAT if bench.par.backend == "gloo" else (
        "Seconds are measured on the accelerators; the step ratio is the machine-independent twin.")
    if bench.rank == 0:
        write_json(args.out, report)
    bench.par.barrier()
    for stack in bench.stacks.values():
        stack.close()
    bench.par.destroy()


class Bench:
    """The model, its rollout stacks (R replicas, and one world-wide group for
    single_group), both schedulers of one rank, and the epochs they run."""

    def __init__(self, args):
        from flexfloor.config import ModelConfig, PlacementPolicy, RolloutConfig, SchedulerConfig
        from flexfloor.model import build_model
        from flexfloor.parallel import Parallel
        from flexfloor.rollout.engine import DEFAULT_BLOCK_TOKENS
        from flexfloor.rollout.offload import ResidentSet
        from flexfloor.rollout.scheduler import LengthHistory, Scheduler
        from flexfloor.rollout.stack import RolloutStack

        self.args = args
        self.t_start = time.perf_counter()
        self.lengths = workload(args)  # [epochs, prompts, samples]
        self.world = int(os.environ["WORLD_SIZE"])
        base = ModelConfig()
        self.model_cfg = dataclasses.replace(
            base, num_experts=args.num_experts,
            max_seq_len=max(base.max_seq_len, args.prompt_len[1] + args.max_len))
        # the training EP size must divide the world and the experts; the rollout uses every rank
        self.par = Parallel.build(expert_parallel_size=math.gcd(self.world, args.num_experts))
        self.rank = self.par.rank
        self.model = build_model(self.model_cfg, self.par)
        self.max_batch = args.max_batch_size or args.num_prompts * args.samples_per_prompt
        # FlexFloor's migration (--migrate-max-requests; the baselines never migrate)
        migrate = SchedulerConfig(migrate=args.migrate_max_requests > 0,
                                  migrate_max_requests=args.migrate_max_requests)
        elastic = elastic_section(args)
        elastic.validate()
        # replicas -> rollout stack: R replicas, and R = 1 for single_group (the same at R = 1);
        # elastic runs under the job's default elastic section (tail consolidation inside each
        # replica, as the simulator's tiny-cpu)
        self.stacks = {r: RolloutStack.build(self.par, self.model, scheduler=migrate,
                                             elastic=elastic,
                                             rollout=RolloutConfig(
                                                 replicas=r, max_batch_size=self.max_batch,
                                                 kv_budget_tokens=args.kv_budget_tokens,
                                                 kv_block_tokens=DEFAULT_BLOCK_TOKENS,
                                                 progress=False))
                       for r in sorted({1, args.replicas})}
        self.stack = self.stacks[args.replicas]
        # --plan-seconds: FlexFloor's plan priced by the cost model the figures are priced with
        self.plan_cost = self.stack.plan_step_cost() if args.plan_seconds else None
        memory = self.stack.memory
        self.resident = ResidentSet(self.model, moe=self.stack.moe, engine=self.stack.engine)
        self.schedulers = {
            "chunks": Scheduler(PlacementPolicy.BASELINE, memory=memory,
                                max_batch_size=self.max_batch),
            "flexfloor": Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), memory=memory,
                                   max_batch_size=self.max_batch),
        }
        self.prompts = make_prompts(dataset_size(args), args.prompt_len,
                                    self.model_cfg.vocab_size, args.seed)
        self.batches = dataset_batches(dataset_size(args), args.num_prompts, args.epochs, args.seed)
        self.kept = []  # per summary epoch: mode -> (median records, results)

    def epoch(self, epoch: int) -> dict:
        """Place every mode, run them alternately, report; the FlexFloor scheduler then learns."""
        from flexfloor.rollout.replicas import mode_assignments
        from flexfloor.rollout.scheduler import evidence_accuracy, prediction_accuracy
        from flexfloor.rollout.tails import RunningEstimates, end_to_keep

        args, t0 = self.args, time.perf_counter()
        groups = self.prompt_groups(epoch)
        replicas = self.stack.layout.topology.replicas
        chunks = self.schedulers["chunks"].plan(groups, range(self.world))
        # FlexFloor plans inside each replica (its static bound, releases and memory floor), as
        # the simulator does
        plan = self.schedulers["flexfloor"].plan(groups, range(self.world), replicas=replicas,
                                                 step_cost=self.plan_cost)
        assignment = mode_assignments(groups, replicas, chunks=chunks, flexfloor=plan)
        # with --plan-estimates each running request's prediction across replicas and in the
        # pace rule: the plan's (else its siblings', else its cap)
        estimates = (RunningEstimates.of_plan(plan, self.schedulers["flexfloor"].predictor)
                     if args.plan_estimates else None)
        expected = {Mode.STATIC_CHUNKS: chunks.expected_finish,
                    Mode.SINGLE_GROUP: chunks.expected_finish, Mode.ELASTIC: plan.expected_finish}
        runs = {m: [] for m in args.modes}
        for rep in range(args.repeats):
            for mode in (args.modes if rep % 2 == 0 else args.modes[::-1]):
                runs[mode].append(self.rollout(Mode(mode), assignment[Mode(mode)],
                                               plan.expected_finish, end_to_keep(plan),
                                               modelled_clock=plan.by_seconds,
                                               estimates=estimates))
        entry = {"epoch": epoch, "history": epoch > 1, "seconds": time.perf_counter() - t0}
        kept = {}
        for mode in args.modes:
            entry[mode], kept[mode] = mode_report(
                runs[mode], assignment[Mode(mode)], expected.get(Mode(mode)), self.world, args,
                # across replicas a hand-over lands where the wall clocks say: steps vary
                steps_vary=mode == Mode.ELASTIC.value and args.consolidate_across)
        if epoch > 1 or args.epochs == 1:
            self.kept.append(kept)
        if "elastic" in args.modes:
            results = runs["elastic"][0]["results"]
            lengths = {}
            for r in results:
                lengths.setdefault(r.prompt_uid, []).append(len(r.token_ids))
            realised = {uid: max(ls) for uid, ls in lengths.items()}
            predictor = self.schedulers["flexfloor"].predictor
            entry["predictor"] = {**prediction_accuracy(plan.predicted, realised),
                                  "sources": plan.sources}
            # per evidence, as the simulator reports it: the history's (prompts that have
            # some) and the siblings' (each prompt from the shorter half of its samples)
            entry["prediction_accuracy"] = evidence_accuracy(plan, lengths, predictor)
            # history for the next epoch: every rank observes the same (gathered) results
            self.schedulers["flexfloor"].observe(results)
        add_ratios(entry, args.modes)
        if len(args.modes) > 1:
            entry["sha_match"] = (len({entry[m]["responses_sha256"] for m in args.modes}) == 1
                                  and all(entry[m]["repeats_consistent"] for m in args.modes))
        if self.rank == 0:
            print(progress_line(entry, args), flush=True)
        return entry

    def prompt_groups(self, epoch: int) -> list:
        """The epoch's batch: the prompts this step draws from the dataset (every prompt once,
        shuffled, when the dataset is one step's), its samples with the workload's lengths as
        targets; a prompt seen before has history."""
        from flexfloor.rollout.scheduler import PromptGroup
        from flexfloor.rollout.types import Request, SamplingParams

        args = self.args
        sampling = SamplingParams(greedy=args.greedy, temperature=1.0)
        order = [int(u) for u in self.batches[epoch - 1]]
        return [PromptGroup(uid, tuple(
            Request(prompt_uid=uid, sample_index=s, prompt_ids=self.prompts[uid],
                    max_new_tokens=args.max_len, sampling=sampling, seed=args.seed, step=epoch,
                    target_len=int(self.lengths[epoch - 1, uid, s]))
            for s in range(args.samples_per_prompt))) for uid in order]

    def rollout(self, mode: Mode, requests_of: dict, expected_finish: dict,
                end_bound=None, modelled_clock: bool = False, estimates=None) -> dict:
        """One rollout of this rank's requests (`requests_of`: rank -> requests) in `mode`;
        every rank's records and results, gathered. single_group runs on one world-wide group,
        the others on the replicas; elastic builds the survivor groups its plan
        (`expected_finish`) implies before decoding and, with --correct, keeps its end
        (`end_bound`: `tails.end_to_keep`, in engine steps, or with `modelled_clock` (a plan by
        seconds, --plan-seconds) in modelled seconds, the replicas' clock) and predicts its
        running requests from the plan (`estimates`). A held mode's ranks are occupied to the
        end of the slowest replica."""
        import torch.distributed as dist

        from flexfloor.config import ReleasePolicy
        from flexfloor.rollout.metrics import rollout_metrics
        from flexfloor.rollout.offload import HostOffload, OffloadOnRelease, resident_bytes
        from flexfloor.rollout.replicas import held_to_end
        from flexfloor.rollout.survivors import live_process_groups

        stack = self.stacks[1] if mode == Mode.SINGLE_GROUP else self.stack
        elastic = mode == Mode.ELASTIC
        policy = ReleasePolicy.ELASTIC if elastic else ReleasePolicy.STATIC
        # a released rank parks its weights in host memory until resync (what it frees: below)
        listener = OffloadOnRelease(HostOffload(self.resident, self.par.device)) if elastic else None
        # replicas: the experts their placement borrows; elastic: the survivor groups built ahead
        run = stack.start(policy, on_event=listener, expected_finish=expected_finish,
                          end_bound=end_bound, modelled_clock=elastic and modelled_clock,
                          estimates=estimates)
        groups = live_process_groups()  # after the groups built ahead: counts any made later
        out = run.generate(requests_of[self.rank])
        held = resident_bytes(self.resident, self.par.device)  # a rank never released holds it
        out.record.note(groups_created_during_rollout=live_process_groups() - groups,
                        resident_bytes_before_release=held, resident_bytes_after_release=held,
                        # the rollout began before decoding: the replica layout's expert
                        # transfers (occupied time; the decoding clock starts at 0)
                        start_s=-run.started["start_s"],
                        start_sent_bytes=run.started["sent_bytes"])
        out.record.resync_s = run.resync()
        if listener is not None:
            out.record.note(**listener.take_stats())
        records, results = [None] * self.world, [None] * self.world
        record = out.record.as_dict()
        # the steps at which this rank's replica handed requests over and stayed (the correction)
        record["corrected_at"] = [t["step"] for t in getattr(run.membership, "timeline", [])
                                  if "corrected" in t]
        dist.all_gather_object(records, record, group=self.par.world_group)
        dist.all_gather_object(results, out.results, group=self.par.world_group)
        results = [r for part in results for r in part]
        if mode in HELD and stack.layout.replicated:
            records = held_to_end(records)
        return {"records": records, "results": results,
                "metrics": rollout_metrics(records, results, self.args.cost)}

    def workload_report(self) -> dict:
        args, lengths = self.args, drawn_lengths(self.args, self.lengths)
        lo, hi = args.prompt_len
        return {
            "length_dist": args.length_dist,
            "params": {**DEFAULT_PARAMS[args.length_dist], **NOISE_PARAMS, **MIX_PARAMS,
                       **{k: getattr(args, f) for k, f in DIST_FLAGS[args.length_dist].items()
                          if getattr(args, f) is not None},
                       **{k: getattr(args, k) for k in MIX_PARAMS if getattr(args, k) is not None}},
            "num_prompts": args.num_prompts, "dataset_prompts": dataset_size(args),
            "samples_per_prompt": args.samples_per_prompt,
            "epochs": args.epochs, "seed": args.seed, "max_len": args.max_len,
            "prompt_len": [lo, hi], "greedy": args.greedy,
            "tail_stats": tail_stats(lengths),
            "tail_stats_per_epoch": [tail_stats(e) for e in lengths],
            "kv_budget_tokens": args.kv_budget_tokens, "max_batch_size": self.max_batch,
            # KV tokens a rank reserves for its fair share of an epoch: sizes --kv-budget-tokens
            "mean_kv_tokens_per_rank": float(
                (lengths.sum(axis=(1, 2)).mean() + lengths[0].size * (lo + hi) / 2) / self.world),
        }

    def setup_report(self) -> dict:
        return {"nproc": self.world, "backend": self.par.backend,
                "num_experts": self.args.num_experts, "training_ep_size": self.par.ep_size,
                "replicas": self.args.replicas, "replica_ranks": [
                    list(r) for r in self.stack.layout.topology.replicas],
                "max_seq_len": self.model_cfg.max_seq_len, "repeats": self.args.repeats,
                "modes": self.args.modes, "worker_seconds": time.perf_counter() - self.t_start,
                "accelerator": self.args.accelerator, "model_shape": self.args.model_shape,
                "pace_bound": self.args.pace_bound, "plan_seconds": self.args.plan_seconds,
                "consolidate_across": self.args.consolidate_across,
                "taker_hedge": self.args.taker_hedge, "correct": self.args.correct,
                "plan_estimates": self.args.plan_estimates,
                "cpu_seconds_warning": cpu_seconds_warning(self.world)}


def mode_report(runs: list[dict], assignment: dict, expected_finish, world: int, args,
                steps_vary: bool = False) -> tuple[dict, tuple]:
    """One mode's figures for one epoch: `rollout_metrics` of the per-rank median records over
    the repeats; returns (figures, (median records, results)) for the summary.
    `expected_finish` (rank -> predicted steps) where the mode's placement predicts one;
    `steps_vary`: its step counts may differ between repeats (only its tokens must not)."""
    from flexfloor.rollout.metrics import rollout_metrics

    kept = alike_steps(runs) if steps_vary else runs
    records = median_records([run["records"] for run in kept])
    results = kept[0]["results"]
    m = rollout_metrics(records, results, args.cost)
    m["repeats"] = {k: [run["metrics"][k] for run in runs] for k in (
        "occupied_worker_seconds", "rollout_wall_seconds", "occupied_worker_steps",
        "responses_sha256")}
    m["repeats_consistent"] = all(
        len(set(m["repeats"][k])) == 1
        for k in ("responses_sha256",) + (() if steps_vary else ("occupied_worker_steps",)))
    # tail consolidation: requests moved inside a replica and to another one, and the
    # corrections (a replica handing its longest requests over and staying), in those repeats
    first = kept[0]["records"]
    per_replica = world // args.replicas
    m["tails"] = {"moved_within": sum(r["migrated_out"] - r["migrated_across"] for r in first),
                  "moved_across": sum(r["migrated_across"] for r in first),
                  "corrections": len({(r["rank"] // per_replica, s) for r in first
                                      for s in r.get("corrected_at", ())})}
    m["reconfiguration"] = reconfiguration(records, m["occupied_worker_seconds"])
    m["placement"] = {"requests_per_rank": [len(assignment[r]) for r in range(world)]}
    if expected_finish is not None:
        m["placement"]["expected_finish_steps"] = [expected_finish[r] for r in range(world)]
    return m, (records, results)


def alike_steps(runs: list[dict]) -> list[dict]:
    """The repeats whose ranks took the steps of the repeat with the median occupied
    worker-steps: their records are medians of one run of steps (a rank's steps, release and
    trace from one repeat, its timings from another would price a step it did not take)."""
    steps = [[r["steps"] for r in run["records"]] for run in runs]
    order = sorted(range(len(runs)), key=lambda i: (sum(steps[i]), i))
    mid = steps[order[(len(order) - 1) // 2]]
    return [run for run, s in zip(runs, steps) if s == mid]


def median_records(repeats: list[list[dict]]) -> list[dict]:
    """Per rank, the median over repeats of every timing field (deterministic fields are equal)."""
    out = []
    for per_rank in zip(*repeats):
        rec = {}
        for key in per_rank[0]:
            values = [r.get(key) for r in per_rank]
            if all(isinstance(v, (int, float)) for v in values) and len(set(values)) > 1:
                rec[key] = statistics.median(values)
            else:
                rec[key] = values[0]
        out.append(rec)
    return out


def reconfiguration(records: list[dict], occupied_s: float) -> dict:
    """Seconds the release protocol spent (summed over ranks) and bytes the experts moved."""
    out = {k: sum(r.get(k, 0.0) for r in records) for k in ("plan_s", "transfer_s", "switch_s")}
    out["start_s"] = -sum(r.get("start_s", 0.0) for r in records)  # the start's transfers
    out["sent_bytes"] = int(sum(r.get("sent_bytes", 0) for r in records))
    # replicas: the experts each rollout start borrows (not a release cost: every mode pays it)
    out["start_sent_bytes"] = int(sum(r.get("start_sent_bytes", 0) for r in records))
    # each shrink's group switch: the slowest rank that took part (survivor groups built ahead)
    shrinks = [r.get("switch_s_per_shrink", []) for r in records]
    out["switch_s_per_shrink"] = [max(s[k] for s in shrinks if len(s) > k)
                                  for k in range(max(map(len, shrinks), default=0))]
    total = out["plan_s"] + out["transfer_s"] + out["switch_s"]
    out["fraction_of_occupied_seconds"] = total / occupied_s if occupied_s else 0.0
    return out


def summary(epochs: list[dict], kept: list[dict], args) -> dict:
    """The headline figures over the summary epochs (2..E: the scheduler has history).

    Each rank's occupied time, tail, steps and tokens add up over epochs, so the metrics are
    `rollout_metrics` of per-rank records summed over epochs; the rollout wall time is the sum of
    the epochs' walls and the digest is one over the epochs' digests.
    """
    from flexfloor.rollout.metrics import rollout_metrics, summed_records

    first = 2 if args.epochs > 1 else 1
    chosen = [e for e in epochs if e["epoch"] >= first]
    report = {"summary_epochs": [e["epoch"] for e in chosen],
              "summary_note": ("figures sum epochs 2..E, where the scheduler predicts from the "
                               "length history of earlier epochs; epoch 1 (no history, default "
                               "prediction) is only in per_epoch")
              if first == 2 else "one epoch: no length history, default prediction"}
    for mode in args.modes:
        summed = summed_records([k[mode][0] for k in kept])
        results = [r for k in kept for r in k[mode][1]]
        m = rollout_metrics(summed, results, args.cost)
        m.pop("released_ranks")  # per epoch only
        for key in ("rollout_wall_seconds", "rollout_wall_steps"):
            m[key] = sum(e[mode][key] for e in chosen)
        m["responses_sha256"] = chained_sha256(e[mode]["responses_sha256"] for e in chosen)
        report[mode] = m
    report["modes"] = list(args.modes)
    add_ratios(report, args.modes)
    if len(args.modes) > 1:
        report["identical_responses"] = all(e["sha_match"] for e in epochs)
    if "elastic" in args.modes:
        recs = [rec for k in kept for rec in k["elastic"][0]]
        report["reconfiguration"] = reconfiguration(
            recs, report["elastic"]["occupied_worker_seconds"])
    report["ceilings"] = ceilings({m: [rec for k in kept for rec in k[m][0]] for m in args.modes},
                                  args.kv_budget_tokens)
    return report


def ceilings(records: dict, kv_budget_tokens) -> dict:
    """What no release policy can beat on this workload, from the records themselves
    (mode -> every summary epoch's per-rank records).

    - `release_only_step_ratio`: static's occupied worker-steps over its busy ones: every rank
      of static's placement released when its own last response ends, nothing moved;
    - with a KV budget, `kv_pool_use` (per mode: cached tokens summed over every rank-step,
      over the budget times the rank-steps) and `kv_bound_step_ratio`: static's occupied
      worker-steps over the fewest rank-steps that could hold elastic's cached K/V, each
      rank-step with a full pool. The pool holds whole blocks, so where the traces count them
      (`StepTrace.kv_blocks`) the bound is in blocks, the budget's whole blocks to a rank-step
      (`kv_block_use`: the blocks as `kv_pool_use` counts tokens), and `kv_token_bound_step_ratio`
      is the looser bound in tokens. A request's cached tokens (and blocks) over its life do not
      depend on where it runs (a preemption only adds), and a release takes KV room from the
      survivors (the borrowed experts), never gives it, so above this ratio only more KV per
      rank helps.
    """
    out = {}
    if "static" in records:
        st = records["static"]
        busy = sum(r["busy_steps"] for r in st)
        out["release_only_step_ratio"] = sum(r["steps"] for r in st) / busy if busy else None
    if kv_budget_tokens:
        steps = {m: sum(r["steps"] for r in recs) for m, recs in records.items()}
        kv = {m: sum(sum(r["trace"]["kv_tokens"]) for r in recs) for m, recs in records.items()}
        out["kv_pool_use"] = {m: kv[m] / (kv_budget_tokens * steps[m]) for m in records}
        sizes = {r["trace"].get("block_tokens", 0) for recs in records.values() for r in recs}
        bt = sizes.pop() if len(sizes) == 1 else 0  # one block size, traced
        capacity = kv_budget_tokens // bt if bt else 0
        if capacity:
            blocks = {m: sum(sum(r["trace"]["kv_blocks"]) for r in recs)
                      for m, recs in records.items()}
            out["kv_block_use"] = {m: blocks[m] / (capacity * steps[m]) for m in records}
        if "static" in records and "elastic" in records:
            by_tokens = steps["static"] / math.ceil(kv["elastic"] / kv_budget_tokens)
            if capacity:
                out["kv_bound_step_ratio"] = (steps["static"]
                                              / math.ceil(blocks["elastic"] / capacity))
                out["kv_token_bound_step_ratio"] = by_tokens
            else:
                out["kv_bound_step_ratio"] = by_tokens
    return out


def ceilings_line(c: dict) -> str | None:
    """`ceilings` on one line (None without static's release-only figure); the KV bound only
    where static and elastic both ran."""
    if c.get("release_only_step_ratio") is None:
        return None
    line = (f"ceilings (step ratio vs static): {c['release_only_step_ratio']:.2f} releasing "
            "static's ranks at their own last response")
    if "kv_token_bound_step_ratio" in c:  # blocks traced
        use = c["kv_block_use"]
        line += (f", {c['kv_bound_step_ratio']:.2f} with every rank-step's KV pool full "
                 f"of blocks (block use: static {use['static']:.2f}, elastic "
                 f"{use['elastic']:.2f}; {c['kv_token_bound_step_ratio']:.2f} counting "
                 "tokens, which a pool of blocks cannot hold)")
    elif "kv_bound_step_ratio" in c:
        line += (f", {c['kv_bound_step_ratio']:.2f} with every rank-step's KV pool full "
                 f"(pool use: static {c['kv_pool_use']['static']:.2f}, "
                 f"elastic {c['kv_pool_use']['elastic']:.2f})")
    return line


def add_ratios(rep: dict, modes: list[str]) -> None:
    """`ratios` (elastic / static) and `ratios_vs` (elastic / each baseline run) into a report
    or a per-epoch entry, where elastic and the baseline ran."""
    from flexfloor.rollout.metrics import ratios

    if "elastic" not in modes:
        return
    if "static" in modes:
        rep["ratios"] = ratios(rep["elastic"], rep["static"])
    rep["ratios_vs"] = {b: ratios(rep["elastic"], rep[b]) for b in BASELINES if b in modes}


def evidence_line(accuracy: dict) -> str:
    """The predictor's accuracy per evidence (`prediction_accuracy`), on one line."""
    return " / ".join(f"{k} spearman {_fmt(v['spearman'], 2)} mae {_fmt(v['mae'])} (n {v['n']})"
                      for k, v in accuracy.items())


def progress_line(entry: dict, args) -> str:
    parts = [f"{m} {entry[m]['occupied_worker_steps']} occupied steps" for m in args.modes]
    if "ratios" in entry:
        r = entry["ratios"]
        parts.append(f"step ratio {r['tokens_per_occupied_worker_step']:.2f}, second ratio "
                     f"{r['tokens_per_occupied_worker_second']:.2f}, wall ratio "
                     f"{r['rollout_wall_seconds']:.2f} (in steps {r['rollout_wall_steps']:.2f})")
    if "sha_match" in entry:
        parts.append("same tokens" if entry["sha_match"] else "TOKENS DIFFER")
    if "predictor" in entry:
        p = entry["predictor"]
        parts.append(f"predictor spearman {_fmt(p['spearman'], 2)}")
    if "prediction_accuracy" in entry:
        parts.append(evidence_line(entry["prediction_accuracy"]))
    return f"epoch {entry['epoch']}/{args.epochs} ({entry['seconds']:.1f} s): " + ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
