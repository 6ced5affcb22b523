"""KvpoolHiCacheStorage against SGLang 0.5.23's own code: its storage factory's dynamic loader,
its CPU host pool (``MHATokenToKVPoolHost``), and the storage methods of its
``HiCacheController`` (``_page_backup``, ``_storage_hit_query``, ``_page_get_zero_copy``,
``_generic_page_get``/``_generic_page_set``) driving the backend as SGLang's I/O threads do.

SGLang is installed by ``tests/peers/install_sglang.sh .venv`` (the wheel with --no-deps and
the few packages its HiCache modules import); ``tests/peers/sglang_env.py`` shims torchvision,
which PyPI cannot provide for a CPU torch, and builds SGLang's pools and configs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.errors import ConfigError, InvalidArgumentError, StorageError

sys.path.insert(0, str(Path(__file__).parents[1] / "peers"))
import sglang_env

sglang_env.install_torchvision_shim()
warnings.filterwarnings("ignore", module="sglang")
try:
    from sglang.srt.managers.cache_controller import (
        HiCacheController,
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError as exc:  # the tests need SGLang's own code, never a stand-in
    raise ImportError(f"SGLang 0.5.23 is not importable ({exc}); install it with "
                      "tests/peers/install_sglang.sh .venv") from exc

from kvpool.integrations.sglang import KvpoolHiCacheStorage  # noqa: E402

PS = 4  # tokens per page of the test pools


@pytest.fixture(scope="module")
def pool() -> Any:
    return sglang_env.host_pool("page_first", page_size=PS)


@pytest.fixture(scope="module")
def pool_lf() -> Any:
    return sglang_env.host_pool("layer_first", page_size=PS)


def indices(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices (token slots) of whole pages."""
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def fill(pool: Any, pages: list[int], seed: int) -> list[bytes]:
    """Random bytes into the pool's pages; the bytes of each (SGLang's flat data page)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in pages:
        page = pool.get_data_page(p * PS, flat=False).view(torch.uint8)
        page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen))
        out.append(read(pool, p))
    return out


def read(pool: Any, page: int) -> bytes:
    return bytes(pool.get_data_page(page * PS).view(torch.uint8).numpy().tobytes())


def wipe(pool: Any, pages: list[int]) -> None:
    for p in pages:
        pool.get_data_page(p * PS, flat=False).view(torch.uint8).fill_(0xA5)


def tokens(n_pages: int, salt: int = 0) -> list[int]:
    return [(salt * 7919 + i) % 50_000 for i in range(n_pages * PS)]


class Controller:
    """The attributes SGLang's ``HiCacheController`` storage methods read, and those methods
    (SGLang's own functions, called on this object as they are on a controller)."""

    def __init__(self, backend: Any, pool: Any, *, zero_copy: bool = True) -> None:
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = pool
        self.page_size = pool.page_size
        get = HiCacheController._page_get_zero_copy if zero_copy else \
            HiCacheController._generic_page_get
        put = HiCacheController._page_set_zero_copy if zero_copy else \
            HiCacheController._generic_page_set
        self.page_get_func = partial(get, self)
        self.page_set_func = partial(put, self)

    def backup(self, host_indices: torch.Tensor, hashes: list[str]) -> int:
        op = StorageOperation(host_indices, [], hash_value=hashes)
        HiCacheController._page_backup(self, op)
        return int(op.completed_tokens)

    def query(self, token_ids: list[int]) -> tuple[list[str], int]:
        hashes, count = HiCacheController._storage_hit_query(
            self, PrefetchOperation("req", token_ids))
        return list(hashes), int(count)

    def load(self, hashes: list[str], host_indices: torch.Tensor) -> int:
        return int(self.page_get_func(PrefetchOperation("req", []), hashes, host_indices))


def hashes_of(token_ids: list[int]) -> list[str]:
    return list(get_storage_hash_str(token_ids, None, page_size=PS))


def disk(tmp_path: Path, name: str = "disk", pages: int = 64, **more: Any) -> dict[str, Any]:
    return {"disk_path": str(tmp_path / name), "disk_bytes": pages * 512, **more}


# ---------------------------------------------------------------------- loading, options


def test_dynamic_loader_builds_it_and_refuses_bad_options(tmp_path: Path, pool: Any) -> None:
    backend = sglang_env.create(disk(tmp_path), pool)
    try:
        assert isinstance(backend, KvpoolHiCacheStorage)
        assert isinstance(backend, HiCacheStorage)
        assert backend.pages is not None and backend.pages.page_bytes == 512
        assert backend.pages.segments == 2  # page_first MHA: the K run and the V run
    finally:
        backend.close()
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({}, ConfigError, "disk_path"),
        ({"disk_path": str(tmp_path / "x")}, ConfigError, "go together"),
        ({**disk(tmp_path), "disk_bytes": "lots"}, ConfigError, "disk_bytes"),
        ({**disk(tmp_path), "eviction_policy": "mru"}, ConfigError, "eviction_policy"),
        ({**disk(tmp_path), "disk_pth": "/tmp"}, ConfigError, "disk_pth"),
        ({"remote_url": "http://127.0.0.1:1"}, InvalidArgumentError, "remote_url"),
        ({**disk(tmp_path), "remote_timeout_s": 0}, ConfigError, "remote_timeout_s"),
    ]
    for extra, error, words in bad:
        with pytest.raises(error, match=words):
            sglang_env.create(extra, pool)
    with pytest.raises(ConfigError, match="holds no page"):
        sglang_env.create({**disk(tmp_path), "disk_bytes": 100}, pool)


