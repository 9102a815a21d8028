"""Serving a grid by padding: each request padded up to its bucket, the outputs sliced back.

``kiln.activate(DIR).compile(model)`` wraps the compiled model in :class:`PaddedModel` when the
artifact's spec declares ``pad`` values, and on the torch.compile route with ``dynamic: false``
when it declares none (:func:`exact_grid`): then no axis pads, every request must be a baked
bucket exactly, and ``on_miss`` decides the rest as below. A call then:

1. reads each axis's size from the inputs' shapes (:meth:`kiln.padding.PadGrid.axis_sizes`);
2. picks the smallest baked bucket that holds them (:meth:`kiln.padding.PadGrid.fit`);
3. pads every input on the axes that grew, with the input's ``pad`` value, at the end of each
   dimension (right padding: the request's data keeps its positions);
4. calls the compiled model, which runs a graph the bake compiled;
5. slices every output back on each dimension that carried a padded size.

Which output dimensions carry an axis is found once per bucket and axis, not guessed from
sizes (a hidden size of 256 is not a padded sequence of 256): the eager model runs under
torch's fake tensor mode (shapes only, no data, no kernels) with that axis at two sizes below
the bucket's (one less, and half: at one size a pooled ``ceil(seq / 2)`` can stay put), and a
dimension whose size moves one for one with the axis at both is sliced to the request's size.
A dimension that moves otherwise (``2 * seq``, a strided convolution, ``batch * seq``
flattened) cannot be unpadded by slicing: it is returned as the bucket gave it, and a warning
names it once. On the AOT route the bake finds them instead (:func:`bake_carriers`, recorded
in the manifest): fake tensors import Dynamo, which that route's server never does. Outputs
may be tensors, tuples, lists, dicts, named tuples and dataclasses (Hugging Face
``ModelOutput`` included), nested; anything else is returned as it is. ``keep`` opts outputs
out by path (``"logits"``, ``"0"``, ``"hidden.1"``).

A request no bucket holds follows ``on_miss`` (:data:`kiln.serving.OnMiss`): ``error`` raises
:class:`~kiln.padding.OffGridError`, ``eager`` runs the uncompiled model, ``compile`` calls the
compiled model unpadded, so torch compiles the shape here. Each is counted per shape
(:attr:`PaddedModel.stats`) and logged once per shape.

Padding is only correct for models whose real outputs do not depend on the padded positions:
rows that are independent (per-token layers, a batch of independent requests), or a mask input
(padded with 0) that the model uses to ignore them. docs/padding.md says which models qualify.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.artifact.manifest import Manifest, PadCarriers, PadOutput
from kiln.errors import IntegrityError, ParameterError
from kiln.grid import Bucket
from kiln.padding import OffGridError, PadGrid, ShapeError, shape_key, work
from kiln.serving import DEFAULT_ON_MISS, ON_MISS, OnMiss, served_torch_kwargs
from kiln.spec_yaml import did_you_mean

log = logging.getLogger("kiln")

Path = tuple[str, ...]  # an output's place: ("logits",), ("0",), ("hidden", "1")
_KNOWN_SHOWN = 12  # output paths an error about ``keep`` lists


@dataclass
class PaddingStats:
    """What the padding path did so far, for a server's metrics and kiln's replay."""

    calls: int = 0
    exact: int = 0  # requests that were a bucket already
    padded: int = 0  # requests padded up to a bucket
    off_grid: Counter[str] = field(default_factory=Counter)  # request shape -> calls
    real_work: float = 0.0  # sum of the requests' sizes (products of axis sizes), in-grid
    padded_work: float = 0.0  # sum of their buckets' sizes
    probes: int = 0  # fake-tensor runs that found which output dims carry an axis
    last_bucket: dict[str, int] | None = None  # the bucket of the last call (None: off grid)
    last_overhead_s: float = 0.0  # host time the last call spent padding and slicing

    @property
    def waste(self) -> float:
        """The share of in-grid work spent on padding."""
        return 1.0 - self.real_work / self.padded_work if self.padded_work else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "exact": self.exact,
            "padded": self.padded,
            "off_grid": sum(self.off_grid.values()),
            "off_grid_shapes": dict(self.off_grid),
            "waste": round(self.waste, 4),
            "probes": self.probes,
        }


class PaddedModel:
    """``compiled``, served only at the baked buckets of ``grid``; see the module docstring.

    Attributes other than its own come from ``compiled`` (a precompiled forward's ``misses``).
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        model: Any,
        grid: PadGrid,
        *,
        on_miss: OnMiss = DEFAULT_ON_MISS,
        keep: Collection[str] = (),
        carriers: Sequence[PadCarriers] = (),
    ) -> None:
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss={on_miss!r}: one of {', '.join(ON_MISS)}")
        self.compiled, self.model, self.grid, self.on_miss = compiled, model, grid, on_miss
        self.keep = frozenset(tuple(k.split(".")) for k in keep)
        self._keep_checked = not self.keep  # against the first call's outputs
        self.stats = PaddingStats()
        self._names = [i.name for i in grid.inputs]
        self._signature = _signature(model)
        self._carriers: dict[tuple[tuple[int, ...], str], _Carriers] = {}
        for record in carriers:  # found by the bake: no probe here
            try:
                sizes = Bucket.parse(record.bucket).as_dict()
                point = tuple(sizes[a] for a in grid.axes)
            except (KeyError, ValueError):
                raise IntegrityError(
                    f"padding record for bucket {record.bucket!r} does not name the grid's axes "
                    f"({', '.join(grid.axes)})"
                ) from None
            self._carriers[(point, record.axis)] = _Carriers.from_record(record)
        self._warned: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks: the wrapped callable's (``misses``).
        if name.startswith("_") or name in {"compiled", "model", "grid"}:
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self.stats.calls += 1
        if args:
            kwargs = self._bind(args, kwargs)
        tensors = {n: kwargs[n] for n in self._names if n in kwargs}
        for name, value in tensors.items():
            if not hasattr(value, "shape"):  # not "missing": the call has it, as something else
                raise ShapeError(f"input {name!r} is a {type(value).__name__}, not a tensor")
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        request = self.grid.axis_sizes(shapes)
        bucket = self.grid.lookup(request)
        other = self._other_dtype(tensors)  # no baked graph takes it, whatever its shape
        self.stats.last_bucket = bucket if other is None else None
        if bucket is None or other is not None:
            return self._off_grid(request, kwargs, other)
        self.stats.real_work += work(request)
        self.stats.padded_work += work(bucket)
        if bucket == request:
            self.stats.exact += 1
            self.stats.last_overhead_s = time.perf_counter() - t0
            out = self.compiled(**kwargs)
            self._check_keep(out)
            return out
        self.stats.padded += 1
        grown = [a for a in self.grid.axes if bucket[a] != request[a]]
        padded = dict(kwargs)
        for inp in self.grid.inputs:
            if inp.name in tensors and any(a in grown for _, a in inp.axes()):
                padded[inp.name] = _pad(tensors[inp.name], self.grid.shape_of(inp, bucket), inp.pad)
        overhead = time.perf_counter() - t0
        out = self.compiled(**padded)
        t1 = time.perf_counter()
        result = self._unpad(out, request, bucket, grown, kwargs)
        self.stats.last_overhead_s = overhead + time.perf_counter() - t1
        return result

    # --- off the grid ----------------------------------------------------------------------
    def _off_grid(
        self, request: dict[str, int], kwargs: dict[str, Any], other: str | None = None
    ) -> Any:
        """A request no bucket holds, or (``other``) an input of a dtype the bake never saw."""
        key = shape_key(request) + (f" ({other})" if other else "")
        first = key not in self.stats.off_grid
        self.stats.off_grid[key] += 1
        self.stats.last_overhead_s = 0.0
        if other is not None:
            why = f"{shape_key(request)}: {other}: no baked graph takes it"
        else:
            why = self.grid.why_off_grid([request[a] for a in self.grid.axes])
        if self.on_miss == "error":
            raise OffGridError(f"{why} (on_miss: error)")
        if first:
            served = "eager" if self.on_miss == "eager" else "compiling it in this process"
            log.warning("kiln: %s: served %s (on_miss: %s)", why, served, self.on_miss)
        if self.on_miss == "eager":
            return self.model(**kwargs)
        return self.compiled(**kwargs)

    # --- inputs ----------------------------------------------------------------------------
    def _other_dtype(self, tensors: dict[str, Any]) -> str | None:
        """The first input whose dtype is not the spec's, in words (None: all are): torch
        compiles a graph per input dtype, so serving it would compile in this process."""
        for inp in self.grid.inputs:
            t = tensors.get(inp.name)
            got = str(getattr(t, "dtype", "")).removeprefix("torch.")
            if inp.dtype and got and got != inp.dtype:
                return f"input {inp.name!r} is {got}, the bake's is {inp.dtype}"
        return None

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional arguments by the forward's own parameter names (kiln calls by keyword)."""
        if self._signature is None:
            raise ShapeError("pass the inputs by keyword: the model's signature is unknown")
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ShapeError(f"the call does not match forward(): {exc}") from None
        if any(
            self._signature.parameters[n].kind is inspect.Parameter.VAR_POSITIONAL
            for n in bound.arguments
        ):
            raise ShapeError("pass the inputs by keyword: forward() takes *args")
        out = dict(bound.arguments)
        for name, param in self._signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in out:
                out.update(out.pop(name))
        return out

    # --- outputs ---------------------------------------------------------------------------
    def _unpad(
        self,
        out: Any,
        request: dict[str, int],
        bucket: dict[str, int],
        grown: list[str],
        kwargs: dict[str, Any],
    ) -> Any:
        """``out`` with every dimension that carried a grown axis sliced to the request's size."""
        self._check_keep(out)
        leaves = list(tensor_leaves(out))
        point = tuple(bucket[a] for a in self.grid.axes)
        carriers = []
        for axis in grown:
            key = (point, axis)
            if key not in self._carriers:
                shapes = {p: tuple(t.shape) for p, t in leaves}
                self._carriers[key] = self._probe(axis, bucket, kwargs, shapes)
            found = self._carriers[key]
            if found.by_size:  # a probe here warned already; one the bake ran has not
                self._warn_once(f"probe:{axis}", _unprobed(axis, None))
            carriers.append(found)
        targets: dict[Path, list[int | None]] = {}
        for path, tensor in leaves:
            if any(path[: len(k)] == k for k in self.keep):
                continue
            sizes: list[int | None] = [None] * tensor.dim()
            shape = tuple(tensor.shape)
            for axis, found in zip(grown, carriers, strict=True):
                for d in found.of(path, shape, bucket[axis]):
                    if d < len(shape) and shape[d] == bucket[axis]:
                        sizes[d] = request[axis]
                if path in found.unsliceable:
                    self._warn_once(
                        f"{_shown(path)}:{axis}",
                        f"output {_shown(path)} changes with {axis} other than one for one: "
                        "returned padded (pass keep= to silence this)",
                    )
            targets[path] = sizes
        return _rebuild(out, (), targets)

    def _check_keep(self, out: Any) -> None:
        """Each ``keep`` path must name a place in the outputs (checked once, at the first call
        that returns some): a misspelt one keeps nothing, and the output it meant would come
        back sliced without a word."""
        if self._keep_checked:
            return
        paths = set(output_paths(out))
        unknown = sorted(".".join(k) for k in self.keep - paths)
        if unknown:
            known = sorted((".".join(p) for p in paths), key=lambda p: (p.count("."), p))
            listed = ", ".join(known[:_KNOWN_SHOWN]) + (", …" if len(known) > _KNOWN_SHOWN else "")
            raise ParameterError(
                "keep",
                unknown[0],
                f"no output is at this path{did_you_mean(unknown[0], known)} (the outputs: "
                f"{listed or 'one tensor, which no path names'})",
            )
        self._keep_checked = True

    def _probe(
        self,
        axis: str,
        bucket: dict[str, int],
        kwargs: dict[str, Any],
        at_bucket: dict[Path, tuple[int, ...]],
    ) -> _Carriers:
        """Which output dimensions carry ``axis`` at ``bucket`` (whose outputs have the shapes
        ``at_bucket``): :func:`find_carriers`, once per bucket and axis."""
        self.stats.probes += 1
        try:
            return find_carriers(self.model, self.grid, bucket, axis, kwargs, at_bucket)
        except Exception as exc:  # the model does something fake tensors cannot (data access)
            self._warn_once(f"probe:{axis}", _unprobed(axis, exc))
            return _Carriers(by_size=True)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("kiln: %s", message)


