"""Where the router's tokenizer comes from (for requests that carry text, not token ids).

Each worker's tokenizer is, in this order: its own ``tokenizer`` key (a Hugging Face name or a
local directory), the config's top-level ``tokenizer``, or, for a ``kvpool`` worker with an
``http_base_url``, the worker's own: ``kvpool serve`` answers ``GET /v1/tokenizer`` with its
tokenizer's files (``{"model", "files": {name: base64}}``), which the router loads from a
temporary directory. A router routes one model's requests, so these must be one tokenizer: the
configured ones are all loaded, the served one is fetched from the first ``kvpool`` worker that
answers, and their fingerprints (the tokenizer's JSON and chat template) must agree.

:meth:`TokenizerSources.encoder` loads on first use (loading and fetching never on the event
loop: ``transformers`` in the given thread pool) and keeps the result, frozen out of the
cyclic collector (``gc.freeze``) as the router's start-up state is. A failure is not kept:
a worker that did not answer, a load that failed, is tried again on the next request (at most
once per :data:`RETRY_S`), so a router started before its workers serves text once one is up.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gc
import hashlib
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path, PurePosixPath
from typing import Any, Final

from aiohttp import ClientError, ClientSession, ClientTimeout

from kvpool.errors import ConfigError, KVPoolError
from kvpool.router.config import ServiceConfig, WorkerKind
from kvpool.router.tokenize import TextEncoder

__all__ = ["RETRY_S", "TOKENIZER_PATH", "TokenizerSources", "TokenizerUnavailableError",
           "load_tokenizer", "tokenizer_from_files"]

TOKENIZER_PATH: Final = "/v1/tokenizer"
RETRY_S: Final = 1.0
_FETCH_TIMEOUT_S: Final = 30.0


class TokenizerUnavailableError(KVPoolError):
    """No tokenizer could be had for text requests: none is configured and no worker sent
    one, one failed to load, or the workers' tokenizers differ (the service's 503)."""


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` (blocking); TokenizerUnavailableError when it fails."""
    try:
        from transformers import AutoTokenizer
    except ImportError:  # pragma: no cover - the engine extra is missing
        raise TokenizerUnavailableError(
            "tokenizing text needs transformers: pip install 'kvpool[engine]'"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:  # transformers raises many kinds: all are this source's failure
        raise TokenizerUnavailableError(
            f"cannot load the tokenizer {name_or_path!r}: {exc}"
        ) from None


def tokenizer_from_files(files: dict[str, bytes]) -> Any:
    """A tokenizer from the files ``GET /v1/tokenizer`` sent (blocking)."""
    with tempfile.TemporaryDirectory(prefix="kvpool-tokenizer-") as tmp:
        for name, data in files.items():
            Path(tmp, name).write_bytes(data)
        return load_tokenizer(tmp)


def fingerprint(tokenizer: Any) -> str:
    """What makes two tokenizers encode alike: the tokenizer's JSON and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    h.update(b"\0" + str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def _decode_files(payload: object, url: str) -> dict[str, bytes]:
    files = payload.get("files") if isinstance(payload, dict) else None
    if not isinstance(files, dict) or not files:
        raise TokenizerUnavailableError(f"{url}: no 'files' object in the answer")
    out: dict[str, bytes] = {}
    for name, data in files.items():
        path = PurePosixPath(name)
        if len(path.parts) != 1 or name in (".", "..") or not isinstance(data, str):
            raise TokenizerUnavailableError(f"{url}: bad file entry {name!r}")
        try:
            out[name] = base64.b64decode(data, validate=True)
        except binascii.Error:
            raise TokenizerUnavailableError(f"{url}: file {name!r} is not base64") from None
    return out


class TokenizerSources:
    """The tokenizer text requests are encoded with; see the module docstring.

    ``session``: a callable giving the aiohttp session to fetch with (the proxy's);
    ``executor``: where loading runs.
    """

    def __init__(self, config: ServiceConfig, session: Callable[[], ClientSession | None],
                 executor: Executor) -> None:
        self.configured: dict[str, list[str]] = {}  # name or path -> worker ids
        self.served: list[tuple[str, str]] = []  # (worker id, base url) that serve theirs
        for w in config.workers:
            source = w.tokenizer or config.tokenizer
            if source is not None:
                self.configured.setdefault(source, []).append(w.id)
            elif w.kind is WorkerKind.KVPOOL and w.http_base_url is not None:
                self.served.append((w.id, w.http_base_url))
        self._session = session
        self._executor = executor
        self._encoder: TextEncoder | None = None
        self._loading: asyncio.Task[TextEncoder] | None = None
        self._failed_at = -RETRY_S
        self._failure: TokenizerUnavailableError | None = None
        self.loads = 0

    @property
    def any(self) -> bool:
        """Whether any worker has a tokenizer source at all."""
        return bool(self.configured or self.served)

    @property
    def loaded(self) -> TextEncoder | None:
        return self._encoder

    def invalidate(self) -> None:
        """Forget the tokenizer: the next text request loads it again."""
        self._encoder = None

    async def encoder(self) -> TextEncoder:
        """The encoder, loaded once; TokenizerUnavailableError when it cannot be had now."""
        if self._encoder is not None:
            return self._encoder
        if not self.any:
            raise TokenizerUnavailableError(
                "no tokenizer for text requests: set 'tokenizer' in the router config (a "
                "Hugging Face name or a local directory), or use kvpool workers with an "
                "http_base_url, or send token ids"
            )
        if self._loading is None:
            if self._failure is not None and time.monotonic() - self._failed_at < RETRY_S:
                raise self._failure
            self._loading = asyncio.ensure_future(self._load())
        loading = self._loading
        try:
            encoder = await asyncio.shield(loading)
        except TokenizerUnavailableError as exc:
            self._failure, self._failed_at = exc, time.monotonic()
            raise
        finally:
            if loading.done() and self._loading is loading:
                self._loading = None
        self._encoder = encoder
        # transformers and the tokenizer add ~330,000 objects (SmolLM2's) after the router
        # froze its start-up state (commands/router.settle_gc): each full collection would
        # walk them (~180 ms) for as long as the router runs; they live as long, so frozen too
        gc.freeze()
        return encoder

    async def _load(self) -> TextEncoder:
        loop = asyncio.get_running_loop()
        found: list[tuple[str, Sequence[str], Any]] = []
        for source, workers in self.configured.items():
            tok = await loop.run_in_executor(self._executor, load_tokenizer, source)
            found.append((source, workers, tok))
        if self.served:
            fetched = await self._fetch_first()
            if fetched is None and not found:
                ids = ", ".join(w for w, _ in self.served)
                raise TokenizerUnavailableError(
                    f"no worker sent its tokenizer ({TOKENIZER_PATH}) yet: tried {ids}"
                )
            if fetched is not None:
                found.append(fetched)
        prints = await loop.run_in_executor(
            self._executor, lambda: [fingerprint(tok) for _, _, tok in found])
        if len(set(prints)) > 1:
            named = "; ".join(f"{src} for {', '.join(ws)}" for src, ws, _ in found)
            raise TokenizerUnavailableError(
                f"the workers' tokenizers differ ({named}): one router routes one model's "
                "text requests"
            )
        tokenizer = found[0][2]
        encoder = await loop.run_in_executor(self._executor, TextEncoder, tokenizer)
        self.loads += 1
        return encoder

    async def _fetch_first(self) -> tuple[str, Sequence[str], Any] | None:
        session = self._session()
        if session is None:
            raise ConfigError("the proxy's HTTP session is not started")
        loop = asyncio.get_running_loop()
        for worker_id, base in self.served:
            url = base + TOKENIZER_PATH
            try:
                async with session.get(url, timeout=ClientTimeout(total=_FETCH_TIMEOUT_S)) as r:
                    if r.status != 200:
                        continue
                    payload = await r.json(content_type=None)
                files = _decode_files(payload, url)
                tok = await loop.run_in_executor(self._executor, tokenizer_from_files, files)
            except (ClientError, TimeoutError, ValueError, TokenizerUnavailableError):
                continue
            return url, [worker_id], tok
        return None
