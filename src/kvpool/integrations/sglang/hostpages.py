"""Zero-copy views of the pages of SGLang's host KV pool (``HostKVCache``), and the namespace
that says which pages may be exchanged.

A page is where SGLang's own zero-copy backends find it: ``get_page_buffer_meta(indices)``
gives, per page, the address and size of each contiguous run of its bytes in the pool's
``kv_buffer`` (an MHA page in the ``page_first`` layout: its K run and its V run; in
``layer_first``: one K and one V run per layer). The runs of a page are ordered by address,
which is the order of SGLang's flat data page (``get_data_page(index, flat=True)``), so the
bytes stored by ``batch_set_v1`` and by ``batch_set`` are the same and either interface reads
what the other wrote. Each run becomes a ``memoryview`` into ``kv_buffer``, bounds-checked
against it: reads land in the host pool and writes leave from it, with no copy in between.

:func:`page_namespace` describes everything that makes two processes' pages interchangeable:
the model (SGLang's storage model name and the operator's ``namespace``), the KV layout (host
pool class, layout, dtype, page size, bytes and runs per page, layers, heads, head dim) and
the shard (tensor-, pipeline- and context-parallel rank and size; an MLA model's KV is the same
on every tensor-parallel rank, so it leaves the TP rank out).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from kvpool.errors import StorageError
from kvpool.tiers.remote.namespace import RemoteNamespace

__all__ = ["HostPages", "page_keys", "page_namespace"]

_FORMAT = 1


class HostPages:
    """The pages of one SGLang host pool as runs of ``memoryview`` (module docstring)."""

    def __init__(self, host_pool: Any) -> None:
        import torch

        buffer = getattr(host_pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" \
                or not buffer.is_contiguous():
            raise StorageError(
                f"kvpool storage needs a host pool with one contiguous CPU kv_buffer; "
                f"{type(host_pool).__name__} has {type(buffer).__name__}")
        if not hasattr(host_pool, "get_page_buffer_meta"):
            raise StorageError(f"{type(host_pool).__name__} has no get_page_buffer_meta")
        self.pool = host_pool
        self.page_size = int(host_pool.page_size)
        self._base = buffer.view(torch.uint8).reshape(-1).numpy().data.cast("B")
        self._addr = int(buffer.data_ptr())
        self._torch = torch
        first = self._runs_meta(torch.arange(self.page_size, dtype=torch.int64))
        sizes = {size for _, size in first[0]}
        if len(sizes) != 1:
            raise StorageError(
                f"{type(host_pool).__name__}: a page's runs differ in size ({sorted(sizes)}); "
                "kvpool storage needs runs of one size")
        self.segments = len(first[0])
        self.run_bytes = sizes.pop()
        self.page_bytes = self.segments * self.run_bytes

    def _runs_meta(self, indices: Any) -> list[list[tuple[int, int]]]:
        """Per page of ``indices`` (token indices, whole pages), its runs (offset, size)
        ordered by address."""
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        n = len(indices) // self.page_size
        if n == 0 or len(ptrs) % n:
            raise StorageError(f"get_page_buffer_meta gave {len(ptrs)} runs for {n} pages")
        per = len(ptrs) // n
        pages = []
        for p in range(n):
            runs = sorted((int(a) - self._addr, int(s))
                          for a, s in zip(ptrs[p * per:(p + 1) * per],
                                          sizes[p * per:(p + 1) * per], strict=True))
            pages.append(runs)
        return pages

    def runs(self, host_indices: Any, pages: int) -> list[list[memoryview]]:
        """The runs of the first ``pages`` pages of ``host_indices`` (a tensor of token
        indices, ``page_size`` per page) as views into the pool; StorageError when the
        indices do not cover that many pages or leave the pool."""
        need = pages * self.page_size
        if host_indices is None or int(host_indices.numel()) < need:
            got = None if host_indices is None else int(host_indices.numel())
            raise StorageError(f"{pages} pages need {need} host indices, got {got}")
        if pages == 0:
            return []
        indices = host_indices[:need].to(device="cpu", dtype=self._torch.int64)
        base = self._base
        out = []
        for page in self._runs_meta(indices):
            views = []
            for off, size in page:
                if off < 0 or off + size > base.nbytes or size != self.run_bytes:
                    raise StorageError(f"a page run [{off}, {off + size}) leaves the host pool "
                                       f"({base.nbytes} bytes)")
                views.append(base[off:off + size])
            out.append(views)
        return out

    def split(self, flat: Any) -> list[memoryview]:
        """A flat page tensor (SGLang's ``get_dummy_flat_data_page`` shape) as runs."""
        if not isinstance(flat, self._torch.Tensor) or not flat.is_contiguous() \
                or flat.device.type != "cpu":
            raise StorageError("a page tensor must be a contiguous CPU tensor")
        view = flat.view(self._torch.uint8).reshape(-1).numpy().data.cast("B")
        if view.nbytes != self.page_bytes:
            raise StorageError(f"a page tensor holds {view.nbytes} bytes; pages are "
                               f"{self.page_bytes}")
        size = self.run_bytes
        return [view[i * size:(i + 1) * size] for i in range(self.segments)]


def page_namespace(config: Any, pages: HostPages, *, model: str, extra: str) -> RemoteNamespace:
    """The namespace of the pages of ``pages`` under SGLang's ``HiCacheStorageConfig``
    (module docstring)."""
    pool = pages.pool
    replicated = bool(config.is_mla_model)
    shard: dict[str, object] = {
        "pp": [config.pp_rank, config.pp_size],
        "cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [getattr(config, "dcp_rank", 0), getattr(config, "dcp_size", 1)],
    }
    if not replicated:
        shard["tp"] = [config.tp_rank, config.tp_size]
    doc = {
        "format": _FORMAT,
        "engine": "sglang",
        "hash_algo": "v2_sha256",
        "model": model,
        "namespace": extra,
        "pool": type(pool).__name__,
        "layout": str(getattr(pool, "layout", "")),
        "dtype": str(getattr(pool, "dtype", "")),
        "page_size": pages.page_size,
        "page_bytes": pages.page_bytes,
        "runs": pages.segments,
        "layers": int(getattr(pool, "layer_num", 0)),
        "heads": int(getattr(pool, "head_num", 0)),
        "head_dim": int(getattr(pool, "head_dim", 0) or getattr(pool, "kv_lora_rank", 0)),
        "mla": replicated,
        "shard": shard,
    }
    return RemoteNamespace.from_description(json.dumps(doc, sort_keys=True,
                                                       separators=(",", ":")))


def page_keys(keys: Sequence[str]) -> list[bytes]:
    """kvpool's 32-byte key of each SGLang page key (sha256 of its text)."""
    return [hashlib.sha256(b"sglang-page\0" + k.encode()).digest() for k in keys]
