"""The shape grid: which input shapes a bake compiles and a verify must prove.

A bucket is one point of the cartesian product of the spec's axes, minus the excluded
combinations. Buckets have a stable string key (``batch=4,seq=128``) so that the manifest,
verify reports and bench tables can name them across processes and machines. Torch-free.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kiln.errors import ParameterError, UsageError

if TYPE_CHECKING:
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


# --- shards: one grid baked by several machines --------------------------------------------
SHARD_PATTERN = re.compile(r"^(\d{1,9})/(\d{1,9})$")


@dataclass(frozen=True)
class Shard:
    """Slice ``index`` (0-based) of ``count``: ``kiln bake --shard I/N``.

    0-based because a Kubernetes Indexed Job hands each pod ``JOB_COMPLETION_INDEX`` from 0, so
    ``--shard $(JOB_COMPLETION_INDEX)/N`` needs no arithmetic in a shell.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ParameterError(
                "shard", self, "the shard count must be at least 1", shown=str(self)
            )
        if not 0 <= self.index < self.count:
            raise ParameterError(
                "shard",
                self,
                f"the index counts from 0, so it is at most {self.count - 1}",
                shown=str(self),
            )

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def suffix(self) -> str:
        """``.shard-1-of-3``: in a shard's default artifact name."""
        return f".shard-{self.index}-of-{self.count}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``I/N`` as the command line gives it; anything else is exit 2, one line."""
        match = SHARD_PATTERN.match(text.strip())
        if not match:
            raise ParameterError("shard", text, "expected INDEX/COUNT, e.g. 0/3 (0-based)")
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def of(cls, value: Shard | tuple[int, int] | str) -> Shard:
        """What the library takes: a :class:`Shard`, ``(index, count)`` or ``"I/N"``."""
        if isinstance(value, Shard):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        index, count = value
        return cls(int(index), int(count))


def bucket_cost(bucket: Bucket) -> int:
    """How much a bucket's warmup calls and autotuning cost, relative to the others: its size
    (the product of its axis sizes; fixed dimensions are the same for every bucket)."""
    return math.prod(size for _, size in bucket.sizes)


def assign_shards(buckets: list[Bucket], count: int) -> dict[str, int]:
    """Every bucket's shard: balanced, and the same on every machine (it depends on the grid only).

    Each static bucket is a whole compile, and that fixed cost dominates (on CPU a bucket's
    compile time hardly depends on its size), so shards first get equal numbers of buckets (±1);
    among shards with as many, the bucket goes to the one with the least total size, so the
    larger shapes (which warm up and autotune longer) are spread out. Buckets are dealt largest
    first (ties by key), shards tie by index: no set or dict order, no machine state.
    """
    if count > len(buckets):
        raise UsageError(
            f"{count} shards for a grid of {len(buckets)} bucket(s): a shard would be empty; "
            f"use at most {len(buckets)} shards"
        )
    loads = [(0, 0)] * count  # (buckets, total size) per shard
    out: dict[str, int] = {}
    for bucket in sorted(buckets, key=lambda b: (-bucket_cost(b), b.key)):
        shard = min(range(count), key=lambda i: (loads[i], i))
        n, size = loads[shard]
        loads[shard] = (n + 1, size + bucket_cost(bucket))
        out[bucket.key] = shard
    return out


def shard_buckets(buckets: list[Bucket], shard: Shard) -> list[Bucket]:
    """The buckets ``shard`` bakes, in grid order. Every bucket is in exactly one shard."""
    assignment = assign_shards(buckets, shard.count)
    return [b for b in buckets if assignment[b.key] == shard.index]


def shard_grid(spec: Spec, buckets: list[Bucket], shard: Shard) -> list[Bucket]:
    """The slice of ``buckets`` (``spec``'s grid) that ``shard`` bakes; exit 2 where sharding
    cannot give what one process would.

    Only static shapes (``dynamic: false``) split: each bucket is then its own graph, whoever
    compiles it. With automatic or forced dynamic shapes a process's graphs (and the PGO profile
    it writes) depend on every shape it has seen, so shards would bake graphs a single process
    never serves, and their profiles would collide in ``kiln merge``. A distributed spec shards
    like any other: every rank of a shard bakes the shard's buckets, and ``kiln merge`` pairs the
    shards' ranks up.
    """
    if spec.compile.dynamic is not False:
        raise ParameterError(
            "shard",
            shard,
            f"sharding needs compile.dynamic: false (this spec has {spec.compile.dynamic}): "
            "with dynamic shapes a process's graphs depend on every shape it saw",
            shown=str(shard),
        )
    if spec.compile.precompile_route == "frames":
        raise ParameterError(
            "shard",
            shard,
            "precompile: true with graph breaks is unsharded for now: torch saves all of a "
            "forward's frames in one file, which every shard would write",
            shown=str(shard),
        )
    return shard_buckets(buckets, shard)


def off_grid(sizes: dict[str, int], baked: list[dict[str, int]]) -> str | None:
    """Why a bucket of ``sizes`` is outside the grid an artifact baked (``baked``: each baked
    bucket's sizes), or None when it is in it: the axis value the bake never used
    (``seq=64 is not in the baked grid (seq: 32, 128)``), else the combination. A served
    bucket outside the grid compiles by design; a torch guard quoted instead
    (``expected 32, actual 64``) reads like a cache fault."""
    if not baked or sizes in baked:
        return None
    key = ",".join(f"{a}={s}" for a, s in sizes.items())
    if set(sizes) != set(baked[0]):  # another model's grid: no size of it was baked
        return f"{key} is not in the baked grid (its axes are {', '.join(baked[0])})"
    for axis, size in sizes.items():
        values = sorted({b[axis] for b in baked if axis in b})
        if values and size not in values:
            shown = ", ".join(map(str, values))
            return f"{axis}={size} is not in the baked grid ({axis}: {shown})"
    return f"{key} is not in the baked grid (excluded, or another shard's)"
