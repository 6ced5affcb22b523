"""Remote namespaces, keys and the verified value format (kvpool.tiers.remote.namespace, .codec)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool import CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import BlockHasher, HashAlgo
from kvpool.tiers.remote.codec import HEADER, ValueCodec
from kvpool.tiers.remote.namespace import RemoteNamespace, key_bytes
from kvpool.tiers.storage import GroupGeometry

GEO = [GroupGeometry(num_layers=2, kv_heads=2, head_dim=8)]


def _ns(**overrides: object) -> RemoteNamespace:
    kwargs: dict[str, object] = {"tokens_per_block": 16, "gpu_blocks": 4, "layer_geometry": GEO}
    model = str(overrides.pop("model", "m"))
    kwargs.update(overrides)
    return RemoteNamespace.from_config(CacheConfig(**kwargs), model=model)  # type: ignore[arg-type]


def test_namespace_changes_with_everything_that_changes_the_bytes() -> None:
    base = _ns()
    variants = [
        _ns(model="other"),
        _ns(tokens_per_block=32),
        _ns(hash_algo="v1_block_key"),
        _ns(layer_geometry=[GroupGeometry(num_layers=3, kv_heads=2, head_dim=8)]),
        _ns(layer_geometry=[GroupGeometry(num_layers=2, kv_heads=2, head_dim=8,
                                          dtype="bfloat16")]),
        _ns(window_sizes=[64]),
    ]
    digests = {base.digest, *(v.digest for v in variants)}
    assert len(digests) == len(variants) + 1
    # what does not change the bytes does not change the namespace
    assert _ns(gpu_blocks=99, host_blocks=7).digest == base.digest
    assert RemoteNamespace.from_description(base.description) == base


def test_scopes_are_distinct_namespaces_for_every_algorithm() -> None:
    for algo in HashAlgo:
        ns = _ns(hash_algo=algo)
        scopes = [ns.scope(), ns.scope(lora_id=1), ns.scope(cache_salt="a"),
                  ns.scope(lora_id=1, cache_salt="a")]
        assert len({s.digest for s in scopes}) == 4
        assert ns.scope(cache_salt="a") == ns.scope(cache_salt="a")


def test_remote_keys_carry_the_whole_key_and_no_hash_tag() -> None:
    for algo in HashAlgo:
        scope = _ns(hash_algo=algo).scope()
        keys = BlockHasher(algo, 16).extend(list(range(64)))
        remote = scope.remote_keys(keys, 1)
        assert remote == [scope.remote_key(k, 1) for k in keys]
        for k, r in zip(keys, remote, strict=True):
            assert key_bytes(algo, k).hex().encode() in r
            assert b"{" not in r and b"}" not in r
            assert r.endswith(b":1") and r.startswith(scope.prefix)
        assert scope.remote_key(keys[0], 0) != scope.remote_key(keys[0], 1)


def test_key_bytes_rejects_a_key_of_another_algorithm() -> None:
    with pytest.raises(InvalidArgumentError):
        key_bytes(HashAlgo.V1_BLOCK_KEY, b"x" * 32)
    with pytest.raises(InvalidArgumentError):
        key_bytes(HashAlgo.V2_SHA256, 5)
    with pytest.raises(InvalidArgumentError):
        key_bytes(HashAlgo.V2_SHA256, b"short")
    assert key_bytes(HashAlgo.V1_BLOCK_KEY, 1) == b"\0" * 7 + b"\1"


NS_A, NS_B = b"A" * 16, b"B" * 16


@given(st.binary(min_size=0, max_size=4096))
def test_round_trip(payload: bytes) -> None:
    codec = ValueCodec()
    value = codec.encode(NS_A, b"k", payload)
    decoded = codec.decode(value, NS_A, b"k")
    assert decoded is not None and bytes(decoded) == payload
    assert not codec.rejected


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_damage_is_a_counted_miss(payload: bytes, data: st.DataObject) -> None:
    codec = ValueCodec()
    value = bytearray(codec.encode(NS_A, b"k", payload))
    how = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if how == "truncate":
        damaged = bytes(value[:data.draw(st.integers(0, len(value) - 1))])
    elif how == "flip":
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] ^= data.draw(st.integers(1, 255))
        damaged = bytes(value)
    else:
        damaged = bytes(value) + data.draw(st.binary(min_size=1, max_size=8))
    assert codec.decode(damaged, NS_A, b"k") is None
    assert sum(codec.rejected.values()) == 1


def test_reject_reasons() -> None:
    codec = ValueCodec()
    value = codec.encode(NS_A, b"k", b"payload")
    assert codec.decode(None, NS_A, b"k") is None
    assert codec.decode(value, NS_B, b"k") is None
    assert codec.decode(value, NS_A, b"other key") is None
    assert codec.decode(value[:HEADER.size - 1], NS_A, b"k") is None
    assert codec.decode(value[:-1], NS_A, b"k") is None
    assert codec.decode(b"junk" * 20, NS_A, b"k") is None
    assert codec.rejected == {"missing": 1, "namespace": 1, "key": 1, "short": 2, "magic": 1}
