"""Serving ``compile.route: aoti``: AOTInductor packages called without Dynamo or Inductor.

A server on the torch.compile route pays for importing Inductor (1.6-1.9 s on the H200 image)
and for loading graphs even when every cache hits. An AOTInductor package is a shared library
with the compiled kernels and a C++ runner, so a served process needs neither. torch's own
loader (``torch._inductor.aoti_load_package``) brings both costs back: it imports
``torch._inductor.codecache``, test-compiles programs with g++ to pick a CPU ISA, and unzips the
package into a temporary folder on every start (pytorch#191715, #194163). kiln ships the
packages already extracted and builds torch's lowest-level runner
(``torch._C._aoti.AOTIModelContainerRunnerCpu``/``Cuda``) on the restored library directly:
milliseconds, and nothing here imports ``torch._dynamo`` or ``torch._inductor``
(tests/test_aoti.py asserts it on ``sys.modules``).

:class:`AotiModel` is the callable ``kiln.activate(DIR).compile(model)`` returns: it picks the
package by the inputs' shapes (and dtype and device), exactly, because a runner given a shape it
was not built for does not check it and computes garbage. Inputs no package takes are a miss,
handled by the artifact's ``on_miss`` (kiln.serving.OnMiss: ``error`` raises
:class:`kiln.padding.OffGridError`, ``eager`` runs the model's forward) and counted.

Weights (``compile.weights``): ``external`` packages are built without their constants; each
runner is handed the serving model's own tensors, by pointer (no copy, one set of weights for
every bucket). They must be the shapes and dtypes the bake saw (checked here, naming the first
that differs); values may differ (another checkpoint of the architecture). In-place updates
(``load_state_dict``, ``copy_``) are seen by the packages; tensors *replaced* afterwards
(``model.half()``, a new ``nn.Parameter``) are not: call ``compile()`` again. ``embed``
packages carry the bake's weights and ignore the model's (except for an eager miss).

CUDA graphs: the route serves without them. torch's runner is not made for stream capture (it
manages its own model pool per call; single-threaded runs for capture are pytorch#148601, not
exposed to Python in 2.11-2.13), so a mode's ``triton.cudagraphs`` is left out of the
packages' options and the bake says so in the manifest's warnings.
"""

from __future__ import annotations

import functools
import logging
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.artifact.manifest import Aoti, AotiInput, AotiProgram, Manifest
from kiln.compiler.failures import one_line
from kiln.errors import PackageLoadError, UsageError
from kiln.grid import Bucket
from kiln.layout import CacheLayout
from kiln.padding import OffGridError
from kiln.serving import ON_MISS

if TYPE_CHECKING:
    from kiln.spec import Spec

log = logging.getLogger("kiln")
MISS_POLICIES = tuple(p for p in ON_MISS if p != "compile")  # no compiler to call here
_LOGGED_MISSES = 256  # distinct misses logged (each once); later ones are only counted


class WeightsMismatchError(UsageError, ValueError):
    """The serving model's weights are not the shapes or dtypes the packages were built for:
    the caller's model is not the baked one (exit 2)."""


@dataclass
class _Program:
    """One loaded package: its runner and how its outputs fold back into the model's types."""

    info: AotiProgram
    runner: Any
    out_spec: Any

    def takes(self, sizes: dict[str, int]) -> bool:
        """Whether a ranged program covers these axis sizes (exact ones are looked up)."""
        ranges = self.info.ranges or {}
        return all(lo <= sizes[axis] <= hi for axis, (lo, hi) in ranges.items())


