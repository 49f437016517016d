"""Atomic, verified, EP-reshardable checkpoints.

Layout of a checkpoint root:

    root/
      latest                 text: the name of the newest complete checkpoint ("iter_0000012")
      iter_0000012/          Megatron-Core dist-checkpoint (torch_dist) of model + optimizer
        flexfloor.json       step, model shape, extra state keys, file manifest (sizes, sha256)
        extra_state.pt       RNG states, scheduler/data/length-history state (rank 0's copy)
        rng_rank{r}.pt       each rank's RNG state

Why not Megatron's save alone: it writes shards straight into the target directory and is not
atomic (overwriting a directory can load silently as a mix of old and new shards). So every save
goes into `iter_N.tmp`, all ranks meet, rank 0 writes the manifest, renames the directory to
`iter_N` and only then points `latest` at it (write-temp + os.replace). A crash at any point
leaves the previous checkpoint the one that loads. Loading verifies the manifest (every file
present with its size and checksum) and the model shape before reading a single tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import shutil
from dataclasses import asdict, dataclass, is_dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from flexfloor.faults import FaultPhase, arm_at_fork, inject

FORMAT_VERSION = 1
META_FILE = "flexfloor.json"
EXTRA_FILE = "extra_state.pt"
LATEST_FILE = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupted or of another model; or
    a save or load that failed (disk full, permissions), whatever the exception class."""


def root_cause(exc: BaseException) -> str:
    """The innermost reason of a failed save/load on one line: torch's `CheckpointException`
    (a BaseException) wraps each rank's error with its traceback; Megatron's writer chains them."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {root_cause(inner)}")
        return "; ".join(parts)
    while exc.__cause__ is not None or (exc.__context__ is not None
                                        and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _interrupt(exc: BaseException) -> Optional[BaseException]:
    """The KeyboardInterrupt or SystemExit inside a failure, if any: torch's
    `CheckpointException` catches a rank's interrupt with everything else and wraps it."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(w[0] if isinstance(w, tuple) else w for w in failures.values())
        todo.extend((e.__cause__, e.__context__))
    return None


_SAVE_FIX = ("free space or fix the permissions of checkpoint.dir (the last complete checkpoint "
             "is kept)")
_LOAD_FIX = "check the files or load an earlier checkpoint"


@contextlib.contextmanager
def _io(what: str, path: str, fix: str):
    """Any failure of a save or load, whatever its class, leaves as one CheckpointError that
    names the cause (`Errno 28`, a permission) and the fix. An interrupt stays an interrupt."""
    try:
        yield
    except (CheckpointError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        interrupt = _interrupt(e)
        if interrupt is not None:  # a Ctrl-C or SIGTERM during the save, not a disk's failure
            raise interrupt
        try:  # a full disk often surfaces as a torch serializer error, not as Errno 28
            free = f" ({shutil.disk_usage(os.path.dirname(path)).free / 2**20:.0f} MiB free there)"
        except OSError:
            free = ""
        raise CheckpointError(f"{what} {path} failed{free}: {root_cause(e)}; {fix}") from e


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


# --------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------
# manifest


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(directory: str) -> dict:
    files = {}
    for dirpath, _, names in os.walk(directory):
        for name in sorted(names):
            if name == META_FILE:
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, directory)
            files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    return files


def _verify_manifest(directory: str, meta: dict) -> None:
    for rel, want in meta["files"].items():
        path = os.path.join(directory, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {directory} is incomplete: {rel} is missing")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {directory} is corrupted: {rel} has {size} bytes, the manifest "
                f"says {want['bytes']} (truncated or overwritten); load an earlier checkpoint"
            )
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {directory} is corrupted: {rel} fails its sha256 check; "
                "load an earlier checkpoint"
            )


def _shape_of(model_cfg) -> dict:
    d = asdict(model_cfg) if is_dataclass(model_cfg) else dict(vars(model_cfg))
    keys = (
        "num_layers hidden_size ffn_hidden_size moe_ffn_hidden_size num_attention_heads "
        "num_query_groups kv_channels num_experts moe_router_topk shared_expert_ffn_hidden_size "
        "vocab_size"
    ).split()
    return {k: d.get(k) for k in keys}


# --------------------------------------------------------------------------------------------
# save / load


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_state(model, optimizer, *, is_loading: bool) -> dict:
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"chained_optim_avoid_prefix": True}
        )
    return state


