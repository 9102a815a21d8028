"""The model spec: what to compile, how, and over which shape grid.

The spec is the contract between the CI that bakes and the pod that verifies, so it is strict:
unknown keys, duplicate keys and wrong types are errors that point at ``file:line:col``. PyYAML
silently keeps the last of two duplicate keys, and pydantic only knows paths, so we compose the
YAML node tree once and use it both to reject duplicates and to map pydantic's error locations
back to source positions. Torch-free: init containers parse specs too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from kiln.errors import SpecError

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"]
FloatDType = Literal["float32", "float16", "bfloat16"]
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

_NAME_RE = r"^[a-z0-9._-]+$"

# torch._inductor.list_mode_options(), restated so that parsing a spec stays torch-free
# (tests/test_spec.py holds it to torch's table).
MODE_OPTIONS: dict[str, dict[str, bool]] = {
    "default": {},
    "reduce-overhead": {"triton.cudagraphs": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune": {
        "max_autotune": True,
        "triton.cudagraphs": True,
        "coordinate_descent_tuning": True,
    },
}


# What an autotuning spec adds to its Inductor options, and why:
AUTOTUNE_LOADING: dict[str, Any] = {
    # On an FX hit, statically launchable kernels come back as pickled autotuners that keep the
    # bake's file paths and (torch <= 2.11) lose the coordinate-descent flag (pytorch#172819);
    # kernels loaded from source read the `.best_config` beside the restored source.
    "use_static_cuda_launcher": False,
    # A kernel loaded in the compile worker pool returns to the parent pickled, and
    # triton.Config.__setstate__ (3.6) keeps only its own fields, so `found_by_coordesc` is
    # dropped and the first call tunes again. Whether the pool is ready yet is a race, so
    # restored runs re-tuned only sometimes (H200: 134 benchmarks through a ready pool, 0 with
    # this setting; docs/benchmarks.md).
    "compile_threads": 1,
}


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
            "also bake AOT-compiled forwards (graphs + guards) so a serving process skips "
            "Dynamo tracing; needs fullgraph: true and torch >= 2.9"
        ),
    )

    @model_validator(mode="after")
    def _mode_xor_options(self) -> CompileSpec:
        if self.options and "mode" in self.model_fields_set:
            raise _LocatedValueError(
                ("options",), "mode and options are mutually exclusive (torch.compile refuses both)"
            )
        if self.precompile and not self.fullgraph:
            raise _LocatedValueError(
                ("precompile",), "precompile: true needs fullgraph: true (no graph breaks)"
            )
        return self

    def inductor_options(self) -> dict[str, Any]:
        """The Inductor settings this spec compiles with, whether spelled as mode or options."""
        return dict(self.options) if self.options else dict(MODE_OPTIONS[self.mode or "default"])

    @property
    def autotunes(self) -> bool:
        """Whether compiling tunes kernels, whose results a fresh process must find and re-read."""
        options = self.inductor_options()
        return any(bool(options.get(k)) for k in ("max_autotune", "coordinate_descent_tuning"))

    @property
    def cudagraphs(self) -> bool:
        """Whether calls are CUDA-graphed: a warm bucket needs its graph recorded, not just
        compiled (warm-up call, recording call, then replays)."""
        return bool(self.inductor_options().get("triton.cudagraphs"))

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` exactly as a serving process must pass them.

        Autotuning specs get the settings in :data:`AUTOTUNE_LOADING`, which make a warm
        process use the tuning results it is given instead of benchmarking again; a key the
        spec sets itself stands. ``use_static_cuda_launcher`` is part of Inductor's cache key,
        so a server must compile with these arguments (the manifest records them).
        """
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
        }
        if self.autotunes:
            options = self.inductor_options()
            kwargs["options"] = options | {
                k: v for k, v in AUTOTUNE_LOADING.items() if k not in options
            }
        elif self.options:
            kwargs["options"] = dict(self.options)
        else:
            kwargs["mode"] = self.mode or "default"
        return kwargs

    def cold_torch_kwargs(self) -> dict[str, Any]:
        """:meth:`torch_kwargs` for a compile that starts from an empty cache.

        Only a warm process must load kernels in-process; a cold one compiles hundreds of
        kernels, which Inductor's worker pool does in parallel. ``compile_threads`` is outside
        the cache key, so what this compiles, a process with :meth:`torch_kwargs` finds.
        """
        kwargs = self.torch_kwargs()
        if self.autotunes and "compile_threads" not in self.options:
            return with_compile_threads(kwargs, None)
        return kwargs


