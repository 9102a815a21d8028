"""``kiln plan``: bucket lists chosen from observed traffic, so padding wastes the least.

Every bucket is a compile at bake time; every request pays for the padding up to its bucket.
Given the shapes a server saw (:mod:`kiln.traffic`), the planner picks each padded axis's
sizes to minimise the expected padded work (the product of a request's padded axis sizes, each
raised to its weight: ``seq: 2`` for attention that is quadratic in length) under a bucket
count, or under a bake-time budget estimated from an artifact's own per-bucket times.

One axis is solved exactly. Bucket boundaries can always sit on observed sizes (lowering a
bucket to the largest request it holds never costs more), so the choice is a partition of the
sorted distinct sizes into ``k`` runs, each served by its run's largest size: a dynamic
programme over (runs, last size). Its inner minimum is over lines ``f(i) - C_i * x`` queried at
increasing ``x = g(size)`` with decreasing slopes, which a monotone convex hull answers in
amortised O(1): O(k * m) for m distinct sizes (tests hold it to brute force).

Several axes are not independent (a request's cost is a product), and the exact problem is a
search over every combination of per-axis partitions. kiln runs coordinate descent instead:
for each way to split the bucket count over the axes (k_1 * k_2 * ... <= N, maximal), start
from each axis planned alone, then re-plan one axis at a time exactly, with every request
weighted by its other axes' padded sizes, until nothing improves. docs/padding.md gives the
measured distance from the exhaustive optimum. Torch-free.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kiln.artifact.manifest import Manifest
from kiln.errors import Param, ParameterError, SpecError, UsageError, Worded
from kiln.padding import PadGrid, work
from kiln.spec import MAX_BUCKETS, Spec, parse_spec
from kiln.traffic import Traffic

_MAX_ROUNDS = 32  # coordinate-descent rounds; each strictly improves, so this is a guard


# --- one axis, exactly -------------------------------------------------------------------
def plan_axis(
    values: Sequence[int], weights: Sequence[float], k: int, exponent: float = 1.0
) -> list[tuple[list[int], float]]:
    """The best ``j``-bucket lists for ``j`` = 1..``k`` over sorted distinct ``values`` with
    positive ``weights``: each ``(sizes, cost)`` with cost = sum of weight * g(bucket), g(v) =
    v ** exponent. The largest value is always a bucket (every value must fit)."""
    m = len(values)
    if m == 0:
        raise ValueError("no values to plan")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError("values must be sorted and distinct")
    k = min(k, m)
    prefix = [0.0, *itertools.accumulate(weights)]

    def g(v: int) -> float:
        return v if exponent == 1 else v**exponent

    inf = math.inf
    previous = [0.0] + [inf] * m  # f_0: nothing covered
    parents: list[list[int]] = []
    out: list[tuple[list[int], float]] = []
    for _ in range(k):
        current = [inf] * (m + 1)
        parent = [0] * (m + 1)
        hull: list[tuple[float, float, int]] = []  # (slope, intercept, i), slopes decreasing
        head = 0
        for j in range(1, m + 1):
            i = j - 1
            if previous[i] < inf:  # the line for "the previous run ends at i"
                line = (-prefix[i], previous[i], i)
                while len(hull) - head >= 2 and _useless(hull[-2], hull[-1], line):
                    hull.pop()
                hull.append(line)
                head = min(head, len(hull) - 1)
            if len(hull) - head == 0:
                continue
            x = g(values[j - 1])
            while len(hull) - head >= 2 and _at(hull[head], x) >= _at(hull[head + 1], x):
                head += 1
            slope, intercept, i_best = hull[head]
            current[j] = x * prefix[j] + intercept + slope * x
            parent[j] = i_best
        parents.append(parent)
        if current[m] < inf:
            out.append((_sizes(values, parents, m), current[m]))
        previous = current
    return out


def _at(line: tuple[float, float, int], x: float) -> float:
    return line[1] + line[0] * x


def _useless(a: tuple[float, float, int], b: tuple[float, float, int], c: tuple) -> bool:
    """Whether line ``b`` is never the lowest once ``c`` (a smaller slope) is added."""
    (m1, b1, _), (m2, b2, _), (m3, b3, _) = a, b, c
    return (b3 - b1) * (m1 - m2) <= (b2 - b1) * (m1 - m3)


def _sizes(values: Sequence[int], parents: list[list[int]], m: int) -> list[int]:
    sizes, j = [], m
    for parent in reversed(parents):
        sizes.append(values[j - 1])
        j = parent[j]
    return sorted(sizes)


# --- bake time -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BakeTime:
    """Seconds to bake one bucket, ``fixed + per_work * work(bucket)``, fitted to an artifact's
    own bucket timings (each bucket's first call in the bake: its compile)."""

    fixed: float
    per_work: float
    source: str

    @classmethod
    def from_manifest(cls, manifest: Manifest, weights: Mapping[str, float]) -> BakeTime:
        points = [(work(b.sizes, weights), b.first_call_s) for b in manifest.grid]
        if not points:
            raise UsageError(f"{manifest.name}: the manifest lists no baked bucket to time")
        xs, ys = zip(*points, strict=True)
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
        fixed = mean_y - slope * mean_x
        if slope < 0 or fixed < 0:  # noise: fall back to a constant (or a pure slope)
            slope, fixed = (0.0, mean_y) if slope < 0 else (sum(ys) / sum(xs), 0.0)
        return cls(fixed, slope, f"{manifest.name} ({len(points)} buckets)")

    def of(self, buckets: Sequence[Mapping[str, int]], weights: Mapping[str, float]) -> float:
        return sum(self.fixed + self.per_work * work(b, weights) for b in buckets)


# --- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Evaluation:
    """How a grid serves a traffic log."""

    buckets: int
    waste: float  # share of the in-grid padded work that is padding
    overhead: float  # padded work / unpadded work, in-grid requests
    off_grid: float  # share of requests no bucket holds
    bake_s: float | None = None  # estimated, when a bake time model is known

    def to_dict(self) -> dict[str, Any]:
        out = {
            "buckets": self.buckets,
            "waste": round(self.waste, 4),
            "padded_work_ratio": round(self.overhead, 4),
            "off_grid": round(self.off_grid, 4),
        }
        if self.bake_s is not None:
            out["bake_s"] = round(self.bake_s, 1)
        return out


@dataclass(frozen=True)
class Plan:
    buckets: dict[str, list[int]]
    method: str
    planned: Evaluation
    current: Evaluation
    requests: int
    shapes: int
    weights: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def yaml(self) -> str:
        """The ``buckets:`` section as spec YAML."""
        lines = ["buckets:"] + [
            f"  {a}: [{', '.join(map(str, s))}]" for a, s in self.buckets.items()
        ]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "buckets": self.buckets,
            "method": self.method,
            "planned": self.planned.to_dict(),
            "current": self.current.to_dict(),
            "requests": self.requests,
            "shapes": self.shapes,
            "weights": self.weights,
            "notes": self.notes,
            "yaml": self.yaml(),
        }