def _write_results_in_process() -> None:
    """Megatron-Core's torch_dist writer hands a save's write results to the caller through a
    queue of a spawned `multiprocessing.Manager` process, made for async saves (whose writer runs
    in another process). Our saves are synchronous: the writer is this process, so a thread queue
    carries them. The Manager would cost every process's first save its start and its import of
    torch (to unpickle the results): seconds, in every worker and again in every restarted one,
    and one more process per worker to reap after a kill."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # (a Megatron-Core without this module-level queue has nothing to replace)
    if hasattr(filesystem_async, "_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(
    root: str,
    step: int,
    *,
    model,
    model_cfg,
    optimizer=None,
    extra_state: Optional[dict] = None,
    keep_last: int = 0,
) -> str:
    """Save atomically; returns the final directory. Call on every rank."""
    from megatron.core import dist_checkpointing

    final = os.path.join(root, iter_name(step))
    tmp = final + ".tmp"
    if _is_rank0():
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # leftovers of a crashed save: never loaded, safe to drop
            shutil.rmtree(tmp)
        if os.path.exists(final) and step > _latest_step(root):
            # renamed by a save that crashed before it moved `latest`: never loaded, and this
            # save (of a run resumed from `latest`) recomputed the same step
            shutil.rmtree(final)
        if os.path.exists(final):
            raise CheckpointError(
                f"{final} exists already; checkpoints are never overwritten. Remove it or "
                "save under another step"
            )
        os.makedirs(tmp)
    _barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    _write_results_in_process()
    arm_at_fork(FaultPhase.WRITE, rank, step)  # at dist-checkpointing's first writer process
    with _io("saving", tmp, _SAVE_FIX):
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), tmp)
        torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
        if _is_rank0():
            torch.save(extra_state or {}, os.path.join(tmp, EXTRA_FILE))
    inject(FaultPhase.SAVE, rank, step)
    _barrier()
    if _is_rank0():
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "model_shape": _shape_of(model_cfg),
            "has_optimizer": optimizer is not None,
            "extra_state_keys": sorted((extra_state or {}).keys()),
            "files": _manifest(tmp),
        }
        _write_atomic(os.path.join(tmp, META_FILE), json.dumps(meta, indent=1))
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, LATEST_FILE), iter_name(step) + "\n")
        if keep_last > 0:
            _prune(root, keep_last)
    _barrier()
    return final


def _latest_step(root: str) -> int:
    """The step `root/latest` points at; -1 when there is none."""
    try:
        with open(os.path.join(root, LATEST_FILE)) as f:
            return int(f.read().strip().removeprefix("iter_"))
    except (FileNotFoundError, ValueError):
        return -1


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("iter_") and not d.endswith(".tmp"))
    for name in done[:-keep_last]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a root (follows `latest`) or an `iter_N` directory."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint path {path} does not exist (checkpoint.load)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, give the folder: a checkpoint root or one of "
                              "its iter_N folders (checkpoint.load)")
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    elif not os.path.basename(path.rstrip("/")).startswith("iter_"):
        iters = sorted(d for d in os.listdir(path) if d.startswith("iter_")
                       and not d.endswith(".tmp"))
        raise CheckpointError(
            f"{path} has no `{LATEST_FILE}` file in it and is no iter_N folder: give "
            + (f"an iter_N folder in it ({', '.join(iters[-3:])})" if iters else
               "a checkpoint root (with `latest`) or an iter_N folder") + " (checkpoint.load)")
    if path.rstrip("/").endswith(".tmp"):
        raise CheckpointError(f"{path} is an unfinished save and is never loaded")
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise CheckpointError(
            f"{path} is not a complete FlexFloor checkpoint (no {META_FILE}): the save did not "
            "finish; point checkpoint.load at the root or an earlier iter_N"
        )
    return path


def read_meta(path: str) -> dict:
    with open(os.path.join(resolve_checkpoint(path), META_FILE)) as f:
        return json.load(f)


def load_checkpoint(
    path: str,
    *,
    model,
    model_cfg,
    optimizer=None,
    verify: bool = True,
) -> tuple[int, dict]:
    """Load into `model` (and `optimizer`) at the current EP layout. Returns (step, extra_state).

    The checkpoint may have been saved at any EP size. Call on every rank.
    """
    from megatron.core import dist_checkpointing

    directory = resolve_checkpoint(path)
    with open(os.path.join(directory, META_FILE)) as f:
        meta = json.load(f)
    want = _shape_of(model_cfg)
    diff = {k: (meta["model_shape"].get(k), v) for k, v in want.items() if meta["model_shape"].get(k) != v}
    if diff:
        fields = ", ".join(f"model.{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise CheckpointError(
            f"checkpoint {directory} is of another model shape ({fields}); use a config that "
            "matches the checkpoint or convert it"
        )
    if optimizer is not None and not meta["has_optimizer"]:
        raise CheckpointError(f"checkpoint {directory} holds no optimizer state; load it without one")
    if verify:
        _verify_manifest(directory, meta)
    _barrier()
    with _io("loading", directory, _LOAD_FIX):
        state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True),
                                        directory)
        model.load_state_dict(state["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng_file = os.path.join(directory, f"rng_rank{rank}.pt")
        if os.path.exists(rng_file):  # absent when resumed on more ranks than saved
            set_rng_state(torch.load(rng_file, weights_only=False))
        extra = torch.load(os.path.join(directory, EXTRA_FILE), weights_only=False)
    return meta["step"], extra


# --------------------------------------------------------------------------------------------
# start-up: the directory is writable and this job holds it

LOCK_FILE = "flexfloor.lock"


@dataclass(frozen=True)
class DirLock:
    """`checkpoint.dir/flexfloor.lock`, held by rank 0 of the job for the whole run."""

    path: str
    host: str
    pid: int
    started: str  # ISO time, UTC

    def release(self) -> None:
        """Remove the lock if it is still this job's (a job that took it over keeps it)."""
        if _read_lock(self.path) == {"host": self.host, "pid": self.pid, "started": self.started}:
            os.remove(self.path)


