"""The persistent disk tier's manifest (kvpool.tiers.manifest): crash-safe, validated on read."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool import CacheConfig
from kvpool.errors import InvalidArgumentError, ManifestError, UnsafePathError
from kvpool.hashing.keys import HashAlgo
from kvpool.tiers.manifest import Manifest, ManifestEntry
from kvpool.tiers.remote.namespace import RemoteNamespace
from kvpool.tiers.storage import GroupGeometry


def _ns(algo: HashAlgo = HashAlgo.V2_SHA256, model: str = "m") -> RemoteNamespace:
    cfg = CacheConfig(tokens_per_block=4, gpu_blocks=4, hash_algo=algo,
                      layer_geometry=[GroupGeometry(num_layers=1, kv_heads=1, head_dim=8)])
    return RemoteNamespace.from_config(cfg, model=model)


def _key(algo: HashAlgo, i: int) -> int | bytes:
    return i * 7919 if algo is HashAlgo.V1_BLOCK_KEY else i.to_bytes(32, "big")


def _entry(algo: HashAlgo, group: int, slot: int, i: int) -> ManifestEntry:
    first = i % 3 == 0
    return ManifestEntry(
        group, slot, _key(algo, i), tuple(range(i, i + 1 + i % 4)),
        None if first else _key(algo, i - 1), i * 31,
        lora_id=i if first and i % 2 else None, cache_salt=f"s{i}é" if first else None,
    )


# an operation: ("put", group, slot, i) or ("drop", group, slot, 0)
OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "drop"]), st.integers(0, 1),
                         st.integers(0, 5), st.integers(0, 10_000)), max_size=30)


def _replay(algo: HashAlgo, ops: list[tuple[str, int, int, int]]
            ) -> dict[tuple[int, int], ManifestEntry]:
    state: dict[tuple[int, int], ManifestEntry] = {}
    for op, g, s, i in ops:
        if op == "put":
            state[g, s] = _entry(algo, g, s, i)
        else:
            state.pop((g, s), None)
    return state


def _write(path: Path, algo: HashAlgo, ops: list[tuple[str, int, int, int]]) -> list[int]:
    """Write ``ops``; the file size after each record (the header alone first)."""
    sizes = []
    with Manifest(path, _ns(algo)) as m:
        sizes.append(path.stat().st_size)
        for op, g, s, i in ops:
            if op == "put":
                m.append_put(_entry(algo, g, s, i))
            else:
                m.append_drop(g, s)
            sizes.append(path.stat().st_size)
    return sizes


@given(st.sampled_from(list(HashAlgo)), OPS)
def test_round_trip_and_compaction(algo: HashAlgo, ops: list[tuple[str, int, int, int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "disk.manifest"
        _write(path, algo, ops)
        with Manifest(path, _ns(algo)) as m:
            assert m.entries == _replay(algo, ops) and m.ignored_bytes == 0
            m.compact()
        assert Manifest(path, _ns(algo)).entries == _replay(algo, ops)
        assert not (Path(d) / "disk.manifest.tmp").exists()


@given(OPS, st.data())
def test_damage_yields_only_records_that_were_written(
    ops: list[tuple[str, int, int, int]], data: st.DataObject
) -> None:
    """Truncations and byte flips: the reader keeps a prefix of the records written, whole,
    never an entry that was not written; by default it refuses the file."""
    import tempfile

    algo = HashAlgo.V2_SHA256
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m"
        sizes = _write(path, algo, ops)
        raw = bytearray(path.read_bytes())
        if data.draw(st.booleans()) or len(raw) == sizes[0]:
            cut = data.draw(st.integers(0, len(raw) - 1))
            damaged, first_bad = bytes(raw[:cut]), cut
        else:
            flip = data.draw(st.integers(sizes[0], len(raw) - 1))
            raw[flip] ^= data.draw(st.integers(1, 255))
            damaged, first_bad = bytes(raw), flip
        path.write_bytes(damaged)
        intact = sum(1 for s in sizes[1:] if s <= first_bad)
        if first_bad < sizes[0]:  # the header itself
            with pytest.raises(ManifestError, match="damaged header"):
                Manifest(path, _ns(algo), on_damage="keep_prefix")
        elif damaged == raw[:first_bad] and first_bad in sizes:
            # cut at a record boundary: a shorter log, as a writer killed between two appends
            # leaves it - nothing to detect, and nothing wrong in what is read back
            with Manifest(path, _ns(algo)) as m:
                assert m.entries == _replay(algo, ops[:intact]) and m.ignored_bytes == 0
            # nothing is damaged, so "discard" has nothing to discard either
            assert Manifest(path, _ns(algo), on_damage="discard").entries == _replay(
                algo, ops[:intact])
            return
        else:
            with pytest.raises(ManifestError, match="damaged after byte"):
                Manifest(path, _ns(algo))
            with Manifest(path, _ns(algo), on_damage="keep_prefix") as m:
                assert m.entries == _replay(algo, ops[:intact])
                assert m.ignored_bytes == len(damaged) - sizes[intact]
                m.append_put(_entry(algo, 0, 9, 3))  # appends after the cut
            assert Manifest(path, _ns(algo)).entries == {
                **_replay(algo, ops[:intact]), (0, 9): _entry(algo, 0, 9, 3)}
        path.write_bytes(damaged)
        assert Manifest(path, _ns(algo), on_damage="discard").entries == {}
        assert Manifest(path, _ns(algo)).entries == {}  # rewritten empty, valid


def test_another_namespace_is_refused_or_discarded(tmp_path: Path) -> None:
    path = tmp_path / "m"
    _write(path, HashAlgo.V2_SHA256, [("put", 0, 1, 5)])
    with pytest.raises(ManifestError, match="another namespace"):
        Manifest(path, _ns(model="other"))
    with pytest.raises(ManifestError, match="another namespace"):
        Manifest(path, _ns(HashAlgo.VLLM_SHA256_CBOR))
    with Manifest(path, _ns(model="other"), on_damage="discard") as m:
        assert m.entries == {} and m.ignored_bytes > 0
    assert Manifest(path, _ns(model="other")).entries == {}


def test_bad_entries_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m"
    with Manifest(path, _ns()) as m:
        size = path.stat().st_size
        bad = [
            ManifestEntry(0, 1, b"short", (1,), None, 0),
            ManifestEntry(0, -1, _key(HashAlgo.V2_SHA256, 1), (1,), None, 0),
            ManifestEntry(0, 1, _key(HashAlgo.V2_SHA256, 1), (1 << 31,), None, 0),
            ManifestEntry(0, 1, _key(HashAlgo.V2_SHA256, 2), (1,), _key(HashAlgo.V2_SHA256, 1),
                          0, lora_id=3),
        ]
        for e in bad:
            with pytest.raises(InvalidArgumentError):
                m.append_put(e)
        with pytest.raises(InvalidArgumentError):
            Manifest(tmp_path / "x", _ns(), on_damage="ignore")  # type: ignore[arg-type]
        assert path.stat().st_size == size and m.entries == {}


def test_maybe_compact_shrinks_a_long_log(tmp_path: Path) -> None:
    path = tmp_path / "m"
    with Manifest(path, _ns()) as m:
        for i in range(30_000):
            m.append_put(_entry(HashAlgo.V2_SHA256, 0, i % 10, i))
        assert m.maybe_compact()
        assert path.stat().st_size < 2_000 and not m.maybe_compact()
        m.append_drop(0, 3)
    assert sorted(Manifest(path, _ns()).entries) == [(0, s) for s in range(10) if s != 3]


def test_records_survive_sigkill(tmp_path: Path) -> None:
    """A writer killed with SIGKILL: every record appended before is read back."""
    path = tmp_path / "m"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_manifest import _entry, _ns
        from kvpool.tiers.manifest import Manifest
        m = Manifest({str(path)!r}, _ns())
        for i in range(500):
            m.append_put(_entry(_ns().algo, 0, i, i))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert proc.returncode == -9
    entries = Manifest(path, _ns()).entries
    assert entries == {(0, i): _entry(HashAlgo.V2_SHA256, 0, i, i) for i in range(500)}


@given(st.sampled_from(list(HashAlgo)), OPS, st.lists(st.integers(0, 10_000), max_size=8))
def test_paths_and_batches_round_trip_and_compact(tmp_path_factory: pytest.TempPathFactory,
                                                  algo: HashAlgo,
                                                  ops: list[tuple[str, int, int, int]],
                                                  path_ids: list[int]) -> None:
    """append_many writes drops, paths and puts in one record batch; paths (by key, without
    a slot) survive reopening and compaction and go with clear()."""
    path = tmp_path_factory.mktemp("m") / "manifest"
    paths = {_key(algo, i): _entry(algo, 1, 2, i) for i in path_ids}
    expected_paths = {k: ManifestEntry(0, 0, e.key, e.tokens, e.parent, 0, e.lora_id,
                                       e.cache_salt) for k, e in paths.items()}
    with Manifest(path, _ns(algo)) as m:
        for op, g, s, i in ops:
            if op == "put":
                m.append_many(puts=[_entry(algo, g, s, i)])
            else:
                m.append_many(drops=[(g, s)])
        m.append_many(paths=paths.values())
        assert m.paths == expected_paths
    m = Manifest(path, _ns(algo))
    assert m.entries == _replay(algo, ops) and m.paths == expected_paths
    m.compact()
    m.close()
    m = Manifest(path, _ns(algo))
    assert m.entries == _replay(algo, ops) and m.paths == expected_paths
    m.clear()
    m.close()
    m = Manifest(path, _ns(algo))
    assert m.entries == {} and m.paths == {}
    m.close()


# ---------------------------------------------------------------------------- file safety


def test_a_link_at_the_manifest_or_its_snapshot_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    """A symbolic link planted at the manifest or at its temporary snapshot never makes the
    manifest write through it (an UnsafePathError naming the path), whether it points at a
    file (left as it was) or nowhere (nothing created there)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target, nowhere = outside / "victim", outside / "created"
    target.write_bytes(b"keep me")
    for name in ("m", "m.tmp"):
        for dest in (target, nowhere):
            d = tmp_path / f"{name}-{dest.name}"
            d.mkdir()
            (d / name).symlink_to(dest)
            with pytest.raises(UnsafePathError, match="symbolic link") as err:
                Manifest(d / "m", _ns())
            assert str(d / name) in str(err.value)
            assert target.read_bytes() == b"keep me" and not nowhere.exists()
    # planted while the manifest is open: the compaction refuses, the old log stays usable
    path = tmp_path / "live" / "m"
    path.parent.mkdir()
    with Manifest(path, _ns()) as m:
        m.append_put(_entry(HashAlgo.V2_SHA256, 0, 1, 1))
        (path.parent / "m.tmp").symlink_to(target)
        with pytest.raises(UnsafePathError):
            m.compact()
        m.append_put(_entry(HashAlgo.V2_SHA256, 0, 2, 2))
    assert target.read_bytes() == b"keep me"
    assert sorted(Manifest(path, _ns(), on_damage="raise").entries) == [(0, 1), (0, 2)]