def evaluate(
    grid: PadGrid,
    traffic: Traffic,
    weights: Mapping[str, float],
    bake: BakeTime | None = None,
) -> Evaluation:
    """``grid`` serving ``traffic``: the padding-path's own bucket choice for every shape."""
    real = padded = off = 0.0
    for sizes, count in traffic.counts().items():
        request = traffic.sizes(sizes)
        bucket = grid.lookup({a: request[a] for a in grid.axes})
        if bucket is None:
            off += count
            continue
        real += count * work(request, weights)
        padded += count * work(bucket, weights)
    points = [dict(zip(grid.axes, p, strict=True)) for p in grid.points]
    return Evaluation(
        buckets=len(grid.points),
        waste=1 - real / padded if padded else 0.0,
        overhead=padded / real if real else 1.0,
        off_grid=off / traffic.requests,
        bake_s=bake.of(points, weights) if bake else None,
    )


def plan(
    spec: Spec,
    traffic: Traffic,
    *,
    max_buckets: int | None = None,
    budget_s: float | None = None,
    bake: BakeTime | None = None,
    weights: Mapping[str, float] | None = None,
    coverage: float = 1.0,
) -> Plan:
    """Bucket lists for ``spec``'s padded axes that serve ``traffic`` with the least padded
    work, at most ``max_buckets`` buckets (default: as many as the spec has now) and, with
    ``budget_s``, an estimated bake time within it (``bake`` estimates it). Axes that are not
    padded keep their sizes. ``coverage``: the share of requests the grid must hold (the rest
    are left to ``on_miss``)."""
    weights = _checked_weights(spec, weights or {})
    if not 0 < coverage <= 1:
        raise ParameterError(
            "coverage", coverage, "a share above 0 and at most 1", shown=f"{coverage:g}"
        )
    if budget_s is not None and bake is None:  # the CLI says it as --budget-s and --artifact
        raise UsageError(
            Worded(
                Param("budget_s"), " needs ", Param("bake"), " to estimate each bucket's bake time"
            )
        )
    padded = [a for a in spec.paddable_axes() if a in traffic.axes]
    if not padded:
        raise UsageError(
            f"{spec.name}: no axis is padded (declare `pad` on every input that carries an "
            "axis): the serving path only serves exact bucket sizes, so there is nothing to plan"
        )
    current = PadGrid.from_spec(spec)
    fixed = {a: sorted(spec.buckets[a]) for a in spec.buckets if a not in padded}
    cap_padded = _padded_cap(max_buckets, len(current.points), fixed)
    requests = _requests(traffic, fixed, padded)
    if not requests:
        raise UsageError("no request in the log has sizes the unpadded axes bake")
    tops = _tops(requests, padded, coverage)
    notes = []
    chosen, method = _search(requests, padded, tops, weights, cap_padded, budget_s, bake, fixed)
    buckets = {a: chosen[a] if a in chosen else spec.buckets[a] for a in spec.buckets}
    if spec.exclude:
        notes.append("the spec's exclude list is kept: the evaluation honours it")
    new = spec.model_copy(update={"buckets": buckets})
    return Plan(
        buckets=buckets,
        method=method,
        planned=evaluate(PadGrid.from_spec(new), traffic, weights, bake),
        current=evaluate(current, traffic, weights, bake),
        requests=traffic.requests,
        shapes=len(traffic.counts()),
        weights=weights,
        notes=notes,
    )


