"""Release frees the accelerator: a released rank parks what it holds in host memory until resync.

A rank that leaves a rollout has already sent its experts to the survivors and dropped the experts
it borrowed; its KV blocks went with its finished requests. What it still holds are the model's
own weights (its expert shard and every dense weight), Megatron DDP's gradient buffers and the
optimizer's fp32 main parameters and Adam moments: in a colocated RL job that is most of an
accelerator's memory, and nothing of it is read before the next training step. `HostOffload`
copies each of those storages into one compact host buffer (pinned on CUDA, so the copy back runs
at full bus speed) and resizes the storage itself to 0 bytes: the `Parameter` objects, their
views (`main_grad` into the DDP buffer), the optimizer's references and the autograd hooks all
stay as they are, only their memory is gone. `restore()` (at resync) re-grows every storage and
copies its bytes back, so weights, gradients and optimizer state come back bit for bit.

Lifecycle (one value per rank, built once): `offload()` at release -> `restore()` at resync; the
release listener `OffloadOnRelease` calls them on the "released" / "rejoined" events.

What "freed" means, and how it is measured (`resident_bytes`):
- CUDA: `torch.cuda.memory_allocated()`, after `torch.cuda.empty_cache()` has handed the cached
  blocks back to the driver; another job on the device can then allocate them.
- CPU (the tests): there is no separate device memory, so the figure is the bytes of the live
  storages the process holds for the model, the engine (KV, borrowed experts) and the optimizer,
  each storage counted once however many views share it. It is honest because the storages are
  really emptied (resized to 0 bytes: freed, not re-pointed or hidden from the count) and the
  parked bytes live outside the process's tensors: in a temporary file, unmapped until resync
  (the CPU stand-in for pinned host memory; the page cache holding it is the kernel's to write
  out). A released rank then holds nothing of the measured set but what the release could not
  move; its figure must be at most 10% of a survivor's (tested). The process's RSS is reported
  next to it (`rss_bytes_*`) but is not the measure: freed storages of small models stay in the
  C allocator's heap, free for the process's next tensors but not handed back to the kernel, so
  RSS falls only where tensors are large enough to be mapped on their own (two linear layers
  and Adam, 144 MB in all: RSS fell by 143 MB).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind `tensors`, each once (views of one buffer share one), non-empty only."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        seen.setdefault((str(s.device), s.data_ptr()), s)
    return list(seen.values())


@dataclass
class ResidentSet:
    """Everything a rank holds for rollout and training: the model, its DDP gradient buffers and
    optimizer (`train_state`, a `flexfloor.trainer.optim.TrainState`), and the engine's borrowed
    experts and KV (`moe`, `engine`). Parts not given are not counted or moved."""

    model: torch.nn.Module
    train_state: Optional[object] = None
    moe: Optional[object] = None  # megatron_ext.elastic_moe.PlacedMoE
    engine: Optional[object] = None  # flexfloor.rollout.engine.RolloutEngine
    also: tuple = ()  # more ResidentSets of the rank (a critic, a frozen reference policy)

    def tensors(self) -> Iterator[torch.Tensor]:
        for part in self.also:
            yield from part.tensors()
        yield from self.model.parameters()
        yield from self.model.buffers()
        for p in self.model.parameters():
            for name in ("main_grad", "grad"):  # DDP's views into its buffers; plain autograd
                g = getattr(p, name, None)
                if isinstance(g, torch.Tensor):
                    yield g
        if self.train_state is not None:
            yield from _optimizer_tensors(self.train_state.optimizer)
        if self.moe is not None:
            for hosted in self.moe.hosted:  # borrowed experts (the own ones are model params)
                for module in hosted.values():
                    yield from module.parameters()
        if self.engine is not None:
            yield from _engine_tensors(self.engine)

    def nbytes(self) -> int:
        """Bytes of live storages (each once): what `resident_bytes` reports on CPU."""
        return sum(s.nbytes() for s in unique_storages(self.tensors()))

    def offloadable(self) -> list[torch.UntypedStorage]:
        """What a released rank parks in host memory: model, gradient buffers, optimizer state.
        (Borrowed experts and KV are freed by the release itself, not parked; any left would
        still count in `nbytes`.)"""
        return unique_storages(ResidentSet(self.model, train_state=self.train_state,
                                           also=self.also).tensors())


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Tensors of a Megatron optimizer (chained or not): the parameters it steps (fp32 main
    copies under bf16) and their state (Adam moments, step)."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for group in torch_opt.param_groups:
            yield from group["params"]
        for state in torch_opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


def _engine_tensors(engine) -> Iterator[torch.Tensor]:
    """The engine's KV: a block pool when it has one, else its running requests' caches."""
    pool = getattr(engine, "kv_pool", None)
    if pool is not None:
        for name in ("k", "v"):
            t = getattr(pool, name, None)
            if isinstance(t, torch.Tensor):
                yield t
    for r in getattr(engine, "running", ()) or ():
        cache = getattr(r, "cache", None)
        if cache is not None:
            yield cache.k
            yield cache.v


def resident_bytes(resident: ResidentSet, device: torch.device) -> int:
    """Accelerator bytes this rank holds: `memory_allocated` on CUDA, live storages on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return resident.nbytes()