@dataclass(frozen=True)
class _Carriers:
    """The output dimensions that carry one axis: per output path, the dims that move one for
    one with it (sliced), and the paths that move otherwise (left padded). ``by_size``: no
    probe ran, so a dimension whose size is the axis's padded size counts."""

    dims: dict[Path, tuple[int, ...]] = field(default_factory=dict)
    unsliceable: frozenset[Path] = frozenset()
    by_size: bool = False

    @classmethod
    def compare(
        cls,
        at_bucket: dict[Path, tuple[int, ...]],
        moved: dict[Path, tuple[int, ...]],
        bucket_size: int,
        size: int,
    ) -> _Carriers:
        dims: dict[Path, tuple[int, ...]] = {}
        bad: set[Path] = set()
        for path, shape in at_bucket.items():
            other = moved.get(path)
            if other is None or len(other) != len(shape):
                bad.add(path)
                continue
            changed = [d for d, (a, b) in enumerate(zip(shape, other, strict=True)) if a != b]
            ok = [d for d in changed if shape[d] == bucket_size and other[d] == size]
            dims[path] = tuple(ok)
            if len(ok) != len(changed):
                bad.add(path)
        return cls(dims, frozenset(bad))

    def both(self, other: _Carriers) -> _Carriers:
        """What two probes at different sizes agree on: a dim is sliced only where both saw it
        move one for one; an output either saw move otherwise (or that moved at one size and
        not the other: ``ceil(seq / 2)`` is 8 at 15 and at 16) is left padded."""
        bad = set(self.unsliceable | other.unsliceable)
        dims: dict[Path, tuple[int, ...]] = {}
        for path in self.dims.keys() | other.dims.keys():
            mine, theirs = self.dims.get(path), other.dims.get(path)
            if mine != theirs:
                bad.add(path)
            dims[path] = mine if mine is not None else theirs or ()
        return _Carriers(dims, frozenset(bad), self.by_size or other.by_size)

    def of(self, path: Path, shape: tuple[int, ...], bucket_size: int) -> tuple[int, ...]:
        """The dims of the output at ``path`` to slice."""
        if self.by_size:
            return tuple(d for d, n in enumerate(shape) if n == bucket_size)
        return self.dims.get(path, ())

    def recorded(self, bucket: str, axis: str) -> PadCarriers:
        """As the manifest records it (the AOT route's bake)."""
        outputs = [
            PadOutput(path=list(path), dims=list(self.dims.get(path, ())), sliceable=False)
            for path in sorted(self.unsliceable)
        ]
        outputs += [
            PadOutput(path=list(path), dims=list(dims))
            for path, dims in self.dims.items()
            if path not in self.unsliceable
        ]
        return PadCarriers(bucket=bucket, axis=axis, outputs=outputs, by_size=self.by_size)

    @classmethod
    def from_record(cls, record: PadCarriers) -> _Carriers:
        return cls(
            {tuple(o.path): tuple(o.dims) for o in record.outputs},
            frozenset(tuple(o.path) for o in record.outputs if not o.sliceable),
            record.by_size,
        )


