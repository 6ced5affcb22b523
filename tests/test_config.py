"""CacheConfig's groups: each a frozen object that checks its fields and names their path;
from_mapping reads plain data into the same shape, refusing unknown names with their path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpool import (
    CacheConfig,
    DiskConfig,
    EventsConfig,
    EvictionConfig,
    GroupGeometry,
    HashAlgo,
    InvalidArgumentError,
    RemoteConfig,
)
from kvpool.tiers.remote import MemoryStore

BASE: dict[str, Any] = {"tokens_per_block": 4, "gpu_blocks": 8}


@pytest.mark.parametrize(("make", "path"), [
    (lambda: DiskConfig(path=3), "CacheConfig.disk.path must be a path"),
    (lambda: DiskConfig(persistent=1), "CacheConfig.disk.persistent must be a bool"),
    (lambda: DiskConfig(sync_interval_s=-1), "CacheConfig.disk.sync_interval_s must be"),
    (lambda: DiskConfig(manifest_damaged="fix"), "CacheConfig.disk.manifest_damaged must be"),
    (lambda: RemoteConfig(write="sometimes"), "CacheConfig.remote.write must be one of"),
    (lambda: RemoteConfig(url="ftp://x"), "CacheConfig.remote.url scheme 'ftp'"),
    (lambda: RemoteConfig(timeout_s=float("nan")), "CacheConfig.remote.timeout_s must be"),
    (lambda: EventsConfig(buffer_max_size=True), "CacheConfig.events.buffer_max_size must be"),
    (lambda: EventsConfig(hash_algo="md5"), "md5"),
    (lambda: EvictionConfig(policy="mru"), "CacheConfig.eviction.policy must be one of"),
    (lambda: EvictionConfig(offload_min_priority=101),
     r"CacheConfig\.eviction\.offload_min_priority must be an int in \[0, 100\]"),
    (lambda: CacheConfig(**BASE, disk={"path": "/x"}),  # type: ignore[arg-type]
     "CacheConfig.disk must be a DiskConfig.*from_mapping"),
    (lambda: CacheConfig(**BASE, events=EventsConfig(hash_algo="v1_block_key")),
     "CacheConfig.events.hash_algo 'v1_block_key' is not a projection"),
    (lambda: CacheConfig(**BASE, host_blocks=4, disk_blocks=4, disk=DiskConfig(persistent=True)),
     "CacheConfig.disk.persistent needs a disk tier holding real KV"),
    (lambda: CacheConfig(**BASE, host_blocks=4, disk_blocks=4,
                         layer_geometry=[GroupGeometry(1, 1, 4, "float32")]),
     "a disk tier with real storage needs CacheConfig.disk.path"),
])
def test_each_group_names_the_path_of_a_bad_field(make: Any, path: str) -> None:
    with pytest.raises(InvalidArgumentError, match=path):
        make()


def test_groups_are_frozen_defaults_compare_and_events_carry_the_tree_algorithm() -> None:
    a = CacheConfig(**BASE, hash_algo="v2_sha256_64")
    assert a == CacheConfig(**BASE, hash_algo="v2_sha256_64") and hash(a.eviction)
    assert a.disk == DiskConfig() and a.remote.url is None and a.eviction.policy == "2q"
    assert a.events.hash_algo is HashAlgo.V2_SHA256_64  # None: the tree's own
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.disk.path = "/tmp"  # type: ignore[misc]
    b = CacheConfig(**BASE, events=EventsConfig(10, "v2_sha256_64"))
    assert b.events == EventsConfig(10, HashAlgo.V2_SHA256_64) and b.hash_algo is HashAlgo.V2_SHA256
    store = MemoryStore(1 << 20)  # a store is shared, not compared
    assert CacheConfig(**BASE, remote=RemoteConfig(store=store)) == CacheConfig(
        **BASE, remote=RemoteConfig(store=MemoryStore(1 << 10)))


def test_from_mapping_builds_the_nested_shape_and_refuses_unknown_names() -> None:
    store = MemoryStore(1 << 20)
    cfg = CacheConfig.from_mapping({
        **BASE, "host_blocks": 4, "eviction": {"policy": "lru", "offload_gate": "reused"},
        "events": {"buffer_max_size": 100}, "remote": RemoteConfig(store=store, write="store"),
    })
    assert cfg == CacheConfig(**BASE, host_blocks=4,
                              eviction=EvictionConfig(policy="lru", offload_gate="reused"),
                              events=EventsConfig(buffer_max_size=100),
                              remote=RemoteConfig(store=store, write="store"))
    assert cfg.remote.store is store
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.disk has no field 'pth'"):
        CacheConfig.from_mapping({**BASE, "disk": {"pth": "/x"}})
    with pytest.raises(InvalidArgumentError, match="CacheConfig has no field 'disk_path'"):
        CacheConfig.from_mapping({**BASE, "disk_path": "/x"})
    with pytest.raises(InvalidArgumentError, match="CacheConfig needs gpu_blocks"):
        CacheConfig.from_mapping({"tokens_per_block": 4})
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.eviction\.policy must be"):
        CacheConfig.from_mapping({**BASE, "eviction": {"policy": "mru"}})
