"""What one HTTP service accepts: body size, open connections, and how long a client may take.

:class:`HttpLimits` is built from ``kvpool router``'s ``listen`` section or ``kvpool serve``'s
flags. The connection cap keeps the process below its open-file limit (``RLIMIT_NOFILE``), so
``accept()`` never fails for want of descriptors and ``/health`` keeps answering while slow
clients hold connections: past the cap a new connection gets a JSON 503 and is closed.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Final

from kvpool.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_KEEPALIVE_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_PROMPT_TOKENS",
    "HttpLimits",
    "descriptor_budget",
]

MAX_PROMPT_TOKENS: Final = 1 << 20
"""The longest prompt the default body limit is sized for (1 Mi tokens, the longest context
of today's models)."""
DEFAULT_MAX_BODY_BYTES: Final = -(-(MAX_PROMPT_TOKENS * 9 + (64 << 10)) // (1 << 20)) << 20
"""10 MiB: :data:`MAX_PROMPT_TOKENS` token ids of 7 digits written as JSON (``1234567, ``,
9 bytes each) plus 64 KiB for the rest of the body, rounded up to whole MiB."""
DEFAULT_KEEPALIVE_TIMEOUT_S: Final = 30.0
"""An open connection with no request in progress (idle between requests, or its request
line and headers not all in yet) is closed after this long."""
DEFAULT_BODY_TIMEOUT_S: Final = 60.0
"""A request's whole body must arrive within this long after its headers (408 otherwise)."""
_SPARE_DESCRIPTORS: Final = 4
"""The open-file limit is divided so: 3 parts of 4 for client connections, the rest for the
process's own files and sockets (models, event sockets, proxied connections)."""
_UNLIMITED_CONNECTIONS: Final = 65536


def descriptor_budget() -> int:
    """The most client connections the open-file limit leaves room for: three quarters of the
    soft ``RLIMIT_NOFILE`` (768 at the common 1,024)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > _UNLIMITED_CONNECTIONS * 2:
        return _UNLIMITED_CONNECTIONS
    return max(1, soft - soft // _SPARE_DESCRIPTORS)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The limits of one service's request boundary.

    Attributes:
        max_body_bytes: the largest request body accepted (413 past it, at once when the
            ``Content-Length`` says so).
        max_connections: open client connections at most (None: :func:`descriptor_budget`);
            a connection past it gets a JSON 503 and is closed.
        keepalive_timeout_s: an idle connection, or one whose request head is still not all
            in, is closed after this long.
        body_timeout_s: the whole body must arrive within this long after the head (408).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int | None = None
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise InvalidArgumentError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_connections is not None and self.max_connections < 1:
            raise InvalidArgumentError(
                f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("keepalive_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value}")

    def connection_cap(self) -> int:
        """The cap in force: ``max_connections``, never above :func:`descriptor_budget`."""
        budget = descriptor_budget()
        return budget if self.max_connections is None else min(self.max_connections, budget)