def fake_shapes(
    model: Any, grid: PadGrid, sizes: dict[str, int], kwargs: dict[str, Any]
) -> dict[Path, tuple[int, ...]]:
    """The shapes of ``model``'s outputs with its inputs at ``sizes``, from one run on fake
    tensors (shapes only, no data, no kernels); raises what the forward raises there."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = dict(kwargs)
        for inp in grid.inputs:
            real = kwargs.get(inp.name)
            if isinstance(real, torch.Tensor):
                shape = grid.shape_of(inp, sizes)
                fake[inp.name] = torch.empty(shape, dtype=real.dtype, device=real.device)
        out = model(**fake)
        return {p: tuple(t.shape) for p, t in tensor_leaves(out)}


def probe_sizes(bucket_size: int) -> list[int]:
    """The sizes an axis is probed at below its bucket's: two where there are two (one less,
    and half), since one size can fall on a plateau of a dim that moves otherwise (a pooling
    ``ceil(seq / 2)`` is 8 at 15 and at 16); none for a bucket of 1, into which nothing pads."""
    return sorted({bucket_size - 1, bucket_size // 2} - {0, bucket_size})


def find_carriers(
    model: Any,
    grid: PadGrid,
    bucket: dict[str, int],
    axis: str,
    kwargs: dict[str, Any],
    at_bucket: dict[Path, tuple[int, ...]],
) -> _Carriers:
    """Which outputs of ``bucket``'s call (of shapes ``at_bucket``) carry ``axis``: the model
    on fake tensors at each of :func:`probe_sizes`, compared with the bucket's. The same sizes
    whatever the request, so a server and the bake find the same; raises what the forward
    raises on fake tensors."""
    found: _Carriers | None = None
    for size in probe_sizes(bucket[axis]):
        moved = fake_shapes(model, grid, {**bucket, axis: size}, kwargs)
        one = _Carriers.compare(at_bucket, moved, bucket[axis], size)
        found = one if found is None else found.both(one)
    return found or _Carriers()


def bake_carriers(
    model: Any, grid: PadGrid, bucket: str, kwargs: dict[str, Any]
) -> list[PadCarriers]:
    """What :meth:`PaddedModel._probe` finds at run time, found by the bake instead: for each
    padded axis of ``bucket`` (the call's inputs ``kwargs``), :func:`find_carriers` against
    the bucket's outputs on fake tensors. For the AOT route, whose server imports no Dynamo,
    which fake tensors would import (1.7 s on the CPU)."""
    sizes = Bucket.parse(bucket).as_dict()
    axes = [a for a in sorted(grid.paddable) if sizes[a] >= 2]  # 1: nothing is padded into it
    if not axes:
        return []
    try:
        at = fake_shapes(model, grid, sizes, kwargs)
    except Exception as exc:  # as at run time: the server slices by size, and says so
        log.warning("kiln: %s: %s", bucket, _unprobed(", ".join(axes), exc))
        return [_Carriers(by_size=True).recorded(bucket, axis) for axis in axes]
    out: list[PadCarriers] = []
    for axis in axes:
        try:
            found = find_carriers(model, grid, sizes, axis, kwargs, at)
        except Exception as exc:
            log.warning("kiln: %s: %s", bucket, _unprobed(axis, exc))
            found = _Carriers(by_size=True)
        out.append(found.recorded(bucket, axis))
    return out


def _unprobed(axis: str, exc: BaseException | None) -> str:
    """The warning for outputs sliced by size: ``exc`` is why fake tensors could not run the
    model (None: the bake's probe said so, in the bake's log)."""
    why = f" ({type(exc).__name__}: {_first_line(exc)})" if exc is not None else ""
    return (
        f"could not trace output shapes on fake tensors{why}: slicing dimensions whose size "
        f"is the padded {axis}"
    )


def _pad(tensor: Any, shape: tuple[int, ...], value: Any) -> Any:
    """``tensor`` at the end of a new ``shape`` tensor filled with ``value``."""
    out = tensor.new_full(shape, value)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def tensor_leaves(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every tensor in an output, with its path."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensor_leaves(v, (*path, str(k)))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from tensor_leaves(v, (*path, str(i)))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensor_leaves(getattr(obj, f.name), (*path, f.name))


def output_paths(obj: Any, path: Path = ()) -> Iterator[Path]:
    """Every place in an output that ``keep`` can name: each item of each container, as
    :func:`tensor_leaves` walks them, a dataclass's unset fields included (a ``ModelOutput``'s
    ``attentions=None`` names what a call with ``output_attentions`` returns)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return
    for key, value in items:
        yield (*path, key)
        yield from output_paths(value, (*path, key))


