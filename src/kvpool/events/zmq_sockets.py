"""What both ends of kvpool's ZeroMQ event transport share: the protocol's constants and the
process's one ZeroMQ context, sockets made and bound with typed errors. The protocol is
described in :mod:`kvpool.events.zmq`.
"""

from __future__ import annotations

from typing import Any, Final

import zmq

from kvpool.errors import TransportError

__all__ = [
    "END_SEQ",
    "MAX_SEQ",
    "MAX_SOCKETS",
    "PROBE_SEQ",
    "SNAPSHOT_REQUEST",
    "bind",
    "new_socket",
    "shared_context",
]

END_SEQ: Final = b"\xff" * 8
"""The seq frame of the replay end marker (-1 as a signed 8-byte big-endian int)."""

SNAPSHOT_REQUEST: Final = b"kvpool-snapshot"
"""The replay request for a snapshot (a kvpool publisher's addition)."""

PROBE_SEQ: Final = (1 << 63).to_bytes(8, "big")  # past anything a publisher buffers
MAX_SEQ: Final = (1 << 63) - 1  # seqs are signed 8-byte ints on the wire (END_SEQ is -1)
MAX_SOCKETS: Final = 16_384  # per context, when kvpool makes its first socket


def shared_context() -> zmq.Context[Any]:
    """The process's shared ZeroMQ context, its socket limit raised.

    A publisher takes 6 sockets and a subscriber 2; ZeroMQ's default of 1,023 sockets per
    context would stop a process (a replay of a large cluster, a router of many engines) at
    about 127 publishers. ZeroMQ applies the limit only before the context's first socket, so
    this takes effect when kvpool is the first to use the shared context (it usually is).
    """
    ctx: zmq.Context[Any] = zmq.Context.instance()
    if ctx.get(zmq.MAX_SOCKETS) < MAX_SOCKETS:
        ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
    return ctx


def new_socket(ctx: zmq.Context[Any], kind: int, made: list[zmq.Socket[Any]]) -> zmq.Socket[Any]:
    """A new socket with no linger (appended to ``made``); TransportError past the limits."""
    try:
        sock: zmq.Socket[Any] = ctx.socket(kind)
    except zmq.ZMQError as exc:
        raise TransportError(
            f"cannot create a ZeroMQ socket ({exc}): the shared context's socket limit or the "
            f"process's file descriptors ran out (a publisher uses 6 sockets, a subscriber 2; "
            f"the limit is raised to {MAX_SOCKETS} only when kvpool creates the context's "
            f"first socket)"
        ) from None
    sock.setsockopt(zmq.LINGER, 0)
    made.append(sock)
    return sock


def _bind_address(endpoint: str) -> str:
    # libzmq spells "any free port" as "*"; port 0 is the spelling everyone else uses.
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-1] + "*"
    return endpoint


def bind(socket: zmq.Socket[Any], endpoint: str) -> str:
    try:
        socket.bind(_bind_address(endpoint))
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {endpoint!r}: {exc}") from None
    bound = socket.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)
