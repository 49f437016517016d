"""Rollout figures from per-rank records: the one place the headline metrics are computed.

Used by the benchmark, the trainer's per-step log and the simulator, so every tool reports the
same quantity under the same name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Iterable, Sequence

from flexfloor.rollout.timeline import tail_fraction


def responses_sha256(results: Iterable) -> str:
    """A digest of every response's token ids, keyed by request id, order-independent."""
    rows = sorted((r.request_id, list(r.token_ids)) for r in results)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def lengths_sha256(lengths: dict) -> str:
    """The simulator's `responses_sha256` (it has lengths, not tokens): a digest of each
    prompt's response lengths (prompt uid -> lengths), independent of which rank or replica
    ran which sample."""
    rows = sorted((int(uid), sorted(map(int, ls))) for uid, ls in lengths.items())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def chained_sha256(digests: Iterable[str]) -> str:
    """One digest of several rollouts' `responses_sha256`, in order (a summary over steps)."""
    return hashlib.sha256(",".join(digests).encode()).hexdigest()


# the modelled figures: a cost model's seconds of the real steps (flexfloor.sim.cost); the
# simulator's seconds are all modelled and carry the same names
MODELLED_FIGURES = ("modelled_occupied_gpu_seconds", "modelled_rollout_seconds",
                    "tokens_per_modelled_occupied_gpu_second")


def rollout_metrics(records: Sequence[dict], results: Sequence, cost=None) -> dict:
    """records: per-rank `RankRecord.as_dict()` (or `summed_records`); results: every `Result`
    of the rollout; cost: a cost model (`flexfloor.sim.cost.cost_model`) to price every traced
    step with, adding `MODELLED_FIGURES` (per rank: `modelled_occupied_s`)."""
    tokens = sum(len(r.token_ids) for r in results)
    m = metrics_from_counts(records, total_tokens=tokens, num_responses=len(results),
                            digest=responses_sha256(results))
    if cost is not None:
        occupied, wall = modelled_seconds(records, cost)
        m.update(modelled_figures(sum(occupied.values()), wall, tokens))
        for row in m["per_rank"]:
            row["modelled_occupied_s"] = occupied[row["rank"]]
    return m