def test_kvpool_never_imports_sglang_and_says_when_it_is_missing() -> None:
    """``import kvpool`` (and the integration's options) leave SGLang alone; without SGLang
    the class lookup raises SGLangUnavailableError, an ImportError SGLang's loader reports."""
    code = (
        "import sys\n"
        "import kvpool, kvpool.integrations.sglang as s\n"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)\n"
        "sys.modules['sglang'] = None  # as if SGLang were not installed\n"
        "try:\n"
        "    s.KvpoolHiCacheStorage\n"
        "except s.SGLangUnavailableError as e:\n"
        "    assert isinstance(e, ImportError) and 'sglang==0.5.23' in str(e)\n"
        "    print('OK')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.stdout.strip() == "OK", done.stderr[-2000:]


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "mla_page_first"])
def test_controller_round_trip_bit_exact(tmp_path: Path, layout: str, pool: Any,
                                         pool_lf: Any) -> None:
    """SGLang's backup and prefetch calls; pages written through the zero-copy interface
    read back through the generic one and the other way round, bit for bit (MHA pools in
    both layouts, and an MLA pool)."""
    mla = layout.startswith("mla")
    host = {"page_first": pool, "layer_first": pool_lf}.get(layout) or \
        sglang_env.mla_host_pool("page_first", page_size=PS)
    backend = sglang_env.create(disk(tmp_path), host, mla=mla)
    try:
        for writer_zero_copy, salt in ((True, 1), (False, 2)):
            writer = Controller(backend, host, zero_copy=writer_zero_copy)
            reader = Controller(backend, host, zero_copy=not writer_zero_copy)
            ids = tokens(6, salt)
            want = fill(host, list(range(6)), seed=salt)
            assert writer.backup(indices(list(range(6))), hashes_of(ids)) == 6 * PS
            found, count = reader.query(ids + tokens(3, salt + 100))
            assert (found, count) == (hashes_of(ids), 6 * PS)
            wipe(host, list(range(10, 16)))
            assert reader.load(found, indices(list(range(10, 16)))) == 6
            assert [read(host, p) for p in range(10, 16)] == want
        metrics = backend.get_stats()
        assert isinstance(metrics, StorageMetrics)
        assert metrics.prefetch_pgs == [6] and metrics.backup_pgs == [6]  # the v1 calls
        assert backend.get_stats().prefetch_pgs == []  # samples are handed over once
    finally:
        backend.close()


