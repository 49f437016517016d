"""FlexFloor's CPU kernels (csrc/cpu_kernels.c), float32: expert GEMMs of a few rows and the
decode step's attention.

**Expert GEMMs** (`grouped_mm`, `linear`). In a decode step each expert gets a handful of
rows (batch 32, top-2 of 8 experts: about 8), so its GEMM is one trip of its weight from
memory. MKL's sgemm (what `torch._grouped_mm` and `F.linear` run on CPU) reads a weight it does
not find in cache at about a third of this machine's streaming bandwidth at such shapes; the
kernel walks the weight in column panels with the rows in registers and prefetches the next
expert's weight while it computes one (docs/engine.md has the figures). Used by
`megatron_ext.elastic_moe.PlacedMoE` for every expert GEMM it runs in float32 on CPU (own
stack, borrowed stack, or a lone expert's weight), so an expert's output is the same bits on
every path; other dtypes and devices keep torch's kernels, and so does
`rollout.cpu_kernels: false`.

Each output element is one in-order sum over the inner dimension, one fused multiply-add per
term, so a row's result does not depend on which other rows share the GEMM (MKL's may: it
splits its work by the row count). The bits differ from MKL's in the last place.

**Decode attention** (`decode_attention`). One new token per request attends to its cached K/V
through the pool's lane views or gathered blocks: each key and value row is read once for the
query heads of its group (grouped-query attention without a copy), and only the request's own
positions are read (SDPA reads the batch's widest span and masks the rest). The softmax's
exponential is a polynomial of about one ulp; results agree with SDPA to ~1e-6 (float32), and a
request's result does not depend on the other requests. `flexfloor.rollout.engine` runs it for
decode-only steps in float32 on CPU.

The kernels are compiled on first use with the machine's C compiler (`$CC`, else `cc`; tuned for
this CPU with -march=native) into `$XDG_CACHE_HOME` (default ~/.cache)/flexfloor/kernels, named
by a hash of the source, the flags, the compiler and the CPU, and loaded with ctypes
(tools/setup_env.sh builds them ahead). Without a compiler every step runs on torch's kernels as
before, one warning says why, and `unavailable_reason()` keeps it (the engine prints it on
stderr, where a run that ignores warnings still shows it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-shared", "-fPIC")

_reason: Optional[str] = None  # why the kernels last failed to build or load (None: they did not)


def _unavailable(message: str, quiet: bool = False) -> None:
    """Keep why the kernels are not there (`unavailable_reason`), and warn unless `quiet`."""
    global _reason
    _reason = message
    if not quiet:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the
    platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "vendor_id"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def cache_dir() -> Path:
    """Where built kernels are kept: $XDG_CACHE_HOME (default ~/.cache)/flexfloor/kernels."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "flexfloor" / "kernels"


def _compiler_version(cc: list[str]) -> bytes:
    """`cc --version`'s first line: an upgraded compiler builds anew."""
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
        return (out.stdout.splitlines() or [""])[0].encode()
    except (OSError, subprocess.SubprocessError):
        return b""


