"""Cluster-scale rollout simulator: the baselines users run vs FlexFloor, on N accelerators.

    python tools/simulate.py --list
    python tools/simulate.py --scenario paper-like --out sim.json [--plot sim.png] [--sweep]

It drives the trainer's own scheduler (length history, prediction, placement) and the engine's
own release decision (`ElasticMembership.decide`: floor, memory capacity, `plan_shrink`) over a
discrete-event model of lockstep EP decoding priced by a roofline cost model (flexfloor/sim/).
The cluster runs `--replicas` EP groups of gpus / replicas ranks. The JSON has
`tools/bench_rollout.py`'s metric names for every mode (`modes`: static, static_chunks,
replica_release, single_group, elastic; seconds are modelled), `ratios` (elastic / static),
`ratios_vs` ({baseline: {metric: elastic / baseline}}), `vs_static` and `ideal` (no
idle-but-occupied time at all). `--sweep` adds FlexFloor over GPU counts and
tail heaviness. Replay your own lengths with `--length-file` (the workload file format of
flexfloor/rollout/workload.py: JSON {"lengths": [epochs][prompts][samples]} or one base length
per line).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from flexfloor.outputs import (  # noqa: E402
    distinct, path_arg, stopped_line, writable, writable_image, write_json,
)
from flexfloor.sim.cost import CostParams, GroupSource  # noqa: E402
from flexfloor.sim.scenarios import (  # noqa: E402
    MODES, SCENARIOS, pace_rule_ignored, pace_rule_moot, prepare, run, sweep,
    sweep_scenarios,
)


def switch(value: str) -> bool:
    """A 0/1 flag's value (1: on)."""
    if value not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 (off) or 1 (on), got {value!r}")
    return value == "1"


