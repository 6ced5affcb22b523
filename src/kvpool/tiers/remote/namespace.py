"""Where a block's bytes live in a shared remote store: namespaces and remote keys.

Two engines may exchange a block's bytes only when the bytes mean the same thing to both. A
:class:`RemoteNamespace` is everything that decides that, written down canonically and hashed:

- the model (a caller-given name, e.g. a model id and revision: geometry alone does not tell a
  fine-tune from its base),
- per layer group its kind (full attention, a window of n tokens, cross attention) and its KV
  geometry (layers, KV heads, head dim, dtype),
- tokens per block and the block-key hash algorithm.

A :class:`ScopeNamespace` narrows it to one reuse scope (LoRA id, cache salt): the v2 root key
of the scope (sha256 of its LoRA id and salt id) names the scope for every algorithm (v1 and
vLLM mix the scope into the first block instead, so their roots do not differ by scope). Two
namespaces are equal exactly when their :attr:`digest` bytes are.

A block's remote key is ``kvp:<scope digest, hex>:<full chained key, hex>:<layer group>``: the
whole key (a 64-bit projection would let two blocks collide), in its canonical byte form
(:func:`key_bytes`), hex so that no byte of it is a Redis Cluster hash-tag brace: the keys of
one namespace spread over every slot of a cluster.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import BlockKey, HashAlgo, cache_salt_id, hash_algo, v2_root_key
from kvpool.validation import check_int, check_u64


class LayoutSource(Protocol):
    """What a namespace reads of a manager's configuration (a ``kvpool.config.CacheConfig``)."""

    @property
    def tokens_per_block(self) -> int: ...
    @property
    def hash_algo(self) -> HashAlgo | str: ...
    @property
    def window_sizes(self) -> Sequence[int | None]: ...
    @property
    def cross_attention_groups(self) -> Sequence[int]: ...
    @property
    def layer_geometry(self) -> Sequence[Any] | None: ...

__all__ = ["KEY_PREFIX", "NAMESPACE_DIGEST_SIZE", "RemoteNamespace", "ScopeNamespace", "key_bytes"]

KEY_PREFIX: Final = b"kvp:"
NAMESPACE_DIGEST_SIZE: Final = 16
_FORMAT: Final = 1  # of the canonical description; a new layout of keys or values bumps it
_DIGEST_KEY_SIZE: Final = 32


def key_bytes(algo: HashAlgo, key: BlockKey) -> bytes:
    """The canonical bytes of a full chained block key: 8 big-endian bytes of a v1 u64 key,
    the 32-byte digest itself for the sha256 algorithms (``v2_sha256``, ``v2_sha256_64`` —
    whose events carry a projection, never the tree key — and ``vllm_sha256_cbor``).

    Raises :class:`InvalidArgumentError` for a key that is not of ``algo``'s kind.
    """
    if algo is HashAlgo.V1_BLOCK_KEY:
        return check_u64("a v1_block_key key", key).to_bytes(8, "big")
    if not isinstance(key, bytes) or len(key) != _DIGEST_KEY_SIZE:
        raise InvalidArgumentError(f"a {algo.value} key must be 32 bytes, got {key!r:.80}")
    return key


def _group_entries(config: LayoutSource) -> list[dict[str, object]]:
    cross = set(config.cross_attention_groups)
    geometry = config.layer_geometry
    groups: list[dict[str, object]] = []
    for g, window in enumerate(config.window_sizes):
        kind = "cross" if g in cross else ("full" if window is None else f"window:{window}")
        entry: dict[str, object] = {"kind": kind}
        if geometry is not None:
            geo = geometry[g]
            entry.update(layers=geo.num_layers, kv_heads=geo.kv_heads, head_dim=geo.head_dim,
                         dtype=geo.dtype)
        groups.append(entry)
    return groups


@dataclass(frozen=True, slots=True)
class RemoteNamespace:
    """What makes two engines' block bytes interchangeable (module docstring).

    ``description`` is canonical JSON (sorted keys, no spaces), so equal settings give equal
    bytes on every machine; ``digest`` is the first 16 bytes of its sha256.
    """

    description: bytes
    digest: bytes
    algo: HashAlgo

    @classmethod
    def from_config(cls, config: LayoutSource, *, model: str = "") -> RemoteNamespace:
        """The namespace of a manager's configuration. Without ``layer_geometry`` (a manager
        holding no bytes, as in a replay) the groups are described by their kind only."""
        if not isinstance(model, str):
            raise InvalidArgumentError(f"model must be a str, got {model!r}")
        algo = hash_algo(config.hash_algo)
        doc = {
            "format": _FORMAT,
            "model": model,
            "hash_algo": algo.value,
            "tokens_per_block": config.tokens_per_block,
            "groups": _group_entries(config),
        }
        return cls.from_description(json.dumps(doc, sort_keys=True, separators=(",", ":")))

    @classmethod
    def from_description(cls, description: str | bytes) -> RemoteNamespace:
        """The namespace a :attr:`description` names (as read back from a manifest)."""
        raw = description.encode() if isinstance(description, str) else bytes(description)
        try:
            doc = json.loads(raw)
            algo = hash_algo(doc["hash_algo"])
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"not a namespace description: {raw!r:.120}") from e
        digest = hashlib.sha256(b"kvpool-namespace\0" + raw).digest()[:NAMESPACE_DIGEST_SIZE]
        return cls(raw, digest, algo)

    def scope(self, lora_id: int | None = None, cache_salt: str | None = None) -> ScopeNamespace:
        """The namespace of one reuse scope of this one."""
        salt_id = cache_salt_id(cache_salt) if cache_salt is not None else None
        scope_key = v2_root_key(lora_id=lora_id, salt_id=salt_id)
        digest = hashlib.sha256(b"kvpool-scope\0" + self.digest + scope_key).digest()
        return ScopeNamespace(self, digest[:NAMESPACE_DIGEST_SIZE])


@dataclass(frozen=True, slots=True)
class ScopeNamespace:
    """One reuse scope of a :class:`RemoteNamespace`: the namespace of remote keys and values.

    ``digest`` (16 bytes) is what every value's header carries (:mod:`kvpool.tiers.remote.codec`).
    """

    parent: RemoteNamespace
    digest: bytes

    @property
    def prefix(self) -> bytes:
        """Every remote key of this scope starts with these bytes (``kvp:<digest hex>:``)."""
        return KEY_PREFIX + self.digest.hex().encode() + b":"

    def remote_key(self, key: BlockKey, layer_group: int) -> bytes:
        """The remote key of one layer group's bytes of the block whose full key is ``key``."""
        check_int("layer_group", layer_group, 0)
        return b"%s%s:%d" % (self.prefix, key_bytes(self.parent.algo, key).hex().encode(),
                             layer_group)

    def remote_keys(self, keys: Sequence[BlockKey], layer_group: int) -> list[bytes]:
        """:meth:`remote_key` of each of ``keys`` (one layer group), validated first."""
        check_int("layer_group", layer_group, 0)
        algo = self.parent.algo
        prefix = self.prefix
        suffix = b":%d" % layer_group
        return [prefix + key_bytes(algo, k).hex().encode() + suffix for k in keys]
