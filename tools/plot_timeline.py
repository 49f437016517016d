"""Draw the rank timeline (busy / done but occupied / released) of a simulated or a real run.

    python tools/plot_timeline.py REPORT.json --out timeline.png [--epoch N]

REPORT is what `tools/simulate.py` or `tools/bench_rollout.py` wrote: one panel for the static
baseline and one for FlexFloor, one row per rank, from the chosen epoch (default: the last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from flexfloor.outputs import path_arg, writable_image  # noqa: E402
from flexfloor.rollout.timeline import plot_rank_timeline  # noqa: E402


def plot_report(report: dict, path: str, epoch: int | None = None) -> str:
    epochs = report.get("per_epoch") if isinstance(report, dict) else None
    if not (isinstance(epochs, list) and epochs and all(isinstance(e, dict) for e in epochs)):
        raise ValueError("no list of per_epoch entries: not a simulate.py or bench_rollout.py "
                         "report")
    entry = epochs[-1] if epoch is None else next(
        (e for e in epochs if e["epoch"] == epoch), None)
    if entry is None:
        raise ValueError(f"no epoch {epoch} in the report; it has {[e['epoch'] for e in epochs]}")
    modes = {m: entry[m]["per_rank"] for m in ("static", "elastic")
             if isinstance(entry.get(m), dict) and isinstance(entry[m].get("per_rank"), list)}
    if not modes:
        raise ValueError(f"epoch {entry.get('epoch')} has no static or elastic per_rank "
                         "timeline: not a simulate.py or bench_rollout.py report")
    names = {"static": "static EP (baseline)", "elastic": "FlexFloor (elastic EP)"}
    for m in modes:
        s = entry[m]
        names[m] += (f": {s['occupied_worker_seconds']:,.0f} occupied worker-"
                     f"{'s' if report.get('unit', 's') == 's' else 'steps'}, "
                     f"tail {s['tail_fraction']:.2f}")
    sc = report.get("scenario") or {}
    workers = sc.get("gpus") or (report.get("setup") or {}).get("nproc") or len(
        next(iter(modes.values())))
    where = ", ".join(x for x in (sc.get("model"), f"{workers} workers") if x)
    title = f"{sc.get('name', 'rollout benchmark')} ({where}), epoch {entry['epoch']}"
    unit = "steps" if report.get("unit") == "steps" else "s"
    return plot_rank_timeline(modes, path, title=title, panel_titles=names, unit=unit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="JSON from tools/simulate.py or tools/bench_rollout.py")
    p.add_argument("--out", required=True, type=path_arg, help="PNG to write")
    p.add_argument("--epoch", type=int, default=None, help="which epoch (default: the last)")
    args = p.parse_args(argv)
    try:
        args.out = writable_image(args.out, "--out")
    except ValueError as e:
        print(f"plot_timeline: {e}", file=sys.stderr)
        return 2
    try:
        with open(args.report) as f:
            report = json.load(f)
        print(plot_report(report, args.out, args.epoch))
    except KeyError as e:
        print(f"plot_timeline: {args.report}: no field {e}: not a simulate.py or "
              "bench_rollout.py report", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError) as e:  # TypeError: a field of another kind
        print(f"plot_timeline: {args.report}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
