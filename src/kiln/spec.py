"""The model spec: what to compile, how, and over which shape grid.

The spec is the contract between the CI that bakes and the pod that verifies, so it is strict:
unknown keys, duplicate keys and wrong types are errors that point at ``file:line:col``. PyYAML
silently keeps the last of two duplicate keys, and pydantic only knows paths, so we compose the
YAML node tree once and use it both to reject duplicates and to map pydantic's error locations
back to source positions. Torch-free: init containers parse specs too.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import math
import re
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from kiln.errors import SpecError
from kiln.serving import (
    ENV_ALLOWED_PREFIXES,
    MAX_NAME_LENGTH,
    MAX_WORLD_SIZE,
    NAME_PATTERN,
    AotiWeights,
    OnMiss,
    env_key_problem,
)
from kiln.serving import autotunes as _autotunes
from kiln.serving import inductor_options as _inductor_options

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"]
FloatDType = Literal["float32", "float16", "bfloat16"]
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

# --- limits --------------------------------------------------------------------------------
# A spec is input from CI, so every number in it is bounded where it is parsed: a typo or a
# hostile value is exit 2 with its location, never a worker that compiles, allocates or loops
# until it is killed. The bounds are far beyond any real grid (docs/spec.md).
MAX_SPEC_BYTES = 1 << 20  # the file itself
MAX_YAML_NODES = 20_000  # values in the document, each alias counted at its expanded size
MAX_YAML_DEPTH = 32  # levels of nesting (a spec needs 5)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # every integer in a spec (torch's widest)
MAX_SIZE = 2**31 - 1  # a bucket size or a fixed dimension
MAX_RANK = 16  # dimensions of one input
MAX_INPUT_ELEMENTS = 2**31  # elements of one input at the grid's largest sizes
MAX_BUCKETS = 4096  # points of the grid before `exclude` (each one is a compile)
MAX_CALLS = 1000  # warmup.calls
MAX_PASSES = 8  # warmup.passes (automatic: at most 4)
# Keyword arguments a distributed spec's factory receives, so it can build its shard.
RANK_KWARGS = ("rank", "world_size")
# The values torch.randint can draw for each dtype, as (lowest low, highest high); high is
# exclusive. float16 stops at its largest finite value; float32/bfloat16 reach past int64.
RANDINT_RANGE: dict[str, tuple[int, int]] = {
    "bool": (0, 2),
    "int32": (-(2**31), 2**31),
    "float16": (-65504, 65505),
}

# compile keys added after specs were first digested, with their defaults: canonical() leaves a
# default out, so a spec that does not use them keeps the digest it had.
_LATER_COMPILE_DEFAULTS = {"route": "compile", "weights": "external"}

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# A pad value as YAML writes it: a boolean, an integer or a float, never a string ("0").
PadValue = StrictBool | Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | StrictFloat
FLOAT16_MAX = 65504.0
Size = Annotated[int, Field(ge=1, le=MAX_SIZE)]


def pad_problem(pad: bool | int | float | None, dtype: str) -> str | None:
    """Why ``pad`` cannot fill a tensor of ``dtype``, or None when it can (or is absent).

    torch would convert silently: 1.5 into an int64 input becomes 1, 70000 into float16 is inf,
    ``true`` into a float is 1.0. A pad value that changes on the way in is a spec mistake.
    """
    if pad is None:
        return None
    if dtype == "bool":
        ok = isinstance(pad, bool)
        return None if ok else f"a bool input pads with true or false, not {pad!r}"
    if isinstance(pad, bool):
        return f"a {dtype} input pads with a number, not {str(pad).lower()}"
    if dtype in ("int64", "int32"):
        if not isinstance(pad, int):
            return f"an {dtype} input pads with an integer, not {pad!r}"
        if dtype == "int32" and not -(2**31) <= pad < 2**31:
            return f"{pad} does not fit int32"
        return None
    if dtype == "float16" and abs(pad) > FLOAT16_MAX:
        return f"{pad} does not fit float16 (at most {FLOAT16_MAX:g} in magnitude)"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    factory: str = Field(
        pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_.]*$",
        description='"module:callable" or "file.py:callable", resolved next to the spec first',
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)
    dtype: FloatDType = "float32"
    device: Literal["cpu", "cuda"] = Field("cpu", description="cuda means cuda:0")
    call_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="constant keyword arguments passed on every call"
    )


class CompileSpec(_Strict):
    backend: str = "inductor"
    mode: Mode | None = Field(None, description="torch.compile mode; None means default")
    dynamic: bool | None = False
    fullgraph: bool = False
    options: dict[str, Any] = Field(
        default_factory=dict, description="torch.compile options=; exclusive with mode"
    )
    precompile: bool = Field(
        False,
        description=(
            "also bake what lets a serving process skip Dynamo tracing: AOT-compiled forwards "
            "(graphs + guards) with fullgraph: true (torch >= 2.9), else Dynamo's saved frames, "
            "graph breaks included (torch >= 2.11); served by kiln.activate().compile()"
        ),
    )

    on_miss: OnMiss | None = Field(
        None,
        description=(
            "a served request outside the baked grid (larger than the largest bucket, or a "
            "size of an axis that is not padded): error | eager | compile; None means error. "
            "Counted and logged once per shape"
        ),
    )
    route: Literal["compile", "aoti"] = Field(
        "compile",
        description=(
            "compile: serve through torch.compile from the restored caches; aoti: torch.export "
            "+ AOTInductor packages, served without Dynamo or Inductor (full-graph models only)"
        ),
    )
    weights: AotiWeights = Field(
        "external",
        description=(
            "route: aoti: external builds the packages without their weights and serves the "
            "model's own parameters; embed builds them in (self-contained, bake-time weights)"
        ),
    )

    @model_validator(mode="after")
    def _mode_xor_options(self) -> CompileSpec:
        if self.options and self.mode is not None:  # torch refuses both, mode=None aside
            raise _LocatedValueError(
                ("options",), "mode and options are mutually exclusive (torch.compile refuses both)"
            )
        if self.route == "compile":
            if "weights" in self.model_fields_set:
                raise _LocatedValueError(("weights",), "weights is for route: aoti")
            return self
        if self.on_miss == "compile":  # the route's server has no compiler to call
            raise _LocatedValueError(
                ("on_miss",), "route: aoti serves without a compiler: on_miss is error or eager"
            )
        if self.precompile:
            raise _LocatedValueError(
                ("precompile",),
                "route: aoti serves AOTInductor packages; precompile is the torch.compile route's",
            )
        if self.backend != "inductor":
            raise _LocatedValueError(("backend",), "route: aoti compiles with inductor")
        return self

    @property
    def precompile_route(self) -> Literal["aot", "frames"] | None:
        """How ``precompile: true`` spares a restored process Dynamo's tracing: one AOT graph
        per bucket for a full-graph model (kiln.compiler.precompile), else Dynamo's saved frames,
        graph breaks and all (kiln.compiler.frames)."""
        if not self.precompile:
            return None
        return "aot" if self.fullgraph else "frames"

    def inductor_options(self) -> dict[str, Any]:
        """The Inductor settings this spec compiles with, whether spelled as mode or options."""
        return _inductor_options(self.mode, self.options)

    @property
    def autotunes(self) -> bool:
        """Whether compiling tunes kernels, whose results a fresh process must find and re-read."""
        return _autotunes(self.inductor_options())

    @property
    def cudagraphs(self) -> bool:
        """Whether calls are CUDA-graphed: a warm bucket needs its graph recorded, not just
        compiled (warm-up call, recording call, then replays)."""
        return bool(self.inductor_options().get("triton.cudagraphs"))


class InputSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    shape: list[str | int] = Field(max_length=MAX_RANK)
    dtype: DType = "float32"
    fill: Literal["randn", "randint", "ones", "zeros"] = "randn"
    low: Int64 = 0
    high: Int64 | None = None
    pad: PadValue | None = Field(
        None,
        description=(
            "the value a served request is padded with up to its bucket (kiln.padding); an "
            "input without it is never padded, and an axis is padded only when every input "
            "that carries it declares one"
        ),
    )

    @field_validator("pad", mode="before")
    @classmethod
    def _pad_is_a_number(cls, pad: Any) -> Any:
        if pad is not None and not isinstance(pad, (bool, int, float)):
            raise ValueError(f"a pad value is a number or true/false, not {type(pad).__name__}")
        if isinstance(pad, float) and not math.isfinite(pad):
            raise ValueError(f"a pad value is finite, not {pad} (the manifest records it as JSON)")
        return pad

    @model_validator(mode="after")
    def _pad_fits_dtype(self) -> InputSpec:
        problem = pad_problem(self.pad, self.dtype)
        if problem:
            raise _LocatedValueError(("pad",), problem)
        return self

    @model_validator(mode="after")
    def _randint_needs_high(self) -> InputSpec:
        if self.fill == "randint" and self.high is None:
            raise _LocatedValueError(("fill",), "fill: randint needs `high`")
        if self.high is not None and self.high <= self.low:
            raise _LocatedValueError(("high",), "`high` must be greater than `low`")
        if self.fill == "randint" and self.high is not None and self.dtype in RANDINT_RANGE:
            lowest, highest = RANDINT_RANGE[self.dtype]
            if self.low < lowest:
                raise _LocatedValueError(("low",), f"{self.dtype} values start at {lowest}")
            if self.high > highest:
                raise _LocatedValueError(
                    ("high",), f"{self.dtype} values end below {highest} (high is exclusive)"
                )
        return self


class WarmupSpec(_Strict):
    calls: int = Field(2, ge=1, le=MAX_CALLS, description="calls per bucket during bake")
    passes: int | None = Field(
        None,
        ge=1,
        le=MAX_PASSES,
        description=(
            "fresh-process bake passes in different bucket orders; None: 1 for dynamic=false "
            "without autotuning (static shapes are keyed per shape), else until a pass "
            "compiles nothing (at most 4)"
        ),
    )


class DistributedSpec(_Strict):
    """K ranks, one process each, launched by torch's own launcher (``torch.distributed.run``).

    Each rank compiles its own graphs (its shard, its collectives) into its own cache root; the
    factory gets ``rank=`` and ``world_size=`` to build its shard.
    """

    world_size: int = Field(
        ge=1,
        le=MAX_WORLD_SIZE,
        description="ranks (processes); cuda: one GPU each (cuda:LOCAL_RANK)",
    )
    backend: Literal["gloo", "nccl"] = Field(
        description="torch.distributed backend: gloo (CPU) or nccl (CUDA)"
    )


class Spec(_Strict):
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH, description="artifact name")
    model: ModelSpec
    compile: CompileSpec = Field(default_factory=CompileSpec)
    inputs: list[InputSpec] = Field(min_length=1)
    buckets: dict[str, list[Size]] = Field(min_length=1)
    exclude: list[dict[str, int]] = Field(default_factory=list)
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    distributed: DistributedSpec | None = Field(
        None, description="tensor-parallel ranks; absent: one process, as before"
    )
    env: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description=(
            "extra environment for compilation, recorded; only variables that change compiled "
            f"code ({', '.join(p + '*' for p in ENV_ALLOWED_PREFIXES)}), never cache locations, "
            "files or programs"
        ),
    )

    bytecode: Literal["auto", "always", "never"] = Field(
        "auto",
        description=(
            "ship the Python bytecode of the modules the bake imported (kiln.bytecode): auto "
            "when torch's is not cached in the bake's image, which the serving image then "
            "likely lacks too; a served process uses it only when it has none of its own"
        ),
    )

    _path: Path | None = PrivateAttr(None)
    _base: Path | None = PrivateAttr(None)  # set by with_base(): a spec that came by value

    @model_validator(mode="after")
    def _check_axes(self) -> Spec:
        points = 1
        for axis, sizes in self.buckets.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", axis):
                raise _LocatedValueError(("buckets", axis), "axis names are identifiers")
            if not sizes:
                raise _LocatedValueError(("buckets", axis), "needs at least one size")
            if len(set(sizes)) != len(sizes):
                raise _LocatedValueError(("buckets", axis), "sizes must be unique and >= 1")
            points *= len(sizes)
            if points > MAX_BUCKETS:
                raise _LocatedValueError(
                    ("buckets", axis), f"the grid has more than {MAX_BUCKETS} buckets"
                )
        names: dict[str, int] = {}
        for i, inp in enumerate(self.inputs):
            if inp.name in names:
                raise _LocatedValueError(
                    ("inputs", i, "name"), f"input {inp.name!r} is also input {names[inp.name]}"
                )
            names[inp.name] = i
            elements = 1
            for j, dim in enumerate(inp.shape):
                if isinstance(dim, str) and dim not in self.buckets:
                    hint = _did_you_mean(dim, self.buckets)
                    raise _LocatedValueError(
                        ("inputs", i, "shape", j), f"axis {dim!r} is not declared in buckets{hint}"
                    )
                if isinstance(dim, int) and not 1 <= dim <= MAX_SIZE:
                    raise _LocatedValueError(
                        ("inputs", i, "shape", j), f"sizes must be >= 1 and <= {MAX_SIZE}"
                    )
                elements *= max(self.buckets[dim]) if isinstance(dim, str) else dim
            if elements > MAX_INPUT_ELEMENTS:
                raise _LocatedValueError(
                    ("inputs", i, "shape"),
                    f"{elements} elements at the largest bucket; one input may have at most "
                    f"{MAX_INPUT_ELEMENTS}",
                )
        self._check_pads()
        used = {dim for inp in self.inputs for dim in inp.shape if isinstance(dim, str)}
        for axis in self.buckets:
            if axis not in used:  # it would only repeat every bucket, compiling nothing new
                raise _LocatedValueError(("buckets", axis), f"axis {axis!r} is used by no input")
        for key in self.model.call_kwargs:
            if key in names:
                raise _LocatedValueError(
                    ("model", "call_kwargs", key), f"{key!r} is already an input's name"
                )
        for i, combo in enumerate(self.exclude):
            for axis in combo:
                if axis not in self.buckets:
                    raise _LocatedValueError(
                        ("exclude", i, axis),
                        f"unknown axis {axis!r}{_did_you_mean(axis, self.buckets)}",
                    )
        for key in self.env:
            problem = env_key_problem(key)
            if problem:
                raise _LocatedValueError(("env", key), problem)
        self._check_distributed()
        return self

    def _check_pads(self) -> None:
        """A declared ``pad`` must be able to pad something: an input whose every axis is also
        carried by an input without ``pad`` would never be padded, which is a spec mistake."""
        paddable = self.paddable_axes()
        for i, inp in enumerate(self.inputs):
            if inp.pad is None:
                continue
            axes = [d for d in inp.shape if isinstance(d, str)]
            if not axes:
                raise _LocatedValueError(
                    ("inputs", i, "pad"), f"input {inp.name!r} has no bucket axis to pad"
                )
            if not any(a in paddable for a in axes):
                blockers = sorted(
                    {
                        other.name
                        for other in self.inputs
                        if other.pad is None and any(a in other.shape for a in axes)
                    }
                )
                raise _LocatedValueError(
                    ("inputs", i, "pad"),
                    f"input {inp.name!r} is never padded: {', '.join(map(repr, blockers))} "
                    f"also carr{'ies' if len(blockers) == 1 else 'y'} its axes and declares "
                    "no pad",
                )

    def paddable_axes(self) -> list[str]:
        """The axes a served request may be padded on, in bucket order: those that every
        input carrying them declares a ``pad`` for."""
        return [
            axis
            for axis in self.buckets
            if all(inp.pad is not None for inp in self.inputs if axis in inp.shape)
            and any(axis in inp.shape for inp in self.inputs)
        ]

    def _check_distributed(self) -> None:
        """A backend that cannot run on the device, or kwargs that would shadow the rank."""
        if self.distributed is None:
            return
        if self.distributed.backend == "nccl" and self.model.device != "cuda":
            raise _LocatedValueError(
                ("distributed", "backend"), "nccl needs model.device: cuda (use gloo on the CPU)"
            )
        if self.compile.precompile_route == "frames":
            raise _LocatedValueError(
                ("compile", "precompile"),
                "precompile: true with graph breaks (fullgraph: false) is single-rank for now",
            )
        if self.bytecode == "always":
            raise _LocatedValueError(
                ("bytecode",), "a multi-rank bake ships no Python bytecode (single-rank for now)"
            )
        for key in RANK_KWARGS:
            if key in self.model.kwargs:
                raise _LocatedValueError(
                    ("model", "kwargs", key),
                    f"{key!r} is passed by kiln to a distributed spec's factory (each rank's own)",
                )

    # --- derived facts -------------------------------------------------------------------
    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def base_dir(self) -> Path:
        """Where the spec's relative paths (a factory file) start: its file's folder."""
        if self._base is not None:
            return self._base
        return self._path.parent if self._path else Path.cwd()

    def with_base(self, base: Path) -> Spec:
        """This spec, its relative paths resolved from ``base``: a spec sent by value (a grid
        worker's) has no file, only the folder its file was in."""
        out = self.model_copy()
        out._base = base
        return out

    def canonical(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        if self.distributed is None:  # a 1-rank spec's digest stays what it was before ranks
            del out["distributed"]
        if self.bytecode == "auto":  # likewise for the default, added later
            del out["bytecode"]
        # Likewise for padding (added later): absent unless declared.
        if out["compile"]["on_miss"] is None:
            del out["compile"]["on_miss"]
        for inp in out["inputs"]:
            if inp["pad"] is None:
                del inp["pad"]
        for key, default in _LATER_COMPILE_DEFAULTS.items():  # and compile's later keys
            if out["compile"].get(key) == default:
                del out["compile"][key]
        return out

    @property
    def world_size(self) -> int:
        """Ranks this spec runs as: 1 unless it has a ``distributed`` section."""
        return self.distributed.world_size if self.distributed else 1

    def sha256(self) -> str:
        """Digest of the spec's meaning (not its formatting): what bake and verify must share."""
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def compile_env(self) -> dict[str, str]:
        return {k: _env_str(v) for k, v in self.env.items()}

    def factory_origin(self) -> Path | None:
        """The source file the factory lives in, when it is a file we can hash."""
        target, _, _ = self.model.factory.partition(":")
        if target.endswith(".py"):
            p = Path(target)
            return p if p.is_absolute() else self.base_dir / p
        found = _find_module(target, self.base_dir)
        return Path(found.origin) if found and found.origin else None


def _env_str(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


class _LocatedValueError(ValueError):
    """A cross-field error that knows which key it belongs to (pydantic only knows the model)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def _did_you_mean(word: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` when one of ``choices`` is close to ``word``, else nothing."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fields_at(loc: tuple[str | int, ...]) -> list[str]:
    """The keys the spec's models allow at ``loc`` (``()`` is the top level); [] where free-form.

    Follows the models' annotations (a model, a list of models, an optional model), so an
    unknown key is compared with its own level's fields, however deep it is.
    """
    annotation: Any = Spec
    for part in loc:
        annotation = _without_none(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        elif get_origin(annotation) is list and isinstance(part, int):
            annotation = get_args(annotation)[0]
        else:
            return []
    annotation = _without_none(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``; any other annotation as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _find_module(name: str, base: Path) -> Any:
    sys.path.insert(0, str(base))
    try:
        return importlib.util.find_spec(name)
    except Exception:  # a dotted name imports its parent package, which may raise anything
        return None
    finally:
        sys.path.remove(str(base))


# --- YAML with positions and bounds -------------------------------------------------------
#
# A spec may come from anywhere (a pull request, a pipeline variable), and PyYAML left alone will
# expand a kilobyte of nested aliases into billions of nodes, recurse until RecursionError on deep
# nesting, and raise assorted exceptions on tags it cannot construct. So kiln composes the node
# tree itself, with bounds, and builds plain Python values from it: only strings, 64-bit
# integers, floats, booleans, null, lists and mappings with string keys. Anchors and aliases stay
# allowed (a shared size list is handy) but count at their expanded size, so a bomb stops at
# MAX_YAML_NODES; an alias inside its own anchor is refused; merge keys (``<<``) are refused.

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("str", "int", "float", "bool", "null"))
# Implicitly resolved tags that kiln reads as the plain text they are written as: YAML 1.1
# timestamps (``2024-01-01``), ``=`` and ``<<`` as a value are not values a spec needs (``<<`` as
# a key is refused, see check_key).
_PLAIN_TAGS = frozenset(_TAG + t for t in ("timestamp", "value", "yaml", "merge"))


# libyaml's parser where PyYAML was built with it (several times faster), else PyYAML's own; both
# give the same events, and kiln composes and constructs from those itself.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _tag_name(tag: str) -> str:
    return "!!" + tag.removeprefix(_TAG) if tag.startswith(_TAG) else tag


class _Composer:
    """Builds a node tree from PyYAML's event stream, refusing what a spec never needs.

    Depth and expanded size are checked as events arrive, so a hostile document is refused after
    at most MAX_YAML_NODES nodes of work, whatever its size once expanded.
    """

    def __init__(self, text: str, file: str) -> None:
        self.loader = _Loader(text)
        self.file = file
        self.expanded = 0  # nodes composed so far, each alias counted at its expanded size
        # anchor -> (node, expanded size, height); size None while the anchored node is open
        self.anchors: dict[str, tuple[yaml.Node, int | None, int]] = {}

    def error(self, message: str, mark: Any) -> SpecError:
        return SpecError(
            message,
            file=self.file,
            line=mark.line + 1 if mark is not None else None,
            col=mark.column + 1 if mark is not None else None,
        )

    def document(self) -> yaml.Node | None:
        loader = self.loader
        loader.get_event()  # stream start
        if loader.check_event(yaml.StreamEndEvent):
            return None
        loader.get_event()  # document start
        node, _ = self.node(1)
        loader.get_event()  # document end
        if not loader.check_event(yaml.StreamEndEvent):
            event = loader.get_event()
            raise self.error("a spec is one YAML document (found a second one)", event.start_mark)
        return node

    def count(self, n: int, mark: Any) -> None:
        self.expanded += n
        if self.expanded > MAX_YAML_NODES:
            raise self.error(
                f"the document holds more than {MAX_YAML_NODES} values (an alias counts "
                "as everything it repeats): refused",
                mark,
            )

    def node(self, depth: int) -> tuple[yaml.Node, int]:
        """The next node and its height (levels of nesting, aliases expanded)."""
        loader = self.loader
        event = loader.peek_event()
        if isinstance(event, yaml.AliasEvent):
            loader.get_event()
            if event.anchor not in self.anchors:
                raise self.error(f"undefined alias *{event.anchor}", event.start_mark)
            target, size, height = self.anchors[event.anchor]
            if size is None:
                raise self.error(
                    f"recursive alias *{event.anchor} (used inside its own anchor)",
                    event.start_mark,
                )
            self.count(size, event.start_mark)
            self.check_depth(depth + height - 1, event.start_mark)
            return target, height
        self.check_depth(depth, event.start_mark)
        anchor = event.anchor
        if anchor is not None and anchor in self.anchors:
            raise self.error(f"duplicate anchor &{anchor}", event.start_mark)
        start = self.expanded
        self.count(1, event.start_mark)
        if isinstance(event, yaml.ScalarEvent):
            node: yaml.Node = self.scalar()
            height = 1
            if anchor is not None:
                self.anchors[anchor] = (node, 1, 1)
            return node, height
        loader.get_event()
        kind = "seq" if isinstance(event, yaml.SequenceStartEvent) else "map"
        if event.tag not in (None, "!", _TAG + kind):
            raise self.error(
                f"tag {_tag_name(event.tag)} is not allowed in a spec", event.start_mark
            )
        collection: yaml.SequenceNode | yaml.MappingNode
        if kind == "seq":
            collection = yaml.SequenceNode(_TAG + kind, [], event.start_mark, None)
        else:
            collection = yaml.MappingNode(_TAG + kind, [], event.start_mark, None)
        if anchor is not None:
            self.anchors[anchor] = (collection, None, 0)
        height = 1
        end = yaml.SequenceEndEvent if kind == "seq" else yaml.MappingEndEvent
        while not loader.check_event(end):
            if kind == "seq":
                item, h = self.node(depth + 1)
                collection.value.append(item)
            else:
                key, _ = self.node(depth + 1)
                self.check_key(key)
                item, h = self.node(depth + 1)
                collection.value.append((key, item))
            height = max(height, h + 1)
        collection.end_mark = loader.get_event().end_mark
        if anchor is not None:
            self.anchors[anchor] = (collection, self.expanded - start, height)
        return collection, height

    def scalar(self) -> yaml.ScalarNode:
        event = self.loader.get_event()
        if event.tag in (None, "!"):
            tag = self.loader.resolve(yaml.ScalarNode, event.value, event.implicit)
            if tag in _PLAIN_TAGS:
                tag = _TAG + "str"
        elif event.tag in _SCALAR_TAGS:
            tag = event.tag
        else:
            raise self.error(
                f"tag {_tag_name(event.tag)} is not allowed in a spec (plain strings, numbers, "
                "booleans, null, lists and mappings only)",
                event.start_mark,
            )
        return yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)

    def check_key(self, key: yaml.Node) -> None:
        if isinstance(key, yaml.ScalarNode) and key.value == "<<" and not key.style:
            raise self.error(
                "merge keys (<<) are not supported: write the keys out", key.start_mark
            )
        if not isinstance(key, yaml.ScalarNode) or key.tag != _TAG + "str":
            raise self.error(
                "mapping keys must be strings (quote a key that reads as a number, boolean or "
                "null)",
                key.start_mark,
            )

    def check_depth(self, depth: int, mark: Any) -> None:
        if depth > MAX_YAML_DEPTH:
            raise self.error(f"nested deeper than {MAX_YAML_DEPTH} levels: refused", mark)


def _compose(text: str, file: str) -> yaml.Node | None:
    """The document's bounded node tree; every problem is a located :class:`SpecError`."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES} bytes", file=file)
    try:
        return _Composer(text, file).document()
    except yaml.MarkedYAMLError as exc:
        message, mark = _syntax_error(exc)
        raise SpecError(
            f"invalid YAML: {message}",
            file=file,
            line=mark.line + 1 if mark else None,
            col=mark.column + 1 if mark else None,
        ) from None
    except yaml.reader.ReaderError as exc:
        before = text[: exc.position]
        raise SpecError(
            f"invalid YAML: character {_codepoint(exc.character)} is not allowed",
            file=file,
            line=before.count("\n") + 1,
            col=exc.position - (before.rfind("\n") + 1) + 1,
        ) from None
    except yaml.YAMLError as exc:  # no position known
        raise SpecError(f"invalid YAML: {exc}", file=file) from None
    except UnicodeError:  # lone surrogates in text that did not come from a file
        raise SpecError("invalid YAML: the text is not valid Unicode", file=file) from None


def _syntax_error(exc: yaml.MarkedYAMLError) -> tuple[str, Any]:
    """What PyYAML (or libyaml) found, and where the mistake is.

    The parser notices a missing thing only at the next token, which is often on a later line:
    a key without its ':' is reported on the line after it, an unclosed quote or bracket at the
    end of the file. Its *context* mark is where it started the construct it could not finish;
    when that is on an earlier line, the mistake is there. Block contexts are the exception:
    "while parsing a block mapping" starts at the mapping's first key, while a mis-indented line
    is the problem mark's own.
    """
    problem, context = exc.problem, exc.context
    message = problem or context or "syntax error"
    p, c = exc.problem_mark, exc.context_mark
    if (
        p is not None
        and c is not None
        and context
        and c.line < p.line
        and not context.startswith("while parsing a block")
    ):
        return f"{message} ({context})" if problem else message, c
    return message, p or c


def _codepoint(character: str | int | bytes) -> str:
    """PyYAML's reader reports a str, libyaml's an int, a decoding error a byte."""
    if isinstance(character, bytes):
        return "0x" + character.hex()
    return f"U+{character if isinstance(character, int) else ord(character):04X}"


def _construct(loader: yaml.SafeLoader, node: yaml.Node, file: str, path: tuple[str, ...]) -> Any:
    """Plain Python values from a composed tree (aliases already bounded by the composer)."""
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        first: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = _scalar(loader, key_node, file)
            where = (*path, key)
            if key in first:
                raise SpecError(
                    f"duplicate key (first defined on line {first[key].start_mark.line + 1})",
                    file=file,
                    line=key_node.start_mark.line + 1,
                    col=key_node.start_mark.column + 1,
                    key=_printable(".".join(where)),
                )
            first[key] = key_node
            out[key] = _construct(loader, value_node, file, where)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _construct(loader, item, file, (*path, str(i))) for i, item in enumerate(node.value)
        ]
    return _scalar(loader, node, file)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node, file: str) -> Any:
    def refuse(message: str) -> SpecError:
        return SpecError(
            message, file=file, line=node.start_mark.line + 1, col=node.start_mark.column + 1
        )

    try:
        value = loader.construct_object(node, deep=True)
    except Exception:  # PyYAML's converters raise what they meet (`!!int ""`: IndexError)
        shown = repr(node.value) if len(node.value) <= 40 else repr(node.value[:40]) + "…"
        what = "a 64-bit integer" if node.tag == _TAG + "int" else f"a valid {_tag_name(node.tag)}"
        raise refuse(f"{shown} is not {what}") from None
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not INT64_MIN <= value <= INT64_MAX
    ):
        raise refuse("integer beyond 64 bits")
    if isinstance(value, str) and "\0" in value:
        raise refuse("strings must not contain NUL characters")
    return value