def _rebuild(obj: Any, path: Path, targets: dict[Path, list[int | None]]) -> Any:
    """``obj`` with each tensor at a path in ``targets`` sliced to its sizes (None: as is)."""
    import torch

    if isinstance(obj, torch.Tensor):
        sizes = targets.get(path)
        if not sizes or all(s is None for s in sizes):
            return obj
        return obj[tuple(slice(0, s) for s in sizes)]
    if isinstance(obj, dict) and not dataclasses.is_dataclass(obj):
        items = {k: _rebuild(v, (*path, str(k)), targets) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_rebuild(v, (*path, str(i)), targets) for i, v in enumerate(obj)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(v, (*path, str(i)), targets) for i, v in enumerate(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _rebuild(getattr(obj, f.name), (*path, f.name), targets)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def _signature(model: Any) -> inspect.Signature | None:
    target = getattr(model, "forward", model)
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def _shown(path: Path) -> str:
    return ".".join(path) or "<output>"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def with_padding(
    compiled: Callable[..., Any],
    model: Any,
    manifest: Manifest,
    *,
    on_miss: OnMiss | None = None,
    keep: Collection[str] = (),
    carriers: Sequence[PadCarriers] = (),
) -> Callable[..., Any]:
    """``compiled`` wrapped in :class:`PaddedModel` when ``manifest``'s spec pads an axis, or
    when it pads none but serves its buckets only (:func:`exact_grid`): then a request must be
    a baked bucket exactly, and :func:`miss_policy` decides the others. Else (the AOT route's
    packages, which pick their own; dynamic graphs) as it is. ``carriers``: what the bake found
    of the outputs (the AOT route's packages)."""
    policy = miss_policy(manifest, on_miss)
    grid = PadGrid.from_manifest(manifest)
    if grid.pads or exact_grid(manifest):
        return PaddedModel(compiled, model, grid, on_miss=policy, keep=keep, carriers=carriers)
    asked = on_miss or (manifest.spec.get("compile") or {}).get("on_miss")
    if manifest.aoti is None and asked not in (None, "compile"):
        log.warning(
            "kiln: on_miss: %s does not apply: dynamic graphs (compile.dynamic: %s) serve every "
            "shape they cover, and torch compiles the others",
            asked,
            served_torch_kwargs(manifest).get("dynamic"),
        )
    return compiled


def exact_grid(manifest: Manifest) -> bool:
    """Whether a compile-route artifact serves its baked buckets and nothing else, so that a
    request of another shape (or input dtype) is off the grid, padded or not: ``dynamic:
    false`` compiles one graph per bucket, and torch would compile any other shape in the
    server. Dynamic graphs (``true``, or None's automatic dynamic) serve shapes between and
    beyond the buckets; the AOT route's packages pick their own."""
    return manifest.aoti is None and served_torch_kwargs(manifest).get("dynamic") is False


def miss_policy(manifest: Manifest, on_miss: OnMiss | None = None) -> OnMiss:
    """What a request off ``manifest``'s grid gets: ``on_miss`` (the caller's), else the spec's
    ``compile.on_miss``, else :data:`~kiln.serving.DEFAULT_ON_MISS`; ``compile`` where nothing
    holds requests to the grid (a spec that pads nothing, served by dynamic graphs). A caller's
    value outside :data:`~kiln.serving.ON_MISS` is a ParameterError, the manifest's an
    IntegrityError."""
    if on_miss is not None and on_miss not in ON_MISS:  # the caller's: not the artifact's fault
        raise ParameterError("on_miss", on_miss, f"one of {', '.join(ON_MISS)}")
    policy = on_miss or (manifest.spec.get("compile") or {}).get("on_miss") or DEFAULT_ON_MISS
    if policy not in ON_MISS:
        raise IntegrityError(f"{manifest.name}: on_miss {policy!r} is not one of {ON_MISS}")
    if manifest.aoti is None and not exact_grid(manifest):
        return policy if PadGrid.from_manifest(manifest).pads else "compile"
    return policy
