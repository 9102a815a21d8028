from __future__ import annotations

import pytest

from kiln.errors import UsageError
from kiln.grid import Bucket, Order, expand, ordered, rotations
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