def with_compile_threads(torch_kwargs: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """``torch_kwargs`` with Inductor's compile thread count set (``None``: torch's default).

    A ``mode`` becomes its options, since torch.compile takes one or the other. The count is
    outside Inductor's cache key, so the result hits what ``torch_kwargs`` compiled.
    """
    kwargs = dict(torch_kwargs)
    options = kwargs.pop("options", None)
    if options is None:
        options = MODE_OPTIONS[kwargs.pop("mode", None) or "default"]
    options = {k: v for k, v in options.items() if k != "compile_threads"}
    if threads is not None:
        options["compile_threads"] = threads
    return kwargs | {"options": options}


class InputSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    shape: list[str | int]
    dtype: DType = "float32"
    fill: Literal["randn", "randint", "ones", "zeros"] = "randn"
    low: int = 0
    high: int | None = None

    @model_validator(mode="after")
    def _randint_needs_high(self) -> InputSpec:
        if self.fill == "randint" and self.high is None:
            raise _LocatedValueError(("fill",), "fill: randint needs `high`")
        if self.high is not None and self.high <= self.low:
            raise _LocatedValueError(("high",), "`high` must be greater than `low`")
        return self


class WarmupSpec(_Strict):
    calls: int = Field(2, ge=1, description="calls per bucket during bake")
    passes: int | None = Field(
        None,
        ge=1,
        description=(
            "fresh-process bake passes in different bucket orders; None: 1 for dynamic=false "
            "without autotuning (static shapes are keyed per shape), else until a pass "
            "compiles nothing (at most 4)"
        ),
    )


class Spec(_Strict):
    name: str = Field(pattern=_NAME_RE, description="artifact name")
    model: ModelSpec
    compile: CompileSpec = Field(default_factory=CompileSpec)
    inputs: list[InputSpec] = Field(min_length=1)
    buckets: dict[str, list[int]] = Field(min_length=1)
    exclude: list[dict[str, int]] = Field(default_factory=list)
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    env: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="extra environment for compilation, recorded"
    )

    _path: Path | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_axes(self) -> Spec:
        for axis, sizes in self.buckets.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", axis):
                raise _LocatedValueError(("buckets", axis), "axis names are identifiers")
            if not sizes:
                raise _LocatedValueError(("buckets", axis), "needs at least one size")
            if any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
                raise _LocatedValueError(("buckets", axis), "sizes must be unique and >= 1")
        for i, inp in enumerate(self.inputs):
            for j, dim in enumerate(inp.shape):
                if isinstance(dim, str) and dim not in self.buckets:
                    raise _LocatedValueError(
                        ("inputs", i, "shape", j), f"axis {dim!r} is not declared in buckets"
                    )
                if isinstance(dim, int) and dim < 1:
                    raise _LocatedValueError(("inputs", i, "shape", j), "sizes must be >= 1")
        for i, combo in enumerate(self.exclude):
            for axis in combo:
                if axis not in self.buckets:
                    raise _LocatedValueError(("exclude", i, axis), f"unknown axis {axis!r}")
        return self

    # --- derived facts -------------------------------------------------------------------
    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def base_dir(self) -> Path:
        return self._path.parent if self._path else Path.cwd()

    def canonical(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

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


def _find_module(name: str, base: Path) -> Any:
    sys.path.insert(0, str(base))
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    finally:
        sys.path.remove(str(base))


# --- YAML with positions ----------------------------------------------------------------


def _compose(text: str, file: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise SpecError(
            f"invalid YAML: {exc.problem or exc}",
            file=file,
            line=mark.line + 1 if mark else None,
            col=mark.column + 1 if mark else None,
        ) from None


def _check_duplicates(node: yaml.Node, file: str, path: tuple[str, ...] = ()) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise SpecError(
                    f"duplicate key (first defined on line {first})",
                    file=file,
                    line=key_node.start_mark.line + 1,
                    col=key_node.start_mark.column + 1,
                    key=".".join((*path, key)),
                )
            seen[key] = key_node
            _check_duplicates(value_node, file, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, file, (*path, str(i)))


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
    return ".".join(str(p) for p in loc) or "<root>"


def parse_spec(text: str, file: str = "<spec>", path: Path | None = None) -> Spec:
    """Parse and validate spec text; every error names ``file:line:col: key``."""
    root = _compose(text, file)
    if root is None:
        raise SpecError("empty spec", file=file, line=1, col=1)
    _check_duplicates(root, file)
    data = yaml.SafeLoader(text).get_single_data()
    if not isinstance(data, dict):
        raise SpecError("a spec is a mapping of keys", file=file, line=1, col=1)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc: tuple[str | int, ...] = tuple(err["loc"])
        message = err["msg"]
        located = (err.get("ctx") or {}).get("error")
        if isinstance(located, _LocatedValueError):
            loc, message = loc + located.loc, located.message
        elif err["type"] == "extra_forbidden":
            message = "unknown key"
        loc = tuple(p for p in loc if not _is_type_tag(p))
        pos = _locate(root, loc)
        line, col = pos if pos else (None, None)
        raise SpecError(
            message.removeprefix("Value error, "),
            file=file,
            line=line,
            col=col,
            key=_dotted(loc),
        ) from None
    spec._path = path
    _check_factory(spec, root, file)
    return spec


def _is_type_tag(part: str | int) -> bool:
    """pydantic appends union member names ("str", "int", "function-after[...]") to locs."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none", "list", "dict"} or "[" in part
    )


def _check_factory(spec: Spec, root: yaml.Node, file: str) -> None:
    """Catch a factory that cannot resolve now, not minutes into a CI bake (torch-free)."""
    target, _, _ = spec.model.factory.partition(":")
    ok = True
    if target.endswith(".py"):
        origin = spec.factory_origin()
        ok = origin is not None and origin.is_file()
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
        with contextlib.suppress(OSError, yaml.YAMLError):
            root = yaml.compose(spec.path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
            loc = tuple(int(p) if p.isdigit() else p for p in key.split("."))
            line, col = _locate(root, loc) or (None, None)
    return SpecError(message, file=str(spec.path or "<spec>"), line=line, col=col, key=key)


def load_spec(path: str | Path) -> Spec:
    """Read a spec file. Raises :class:`SpecError` (exit 2) with ``file:line:col``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("spec file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read spec: {exc}", file=str(path)) from None
    return parse_spec(text, file=str(path), path=p.resolve())


def spec_json_schema() -> dict[str, Any]:
    return Spec.model_json_schema()
