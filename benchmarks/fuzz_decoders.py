"""Fuzzing the wire decoders: only the documented error types may escape, whatever the input.

For each decoder, ``--count`` inputs (default 100,000), seeded: a third random (random bytes,
random JSON-ish text), two thirds valid payloads (random events encoded as the engines encode
them) mutated: bytes flipped, inserted, deleted, truncated, spliced, invalid UTF-8 put inside,
an array header set to 2**32 - 1 elements, nesting 10 to 100,000 deep. Decoders:

* ``decode_vllm_batch`` (tokens read and not), ``decode_vllm_keys`` (tokens read: the numba
  kernel when the ``jit`` extra is there; and not), for ``vllm_sha256_cbor`` and ``v2_sha256``;
* ``parse_trtllm_json`` (tokens read and not), ``parse_trtllm_keys``;
* the router service's ``/route`` body (``parse_route_body``).

The decoders must raise :class:`~kvpool.errors.EventFormatError` (the route body:
:class:`~kvpool.errors.InvalidArgumentError`, the service's 400) and nothing else. A row per
decoder: inputs, accepted, rejected, escaped (anything else: the run fails, exit 1, with the
first examples). A test runs this with a small count.

    .venv/bin/python benchmarks/fuzz_decoders.py [--count 100000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.errors import EventFormatError, InvalidArgumentError
from kvpool.events.model import (
    AllCleared,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvpool.events.trtllm_json import parse_trtllm_json, parse_trtllm_keys, to_trtllm_json
from kvpool.events.vllm_msgpack import decode_vllm_batch, decode_vllm_keys, encode_vllm_batch
from kvpool.hashing import jit
from kvpool.router.service import parse_route_body

Decoder = Callable[[bytes], object]


# ------------------------------------------------------------------------------- valid inputs


def _events(rng: random.Random, hex_hashes: bool) -> list[KVCacheEvent]:
    def h() -> int | str:
        v = rng.getrandbits(64)
        return f"{v:016x}" + "0" * 48 if hex_hashes else v

    algo = "v2_sha256" if hex_hashes else "vllm_sha256_cbor"
    out: list[KVCacheEvent] = []
    for eid in range(rng.randrange(1, 6)):
        kind = rng.random()
        group = rng.choice((0, 0, 1))
        if kind < 0.55:
            tpb = rng.choice((1, 4, 16))
            level = rng.choice((0, 0, 1, 2))
            blocks = tuple(
                StoredBlock(h(), tuple(rng.randrange(1 << rng.choice((7, 16, 32)))
                                       for _ in range(tpb)), level)
                for _ in range(rng.randrange(1, 6))
            )
            parent = h() if rng.random() < 0.5 else None
            data: Any = Stored(parent, blocks)
        elif kind < 0.8:
            hashes = tuple(h() for _ in range(rng.randrange(1, 6)))
            data = Removed(hashes, (rng.randrange(3),) * len(hashes))
        elif kind < 0.9:
            data = Updated(h(), EventDiff(0, 1))
        else:
            data = AllCleared()
        out.append(KVCacheEvent(eid, data, 4096, group, algo))
    return out


def valid_vllm(rng: random.Random) -> bytes:
    events = _events(rng, rng.random() < 0.3)
    if rng.random() < 0.15:  # an older engine's positional events
        return msgspec.msgpack.encode([0.0, [["BlockStored", [rng.getrandbits(64)], None,
                                               [1, 2, 3], 3, None, "GPU"]], None])
    return encode_vllm_batch(events, ts=0.0, block_size=rng.choice((None, 4, 16)))


def valid_trtllm(rng: random.Random) -> bytes:
    return to_trtllm_json(_events(rng, rng.random() < 0.3)).encode()


def valid_route(rng: random.Random) -> bytes:
    body: dict[str, Any] = {"token_ids": [rng.randrange(200_000) for _ in range(rng.randrange(40))]}
    if rng.random() < 0.5:
        body["cache_salt"] = "salt-é"
    if rng.random() < 0.5:
        body["request_id"] = f"r{rng.randrange(1000)}"
    return msgspec.json.encode(body)


# ---------------------------------------------------------------------------------- mutations


def mutate(rng: random.Random, data: bytes, json_like: bool) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(9)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip bits
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert random bytes
            b[pos:pos] = rng.randbytes(rng.randrange(1, 8))
        elif op == 2:  # delete a range
            del b[pos:pos + rng.randrange(1, 16)]
        elif op == 3:  # truncate
            del b[pos:]
        elif op == 4:  # duplicate a slice elsewhere
            start = rng.randrange(len(b) + 1)
            b[pos:pos] = b[start:start + rng.randrange(1, 32)]
        elif op == 5:  # invalid UTF-8
            b[pos:pos] = rng.choice((b"\xe9", b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\x8c"))
        elif op == 6:  # a huge count
            header = b"\xdd\xff\xff\xff\xff" if not json_like else b"[" * 3
            b[pos:pos] = header
        elif op == 7 and b:  # a byte replaced by a rare one
            b[min(pos, len(b) - 1)] = rng.choice((0xC1, 0xA1, 0xDF, 0xDE, 0xD9, 0x00, 0x22, 0x5C))
        else:  # deep nesting around or inside
            depth = rng.choice((10, 10, 1000, 100_000))
            if json_like:
                b[pos:pos] = b"[" * depth + b"]" * rng.choice((0, depth))
            else:
                b[pos:pos] = b"\x91" * depth
    return bytes(b)


def random_input(rng: random.Random, json_like: bool) -> bytes:
    if json_like and rng.random() < 0.5:
        parts = [rng.choice(('[', ']', '{', '}', '"', ':', ',', '1', '-1', 'null', 'true',
                             '"type"', '"stored"', '"event_id"', '"data"', '"blocks"',
                             '"token_ids"', '1e400', '"\\ud800"', '18446744073709551616'))
                 for _ in range(rng.randrange(1, 40))]
        return "".join(parts).encode("utf-8", "surrogatepass")
    return rng.randbytes(rng.randrange(0, 64))


# ------------------------------------------------------------------------------------- the run


def _decoders() -> list[tuple[str, bool, Callable[[random.Random], bytes], Decoder,
                              type[Exception]]]:
    v, t, r = valid_vllm, valid_trtllm, valid_route
    fe, ia = EventFormatError, InvalidArgumentError
    v2 = "v2_sha256"
    return [
        ("decode_vllm_batch", False, v, lambda p: decode_vllm_batch(p), fe),
        ("decode_vllm_batch tokens=False v2", False, v,
         lambda p: decode_vllm_batch(p, hash_algo=v2, tokens=False), fe),
        ("decode_vllm_keys", False, v, lambda p: decode_vllm_keys(p), fe),
        ("decode_vllm_keys tokens=True", False, v, lambda p: decode_vllm_keys(p, tokens=True), fe),
        ("decode_vllm_keys tokens=True v2", False, v,
         lambda p: decode_vllm_keys(p, hash_algo=v2, tokens=True), fe),
        ("parse_trtllm_json", True, t, lambda p: parse_trtllm_json(p), fe),
        ("parse_trtllm_json tokens=False", True, t, lambda p: parse_trtllm_json(p, tokens=False),
         fe),
        ("parse_trtllm_json str", True, t,
         lambda p: parse_trtllm_json(p.decode("utf-8", "surrogateescape")), fe),
        ("parse_trtllm_keys", True, t, lambda p: parse_trtllm_keys(p), fe),
        ("/route body", True, r, lambda p: parse_route_body(p), ia),
    ]


def fuzz(count: int, seed: int) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per decoder, and examples of escaped errors (empty when none escaped)."""
    rows: list[dict[str, Any]] = []
    examples: list[str] = []
    for name, json_like, valid, decode, allowed in _decoders():
        rng = random.Random(f"{seed}:{name}")
        accepted = rejected = escaped = 0
        t0 = time.perf_counter()
        for i in range(count):
            data = (random_input(rng, json_like) if i % 3 == 0
                    else mutate(rng, valid(rng), json_like) if i % 3 == 1 or i % 30 != 2
                    else valid(rng))
            try:
                decode(data)
                accepted += 1
            except allowed:
                rejected += 1
            except Exception as exc:
                escaped += 1
                if len(examples) < 10:
                    examples.append(f"{name}: {type(exc).__name__}: {exc} <- {data[:80]!r}")
        rows.append({
            "decoder": name,
            "inputs": count,
            "accepted": accepted,
            "rejected": rejected,
            "escaped": escaped,
            "s": time.perf_counter() - t0,
        })
    return rows, examples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="inputs per decoder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    rows, examples = fuzz(args.count, args.seed)
    report("fuzz_decoders", rows, title="decoders under fuzzing (escaped must be 0)",
           extra={"count": args.count, "seed": args.seed, "jit": jit.backend(),
                  "escaped_examples": examples}, out=args.out)
    for line in examples:
        print(line, file=sys.stderr)
    return 1 if examples else 0


if __name__ == "__main__":
    sys.exit(main())
