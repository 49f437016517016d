"""Entry point: `torchrun --nproc-per-node N -m flexfloor.train --config FILE [a.b=value ...]`.

Exit codes: 0 done; 2 a bad config (nothing started, nothing written); 75 preempted (SIGTERM or
SIGINT: the step in progress finished and saved, see flexfloor/preemption.py; run the same
command again to resume); 1 any other failure, after one line on stderr that names the rank, the
phase and the step. A failed worker exits at once (no teardown that could wait on a dead peer),
so torchrun sees it, stops the other workers and, with `--max-restarts`, starts them again: the
job then resumes from the newest complete checkpoint (checkpoint.resume=auto). No helper process
of a worker outlives it, even after a SIGKILL (flexfloor/launch/reaper.py).

`--check-config` only reads and validates the config for WORLD_SIZE workers (exit 0 or 2): the
example scripts run it once before they start the workers, so a config error is printed once.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from flexfloor.launch.local import clear_report, report_exit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flexfloor.train",
        description="GRPO/PPO post-training of a MoE model with elastic expert parallelism. "
        "Launch with torchrun (one process per worker).",
    )
    parser.add_argument("--config", help="YAML config (see examples/configs/)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config for WORLD_SIZE workers and exit (0 or 2)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    clear_report()  # a code an earlier round left under this worker's name is not its own
    warnings.filterwarnings("ignore", module="megatron")

    from flexfloor.config import ConfigError, load_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.config, args.overrides).resolve_world(world)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from flexfloor.outputs import creatable_folder

    try:  # before any worker builds a model: a bad folder costs a second, not the set-up
        creatable_folder(cfg.logging.run_dir, "logging.run_dir")
        if cfg.checkpoint.dir is not None:
            creatable_folder(cfg.checkpoint.dir, "checkpoint.dir")
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        return 0
    from flexfloor.launch.reaper import start_reaper
    from flexfloor.preemption import Preemption

    start_reaper()
    preemption = Preemption(cfg.checkpoint.preempt_grace_s, on_stop=_stop_now).install()
    from flexfloor.coordinator import Job

    try:
        job = Job(cfg)
        job.run(stop=lambda: preemption.requested(job.parallel))
        if not job.done():
            code = preemption.finish(job)
            if job.dir_lock is not None:
                job.dir_lock.release()
            _exit_now(code)  # no teardown: a peer may be gone already
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - every failure ends the same way: one line, exit 1
        _fail(e)
    job.close()
    report_exit(0)
    return 0


def _stop_now(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    _exit_now(1)


def _fail(e: BaseException) -> None:
    import torch.distributed as dist

    from flexfloor.checkpoint import CheckpointError
    from flexfloor.coordinator import TrainingError, error_origin
    from flexfloor.parallel import LaunchSetupError
    from flexfloor.rollout.engine import RolloutError

    where = error_origin(e) or f"rank {os.environ.get('RANK', '0')}"
    # these messages say what is wrong and how to fix it; anything else also gets its traceback
    expected = (ValueError, FileNotFoundError, CheckpointError, TrainingError, RolloutError,
                LaunchSetupError, dist.DistError)
    if not isinstance(e, expected):
        traceback.print_exception(e, file=sys.stderr)
    message = " ".join(str(e).split())  # one line
    rank = where.split(",")[0] + ", "
    if message.startswith(rank):  # a CollectiveError names the rank already
        message = message[len(rank):]
    print(f"[flexfloor] error: {where}: {type(e).__name__}: {message}", file=sys.stderr,
          flush=True)
    _exit_now(1)


def _exit_now(code: int) -> None:
    """Exit without teardown: destroying process groups can wait on a dead peer, and a
    dist-checkpointing writer or a non-daemon thread would keep the process alive. Helper
    processes this worker started go first."""
    report_exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except ImportError:
        pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
