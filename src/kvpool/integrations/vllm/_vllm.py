"""The vLLM versions these modules were written against, checked when one is imported: a
missing or other vLLM raises :class:`~kvpool.integrations.IntegrationUnavailableError`."""

from __future__ import annotations

from typing import Final

from kvpool.integrations import IntegrationUnavailableError, require

__all__ = ["VLLM_VERSION", "VLLM_VERSIONS", "import_failed"]

VLLM_VERSIONS: Final = ("0.33",)

VLLM_VERSION: Final = require("vllm", "vllm", VLLM_VERSIONS, "kvpool.integrations.vllm")


def import_failed(exc: ImportError) -> IntegrationUnavailableError:
    """The error for a vLLM module that is installed but does not import."""
    return IntegrationUnavailableError(
        f"vllm {VLLM_VERSION} is installed but its offloading modules do not import ({exc}); "
        "they need a few of vLLM's dependencies (kvpool's tests/peers/install_vllm.sh lists "
        "and installs them)"
    )