def rss_bytes() -> int:
    """The process's resident set size (Linux), 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class OffloadError(RuntimeError):
    pass


@dataclass
class HostOffload:
    """Parks a rank's resident storages in host memory and brings them back (see the module doc).

    `offload()` then `restore()`, any number of times; `parked` says which state it is in.
    """

    resident: ResidentSet
    device: torch.device
    stats: dict = field(default_factory=dict)
    _parked: list = field(default_factory=list, repr=False)  # (storage, offset, nbytes)
    _host: object = field(default=None, repr=False)  # _PinnedHost | _FileHost while parked

    @property
    def parked(self) -> bool:
        return self._host is not None

    def offload(self) -> dict:
        """Copy every offloadable storage to host memory, empty the storages, drop caches.
        Returns (and keeps in `stats`) bytes before/after, bytes moved and seconds."""
        if self.parked:
            raise OffloadError("offload() called twice without restore(): the weights are already "
                               "in host memory")
        t0 = time.perf_counter()
        before, rss_before = resident_bytes(self.resident, self.device), rss_bytes()
        storages = self.resident.offloadable()
        total = sum(s.nbytes() for s in storages)
        self._host = (_PinnedHost if self.device.type == "cuda" else _FileHost)(total)
        offset = 0
        for s in storages:
            n = s.nbytes()
            self._host.write(offset, _bytes_of(s))
            self._parked.append((s, offset, n))
            offset += n
        self._host.written()
        for s, _, _ in self._parked:
            s.resize_(0)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.stats = {
            "resident_bytes_before_release": before,
            "resident_bytes_after_release": resident_bytes(self.resident, self.device),
            "offloaded_bytes": total,
            "rss_bytes_before_release": rss_before,
            "rss_bytes_after_release": rss_bytes(),
            "offload_s": time.perf_counter() - t0,
        }
        return self.stats

    def restore(self) -> float:
        """Re-grow every parked storage and copy its bytes back (bit for bit). Returns seconds."""
        if not self.parked:
            return 0.0
        t0 = time.perf_counter()
        for s, offset, n in self._parked:
            s.resize_(n)
            self._host.read(offset, _bytes_of(s))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._parked.clear()
        self._host.close()
        self._host = None
        self.stats["restore_s"] = time.perf_counter() - t0
        self.stats["resident_bytes_after_resync"] = resident_bytes(self.resident, self.device)
        return self.stats["restore_s"]


class _PinnedHost:
    """CUDA: one pinned host buffer; copies run asynchronously, synchronised once."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def write(self, offset: int, src: torch.Tensor) -> None:
        self.buf[offset : offset + src.numel()].copy_(src, non_blocking=True)

    def written(self) -> None:
        torch.cuda.synchronize()  # before the device storages are freed

    def read(self, offset: int, dst: torch.Tensor) -> None:
        dst.copy_(self.buf[offset : offset + dst.numel()], non_blocking=True)

    def close(self) -> None:
        self.buf = None


class _FileHost:
    """CPU: a temporary file (the stand-in for host memory outside the process's tensors; see
    the module doc), mapped only while it is written and while it is read back. Tensor copies
    only: `.numpy()` would pin a storage's size for good and forbid the resize."""

    def __init__(self, nbytes: int):
        fd, self.path = tempfile.mkstemp(prefix="flexfloor-offload-")
        os.close(fd)
        self.nbytes = nbytes
        self.map = self._map()

    def _map(self) -> torch.Tensor:
        return torch.from_file(self.path, shared=True, size=max(1, self.nbytes), dtype=torch.uint8)

    def write(self, offset: int, src: torch.Tensor) -> None:
        self.map[offset : offset + src.numel()].copy_(src)

    def written(self) -> None:
        self.map = None  # unmapped: the bytes are the kernel's page cache, not this process's

    def read(self, offset: int, dst: torch.Tensor) -> None:
        if self.map is None:
            self.map = self._map()
        dst.copy_(self.map[offset : offset + dst.numel()])

    def close(self) -> None:
        self.map = None
        os.unlink(self.path)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class OffloadOnRelease:
    """A release listener (see `flexfloor.rollout.elastic.ReleaseListener`) that offloads this rank
    when it is released and restores it when it rejoins at resync, then tells `then` (the
    launcher's listener) the same event. `take_stats()` hands the rollout's figures to its rank
    record (`resident_bytes_before_release`, `resident_bytes_after_release`, `restore_s`)."""

    def __init__(self, offload: HostOffload, then=None):
        self.offload = offload
        self.then = then
        self._stats: dict = {}

    def __call__(self, event: str, rank: int, time_s: float, engine_step: int) -> None:
        # the launcher hears "released" once the memory is free, and "rejoined" before the
        # memory is taken back (a borrower stops at that news)
        if event == "released":
            self._stats = dict(self.offload.offload())
        if self.then is not None:
            self.then(event, rank, time_s, engine_step)
        if event == "rejoined" and self.offload.parked:
            self.offload.restore()
            self._stats.update(restore_s=self.offload.stats["restore_s"],
                               resident_bytes_after_resync=self.offload.stats[
                                   "resident_bytes_after_resync"])

    def take_stats(self) -> dict:
        """This rollout's figures (empty when the rank was not released); cleared by the call."""
        out, self._stats = self._stats, {}
        return out