SCENARIO = "default: the scenario's"
OVERRIDES = {  # flag -> (Scenario field, type, help); each default: the scenario's
    "gpus": ("gpus", int, "accelerators (ranks) in the cluster"),
    "replicas": ("replicas", int, "EP groups of gpus / replicas ranks, each holding every expert"),
    "accelerator": ("accelerator", str, "H100, H800, H200 or A100 (roofline step costs)"),
    "model": ("model", str, "a model preset or deepseek-v3"),
    "dataset_prompts": ("dataset_prompts", int,
                        "prompts of the dataset each step draws --num-prompts from"),
    "history_correlation": ("history_correlation", float,
                            "how much a prompt's length one step tells of the next, 0-1"),
    "cap_fraction": ("cap_fraction", float, "share of samples, drawn each step, that run to "
                     "--max-len, 0-1"),
    "kv_block_tokens": ("kv_block_tokens", int, "KV block size of the engine's pool, in "
                        "tokens (0: a request reserves prompt + response at admission)"),
    "num_prompts": ("num_prompts", int, "prompts per training step"),
    "samples_per_prompt": ("samples_per_prompt", int, "responses sampled per prompt"),
    "epochs": ("epochs", int, "training steps simulated (step 1 has no length history)"),
    "max_len": ("max_len", int, "response cap, tokens"),
    "max_batch_size": ("max_batch_size", int, "requests decoded at once per rank"),
    "kv_budget_tokens": ("kv_budget_tokens", int, "KV cache per rank, in tokens (default: "
                         "from the accelerator's memory; unbounded under UnitCost)"),
    "min_active_ranks": ("min_active_ranks", int, "the floor: ranks a replica keeps, 1 to its "
                         "size (gpus / replicas)"),
    "migrate_max_requests": ("migrate_max_requests", int, "a rank with at most this many "
                             "requests left hands them over and leaves (0: off)"),
    "seed": ("seed", int, "workload seed"),
    "max_share": ("max_share", float, "FlexFloor placement: a rank takes at most this many "
                  "fair shares of the prompt groups"),
    "load_cap": ("load_cap", float, "FlexFloor placement: a rank's peak KV load at most this "
                 "times the baseline's fullest rank"),
    "pace_margin": ("pace_margin", float, "FlexFloor across replicas: a rank's predicted finish "
                    "at most this times static's predicted end"),
    "consolidate": ("consolidate", switch, "1: tail consolidation across replicas (elastic), "
                    "0: off"),
    "correct": ("correct", switch, "1: the online correction against the plan's end and the "
                "evacuation's hedges (docs/simulator.md), 0: off"),
    "taker_hedge": ("taker_hedge", float, "with the correction, a taker counts its running "
                    "requests at this times their estimate (at least 1; 1: off)"),
    "oracle": ("oracle", switch, "1: elastic told every length exactly (a ceiling, not the "
               "policy), 0: predicted"),
    "gather": ("gather", switch, "1: with no history, gather the requests their siblings say "
               "are long onto the replicas that end later, 0: off"),
    "dense_replicas": ("dense_replicas", int, "analysis placement (\"Two tiers\"): elastic's "
                       "requests on the first K replicas, the --lane-requests longest on the "
                       "others"),
    "lane_requests": ("lane_requests", int, "with --dense-replicas: the N longest requests "
                      "(by the estimates; exact with --oracle 1) go to the lanes"),
    "no_denser": ("no_denser", switch, "1: once the history proves wrong, a leaving replica "
                  "hands over only to ranks no denser than its fullest, 0: never"),
    "distrust": ("distrust", switch, "1: after a rollout that proved the history wrong, place "
                 "the next as static does, 0: pack by it anyway"),
    "shrink_pace": ("shrink_pace", switch, "1: a shrink inside a replica obeys the pace rule "
                    "(no later end for its replica), 0: every shrink the floor allows"),
}


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default where it has one; a flag left to the scenario says so itself."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=Help)
    p.add_argument("--list", action="store_true", help="name and describe the scenarios")
    p.add_argument("--scenario", help=f"one of {sorted(SCENARIOS)}")
    p.add_argument("--out", type=path_arg, help="JSON file the report goes to")
    p.add_argument("--plot", type=path_arg,
                   help="PNG of the last epoch's rank timeline (static and FlexFloor)")
    p.add_argument("--sweep", action="store_true",
                   help="add a sweep over GPU counts and tail heaviness (lognormal sigma)")
    p.add_argument("--sweep-gpus", default="16,32,64,128,256",
                   help="with --sweep: the GPU counts, comma-separated")
    p.add_argument("--sweep-sigmas", default="0.4,0.6,0.8",
                   help="with --sweep: the lognormal sigmas, comma-separated")
    o = p.add_argument_group("scenario overrides")
    for flag, (_, typ, text) in OVERRIDES.items():
        o.add_argument("--" + flag.replace("_", "-"), type=typ, default=None,
                       help=text if "default:" in text else f"{text} ({SCENARIO})",
                       **({"metavar": "{0,1}"} if typ is switch else {}))
    o.add_argument("--length-file", type=path_arg,
                   help="replay these lengths (workload file format)")
    o.add_argument("--length-median", type=float,
                   help=f"lognormal median response length, tokens ({SCENARIO})")
    o.add_argument("--length-sigma", type=float,
                   help=f"lognormal sigma: the tail's heaviness, 0 or more ({SCENARIO})")
    c = p.add_argument_group("cost model (CostParams)")
    c.add_argument("--group-source", choices=[g.value for g in GroupSource], default=None,
                   help="survivors' group at a shrink: new (NCCL init, group_create_s), "
                        "prebuilt (every set ready, a switch) or planned (the sets of the "
                        "plan's finish order are ready, any other is created, as the engine does)")
    c.add_argument("--group-create-s", type=float, default=None,
                   help="seconds to create a process group (NCCL init) at a shrink with "
                        "--group-source new or planned (default: CostParams')")
    c.add_argument("--host-overhead-s", type=float, default=None, help="engine time per step, seconds (default: CostParams')")
    c.add_argument("--zipf-s", type=float, default=None, help="expert popularity exponent (default: CostParams')")
    args = p.parse_args(argv)
    if not args.list and not (args.scenario and args.out):
        p.error("--scenario NAME and --out FILE are required (or --list)")
    if args.scenario and args.scenario not in SCENARIOS:
        p.error(f"--scenario {args.scenario!r} unknown; choose one of {sorted(SCENARIOS)}")
    args.sweep_gpus = _numbers(p, "--sweep-gpus", args.sweep_gpus, int)
    args.sweep_sigmas = _numbers(p, "--sweep-sigmas", args.sweep_sigmas, float)
    return args


