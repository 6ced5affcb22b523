"""kvpool inside other engines: tiers and eviction policies they load by module path.

- :mod:`kvpool.integrations.vllm`: a vLLM secondary offloading tier (``KvpoolTier``) on
  kvpool's persistent disk tier and shared remote store, and vLLM ``CachePolicy`` classes on
  kvpool's eviction policies (S3-FIFO, 2Q, ARC).
- :mod:`kvpool.integrations.sglang`: an SGLang HiCache storage backend (``KvpoolHiCacheStorage``)
  on kvpool's disk tier and shared remote store.

The engines are not kvpool dependencies: importing :mod:`kvpool` or this package never imports
them. A module that needs an engine imports it when it is itself imported and raises
:class:`IntegrationUnavailableError` (an ``ImportError``) naming what to install when the
engine is missing or of another version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from kvpool.errors import KVPoolError

__all__ = ["IntegrationUnavailableError", "require"]


class IntegrationUnavailableError(KVPoolError, ImportError):
    """An integration module needs an engine (vLLM, SGLang) that is not installed, or is of a
    version it was not written for."""


def require(distribution: str, module: str, versions: tuple[str, ...], what: str) -> str:
    """The installed version of ``distribution`` (whose top-level module is ``module``);
    :class:`IntegrationUnavailableError` when it is missing or its version starts with none of
    ``versions``. ``what`` names the integration in the message."""
    try:
        found = importlib.util.find_spec(module) is not None
        version = importlib.metadata.version(distribution) if found else None
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        version = None
    if version is None:
        raise IntegrationUnavailableError(
            f"{what} needs {distribution} {' or '.join(versions)} installed in this "
            f"environment (it is not a kvpool dependency): pip install "
            f"'{distribution}=={versions[0]}.*'"
        )
    if not any(version == v or version.startswith(v + ".") for v in versions):
        raise IntegrationUnavailableError(
            f"{what} was written for {distribution} {' or '.join(versions)}, but "
            f"{distribution} {version} is installed"
        )
    return version