def _checked_weights(spec: Spec, weights: Mapping[str, float]) -> dict[str, float]:
    """``weights`` as floats, each an axis of ``spec`` weighted above 0 and at most 8."""
    out = {a: float(w) for a, w in weights.items()}
    for axis, w in out.items():
        if axis not in spec.buckets:
            raise UsageError(
                Worded(
                    Param("weights", key=axis),
                    f": not an axis of {spec.name} ({', '.join(spec.buckets)})",
                )
            )
        if not 0 < w <= 8:
            raise ParameterError(
                "weights", w, "a weight is above 0 and at most 8", shown=f"{w:g}", key=axis
            )
    return out


def _padded_cap(max_buckets: int | None, now: int, fixed: Mapping[str, list[int]]) -> int:
    """How many sizes the padded axes may have together: ``max_buckets`` (default: the ``now``
    buckets the spec has) over the buckets the unpadded axes' ``fixed`` sizes already make."""
    cap = max_buckets if max_buckets is not None else now
    if not 1 <= cap <= MAX_BUCKETS:
        raise ParameterError("max_buckets", cap, f"from 1 to {MAX_BUCKETS}")
    cap_padded = cap // math.prod(len(s) for s in fixed.values()) if fixed else cap
    if cap_padded < 1:
        raise ParameterError(
            "max_buckets",
            cap,
            f"the axes that are not padded already make "
            f"{math.prod(len(s) for s in fixed.values())} buckets",
        )
    return cap_padded


_Requests = dict[tuple[int, ...], float]  # padded-axis sizes -> requests


def _requests(traffic: Traffic, fixed: dict[str, list[int]], padded: list[str]) -> _Requests:
    """The log's requests on the padded axes, dropping those whose unpadded axes no bucket has."""
    out: _Requests = defaultdict(float)
    for sizes, count in traffic.counts().items():
        request = traffic.sizes(sizes)
        if all(request.get(a, s[0]) in s for a, s in fixed.items()):
            out[tuple(request[a] for a in padded)] += count
    return dict(out)


def _tops(requests: _Requests, axes: list[str], coverage: float) -> list[int]:
    """Each axis's largest bucket: the smallest size that holds ``coverage`` of the requests."""
    tops = []
    total = sum(requests.values())
    for i in range(len(axes)):
        per: dict[int, float] = defaultdict(float)
        for sizes, n in requests.items():
            per[sizes[i]] += n
        seen = 0.0
        for value in sorted(per):
            seen += per[value]
            if seen >= coverage * total * (1 - 1e-12):
                tops.append(value)
                break
    return tops


def _search(
    requests: _Requests,
    axes: list[str],
    tops: list[int],
    weights: Mapping[str, float],
    cap: int,
    budget_s: float | None,
    bake: BakeTime | None,
    fixed: dict[str, list[int]],
) -> tuple[dict[str, list[int]], str]:
    """The best bucket lists over the ways to split ``cap`` buckets among ``axes``."""
    held = {s: n for s, n in requests.items() if all(v <= t for v, t in zip(s, tops, strict=True))}
    exps = [weights.get(a, 1.0) for a in axes]
    distinct = [len({s[i] for s in held}) for i in range(len(axes))]
    fixed_points = [dict(zip(fixed, p, strict=True)) for p in itertools.product(*fixed.values())]

    def bake_s(lists: list[list[int]]) -> float:
        assert bake is not None
        grid = [
            {**dict(zip(axes, p, strict=True)), **f}
            for p in itertools.product(*lists)
            for f in fixed_points or [{}]
        ]
        return bake.of(grid, weights)

    best: tuple[float, list[list[int]]] | None = None
    limit = cap
    while best is None and limit >= 1:
        for split in _splits(distinct, limit):
            lists, cost = _descend(held, split, exps)
            if budget_s is not None and bake_s(lists) > budget_s:
                continue
            if best is None or cost < best[0]:
                best = (cost, lists)
        if budget_s is None:
            break
        limit -= 1
    if best is None:
        one = [[max(s[i] for s in held)] for i in range(len(axes))]
        raise ParameterError(
            "budget_s",
            budget_s,
            f"not even one bucket fits (estimated {bake_s(one):.0f} s for {_shown(axes, one)})",
            shown=f"{budget_s:g}",
        )
    method = "dynamic programming (exact)" if len(axes) == 1 else "coordinate descent"
    return dict(zip(axes, best[1], strict=True)), method