def cpu_seconds_warning(workers: int) -> str | None:
    """Why CPU seconds do not measure occupied time when the workers outnumber the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if workers <= (cores or 1):
        return None
    return (f"{workers} workers share {cores} CPU cores: occupied_worker_seconds count time "
            "the workers waited for a core; the worker-steps and modelled seconds do not")


def modelled_figures(occupied_s: float, rollout_s: float, total_tokens: int) -> dict:
    """`MODELLED_FIGURES` from modelled occupied and rollout seconds."""
    return dict(zip(MODELLED_FIGURES, (
        occupied_s, rollout_s, total_tokens / occupied_s if occupied_s > 0 else 0.0)))


def modelled_seconds(records: Sequence[dict], cost) -> tuple[dict, float]:
    """(rank -> modelled occupied seconds, modelled rollout seconds) of the rollouts the
    records hold (summed records: each rollout priced on its own, then added up)."""
    from flexfloor.rollout.types import StepTrace
    from flexfloor.sim.cost import price_trace

    rollouts = [r.get("per_rollout", [r]) for r in records]
    occupied = {r["rank"]: 0.0 for r in records}
    wall = 0.0
    for i in range(max(map(len, rollouts), default=0)):
        recs = [rs[i] for rs in rollouts if i < len(rs)]
        missing = [r["rank"] for r in recs if "trace" not in r]
        if missing:
            raise ValueError(f"records of ranks {missing} have no step trace: modelled seconds "
                             "price the engine's traced steps (RankRecord.trace)")
        priced = price_trace({r["rank"]: StepTrace.from_dict(r["trace"]) for r in recs}, cost,
                             held_steps={r["rank"]: r["steps"] for r in recs})
        for rank, t in priced.occupied_s.items():
            occupied[rank] += t
        wall += priced.rollout_s
    return occupied, wall


def metrics_from_counts(records: Sequence[dict], *, total_tokens: int, num_responses: int,
                        digest: str | None = None) -> dict:
    """The same figures from counts (the simulator has lengths, not tokens)."""
    occupied = [r["release_s"] - r["start_s"] for r in records]
    tokens = total_tokens
    occ_s = sum(occupied)
    occ_steps = sum(r["steps"] for r in records)
    wall = max((r["release_s"] for r in records), default=0.0)
    return {
        "total_response_tokens": tokens,
        "num_responses": num_responses,
        "occupied_worker_seconds": occ_s,
        "occupied_worker_steps": occ_steps,
        "tail_fraction": tail_fraction(records),
        "rollout_wall_seconds": wall,
        # the steps of the rank that stayed longest: the wall's machine-independent twin
        "rollout_wall_steps": max((r["steps"] for r in records), default=0),
        "tokens_per_occupied_worker_second": tokens / occ_s if occ_s > 0 else 0.0,
        "tokens_per_occupied_worker_step": tokens / occ_steps if occ_steps else 0.0,
        "released_ranks": sum(1 for r in records if r["release_s"] < wall - 1e-9),
        "responses_sha256": digest,
        # every survivor group holds the last survivors, so the fullest count is the rollout's
        "groups_created_during_rollout": max(
            (r.get("groups_created_during_rollout", 0) for r in records), default=0),
        "per_rank": [
            {
                "rank": r["rank"],
                "local_finish_s": r["local_finish_s"],
                "release_s": r["release_s"],
                "steps": r["steps"],
                "busy_steps": r["busy_steps"],
                "tokens": r["tokens"],
                "requests": r["requests"],
                **{k: r[k] for k in ("release_step", "local_finish_step",
                                     "resident_bytes_before_release",
                                     "resident_bytes_after_release") if k in r},
                # the engine's per-step trace (one rollout; the simulator has none)
                **({"trace": r["trace"]} if r.get("trace", {}).get("groups") else {}),
            }
            for r in sorted(records, key=lambda r: r["rank"])
        ],
    }


def summed_records(epochs: list[list[dict]]) -> list[dict]:
    """Per rank, its records of several rollouts added up (times relative to each start; the
    resident bytes of the fullest rollout)."""
    summed = {}
    for records in epochs:
        for rec in records:
            s = summed.setdefault(rec["rank"], {"rank": rec["rank"], "start_s": 0.0,
                                                "local_finish_s": 0.0, "release_s": 0.0})
            for key in ("steps", "busy_steps", "tokens", "requests"):
                s[key] = s.get(key, 0) + rec[key]
            s["local_finish_s"] += rec["local_finish_s"] - rec["start_s"]
            s["release_s"] += rec["release_s"] - rec["start_s"]
            s["groups_created_during_rollout"] = (s.get("groups_created_during_rollout", 0)
                                                  + rec.get("groups_created_during_rollout", 0))
            for key in ("resident_bytes_before_release", "resident_bytes_after_release"):
                if key in rec:  # the fullest rollout's
                    s[key] = max(s.get(key, 0), rec[key])
            s.setdefault("per_rollout", []).append(rec)  # each priced on its own (modelled)
    return [summed[r] for r in sorted(summed)]


def ratios(elastic: dict, static: dict) -> dict:
    """FlexFloor / baseline for the figures the tools report (their `ratios`)."""

    def ratio(key):
        return elastic[key] / static[key] if static[key] else float("nan")

    # rollout_wall_steps: where a released rank's step costs the survivors nothing (one
    # accelerator per rank), the wall follows this ratio; on shared CPU cores the survivors'
    # steps get cheaper as ranks leave, and the seconds ratio flatters
    keys = ["tokens_per_occupied_worker_second", "tokens_per_occupied_worker_step",
            "rollout_wall_seconds", "rollout_wall_steps"]
    # the modelled figures where both sides have them (a cost model was given)
    keys += [k for k in MODELLED_FIGURES[1:] if elastic.get(k) is not None
             and static.get(k) is not None]
    return {key: ratio(key) for key in keys}


def json_safe(obj):
    """NaN/inf -> None, recursively, so the JSON a tool writes is strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
