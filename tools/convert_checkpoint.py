#!/usr/bin/env python
"""Convert Hugging Face safetensors checkpoints <-> FlexFloor (Megatron-Core) checkpoints.

Families: Mixtral, Qwen3-MoE, OLMoE (read from config.json's model_type).

    python tools/convert_checkpoint.py hf-to-flexfloor --hf HF_DIR --out CKPT_ROOT [--ep N]
    python tools/convert_checkpoint.py flexfloor-to-hf --ckpt CKPT_ROOT --out HF_DIR [--ep N]

--ep N runs N gloo workers (the tool starts them with torchrun), each holding 1/N of the experts:
it reads only its own experts, and on the way back writes them as its own safetensors shard.
Under torchrun the EP size defaults to the world size. FlexFloor checkpoints load at any EP size,
so the EP size of a conversion only decides the memory each worker needs. N must divide the
model's experts. A refused or failed conversion, or SIGTERM, SIGINT or SIGHUP to the tool, stops
the workers and removes the partial output; a stop that comes once the output is complete keeps
it (exit status 0).

hf-to-flexfloor also writes CKPT_ROOT/model.yaml, the model section to train the checkpoint
with (`model.*` of a FlexFloor config). A checkpoint not made by this tool (a training run's)
needs its model section back: `flexfloor-to-hf --config run.yaml --family mixtral ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from flexfloor.launch.stop import StopSignals, Stopped  # noqa: E402  light: no torch


def parse(argv):
    from flexfloor.outputs import path_arg, writable_folder  # light: no torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-flexfloor", help="HF folder -> FlexFloor checkpoint root")
    a.add_argument("--hf", required=True, type=path_arg,
                   help="HF model folder (config.json + *.safetensors)")
    a.add_argument("--out", required=True, type=path_arg,
                   help="FlexFloor checkpoint root (created)")
    a.add_argument("--step", type=int, default=0, help="step number of the saved checkpoint")
    b = sub.add_parser("flexfloor-to-hf", help="FlexFloor checkpoint -> HF folder")
    b.add_argument("--ckpt", required=True, type=path_arg,
                   help="checkpoint root (follows latest) or iter_N")
    b.add_argument("--out", required=True, type=path_arg,
                   help="HF model folder (created; must not exist)")
    b.add_argument("--config", type=path_arg,
                   help="FlexFloor YAML whose model section the checkpoint holds "
                   "(only for checkpoints this tool did not make)")
    b.add_argument("--family", help="HF model_type to write: mixtral, qwen3_moe, olmoe "
                   "(only for checkpoints this tool did not make)")
    b.add_argument("overrides", nargs="*", help="section.field=value overrides of --config")
    for s in (a, b):
        s.add_argument("--ep", type=int, default=None,
                       help="expert-parallel size (default: 1, or the torchrun world size)")
    args = p.parse_args(argv)
    error = sub.choices[args.direction].error  # prints the usage and the message, exits 2
    if args.ep is not None and args.ep < 1:
        error(f"--ep {args.ep} must be at least 1 (the number of workers sharing the experts)")
    if getattr(args, "step", 0) < 0:
        error(f"--step {args.step} must be at least 0")
    if getattr(args, "overrides", None) and not args.config:
        error(f"overrides {' '.join(args.overrides)} change --config, which is not given; "
              "pass --config FILE or drop them")
    try:
        writable_folder(args.out, "--out")
    except ValueError as e:
        error(str(e))
    return args


# a terminal or ssh session closing sends SIGHUP: it stops a conversion as SIGTERM does
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STATUS_ENV = "FLEXFLOOR_CONVERT_STATUS"  # set by the launching parent: where workers report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "RANK" in os.environ:  # a worker under torchrun, which stops it
        return _convert(parse(argv))
    with EarlyStop() as early:
        try:
            args = parse(argv)
            if (args.ep or 1) > 1:
                return _launch(args, argv, early)
            # one process: its own one-rank gloo world; its store binds a free port
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
            return _alone(args, early)
        except Stopped as e:
            print(f"[convert] stopped by {signal.Signals(e.args[0]).name} as it started: "
                  "nothing written", file=sys.stderr)
            return 128 + e.args[0]


class EarlyStop:
    """While entered, a stop signal before a run's own handling takes over (the imports and
    checks, nothing written yet) raises `Stopped`: the tool ends with one line, not an import's
    traceback. `hand_over` once the run's handlers are in place; from then on, also once the
    handlers here are back, a stop is ignored (the run has decided its outcome)."""

    def __enter__(self) -> "EarlyStop":
        self.armed, self.got = True, []
        self._previous = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _stop(self, signum, _frame):
        if self.armed:
            self.got.append(signum)
            raise Stopped(signum)

    def hand_over(self) -> None:
        """A stop raised where Python dropped it (an import's clean-up) is sent again, to the
        run's handlers."""
        self.armed = False
        if self.got:
            os.kill(os.getpid(), self.got[0])


def _alone(args, early: EarlyStop) -> int:
    """A conversion with no launcher to clean up after it: a refusal, a failure or a stop
    signal removes what this run left half done (as `_launch` does for its workers), a stop
    returns 128 + the signal; after a SIGKILL the reaper removes it. A complete output stays,
    whatever comes after it: a stop then returns 0."""
    with StopSignals(STOP_SIGNALS) as stop:  # a stop from here on is kept and ends `run`
        early.hand_over()
        from flexfloor.launch.reaper import forget, remove_if_killed, remove_paths, start_reaper

        output = Output.of(args)  # before the work: what this run makes
        start_reaper()
        remove_if_killed(output.partial)
        rc = None
        try:
            rc = stop.run(_convert, args)
        finally:
            if rc != 0:  # also a stop raised where Python drops exceptions (an import's clean-up)
                remove_paths(output.partial)
            forget(output.partial)  # kept or removed above: the reaper leaves it
        if stop.got:
            return _stopped(args, output, stop.signum, said_done=rc == 0)
        return rc


def _stopped(args, output: "Output", signum: int, *, said_done: bool) -> int:
    """The end of a run a stop signal came to: 0 where the output was complete by then (kept),
    else 128 + the signal (its partial output removed by the caller)."""
    name = signal.Signals(signum).name
    if output.finished():
        if not said_done:
            print(f"[convert] {name} came after the conversion had finished: {args.out} is "
                  "complete and kept", file=sys.stderr)
        return 0
    print(f"[convert] stopped by {name}: the partial output removed", file=sys.stderr)
    return 128 + signum


def _convert(args) -> int:
    """The conversion in this process (one rank of the world): 0, or 2 on a refusal."""
    import logging

    from flexfloor.convert import flexfloor_to_hf, hf_to_flexfloor
    from flexfloor.parallel import Parallel

    # its writer logs a failed write, which the refusal below reports with its cause
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(
        logging.CRITICAL)
    par = Parallel.build(expert_parallel_size=args.ep, backend="gloo")
    try:
        if args.direction == "hf-to-flexfloor":
            directory, _, _ = hf_to_flexfloor(args.hf, args.out, par, step=args.step)
            if par.rank == 0:
                print(f"[convert] {args.hf} -> {directory} (EP={par.ep_size}); model section: "
                      f"{os.path.join(args.out, 'model.yaml')}")
        else:
            flexfloor_to_hf(args.ckpt, args.out, par, model_cfg=_model_cfg(args),
                            family=args.family)
            if par.rank == 0:
                print(f"[convert] {args.ckpt} -> {args.out} (EP={par.ep_size}, "
                      f"{par.ep_size} shard{'s' if par.ep_size > 1 else ''})")
    except _refusals() as e:
        status = os.environ.get(STATUS_ENV)
        if status:  # the launching parent reports it once; a clean exit keeps torchrun quiet
            with open(os.path.join(status, f"rank{par.rank}.txt"), "w") as f:
                f.write(_message(e))
            return 0
        if par.rank == 0:
            print(f"[convert] error: {_message(e)}", file=sys.stderr)
        return 2
    finally:
        par.destroy()
    return 0


def _refusals() -> tuple:
    from flexfloor.checkpoint import CheckpointError
    from flexfloor.config import ConfigError
    from flexfloor.convert import ConversionError

    return ConversionError, CheckpointError, ConfigError


def _message(e: Exception) -> str:
    """A refusal's text, with the checkpoint library's config keys named by this tool's flags."""
    from flexfloor.checkpoint import CheckpointError

    text = str(e)
    if isinstance(e, CheckpointError):
        text = text.replace("checkpoint.load", "--ckpt").replace("checkpoint.dir", "--out")
    return text


def _model_cfg(args):
    from flexfloor.config import load_config

    return load_config(args.config, args.overrides).model if args.config else None


def _launch(args, argv, early: EarlyStop) -> int:
    """--ep N without torchrun: check what needs no workers, then start N of them. A refusal
    (here or in a worker) prints one `[convert] error:` line, removes what the run wrote and
    returns 2. SIGTERM, SIGINT or SIGHUP stops torchrun and its workers, removes what the run
    wrote and returns 128 + the signal; once the output is complete, it keeps it and returns 0."""
    import tempfile

    from flexfloor.convert import check_flexfloor_to_hf, check_hf_to_flexfloor
    from flexfloor.launch.reaper import forget, remove_if_killed, remove_paths, start_reaper

    try:
        if args.direction == "hf-to-flexfloor":
            check_hf_to_flexfloor(args.hf, args.out, step=args.step, ep=args.ep)
        else:
            check_flexfloor_to_hf(args.ckpt, args.out, model_cfg=_model_cfg(args),
                                  family=args.family, ep=args.ep)
    except _refusals() as e:
        print(f"[convert] error: {_message(e)}", file=sys.stderr)
        return 2
    output = Output.of(args)
    start_reaper()  # a SIGKILL here (nothing to forward) still ends torchrun and its workers
    with tempfile.TemporaryDirectory(prefix="convert_") as tmp:
        # and leaves nothing: the reaper removes this folder and the partial output
        remove_if_killed([tmp, *output.partial])
        status = os.path.join(tmp, "status")
        os.mkdir(status)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ep}",
               "--standalone",  # torchrun binds a free port
               os.path.abspath(__file__), "--", *argv]
        # TMPDIR: torchrun's torchelastic_* log folders land in `tmp` too, and go with it
        env = {**os.environ, "OMP_NUM_THREADS": "1", STATUS_ENV: status, "TMPDIR": tmp}
        rc, stopped = _run(cmd, env, early)
        reports = sorted(os.listdir(status))  # rank0.txt first
        if rc != 0 or reports or stopped:
            remove_paths(output.partial)
        forget(output.partial)  # kept or removed above: the reaper leaves it
        if stopped:
            return _stopped(args, output, stopped, said_done=False)
        if reports:
            with open(os.path.join(status, reports[0])) as f:
                print(f"[convert] error: {f.read()}", file=sys.stderr)
    return 2 if reports and rc == 0 else rc  # rc != 0: a worker crashed (torchrun said how)


