"""Local launcher: this node's torchrun, exiting as its workers decided.

    python -m flexfloor.launch.local [torchrun options] -m flexfloor.train [train arguments]

Run as `python -m torch.distributed.run`, torchrun answers a stop signal it receives (Ctrl-C in
the terminal, a SIGTERM to the job) with its own traceback and exit code 1, even where every
worker finished its step, saved it and exited 75 (preempted: run the same command again); and a
worker's 75 reaches the caller as torchrun's 1. So `examples/train_moe.sh` runs torchrun's entry
point in this process instead (so does each node's task of `grpo_moe.sbatch`), and every worker
of this node reports its exit code into a folder of this launch (`STATUS_ENV`). The last launch
attempt's codes decide the outcome:
- every worker exited 75: exit 75 (a wrapper requeues exactly the preempted jobs);
- every worker exited 0 (a stop signal after the last step): exit 0;
- a stop signal, and the workers stopped before they saved: one line, exit 128 + the signal;
- otherwise torchrun's own outcome (0, or 1 after its failure summary).
No traceback is printed for a stop signal. Before torchrun starts any worker, the config of
`-m flexfloor.train` is checked here once (`flexfloor.train --check-config`, for the world
size the torchrun options give): an error is one line and exit code 2, not one per worker
and torchrun's failure summary.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass

# set for the workers: the folder where each writes its exit code (flexfloor.train)
STATUS_ENV = "FLEXFLOOR_LAUNCH_STATUS"
PREEMPTED = 75  # flexfloor.preemption.PREEMPTED_EXIT_CODE (not imported: it loads torch's dist)


# in the status folder while torchrun's agent stops this node's workers other than for a stop
# signal: to restart them (a failure here, or another node's new rendezvous round) or after a
# failure with no restarts left. Their SIGTERM is then no preemption (flexfloor.preemption).
RESTARTING = "restarting"


def launcher_restarting() -> bool:
    """In a worker: is this node's launcher stopping its workers for a restart or a failure
    (not for a stop signal)?"""
    folder = os.environ.get(STATUS_ENV)
    return bool(folder) and os.path.exists(os.path.join(folder, RESTARTING))


def _mark_restarts(folder: str) -> None:
    """Have torchrun's agent mark `folder` (RESTARTING) while it stops its workers through
    `_stop_workers`, which it calls for a restart and after a failure; a stop signal it receives
    goes through `_shutdown` instead. (A private method of torch's agent: where it is missing,
    nothing is marked and the workers take that SIGTERM for a preemption, as before.)"""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    stop = getattr(LocalElasticAgent, "_stop_workers", None)
    if stop is None:
        return
    mark = os.path.join(folder, RESTARTING)

    def _stop_workers(self, worker_group):
        with open(mark, "w"):
            pass
        try:
            return stop(self, worker_group)
        finally:  # the next workers start unmarked
            try:
                os.remove(mark)
            except FileNotFoundError:
                pass

    LocalElasticAgent._stop_workers = _stop_workers


@dataclass(frozen=True)
class Saved:
    """What a stop left to go on from: `words` for its last line; `resumes`: whether the same
    command resumes (`CheckpointConfig.resumes_from_dir`; None where it cannot be told here, as
    on a Ray driver that may not see the workers' files); `checkpoint`: one was saved or stands
    in checkpoint.dir (with checkpoint.resume=off the same command does not read it)."""

    words: str
    resumes: bool | None
    checkpoint: bool = False

    @classmethod
    def standing(cls, words: str, checkpoint_cfg, here: bool = True) -> "Saved":
        """What checkpoint.dir holds now (the stop's save, or the newest complete checkpoint
        where the stop saved nothing) and whether the same command resumes from it. `here`:
        this process sees checkpoint.dir as the workers wrote it (a worker; a Ray driver may
        not, and then says it cannot tell where it finds nothing)."""
        from flexfloor.config import Resume

        c = checkpoint_cfg
        if not c.dir:
            return cls(words, False)
        if c.resumes_from_dir():
            return cls(words, True, checkpoint=True)
        if c.resume != Resume.AUTO:
            return cls(words, False, c.holds_checkpoint())
        return cls(words, False if here else None)


def stopped_when(step: int) -> str:
    """Where a stopped run stood, for its last line: after its last finished step, or before
    its first (a stop during the warm start)."""
    return f"after step {step}" if step else "before step 1"


def to_go_on(saved: Saved) -> str:
    """How a stopped run goes on, from what its stop `saved`: the same command resumes it, or
    starts it again where nothing is there to resume from."""
    if saved.resumes:
        return "run the same command again to resume"
    if saved.resumes is None:
        return ("run the same command again: it resumes from the newest complete checkpoint in "
                "checkpoint.dir if there is one, else starts again")
    if saved.checkpoint:
        return ("checkpoint.resume=off: the same command starts again; run it with "
                "checkpoint.resume=auto to resume")
    return "run the same command again to start it again (nothing to resume from)"


def _report_path() -> str | None:
    """This worker's report file in the launch's folder, or None outside this launcher."""
    folder = os.environ.get(STATUS_ENV)
    if not folder or not os.path.isdir(folder):
        return None
    return os.path.join(folder, f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                                f".rank_{os.environ.get('RANK', '0')}")


def clear_report() -> None:
    """In a worker, as it starts: remove the report an earlier round of the same attempt number
    left. Under the c10d rendezvous (a multi-node job with restarts) a node whose workers were
    restarted for another node's failure keeps its count, so its new workers report under the
    old names; one killed before it reports would leave its predecessor's code (a 75, say)
    standing for it."""
    path = _report_path()
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def report_exit(code: int) -> None:
    """In a worker: record `code` as this worker's exit code for the launcher (if any)."""
    path = _report_path()
    if path is None:
        return
    from flexfloor.outputs import write_whole

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(str(code))

    try:  # whole or not at all: the launcher reads no half-written code
        write_whole(path, write)
    except OSError:  # the launcher is gone: nobody reads it
        pass


def last_attempt_codes(folder: str) -> dict[int, int]:
    """rank -> exit code of the newest attempt that reported any."""
    by_attempt: dict[int, dict[int, int]] = {}
    for name in os.listdir(folder):
        m = re.fullmatch(r"attempt_(\d+)\.rank_(\d+)", name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                code = int(f.read().strip())
        except (OSError, ValueError):
            continue
        by_attempt.setdefault(int(m.group(1)), {})[int(m.group(2))] = code
    return by_attempt[max(by_attempt)] if by_attempt else {}


def outcome(codes: dict[int, int], workers: int | None, torchrun_code: int,
            signum: int | None) -> int:
    """The job's exit code (module doc): `codes` from `last_attempt_codes`, `workers` the
    attempt's worker count (None: as many as reported), `signum` the stop signal torchrun
    received (None: none)."""
    every = bool(codes) and (workers is None or len(codes) == workers)
    if every and set(codes.values()) == {PREEMPTED}:
        return PREEMPTED
    if every and set(codes.values()) == {0}:
        return 0
    if signum is not None:
        return 128 + signum
    return torchrun_code


def world_size(nnodes: str, nproc_per_node: str) -> int | None:
    """The workers torchrun's `--nnodes` and `--nproc-per-node` give, when fixed: None for an
    elastic range (`1:4`) or a per-device count (`gpu`, `auto`)."""
    from torch.distributed.run import parse_min_max_nnodes

    low, high = parse_min_max_nnodes(str(nnodes))
    if low != high or not str(nproc_per_node).isdigit():
        return None
    return low * int(nproc_per_node)


def check_config(train_args: list[str], world: int) -> int:
    """`flexfloor.train --check-config` of `train_args` in this process, once, for `world`
    workers, before any worker starts: its exit code (2 after one line)."""
    from flexfloor.train import main as train_main

    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        return train_main(["--check-config", *train_args])
    finally:
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before


def check_config_first(args) -> int:
    """`check_config` for torchrun's parsed `args` (when they run `-m flexfloor.train` on a
    fixed world size): its exit code, 0 when it passed or does not apply."""
    train_args = list(args.training_script_args)
    world = world_size(args.nnodes, args.nproc_per_node)
    if not (args.module and args.training_script == "flexfloor.train") or world is None \
            or "--check-config" in train_args:
        return 0
    return check_config(train_args, world)


def main(argv=None) -> int:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from torch.distributed.run import parse_args

    from flexfloor.launch.reaper import forget, remove_if_killed, start_reaper

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)  # torchrun's own errors (exit 2) before anything is made
    code = check_config_first(args)
    if code:
        return code
    nproc = str(args.nproc_per_node)  # this node's workers: they report here
    workers = int(nproc) if nproc.isdigit() else None
    start_reaper()  # after a SIGKILL of this launcher, its workers and the folder go too
    status = tempfile.mkdtemp(prefix="flexfloor-launch-")
    remove_if_killed([status])
    os.environ[STATUS_ENV] = status
    _mark_restarts(status)
    signum, code = None, 0
    try:
        try:
            torchrun(argv)
        except SignalException as e:  # torchrun has stopped its workers (they saved, or not)
            signum = int(e.sigval)
        except ChildFailedError:  # torchrun printed which worker failed and how
            code = 1
        codes = last_attempt_codes(status)
    finally:
        shutil.rmtree(status, ignore_errors=True)
        forget([status])
    result = outcome(codes, workers, code, signum)
    if signum is not None and result == 128 + signum:
        print(f"[flexfloor] stopped by {signal.Signals(signum).name} before every worker had "
              "saved its step: run the same command again to resume from the newest checkpoint",
              file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
