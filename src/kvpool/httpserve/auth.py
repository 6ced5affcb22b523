"""Bearer-token authentication, the same for both services: the token is the value of an
environment variable whose *name* the configuration gives (``listen.auth_token_env`` of
``kvpool router``, ``--auth-token-env`` of ``kvpool serve``), so it stays out of files and
command lines. Compared as bytes in constant time; a header that is not valid UTF-8 is
compared as the bytes it was sent as (aiohttp keeps them as surrogate escapes), never
refused with an error of its own."""

from __future__ import annotations

import hmac
import os

from kvpool.errors import ConfigError

__all__ = ["authorized", "bearer_token"]


def bearer_token(variable: str | None, *, option: str) -> bytes | None:
    """The token held by the environment variable ``variable`` (None: no auth). ``option``
    names the setting in the error raised when the variable is unset or empty."""
    if variable is None:
        return None
    token = os.environ.get(variable, "").strip()
    if not token:
        raise ConfigError(
            f"{option}: the environment variable {variable!r} is not set or empty"
        )
    return token.encode("utf-8", "surrogateescape")


def authorized(header: str, token: bytes) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <token>``."""
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        sent = given.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte: not what was configured
        return False
    return hmac.compare_digest(sent, token)
