"""Entry point: `torchrun --nproc-per-node N -m flexfloor.train --config FILE [a.b=value ...]`.

Exit codes: 0 done; 2 a bad config (nothing started, nothing written); 75 preempted (SIGTERM or
SIGINT: the step in progress finished and saved, see flexfloor/preemption.py; run the same
command again to resume); 1 any other failure, after one line on stderr that names the rank, the
phase and the step. A failed worker exits at once (no teardown that could wait on a dead peer),
so torchrun sees it, stops the other workers and, with `--max-restarts`, starts them again: the
job then resumes from the newest complete checkpoint (checkpoint.resume=auto). No helper process
of a worker outlives it, even after a SIGKILL (flexfloor/launch/reaper.py).

`--check-config` only reads and validates the config for WORLD_SIZE workers, and that the files
it names exist (exit 0 or 2). `python -m flexfloor.launch.local` (which the example scripts and
the Slurm scripts run in place of torchrun) runs it once before it starts the workers, so a
config error is printed once (per node). Under plain torchrun every worker checks its config
and only each node's local rank 0 prints the error.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import traceback
import warnings

from flexfloor.launch.local import clear_report, report_exit


def main(argv=None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers were installed, or a second one
        if os.environ.get("LOCAL_RANK", "0") == "0":  # the same on every worker of the node
            _say("[flexfloor] stopped at once by SIGINT (while starting, or a second Ctrl-C): "
                 "the step in progress is not saved; the newest complete checkpoint, if any, "
                 "stands")
        _exit_now(130)


def _run(argv) -> int:
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

    from flexfloor.config import ConfigError

    try:
        cfg = checked_config(args.config, args.overrides, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, ValueError) as e:
        # the same error on every worker of a node (same config, same files): said once
        if os.environ.get("LOCAL_RANK", "0") == "0":
            _say(f"config error: {e}")
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
        _fail(e, stopping=preemption.signal_name)
    job.close()
    report_exit(0)
    return 0


def checked_config(path: str | None, overrides: list[str], world: int):
    """The config of `path` and `overrides`, resolved for `world` workers, once it validates,
    its output folders can be made and the input files it names exist: before any worker
    builds a model, so a bad path costs a second, not the set-up. ConfigError or ValueError
    (naming the field and the fix) otherwise."""
    from flexfloor.config import ConfigError, DataSource, load_config
    from flexfloor.outputs import creatable_folder

    cfg = load_config(path, overrides).resolve_world(world)
    creatable_folder(cfg.logging.run_dir, "logging.run_dir")
    if cfg.checkpoint.dir is not None:
        creatable_folder(cfg.checkpoint.dir, "checkpoint.dir")
    d = cfg.data
    if d.tokenizer is not None and not os.path.exists(d.tokenizer):
        raise ConfigError("data.tokenizer", f"{d.tokenizer}: no such file or folder; give a "
                          "tokenizer.json, a SentencePiece .model or an HF model folder (or "
                          "data.tokenizer=null for the bundled one)")
    for name in ("train_files", "val_files"):
        for i, f in enumerate(getattr(d, name)):
            if not os.path.isfile(f):
                raise ConfigError(f"data.{name}[{i}]", f"{f}: no such file; give the path of a "
                                  "verl-format parquet file (tools/make_synthetic_data.py "
                                  "writes one)")
    if d.source == DataSource.REASONING_GYM:
        from flexfloor.data.tasks import reasoning_gym_tasks

        try:
            known = reasoning_gym_tasks()
        except ImportError as e:  # says how to install it
            raise ConfigError("data.source", str(e)) from None
        if d.task not in known:
            guess = difflib.get_close_matches(d.task, known, n=1)
            raise ConfigError("data.task", f"{d.task!r} is not a reasoning-gym task; "
                              + (f"did you mean {guess[0]!r}? " if guess else "")
                              + f"e.g. basic_arithmetic, chain_sum or simple_equations ({len(known)} "
                              "tasks: python -c \"import reasoning_gym; "
                              "print(sorted(reasoning_gym.factory.DATASETS))\")")
    c = cfg.checkpoint
    if not c.resumes_from_dir():  # else neither is read (Checkpointer.start_point)
        for name, fix in (("load", "a checkpoint root (the checkpoint.dir of a run) or one of "
                                   "its iter_N folders, or checkpoint.load=null"),
                          ("init_from", "a checkpoint root (e.g. the --out of "
                                        "tools/convert_checkpoint.py) or one of its iter_N "
                                        "folders")):
            path = getattr(c, name)
            if path is not None and not os.path.exists(path):
                raise ConfigError(f"checkpoint.{name}", f"{path}: does not exist; give {fix}")
    if cfg.reward.custom_fn is not None:
        from flexfloor.data.reward import custom_fn_file_missing

        missing = custom_fn_file_missing(cfg.reward.custom_fn)
        if missing:
            raise ConfigError("reward.custom_fn", missing)
    return cfg


def _say(line: str) -> None:
    """One line on stderr in one write: the workers of a node share the stream, and a line
    written in two parts (text, then newline) can be cut by another worker's."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode(errors="replace"))


def _stop_now(line: str) -> None:
    _say(line)
    _exit_now(1)


def _fail(e: BaseException, stopping: str | None = None) -> None:
    """One line naming where `e` came from, and exit 1. `stopping`: the stop signal this worker
    was finishing its step for (a peer that reached its grace first and left makes this
    worker's collective fail): the line says so, and no traceback comes with it."""
    import torch.distributed as dist

    from flexfloor.checkpoint import CheckpointError
    from flexfloor.coordinator import TrainingError, error_origin
    from flexfloor.parallel import LaunchSetupError
    from flexfloor.rollout.engine import RolloutError

    where = error_origin(e) or f"rank {os.environ.get('RANK', '0')}"
    # these messages say what is wrong and how to fix it; anything else also gets its traceback
    expected = (ValueError, FileNotFoundError, CheckpointError, TrainingError, RolloutError,
                LaunchSetupError, dist.DistError)
    if not isinstance(e, expected) and stopping is None:
        traceback.print_exception(e, file=sys.stderr)
    message = " ".join(str(e).split())  # one line
    rank = where.split(",")[0] + ", "
    if message.startswith(rank):  # a CollectiveError names the rank already
        message = message[len(rank):]
    during = "" if stopping is None else f" (while stopping for {stopping}: no checkpoint saved)"
    _say(f"[flexfloor] error: {where}: {type(e).__name__}: {message}{during}")
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