def _numbers(p, flag: str, text: str, kind) -> list:
    """A comma-separated list of positive numbers of `kind`, or the parser's error naming
    `flag`."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        p.error(f"{flag} {text!r}: write positive {kind.__name__}s separated by commas, e.g. "
                f"{'16,64' if kind is int else '0.4,0.8'}")
    return values


def scenario_of(args):
    sc = SCENARIOS[args.scenario]
    kw = {field: getattr(args, flag) for flag, (field, _, _) in OVERRIDES.items()
          if getattr(args, flag) is not None}
    if args.length_file:
        if args.length_median is not None or args.length_sigma is not None:
            raise ValueError("--length-median/--length-sigma with --length-file: the file gives "
                             "the lengths; drop one or the other")
        kw.update(length_dist="file", length_params={"path": args.length_file})
    elif args.length_median is not None or args.length_sigma is not None:
        params = dict(sc.length_params)
        median, sigma = args.length_median, args.length_sigma
        for flag, value in (("--length-median", median), ("--length-sigma", sigma)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} {value}: must be a finite number above 0")
        if args.length_median is not None:
            params["median"] = args.length_median
        if args.length_sigma is not None:
            params["sigma"] = args.length_sigma
        kw["length_params"] = params
    if kw.get("kv_block_tokens") == 0:
        kw["kv_block_tokens"] = None  # 0: reserve prompt + response at admission
    return sc.with_overrides(**kw)


def flag_named(message: str, args) -> str:
    """`message` of a Scenario field given by a flag ("max_batch_size=-5: ..."), told with the
    flag instead ("--max-batch-size -5: ..."); any other message as it is."""
    name, sep, rest = message.partition("=")
    for flag, (field_name, _, _) in OVERRIDES.items():
        if sep and field_name == name and getattr(args, flag) is not None:
            return f"--{flag.replace('_', '-')} {rest}"
    return message


def params_of(args) -> CostParams:
    kw = {k: getattr(args, k) for k in ("group_create_s", "host_overhead_s", "zipf_s")
          if getattr(args, k) is not None}
    for k, value in kw.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{k.replace('_', '-')} {value}: must be a number at least 0")
    if args.group_source:
        kw["group_source"] = GroupSource(args.group_source)
    return CostParams(**kw)


def format_report(rep: dict) -> str:
    unit = rep["unit"]
    rows = [("total_response_tokens", "{:,.0f}"), ("occupied_worker_seconds", "{:,.1f}"),
            ("occupied_worker_steps", "{:,.0f}"), ("tail_fraction", "{:.3f}"),
            ("rollout_wall_seconds", "{:,.1f}"), ("tokens_per_occupied_worker_second", "{:,.1f}"),
            ("groups_created_during_rollout", "{:,.0f}")]
    lines = [f"{'':34s}" + "".join(f"{m:>16s}" for m in MODES)]
    for key, fmt in rows:
        lines.append(f"{key:34s}" + "".join(f"{fmt.format(rep[m][key]):>16s}" for m in MODES))
    for key in ("tokens_per_occupied_worker_second", "rollout_wall_seconds"):
        lines.append(f"{key + ' / static':34s}" + "".join(
            f"{rep['vs_static'][m][key]:16.3f}" for m in MODES))
    r = rep["ratios"]
    lines.append(f"ideal (no idle-but-occupied time): {rep['ideal']['tokens_per_occupied_worker_second']:,.1f} "
                 f"tokens per occupied worker-{'second' if unit == 's' else 'step'}; FlexFloor reaches "
                 f"{r['elastic_over_ideal']:.3f} of it, static {r['static_over_ideal']:.3f}")
    if unit != "s":
        lines.append("(UnitCost: every step costs 1, so 'seconds' are engine steps)")
    for e in rep.get("per_epoch", []):
        acc = e.get("prediction_accuracy")
        if acc:
            lines.append(f"step {e['epoch']} prediction: " + ", ".join(
                f"{k} spearman {_figure(v['spearman'], '.3f')} mae {_figure(v['mae'], ',.0f')} "
                f"(n {v['n']})" for k, v in acc.items()))
    for name, t in rep.get("targets", {}).items():
        lines.append(f"target {name} {t['target']}: {t['value']:.3f} "
                     f"{'met' if t['met'] else 'NOT MET'}")
    return "\n".join(lines)


def _figure(x, spec: str) -> str:
    """`x` formatted, or "-" where there is none (no prompt with history: None, or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_sweep(rows: list[dict], unit: str = "s") -> str:
    """The sweep's table; `unit`: the report's ("steps" under UnitCost)."""
    lines = [f"{'gpus':>5s} {'sigma':>6s} {'p99/p50':>8s} {'static tail':>12s} "
             f"{'tok/occ-s x' if unit == 's' else 'tok/occ-step x':>14s} {'wall x':>8s} "
             f"{'vs ideal':>9s}"]
    for r in rows:
        lines.append(f"{r['gpus']:5d} {r['sigma']:6.2f} {r['p99_over_p50']:8.1f} "
                     f"{r['static_tail_fraction']:12.3f} {r['tokens_per_occupied_worker_second']:14.3f} "
                     f"{r['rollout_wall_seconds']:8.3f} {r['elastic_over_ideal']:9.3f}")
    return "\n".join(lines)


def step_line(entry: dict, sc, seconds: float) -> str:
    """One simulated step's progress line: FlexFloor against static, as the summary reads."""
    r = entry["ratios"]
    per = "GPU-s" if sc.accelerator else "worker-step (UnitCost)"
    scored = ("" if entry["epoch"] > 1 or sc.epochs == 1 else
              "; not in the summary (no length history yet)")
    return (f"step {entry['epoch']}/{sc.epochs} done ({seconds:.0f} s): elastic "
            f"x{r['tokens_per_occupied_worker_second']:.3f} tokens per occupied {per}, makespan "
            f"x{r['rollout_wall_seconds']:.3f}, against static{scored}")


def main(argv=None) -> int:
    written = []  # what a Ctrl-C leaves written
    try:
        return simulate(parse_args(argv), written)
    except KeyboardInterrupt:
        print(stopped_line("simulate", written), file=sys.stderr)
        return 130


def simulate(args, written: list) -> int:
    """The command, from its parsed flags; each file it writes goes into `written`."""
    if args.list:
        for name, sc in SCENARIOS.items():
            where = f"{sc.gpus} x {sc.accelerator}" if sc.accelerator else f"{sc.gpus} ranks, UnitCost"
            print(f"{name:18s} {sc.model} on {where}: {sc.description}")
        return 0
    try:  # before the work and before any line: a bad input is its error line alone
        out = writable(args.out, "--out")
        if args.plot:
            args.plot = writable_image(args.plot, "--plot")
        distinct(length_file=args.length_file, out=out, plot=args.plot)
        sc = scenario_of(args)
        params = params_of(args)
        try:
            # check_scenario's, the model, the accelerator, the lengths (a file's read), the KV
            prepared = prepare(sc, params=params)
        except ValueError as e:
            raise ValueError(flag_named(str(e), args)) from None
        size = sc.gpus // sc.replicas
        if args.min_active_ranks is not None and args.min_active_ranks > size:
            # a scenario's own floor is capped at its replicas' size; a floor given is meant
            raise ValueError(f"--min-active-ranks {args.min_active_ranks}: must be 1 to {size} "
                             f"(a replica's ranks: {sc.gpus} GPUs / {sc.replicas} "
                             f"replica{'' if sc.replicas == 1 else 's'})")
        ignored = [sc.gpus] if pace_rule_ignored(sc) else []
        if args.sweep and sc.dense_replicas is not None:
            raise ValueError("--sweep with --dense-replicas: the sweep scales the prompts with "
                             "the GPU count, not the replicas' tiers; run each cluster size with "
                             "its own --gpus instead")
        if args.sweep and args.length_file:
            raise ValueError("--sweep with --length-file: the sweep draws lognormal lengths of "
                             "each --sweep-sigmas, not the file's; run each cluster size with its "
                             "own --gpus instead")
        if args.sweep:
            for s in sweep_scenarios(sc, args.sweep_gpus, args.sweep_sigmas):
                try:  # every size's inputs (a second for the default sweep), not after the run
                    prepare(s, params=params)
                except ValueError as e:
                    raise ValueError(f"--sweep-gpus {s.gpus}: {e}") from None
                if pace_rule_ignored(s) and s.gpus not in ignored:
                    ignored.append(s.gpus)
        t0 = time.perf_counter()
        print(f"simulate: {sc.name}: {sc.model} on {sc.gpus} "
              f"{sc.accelerator or 'ranks (UnitCost)'}, {sc.num_prompts} prompts x "
              f"{sc.samples_per_prompt} samples, {sc.epochs} epochs", flush=True)
        if ignored:
            at = "" if ignored == [sc.gpus] else f" at {', '.join(map(str, ignored))} GPUs"
            print(f"note: the pace rule (--shrink-pace, on by default) does not act here{at}: "
                  "it needs the replicas simulated together (--replicas > 1 with "
                  "--consolidate 1); every shrink the floor (--min-active-ranks) allows is made",
                  flush=True)
        if sc.dense_replicas is not None:
            k, lanes = sc.dense_replicas, sc.replicas - sc.dense_replicas
            first = "the first replica" if k == 1 else f"the first {k} replicas"
            where = (f"the {sc.lane_requests} longest requests (by "
                     f"{'their exact lengths' if sc.oracle else 'the estimates'}) on the last "
                     f"{lanes} replica{'' if lanes == 1 else 's'}, the rest on {first}"
                     if sc.lane_requests else f"every request on {first}"
                     + (", the others released at once" if lanes else ""))
            print(f"note: elastic is the two-tier analysis placement, not FlexFloor's: {where} "
                  "(docs/simulator.md, \"Two tiers\")", flush=True)
        if pace_rule_moot(sc):
            print("note: the pace rule (--shrink-pace) never refuses a shrink here: under UnitCost "
                  "(no accelerator) every step costs 1 whatever a rank hosts, so no shrink slows "
                  "a replica", flush=True)
        rep = run(sc, params=params, prepared=prepared, progress=lambda e: print(
            step_line(e, sc, time.perf_counter() - t0), flush=True))
        if args.sweep:
            print(f"sweep: {len(args.sweep_gpus)} GPU counts x {len(args.sweep_sigmas)} tails",
                  flush=True)
            rep["sweep"] = sweep(sc, args.sweep_gpus, args.sweep_sigmas, params=params)
    except (ValueError, OSError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    rep["seconds"] = time.perf_counter() - t0
    write_json(out, rep)
    written.append(out)
    print(format_report(rep))
    if "sweep" in rep:
        print(format_sweep(rep["sweep"], rep["unit"]))
    print(f"took {rep['seconds']:.0f} s; results in {out}")
    if args.plot:
        from tools.plot_timeline import plot_report

        print(f"timeline plot in {plot_report(rep, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