@functools.cache
def share_libstdcxx() -> bool:
    """Put libstdc++ in the process's global symbol scope, before any package library opens.

    Why: on torch 2.11's CUDA image of the GPU machines (g++ 13.3, the system libstdc++ 6.0.33
    of GCC 14), every AOTInductor package, CPU or CUDA, kiln's or torch's own
    ``aoti_load_package``, died with SIGSEGV in its constructor: ``std::regex`` in
    ``parse_device_str`` fetched the wrong locale facet (cuda-gdb backtrace in
    docs/benchmarks.md). torch opens its libraries ``RTLD_LOCAL``, so libstdc++ is not in the
    global scope, and a package library opened later binds the libstdc++ symbols it defines
    itself (``LD_DEBUG=bindings``: 1,277 locale and facet bindings to its own copies, 40 to
    libstdc++) while libstdc++'s code uses its own. Opened ``RTLD_GLOBAL`` first (by soname, so
    it is the copy torch already mapped), it is searched before the package: the same package
    then loads and runs, whether torch was imported before or after (H100, measured); binding
    the package to itself first (``RTLD_DEEPBIND``) still crashes. Nothing changes where the
    runtime was global already. Returns whether it is global now (False where it cannot load)."""
    import ctypes

    try:
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL)
    except (OSError, AttributeError):  # no such library (macOS), no RTLD_GLOBAL (Windows)
        return False
    return True


def runner_for(library: Path, device: str, device_index: int) -> Any:
    """torch's lowest-level AOTInductor runner on an extracted package's library: no zip, no
    temporary folder, no compiler (the kernel binaries sit beside the library)."""
    import torch

    share_libstdcxx()

    if device == "cuda":
        return torch._C._aoti.AOTIModelContainerRunnerCuda(
            str(library), 1, f"cuda:{device_index}", str(library.parent)
        )
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)


def _load(
    library: Path, where: str, device: str, device_index: int, size: int | None = None
) -> Any:
    """:func:`runner_for`, with a library that is missing, not the ``size`` the bake made it
    (truncated: dlopen maps it anyway and the process dies of SIGBUS), or that dlopen refuses
    as a file (torch's ``Error in dlopen: LIBRARY: …``), named (``where``: its path in the
    restored folder) as a :class:`~kiln.errors.PackageLoadError`. Any other failure (a library
    it needs missing from the image, the device, memory) is torch's own error, unchanged."""
    if not library.is_file():
        raise PackageLoadError(f"AOTInductor package library {where} is missing")
    if size is not None and (found := library.stat().st_size) != size:
        raise PackageLoadError(
            f"AOTInductor package library {where} is {found} bytes, the bake's was {size}"
        )
    try:
        return runner_for(library, device, device_index)
    except RuntimeError as exc:
        first = one_line(exc)
        if f"dlopen: {library}:" not in first:
            raise
        reason = first.split(f"{library}:", 1)[1].strip()
        raise PackageLoadError(
            f"AOTInductor package library {where} does not load ({reason})"
        ) from exc


def hand_in(runner: Any, constants: dict[str, Any]) -> None:
    """Give ``runner`` the model's tensors as its constants: ``user_managed`` (torch >= 2.7) makes
    it point at the model's own storage, no copy per bucket; an older runner copies them."""
    try:
        runner.update_constant_buffer(constants, False, True, True)
    except TypeError:  # no user_managed argument in this torch's binding
        runner.update_constant_buffer(constants, False, True)


def model_tensors(model: Any) -> dict[str, Any]:
    """Every parameter and buffer of ``model`` by each of its names (tied weights have two)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def constants_for(runner: Any, tensors: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The runner's constants from ``tensors`` (keyed by the runner's internal names), and the
    original names of those the model does not have."""
    out: dict[str, Any] = {}
    missing: list[str] = []
    for name, fqn in runner.get_constant_names_to_original_fqns().items():
        if fqn in tensors:
            out[name] = tensors[fqn]
        else:
            missing.append(fqn)
    return out, sorted(missing)


