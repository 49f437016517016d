"""Draw the rank timeline (busy / done but occupied / released) of a simulated or a real run.

    python tools/plot_timeline.py REPORT.json --out timeline.png [--epoch N]

REPORT is what `tools/simulate.py` or `tools/bench_rollout.py` wrote: one panel for the static
baseline and one for FlexFloor, one row per rank, from the chosen epoch (default: the last). A
simulator report is drawn in its modelled seconds (engine steps under UnitCost), a benchmark's in
engine steps: its seconds are CPU seconds, which flatter FlexFloor (a released worker frees a
core) and are no measure of occupied time.
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
from flexfloor.rollout.timeline import plot_rank_timeline, tail_fraction  # noqa: E402


def report_unit(report: dict) -> str:
    """The clock a report's timeline is drawn in (a key of `timeline.AXIS`): a simulator
    report's own (`unit`: modelled seconds, or engine steps under UnitCost); a benchmark's
    (no `unit`) in engine steps, as its occupied worker-steps are counted: its seconds are the
    CPU's, which flatter a mode that releases workers (a released process frees a core)."""
    if "unit" not in report:
        return "steps"
    return "steps" if report["unit"] == "steps" else "modelled s"


def timeline_panels(report: dict, epoch: int | None = None) -> tuple[dict, dict, str, str]:
    """(mode -> per-rank rows, mode -> panel title, title, unit) of the chosen epoch (default:
    the last) of a simulate.py or bench_rollout.py report; ValueError naming what is missing."""
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
    unit = report_unit(report)
    names = {"static": "static EP (baseline)", "elastic": "FlexFloor (elastic EP)"}
    for m in modes:
        s = entry[m]
        if unit == "steps":
            occupied = f"{s['occupied_worker_steps']:,.0f} occupied worker-steps"
            if s.get("modelled_occupied_gpu_seconds") is not None:  # the benchmark's
                occupied += f" ({s['modelled_occupied_gpu_seconds']:,.2f} modelled GPU-s)"
        else:
            occupied = f"{s['occupied_worker_seconds']:,.0f} occupied worker-s (modelled)"
        names[m] += f": {occupied}, tail {tail_fraction(modes[m], unit):.2f}"
    sc = report.get("scenario") or {}
    workers = sc.get("gpus") or (report.get("setup") or {}).get("nproc") or len(
        next(iter(modes.values())))
    where = ", ".join(x for x in (sc.get("model"), f"{workers} workers") if x)
    title = f"{sc.get('name', 'rollout benchmark')} ({where}), epoch {entry['epoch']}"
    return modes, names, title, unit


def plot_report(report: dict, path: str, epoch: int | None = None) -> str:
    modes, names, title, unit = timeline_panels(report, epoch)
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
            text = f.read()
        try:
            report = json.loads(text)
        except ValueError as e:
            what = "is empty" if not text.strip() else f"is not JSON ({e})"
            raise ValueError(f"{what}; give the JSON report tools/simulate.py or "
                             "tools/bench_rollout.py wrote") from None
        print(plot_report(report, args.out, args.epoch))
    except KeyError as e:
        print(f"plot_timeline: {args.report}: no field {e}: not a simulate.py or "
              "bench_rollout.py report", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"plot_timeline: {args.report}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:  # TypeError: a field of another kind
        print(f"plot_timeline: {args.report}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
