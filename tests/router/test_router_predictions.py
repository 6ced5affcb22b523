"""The router's predictions against a plain model: a count per (key, slot)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.router.predictions import Predictions

_keys = st.lists(st.integers(0, 12), max_size=10)  # few keys: shared and repeated ones
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), _keys),
        st.tuples(st.just("remove"), st.integers(0, 50), st.just([])),
        st.tuples(st.just("start"), st.integers(0, 50), st.just([])),
        st.tuples(st.just("expire"), st.integers(0, 5), st.just([])),
        st.tuples(st.just("drop_slot"), st.integers(0, 3), st.just([])),
    ),
    max_size=40,
)


def _masks(refs: Counter[tuple[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for (key, slot), n in refs.items():
        if n:
            out[key] = out.get(key, 0) | 1 << slot
    return out


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_predictions_equal_a_count_per_key_and_slot(
    ops: list[tuple[str, int, list[int]]],
) -> None:
    """Requests add keys (some repeated within a request, many shared between requests and
    slots), end one by one, start their TTL and expire, or lose their slot: the masks are
    those of the model at every step, and no empty count is kept."""
    pred = Predictions(ttl_s=2.0)
    refs: Counter[tuple[int, int]] = Counter()
    live: list[tuple[int, list[int]]] = []  # routed, not started
    queued: list[tuple[float, int, list[int]]] = []
    now = 0.0
    for op, arg, keys in ops:
        now += 1.0
        if op == "add":
            pred.add(arg, keys)
            refs.update((k, arg) for k in keys)
            live.append((arg, keys))
        elif op in ("remove", "start") and live:
            slot, keys = live.pop(arg % len(live))
            if op == "remove":
                pred.remove(slot, keys)
                refs.subtract((k, slot) for k in keys)
            else:
                pred.start(slot, keys, now)
                queued.append((now + 2.0, slot, keys))
        elif op == "expire":
            now += arg
            pred.expire(now)
            for item in [q for q in queued if q[0] <= now]:
                queued.remove(item)
                refs.subtract((k, item[1]) for k in item[2])
        elif op == "drop_slot":
            pred.drop_slot(arg)
            for item in [q for q in queued if q[1] == arg]:
                queued.remove(item)
                refs.subtract((k, arg) for k in item[2])
        assert pred.masks == _masks(refs)
        assert len(pred) == sum(1 for n in refs.values() if n)
        assert all(c > 0 for extra in pred._extra.values() for c in extra.values())
        assert all(pred._extra.values())