def build(quiet: bool = False) -> Optional[Path]:
    """The compiled kernels' path, compiling them if this source, flags, compiler and CPU have
    none yet (atomically: concurrent ranks each write their own file and rename it). None, with a
    warning unless `quiet`, when they cannot be built."""
    cc = os.environ.get("CC") or "cc"
    command = shlex.split(cc)  # e.g. CC="ccache gcc"
    if not command or shutil.which(command[0]) is None:
        _unavailable(f"no C compiler ({cc!r}, from $CC or the default 'cc') on PATH: the CPU "
                     f"decode step runs on torch's kernels (slower at decode batch sizes); "
                     f"install gcc or set CC to build megatron_ext/csrc/cpu_kernels.c", quiet)
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), _compiler_version(command),
                                     " ".join(FLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    folder = cache_dir()
    lib = folder / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            subprocess.run([*command, *FLAGS, str(SOURCE), "-o", tmp], check=True,
                           capture_output=True, text=True, timeout=120)
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared cache out
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        _unavailable(f"could not build the CPU kernels with {cc!r} into {folder} "
                     f"({str(detail).strip()[:300]}): the CPU decode step runs on torch's "
                     f"kernels; fix the compiler or the folder ($XDG_CACHE_HOME), or set "
                     f"rollout.cpu_kernels: false", quiet)
        return None
    return lib


@functools.lru_cache(maxsize=None)
def _library():
    """The loaded kernels (functions by name), or None: not built, or not loadable (one warning
    says why)."""
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # e.g. a cache on a noexec mount, or a damaged file
        _unavailable(f"could not load the CPU kernels {path} ({e}): the CPU decode step runs on "
                     f"torch's kernels; remove the file to rebuild it, or point $XDG_CACHE_HOME "
                     f"elsewhere")
        return None
    P, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    gemm, attention = lib.ff_grouped_gemm, lib.ff_decode_attention
    gemm.restype = attention.restype = ctypes.c_int
    gemm.argtypes = [i32, i32, i32, i32, P, P, i64, P, P, P, i64]
    attention.argtypes = [i32, i32, i32, i32, i32, i32, P, i64, i64, P, P, i64, i64, i64, P, P,
                          f32, P, P]
    return {"gemm": gemm, "attention": attention}


def available() -> bool:
    """Whether the kernels are built and loaded."""
    return _library() is not None


def unavailable_reason() -> Optional[str]:
    """Why the kernels are not available (what the warning said), or None when they are."""
    return None if available() else _reason


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def handles(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w, offs)` runs the kernel: float32 CPU tensors x [R, K] and w
    [E, K, N], and the kernel built."""
    return (_float32_cpu(x, w) and x.dim() == 2 and w.dim() == 3 and w.shape[1] == x.shape[1]
            and available())


def _row_major(w: torch.Tensor) -> bool:
    """Whether each [K, N] of w [E, K, N] is stored row-major (the kernel's layout)."""
    K, N = w.shape[1], w.shape[2]
    return (N <= 1 or w.stride(2) == 1) and (K <= 1 or w.stride(1) == N)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
               after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`torch._grouped_mm(x, w, offs=offs)` for `handles(x, w)`: rows offs[e-1] .. offs[e]-1
    of x through w[e]; rows past offs[-1] are left unwritten (as torch's). `after`: a weight
    the next GEMM reads (its first expert is prefetched during the last expert). A w whose
    [K, N] are not row-major runs on a row-major copy made for this call (the same bits; the
    trainer's stacks are row-major: `flexfloor.model.stack_experts`)."""
    if not handles(x, w):
        raise ValueError(f"grouped_mm: x {tuple(x.shape)} {x.dtype} {x.device} and w "
                         f"{tuple(w.shape)} {w.dtype} {w.device}: float32 CPU tensors [R, K] and "
                         f"[E, K, N], and the kernels built (`available()`), are what it runs")
    E, K, N = w.shape
    x = x if x.is_contiguous() else x.contiguous()
    w = w if _row_major(w) else w.contiguous()
    if offs.dtype != torch.int32 or offs.device.type != "cpu" or not offs.is_contiguous():
        offs = offs.to(device="cpu", dtype=torch.int32).contiguous()
    if offs.numel() != E:
        raise ValueError(f"grouped_mm: {offs.numel()} offsets for {E} experts")
    out = x.new_empty(x.shape[0], N)
    pf, pf_bytes = None, 0
    if after is not None and after.device.type == "cpu" and after.dim() == 3:
        pf, pf_bytes = after.data_ptr(), after[0].numel() * after.element_size()
    if _library()["gemm"](E, x.shape[0], K, N, x.data_ptr(), w.data_ptr(), w.stride(0),
                          offs.data_ptr(), out.data_ptr(), pf, pf_bytes):
        raise ValueError(f"grouped_mm: offsets {offs.tolist()} must not decrease and must not "
                         f"pass the {x.shape[0]} rows")
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`F.linear(x, weight)` (weight [N, K], any strides) through the kernel, the same bits as
    the weight's rows in a stack; None where the kernel does not run (float32 CPU only)."""
    if not _float32_cpu(x, weight):
        return None
    w = weight.detach().t().unsqueeze(0)  # [1, K, N]; a row-major weight is copied by grouped_mm
    if not handles(x, w):
        return None
    offs = torch.tensor([x.shape[0]], dtype=torch.int32)
    return grouped_mm(x, w, offs)


def runs_attention(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `decode_attention(q, keys, ...)` runs the kernel: float32 CPU tensors, the head
    dimension contiguous, and the kernels built."""
    return (_float32_cpu(q, keys) and q.stride(-1) == 1 and keys.stride(-1) == 1
            and available())


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     lengths: torch.Tensor, scale: float,
                     rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one new token per request: q [B, heads, D]; keys and values [R, G, L, D]
    (any strides, the same for both, D contiguous; heads a multiple of G: grouped-query
    attention, query head h reads group h // (heads / G)); request b reads row rows[b] (default
    b) at positions 0 .. lengths[b]-1. Returns [B, heads, D] (contiguous), what
    `F.scaled_dot_product_attention` gives with the mask `position < lengths[b]` and
    `enable_gqa`, to ~1e-6."""
    if q.dim() != 3 or keys.dim() != 4:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and keys {tuple(keys.shape)}: "
                         f"[B, heads, D] and [R, G, L, D]")
    B, H, D = q.shape
    R, G, L, KD = keys.shape
    if not (_float32_cpu(q, keys, values) and q.stride(-1) == 1 and keys.stride(-1) == 1
            and available()):
        raise ValueError(f"decode_attention: q {q.dtype} {q.device} strides {q.stride()}, keys "
                         f"{keys.dtype} {keys.device} strides {keys.stride()}: float32 CPU "
                         f"tensors with the head dimension contiguous, and the kernels built "
                         f"(`runs_attention`), are what it runs")
    if values.shape != keys.shape or values.stride() != keys.stride():
        raise ValueError(f"decode_attention: values {tuple(values.shape)} strides "
                         f"{values.stride()} must match keys {tuple(keys.shape)} {keys.stride()}")
    if G < 1 or H % G or KD != D or lengths.shape != (B,):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"lengths {tuple(lengths.shape)}: heads must be a multiple of the groups, "
                         f"the head sizes equal, and one length per request")
    lengths = lengths.to(device="cpu", dtype=torch.int64).contiguous()
    if rows is not None:
        rows = rows.to(device="cpu", dtype=torch.int64).contiguous()
        if rows.shape != (B,):
            raise ValueError(f"decode_attention: rows {tuple(rows.shape)}: one per request ({B})")
    out = q.new_empty(B, H, D)
    scratch = q.new_empty(max(1, H // G * L))
    rc = _library()["attention"](B, R, H, G, D, L, q.data_ptr(), q.stride(0), q.stride(1),
                                 keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                 keys.stride(1), keys.stride(2),
                                 None if rows is None else rows.data_ptr(), lengths.data_ptr(),
                                 scale, out.data_ptr(), scratch.data_ptr())
    if rc == -1:
        raise ValueError(f"decode_attention: lengths {lengths.tolist()} must be 1 .. {L} "
                         f"(the keys' positions)")
    if rc == -2:
        raise ValueError(f"decode_attention: rows {None if rows is None else rows.tolist()} "
                         f"must name one of the {R} rows of keys for each of {B} requests")
    return out
