"""The torch device a storage runs on, and the single-threaded torch of its copy workers."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from kvpool.errors import StorageError

if TYPE_CHECKING:
    import torch

__all__ = ["resolve_device", "serial_torch_thread", "thread_local_torch_threads"]


@cache
def thread_local_torch_threads() -> bool:
    """Whether ``torch.set_num_threads`` in one thread leaves the others alone (OpenMP only):
    without it, copy workers could not run single-threaded, so none are used."""
    import torch

    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def serial_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)  # thread-local under OpenMP: the caller's threads are untouched


def resolve_device(device: object) -> torch.device:
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise StorageError(f"device {device!r} is not a torch device: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise StorageError(f"device {device!r} asks for CUDA, which is not available")
        if resolved.index is None:  # streams and events need a concrete device
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise StorageError(f"device {device!r} is not supported (use 'cpu' or 'cuda[:N]')")
    return resolved
