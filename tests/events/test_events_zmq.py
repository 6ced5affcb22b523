"""The ZeroMQ transport on 127.0.0.1 with real sockets: wire frames, ordered delivery, replay of a
dropped batch, restart detection."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvpool.errors import InvalidArgumentError, TransportError
from kvpool.events import SubscribedBatch, ZmqEventPublisher, ZmqEventSubscriber
from kvpool.events.zmq import END_SEQ

LOCAL = "tcp://127.0.0.1:0"


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    pub = ZmqEventPublisher(LOCAL, LOCAL, topic="kv")
    yield pub
    pub.close()


def collect(sub: ZmqEventSubscriber, count: int, timeout_s: float = 10.0) -> list[SubscribedBatch]:
    """Receive until ``count`` batches arrived (or fail after ``timeout_s``)."""
    out: list[SubscribedBatch] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"got {len(out)} of {count} batches: {[b.seq for b in out]}"
        out += sub.recv(min(left, 0.5))
    return out


def connected(pub: ZmqEventPublisher) -> ZmqEventSubscriber:
    """A subscriber whose SUB socket is known to be joined: a warm-up batch reached it.

    It starts at whatever seq arrives first, so the warm-ups it missed are no gaps."""
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv", start_seq=None)
    pub.publish(b"warm-up")
    deadline = time.monotonic() + 10
    while sub.recv(0.05) == []:
        assert time.monotonic() < deadline, "subscriber never joined"
        pub.publish(b"warm-up")
    sub.recv(0.1)  # drain any further warm-ups
    return sub


def _raw_socket(kind: int, endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


# --------------------------------------------------------------------------------- wire frames


def test_ephemeral_endpoints_are_exposed(publisher: ZmqEventPublisher) -> None:
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    assert publisher.replay_endpoint is not None
    ports = {
        int(publisher.endpoint.rsplit(":", 1)[1]),
        int(publisher.replay_endpoint.rsplit(":", 1)[1]),
    }
    assert len(ports) == 2 and 0 not in ports


def test_pub_frames_are_topic_seq_payload(publisher: ZmqEventPublisher) -> None:
    sub = _raw_socket(zmq.SUB, publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        frames: list[bytes] = []
        deadline = time.monotonic() + 10
        while not frames:  # the slow joiner misses the first batches: keep publishing
            assert time.monotonic() < deadline
            publisher.publish(b"payload")
            if sub.poll(50):
                frames = sub.recv_multipart()
        topic, seq, payload = frames
        assert topic == b"kv" and len(seq) == 8 and payload == b"payload"
        first = int.from_bytes(seq, "big")
        publisher.publish(b"next")
        while True:  # later batches carry the following seqs, big-endian
            topic, seq, payload = sub.recv_multipart()
            if payload == b"next":
                break
        assert int.from_bytes(seq, "big") > first
    finally:
        sub.close()


def test_replay_socket_speaks_the_dealer_protocol(publisher: ZmqEventPublisher) -> None:
    for i in range(5):
        publisher.publish(b"batch-%d" % i)
    dealer = _raw_socket(zmq.DEALER, publisher.replay_endpoint or "")
    try:
        replies: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while len(replies) < 4:  # the publisher thread may not have sent all 5 yet
            assert time.monotonic() < deadline
            dealer.send_multipart([b"", (2).to_bytes(8, "big")])
            replies = []
            while True:
                frames = dealer.recv_multipart()
                replies.append(frames)
                if frames[2] == END_SEQ:
                    break
        assert replies[:-1] == [
            [b"", b"kv", i.to_bytes(8, "big"), b"batch-%d" % i] for i in range(2, 5)
        ]
        # kvpool's end marker carries the next seq and the publisher's epoch
        assert replies[-1] == [b"", b"", b"\xff" * 8, (5).to_bytes(8, "big") + publisher.epoch]
    finally:
        dealer.close()


# ---------------------------------------------------------------------------------- delivery


def test_batches_are_delivered_in_order(publisher: ZmqEventPublisher) -> None:
    sub = connected(publisher)
    try:
        first = publisher.next_seq
        payloads = [b"p%d" % i for i in range(300)]
        for payload in payloads:
            publisher.publish(payload)
        got = collect(sub, 300)
        assert [b.seq for b in got] == list(range(first, first + 300))
        assert [b.payload for b in got] == payloads
        assert sub.missed == 0 and sub.restarts == 0 and not any(b.restart for b in got)
    finally:
        sub.close()


def test_a_batch_dropped_on_pub_is_recovered_by_replay(publisher: ZmqEventPublisher) -> None:
    sub = connected(publisher)
    try:
        first = publisher.next_seq
        publisher.skip_on_pub(first + 2)  # never sent on PUB, kept for replay
        for i in range(6):
            publisher.publish(b"b%d" % i)
        got = collect(sub, 6)
        assert [b.seq for b in got] == list(range(first, first + 6))
        assert [b.payload for b in got] == [b"b%d" % i for i in range(6)]
        assert sub.gaps == 1 and sub.replayed >= 1 and sub.missed == 0
        assert sub.recv(0.2) == []  # the replayed batches arriving again are dropped
    finally:
        sub.close()


def test_without_replay_a_gap_is_counted_as_missed() -> None:
    with ZmqEventPublisher(LOCAL, None, topic="kv") as pub:
        sub = connected(pub)
        try:
            first = pub.next_seq
            pub.skip_on_pub(first + 1)
            for i in range(3):
                pub.publish(b"%d" % i)
            got = collect(sub, 2)
            assert [b.seq for b in got] == [first, first + 2]
            assert sub.missed == 1 and sub.gaps == 1
        finally:
            sub.close()


def test_catch_up_fetches_what_was_published_before_joining(publisher: ZmqEventPublisher) -> None:
    for i in range(4):
        publisher.publish(b"early-%d" % i)
    sub = ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv")
    try:
        got: list[SubscribedBatch] = []
        deadline = time.monotonic() + 10
        while len(got) < 4:
            assert time.monotonic() < deadline
            got += sub.catch_up()
        assert [(b.seq, b.payload) for b in got] == [(i, b"early-%d" % i) for i in range(4)]
        assert sub.expected_seq == 4
    finally:
        sub.close()


def _rebind(endpoint: str, replay: str | None) -> ZmqEventPublisher:
    deadline = time.monotonic() + 10
    while True:  # the old sockets' ports are released asynchronously
        try:
            return ZmqEventPublisher(endpoint, replay, topic="kv")
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_publisher_restart_is_detected_and_flagged() -> None:
    old = ZmqEventPublisher(LOCAL, LOCAL, topic="kv")
    endpoint, replay = old.endpoint, old.replay_endpoint
    sub = connected(old)
    try:
        for i in range(40):
            old.publish(b"old-%d" % i)
        before = collect(sub, 40)
        assert before[-1].seq == old.next_seq - 1 and sub.restarts == 0
        old.close()
        new = _rebind(endpoint, replay)
        try:
            got: list[SubscribedBatch] = []
            deadline = time.monotonic() + 10
            while not got:  # until the SUB socket has reconnected
                assert time.monotonic() < deadline
                new.publish(b"new-%d" % new.next_seq)
                got += sub.recv(0.1)
            assert sub.restarts == 1
            assert got[0].restart and got[0].seq == 0 and got[0].payload == b"new-0"
            assert [b.seq for b in got] == list(range(len(got)))
            assert not any(b.restart for b in got[1:])
        finally:
            new.close()
    finally:
        sub.close()


# -------------------------------------------------------------------------------- lifecycle


def test_publish_never_blocks_and_close_sends_the_queue() -> None:
    pub = ZmqEventPublisher(LOCAL, LOCAL, topic="kv")
    sub = connected(pub)
    try:
        first = pub.next_seq
        start = time.monotonic()
        for _ in range(2000):
            pub.publish(b"x" * 100)
        assert time.monotonic() - start < 2.0
        pub.close()
        got = collect(sub, 2000)
        assert [b.seq for b in got] == list(range(first, first + 2000))
    finally:
        sub.close()
        pub.close()
    with pytest.raises(TransportError, match="closed"):
        pub.publish(b"late")


def test_bind_conflicts_and_bad_arguments_are_typed_errors(publisher: ZmqEventPublisher) -> None:
    with pytest.raises(TransportError, match=publisher.endpoint.rsplit(":", 1)[1]):
        ZmqEventPublisher(publisher.endpoint, None)
    with pytest.raises(InvalidArgumentError, match="buffer_steps"):
        ZmqEventPublisher(LOCAL, None, buffer_steps=0)
    sub = ZmqEventSubscriber(publisher.endpoint)
    sub.close()
    with pytest.raises(TransportError, match="closed"):
        sub.recv(0)


def test_batches_go_out_while_the_publishing_thread_holds_the_gil() -> None:
    """An engine's scheduler thread is busy in Python (it holds the GIL): the batches it hands
    over must still leave at once. Here the thread holds the GIL in one long C call (no other
    Python thread can run meanwhile); every batch published before it must have reached the
    subscriber's socket by its end. A Python sending thread could not have sent any of them."""
    pub = ZmqEventPublisher(LOCAL, None, topic="kv")
    sub = _raw_socket(zmq.SUB, pub.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # joined once a warm-up batch arrives
            assert time.monotonic() < deadline, "subscriber never joined"
            pub.publish(b"warm-up")
        while sub.poll(100):
            sub.recv_multipart()
        first = pub.next_seq
        for _ in range(50):
            pub.publish(b"y" * 200)
        assert sum(range(60_000_000)) > 0  # C only (builtin sum over a range): holds the GIL
        arrived = []
        while len(arrived) < 50:
            try:  # what is queued at the SUB socket now, without waiting
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            arrived.append(int.from_bytes(frames[1], "big"))
        assert arrived == list(range(first, first + 50))
    finally:
        sub.close()
        pub.close()


_MANY = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = 8000 if hard == resource.RLIM_INFINITY else min(hard, 8000)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
if max(soft, want) < 6000:
    print("SKIP")
    sys.exit(0)
from kvpool.events import ZmqEventPublisher, ZmqEventSubscriber
pairs = []
for _ in range(300):
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    pairs.append((pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint)))
for pub, sub in pairs:
    sub.close()
    pub.close()