def _splits(distinct: list[int], cap: int) -> Iterator[tuple[int, ...]]:
    """Bucket counts per axis whose product is at most ``cap``, none of which can grow."""

    def grow(prefix: tuple[int, ...], left: int) -> Iterator[tuple[int, ...]]:
        i = len(prefix)
        if i == len(distinct):
            yield prefix
            return
        for k in range(1, min(distinct[i], left) + 1):
            yield from grow((*prefix, k), left // k)

    for split in grow((), cap):
        product = math.prod(split)
        if all(
            k == d or product // k * (k + 1) > cap for k, d in zip(split, distinct, strict=True)
        ):
            yield split


def _descend(
    requests: _Requests, split: tuple[int, ...], exps: list[float]
) -> tuple[list[list[int]], float]:
    """Coordinate descent from each axis planned alone; exact for one axis."""
    n = len(split)
    lists = []
    for i in range(n):  # alone: the other axes as if unpadded
        lists.append(_axis_plan(requests, i, split[i], exps, None))
    cost = _cost(requests, lists, exps)
    if n == 1:
        return lists, cost
    for _ in range(_MAX_ROUNDS):
        improved = False
        for i in range(n):
            candidate = [
                *lists[:i],
                _axis_plan(requests, i, split[i], exps, lists),
                *lists[i + 1 :],
            ]
            c = _cost(requests, candidate, exps)
            if c < cost * (1 - 1e-12):
                lists, cost, improved = candidate, c, True
        if not improved:
            break
    return lists, cost


def _axis_plan(
    requests: _Requests,
    i: int,
    k: int,
    exps: list[float],
    lists: list[list[int]] | None,
) -> list[int]:
    """Axis ``i``'s best ``k`` sizes with every request weighted by its other axes (padded to
    ``lists`` when given, else as they are)."""
    per: dict[int, float] = defaultdict(float)
    for sizes, n in requests.items():
        other = 1.0
        for j, v in enumerate(sizes):
            if j != i:
                other *= (_up(lists[j], v) if lists else v) ** exps[j]
        per[sizes[i]] += n * other
    values = sorted(per)
    plans = plan_axis(values, [per[v] for v in values], k, exps[i])
    return plans[-1][0]


def _cost(requests: _Requests, lists: list[list[int]], exps: list[float]) -> float:
    return sum(
        n * math.prod(_up(lst, v) ** e for lst, v, e in zip(lists, s, exps, strict=True))
        for s, n in requests.items()
    )


def _up(sizes: list[int], value: int) -> int:
    for s in sizes:
        if s >= value:
            return s
    return sizes[-1]  # not reached for held requests


def _shown(axes: list[str], lists: list[list[int]]) -> str:
    return ",".join(f"{a}={s[0]}" for a, s in zip(axes, lists, strict=True))


# --- writing the spec back -----------------------------------------------------------------
def rewrite_buckets(text: str, buckets: Mapping[str, list[int]], file: str) -> str:
    """``text`` (a spec) with each axis's bucket list replaced by ``buckets``' in flow style;
    everything else, comments included, byte for byte as it was.

    The lists are located by PyYAML's node marks (the spec already parsed, so the text is
    bounded). The result is parsed again and must mean the old spec with only the buckets
    changed: an anchor shared with another key, say, is refused rather than changed twice.
    """
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    section = next(
        (v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "buckets"), None
    )
    if not isinstance(section, yaml.MappingNode):
        raise SpecError("no buckets mapping to rewrite", file=file)
    edits = []
    for key, value in section.value:
        if key.value in buckets:
            start, end = value.start_mark.index, value.end_mark.index
            if isinstance(value, yaml.SequenceNode) and not value.flow_style and value.value:
                end = value.value[-1].end_mark.index  # a block list ends at its last item
            edits.append((start, end, "[" + ", ".join(map(str, buckets[key.value])) + "]"))
    out = text
    for start, end, new in sorted(edits, reverse=True):
        out = out[:start] + new + out[end:]
    before, after = parse_spec(text, file), parse_spec(out, file)
    expected = before.model_copy(update={"buckets": dict(buckets)}).canonical()
    if after.canonical() != expected:
        raise UsageError(
            f"{file}: cannot rewrite the bucket lists in place (an anchor or alias shared with "
            "another key?): copy the printed buckets into the spec by hand"
        )
    return out