def test_single_page_calls_and_clear(tmp_path: Path, pool: Any) -> None:
    backend = sglang_env.create(disk(tmp_path), pool)
    try:
        want = fill(pool, [3], seed=5)[0]
        assert backend.set("p3", pool.get_data_page(3 * PS))
        assert backend.exists("p3") and not backend.exists("nope")
        target = pool.get_dummy_flat_data_page()
        assert backend.get("p3", target) is target
        assert bytes(target.view(torch.uint8).numpy().tobytes()) == want
        assert backend.get("nope", pool.get_dummy_flat_data_page()) is None
        assert backend.batch_get(["p3", "nope"], [pool.get_dummy_flat_data_page()] * 2)[1] is None
        assert backend.clear() and not backend.exists("p3")
        assert backend.batch_set_v1(["a"], indices([3])) == [True] and backend.exists("a")
    finally:
        backend.close()


def test_eviction_keeps_capacity_and_never_serves_wrong_bytes(tmp_path: Path,
                                                              pool: Any) -> None:
    backend = sglang_env.create(disk(tmp_path, pages=4, eviction_policy="lru"), pool)
    try:
        want = {}
        for i in range(10):
            want[f"k{i}"] = fill(pool, [i % 8], seed=100 + i)[0]
            assert backend.batch_set_v1([f"k{i}"], indices([i % 8])) == [True]
        assert backend.stats()["disk"]["pages"] == 4
        held = [k for k in want if backend.exists(k)]
        assert held == ["k6", "k7", "k8", "k9"]  # LRU: the last four stores
        for k in want:
            wipe(pool, [20])
            ok = backend.batch_get_v1([k], indices([20]))[0]
            assert ok == (k in held)
            if ok:
                assert read(pool, 20) == want[k]
    finally:
        backend.close()


# ---------------------------------------------------------------------- damage on disk


def test_damaged_disk_bytes_are_misses_and_the_page_can_be_stored_again(
        tmp_path: Path, pool: Any) -> None:
    backend = sglang_env.create(disk(tmp_path), pool)
    try:
        want = fill(pool, [0, 1, 2], seed=9)
        keys = ["d0", "d1", "d2"]
        assert backend.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
        assert backend.disk is not None
        (kvp,) = Path(backend.disk.directory).glob("*.kvp")
        with open(kvp, "r+b") as f:  # flip one byte of the second page's V run
            f.seek(1 * 512 + 300)
            byte = f.read(1)
            f.seek(1 * 512 + 300)
            f.write(bytes([byte[0] ^ 0xFF]))
        wipe(pool, [10, 11, 12])
        assert backend.batch_get_v1(keys, indices([10, 11, 12])) == [True, False, True]
        assert read(pool, 10) == want[0] and read(pool, 12) == want[2]
        assert backend.batch_exists(keys) == 1  # the damaged page is forgotten
        assert backend.stats()["disk"]["damaged"] == 1
        assert backend.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
        assert backend.batch_get_v1(keys, indices([10, 11, 12])) == [True] * 3
        assert [read(pool, p) for p in (10, 11, 12)] == want
    finally:
        backend.close()


# ---------------------------------------------------------------------- restart, full disk


def _restart_check(path: str, expect_file: str) -> dict[str, Any]:
    """In a new process: the pages stored by the test, found and read back bit-exact."""
    pool = sglang_env.host_pool("page_first", page_size=PS)
    want = json.loads(Path(expect_file).read_text())
    keys, pages = want["keys"], [bytes.fromhex(h) for h in want["pages"]]
    backend = sglang_env.create({"disk_path": path, "disk_bytes": 64 * 512}, pool)
    try:
        found = backend.batch_exists(keys)
        ok = backend.batch_get_v1(keys, indices(list(range(20, 20 + len(keys)))))
        equal = [read(pool, 20 + i) == page for i, page in enumerate(pages)]
        return {"found": found, "ok": ok, "equal": equal,
                "restored": backend.stats()["disk"]["restored"]}
    finally:
        backend.close()


