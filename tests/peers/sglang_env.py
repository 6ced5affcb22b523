"""Import SGLang 0.5.23's own HiCache code on a CPU-only machine, for kvpool's tests.

``tests/peers/install_sglang.sh VENV`` installs the ``sglang`` wheel (``--no-deps``) and the
few packages its storage and host-pool modules import. One third-party dependency cannot be
installed from PyPI for a CPU build of torch: SGLang's ``sglang.srt.configs`` imports
``torchvision`` (for vision-model preprocessors) at import time, and PyPI's torchvision wheels
are CUDA builds that fail to load against the CPU torch ("operator torchvision::nms does not
exist"). :func:`install_torchvision_shim` serves every ``torchvision`` import with an inert
placeholder module, and only when no working torchvision is installed. No HiCache code path
calls torchvision. Nothing of SGLang itself is replaced: every SGLang module the tests use is
SGLang's own file from the installed wheel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__all__ = ["install_torchvision_shim"]


class _AnyAttribute(type):
    """Placeholder classes answer any attribute with another placeholder (an enum member such
    as ``InterpolationMode.BICUBIC`` that a module reads at import time)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttribute(name, (_Placeholder,), {})


class _Placeholder(metaclass=_AnyAttribute):
    """Any attribute of the shim: a class that can be named, subclassed and built, never used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision is not installed (kvpool's test shim)")


class _ShimModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttribute(name, (_Placeholder,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _ShimModule(spec.name)
        module.__path__ = []
        module.__file__ = "<kvpool test shim for torchvision>"
        if spec.name == "torchvision":
            module.__version__ = "0.0.0+kvpool-shim"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_torchvision_shim() -> None:
    """Serve ``torchvision`` imports with the shim unless a working torchvision imports."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    sys.meta_path.insert(0, _Finder())


def host_pool(layout: str = "page_first", *, layers: int = 2, heads: int = 2, head_dim: int = 8,
              page_size: int = 4, device_tokens: int = 64, ratio: float = 2.0) -> Any:
    """SGLang's own CPU host pool (``MHATokenToKVPoolHost``, bfloat16) over a small CPU
    "device" pool, as SGLang builds it from a device pool's ``MHABufferInfo``."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    def side() -> list[Any]:
        return [torch.zeros(device_tokens, heads, head_dim, dtype=torch.bfloat16)
                for _ in range(layers)]

    k, v = side(), side()
    info = MHABufferInfo(
        buffers=KVBuffers(k=tuple(k), v=tuple(v),
                          k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=torch.bfloat16, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=device_tokens,
                                start_layer=0, end_layer=layers)
    pool._kvpool_device_buffers = (k, v)  # keep the "device" tensors alive with the pool
    return pool


def storage_config(extra: dict[str, Any], *, layout: str = "page_first", tp_rank: int = 0,
                   tp_size: int = 1, model: str = "test/model", metrics: bool = True,
                   mla: bool = False) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for kvpool's backend loaded dynamically (with the
    zero-copy interface), plus ``extra``'s kvpool options."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first", model_name=model,
        extra_config={"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
                      "class_name": "KvpoolHiCacheStorage", "interface_v1": 1, **extra})


def create(extra: dict[str, Any], pool: Any, **kwargs: Any) -> Any:
    """kvpool's storage as SGLang's ``HiCacheController.attach_storage_backend`` makes it:
    the factory's dynamic loader, then ``register_mem_pool_host``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra, layout=pool.layout, **kwargs), pool)
    backend.register_mem_pool_host(pool)
    return backend


def mla_host_pool(layout: str = "page_first", *, layers: int = 2, kv_lora_rank: int = 16,
                  rope_dim: int = 8, page_size: int = 4, device_tokens: int = 64,
                  ratio: float = 2.0) -> Any:
    """SGLang's own CPU MLA host pool (``MLATokenToKVPoolHost``, bfloat16): one latent row
    (``kv_lora_rank + rope_dim``) per token and layer, the same on every TP rank."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dim = kv_lora_rank + rope_dim
    rows = tuple(torch.zeros(device_tokens, 1, dim, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows, data_ptrs=torch.tensor([b.data_ptr() for b in rows]),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=dim,
        dtype=torch.bfloat16, device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=device_tokens,
                                start_layer=0, end_layer=layers, target_layer_num=layers)
    pool._kvpool_device_buffers = rows
    return pool