class AotiModel:
    """``model`` served from baked AOTInductor packages; see the module docstring.

    Call it as the model: keyword inputs by their spec names (or positional, in the spec's
    order); the spec's ``call_kwargs`` are baked in, and other values for them are a miss.
    """

    def __init__(
        self,
        model: Any,
        info: Aoti,
        folder: Path,
        *,
        device_index: int = 0,
        on_miss: str = "",
        sizes: Mapping[str, int] | None = None,
    ) -> None:
        """``sizes``: each library's size by its path in the artifact (:func:`library_sizes`),
        checked before it is opened; None for packages no manifest lists yet (the bake's)."""
        import torch
        import torch.utils._pytree as pytree  # torch's own import already loaded it

        if on_miss not in ("", *MISS_POLICIES):
            raise UsageError(
                f"on_miss={on_miss!r}: compile.route: aoti serves without a compiler: one of "
                f"{', '.join(MISS_POLICIES)}"
            )
        self.model = model
        self.info = info
        self.on_miss = on_miss or info.on_miss
        self.misses = 0
        self._missed: set[str] = set()  # what each logged miss was, once each
        self.names = [i.name for i in info.inputs]
        device = torch.device(info.device, device_index if info.device == "cuda" else None)
        self._device = device
        self._dtypes = {i.name: getattr(torch, i.dtype) for i in info.inputs}
        self._weights = self._checked_weights(model) if info.weights == "external" else {}
        self._exact: dict[tuple[tuple[int, ...], ...], _Program] = {}
        self._ranged: list[_Program] = []
        shown = CacheLayout.of_dir(folder).prefix  # a rank's folder: ranks/R/, as verify names it
        for p in info.programs:
            library = folder / p.path / p.library
            where = f"{shown}{p.path}/{p.library}"
            runner = _load(library, where, info.device, device_index, (sizes or {}).get(where))
            if self._weights:
                constants, missing = constants_for(runner, self._weights)
                if missing:  # the bake checked this against the same model: a changed model
                    raise WeightsMismatchError(
                        f"{shown}{p.path}: the model has no tensor named {missing[0]!r} "
                        f"({len(missing)} missing): not the architecture this was baked for"
                    )
                hand_in(runner, constants)
            out_spec = pytree.treespec_loads(runner.get_call_spec()[1])
            program = _Program(p, runner, out_spec)
            if p.ranges:
                self._ranged.append(program)
            for key in p.buckets:
                self._exact[self._signature_of(key)] = program
        self._unflatten = pytree.tree_unflatten

    # --- loading ---------------------------------------------------------------------------
    def _checked_weights(self, model: Any) -> dict[str, Any]:
        """The model's tensors the packages read, checked against what the bake recorded;
        non-contiguous ones copied (a runner reads them as dense)."""
        tensors = model_tensors(model)
        out: dict[str, Any] = {}
        copied: list[str] = []
        for fqn, meta in self.info.constants.items():
            t = tensors.get(fqn)
            if t is None:
                raise WeightsMismatchError(
                    f"the model has no tensor named {fqn!r}: not the architecture this was "
                    "baked for"
                )
            if list(t.shape) != meta.shape or dtype_name(t) != meta.dtype:
                raise WeightsMismatchError(
                    f"{fqn}: the model's is {list(t.shape)} {dtype_name(t)}, the packages were "
                    f"built for {meta.shape} {meta.dtype} (bake again for these weights)"
                )
            if t.device != self._device:
                raise WeightsMismatchError(
                    f"{fqn} is on {t.device}, the packages run on {self._device}: move the "
                    "model first"
                )
            if not t.is_contiguous():
                copied.append(fqn)
            out[fqn] = t.detach().contiguous()  # the same tensor when it is contiguous
        if copied:
            log.warning(
                "kiln: %d weight(s) are not contiguous (e.g. %s): the packages read dense "
                "copies, so in-place updates of them are not seen; make them contiguous "
                "before compile()",
                len(copied),
                copied[0],
            )
        return out

    def _signature_of(self, key: str) -> tuple[tuple[int, ...], ...]:
        bucket = Bucket.parse(key)
        return tuple(bucket.shape_of(i.shape) for i in self.info.inputs)

    # --- serving ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = dict(zip(self.names, args, strict=False))
        if len(args) > len(self.names):
            return self._miss(args, kwargs, f"{len(args)} positional inputs")
        extra = {}
        for name, value in kwargs.items():
            if name in inputs:  # as the model's own forward() would refuse it
                raise TypeError(f"got multiple values for argument {name!r}")
            if name in self.names:
                inputs[name] = value
            else:
                extra[name] = value
        if len(inputs) != len(self.names):
            missing = [n for n in self.names if n not in inputs]
            return self._miss(args, kwargs, f"no input {missing[0]!r}")
        for name, value in extra.items():
            if name not in self.info.call_kwargs or self.info.call_kwargs[name] != value:
                return self._miss(args, kwargs, f"{name}={reprlib.repr(value)} was not baked")
        program = self._pick(inputs)
        if program is None:
            return self._miss(args, kwargs, self._shown(inputs))
        # A runner reads every input as dense, in the layout it was exported with: a slice,
        # a transpose or channels_last would be read as garbage, so it gets a dense copy.
        outputs = program.runner.run([inputs[n].contiguous() for n in self.names])
        return self._unflatten(outputs, program.out_spec)

    def _pick(self, inputs: dict[str, Any]) -> _Program | None:
        for name in self.names:
            t = inputs[name]
            if getattr(t, "dtype", None) != self._dtypes[name] or t.device != self._device:
                return None
        signature = tuple(tuple(inputs[n].shape) for n in self.names)
        program = self._exact.get(signature)
        if program is not None or not self._ranged:
            return program
        sizes: dict[str, int] = {}
        for spec_input, shape in zip(self.info.inputs, signature, strict=True):
            if len(shape) != len(spec_input.shape):
                return None
            for dim, size in zip(spec_input.shape, shape, strict=True):
                if isinstance(dim, int):
                    if dim != size:
                        return None
                elif sizes.setdefault(dim, size) != size:
                    return None
        return next((p for p in self._ranged if p.takes(sizes)), None)

    def _shown(self, inputs: dict[str, Any]) -> str:
        return ", ".join(
            f"{n} {list(getattr(t, 'shape', []))} {getattr(t, 'dtype', type(t).__name__)}"
            for n, t in inputs.items()
        )

    def _miss(self, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> Any:
        self.misses += 1
        if self.on_miss != "eager":
            raise OffGridError(
                f"no baked AOTInductor package takes these inputs ({what}; the grid: "
                f"{self.grid()}): on_miss: eager serves them with the model's forward"
            )
        if what not in self._missed and len(self._missed) < _LOGGED_MISSES:
            self._missed.add(what)
            log.warning("kiln: no baked package takes these inputs (%s): running eagerly", what)
        return self.model(*args, **kwargs)

    def grid(self) -> str:
        """What the packages serve, in one line."""
        keys = [k for p in self.info.programs for k in p.buckets]
        ranged = [
            ", ".join(f"{a} {lo}..{hi}" for a, (lo, hi) in (p.ranges or {}).items())
            for p in self.info.programs
            if p.ranges
        ]
        shown = "; ".join(keys[:6]) + (f"; … {len(keys) - 6} more" if len(keys) > 6 else "")
        return "; ".join(ranged) if ranged else shown


def library_sizes(manifest: Manifest) -> dict[str, int]:
    """Every package library's size by its path in the artifact (``ranks/R/`` included), as
    :class:`AotiModel` names them: what restore installed, checked before each is opened."""
    return {f.path: f.size for f in manifest.entries() if f.kind == "aoti"}


def served_packages(manifest: Manifest, rank: int | None) -> Aoti:
    """The packages this process serves: the artifact's, or for a K-rank artifact its rank's
    (their paths under ``ranks/RANK/``)."""
    if manifest.distributed is not None and rank is not None:
        aoti = manifest.distributed.ranks[rank].aoti
    else:
        aoti = manifest.aoti
    if aoti is None:
        raise ValueError(f"{manifest.name}: no AOTInductor packages (compile.route: aoti)")
    return aoti


def spec_inputs(spec: Spec) -> list[AotiInput]:
    """The spec's inputs as the manifest records them for a server."""
    return [AotiInput(name=i.name, shape=list(i.shape), dtype=i.dtype) for i in spec.inputs]
