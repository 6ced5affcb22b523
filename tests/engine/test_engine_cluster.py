"""A KV-aware cluster on one machine: ``kvpool router`` (proxy on) in front of two
``kvpool serve`` workers (tiny random model), real processes and sockets on 127.0.0.1.

A second request sharing a 1,024-token prefix with an earlier one goes to the worker that
served it, and its ``cached_tokens`` equals the router's matched tokens. The router's
prediction of where routed prefixes go is off (``prediction_ttl_s: 0``), so the match can only
come from the worker's KV events."""

from __future__ import annotations

import os
import random
import stat
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_serve_fixtures import KvpoolProcess, http_request, save_tiny_model, stop_all

TPB = 16
PREFIX = 1024


def _matched_tokens(router: str) -> int:
    metrics = http_request(router, "GET", "/metrics")[2].decode()
    line = next(x for x in metrics.splitlines()
                if x.startswith("kvpool_router_matched_tokens_total "))
    return int(float(line.split()[1]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    tmp = tmp_path_factory.mktemp("cluster")
    model = save_tiny_model(tmp / "model", seed=2)
    procs: list[KvpoolProcess] = []
    try:
        workers = [
            KvpoolProcess("serve", "--model", str(model), "--port", "0", "--tokens-per-block",
                          str(TPB), "--gpu-blocks", "512", "--kv-events-endpoint",
                          "tcp://127.0.0.1:0")  # replay: ipc://* by default
            for _ in range(2)
        ]
        procs += workers
        lines = ["listen: {host: 127.0.0.1, port: 0}", "proxy: true",
                 "router: {prediction_ttl_s: 0}",
                 "ingest: {health_interval_s: 0.2, http_timeout_s: 1.0}", "workers:"]
        for i, w in enumerate(workers):
            events = w.wait_line("kvpool serve publishing KV events on ").split()
            base = w.wait_line("kvpool serve listening on ").split()[-1]
            pub, replay = events[6].rstrip(","), events[8]
            # the replay socket (every cached prompt's token ids): only this user reaches it
            assert replay.startswith("ipc://"), replay
            assert stat.S_IMODE(os.stat(replay[len("ipc://"):]).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(os.path.dirname(replay[len("ipc://"):])).st_mode) == 0o700
            lines.append(f"  - {{id: w{i}, kind: kvpool, zmq_endpoint: '{pub}', "
                         f"replay_endpoint: '{replay}', http_base_url: '{base}', "
                         f"tokens_per_block: {TPB}, hash_algo: v2_sha256_64}}")
        cfg = tmp / "router.yaml"
        cfg.write_text("\n".join(lines) + "\n")
        router = KvpoolProcess("router", "--config", str(cfg))
        procs.append(router)
        base = router.wait_line("kvpool router listening on ").split()[-1]
        yield base, ["w0", "w1"]
    finally:
        stop_all(procs)


def _worker_blocks(router: str, worker: str) -> int:
    view = http_request(router, "GET", "/workers")[2]["workers"]
    return int(next(w for w in view if w["id"] == worker)["blocks_per_tier"][0])


def test_shared_prefix_goes_to_the_worker_that_cached_it(cluster: tuple[str, list[str]]) -> None:
    router, _ = cluster
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(PREFIX)]
    first = [*prefix, 1, *range(10, 29)]
    second = [*prefix, 2, *range(30, 49)]
    status, headers, answer = http_request(router, "POST", "/v1/completions",
                                    {"prompt": first, "max_tokens": 4, "temperature": 0})
    assert status == 200, answer
    served_by = headers["x-kvpool-worker"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    deadline = time.monotonic() + 30
    while _worker_blocks(router, served_by) < PREFIX // TPB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _worker_blocks(router, served_by) >= PREFIX // TPB
    before = _matched_tokens(router)
    status, headers, answer = http_request(router, "POST", "/v1/completions",
                                    {"prompt": second, "max_tokens": 4, "temperature": 0})
    assert status == 200, answer
    matched = _matched_tokens(router) - before
    assert headers["x-kvpool-worker"] == served_by
    assert matched == PREFIX
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == matched
