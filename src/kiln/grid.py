"""The shape grid: which input shapes a bake compiles and a verify must prove.

A bucket is one point of the cartesian product of the spec's axes, minus the excluded
combinations. Buckets have a stable string key (``batch=4,seq=128``) so that the manifest,
verify reports and bench tables can name them across processes and machines. Torch-free.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kiln.errors import UsageError
from kiln.spec import Spec


@dataclass(frozen=True)
class Bucket:
    sizes: tuple[tuple[str, int], ...]

    @property
    def key(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in self.sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(self.sizes)

    def shape_of(self, shape: Sequence[str | int]) -> tuple[int, ...]:
        sizes = self.as_dict()
        return tuple(sizes[d] if isinstance(d, str) else d for d in shape)

    @classmethod
    def parse(cls, key: str) -> Bucket:
        pairs = (part.split("=", 1) for part in key.split(","))
        return cls(tuple((axis, int(size)) for axis, size in pairs))


def expand(spec: Spec) -> list[Bucket]:
    """All buckets in grid order (axes in spec order, sizes in listed order), minus excludes."""
    axes = list(spec.buckets)
    out: list[Bucket] = []
    for combo in itertools.product(*(spec.buckets[a] for a in axes)):
        sizes = dict(zip(axes, combo, strict=True))
        if any(all(sizes[a] == v for a, v in ex.items()) for ex in spec.exclude):
            continue
        out.append(Bucket(tuple(sizes.items())))
    return out


class Order(str, Enum):
    """The request orders verify and bench take; a ``str``, so ``"grid"`` works as well as
    ``Order.GRID``, and the CLI offers exactly these (a typo is exit 2 before anything runs)."""

    SHUFFLE = "shuffle"  # real traffic (the default)
    GRID = "grid"
    REVERSE = "reverse"


ORDERS = tuple(o.value for o in Order)


def ordered(buckets: list[Bucket], order: str, seed: int = 0) -> list[Bucket]:
    """Buckets in a request order: real traffic does not arrive in grid order."""
    if order == Order.GRID:
        return list(buckets)
    if order == Order.REVERSE:
        return buckets[::-1]
    if order == Order.SHUFFLE:
        out = list(buckets)
        random.Random(seed).shuffle(out)
        return out
    raise UsageError(f"unknown order {order!r} (one of {', '.join(ORDERS)})")


def rotations(buckets: list[Bucket], count: int) -> list[list[Bucket]]:
    """``count`` orders that start with different buckets, spread over the grid.

    Automatic-dynamic shapes compile the *first* shape a process sees statically, so a pod whose
    first request is bucket k needs bucket k's static graph: each pass starts somewhere else.
    """
    n = len(buckets)
    out = [list(buckets), buckets[::-1]]
    step = max(1, n // max(1, count))
    start = step // 2 or 1
    while len(out) < count and start < n:
        out.append(buckets[start:] + buckets[:start])
        start += step
    return out[:count]
