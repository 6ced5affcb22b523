"""What the engine tests that hold the engine against transformers' dense forward share: one
torch thread per test module, seeded tiny models built once with their dense reference, and
the check of one finished request's logits.

A test module imports ``one_thread`` (an autouse fixture: importing it is what applies it)
after its ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvpool.engine import RequestOutput

TOL = 1e-4
"""The largest abs difference allowed between the engine's logits and the dense forward's."""


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (and do not fight other processes for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_pairs(build: Callable[[str], Any]) -> Callable[[str], tuple[Any, Any]]:
    """``pair(kind)``: (engine model, dense reference) with the same weights, ``build(kind)``
    in fp32 eval mode, built once per kind."""
    built: dict[str, tuple[Any, Any]] = {}

    def pair(kind: str) -> tuple[Any, Any]:
        if kind not in built:
            model = build(kind).float().eval()
            built[kind] = (model, copy.deepcopy(model))
        return built[kind]

    return pair


def check_dense(ref: Any, out: RequestOutput, *, device: str = "cpu",
                diffs: list[float] | None = None) -> None:
    """``out``'s logits equal ``ref``'s dense forward over the same tokens (max abs diff <=
    :data:`TOL`, appended to ``diffs`` first when given) and its tokens are the dense argmax."""
    assert out.logits is not None
    prompt, gen = out.prompt_token_ids, out.token_ids
    assert len(out.logits) == len(gen)
    with torch.no_grad():
        dense = ref(torch.tensor([prompt + gen], device=device)).logits[0]
    n = len(prompt)
    expected = dense[n - 1:n - 1 + len(gen)]
    diff = float((expected - torch.stack(out.logits)).abs().max())
    if diffs is not None:
        diffs.append(diff)
    assert diff <= TOL, f"{out.request_id}: max abs diff {diff}"
    assert expected.argmax(-1).tolist() == gen


def assert_all_within_tol(diffs: list[float], what: str) -> None:
    """Every comparison in ``diffs`` was within :data:`TOL`, and there was one; prints how
    many there were and the largest difference."""
    assert diffs and max(diffs) <= TOL
    print(f"\n{what}: {len(diffs)} comparisons, max abs diff {max(diffs):.3g}")
