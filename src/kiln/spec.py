"""The model spec: what to compile, how, and over which shape grid.

The spec is the contract between the CI that bakes and the pod that verifies, so it is strict:
unknown keys, duplicate keys and wrong types are errors that point at ``file:line:col``. This
module holds the models and their cross-field checks; reading YAML with positions and bounds,
and mapping an error back to its key, is :mod:`kiln.spec_yaml`'s. Torch-free: init containers
parse specs too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

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

from kiln.envrules import ENV_ALLOWED_PREFIXES, env_key_problem
from kiln.errors import SpecError
from kiln.serving import MAX_NAME_LENGTH, MAX_WORLD_SIZE, NAME_PATTERN, AotiWeights, OnMiss
from kiln.serving import autotunes as _autotunes
from kiln.serving import inductor_options as _inductor_options
from kiln.spec_yaml import (
    INT64_MAX,
    INT64_MIN,
    MAX_SPEC_BYTES,
    LocatedValueError,
    compose,
    did_you_mean,
    locate,
    located_error,
    printable,
    read_mapping,
    yaml11_float,
)
from kiln.workdir import workdir_problem

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"]
FloatDType = Literal["float32", "float16", "bfloat16"]
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

# --- limits --------------------------------------------------------------------------------
# A spec is input from CI, so every number in it is bounded where it is parsed: a typo or a
# hostile value is exit 2 with its location, never a worker that compiles, allocates or loops
# until it is killed. The bounds are far beyond any real grid (docs/spec.md).
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
        article = "an" if dtype.startswith("int") else "a"
        return f"{article} {dtype} input pads with a number, not {str(pad).lower()}"
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
            raise LocatedValueError(
                ("options",), "mode and options are mutually exclusive (torch.compile refuses both)"
            )
        if self.route == "compile":
            if "weights" in self.model_fields_set:
                raise LocatedValueError(("weights",), "weights is for route: aoti")
            return self
        if self.on_miss == "compile":  # the route's server has no compiler to call
            raise LocatedValueError(
                ("on_miss",), "route: aoti serves without a compiler: on_miss is error or eager"
            )
        if self.precompile:
            raise LocatedValueError(
                ("precompile",),
                "route: aoti serves AOTInductor packages; precompile is the torch.compile route's",
            )
        if self.backend != "inductor":
            raise LocatedValueError(("backend",), "route: aoti compiles with inductor")
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
        if isinstance(pad, str) and (spelled := yaml11_float(pad)) is not None:
            raise ValueError(
                f"a pad value is a number, not the string {pad!r} (YAML 1.1 reads an exponent "
                f"float only with a dot and a signed exponent): write {spelled}"
            )
        if pad is not None and not isinstance(pad, (bool, int, float)):
            raise ValueError(f"a pad value is a number or true/false, not {type(pad).__name__}")
        if isinstance(pad, float) and not math.isfinite(pad):
            raise ValueError(f"a pad value is finite, not {pad} (the manifest records it as JSON)")
        return pad

    @model_validator(mode="after")
    def _pad_fits_dtype(self) -> InputSpec:
        problem = pad_problem(self.pad, self.dtype)
        if problem:
            raise LocatedValueError(("pad",), problem)
        return self

    @model_validator(mode="after")
    def _randint_needs_high(self) -> InputSpec:
        if self.fill == "randint" and self.high is None:
            raise LocatedValueError(("fill",), "fill: randint needs `high`")
        if self.high is not None and self.high <= self.low:
            raise LocatedValueError(("high",), "`high` must be greater than `low`")
        if self.fill == "randint" and self.high is not None and self.dtype in RANDINT_RANGE:
            lowest, highest = RANDINT_RANGE[self.dtype]
            if self.low < lowest:
                raise LocatedValueError(("low",), f"{self.dtype} values start at {lowest}")
            if self.high > highest:
                raise LocatedValueError(
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
            "without autotuning (static shapes are keyed per shape; 2 with precompiled "
            "forwards, the second for plain torch.compile's entries), else until a pass "
            "compiles nothing (at most 4)"
        ),
    )


class ServeSpec(_Strict):
    """Where the server runs, as far as a compiled cache depends on it (kiln.workdir)."""

    workdir: str | None = Field(
        None,
        description=(
            "the folder the server runs in (its image's WORKDIR): the bake runs its processes "
            "there, because the CUDA driver keys cuDNN's runtime-compiled kernels by the "
            "working directory; it must exist on the bake machine. Absent: the folder kiln "
            "bake runs in"
        ),
    )

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        problem = None if value is None else workdir_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


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

    serve: ServeSpec = Field(default_factory=ServeSpec)
    bytecode: Literal["auto", "always", "never"] = Field(
        "auto",
        description=(
            "ship the Python bytecode of the modules a server imports (kiln.bytecode): auto "
            "when torch's is not cached in the bake's image, which the serving image then "
            "likely lacks too; a served process uses it only when it has none of its own"
        ),
    )

    _path: Path | None = PrivateAttr(None)
    _base: Path | None = PrivateAttr(None)  # set by with_base(): a spec that came by value

    @model_validator(mode="after")
    def _check_axes(self) -> Spec:
        """Every cross-field rule, in the order a spec's errors are reported (the first one
        found is the one named)."""
        self._check_buckets()
        self._check_inputs()
        self._check_pads()
        self._check_references()
        self._check_distributed()
        return self

    def _check_buckets(self) -> None:
        """Axis names, sizes, and the grid's size."""
        points = 1
        for axis, sizes in self.buckets.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", axis):
                raise LocatedValueError(("buckets", axis), "axis names are identifiers")
            if not sizes:
                raise LocatedValueError(("buckets", axis), "needs at least one size")
            if len(set(sizes)) != len(sizes):
                raise LocatedValueError(("buckets", axis), "sizes must be unique and >= 1")
            points *= len(sizes)
            if points > MAX_BUCKETS:
                raise LocatedValueError(
                    ("buckets", axis), f"the grid has more than {MAX_BUCKETS} buckets"
                )

    def _check_inputs(self) -> None:
        """Unique input names; each shape's axes declared, its sizes and elements bounded."""
        names: dict[str, int] = {}
        for i, inp in enumerate(self.inputs):
            if inp.name in names:
                raise LocatedValueError(
                    ("inputs", i, "name"), f"input {inp.name!r} is also input {names[inp.name]}"
                )
            names[inp.name] = i
            elements = 1
            for j, dim in enumerate(inp.shape):
                if isinstance(dim, str) and dim not in self.buckets:
                    hint = did_you_mean(dim, self.buckets)
                    raise LocatedValueError(
                        ("inputs", i, "shape", j), f"axis {dim!r} is not declared in buckets{hint}"
                    )
                if isinstance(dim, int) and not 1 <= dim <= MAX_SIZE:
                    raise LocatedValueError(
                        ("inputs", i, "shape", j), f"sizes must be >= 1 and <= {MAX_SIZE}"
                    )
                elements *= max(self.buckets[dim]) if isinstance(dim, str) else dim
            if elements > MAX_INPUT_ELEMENTS:
                raise LocatedValueError(
                    ("inputs", i, "shape"),
                    f"{elements} elements at the largest bucket; one input may have at most "
                    f"{MAX_INPUT_ELEMENTS}",
                )

    def _check_references(self) -> None:
        """Names the other sections use: every axis used by an input, call_kwargs that are not
        inputs, exclude's axes declared, env keys allowed."""
        names = {inp.name for inp in self.inputs}
        used = {dim for inp in self.inputs for dim in inp.shape if isinstance(dim, str)}
        for axis in self.buckets:
            if axis not in used:  # it would only repeat every bucket, compiling nothing new
                raise LocatedValueError(("buckets", axis), f"axis {axis!r} is used by no input")
        for key in self.model.call_kwargs:
            if key in names:
                raise LocatedValueError(
                    ("model", "call_kwargs", key), f"{key!r} is already an input's name"
                )
        for i, combo in enumerate(self.exclude):
            for axis, size in combo.items():
                if axis not in self.buckets:
                    raise LocatedValueError(
                        ("exclude", i, axis),
                        f"unknown axis {axis!r}{did_you_mean(axis, self.buckets)}",
                    )
                sizes = self.buckets[axis]
                if size not in sizes:  # it would exclude nothing, silently
                    raise LocatedValueError(
                        ("exclude", i, axis),
                        f"{axis}={size} is no size of the grid, so this excludes no bucket "
                        f"({axis}: {', '.join(map(str, sizes))})",
                    )
        from kiln.grid import expand  # (kiln.grid reads a Spec: imported where it is whole)

        if self.exclude and not expand(self):
            raise LocatedValueError(("exclude",), "the grid is empty after `exclude`")
        for key in self.env:
            problem = env_key_problem(key)
            if problem:
                raise LocatedValueError(("env", key), problem)

    def _check_pads(self) -> None:
        """A declared ``pad`` must be able to pad something: an input whose every axis is also
        carried by an input without ``pad`` would never be padded, which is a spec mistake."""
        paddable = self.paddable_axes()
        for i, inp in enumerate(self.inputs):
            if inp.pad is None:
                continue
            axes = [d for d in inp.shape if isinstance(d, str)]
            if not axes:
                raise LocatedValueError(
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
                raise LocatedValueError(
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
            raise LocatedValueError(
                ("distributed", "backend"), "nccl needs model.device: cuda (use gloo on the CPU)"
            )
        if self.compile.precompile_route == "frames":
            raise LocatedValueError(
                ("compile", "precompile"),
                "precompile: true with graph breaks (fullgraph: false) is single-rank for now",
            )
        for key in RANK_KWARGS:
            if key in self.model.kwargs:
                raise LocatedValueError(
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
        if self.serve.workdir is None:  # and for serve (added later)
            del out["serve"]
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

    def model_source_sha256(self) -> str | None:
        """The sha256 of the factory's source file (None: no file to hash), as the manifest
        records it: bench and verify compare it with the bake's to name a changed model."""
        origin = self.factory_origin()
        if origin is None or not origin.is_file():
            return None
        return hashlib.sha256(origin.read_bytes()).hexdigest()  # a source file: small


def _env_str(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _find_module(name: str, base: Path) -> Any:
    sys.path.insert(0, str(base))
    try:
        return importlib.util.find_spec(name)
    except Exception:  # a dotted name imports its parent package, which may raise anything
        return None
    finally:
        sys.path.remove(str(base))


def parse_spec(text: str, file: str = "<spec>", path: Path | None = None) -> Spec:
    """Parse and validate spec text; every error names ``file:line:col: key``."""
    root, data = read_mapping(text, file)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        raise located_error(exc, root, file, Spec) from None
    spec._path = path
    _check_factory(spec, root, file)
    return spec


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
        line, col = locate(root, ("model", "factory")) or (None, None)
        raise SpecError(problem, file=file, line=line, col=col, key="model.factory")


def error_at(spec: Spec, key: str, message: str) -> SpecError:
    """A :class:`SpecError` for a problem found after parsing (e.g. while importing the factory)."""
    line = col = None
    if spec.path is not None:
        with contextlib.suppress(OSError, UnicodeDecodeError, SpecError):
            root = compose(spec.path.read_text(encoding="utf-8"), str(spec.path))
            loc = tuple(int(p) if p.isdigit() else p for p in key.split("."))
            line, col = locate(root, loc) or (None, None)
    return SpecError(
        printable(message),
        file=str(spec.path or "<spec>"),
        line=line,
        col=col,
        key=printable(key),
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
