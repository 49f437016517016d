"""Preemption: SIGTERM (how Slurm and Kubernetes preempt a job) or SIGINT (Ctrl-C) ends a run
with a checkpoint instead of losing up to `checkpoint.save_interval` steps.

Lifecycle: `Preemption(grace_s).install()` in the worker's main thread before the Job starts.
A signal only records itself (and starts the grace clock); the step in progress runs to its end
(a rollout is never cut: its ranks are in lockstep collectives). After each step the ranks agree
(`requested`, one all-reduce of one number) whether any of them was signalled, so a signal that
reached one worker stops all of them at the same step. The entry point then saves the step
(`finish`) and exits with `PREEMPTED_EXIT_CODE`. If the step and the save take longer than
`checkpoint.preempt_grace_s` after the signal, the worker exits 1 with one line saying so (the
job then resumes from its previous checkpoint): a stuck peer never turns a preemption into a hang.
A second SIGINT stops at once. A SIGTERM that torchrun sends because a worker of this node
exited (it stops the rest of a failed group) is no preemption (the handler looks for the exited
worker for up to `PEER_GONE_WAIT_S`, 1 s, before it takes a SIGTERM for one: what a rank reads of
the process table can lag torchrun's own view): the worker exits at once, also
when its main thread is blocked in a C++ call that waits for the dead peer (a rendezvous, a store
read): Python runs a signal's handler only between the main thread's calls, so a thread that
reads the signal's wakeup byte (`signal.set_wakeup_fd`) stops it instead of torchrun's SIGKILL
30 s later. Nor is the SIGTERM with which torchrun's agent stops healthy workers to restart
them for another node's failure: under `flexfloor.launch.local` (the scripts' launcher) the
agent marks those stops (`launcher_restarting`), and the worker stops at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from flexfloor.launch.local import Saved, launcher_restarting, stopped_when, to_go_on

# EX_TEMPFAIL: "try again later". Distinct from 0 (done), 1 (failed) and 2 (bad config), so a
# wrapper script can requeue (Slurm: `scontrol requeue`) on exactly this code.
PREEMPTED_EXIT_CODE = 75
# how long a SIGTERM's handler looks for an exited worker of this node before it counts the
# signal as a preemption (the grace, checkpoint.preempt_grace_s, runs from after it)
PEER_GONE_WAIT_S = 1.0


class Preemption:
    """SIGTERM/SIGINT -> stop after the current step, save, exit PREEMPTED_EXIT_CODE."""

    def __init__(self, grace_s: float, *, on_stop: Callable[[str], None]):
        self.grace_s = grace_s
        self.on_stop = on_stop  # called with the error line when the worker must stop now
        self.signal_name: Optional[str] = None
        self.signalled_at: Optional[float] = None  # time.monotonic() of the first signal
        self._done = threading.Event()
        self._stopping = threading.Lock()  # one stop line, from the handler or the reader

    def install(self) -> "Preemption":
        """The handlers, and the thread that reads their wakeup bytes (main thread only)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)
        threading.Thread(target=self._read_wakeups, args=(read,), name="flexfloor-signals",
                         daemon=True).start()
        return self

    def _read_wakeups(self, fd: int) -> None:
        while True:
            signums = os.read(fd, 64)  # a byte per signal, written as it arrives
            if signal.SIGTERM in signums and self.signalled_at is None:
                self._stop_if_peer_gone("SIGTERM")

    def _stop_if_peer_gone(self, name: str) -> bool:
        """torchrun stops the others of a failed group, or every worker of this node for a
        restart (flexfloor.launch.local says so): no save to wait for, stop now."""
        if _local_peer_gone():
            why = "after a worker of this node exited"
        elif launcher_restarting():
            why = "to restart the workers (a failure, here or on another node)"
        else:
            return False
        if self._stopping.acquire(blocking=False):
            rank = os.environ.get("RANK", "0")
            self.on_stop(f"[flexfloor] error: rank {rank}: {name} from the launcher {why}: "
                         "stopping now (no checkpoint)")
        return True

    def _stopped_as_peer_gone(self, name: str, until: float) -> bool:
        """`_stop_if_peer_gone`, asked again every 50 ms until `time.monotonic()` reaches
        `until`."""
        while not self._stop_if_peer_gone(name):
            if time.monotonic() >= until:
                return False
            time.sleep(0.05)
        return True

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signalled_at is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            return
        rank = os.environ.get("RANK", "0")
        # torchrun sends its SIGTERM once it has seen a worker exit; what this rank reads of the
        # process table may lag that by a moment (a worker being reaped, a process gone while it
        # is read), so a SIGTERM looks again for a short while before it counts as a preemption
        wait = PEER_GONE_WAIT_S if signum == signal.SIGTERM else 0.0
        if self._stopped_as_peer_gone(name, time.monotonic() + wait):
            return
        self.signal_name, self.signalled_at = name, time.monotonic()
        os.write(2, (f"[flexfloor] rank {rank}: {name}: finishing the step in progress, then "
                     f"saving a checkpoint (checkpoint.preempt_grace_s={self.grace_s:g})\n").encode())
        threading.Thread(target=self._watch, name="flexfloor-preempt-grace", daemon=True).start()

    def _watch(self) -> None:
        if not self._done.wait(self.grace_s):
            rank = os.environ.get("RANK", "0")
            self.on_stop(f"[flexfloor] error: rank {rank}: {self.signal_name}: no checkpoint "
                            f"within checkpoint.preempt_grace_s={self.grace_s:g} s (the step in "
                            "progress or the save took longer); the job resumes from its "
                            "previous checkpoint; raise checkpoint.preempt_grace_s (and the "
                            "launcher's grace, e.g. sbatch --signal) to save instead")

    def requested(self, parallel) -> bool:
        """On every rank: was any rank signalled? Call at the same point on every rank."""
        stop = any_rank(self.signalled_at is not None, parallel)
        if stop and self.signalled_at is None:  # a peer was signalled, this rank not
            self.signal_name, self.signalled_at = "SIGTERM (a peer's)", time.monotonic()
            threading.Thread(target=self._watch, name="flexfloor-preempt-grace",
                             daemon=True).start()
        return stop

    def finish(self, job) -> int:
        """Save the last finished step (unless its regular save did) and say how to resume.
        Returns the exit code."""
        saved = save_last_step(job)
        self._done.set()
        job.log.close()  # the timeline plot and the summary of the steps done, as at a run's end
        job.log.say(f"preempted by {self.signal_name} {stopped_when(job.step_index)}: "
                    f"{saved.words}, "
                    f"{time.monotonic() - self.signalled_at:.1f} s after the signal; "
                    f"{to_go_on(saved)} (exit code {PREEMPTED_EXIT_CODE})")
        return PREEMPTED_EXIT_CODE


