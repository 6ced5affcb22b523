"""The MGET reply reader (kvpool.tiers.remote.resp) over a real socket pair, cut anywhere."""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvpool.tiers.remote.resp import read_mget_reply


def _reply(values: list[bytes | None]) -> bytes:
    out = [b"*%d\r\n" % len(values)]
    for v in values:
        out.append(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v))
    return b"".join(out)


def _read(stream: bytes, cuts: list[int], count: int, close: bool = False
          ) -> list[bytearray | None]:
    """Send ``stream`` in pieces cut at ``cuts`` from a thread; read ``count`` values."""
    a, b = socket.socketpair()

    def send() -> None:
        last = 0
        for cut in [*sorted(set(cuts)), len(stream)]:
            a.sendall(stream[last:cut])
            last = cut
        if close:
            a.close()

    t = threading.Thread(target=send)
    t.start()
    b.settimeout(5)
    try:
        return read_mget_reply(b, count)
    finally:
        t.join()
        b.close()
        if not close:
            a.close()


VALUES = st.lists(st.none() | st.binary(max_size=300_000).map(bytes)
                  | st.binary(max_size=20), max_size=8)


@given(VALUES, st.data())
def test_values_read_whole_however_the_stream_is_cut(values: list[bytes | None],
                                                     data: st.DataObject) -> None:
    stream = _reply(values)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=6))
    assert _read(stream, cuts, len(values)) == values


def test_resp3_nulls() -> None:
    assert _read(b"*3\r\n_\r\n$1\r\nx\r\n_\r\n", [4, 9], 3) == [None, b"x", None]


def test_an_error_reply_is_a_response_error() -> None:
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        _read(b"-WRONGTYPE nope\r\n", [], 1)


@pytest.mark.parametrize("stream", [
    _reply([b"abc", b"defgh"])[:-4],        # closed in a value
    _reply([b"abc"])[:-1],                  # closed before the CRLF
    b"*1\r\n$3\r\nabcXY",                   # no CRLF after a value
    b"*2\r\n$3\r\nabc\r\n",                 # fewer values than keys, then closed
    b"*1\r\n+OK\r\n",                       # not a bulk string
    b"*1\r\n$x\r\n",                        # not a length
])
def test_a_broken_reply_is_a_connection_error(stream: bytes) -> None:
    with pytest.raises(RedisConnectionError):
        _read(stream, [3], 1 if stream.startswith(b"*1") else 2, close=True)


def test_a_reply_for_another_count_is_refused() -> None:
    with pytest.raises(RedisConnectionError, match="unexpected reply"):
        _read(_reply([b"a"]), [], 2)
