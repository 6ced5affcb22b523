"""KV event transport over ZeroMQ: vLLM's PUB socket with a replay ROUTER (COMPATIBILITY §3).

Wire protocol:

* PUB, three frames per batch: ``[topic, seq (8 bytes big-endian), payload]``; ``seq`` starts
  at 0 per publisher and grows by one per batch, so a smaller seq means the publisher restarted.
* Replay ROUTER: the last ``buffer_steps`` batches. A DEALER sends ``[b"", start_seq (8B BE)]``
  and receives ``[b"", topic, seq, payload]`` for every buffered batch with seq >= start_seq,
  then the end marker ``[b"", b"", b"\\xff" * 8, status]``. (vLLM's own publisher leaves the
  topic out of replies and sends an empty status; the subscriber accepts both.)
* kvpool additions, which a vLLM publisher answers with a bare end marker: the end marker's
  ``status`` is the publisher's next seq (8B BE) and its epoch (8 random bytes, new per
  publisher), so a liveness probe tells a consumer that it is behind or that the publisher
  restarted; and a **snapshot request** ``[b"", b"kvpool-snapshot"]`` (15 bytes: read as a
  start seq, it is past anything buffered) is answered, by a publisher given a ``snapshot``
  source, with ``[b"", topic, seq (8B BE), payload]``: one batch holding the state of every
  batch before ``seq`` (an all-cleared event, then every cached block as stored events; see
  :mod:`kvpool.events.snapshot`), then the end marker.

:class:`ZmqEventPublisher` never blocks its caller: :meth:`~ZmqEventPublisher.publish` numbers
the payload, keeps it for replay and queues it on an unbounded inproc pipe; a background thread
running ZeroMQ's proxy (in C, without the GIL, so a busy engine thread cannot hold it up) sends
it on PUB, and a second thread serves replay requests. Each socket is used by one thread at a
time, as ZeroMQ requires. :class:`ZmqEventSubscriber` delivers batches in sequence order,
repairs gaps through the replay socket and flags publisher restarts in-band.

Endpoints ending in port 0 (or ``*``) bind an ephemeral port; the bound endpoints are exposed
as ``endpoint`` / ``replay_endpoint``. Published batches carry the cached prompts' token ids
and a snapshot all of them: the replay socket binds ``ipc://*`` by default, a socket in a new
directory of mode 0700 that only this user can reach, and an ``ipc://`` path elsewhere must
be as private (:mod:`kvpool.events.zmq_sockets`); a ``tcp://`` endpoint, which vLLM-format
consumers on other hosts need, is readable by whoever can connect to it.

The transport is split by end: :mod:`kvpool.events.zmq_sockets` (constants, context, sockets),
:mod:`kvpool.events.zmq_publisher` and :mod:`kvpool.events.zmq_subscriber`; this module
re-exports their public names.
"""

from __future__ import annotations

from kvpool.events.zmq_publisher import ZmqEventPublisher
from kvpool.events.zmq_sockets import END_SEQ, SNAPSHOT_REQUEST
from kvpool.events.zmq_subscriber import (
    PublisherStatus,
    Snapshot,
    SubscribedBatch,
    ZmqEventSubscriber,
)

__all__ = [
    "END_SEQ",
    "SNAPSHOT_REQUEST",
    "PublisherStatus",
    "Snapshot",
    "SubscribedBatch",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
]
