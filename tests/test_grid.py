from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import UsageError
from kiln.grid import (
    Bucket,
    Order,
    Shard,
    assign_shards,
    expand,
    ordered,
    rotations,
    shard_buckets,
    shard_grid,
)
from kiln.spec import load_spec
from tests.conftest import mlp_spec


def test_expand_with_exclude(write_spec) -> None:
    text = mlp_spec(buckets="batch: [1, 4]\nseq: [32, 128, 512]").replace(
        "shape: [batch, 16]", "shape: [batch, seq]"
    )
    text += "exclude: [{batch: 4, seq: 512}, {seq: 32}]\n"
    keys = [b.key for b in expand(load_spec(write_spec(text)))]
    assert keys == ["batch=1,seq=128", "batch=1,seq=512", "batch=4,seq=128"]


def test_bucket_shapes_and_parse() -> None:
    b = Bucket.parse("batch=4,seq=128")
    assert b.shape_of(["batch", "seq", 8]) == (4, 128, 8)
    assert b.key == "batch=4,seq=128"


def test_orders_are_permutations() -> None:
    grid = [Bucket((("b", i),)) for i in range(1, 8)]
    for order in ("grid", "reverse", "shuffle"):
        assert sorted(ordered(grid, order, seed=1), key=lambda b: b.key) == sorted(
            grid, key=lambda b: b.key
        )
    assert ordered(grid, "shuffle", 1) == ordered(grid, "shuffle", 1)
    assert ordered(grid, "shuffle", 1) != grid


def test_rotations_start_on_different_buckets() -> None:
    grid = [Bucket((("b", i),)) for i in range(1, 7)]
    orders = rotations(grid, 4)
    assert len(orders) == 4
    assert len({o[0] for o in orders}) == 4
    assert all(sorted(o, key=lambda b: b.key) == sorted(grid, key=lambda b: b.key) for o in orders)


def test_an_unknown_order_is_a_usage_error() -> None:
    """A library caller's typo is exit 2 with the choices, not a ValueError (exit 1)."""
    with pytest.raises(UsageError, match=r"'random'.*shuffle, grid, reverse"):
        ordered([Bucket((("b", 1),))], "random")
    assert [o.value for o in Order] == ["shuffle", "grid", "reverse"]
    assert ordered([Bucket((("b", 1),))], Order.REVERSE) == [Bucket((("b", 1),))]


# --- shards (issue 14) ------------------------------------------------------------------------
def test_shard_parse() -> None:
    assert Shard.parse("0/3") == Shard(0, 3) == Shard.of((0, 3)) == Shard.of("0/3")
    assert str(Shard.parse(" 2/3 ")) == "2/3"
    for bad, why in (
        ("3/3", "at most 2"),
        ("5/3", "at most 2"),
        ("0/0", "at least 1"),
        ("1", "INDEX/COUNT"),
        ("-1/3", "INDEX/COUNT"),
        ("a/b", "INDEX/COUNT"),
        ("1/3/4", "INDEX/COUNT"),
        ("", "INDEX/COUNT"),
    ):
        with pytest.raises(UsageError, match=why) as err:
            Shard.parse(bad)
        assert "\n" not in err.value.message


def _grid(sizes: list[int]) -> list[Bucket]:
    return [Bucket((("batch", s),)) for s in sizes]


def test_shards_balance_counts_then_sizes() -> None:
    """Equal bucket counts (compiles dominate), then the large shapes spread: 32 with 1, 16
    with 2, 8 with 4; a size-only greedy would give one shard 4 of the 6 compiles."""
    grid = _grid([1, 2, 4, 8, 16, 32])
    slices = [[b.as_dict()["batch"] for b in shard_buckets(grid, Shard(i, 3))] for i in range(3)]
    assert slices == [[1, 32], [2, 16], [4, 8]]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40, unique=True),
    extra=st.lists(st.integers(1, 64), min_size=1, max_size=3, unique=True),
    count=st.integers(1, 40),
    seed=st.integers(0, 1000),
)
def test_every_bucket_in_exactly_one_shard(
    sizes: list[int], extra: list[int], count: int, seed: int
) -> None:
    grid = [Bucket((("batch", s), ("seq", e))) for s in sizes for e in extra]
    if count > len(grid):
        with pytest.raises(UsageError, match="a shard would be empty"):
            assign_shards(grid, count)
        return
    slices = [shard_buckets(grid, Shard(i, count)) for i in range(count)]
    keys = [b.key for s in slices for b in s]
    assert sorted(keys) == sorted(b.key for b in grid)  # each once
    assert all(slices) and max(map(len, slices)) - min(map(len, slices)) <= 1
    for s in slices:  # grid order inside a shard
        assert s == [b for b in grid if b in s]
    # The same slices whatever order a machine happens to hold the grid in.
    shuffled = list(grid)
    random.Random(seed).shuffle(shuffled)
    assert assign_shards(shuffled, count) == assign_shards(grid, count)


def test_shard_grid_needs_static_shapes(write_spec) -> None:
    spec = load_spec(write_spec(mlp_spec(dynamic="null")))
    with pytest.raises(UsageError, match=r"needs compile\.dynamic: false"):
        shard_grid(spec, expand(spec), Shard(0, 2))
    static = load_spec(write_spec(mlp_spec()))
    assert [b.key for b in shard_grid(static, expand(static), Shard(1, 3))] == ["batch=3"]
    with pytest.raises(UsageError, match="4 shards for a grid of 3"):
        shard_grid(static, expand(static), Shard(0, 4))
