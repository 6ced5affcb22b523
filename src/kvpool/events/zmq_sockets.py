"""What both ends of kvpool's ZeroMQ event transport share: the protocol's constants and the
process's one ZeroMQ context, sockets made and bound with typed errors. The protocol is
described in :mod:`kvpool.events.zmq`.

Who can connect. Stored events carry the token ids of cached prompts, and a snapshot holds
every cached prompt: an endpoint is readable by whoever can connect to it. :func:`bind`
therefore binds ``ipc://`` endpoints only where no other user can reach them: ``ipc://*``
(:data:`PRIVATE_IPC`) is a socket in a new directory of mode 0700 under the system's
temporary directory (removed by :func:`release`), and an explicit ``ipc://`` path must lie in
a directory owned by this user with no permission for group or others (else
:class:`TransportError`); the socket file itself is made 0600. ``tcp://`` endpoints (vLLM's
wire format, which remote consumers need) are bound as asked: anyone who can reach the port
can read what is published there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import Any, Final

import zmq

from kvpool.errors import TransportError

__all__ = [
    "END_SEQ",
    "MAX_SEQ",
    "MAX_SOCKETS",
    "PRIVATE_IPC",
    "PROBE_SEQ",
    "SNAPSHOT_REQUEST",
    "bind",
    "is_private",
    "new_socket",
    "release",
    "shared_context",
]

END_SEQ: Final = b"\xff" * 8
"""The seq frame of the replay end marker (-1 as a signed 8-byte big-endian int)."""

SNAPSHOT_REQUEST: Final = b"kvpool-snapshot"
"""The replay request for a snapshot (a kvpool publisher's addition)."""

PROBE_SEQ: Final = (1 << 63).to_bytes(8, "big")  # past anything a publisher buffers
MAX_SEQ: Final = (1 << 63) - 1  # seqs are signed 8-byte ints on the wire (END_SEQ is -1)
MAX_SOCKETS: Final = 16_384  # per context, when kvpool makes its first socket
PRIVATE_IPC: Final = "ipc://*"
"""An ``ipc://`` socket only this user can reach, at a fresh path (see the module doc)."""
_PRIVATE_PREFIX: Final = "kvpool-zmq-"


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


def _private_directory(directory: str) -> str | None:
    """Why other users may reach sockets in ``directory`` (None: only this user can)."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        return f"its directory cannot be read ({exc.strerror})"
    if st.st_uid != os.geteuid():
        return f"its directory {directory} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o077:
        return (f"its directory {directory} is open to other users "
                f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def is_private(endpoint: str) -> bool:
    """Whether only this user can connect to ``endpoint`` (an ``ipc://`` socket in a
    directory of this user's with no permission for group or others)."""
    if not endpoint.startswith("ipc://"):
        return False
    path = endpoint[len("ipc://"):]
    return _private_directory(os.path.dirname(os.path.abspath(path)) or ".") is None


def bind(socket: zmq.Socket[Any], endpoint: str, name: str = "socket") -> str:
    """Bind ``socket`` (module doc: ``ipc://`` only where no other user can reach it); the
    bound endpoint. ``name``: the file name of a :data:`PRIVATE_IPC` socket."""
    made: str | None = None
    if endpoint == PRIVATE_IPC:
        made = tempfile.mkdtemp(prefix=_PRIVATE_PREFIX)  # mode 0700
        endpoint = f"ipc://{made}/{name}"
    elif endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        why = _private_directory(os.path.dirname(os.path.abspath(path)))
        if why is not None:
            raise TransportError(
                f"cannot bind {endpoint!r}: {why}, and the socket serves cached prompts' "
                f"token ids; bind in a directory only you can enter (mode 0700), or use "
                f"{PRIVATE_IPC!r} for a private path"
            )
    try:
        socket.bind(_bind_address(endpoint))
    except zmq.ZMQError as exc:
        if made is not None:
            with contextlib.suppress(OSError):
                os.rmdir(made)
        raise TransportError(f"cannot bind {endpoint!r}: {exc}") from None
    raw = socket.getsockopt(zmq.LAST_ENDPOINT)
    bound = raw.decode() if isinstance(raw, bytes) else str(raw)
    if bound.startswith("ipc://"):
        with contextlib.suppress(OSError):  # the directory already keeps others out
            os.chmod(bound[len("ipc://"):], 0o600)
    return bound


def release(endpoint: str | None) -> None:
    """After the socket bound to ``endpoint`` closed: remove the directory :func:`bind` made
    for a :data:`PRIVATE_IPC` endpoint (nothing for any other)."""
    if endpoint is None or not endpoint.startswith("ipc://"):
        return
    directory = os.path.dirname(endpoint[len("ipc://"):])
    if (not os.path.basename(directory).startswith(_PRIVATE_PREFIX)
            or os.path.dirname(directory) != tempfile.gettempdir()):
        return
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            os.unlink(os.path.join(directory, entry))
        os.rmdir(directory)
