"""The rank timeline of a rollout: busy, idle-but-occupied and released spans per rank."""

from __future__ import annotations

from typing import Mapping, Sequence

COLOURS = {"busy": "#2b7bba", "idle but occupied": "#e8743b", "released": "#cfd8dc"}
LABELS = {
    "busy": "decoding its own responses",
    "idle but occupied": "done, still occupied (serving its experts)",
    "released": "released",
}


# the clocks a record is read in: "s", seconds (measured, or the simulator's modelled ones);
# "steps", engine steps, the machine-independent clock (a rank with no request of its own has
# no local_finish_step: its whole stay is idle)
AXIS = {"s": "seconds", "modelled s": "modelled seconds", "steps": "engine steps"}


def clock(record: dict, unit: str = "s") -> tuple[float, float, float]:
    """(start, local finish, release) of one rank's record in `unit` (a key of AXIS), from the
    rollout start."""
    if unit == "steps":
        return 0, record.get("local_finish_step", 0), record["release_step"]
    return record.get("start_s", 0.0), record["local_finish_s"], record["release_s"]


def rank_spans(record: dict, end: float, unit: str = "s") -> list[tuple[str, float, float]]:
    """(kind, start, end) spans of one rank's record, in `unit` from the rollout start."""
    start, finish, release = clock(record, unit)
    spans = [("busy", start, max(start, finish)), ("idle but occupied", finish, release)]
    if release < end:
        spans.append(("released", release, end))
    return [(k, a, b) for k, a, b in spans if b > a]


def tail_fraction(records: Sequence[dict], unit: str = "s") -> float:
    """The share of the ranks' occupied time spent done but occupied, in `unit`."""
    spans = [clock(r, unit) for r in records]
    occupied = sum(release - start for start, _, release in spans)
    return sum(max(0, release - finish) for _, finish, release in spans) / occupied if (
        occupied > 0) else 0.0


def plot_rank_timeline(modes: Mapping[str, Sequence[dict]], path: str, *, title: str = "",
                       panel_titles: Mapping[str, str] | None = None, unit: str = "s") -> str:
    """One panel per mode (e.g. static, elastic), one row per rank, on the clock `unit` (a key
    of AXIS; the x axis names it). `modes` maps a name to the per-rank records
    (`RankRecord.as_dict()`, the benchmark's `per_rank` rows or the simulator's equivalent:
    rank, local_finish_s, release_s; in steps local_finish_step, release_step). Writes an
    image (its extension's format)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(modes)
    end = max(max(clock(r, unit)[2] for r in recs) for recs in modes.values())
    rows = max(len(v) for v in modes.values())
    row_h = 0.45 if rows <= 16 else max(0.06, 7.0 / rows)  # cluster-sized runs stay on a page
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.2 + row_h * rows * len(names)),
                             squeeze=False, sharex=True)
    for ax, name in zip(axes[:, 0], names):
        records = sorted(modes[name], key=lambda r: r["rank"])
        mode_end = max(clock(r, unit)[2] for r in records)
        for row, rec in enumerate(records):
            for kind, a, b in rank_spans(rec, mode_end, unit):
                ax.barh(row, b - a, left=a, color=COLOURS[kind], edgecolor="white", height=0.8)
        step = max(1, len(records) // 16)
        ax.set_yticks(range(0, len(records), step))
        ax.set_yticklabels([f"rank {r['rank']}" for r in records][::step])
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02 if end > 0 else 1)
        ax.set_ylabel("worker")
        ax.set_title((panel_titles or {}).get(name, name), loc="left", fontsize=10)
    axes[-1, 0].set_xlabel(f"time from rollout start ({AXIS[unit]})")
    fig.legend(handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in COLOURS],
               loc="lower center", ncol=3, fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
