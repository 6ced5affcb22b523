"""Warm restart under the engine: a tiny random transformers model's prefix computed by one
engine, left on a persistent disk tier, is reused by a new engine on the same disk.path, and
its logits equal transformers' dense forward (max abs diff <= 1e-4, as in
test_engine_logits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine_logits import Pair, tokens  # noqa: E402
from test_persist import crash  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("ending", ["killed", "closed"])
@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
def test_a_restarted_engine_reuses_the_prefix_from_disk(model_name: str, ending: str,
                                                        tmp_path: Path) -> None:
    cache: dict[str, Any] = {"gpu_blocks": 16, "host_blocks": 8, "disk_blocks": 40,
                             "disk": {"path": str(tmp_path), "persistent": True,
                                      "sync_interval_s": None},
                             "model_id": f"tiny-{model_name}"}
    first = Pair(model_name, cache, max_batch_size=2)
    base = tokens(9, 22)
    first.run([base])
    for i in range(4):  # push base's blocks off the GPU and the host to disk
        first.run([tokens(20 + i, 25)], max_tokens=4)
    if ending == "killed":
        crash(first.engine.manager)
    else:
        first.engine.manager.close()
    second = Pair(model_name, cache, max_batch_size=2)  # same seed: the same weights
    disk = second.engine.manager.persistent_disk
    assert disk is not None and disk.restored.blocks > 0 and disk.restored.stale == 0
    out = second.run([base[:20] + tokens(10, 3)])[0]  # logits checked against dense
    assert out.cached_tokens == 20
    assert second.engine.manager.stats().tier_hits[2] > 0
    second.engine.manager.close()
