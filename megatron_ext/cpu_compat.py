"""CPU/gloo shims for Megatron-Core, applied only when CUDA is absent.

Megatron-Core assumes a CUDA device in a handful of places that the MoE layers, the legacy
inference engine, the optimizer and dist-checkpointing reach on CPU. Each shim below names the
Megatron-Core 0.16.1 site it covers (module:line). This is the only module in FlexFloor that
patches Megatron-Core; everything else uses it as shipped.

`apply()` is idempotent and a no-op when `torch.cuda.is_available()`: GPU runs get the real code
paths (NCCL, CUDA streams, transformer-engine) untouched. One shim acts at import instead
(`_EagerJitFuser`, installed when this module is imported, before any Megatron-Core import):
Megatron-Core's `jit_fuser` is its own no-op decorator on CPU, not `torch.compile`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

import torch

_lock = threading.Lock()
_applied: list[str] = []


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def applied_shims() -> list[str]:
    """Names of the shims this process applied (empty on a CUDA machine)."""
    return list(_applied)


def apply() -> list[str]:
    """Apply every shim once. Returns the names applied (empty when CUDA is present)."""
    with _lock:
        if _applied or not cuda_absent():
            return list(_applied)
        for name, shim in _SHIMS:
            shim()
            _applied.append(name)
        return list(_applied)


# --------------------------------------------------------------------------------------------
# helpers


class _DummyStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return self

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_device(device):
    """Map a CUDA device spec ('cuda', 'cuda:0', torch.device('cuda'), an int) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _CpuFactoryTorch:
    """A view of the `torch` module whose tensor factories put `device='cuda'` tensors on the CPU.

    Installed as the `torch` name of a few Megatron modules only (optimizer, clip_grads, utils,
    dist-checkpointing saver), so the rest of the process keeps the real module.
    """

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like")

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name in self._FACTORIES:

            def factory(*args, _f=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _f(*args, **kwargs)

            return factory
        return attr


def _install_cpu_factory_torch(module_name: str) -> None:
    module = importlib.import_module(module_name)
    if not isinstance(module.torch, _CpuFactoryTorch):
        module.torch = _CpuFactoryTorch(torch)


# --------------------------------------------------------------------------------------------
# the shims


class _EagerJitFuser(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """0. jit.py:21 sets `jit_fuser = torch.compile`, and dozens of functions are decorated
    with it as Megatron-Core imports (fused_bias_geglu.py:16 first): that alone pulls in
    TorchDynamo and Inductor, seconds of CPU in every process that imports Megatron-Core (each
    worker, each restart), and the one such function our model calls (router.py:531
    `_apply_expert_bias`, a no-op without expert bias) is then traced by Dynamo at its first
    call. Every fusion is off in our model config (flexfloor/model.py), so on CPU
    `megatron.core.jit` is loaded as shipped and then switched to its own `noop_decorator`
    (its `disable_jit_fuser()`) before any module decorates with it: the same eager math."""

    _MODULE = "megatron.core.jit"

    def find_spec(self, name, path, target=None):
        if name != self._MODULE or not cuda_absent():
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        self._shipped = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._shipped.create_module(spec)

    def exec_module(self, module):
        self._shipped.exec_module(module)
        module.disable_jit_fuser()


def _install_eager_jit_fuser() -> None:
    if "megatron.core.jit" not in sys.modules and not any(
            isinstance(f, _EagerJitFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerJitFuser())


_install_eager_jit_fuser()


def _shim_cuda_streams() -> None:
    # 1. token_dispatcher.py:445 `MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()`
    #    and 7-8. text_generation_controller.py:1163,1337 `torch.cuda.Event(enable_timing=True)`.
    torch.cuda.Stream = _DummyStream  # type: ignore[misc]
    torch.cuda.Event = _DummyStream  # type: ignore[misc]
    # 2. token_dispatcher.py:871-895 `torch.cuda.current_stream()` / `torch.cuda.stream(s)`, and
    #    filesystem_async.py:230 `torch.cuda.synchronize()` in the checkpoint writer.
    torch.cuda.current_stream = lambda device=None: _DUMMY_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


_DUMMY_STREAM = _DummyStream()


def _shim_current_device() -> None:
    # 3. `torch.cuda.current_device()` used as a device: rotary_pos_embedding.py:78,162,297,
    #    moe/router.py:90-198, utils.py:631, tensor_parallel/mappings.py:91-442, attention.py:430,
    #    state_dict_saver.py:252, optimizer.py:1141.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


def _shim_split_sizes_numpy() -> None:
    # 4. moe_utils.py:1093 `maybe_move_tensor_to_cpu(as_numpy=True)` converts only CUDA tensors,
    #    so the alltoall dispatcher's split sizes stay tensors and gloo's all_to_all_single raises
    #    TypeError. On CPU, hand back numpy as the CUDA path does.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original: Callable = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _shim_te_general_gemm() -> None:
    # 5. moe_utils.py:1192 reads `te_general_gemm`, which is only defined when transformer-engine
    #    imports (NameError without it).
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _shim_tensor_cuda() -> None:
    # 9. text_generation_controller.py:1067 and language_module.py:244 call `Tensor.cuda()`.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]


def _shim_causal_mask() -> None:
    # 10. transformer/utils.py:35,40 build the default causal masks with device="cuda";
    #     fused_softmax.py:8 imports get_default_causal_mask by name.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _shim_cuda_tensor_factories() -> None:
    # 11. `device='cuda'` tensor factories: optimizer/optimizer.py:473,481,485,907,
    #     optimizer/clip_grads.py:90,103,115,174,207, core/utils.py:1207 (local l2 norm),
    #     dist_checkpointing/strategies/state_dict_saver.py:204.
    for name in (
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.utils",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    ):
        _install_cpu_factory_torch(name)


def _shim_clip_grad_type_assert() -> None:
    # 12. clip_grads.py:167 asserts `param.grad.type() == 'torch.cuda.FloatTensor'` before scaling;
    #     optimizer.py:50 imports the function by name. Same math, CPU tensors allowed.
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = []
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
                grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


_SHIMS: list[tuple[str, Callable[[], None]]] = [
    ("cuda_streams", _shim_cuda_streams),
    ("current_device", _shim_current_device),
    ("split_sizes_numpy", _shim_split_sizes_numpy),
    ("te_general_gemm", _shim_te_general_gemm),
    ("tensor_cuda", _shim_tensor_cuda),
    ("causal_mask", _shim_causal_mask),
    ("cuda_tensor_factories", _shim_cuda_tensor_factories),
    ("clip_grad_type_assert", _shim_clip_grad_type_assert),
]

__all__ = ["apply", "applied_shims", "cuda_absent"]
