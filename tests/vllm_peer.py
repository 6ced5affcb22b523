"""vLLM 0.33's own offloading code for the integration tests: installed with
``tests/peers/install_vllm.sh VENV`` (``.ci/run`` does). Tests skip without it, unless ``CI`` is
set: there a missing vLLM is a failure."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

INSTALL = "tests/peers/install_vllm.sh .venv"


def vllm_module(name: str) -> ModuleType:
    """Import vLLM's module ``name``; skips (or fails, in CI) the calling test without vLLM."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        message = f"vLLM 0.33's offloading modules are not installed ({exc}); run {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message, allow_module_level=True)
