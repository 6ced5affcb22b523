"""A KV-aware cluster on one machine: ``kvpool router`` (proxy on) in front of two
``kvpool serve`` workers (tiny random model), real processes and sockets on 127.0.0.1.

A second request sharing a 1,024-token prefix with an earlier one goes to the worker that
served it, and its ``cached_tokens`` equals the router's matched tokens. The router's
prediction of where routed prefixes go is off (``prediction_ttl_s: 0``), so the match can only
come from the worker's KV events."""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_serve_fixtures import save_tiny_model

TPB = 16
PREFIX = 1024


class Proc:
    """A ``kvpool`` subprocess whose stdout lines are collected by a thread."""

    def __init__(self, *args: str) -> None:
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_line(self, prefix: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"no line {prefix!r}: {self.lines} {err[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _http(base: str, method: str, path: str, body: object = None
          ) -> tuple[int, dict[str, str], Any]:
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        payload = json.loads(raw) if "json" in resp.getheader("Content-Type", "") else raw
        return resp.status, dict(resp.getheaders()), payload
    finally:
        conn.close()


def _matched_tokens(router: str) -> int:
    metrics = _http(router, "GET", "/metrics")[2].decode()
    line = next(x for x in metrics.splitlines()
                if x.startswith("kvpool_router_matched_tokens_total "))
    return int(float(line.split()[1]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    tmp = tmp_path_factory.mktemp("cluster")
    model = save_tiny_model(tmp / "model", seed=2)
    procs: list[Proc] = []
    try:
        workers = [Proc("serve", "--model", str(model), "--port", "0", "--tokens-per-block",
                        str(TPB), "--gpu-blocks", "512", "--kv-events-endpoint",
                        "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0")
                   for _ in range(2)]
        procs += workers
        lines = ["listen: {host: 127.0.0.1, port: 0}", "proxy: true",
                 "router: {prediction_ttl_s: 0}",
                 "ingest: {health_interval_s: 0.2, http_timeout_s: 1.0}", "workers:"]
        for i, w in enumerate(workers):
            events = w.wait_line("kvpool serve publishing KV events on ").split()
            base = w.wait_line("kvpool serve listening on ").split()[-1]
            pub, replay = events[6].rstrip(","), events[8]
            lines.append(f"  - {{id: w{i}, kind: kvpool, zmq_endpoint: '{pub}', "
                         f"replay_endpoint: '{replay}', http_base_url: '{base}', "
                         f"tokens_per_block: {TPB}, hash_algo: v2_sha256_64}}")
        cfg = tmp / "router.yaml"
        cfg.write_text("\n".join(lines) + "\n")
        router = Proc("router", "--config", str(cfg))
        procs.append(router)
        base = router.wait_line("kvpool router listening on ").split()[-1]
        yield base, ["w0", "w1"]
    finally:
        for p in procs:
            p.stop()


def _worker_blocks(router: str, worker: str) -> int:
    view = _http(router, "GET", "/workers")[2]["workers"]
    return int(next(w for w in view if w["id"] == worker)["blocks_per_tier"][0])


def test_shared_prefix_goes_to_the_worker_that_cached_it(cluster: tuple[str, list[str]]) -> None:
    router, _ = cluster
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(PREFIX)]
    first = [*prefix, 1, *range(10, 29)]
    second = [*prefix, 2, *range(30, 49)]
    status, headers, answer = _http(router, "POST", "/v1/completions",
                                    {"prompt": first, "max_tokens": 4, "temperature": 0})
    assert status == 200, answer
    served_by = headers["x-kvpool-worker"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    deadline = time.monotonic() + 30
    while _worker_blocks(router, served_by) < PREFIX // TPB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _worker_blocks(router, served_by) >= PREFIX // TPB
    before = _matched_tokens(router)
    status, headers, answer = _http(router, "POST", "/v1/completions",
                                    {"prompt": second, "max_tokens": 4, "temperature": 0})
    assert status == 200, answer
    matched = _matched_tokens(router) - before
    assert headers["x-kvpool-worker"] == served_by
    assert matched == PREFIX
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == matched
