"""The serving half of bucketing: which baked bucket a request fits, and what padding costs.

A bake compiles a grid of shapes; a server receives whatever sizes its users send. Padding each
request up to the smallest baked bucket that holds it keeps every call inside the compiled
guards, and this module decides the bucket, for :mod:`kiln.compiler.padded` (which pads
tensors) and for engines that pad themselves::

    grid = PadGrid.from_manifest(read_manifest("/opt/kiln/cache"))
    grid.fit(batch=3, seq=137)  # {"batch": 4, "seq": 256}

An axis is padded only when every input that carries it declares a ``pad`` value in the spec
(``inputs[].pad``); any other axis must match a baked size exactly. "Smallest" is the least
padded work, the product of the bucket's axis sizes (fixed dimensions are the same for every
bucket), ties going to the first bucket in grid order. Only baked buckets count: exclusions
and a shard's missing slices are never fitted. Torch-free: the grid comes from the manifest,
which init containers and routers read without torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import TypeAdapter, ValidationError

from kiln.artifact.manifest import Manifest
from kiln.errors import IntegrityError, UsageError
from kiln.grid import Bucket, expand
from kiln.spec import InputSpec, Spec

Sizes = dict[str, int]
_INPUTS = TypeAdapter(list[InputSpec])


class OffGridError(UsageError):
    """A request no baked bucket holds (``on_miss: error``): larger than the largest bucket, a
    size of an axis that is not padded which no bucket has, or an empty axis (``seq=0``)."""


class ShapeError(UsageError):
    """Inputs whose shapes do not match the spec: another rank, a fixed dimension that differs,
    one axis with two sizes, an input missing."""


@dataclass(frozen=True)
class PadInput:
    """One input as the padding path sees it: its dimensions (axis names or fixed sizes) and
    the value it is padded with (None: never padded)."""

    name: str
    shape: tuple[str | int, ...]
    pad: bool | int | float | None = None
    dtype: str | None = None  # the spec's (``int64``); a request of another compiles anew

    def axes(self) -> list[tuple[int, str]]:
        """(dimension, axis) for every dimension that is a bucket axis."""
        return [(d, a) for d, a in enumerate(self.shape) if isinstance(a, str)]


@dataclass(frozen=True)
class PadGrid:
    """The baked buckets of one artifact (or spec), the inputs, and the axes that pad."""

    axes: tuple[str, ...]
    points: tuple[tuple[int, ...], ...]  # every baked bucket, sizes in ``axes`` order
    inputs: tuple[PadInput, ...]
    paddable: frozenset[str]
    _by_work: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _fits: dict[tuple[int, ...], tuple[int, ...] | None] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        for point in self.points:
            if len(point) != len(self.axes):
                raise ValueError(f"bucket {point} does not name every axis of {self.axes}")
        unknown = self.paddable - set(self.axes)
        if unknown:
            raise ValueError(f"padded axes {sorted(unknown)} are not axes of this grid")
        order = {p: i for i, p in enumerate(self.points)}
        ranked = sorted(order, key=lambda p: (math.prod(p), order[p]))
        object.__setattr__(self, "_by_work", tuple(ranked))

    # --- construction ------------------------------------------------------------------
    @classmethod
    def from_spec(
        cls,
        spec: Spec,
        buckets: Sequence[Bucket] | None = None,
        paddable: Iterable[str] | None = None,
    ) -> PadGrid:
        """The grid ``spec`` bakes (or only ``buckets`` of it); ``paddable`` overrides which
        axes pad (default: the spec's, :meth:`kiln.spec.Spec.paddable_axes`)."""
        axes = tuple(spec.buckets)
        points = [tuple(b.as_dict()[a] for a in axes) for b in buckets or expand(spec)]
        inputs = tuple(PadInput(i.name, tuple(i.shape), i.pad, i.dtype) for i in spec.inputs)
        chosen = spec.paddable_axes() if paddable is None else list(paddable)
        return cls(axes, tuple(points), inputs, frozenset(chosen))

    @classmethod
    def from_manifest(cls, manifest: Manifest, paddable: Iterable[str] | None = None) -> PadGrid:
        """The buckets ``manifest`` says were baked, with its spec's inputs and pad values.

        ``paddable``: the axes a caller that pads by itself rounds up (default: those the spec
        declares ``pad`` for). The manifest comes from elsewhere: a spec section that does not
        describe its grid is an :class:`~kiln.errors.IntegrityError`, never a wrong bucket.
        """
        try:
            inputs = _INPUTS.validate_python(manifest.spec.get("inputs"))
        except ValidationError as exc:
            raise IntegrityError(f"{manifest.name}: the manifest's spec inputs: {exc}") from None
        axes: list[str] = []
        for inp in inputs:
            axes += [d for d in inp.shape if isinstance(d, str) and d not in axes]
        ordered = [a for a in manifest.spec.get("buckets") or {} if a in axes]
        axes = ordered + [a for a in axes if a not in ordered]
        points = []
        for stats in manifest.grid:
            if set(stats.sizes) != set(axes):
                raise IntegrityError(
                    f"{manifest.name}: bucket {stats.key} does not size the axes {axes}"
                )
            points.append(tuple(stats.sizes[a] for a in axes))
        declared = [
            a
            for a in axes
            if all(i.pad is not None for i in inputs if a in i.shape)  # carried by one at least
        ]
        chosen = declared if paddable is None else list(paddable)
        pads = tuple(PadInput(i.name, tuple(i.shape), i.pad, i.dtype) for i in inputs)
        return cls(tuple(axes), tuple(dict.fromkeys(points)), pads, frozenset(chosen))

    # --- questions -----------------------------------------------------------------------
    @property
    def pads(self) -> bool:
        """Whether any axis pads: without one, serving passes requests through untouched."""
        return bool(self.paddable)

    def sizes(self) -> dict[str, list[int]]:
        """Each axis's baked sizes, ascending."""
        return {a: sorted({p[i] for p in self.points}) for i, a in enumerate(self.axes)}

    def fit(self, sizes: Mapping[str, int] | None = None, /, **kw: int) -> Sizes:
        """The smallest baked bucket that holds ``sizes`` (every axis named), as axis sizes;
        :class:`OffGridError`, saying why, when none does; :class:`ShapeError` for a request no
        bucket choice makes right (an axis missing or unknown, a size below 0)."""
        request = self._request({**(sizes or {}), **kw})
        found = self._fit(request)
        if found is None:
            raise OffGridError(self.why_off_grid(request))
        return dict(zip(self.axes, found, strict=True))

    def lookup(self, sizes: Mapping[str, int]) -> Sizes | None:
        """:meth:`fit`, with None for a request off the grid."""
        found = self._fit(self._request(sizes))
        return None if found is None else dict(zip(self.axes, found, strict=True))

    def _request(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        missing = [a for a in self.axes if a not in sizes]
        extra = [a for a in sizes if a not in self.axes]
        if missing or extra:
            what = f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(extra)}"
            raise ShapeError(f"a request names every axis ({', '.join(self.axes)}): {what}")
        request = tuple(int(sizes[a]) for a in self.axes)
        negative = [f"{a}={n}" for a, n in zip(self.axes, request, strict=True) if n < 0]
        if negative:  # no tensor has such a size: a caller's bug, which no bucket must hide
            raise ShapeError(f"a request's sizes are never negative: {', '.join(negative)}")
        return request

    def _fit(self, request: tuple[int, ...]) -> tuple[int, ...] | None:
        if 0 in request:  # padded up, the call would compute nothing but padding: no bucket's
            return None
        if request in self._fits:
            return self._fits[request]
        rounds = [a in self.paddable for a in self.axes]
        found = next(
            (
                p
                for p in self._by_work
                if all(
                    (b >= r) if up else (b == r)
                    for b, r, up in zip(p, request, rounds, strict=True)
                )
            ),
            None,
        )
        if len(self._fits) < _FIT_MEMO:
            self._fits[request] = found
        return found

    def why_off_grid(self, request: Sequence[int]) -> str:
        """One line on why no bucket holds ``request`` (sizes in axis order)."""
        shown = _key(self.axes, request)
        sizes = self.sizes()
        for axis, size in zip(self.axes, request, strict=True):
            baked = sizes[axis]
            if size == 0:
                return f"{shown} is off the grid: {axis} is empty, and no bucket is"
            if axis in self.paddable and size > baked[-1]:
                return (
                    f"{shown} is off the grid: {axis}={size} is larger than its largest "
                    f"bucket ({baked[-1]})"
                )
            if axis not in self.paddable and size not in baked:
                why = "not every input carrying it" if self.pads else "no input"
                return (
                    f"{shown} is off the grid: {axis} is not padded ({why} declares `pad`) "
                    f"and {size} is not a baked size ({_listed(baked)})"
                )
        return f"{shown} is off the grid: every bucket that holds it was excluded or not baked"

    def axis_sizes(self, shapes: Mapping[str, Sequence[int]]) -> Sizes:
        """Each axis's size in a request, read from its inputs' shapes (by input name).

        :class:`ShapeError` when an input is missing, has another rank or another fixed
        dimension, or two inputs disagree on an axis: such a call would fail in the model too,
        and no bucket choice can make it right.
        """
        out: Sizes = {}
        for inp in self.inputs:
            if inp.name not in shapes:
                raise ShapeError(f"input {inp.name!r} is missing from the call")
            shape = tuple(shapes[inp.name])
            if len(shape) != len(inp.shape):
                raise ShapeError(
                    f"input {inp.name!r} has {len(shape)} dimensions, the spec says "
                    f"{len(inp.shape)} ({_dims(inp.shape)})"
                )
            for d, (want, got) in enumerate(zip(inp.shape, shape, strict=True)):
                if isinstance(want, int):
                    if want != got:
                        raise ShapeError(
                            f"input {inp.name!r} dimension {d} is {got}, the spec fixes it "
                            f"at {want}"
                        )
                elif out.setdefault(want, got) != got:
                    raise ShapeError(
                        f"axis {want!r} is {out[want]} in one input and {got} in {inp.name!r}"
                    )
        return out

    def shape_of(self, inp: PadInput, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """``inp``'s shape at these axis sizes."""
        return tuple(sizes[d] if isinstance(d, str) else d for d in inp.shape)


_FIT_MEMO = 1 << 16  # distinct request shapes remembered per grid (a few MB at most)


def work(sizes: Mapping[str, int], weights: Mapping[str, float] | None = None) -> float:
    """A call's cost as the planner and the reports count it: the product of its axis sizes,
    each raised to its weight (default 1; ``seq: 2`` for attention quadratic in length)."""
    weights = weights or {}
    return math.prod(size ** weights.get(axis, 1) for axis, size in sizes.items())


def waste(
    request: Mapping[str, int],
    bucket: Mapping[str, int],
    weights: Mapping[str, float] | None = None,
) -> float:
    """The share of a padded call's work spent on padding: 0 for an exact fit."""
    return 1.0 - work(request, weights) / work(bucket, weights)


def _key(axes: Sequence[str], sizes: Sequence[int]) -> str:
    return ",".join(f"{a}={s}" for a, s in zip(axes, sizes, strict=True))


def shape_key(sizes: Mapping[str, int]) -> str:
    """``batch=3,seq=137``: how logs and reports name a request, as buckets are named."""
    return ",".join(f"{a}={s}" for a, s in sizes.items())


def _listed(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", …" if len(values) > limit else "")


def _dims(shape: Sequence[str | int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"
