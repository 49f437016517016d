"""The checkpoint manager: what is saved, when, and where a run starts from.

Where the weights come from, first match wins: a resume (`checkpoint.dir/latest` with
checkpoint.resume=auto, or `checkpoint.load`: weights, optimizer, step, run state, companions),
then `checkpoint.init_from` (weights only, e.g. a converted HF checkpoint: fresh optimizer and
schedule, step 0), then the random init of `model.seed`.

A checkpoint is the policy's (weights, optimizer, and the run state in `extra`: step, data
cursor, scheduler, LR schedule, config) plus its companions, one sub-folder each beside it: the
critic (PPO) and the frozen reference (trainer.kl_coef > 0). The companions are written first:
the policy's checkpoint, written last, is the one whose presence marks the step complete.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Sequence

from flexfloor.checkpoint import (CheckpointError, iter_name, load_checkpoint, read_meta,
                                  resolve_checkpoint, rng_state, save_checkpoint, set_rng_state)
from flexfloor.config import CheckpointConfig, ModelConfig

# (sub-folder, model, optimizer or None) saved beside the policy
Companion = tuple[str, object, object]


class Start(enum.Enum):
    FRESH = "fresh"  # the random init
    RESUME = "resume"  # a training checkpoint: everything
    INIT_FROM = "init_from"  # weights only


@dataclass(frozen=True)
class StartPoint:
    kind: Start
    path: str | None = None


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, model_cfg: ModelConfig, *, total_steps: int):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.total_steps = total_steps

    def start_point(self) -> StartPoint:
        """checkpoint.resume=auto: the newest complete checkpoint of checkpoint.dir (a restarted
        job continues); else checkpoint.load; else checkpoint.init_from; else fresh."""
        c = self.cfg
        if c.resumes_from_dir():
            return StartPoint(Start.RESUME, c.dir)
        if c.load:
            return StartPoint(Start.RESUME, c.load)
        if c.init_from:
            return StartPoint(Start.INIT_FROM, c.init_from)
        return StartPoint(Start.FRESH)

    def should_save(self, step: int) -> bool:
        """After step `step`: every checkpoint.save_interval steps and after the last one."""
        c = self.cfg
        if not c.dir:
            return False
        return step == self.total_steps or (c.save_interval > 0 and step % c.save_interval == 0)

    def save(self, step: int, *, model, optimizer, extra: dict,
             companions: Sequence[Companion]) -> str:
        root, keep = self.cfg.dir, self.cfg.keep_last
        for name, companion, companion_optimizer in companions:
            save_checkpoint(os.path.join(root, name), step, model=companion,
                            model_cfg=self.model_cfg, optimizer=companion_optimizer,
                            keep_last=keep)
        return save_checkpoint(root, step, model=model, model_cfg=self.model_cfg,
                               optimizer=optimizer, extra_state=extra, keep_last=keep)

    def resume(self, path: str, *, model, optimizer,
               companions: Sequence[Companion]) -> tuple[int, dict]:
        """Loads a training checkpoint into the model, optimizer and companions; returns (step,
        the run state saved with it)."""
        try:
            if not read_meta(path)["has_optimizer"]:
                raise CheckpointError(
                    f"{resolve_checkpoint(path)} holds weights only (no optimizer state, e.g. a "
                    "converted HF checkpoint): there is no training run to resume; to start one "
                    f"from these weights, set checkpoint.init_from={path} and checkpoint.load=null")
            step, extra = load_checkpoint(path, model=model, model_cfg=self.model_cfg,
                                          optimizer=optimizer)
        except CheckpointError as e:
            if path != self.cfg.load:  # found by checkpoint.resume=auto
                raise CheckpointError(
                    f"{e} (found in checkpoint.dir={path} by checkpoint.resume=auto; to start "
                    "afresh, use another checkpoint.dir or set checkpoint.resume=off)") from e
            raise
        root = os.path.dirname(os.path.abspath(resolve_checkpoint(path)))
        for name, companion, companion_optimizer in companions:
            load_checkpoint(os.path.join(root, name, iter_name(step)), model=companion,
                            model_cfg=self.model_cfg, optimizer=companion_optimizer)
        return step, extra

    def init_from(self, path: str, *, model, optimizer) -> None:
        """checkpoint.init_from: the model's weights only. The optimizer, the LR schedule, the
        data cursor and this rank's RNG stay as a new run sets them up; the critic stays fresh;
        the KL reference is frozen from these weights at the first step (after a warm start)."""
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint.init_from={path} does not exist; give a checkpoint "
                                  "root (e.g. the --out of tools/convert_checkpoint.py) or an iter_N")
        rng = rng_state()  # load_checkpoint restores the saving job's RNG: not ours to take
        try:
            load_checkpoint(path, model=model, model_cfg=self.model_cfg)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (checkpoint.init_from={path})") from e
        set_rng_state(rng)
        optimizer.reload_model_params()  # fp32 main params of a bf16 model