def test_the_manifest_is_private_and_only_a_regular_file_of_ours(tmp_path: Path) -> None:
    path = tmp_path / "m"
    with Manifest(path, _ns()) as m:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        m.append_put(_entry(HashAlgo.V2_SHA256, 0, 1, 1))
        m.compact()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)  # an older release's manifest: narrowed when opened
    Manifest(path, _ns()).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it to read would block: refused at once instead
    with pytest.raises(UnsafePathError, match="not a regular file"):
        Manifest(fifo, _ns())
    if os.geteuid() == 0:  # root can give the file away
        os.chown(path, 12345, 12345)
        with pytest.raises(UnsafePathError, match="belongs to uid 12345"):
            Manifest(path, _ns())


FULL_APPEND = """
import os, resource, signal, sys
sys.path.insert(0, sys.argv[2])
from test_manifest import _entry, _ns
from kvpool.errors import StorageError
from kvpool.tiers.manifest import Manifest
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
m = Manifest(sys.argv[1], _ns())
m.append_put(_entry(_ns().algo, 0, 1, 1))
size = os.path.getsize(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))  # the next record is cut short
try:
    m.append_many(puts=[_entry(_ns().algo, 0, 2, 2), _entry(_ns().algo, 0, 3, 3)])
    print("appended")
except StorageError as exc:
    print("refused", os.path.getsize(sys.argv[1]) == size, sorted(m.entries))
resource.setrlimit(resource.RLIMIT_FSIZE, (20, hard))
try:
    m.compact()  # the snapshot is larger than the limit: the old log stays
except StorageError:
    print("compaction refused", os.listdir(os.path.dirname(sys.argv[1])))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
m.append_put(_entry(_ns().algo, 0, 4, 4))
m.close()
print(sorted(Manifest(sys.argv[1], _ns()).entries))
"""


def test_a_record_that_does_not_fit_leaves_the_log_whole(tmp_path: Path) -> None:
    """A file size limit (in a child: it is per process) cuts an append short: the partial
    record is cut off, the entries unchanged, a compaction that does not fit leaves the old
    log and no snapshot, and later records land after the intact ones."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", FULL_APPEND, str(tmp_path / "m"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "refused True [(0, 1)]", "compaction refused ['m']", "[(0, 1), (0, 4)]"]