@dataclasses.dataclass(frozen=True)
class Output:
    """What a run writes, looked at before it starts (absolute paths). `partial`: what a
    refused, failed or stopped run leaves half done, removed then (and by the reaper after a
    SIGKILL): OUT.tmp where the run makes OUT (the library renames it to OUT once complete),
    else, in a checkpoint root that exists, iter_N.tmp and the .tmp files of `latest` and
    model.yaml. An HF folder that exists is refused by the run's checks: nothing is written."""

    out: str
    partial: tuple[str, ...]
    complete: str  # a file there (and `latest`'s text) only once the output is complete
    latest: str  # what the root's `latest` must hold; "" for an HF folder
    was_complete: bool

    @classmethod
    def of(cls, args) -> "Output":
        from flexfloor.checkpoint import LATEST_FILE, iter_name

        out = os.path.abspath(args.out)
        if args.direction == "hf-to-flexfloor":
            name = iter_name(args.step)
            there = [os.path.join(out, name + ".tmp"), os.path.join(out, LATEST_FILE + ".tmp"),
                     os.path.join(out, "model.yaml.tmp")]
            done = cls(out, tuple(there) if os.path.exists(out) else (out + ".tmp",),
                       os.path.join(out, LATEST_FILE), name, False)
        else:
            done = cls(out, () if os.path.exists(out) else (out + ".tmp",),
                       os.path.join(out, "config.json"), "", False)
        return dataclasses.replace(done, was_complete=done.finished())

    def finished(self) -> bool:
        """Whether this run's output is complete: a stop that comes now keeps it."""
        try:
            with open(self.complete) as f:
                text = f.read().strip()
        except OSError:
            return False
        return not self.was_complete and (not self.latest or text == self.latest)


