"""The router configuration: the shipped examples load, the listen keys, errors name the key."""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec
import pytest
import yaml

from kvpool.errors import ConfigError
from kvpool.router.config import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_PROMPT_TOKENS,
    IngestOptions,
    ListenOptions,
    RouterOptions,
    ServiceConfig,
    WorkerConfig,
    WorkerKind,
    load_config,
    parse_config,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ONE = [{"id": "a", "kind": "kvpool"}]


def test_vllm_example_has_two_vllm_workers_with_events_replay_and_the_cbor_hash() -> None:
    cfg = load_config(EXAMPLES / "router-vllm.yaml")
    assert [(w.id, w.kind) for w in cfg.workers] == [
        ("vllm-0", WorkerKind.VLLM), ("vllm-1", WorkerKind.VLLM),
    ]
    assert {w.zmq_endpoint for w in cfg.workers} == {"tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567"}
    assert all(w.replay_endpoint and w.hash_algo == "vllm_sha256_cbor" for w in cfg.workers)
    assert cfg.proxy and cfg.workers[1].http_base_url == "http://127.0.0.1:8002"


def test_trtllm_example_polls_http_workers_with_the_trtllm_score() -> None:
    cfg = load_config(EXAMPLES / "router-trtllm.yaml")
    assert cfg.router.mode == "trtllm"
    assert [w.kind for w in cfg.workers] == [WorkerKind.TRTLLM, WorkerKind.TRTLLM]
    assert all(w.zmq_endpoint is None and w.hash_algo is None for w in cfg.workers)


def test_kvpool_example_names_the_hash_or_matches_by_tokens() -> None:
    cfg = load_config(EXAMPLES / "router-kvpool.yaml")
    assert [w.kind for w in cfg.workers] == [WorkerKind.KVPOOL, WorkerKind.KVPOOL]
    assert cfg.workers[0].hash_algo == "v2_sha256"
    assert cfg.workers[1].match_by_tokens and cfg.workers[1].hash_algo is None
    assert cfg.router.tier_weights == (1.0, 0.75, 0.25)


def test_listen_defaults_and_the_body_limit_holds_the_longest_prompt() -> None:
    cfg = parse_config({"workers": ONE})
    assert (cfg.host, cfg.port) == (cfg.listen.host, cfg.listen.port) == ("127.0.0.1", 8000)
    assert cfg.listen.auth_token_env is None
    assert cfg.listen.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 10 << 20
    # a prompt of MAX_PROMPT_TOKENS 7-digit ids as JSON, with room to spare
    body = len(b'{"token_ids": [' + b"1234567, " * MAX_PROMPT_TOKENS + b"]}")
    assert body + (64 << 10) <= DEFAULT_MAX_BODY_BYTES
    cfg = parse_config({"workers": ONE, "listen": {"max_body_bytes": 1 << 30,
                                                   "auth_token_env": "ROUTER_TOKEN"}})
    assert (cfg.listen.max_body_bytes, cfg.listen.auth_token_env) == (1 << 30, "ROUTER_TOKEN")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"listen": {"max_body_bytes": 0}}, "listen.max_body_bytes: expected int >= 1, got 0"),
        ({"listen": {"auth_token_env": "my token"}}, "listen.auth_token_env: expected str"),
        ({"listen": {"auth_token_env": 5}}, "listen.auth_token_env: expected str | null, got int"),
        ({"listen": {"hots": "x"}},
         "listen.hots: unknown key (expected one of host, port, max_body_bytes, max_connections, "
         "keepalive_timeout_s, body_timeout_s, auth_token_env)"),
        ({"rooter": {}}, "rooter: unknown key (expected one of workers, router, ingest, listen,"),
        ({"router": {"mode": "fast"}}, "router.mode: 'fast' is not one of approx, cost, trtllm"),
        ({"router": {"seed": True}}, "router.seed: expected int, got bool"),
        ({"router": {"load_weight": math.inf}}, "router.load_weight: expected a finite number"),
        ({"router": {"temperature": math.nan}}, "router.temperature: expected float >= 0.0"),
        ({"workers": [{"id": "a", "kind": "sglang"}]},
         "workers[0].kind: 'sglang' is not one of vllm, trtllm, kvpool"),
        ({"workers": [{"id": 3, "kind": "kvpool"}]}, "workers[0].id: expected str, got int"),
        ({"workers": [{"id": "", "kind": "kvpool"}]}, "workers[0].id: expected str of length >= 1"),
        ({"workers": [{"id": "a", "kind": "kvpool"}, "b"]},
         "workers[1]: expected object, got str"),
        ({1: 2}, "config: keys must be strings"),
    ],
)
def test_errors_start_with_the_key_path_and_say_what_was_wrong(
    raw: dict[object, object], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"workers": ONE, **raw})
    assert str(info.value).startswith(message)


def test_the_reference_documents_every_key_and_its_example_loads() -> None:
    text = (ROOT / "docs" / "router.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example is not None
    cfg = parse_config(yaml.safe_load(example.group(1)))
    assert cfg.listen.auth_token_env == "ROUTER_TOKEN"
    assert [w.kind for w in cfg.workers] == [WorkerKind.VLLM, WorkerKind.TRTLLM]
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    for struct in (ServiceConfig, ListenOptions, RouterOptions, IngestOptions, WorkerConfig):
        for field in msgspec.structs.fields(struct):
            if field.type not in (ListenOptions, RouterOptions, IngestOptions):
                assert field.name in rows or field.name == "workers", field.name
    # and the defaults the tables state are the structures' defaults
    assert f"`{DEFAULT_MAX_BODY_BYTES}` (10 MiB)" in text
    assert f"| `load_weight` | number ≥ 0 | `{RouterOptions().load_weight}` |" in text
    weights = ", ".join(str(w) for w in RouterOptions().tier_weights)
    assert f"| `tier_weights` | 3 numbers in [0, 1] | `[{weights}]` |" in text