print("OK", len(pairs))
"""

_EXHAUSTED = """
import zmq
from kvpool.errors import TransportError
from kvpool.events import ZmqEventPublisher
zmq.Context.instance().socket(zmq.PUB)  # the context started before kvpool: 1,023 sockets
pubs = []
try:
    while len(pubs) < 1000:
        pubs.append(ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"))
except TransportError as exc:
    print("TransportError", len(pubs), exc)
for pub in pubs:
    pub.close()
"""


def _run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_process_holds_hundreds_of_publishers_and_subscribers() -> None:
    """A replay of a large cluster or a router of many engines: 300 publisher/subscriber pairs
    in one process (ZeroMQ's default context limit would stop at about 127 publishers)."""
    out = _run_python(_MANY)
    if out == "SKIP":
        pytest.skip("this machine allows too few open files")
    assert out == "OK 300"


def test_running_out_of_sockets_is_a_transport_error() -> None:
    out = _run_python(_EXHAUSTED)
    assert out.startswith("TransportError"), out
    count = int(out.split()[1])
    assert 100 <= count < 200 and "socket limit" in out  # 1,023 sockets, 6 per publisher


def test_one_bogus_sequence_number_is_not_counted_as_missed_batches() -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", None, start_seq=0)
    try:
        got: list[SubscribedBatch] = []
        seq = 0
        deadline = time.monotonic() + 10
        while not got:  # until the SUB socket has joined
            assert time.monotonic() < deadline
            sock.send_multipart([b"", seq.to_bytes(8, "big"), b"first"])
            got = sub.recv(timeout_s=0.05)
        seq = got[-1].seq
        for bogus in ((1 << 63) - 5, (1 << 64) - 2):
            sock.send_multipart([b"", bogus.to_bytes(8, "big"), b"garbage"])
            sock.send_multipart([b"", (seq + 1).to_bytes(8, "big"), b"next"])
            seq += 1
            batches = collect(sub, 1)
            assert [(b.seq, b.payload, b.restart) for b in batches] == [(seq, b"next", False)]
        assert (sub.missed, sub.restarts, sub.absurd, sub.malformed) == (0, 0, 2, 0)
    finally:
        sub.close()
        sock.close()


# ------------------------------------------------------------------ seqs that go back: stale or not


class RawPublisher:
    """A test's own PUB end (an XPUB: it knows when the subscriber has joined, so not one
    message is lost to the slow joiner and the counters are exact)."""

    def __init__(self) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def joined(self) -> None:
        """Wait for the subscriber's subscription (its SUB socket is connected then)."""
        assert self.sock.poll(10_000), "the subscriber never joined"
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close()


def _drain(sub: ZmqEventSubscriber, until: int) -> list[tuple[int, bytes, bool]]:
    """What the subscriber delivers up to and including batch ``until`` (bounded wait)."""
    out: list[tuple[int, bytes, bool]] = []
    deadline = time.monotonic() + 10
    while not out or out[-1][0] != until:
        assert time.monotonic() < deadline, out
        out += [(b.seq, b.payload, b.restart) for b in sub.recv(0.05)]
    return out


def test_a_duplicate_or_late_seq_without_replay_is_stale_not_a_restart() -> None:
    """A copy of a delivered batch, or an older seq that arrives late, is dropped and counted
    stale: no restart, nothing counted missed (before: a restart, and 'missed' += its seq)."""
    pub = RawPublisher()
    sub = ZmqEventSubscriber(pub.endpoint, None, topic="kv", start_seq=0)
    try:
        pub.joined()
        for seq in range(605):
            pub.send(seq, b"b%d" % seq)
        assert len(_drain(sub, 604)) == 605
        pub.send(604, b"b604")  # a duplicate of the last batch
        pub.send(600, b"b600")  # a duplicate of an older one
        pub.send(3, b"late")  # a late batch that was never delivered as such
        pub.send(605, b"b605")
        pub.send(1, b"another late one")  # held: judged by the next message
        pub.send(605, b"b605")  # a duplicate again: the held one went back alone
        pub.send(606, b"b606")
        assert _drain(sub, 606) == [(605, b"b605", False), (606, b"b606", False)]
        assert (sub.stale, sub.restarts, sub.missed, sub.gaps) == (5, 0, 0, 0)
        # garbage frames and an absurd seq are counted apart
        pub.sock.send_multipart([b"kv", b"\x00" * 7, b"short seq"])
        pub.sock.send_multipart([b"kv", b"two frames"])
        pub.send((1 << 64) - 1, b"absurd")
        pub.send(607, b"b607")
        assert _drain(sub, 607) == [(607, b"b607", False)]
        assert (sub.malformed, sub.absurd, sub.stale, sub.restarts) == (2, 1, 5, 0)
        assert sub.missed == 0
    finally:
        sub.close()
        pub.close()


def test_a_restart_is_seq_zero_or_a_confirmed_run_back() -> None:
    """Without replay: seq 0 after others is a restart at once; a run that goes back and goes
    on (k, k + 1) is a restart whose first k batches were lost (counted missed, exactly)."""
    pub = RawPublisher()
    sub = ZmqEventSubscriber(pub.endpoint, None, topic="kv", start_seq=0)
    try:
        pub.joined()
        for seq in range(50):
            pub.send(seq, b"old-%d" % seq)
        _drain(sub, 49)
        pub.send(0, b"new-0")
        pub.send(1, b"new-1")
        assert _drain(sub, 1) == [(0, b"new-0", True), (1, b"new-1", False)]
        assert (sub.restarts, sub.missed, sub.stale) == (1, 0, 0)
        for seq in range(2, 40):
            pub.send(seq, b"new-%d" % seq)
        _drain(sub, 39)
        # a second restart whose SUB socket missed its batches 0..6
        pub.send(7, b"third-7")
        pub.send(8, b"third-8")
        assert _drain(sub, 8) == [(7, b"third-7", True), (8, b"third-8", False)]
        assert (sub.restarts, sub.missed, sub.stale, sub.gaps) == (2, 7, 0, 1)
    finally:
        sub.close()
        pub.close()


def test_with_a_kvpool_replay_socket_the_publisher_tells_stale_from_restart() -> None:
    """A kvpool publisher's replay socket answers with its next seq and epoch: a seq that went
    back on SUB while the publisher is ahead in the same epoch is stale at once; a restarted
    publisher (new epoch) is a restart."""
    real = ZmqEventPublisher(LOCAL, LOCAL, topic="kv")
    relay = RawPublisher()  # the subscriber reads the publisher's batches through the test
    tap = _raw_socket(zmq.SUB, real.endpoint)
    tap.setsockopt(zmq.SUBSCRIBE, b"")
    sub = ZmqEventSubscriber(relay.endpoint, real.replay_endpoint, topic="kv", start_seq=0)
    try:
        relay.joined()
        deadline = time.monotonic() + 10
        while not tap.poll(20):  # the tap's own slow join: warm-ups, then replay fills in
            assert time.monotonic() < deadline
            real.publish(b"warm-up")
        for i in range(20):
            real.publish(b"b%d" % i)
        last = real.next_seq - 1
        relayed = -1
        while relayed < last:  # forward every batch the tap sees (replay repairs the rest)
            topic, seq, payload = tap.recv_multipart()
            relay.sock.send_multipart([topic, seq, payload])
            relayed = int.from_bytes(seq, "big")
        _drain(sub, last)
        relay.send(last - 3, b"not what was published")  # stale: the publisher is ahead
        real.publish(b"next")
        relay.sock.send_multipart(tap.recv_multipart())
        assert _drain(sub, last + 1) == [(last + 1, b"next", False)]
        assert (sub.stale, sub.restarts, sub.missed) == (1, 0, 0)
    finally:
        sub.close()
        tap.close()
        relay.close()
        real.close()


# ------------------------------------------------------------------- who can read the replay socket

_AS_ANOTHER_USER = """
import os, sys
import zmq  # imported first: the interpreter's files may not be readable by that user
os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # nobody
dealer = zmq.Context().socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
dealer.connect(sys.argv[1])
dealer.send_multipart([b"", b"kvpool-snapshot"])
print("ANSWERED" if dealer.poll(2000) else "SILENT")
"""


def _snapshot_as_another_user(endpoint: str) -> str:
    done = subprocess.run([sys.executable, "-c", _AS_ANOTHER_USER, endpoint],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_replay_socket_is_private_by_default() -> None:
    """By default the replay socket (snapshots: every cached prompt's token ids) is an ipc
    socket in a new 0700 directory: this user gets snapshots, another user (nobody) gets no
    answer, while over tcp the same request is answered; the directory goes with close()."""
    import os
    import stat

    snapshot = b"every cached prompt"
    pub = ZmqEventPublisher(LOCAL, topic="kv", snapshot=lambda: snapshot)
    tcp = ZmqEventPublisher(LOCAL, LOCAL, topic="kv", snapshot=lambda: snapshot)
    try:
        endpoint = pub.replay_endpoint
        assert endpoint is not None and endpoint.startswith("ipc:///")
        path = endpoint[len("ipc://"):]
        directory = os.stat(os.path.dirname(path))
        assert directory.st_uid == os.geteuid() and stat.S_IMODE(directory.st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        sub = ZmqEventSubscriber(pub.endpoint, endpoint, topic="kv")
        try:
            got = sub.snapshot()
            assert got is not None and got.payload == snapshot
        finally:
            sub.close()
        if os.geteuid() == 0:  # only root can become another user
            assert _snapshot_as_another_user(tcp.replay_endpoint or "") == "ANSWERED"
            assert _snapshot_as_another_user(endpoint) == "SILENT"
    finally:
        pub.close()
        tcp.close()
    assert not os.path.exists(os.path.dirname(path))


def test_an_ipc_path_others_can_reach_is_refused_and_tcp_is_warned_about(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    import os

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    os.chmod(shared, 0o1777)  # like /tmp
    with pytest.raises(TransportError, match="open to other users"):
        ZmqEventPublisher(LOCAL, f"ipc://{shared}/replay", topic="kv")
    with pytest.raises(TransportError, match="open to other users"):
        ZmqEventPublisher(f"ipc://{shared}/events", None, topic="kv")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    with ZmqEventPublisher(LOCAL, f"ipc://{mine}/replay", topic="kv") as pub:
        assert pub.replay_endpoint == f"ipc://{mine}/replay"
    assert "to whoever can connect" not in caplog.text
    with ZmqEventPublisher(LOCAL, LOCAL, topic="kv"):
        assert "to whoever can connect" in caplog.text


def test_stalled_subscribers_never_hold_up_publish_replay_or_close() -> None:
    """A SUB that never reads and a replay client that asks again and again but never reads
    its replies (real sockets, receive buffers of 4 KiB): publish() stays fast (PUB drops for
    the stalled one), the stalled client's replies are cut short and counted, another client
    still gets its replay answer, and close() returns in time."""
    pub = ZmqEventPublisher(LOCAL, LOCAL, topic="kv", buffer_steps=64, hwm=16)
    stalled = []
    for kind, endpoint in ((zmq.SUB, pub.endpoint), (zmq.DEALER, pub.replay_endpoint or "")):
        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        stalled.append(sock)
    dealer = stalled[1]  # stalled[0]: the SUB that never reads
    try:
        payload = b"x" * 65536
        for _ in range(64):
            pub.publish(payload)
        for _ in range(200):  # each asks for 64 batches of 64 KiB: 4 MiB a reply
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        worst = 0.0
        for _ in range(1000):
            started = time.perf_counter()
            pub.publish(payload)
            worst = max(worst, time.perf_counter() - started)
        assert worst < 0.05, worst
        deadline = time.monotonic() + 10
        while pub.replies_cut == 0:
            assert time.monotonic() < deadline, "the stalled client's replies were never cut"
            time.sleep(0.05)
        healthy = _raw_socket(zmq.DEALER, pub.replay_endpoint or "")
        try:
            healthy.send_multipart([b"", pub.next_seq.to_bytes(8, "big")])
            assert healthy.recv_multipart()[2] == END_SEQ  # at once: nothing is missed
        finally:
            healthy.close()
    finally:
        started = time.monotonic()
        pub.close()
        assert time.monotonic() - started < 6.0
        for sock in stalled:
            sock.close()
