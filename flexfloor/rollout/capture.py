"""A sync and shape audit of device code, runnable on CPU: what a CUDA graph capture would refuse.

A graph replays a fixed sequence of kernels on fixed buffers: the code it captures must not read
device values on the host (a sync, and a value the replay cannot change) nor make tensors whose
shape follows from their values. `StepAudit` is a `TorchDispatchMode` that records every aten op
run inside it, with the shapes of its inputs and outputs and its other arguments (split sizes,
dims), and flags:

- host reads: `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`), ops that return a
  Python value of device data (`aten.equal`, `aten.is_nonzero`), `Tensor.tolist` and
  `Tensor.numpy` (which read memory directly: no aten op on CPU), and copies from a non-CPU
  device to the CPU;
- data-dependent shapes: nonzero, bincount, unique, masked_select, argwhere, boolean-mask
  indexing, `repeat_interleave` without `output_size`;
- collectives with split sizes (sizes read on the host: the eager MoE all-to-all).

    with StepAudit() as audit:
        logits = engine._layer_stack(plan, batch, pool)
    assert not audit.flagged, audit.flagged
    audit.signature()   # the op sequence with its shapes: equal for two steps a graph replays

The engine's `static_decode` steps are audited this way in tests/test_capture.py; on CUDA,
`torch.cuda.set_sync_debug_mode("error")` checks the same steps for syncs (tests/gpu/check.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StepAudit", "Flag", "AuditedStep", "audit_steps"]

# ops whose output shape follows from the values of their inputs
DATA_DEPENDENT = frozenset({
    "aten::nonzero", "aten::bincount", "aten::_unique", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::masked_select",
    "aten::argwhere", "aten::nonzero_numpy",
})
# ops that hand a device value to the host
HOST_READS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero",
                        "aten::item"})
# collectives whose split sizes are arguments (host lists)
SPLIT_COLLECTIVES = frozenset({"c10d::alltoall_base_"})


@dataclass(frozen=True)
class Flag:
    """One flagged op: its index in the recorded sequence, its name and why."""

    index: int
    op: str
    reason: str


def _describe(x):
    """An argument as what a replay depends on: a tensor by shape, dtype and device; lists and
    tuples item by item; numbers and other values as they are; process groups by type."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype), x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_describe(v) for v in x)
    if isinstance(x, (bool, int, float, str, type(None), torch.dtype, torch.device,
                      torch.memory_format, torch.layout)):
        return x
    return type(x).__name__


def _reason(name: str, overload: str, args, kwargs, out):
    """Why an op cannot be captured (None: it can)."""
    if name in HOST_READS:
        return "host read"
    if name in DATA_DEPENDENT:
        return "data-dependent shape"
    if (name == "aten::repeat_interleave" and overload in ("Tensor", "self_Tensor")
            and kwargs.get("output_size") is None):  # repeats a tensor: its sum is the size
        return "data-dependent shape (repeat_interleave without output_size)"
    if name in ("aten::index", "aten::index_put", "aten::index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or ()):
            return "data-dependent shape (boolean-mask index)"
    if name in SPLIT_COLLECTIVES:
        splits = [a for a in args if isinstance(a, (list, tuple))]
        if any(len(s) for s in splits):
            return "split sizes read on the host"
    if name in ("aten::_to_copy", "aten::copy_", "aten::to"):
        src = args[1] if name == "aten::copy_" else args[0]
        dst = args[0] if name == "aten::copy_" else out
        if (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                and src.device.type != "cpu" and dst.device.type == "cpu"):
            return "device-to-host copy"
    return None


@dataclass
class _Record:
    name: str
    inputs: tuple
    outputs: tuple


class StepAudit(TorchDispatchMode):
    """Records every op run inside it (name, arguments as `_describe` gives them, outputs) and
    flags what a graph capture refuses (the module docstring). Also flags `Tensor.tolist` and
    `Tensor.numpy` calls, patched while it is active (they read memory without an aten op)."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Record] = []
        self.flagged: list[Flag] = []
        self._saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        self.ops.append(_Record(f"{name}.{func._overloadname}",
                                _describe((args, tuple(sorted(kwargs.items())))),
                                _describe(out)))
        reason = _reason(name, func._overloadname, args, kwargs, out)
        if reason is not None:
            self.flagged.append(Flag(len(self.ops) - 1, name, reason))
        return out

    def __enter__(self):
        for method in ("tolist", "numpy"):
            real = getattr(torch.Tensor, method)
            self._saved[method] = torch.Tensor.__dict__.get(method)  # None: inherited

            def reading(t, *a, _real=real, _method=method, **kw):
                self.flagged.append(Flag(len(self.ops), f"Tensor.{_method}", "host read"))
                return _real(t, *a, **kw)
            setattr(torch.Tensor, method, reading)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, own in self._saved.items():
                if own is None:
                    delattr(torch.Tensor, method)
                else:
                    setattr(torch.Tensor, method, own)
            self._saved.clear()

    def signature(self) -> tuple:
        """The recorded op sequence with every shape and argument: two runs a captured graph
        could replay have the same one."""
        return tuple((r.name, r.inputs, r.outputs) for r in self.ops)

    def summary(self) -> dict:
        """Counts for reports: ops recorded, flags by reason."""
        reasons: dict[str, int] = {}
        for f in self.flagged:
            reasons[f"{f.op}: {f.reason}"] = reasons.get(f"{f.op}: {f.reason}", 0) + 1
        return {"ops": len(self.ops), "flagged": reasons}


@dataclass
class AuditedStep:
    """One layer stack the engine ran under `audit_steps`."""

    bucket: Optional[tuple]  # a padded decode step's (rows, lanes, span); None: an eager step
    ranks: tuple  # the EP group's ranks at the step (a graph is also one layout's)
    positions: list[int]  # the step's token positions (padding rows: 0)
    tokens: list[int]  # the step's input tokens
    flagged: list[Flag]
    signature: tuple  # `StepAudit.signature`
    ops: int


@contextlib.contextmanager
def audit_steps(engine):
    """Audit every layer stack (`RolloutEngine._layer_stack`: embedding to logits, the step's
    index tensors already built) that `engine` runs inside the block, and every step it takes
    with no requests of its own (`_empty_step`: the MoE layers alone; bucket ("empty", rows),
    rows None in an eager step); yields the list of `AuditedStep`s, in order."""
    real_stack, real_empty = engine._layer_stack, engine._empty_step
    steps: list[AuditedStep] = []

    def audited(plan, batch, pool):
        with StepAudit() as audit:
            logits = real_stack(plan, batch, pool)
        steps.append(AuditedStep(batch.bucket, tuple(engine.moe.placement.ranks),
                                 batch.positions.view(-1).tolist(),
                                 batch.tokens.view(-1).tolist(), audit.flagged,
                                 audit.signature(), len(audit.ops)))
        return logits

    def audited_empty(rows=None):
        with StepAudit() as audit:
            logits = real_empty(rows)
        steps.append(AuditedStep(("empty", rows), tuple(engine.moe.placement.ranks), [], [],
                                 audit.flagged, audit.signature(), len(audit.ops)))
        return logits

    engine._layer_stack, engine._empty_step = audited, audited_empty
    try:
        yield steps
    finally:
        del engine._layer_stack, engine._empty_step