def _full_disk_check(directory: str) -> dict[str, Any]:
    """On a small tmpfs: fill the disk under a running storage, then free it again."""
    pool = sglang_env.host_pool("page_first", page_size=PS)
    backend = sglang_env.create({"disk_path": f"{directory}/a", "disk_bytes": 32 * 512}, pool)
    out: dict[str, Any] = {}
    try:
        want: dict[str, bytes] = {}
        stored: dict[str, bool] = {}

        def put(i: int) -> bool:
            key = f"f{i}"
            want[key] = fill(pool, [i % 8], seed=1000 + i)[0]
            stored[key] = backend.batch_set_v1([key], indices([i % 8]))[0]
            return stored[key]

        out["before"] = [put(i) for i in range(4)]
        filler = Path(directory) / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for _ in range(1024):  # bounded: the tmpfs is 256 KiB
                try:
                    os.write(fd, b"\0" * 4096)
                except OSError:
                    break
        finally:
            os.close(fd)
        # the file's slots were reserved at start: stores fail once the manifest outgrows
        # the tmpfs page it ends in
        results: list[bool] = []
        for i in range(4, 400):
            results.append(put(i))
            if results.count(False) >= 3:
                break
        out["while_full"] = results
        wrong = 0
        for key, page in want.items():
            wipe(pool, [30])
            ok = backend.batch_get_v1([key], indices([30]))[0]
            wrong += ok and read(pool, 30) != page
            out.setdefault("unstored_but_found", 0)
            out["unstored_but_found"] += ok and not stored[key]
        out["wrong_bytes"] = wrong
        try:
            sglang_env.create({"disk_path": f"{directory}/b", "disk_bytes": 32 * 512}, pool)
            out["start_on_full_disk"] = "started"
        except StorageError as exc:
            out["start_on_full_disk"] = str(exc)
        filler.unlink()
        out["after"] = [put(i) for i in range(400, 404)]
        wipe(pool, [30])
        out["after_read"] = (backend.batch_get_v1(["f403"], indices([30]))[0]
                             and read(pool, 30) == want["f403"])
        out["write_failures"] = backend.stats()["disk"]["write_failures"]
    finally:
        backend.close()
    return out


def _child(argv: list[str]) -> None:
    result = {"restart": _restart_check(argv[0], argv[1])}
    if len(argv) > 2:
        result["full_disk"] = _full_disk_check(argv[2])
    print("RESULT " + json.dumps(result), flush=True)


def test_new_process_finds_every_page_and_a_full_disk_fails_stores_only(
        tmp_path: Path, pool: Any) -> None:
    backend = sglang_env.create(disk(tmp_path), pool)
    keys = hashes_of(tokens(8, 42))
    want = fill(pool, list(range(8)), seed=42)
    assert Controller(backend, pool).backup(indices(list(range(8))), keys) == 8 * PS
    backend.close()
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps({"keys": keys, "pages": [p.hex() for p in want]}))
    child = [sys.executable, __file__, str(tmp_path / "disk"), str(expect)]
    full = tmp_path / "full"
    full.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs tmpfs {full}"],
                           capture_output=True, text=True)
    if probe.returncode == 0:  # a private mount namespace with a 256 KiB tmpfs
        child = ["unshare", "-rm", "sh", "-c",
                 'mount -t tmpfs -o size=256k tmpfs "$1" && shift && exec "$@"', "sh",
                 str(full), *child, str(full)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[2] / "src"), str(Path(__file__).parent)])}
    done = subprocess.run(child, capture_output=True, text=True, timeout=480, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["restart"] == {"found": 8, "ok": [True] * 8, "equal": [True] * 8,
                                 "restored": 8}
    if probe.returncode != 0:
        pytest.skip(f"no private tmpfs for the full-disk part: {probe.stderr.strip()}")
    fd = result["full_disk"]
    assert fd["before"] == [True] * 4
    assert False in fd["while_full"]  # the disk filled up: stores failed ...
    assert fd["wrong_bytes"] == 0 and fd["unstored_but_found"] == 0  # ... nothing wrong read
    assert "bytes free" in fd["start_on_full_disk"]  # a new tier on a full disk: a clear error
    assert fd["after"] == [True] * 4 and fd["after_read"]  # space again: stores work
    assert fd["write_failures"] >= 1


if __name__ == "__main__":
    _child(sys.argv[1:])
