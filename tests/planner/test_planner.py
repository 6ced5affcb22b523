"""Capacity planner: block needs by brute force, hand-computed plans, and plan invariants."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import CapacityError, InvalidArgumentError
from kvpool.planner.capacity import (
    KVCacheDesc,
    LayerSpec,
    ModelSpec,
    batch_need,
    blocks_needed,
    parse_size,
    plan_pools,
    presets,
    split_budget,
)

# --------------------------------------------------------------------------- brute force


def brute_blocks(desc: KVCacheDesc, tpb: int, window: int | None, sink: int) -> int:
    """Blocks holding a kept position, found by listing the positions one by one."""
    h, c = desc.history_length, desc.capacity
    if window is None:
        kept = set(range(c))
    else:
        kept = {p for p in range(c) if p < sink or p >= h - window - 1}
    return len({p // tpb for p in kept})


def brute_floors(
    model: ModelSpec, tpb: int, batch: int, num_tokens: int, seq_len: int
) -> list[int]:
    """The three always-on constraints of the planner, evaluated position by position."""
    chunk = min(num_tokens, seq_len)
    out = []
    for g in model.layer_groups():
        w, s = g.window, g.sink_tokens
        out.append(
            max(
                batch * brute_blocks(KVCacheDesc(tpb, tpb - 1), tpb, w, s),
                brute_blocks(KVCacheDesc(seq_len, seq_len - chunk), tpb, w, s),
                brute_blocks(KVCacheDesc(chunk, 0), tpb, w, s),
            )
        )
    return out


@st.composite
def descs(draw: st.DrawFn, max_cap: int = 80) -> KVCacheDesc:
    cap = draw(st.integers(0, max_cap))
    return KVCacheDesc(cap, draw(st.integers(0, cap)))


@given(
    desc=descs(),
    tpb=st.integers(1, 9),
    window=st.none() | st.integers(1, 40),
    sink=st.integers(0, 20),
)
def test_blocks_needed_matches_position_enumeration(
    desc: KVCacheDesc, tpb: int, window: int | None, sink: int
) -> None:
    if window is None:
        sink = 0
    assert blocks_needed(desc, tpb, window, sink) == brute_blocks(desc, tpb, window, sink)


def test_blocks_needed_small_window_examples() -> None:
    # tpb 4, window 2: positions [h-3, c) are kept.
    assert blocks_needed(KVCacheDesc(4, 3), 4, 2) == 1  # keeps 0..3: block 0
    assert blocks_needed(KVCacheDesc(5, 4), 4, 2) == 2  # keeps 1..4: blocks 0, 1
    assert blocks_needed(KVCacheDesc(8, 7), 4, 2) == 1  # keeps 4..7: block 1
    assert blocks_needed(KVCacheDesc(40, 39), 4, 2, sink_tokens=5) == 3  # blocks 0, 1 and 9
    assert blocks_needed(KVCacheDesc(40, 0), 4, None) == 10
    assert blocks_needed(KVCacheDesc(0, 0), 4, None) == 0


# --------------------------------------------------------------------------- model geometry


def test_presets_have_public_geometries() -> None:
    llama = ModelSpec.preset("llama-3-8b")
    (group,) = llama.layer_groups()
    assert group.window is None and len(group.layers) == 32
    assert group.bytes_per_block(32) == 4 * 2**20  # 32 layers × K,V × 32 tok × 8 × 128 × 2 B

    gemma2 = ModelSpec.preset("gemma-2-9b").layer_groups()
    assert [(g.window, len(g.layers)) for g in gemma2] == [(4096, 21), (None, 21)]
    assert gemma2[0].layers[:3] == (0, 2, 4)

    gemma3 = ModelSpec.preset("gemma-3-12b").layer_groups()
    assert [(g.window, len(g.layers)) for g in gemma3] == [(1024, 40), (None, 8)]
    assert gemma3[1].layers == tuple(range(5, 48, 6))

    (mistral,) = ModelSpec.preset("mistral-7b").layer_groups()
    assert mistral.window == 4096
    assert "tiny" in presets()


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ModelSpec.preset("gpt-9")
    for name in presets():
        assert name in str(err.value)


def test_groups_are_numbered_by_first_layer_and_sum_their_layers() -> None:
    model = ModelSpec(
        "m",
        (
            LayerSpec(8, kv_heads=1, head_dim=4, sink_tokens=2, dtype="float16"),
            LayerSpec(None, kv_heads=2, head_dim=4, dtype="float32"),
            LayerSpec(8, kv_heads=1, head_dim=4, dtype="float16"),
            LayerSpec(8, kv_heads=3, head_dim=4, sink_tokens=2, dtype="fp8"),
        ),
        100,
    )
    groups = model.layer_groups()
    assert [(g.window, g.sink_tokens, g.layers) for g in groups] == [
        (8, 2, (0, 3)),
        (None, 0, (1,)),
        (8, 0, (2,)),
    ]
    assert [g.bytes_per_block(2) for g in groups] == [
        2 * 2 * (1 * 4 * 2 + 3 * 4 * 1),
        2 * 2 * 2 * 4 * 4,
        2 * 2 * 1 * 4 * 2,
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVCacheDesc(3, 4),
        lambda: KVCacheDesc(-1, 0),
        lambda: LayerSpec(None, kv_heads=1, head_dim=4, sink_tokens=2),
        lambda: LayerSpec(0, kv_heads=1, head_dim=4),
        lambda: LayerSpec(4, kv_heads=0, head_dim=4),
        lambda: LayerSpec(4, kv_heads=1, head_dim=4, dtype="float13"),
        lambda: ModelSpec("empty", (), 10),
    ],
)
def test_bad_specs_raise(make: object) -> None:
    with pytest.raises(InvalidArgumentError):
        make()  # type: ignore[operator]


# --------------------------------------------------------------------------- hand-computed plans

# group 0: full attention, layers 0 and 2: (1 + 2 heads) × 4 dims × K,V × 2 B = 48 B/token
# group 1: window 6, layer 1: 1 head × 4 dims × K,V × 2 B = 16 B/token
SMALL = ModelSpec(
    "small",
    (
        LayerSpec(None, kv_heads=1, head_dim=4, dtype="float16"),
        LayerSpec(6, kv_heads=1, head_dim=4, dtype="float16"),
        LayerSpec(None, kv_heads=2, head_dim=4, dtype="float16"),
    ),
    32,
)
LIMITS = {"max_batch_size": 3, "max_num_tokens": 8, "max_seq_len": 32}


def test_small_model_floors_and_split() -> None:
    # tpb 4 → 192 and 64 bytes per block.
    # concurrent decode 3 × (4, 3): 3 and 3. longest sequence (32, 24): full 8 blocks; window
    # keeps [17, 32) = blocks 4..7 → 4. largest chunk (8, 0): 2 and 2. Floors (8, 4).
    # Typical step (8, 0) + 2 × (16, 15): full 2 + 4 + 4 = 10; window 2 + 2 × 2 = 6.
    # k = 10000 / (10·192 + 6·64) = 4.34: 43.4 and 26.04 → 43 and 26 (9920 B); 80 B left buy
    # one window slot (remainder 0.04 > 0, 64 B ≤ 80 B), not a full one (192 B).
    # Host 1000 B, no floors: k = 0.434: 4.34 and 2.60 → 4 and 2 (896 B); the window's larger
    # remainder takes one more slot (64 B), leaving 40 B.
    plan = plan_pools(SMALL, 4, 10_000, 1000, **LIMITS)
    assert [g.bytes_per_block for g in plan.groups] == [192, 64]
    assert [g.min_slots for g in plan.groups] == [8, 4]
    assert [g.floor_reason for g in plan.groups] == ["longest_sequence", "longest_sequence"]
    assert [g.typical_need for g in plan.groups] == [10, 6]
    assert plan.gpu_blocks == {0: 43, 1: 27}
    assert plan.host_blocks == {0: 4, 1: 3}
    assert plan.disk_blocks == {0: 0, 1: 0}
    assert plan.used_bytes(0) == 43 * 192 + 27 * 64


def test_small_model_binding_floor() -> None:
    # Typical step (32, 31): full 8, window keeps [24, 32) = 2 blocks. k = 3000 / 1664 = 1.80:
    # the window's 3.6 is below its floor 4, so it takes 4 (256 B) and the full group gets
    # ⌊2744 / 192⌋ = 14 slots (56 B left).
    plan = plan_pools(SMALL, 4, 3000, typical_step=[KVCacheDesc(32, 31)], **LIMITS)
    assert plan.gpu_blocks == {0: 14, 1: 4}


def test_caller_constraint_can_set_the_floor() -> None:
    many_short = [KVCacheDesc(6, 5)] * 5  # window keeps [0, 6): 2 blocks each; full 2 each
    plan = plan_pools(SMALL, 4, 10_000, constraints=[many_short], **LIMITS)
    assert [g.min_slots for g in plan.groups] == [10, 10]
    assert [g.floor_reason for g in plan.groups] == ["constraint[0]"] * 2
    assert plan.constraints[-1].needs == (10, 10)


def test_concurrent_decode_floor_for_a_window_smaller_than_a_block() -> None:
    # Seed 004: with window 3 < tpb 16 a long-history decode keeps one or two blocks, so only
    # the concurrent-decode constraint keeps the window pool from shrinking to that.
    model = ModelSpec(
        "swa",
        (LayerSpec(None, kv_heads=1, head_dim=8), LayerSpec(3, kv_heads=1, head_dim=8)),
        4096,
    )
    plan = plan_pools(
        model,
        16,
        2**30,
        max_batch_size=64,
        max_num_tokens=16,
        max_seq_len=4096,
        typical_step=[KVCacheDesc(4096, 4095)],
    )
    window = plan.groups[1]
    assert window.min_slots == 64 and window.floor_reason == "concurrent_decode"
    assert plan.gpu_blocks[1] >= 64
    assert plan.constraints[1].needs[1] <= 2  # what a long-history-only planner would use


def test_infeasible_budget_reports_deficit_and_minimum() -> None:
    # Floors (8, 4) × (192, 64) B = 1792 B.
    plan_pools(SMALL, 4, 1792, **LIMITS)
    with pytest.raises(CapacityError) as err:
        plan_pools(SMALL, 4, 1791, **LIMITS)
    assert err.value.min_budget_bytes == 1792
    assert err.value.deficit == {0: 1, 1: 1}  # 8·1791//1792 = 7 and 4·1791//1792 = 3
    assert "1792 bytes" in str(err.value)


def test_plan_serialises_and_feeds_cache_config() -> None:
    from kvpool.config import CacheConfig

    model = ModelSpec(
        "sinky",
        (
            LayerSpec(None, kv_heads=1, head_dim=8),
            LayerSpec(16, kv_heads=1, head_dim=8, sink_tokens=4),
        ),
        512,
    )
    plan = plan_pools(
        model, 8, 10**6, 10**5, 10**4, max_batch_size=4, max_num_tokens=64, max_seq_len=512
    )
    data = json.loads(json.dumps(plan.to_dict()))
    assert [g["slots"]["gpu"] for g in data["groups"]] == list(plan.gpu_blocks.values())
    assert data["constraints"][0]["batch"] == [{"capacity": 8, "history_length": 7, "count": 4}]
    kwargs = plan.cache_config_kwargs()
    assert kwargs["window_sizes"] == [None, 16] and kwargs["sink_tokens"] == [0, 4]
    cfg = CacheConfig(**kwargs)
    assert cfg.slots[0] == tuple(plan.gpu_blocks.values())
    assert cfg.slots[2] == tuple(plan.disk_blocks.values())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GiB", 40 * 2**30),
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 gib", 3 * 2**29),
        ("123", 123),
        ("64kb", 64_000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "40 GiBs", "-1", "4e9", "1.2.3MB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="bad size"):
        parse_size(text)


# --------------------------------------------------------------------------- plan properties


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    layers = []
    for _ in range(draw(st.integers(1, 5))):
        window = draw(st.none() | st.integers(1, 200))
        sink = 0 if window is None else draw(st.sampled_from([0, 0, 4, 33]))
        layers.append(
            LayerSpec(
                window,
                kv_heads=draw(st.integers(1, 4)),
                head_dim=draw(st.sampled_from([4, 8, 64])),
                sink_tokens=sink,
                dtype=draw(st.sampled_from(["float16", "float32", "fp8"])),
            )
        )
    return ModelSpec("generated", tuple(layers), 4096)


limits = st.fixed_dictionaries(
    {
        "tpb": st.integers(1, 64),
        "max_batch_size": st.integers(1, 64),
        "max_num_tokens": st.integers(1, 1024),
        "max_seq_len": st.integers(1, 2048),
    }
)


@given(model=models(), lim=limits, extra=st.integers(0, 10**8), host=st.integers(0, 10**7))
def test_plan_invariants(model: ModelSpec, lim: dict[str, int], extra: int, host: int) -> None:
    tpb = lim.pop("tpb")
    groups = model.layer_groups()
    bpb = [g.bytes_per_block(tpb) for g in groups]
    floors = brute_floors(
        model, tpb, lim["max_batch_size"], lim["max_num_tokens"], lim["max_seq_len"]
    )
    minimum = sum(f * b for f, b in zip(floors, bpb, strict=True))
    gpu = minimum + extra

    plan = plan_pools(model, tpb, gpu, host, **lim)

    assert [g.min_slots for g in plan.groups] == floors
    for g in plan.groups:
        assert g.slots_per_tier[0] >= g.min_slots >= lim["max_batch_size"]
    for tier, budget in enumerate((gpu, host, 0)):
        assert plan.used_bytes(tier) <= budget
        assert sum(g.slots_per_tier[tier] * g.bytes_per_block for g in plan.groups) <= budget

    # When no floor binds, GPU slots follow the typical step's needs within one slot.
    needs = batch_need(plan.typical_step.batch, groups, tpb)
    k = Fraction(gpu, sum(n * b for n, b in zip(needs, bpb, strict=True)))
    if all(k * n >= f for n, f in zip(needs, floors, strict=True)):
        for g, n in zip(plan.groups, needs, strict=True):
            assert abs(g.slots_per_tier[0] - k * n) < 1
    # Colder tiers have no floors: they always follow the typical step.
    kh = Fraction(host, sum(n * b for n, b in zip(needs, bpb, strict=True)))
    for g, n in zip(plan.groups, needs, strict=True):
        assert abs(g.slots_per_tier[1] - kh * n) < 1


@given(model=models(), lim=limits)
def test_minimum_budget_is_exact(model: ModelSpec, lim: dict[str, int]) -> None:
    tpb = lim.pop("tpb")
    bpb = [g.bytes_per_block(tpb) for g in model.layer_groups()]
    floors = brute_floors(
        model, tpb, lim["max_batch_size"], lim["max_num_tokens"], lim["max_seq_len"]
    )
    minimum = sum(f * b for f, b in zip(floors, bpb, strict=True))

    with pytest.raises(CapacityError) as err:
        plan_pools(model, tpb, minimum - 1, **lim)
    assert err.value.min_budget_bytes == minimum
    assert err.value.deficit and all(v > 0 for v in err.value.deficit.values())
    assert str(minimum) in str(err.value)

    plan = plan_pools(model, tpb, err.value.min_budget_bytes, **lim)
    assert list(plan.gpu_blocks.values()) == floors


@given(
    data=st.data(),
    n=st.integers(1, 5),
    budget_extra=st.integers(0, 10**6),
)
def test_split_budget_water_fills(data: st.DataObject, n: int, budget_extra: int) -> None:
    bpb = data.draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    weights = data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    floors = data.draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    budget = sum(f * b for f, b in zip(floors, bpb, strict=True)) + budget_extra
    slots = split_budget(budget, bpb, weights, floors)
    assert all(s >= f for s, f in zip(slots, floors, strict=True))
    assert sum(s * b for s, b in zip(slots, bpb, strict=True)) <= budget
    # Nothing wasted beyond rounding: less than one slot of every group is left over.
    assert budget - sum(s * b for s, b in zip(slots, bpb, strict=True)) < sum(bpb)
    # Water-filling: a group above its floor sits at the common level k (to within a slot) and
    # every other group is at or above it, so (slots_i − 1) / w_i < k < (slots_j + 1) / w_j.
    for i in range(n):
        if slots[i] > floors[i]:
            for j in range(n):
                assert (slots[i] - 1) * weights[j] < (slots[j] + 1) * weights[i]


def test_plan_pools_rejects_bad_limits() -> None:
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        plan_pools(SMALL, 4, 10_000, max_batch_size=0, max_num_tokens=8, max_seq_len=32)
    with pytest.raises(InvalidArgumentError, match="typical_step"):
        plan_pools(SMALL, 4, 10_000, typical_step=[], **LIMITS)


def test_arguments_of_the_wrong_shape_are_typed_errors() -> None:
    layer = LayerSpec(None, kv_heads=1, head_dim=8)
    model = ModelSpec("m", (layer,), 64)
    limits = {"max_batch_size": 2, "max_num_tokens": 16, "max_seq_len": 64}
    with pytest.raises(InvalidArgumentError, match="layers must be a sequence"):
        ModelSpec("m", 3, 64)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        LayerSpec(None, kv_heads=1, head_dim=8, dtype=["bfloat16"])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="model must be a ModelSpec"):
        plan_pools("m", 4, 1 << 20, **limits)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="max_batch_size must be <="):
        plan_pools(model, 4, 1 << 20, max_batch_size=2**70, max_num_tokens=16, max_seq_len=64)
    with pytest.raises(InvalidArgumentError, match=r"constraints\[0\] must be a sequence"):
        plan_pools(model, 4, 1 << 20, constraints=[None], **limits)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="typical_step must be a sequence"):
        plan_pools(model, 4, 1 << 20, typical_step=5, **limits)  # type: ignore[arg-type]