def _read_lock(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            owner = json.load(f)
        return {k: owner[k] for k in ("host", "pid", "started")}
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return {"host": "?", "pid": -1, "started": "?"}  # torn by a crash while written: stale


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, killed but not yet reaped by its
    parent, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # e.g. access denied: it exists
        return True


# set by a launcher that restarts every worker: JSON {"host": ..., "pid": ...} of the previous
# attempt's rank 0, which it ended (its lock is this job's, wherever the new rank 0 runs)
PREDECESSOR_ENV = "FLEXFLOOR_LOCK_PREDECESSOR"


def _predecessor() -> Optional[tuple]:
    try:
        got = json.loads(os.environ.get(PREDECESSOR_ENV) or "null")
        return (str(got["host"]), int(got["pid"])) if got else None
    except (ValueError, TypeError, KeyError):
        return None


def lock_checkpoint_dir(directory: str, say) -> DirLock:
    """Create `directory`, prove that it takes a file (write, fsync, delete) and take its lock.

    Runs on one process (rank 0) before the first step, so a directory that cannot hold a
    checkpoint fails at start-up, not at the first save. A lock whose process is gone (a killed
    job, the previous attempt of a restarted one) is taken over, and `say` logs it; a live one
    (or one of another host, whose process cannot be checked) refuses the start, naming it,
    unless the launcher names it as this job's rank 0 of an attempt it ended
    (`PREDECESSOR_ENV`: the Ray launcher's restart may place rank 0 on another host).
    """
    import socket
    import time

    field = f"checkpoint.dir={directory}"
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".probe.{socket.gethostname()}.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("flexfloor write probe\n")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"{field} cannot hold checkpoints ({type(e).__name__}: {e}); give a directory this "
            "job can create and write (or fix its permissions or free space)") from None
    me = DirLock(os.path.join(directory, LOCK_FILE), socket.gethostname(), os.getpid(),
                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    text = json.dumps({"host": me.host, "pid": me.pid, "started": me.started})
    while True:
        try:
            fd = os.open(me.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = _read_lock(me.path)
            if owner is None:  # released meanwhile
                continue
            who = f"pid {owner['pid']} on host {owner['host']}, started {owner['started']}"
            if (owner["host"], owner["pid"]) == (me.host, me.pid):  # an earlier Job of ours
                os.remove(me.path)
                continue
            if (owner["host"], owner["pid"]) == _predecessor():
                os.remove(me.path)
                say(f"checkpoint.dir: took over the lock of {who}: this job's rank 0 of the "
                    "launch attempt before, ended by the launcher")
                continue
            if owner["host"] not in (me.host, "?"):
                raise CheckpointError(
                    f"{field} is locked by another job ({who}, {me.path}); use another "
                    "checkpoint.dir, or remove the lock file if that job is gone") from None
            if owner["pid"] != -1 and _pid_alive(owner["pid"]):
                raise CheckpointError(
                    f"{field} is in use by another job ({who}, {me.path}); use another "
                    "checkpoint.dir or stop that job") from None
            os.remove(me.path)
            say(f"checkpoint.dir: took over the stale lock of {who} (that process is gone)")
            continue
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        return me


def hold_checkpoint_dir(directory: str, *, rank: int, group=None, say=print) -> Optional[DirLock]:
    """`lock_checkpoint_dir` on rank 0; every rank raises its refusal (none waits on a rank that
    failed). Returns the lock on rank 0, None elsewhere."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = lock_checkpoint_dir(directory, say)
        except CheckpointError as e:
            error = str(e)
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise CheckpointError(box[0])
    return lock


__all__ = [
    "CheckpointError",
    "DirLock",
    "hold_checkpoint_dir",
    "lock_checkpoint_dir",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "read_meta",
    "rng_state",
    "set_rng_state",
    "iter_name",
]
