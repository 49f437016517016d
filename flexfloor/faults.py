"""Fault injection for the reliability tests (docs/reliability.md): the one place that reads
`FLEXFLOOR_FAULT`. Unset (every real run), `inject()` does nothing.

    FLEXFLOOR_FAULT="PHASE:RANK:STEP[:ENGINE_STEP][,PHASE:RANK:STEP[:ENGINE_STEP]...]"

The i-th fault of the list kills (SIGKILL, like a lost machine; or preempts, SIGTERM) rank RANK when it reaches PHASE
of training step STEP (1-based, as logged), on launch attempt i only
(`TORCHELASTIC_RESTART_COUNT == i`): a job restarted by `torchrun --max-restarts` meets the next
fault of the list, or none. Where each phase fires:

    rollout  an active rank at the first step boundary at or after ENGINE_STEP (default 1)
             (elastic release policy: the hook is the elastic membership's step boundary)
    resync   a rank released early, as it starts waiting for the survivors at resync
    train    after the old log-probs are computed, before the policy update's collectives
    write    while this rank's checkpoint writer processes run: right after the first is forked
             (its half of the write goes on without the worker)
    save     after this rank's shards of the checkpoint are written, before it is complete
    saved    after the step's checkpoint is complete, before the step returns to its caller
    sigterm  where `rollout` fires, but sends SIGTERM once instead of SIGKILL: a preemption
             (flexfloor/preemption.py: the step finishes, is saved, the worker exits 75)
"""

from __future__ import annotations

import enum
import functools
import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

ENV = "FLEXFLOOR_FAULT"


class FaultPhase(enum.Enum):
    ROLLOUT = "rollout"
    RESYNC = "resync"
    TRAIN = "train"
    WRITE = "write"  # fires at the first fork after `arm_at_fork`
    SAVE = "save"
    SAVED = "saved"
    SIGTERM = "sigterm"  # at the rollout hook


@dataclass(frozen=True)
class Fault:
    phase: FaultPhase
    rank: int
    step: int
    engine_step: int = 1


def parse(spec: str) -> list[Fault]:
    """`FLEXFLOOR_FAULT`'s value -> faults, one per launch attempt; errors name the fix."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            phase = FaultPhase(parts[0])
            nums = [int(p) for p in parts[1:]]
        except ValueError:
            nums = []
        if len(nums) not in (2, 3):
            raise ValueError(
                f"{ENV}: {item!r} is not PHASE:RANK:STEP[:ENGINE_STEP] with PHASE one of "
                f"{', '.join(p.value for p in FaultPhase)}; e.g. train:1:2")
        faults.append(Fault(phase, *nums))
    return faults


@functools.lru_cache(maxsize=1)
def planned() -> Optional[Fault]:
    """The fault of this launch attempt, if any."""
    faults = parse(os.environ.get(ENV, ""))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return faults[attempt] if attempt < len(faults) else None


_sent: set = set()  # SIGTERM faults already sent by this process (a kill needs no record)


def inject(phase: FaultPhase, rank: int, step: Optional[int], engine_step: int = 0) -> None:
    """SIGKILL (or SIGTERM) this process if the planned fault is here."""
    f = planned()
    if f is None or f.rank != rank or f.step != step or f in _sent:
        return
    hook = FaultPhase.ROLLOUT if f.phase == FaultPhase.SIGTERM else f.phase
    if hook != phase or (phase == FaultPhase.ROLLOUT and engine_step < f.engine_step):
        return
    sig = signal.SIGTERM if f.phase == FaultPhase.SIGTERM else signal.SIGKILL
    at = f", engine step {engine_step}" if phase == FaultPhase.ROLLOUT else ""
    print(f"[flexfloor] fault injection: {sig.name} rank {rank} in phase '{phase.value}', step "
          f"{step}{at}", file=sys.stderr, flush=True)
    _sent.add(f)
    os.kill(os.getpid(), sig)


def arm_at_fork(phase: FaultPhase, rank: int, step: Optional[int]) -> None:
    """Make `phase` fire in this process right after it next forks (the child runs on), if the
    planned fault is there."""
    f = planned()
    if f is not None and (f.phase, f.rank, f.step) == (phase, rank, step) and f not in _sent:
        os.register_at_fork(after_in_parent=lambda: inject(phase, rank, step))
