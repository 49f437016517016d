"""The run log (rank 0): metrics.jsonl, TensorBoard, a line per step, the release timeline plot
and the end-of-run summary.

metrics.jsonl is strict JSON, one object per step: a NaN or infinite value is written as null and
its field is named under "non_finite" (a list of field names, present only on such lines). A
resumed run keeps the lines of the steps its checkpoint holds, so the file, and the summary read
from it, cover the whole run across restarts. Lines it drops (a crashed attempt's steps that no
checkpoint holds, or an earlier run's in the same folder) are not lost: the old metrics.jsonl and
config.json are copied to `superseded/N/` in the run folder first.
"""

from __future__ import annotations

import json
import math
import os
import shutil

from flexfloor.config import Config, config_to_dict


def finite_json(metrics: dict) -> tuple[dict, list[str]]:
    """`metrics` with every NaN/inf (also inside lists) replaced by None, and the names of the
    fields that held one, in field order."""
    bad: list[str] = []

    def clean(name, v):
        if isinstance(v, float) and not math.isfinite(v):
            if name not in bad:
                bad.append(name)
            return None
        if isinstance(v, (list, tuple)):
            return [clean(name, x) for x in v]
        return v

    return {k: clean(k, v) for k, v in metrics.items()}, bad


def read_metrics(path: str) -> list[dict]:
    """The step lines of a metrics.jsonl, in file order; torn or blank lines are skipped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                m = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash (or blank)
            if isinstance(m, dict) and isinstance(m.get("step"), int):
                out.append(m)
    return out


class RunLog:
    """metrics.jsonl, TensorBoard, a per-step line and the release timeline plot (rank 0)."""

    def __init__(self, cfg: Config, rank: int, resumed_step: int = 0):
        self.rank = rank
        self.run_dir = cfg.logging.run_dir
        self.cfg = cfg
        self.history: list[dict] = []
        # rank 0: the lines of metrics.jsonl this run starts with (the steps it resumes past)
        self.kept: list[dict] = []
        self.timelines: list[list[dict]] = []
        self.writer = None
        if rank != 0:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self._keep_steps_up_to(resumed_step)
        with open(os.path.join(self.run_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(cfg), f, indent=1)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # events an earlier run or a crashed attempt wrote for later steps than this run
            # starts from are purged from TensorBoard's view, as their lines from metrics.jsonl
            self.writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"),
                                        purge_step=resumed_step + 1)

    def _keep_steps_up_to(self, step: int) -> None:
        """metrics.jsonl describes this run: lines of steps after the one it starts from (a
        crashed attempt's steps that no checkpoint holds, an earlier run's) are dropped, after
        the old file and config.json are copied to `superseded/N/`, and so are torn lines (the
        resumed run must not die on them)."""
        if not os.path.exists(self.metrics_path):
            return
        lines = read_metrics(self.metrics_path)
        keep = [m for m in lines if m["step"] <= step]
        if len(keep) < len(lines):
            kept_in = self._set_aside()
            self.say(f"{self.metrics_path} held {len(lines) - len(keep)} steps after step {step} "
                     f"(an earlier run's or a crashed attempt's): the old file and its "
                     f"config.json are kept in {kept_in}")
        tmp = self.metrics_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(m, allow_nan=False) + "\n" for m in keep)
        os.replace(tmp, self.metrics_path)
        self.kept = keep

    def _set_aside(self) -> str:
        """Copy metrics.jsonl and config.json to the first free `superseded/N/`; its path."""
        n = 1
        while os.path.exists(os.path.join(self.run_dir, "superseded", str(n))):
            n += 1
        folder = os.path.join(self.run_dir, "superseded", str(n))
        os.makedirs(folder)
        for name in ("metrics.jsonl", "config.json"):
            path = os.path.join(self.run_dir, name)
            if os.path.exists(path):
                shutil.copy2(path, folder)
        return folder

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[flexfloor] {text}", flush=True)

    def write(self, metrics: dict, records: list[dict]) -> None:
        if self.rank != 0:
            return
        self.history.append(metrics)
        self.timelines.append(records)
        line, non_finite = finite_json(metrics)
        if non_finite:
            line["non_finite"] = non_finite
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line, allow_nan=False) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.writer.add_scalar(k, v, metrics["step"])
        release = " ".join(f"r{i}:{t:.2f}s" for i, t in enumerate(metrics["rollout/release_s"]))
        print(
            f"step {metrics['step']:>4} | reward {metrics['reward/mean']:.3f} "
            f"(solved {metrics['reward/solved']:.2f}) | len mean {metrics['response_length/mean']:.1f} "
            f"max {metrics['response_length/max']} | tok/occ-worker-s "
            f"{metrics['rollout/tokens_per_occupied_worker_second']:.0f} | tail "
            f"{metrics['rollout/tail_fraction']:.2f} | released {metrics['rollout/released_ranks']} "
            f"| release {release} | {metrics['timing/step_s']:.1f}s"
            + (f" | val reward {metrics['val/reward/mean']:.3f} "
               f"(solved {metrics['val/solved']:.2f})" if "val/reward/mean" in metrics else ""),
            flush=True,
        )

    def close(self) -> None:
        if self.rank != 0:
            return
        if self.writer is not None:
            self.writer.close()
        if self.cfg.logging.timeline_plot and self.timelines:
            from flexfloor.rollout.timeline import plot_rank_timeline

            path = os.path.join(self.run_dir, "timeline.png")
            plot_rank_timeline({"last step": self.timelines[-1]}, path,
                               title=f"release timeline, step {self.history[-1]['step']}")
        run = read_metrics(self.metrics_path)  # the whole run, also across restarts
        if run:
            first, last = run[0], run[-1]
            self.say(f"reward {_fmt(first['reward/mean'])} (step {first['step']}) -> "
                     f"{_fmt(last['reward/mean'])} (step {last['step']})")
            val = [m for m in run if m.get("val/reward/mean") is not None]
            if val:
                self.say("val reward " + " -> ".join(
                    f"{m['val/reward/mean']:.3f} (step {m['step']})" for m in val))
        held = [name for name in ("metrics.jsonl", "tensorboard/", "timeline.png")
                if os.path.exists(os.path.join(self.run_dir, name.rstrip("/")))]
        self.say(f"run folder: {os.path.abspath(self.run_dir)}"
                 + (f" ({', '.join(held)})" if held else " (no step logged yet)"))


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
