"""Held-out workloads: FlexFloor's elastic mode against `static` on workloads fixed before any
result was looked at (the rule: no rollout longer than static's on workloads not shown).

    python tools/heldout.py [--out heldout.json] [--only corr0.8,corr0.5] [--seeds 10]
                            [--no-denser 0]   # without ConsolidationRules.no_denser
                            [--distrust 0]    # pack by a history the last rollout proved wrong
                            [--min-active-ranks 1 --group-source planned]  # shrink inside

Each workload is `paper-like`'s GPU policy on a small cluster (16 H800 as 4 replicas x EP4, 16
prompts x 8 samples, lognormal median 400, cap 2,048, 4 steps: steps 2-4 are the rollouts
scored, as tools/simulate.py scores steps 2..E), run through flexfloor.sim (the entry
tools/simulate.py uses), seeds 0-9. Printed per workload: makespan / static (max and median
over the rollouts), late (rollouts with makespan > static's, of all), and tokens per occupied
GPU-s / static's (median and min over seeds). The set is fixed here; do not tune against it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flexfloor.outputs import path_arg, stopped_line, writable, write_json  # noqa: E402
from flexfloor.sim.cost import CostParams, GroupSource  # noqa: E402
from flexfloor.sim.scenarios import SCENARIOS, run  # noqa: E402

SMALL = dict(gpus=16, replicas=4, num_prompts=16, max_len=2048, epochs=4)
MEDIAN = {"median": 400.0, "sigma": 0.6}

# name -> scenario overrides of paper-like (fixed before looking at any result)
WORKLOADS = {
    "corr0.8": dict(SMALL, length_params=MEDIAN, history_correlation=0.8),
    "corr0.5": dict(SMALL, length_params=MEDIAN, history_correlation=0.5),
    "small": dict(SMALL, length_params=MEDIAN),
    "drift0.3": dict(SMALL, length_params={**MEDIAN, "drift_sigma": 0.3}),
    "cap0.05": dict(SMALL, length_params=MEDIAN, cap_fraction=0.05),
}


def one(name: str, seed: int, no_denser: bool = True, distrust: bool = True,
        min_active_ranks: int | None = None, params: CostParams = CostParams()) -> dict:
    floor = {} if min_active_ranks is None else {"min_active_ranks": min_active_ranks}
    sc = SCENARIOS["paper-like"].with_overrides(seed=seed, no_denser=no_denser,
                                                 distrust=distrust, **WORKLOADS[name], **floor)
    rep = run(sc, params=params)
    spans = [e["elastic"]["rollout_wall_seconds"] / e["static"]["rollout_wall_seconds"]
             for e in rep["per_epoch"][1:]]
    return {"seed": seed, "makespan": spans,
            "distrusted": [e["plan"]["distrusted"] for e in rep["per_epoch"][1:]],
            "tokens_per_occupied_gpu_s": rep["ratios"]["tokens_per_occupied_worker_second"]}


def summary(rows: list[dict]) -> dict:
    spans = [s for r in rows for s in r["makespan"]]
    tok = [r["tokens_per_occupied_gpu_s"] for r in rows]
    return {"makespan_max": max(spans), "makespan_median": statistics.median(spans),
            "late": sum(s > 1.0 for s in spans), "rollouts": len(spans),
            "tokens_median": statistics.median(tok), "tokens_min": min(tok)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=path_arg,
                   help="JSON file for every rollout's figures and the summaries")
    p.add_argument("--only", help="comma-separated workload names (default: all)")
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    p.add_argument("--no-denser", type=int, choices=(0, 1), default=1,
                   help="ConsolidationRules.no_denser once history proves wrong (paper-like's "
                        "default, 1) or never (0)")
    p.add_argument("--distrust", type=int, choices=(0, 1), default=1,
                   help="after a rollout that proved the length history wrong, place the next as "
                        "static does (the default, 1) or pack by it anyway (0)")
    p.add_argument("--min-active-ranks", type=int, default=None,
                   help="the floor per replica (paper-like's: the replica's size, no shrink "
                        "inside a replica); below it a replica shrinks under the pace rule")
    p.add_argument("--group-source", choices=[g.value for g in GroupSource], default=None,
                   help="survivors' groups at a shrink (tools/simulate.py --group-source)")
    args = p.parse_args(argv)
    if args.min_active_ranks is not None and not 1 <= args.min_active_ranks <= 4:
        p.error(f"--min-active-ranks {args.min_active_ranks}: must be 1 to 4 (the workloads' "
                "replicas have 4 ranks)")
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: must be at least 1 (seeds 0..N-1)")
    names = list(WORKLOADS) if args.only is None else args.only.split(",")
    if not all(names):
        p.error(f"--only {args.only!r}: an empty workload name; give comma-separated names from "
                f"{list(WORKLOADS)}, or leave --only out for all")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"--only: unknown workload {unknown}; choose from {list(WORKLOADS)}")
    if args.out:
        try:  # before the work: a bad path costs a second
            writable(args.out, "--out")
        except ValueError as e:
            p.error(str(e))
    params = (CostParams() if args.group_source is None
              else CostParams(group_source=GroupSource(args.group_source)))
    t0 = time.process_time()
    out = {}
    print(f"{'workload':<10} {'makespan max':>12} {'median':>7} {'late':>7} "
          f"{'tok/GPU-s med':>13} {'min':>6}")
    try:
        for name in names:
            rows = [one(name, s, bool(args.no_denser), bool(args.distrust),
                        args.min_active_ranks, params) for s in range(args.seeds)]
            s = summary(rows)
            out[name] = {"overrides": WORKLOADS[name], "min_active_ranks": args.min_active_ranks,
                         "group_source": params.group_source.value, "summary": s,
                         "rollouts": rows}
            print(f"{name:<10} {s['makespan_max']:>12.3f} {s['makespan_median']:>7.3f} "
                  f"{s['late']:>3}/{s['rollouts']:<3} {s['tokens_median']:>13.3f} "
                  f"{s['tokens_min']:>6.3f}", flush=True)
    except KeyboardInterrupt:  # the workloads done are kept: --out holds those, named
        written = []
        if args.out and out:
            write_json(args.out, out)
            written.append(f"{args.out} (workloads {', '.join(out)} of {len(names)})")
        print(stopped_line("heldout", written), file=sys.stderr)
        return 130
    print(f"({time.process_time() - t0:.0f} s of CPU)")
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