def _run(cmd, env, early: EarlyStop) -> tuple[int, int]:
    """Run `cmd` in a session of its own; a stop signal here (STOP_SIGNALS) sends SIGTERM to
    its process group: torchrun then stops its workers with the signal it got, and a SIGINT
    would reach them as a KeyboardInterrupt, which a worker inside a checkpoint write could sit
    on until torchrun's SIGKILL 30 s later (seen under load). Its stderr from then on (torchrun's
    and the workers' tracebacks about the stop) is dropped. Returns (exit status, the signal passed on
    or 0). The group is stopped whatever ends this function: it never outlives it."""
    import threading

    got, proc = [], None

    def stop(signum, _frame):
        got.append(signum)
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)

    def copy_stderr():
        for line in iter(proc.stderr.readline, b""):
            if not got:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    early.hand_over()
    copier = None
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
        if got:  # a signal came before `proc` was set
            _signal_group(proc, signal.SIGTERM)
        copier = threading.Thread(target=copy_stderr, daemon=True)
        copier.start()
        rc = proc.wait()
    finally:
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            proc.wait()
        if copier is not None:
            copier.join(timeout=10)  # a helper the group left may hold the pipe: not forever
        for s, handler in previous.items():
            signal.signal(s, handler)
    return rc, (got[0] if got else 0)


def _signal_group(proc, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:  # the group has ended already
        pass


if __name__ == "__main__":
    sys.exit(main())