def _locate(root: yaml.Node | None, loc: tuple[str | int, ...]) -> tuple[int, int] | None:
    """Source position of the deepest node along ``loc`` (the key itself when it is a key)."""
    node = root
    best: yaml.Node | None = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if str(key_node.value) == str(part):
                    best, node = key_node, value_node
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = best = node.value[part]
        else:
            break
    if best is None:
        return None
    return best.start_mark.line + 1, best.start_mark.column + 1


def _dotted(loc: tuple[str | int, ...]) -> str:
    return _printable(".".join(str(p) for p in loc)) or "<root>"


def _printable(text: str) -> str:
    """Keys come from the spec: a line break in one must not split the one-line error."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def parse_spec(text: str, file: str = "<spec>", path: Path | None = None) -> Spec:
    """Parse and validate spec text; every error names ``file:line:col: key``."""
    root = _compose(text, file)
    if root is None:
        raise SpecError("empty spec", file=file, line=1, col=1)
    if not isinstance(root, yaml.MappingNode):
        line, col = root.start_mark.line + 1, root.start_mark.column + 1
        raise SpecError("a spec is a mapping of keys", file=file, line=line, col=col)
    data = _construct(yaml.SafeLoader(""), root, file, ())
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # A typo'd key is the cause of the "missing" error it leaves behind: name it first.
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        loc: tuple[str | int, ...] = tuple(err["loc"])
        message = err["msg"]
        located = (err.get("ctx") or {}).get("error")
        if isinstance(located, _LocatedValueError):
            loc, message = _without_type_tags(loc) + located.loc, located.message
        elif err["type"] == "extra_forbidden":
            # the last part is the spec's own key, never a type tag, whatever it spells
            parent, key = _without_type_tags(loc[:-1]), str(loc[-1])
            loc, message = (*parent, key), f"unknown key {key!r}"
            message += _did_you_mean(key, _fields_at(parent))
        else:
            loc = _without_type_tags(loc)
        pos = _locate(root, loc)
        line, col = pos if pos else (None, None)
        raise SpecError(
            _printable(message.removeprefix("Value error, ")),
            file=file,
            line=line,
            col=col,
            key=_dotted(loc),
        ) from None
    spec._path = path
    _check_factory(spec, root, file)
    return spec


def _without_type_tags(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """pydantic appends union member names ("str", "int", "function-after[...]") to locs."""
    return tuple(
        p
        for p in loc
        if not (
            isinstance(p, str)
            and (p in {"str", "int", "float", "bool", "none", "list", "dict"} or "[" in p)
        )
    )


def _check_factory(spec: Spec, root: yaml.Node, file: str) -> None:
    """Catch a factory that cannot resolve now, not minutes into a CI bake (torch-free)."""
    target, _, _ = spec.model.factory.partition(":")
    ok = True
    if target.endswith(".py"):
        origin = spec.factory_origin()
        try:
            ok = origin is not None and origin.is_file()
        except (OSError, ValueError):  # a name too long for the filesystem, say
            ok = False
        problem = f"factory file {target!r} not found next to the spec"
    else:
        ok = _find_module(target, spec.base_dir) is not None
        problem = f"factory module {target!r} not found (looked next to the spec, then sys.path)"
    if not ok:
        line, col = _locate(root, ("model", "factory")) or (None, None)
        raise SpecError(problem, file=file, line=line, col=col, key="model.factory")


def error_at(spec: Spec, key: str, message: str) -> SpecError:
    """A :class:`SpecError` for a problem found after parsing (e.g. while importing the factory)."""
    line = col = None
    if spec.path is not None:
        with contextlib.suppress(OSError, UnicodeDecodeError, SpecError):
            root = _compose(spec.path.read_text(encoding="utf-8"), str(spec.path))
            loc = tuple(int(p) if p.isdigit() else p for p in key.split("."))
            line, col = _locate(root, loc) or (None, None)
    return SpecError(
        _printable(message),
        file=str(spec.path or "<spec>"),
        line=line,
        col=col,
        key=_printable(key),
    )


def load_spec(path: str | Path) -> Spec:
    """Read a spec file. Raises :class:`SpecError` (exit 2) with ``file:line:col``."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # never more: the path may be /dev/zero
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SpecError("spec file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read spec: {exc}", file=str(path)) from None
    return parse_spec(text, file=str(path), path=p.resolve())


def spec_json_schema() -> dict[str, Any]:
    return Spec.model_json_schema()


def differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys where two canonical specs differ (``buckets.seq``, ``model.kwargs.dim``):
    what ``kiln verify`` names when it is given another spec than the one baked."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            where = f"{prefix}.{key}" if prefix else str(key)
            out += (
                differing_keys(a.get(key), b.get(key), where) if key in a and key in b else [where]
            )
        return out
    return [] if a == b else [prefix or "(the whole spec)"]