def any_rank(flag: bool, parallel) -> bool:
    """On every rank, at the same point: is `flag` set on any rank? (A stop every rank must
    agree on, or one rank leaves a collective the others enter.)"""
    t = torch.tensor([1.0 if flag else 0.0], device=parallel.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel.world_group)
    return bool(t.item())


def save_last_step(job) -> Saved:
    """Save `job`'s last finished step, unless its regular save did (every rank: the save is
    collective). Returns what was saved, for the line that says how to go on."""
    c = job.cfg.checkpoint
    step = job.step_index
    if not c.dir:
        return Saved("nothing saved (no checkpoint.dir; set it to resume a preempted run)", False)
    from flexfloor.checkpoint import CheckpointError, iter_name, read_meta

    try:
        have = read_meta(c.dir)["step"]
    except CheckpointError:
        have = None
    if have != step and step > 0:
        with job.phase("checkpoint save"):
            job.save()
    words = (f"checkpoint {iter_name(step)} in {c.dir}" if step > 0 else
             "no step finished yet, nothing to save")
    return Saved.standing(words, c)


def _local_peer_gone() -> bool:
    """Under torchrun: has a worker of this node exited? torchrun then stops the other workers
    with SIGTERM before it restarts the group (or gives up); that is no preemption, and waiting
    for a peer that is gone would only make torchrun kill this worker 30 s later."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    # torchrun's agent sets its run id (the Ray launcher sets only the restart count: there the
    # parent is Ray's, not a launcher of this node's workers)
    if "TORCHELASTIC_RUN_ID" not in os.environ or not local:
        return False
    import psutil

    try:
        children = psutil.Process(os.getppid()).children()
    except psutil.Error:
        return False
    workers = 0
    for p in children:
        # a process gone while it is read, or a zombie, is no live worker
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                workers += 1
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            workers += 1  # there but unreadable: counted alive
    return workers < int(local)
