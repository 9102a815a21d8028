"""Baking ``compile.route: aoti``: one AOTInductor package per bucket, or one ranged program.

The bake's first pass (kiln.compiler.worker) builds the packages ahead of each bucket's first
call: ``torch.export`` of the model on the bucket's inputs, ``aoti_compile_and_package`` with the
spec's Inductor options, and the package's model folder extracted into ``aoti/N/`` of the work
folder (the zip itself is not shipped: a served process never unzips). The pass then serves its
calls from the extracted package through :class:`~kiln.compiler.aoti_serve.AotiModel`, exactly
as a server will, so the bake's timings and the proof measure the shipped route.

``compile.dynamic: true`` builds one program instead, exported with a ``Dim`` per axis spanning
the axis's sizes in the grid (every size between them is then served too); otherwise one
package per bucket, each specialized to its shapes (Inductor's best code, and the route's
default: docs/benchmarks.md compares the two).

An export failure is the spec's problem (exit 2) and is said in one line at the model's own
source line that torch refused, with the advice to serve the model on the torch.compile route,
which handles graph breaks.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
import time
import traceback
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.artifact.manifest import Aoti, AotiInput, AotiProgram, TensorMeta
from kiln.compiler.aoti_serve import AotiModel, dtype_name, model_tensors
from kiln.compiler.failures import SpecProblem, one_line
from kiln.layout import CacheLayout
from kiln.padding import PadGrid

# A package's path in the manifest is relative to its layout's folder (a rank's, or the root).
_TOP = CacheLayout()
# What of a package's model folder is never read by the runner (sources, build flags).
_NOT_SHIPPED = (".cpp", ".h", "_compile_flags.json", "_linker_flags.json")
# Inductor options that do not apply to an AOTInductor package: CUDA graphs are the serving
# side's (kiln.compiler.aoti_serve says why the route has none); the compile pool is parallelism.
_DROPPED_OPTIONS = ("triton.cudagraphs", "compile_threads")


class AotiBuildError(SpecProblem):
    """The model cannot be built on this route: the spec's problem at ``key`` (exit 2)."""


def package_options(options: dict[str, Any], weights: str) -> dict[str, Any]:
    """The Inductor options a package is compiled with: the spec's, less what does not apply,
    with the constants built in only for ``weights: embed``."""
    out = {k: v for k, v in options.items() if k not in _DROPPED_OPTIONS}
    out["aot_inductor.package_constants_in_so"] = weights == "embed"
    return out


def dropped_cudagraphs(options: dict[str, Any]) -> bool:
    return bool(options.get("triton.cudagraphs"))


def user_frame(exc: BaseException, base: Path | None) -> str | None:
    """``file:line`` of the deepest frame of the failure in the model's own code (not torch's,
    not a library's, not the standard library's, not kiln's), relative to the spec's folder
    when it is under it."""
    skipped = (sysconfig.get_paths()["stdlib"], str(Path(__file__).resolve().parents[1]))
    chosen = None
    for frame in traceback.extract_tb(exc.__traceback__):
        name = frame.filename
        if name.startswith("<") or "site-packages" in name or name.startswith(skipped):
            continue
        if base is not None and name.startswith(f"{base}/"):
            name = name.removeprefix(f"{base}/")
        chosen = f"{name}:{frame.lineno}"
    return chosen


def package_folder(key: str | None) -> str:
    """A package's folder under ``aoti/``: named by the bucket it serves (``batch4_seq128``), so
    shards baked apart never share one and ``kiln merge`` takes the union; ``ranged`` for the
    one program of ``dynamic: true``."""
    return key.replace("=", "").replace(",", "_") if key else "ranged"


class AotiBuilder:
    """Builds the packages of one bake pass into ``out`` and serves its calls from them."""

    def __init__(
        self,
        model: Any,
        out: Path,
        *,
        inputs: list[AotiInput],
        axes: list[str],
        call_kwargs: dict[str, Any],
        device: str,
        device_index: int,
        options: dict[str, Any],
        weights: str,
        ranges: dict[str, list[int]] | None,
        base: Path | None,
        pads: PadGrid | None = None,
    ) -> None:
        self.model = model
        self.pads = pads  # a spec that pads: each bucket's carriers are recorded (padded.py)
        self.out = out
        self.axes = axes
        self.device, self.device_index = device, device_index
        self.options = package_options(options, weights)
        self.ranges = ranges
        self.base = base
        self.info = Aoti(
            device=device,
            weights=weights,
            on_miss="error",  # the bake serves the grid only: a miss is the bake's bug
            inputs=inputs,
            call_kwargs=call_kwargs,
            programs=[],
        )
        self.served: AotiModel | None = None
        # Seconds spent building packages (export, AOT compile, extraction): the route's compile
        # time, which Dynamo's compile timer never sees (the worker's Meter adds it per bucket).
        self.build_s = 0.0
        out.mkdir(parents=True, exist_ok=True)

    @property
    def misses(self) -> int:
        return self.served.misses if self.served is not None else 0

    def key_of(self, example: dict[str, Any]) -> str:
        sizes: dict[str, int] = {}
        for spec_input in self.info.inputs:
            shape = example[spec_input.name].shape
            for dim, size in zip(spec_input.shape, shape, strict=True):
                if isinstance(dim, str):
                    sizes[dim] = int(size)
        return ",".join(f"{axis}={sizes[axis]}" for axis in self.axes)

    def add(self, **example: Any) -> None:
        """Build the package that serves ``example``'s bucket (a ranged program: the first
        call builds it for the whole grid, later buckets only add their key to it)."""
        key = self.key_of(example)
        if self.ranges is not None and self.info.programs:
            program = self.info.programs[0]
            program.buckets.append(key)
        else:
            name = package_folder(key if self.ranges is None else None)
            traced = self._largest(example) if self.ranges is not None else example
            t0 = time.perf_counter()
            library = self._build(traced, self.out / name)
            self.build_s += time.perf_counter() - t0
            folder = _TOP.member(_TOP.aoti / name)
            program = AotiProgram(path=folder, library=library, buckets=[key], ranges=self.ranges)
            self.info.programs.append(program)
        if self.pads is not None:  # after the export: a fake run can leave state on the model
            from kiln.compiler.padded import bake_carriers

            self.info.carriers += bake_carriers(self.model, self.pads, key, example)
        self.served = AotiModel(
            self.model, self.info, self.out.parent, device_index=self.device_index
        )

    def _build(self, example: dict[str, Any], dest: Path) -> str:
        import torch

        try:
            exported = torch.export.export(
                self.model, (), example, dynamic_shapes=self._dynamic_shapes(example)
            )
        except Exception as exc:  # torch raises many kinds; each is the model's problem here
            where = user_frame(exc, self.base)
            at = f" at {where}" if where else ""
            raise AotiBuildError(
                "compile.route",
                f"torch.export failed{at}: {type(exc).__name__}: {one_line(exc)} (route: aoti "
                "needs one full graph; route: compile serves graph breaks)",
            ) from exc
        package = dest.parent / f"{dest.name}.pt2"
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(package), inductor_configs=self.options
        )
        library = _extract(package, dest)
        package.unlink()
        if self.info.weights == "external":
            strip_debug(dest / library)
            self._record_constants(dest / library)
        return library

    def _largest(self, example: dict[str, Any]) -> dict[str, Any]:
        """``example`` at every axis's largest size: export specializes an axis traced at size
        1 (or at any size its range does not need), so a ranged program is traced at the top."""
        assert self.ranges is not None
        out = dict(example)
        for spec_input in self.info.inputs:
            t = example[spec_input.name]
            shape = [self.ranges[d][1] if isinstance(d, str) else d for d in spec_input.shape]
            out[spec_input.name] = t.new_zeros(shape)
        return out

    def _dynamic_shapes(self, example: dict[str, Any]) -> dict[str, Any] | None:
        """One ``Dim`` per axis over its grid range, shared by every input that has the axis;
        an axis of one size stays static (export has no ``Dim`` with min == max)."""
        if self.ranges is None:
            return None
        import torch

        dims = {
            a: torch.export.Dim(a, min=lo, max=hi) for a, (lo, hi) in self.ranges.items() if lo < hi
        }
        out: dict[str, Any] = {name: None for name in example}
        for spec_input in self.info.inputs:
            named = {i: dims[d] for i, d in enumerate(spec_input.shape) if d in dims}
            out[spec_input.name] = named or None
        return out

    def _record_constants(self, library: Path) -> None:
        """Each constant the package reads, as the model has it now: a server's model must
        match (shape, dtype). A constant the model does not hold by name cannot be handed in."""
        from kiln.compiler.aoti_serve import constants_for, runner_for

        tensors = model_tensors(self.model)
        runner = runner_for(library, self.device, self.device_index)
        _, missing = constants_for(runner, tensors)
        if missing:
            raise AotiBuildError(
                "compile.weights",
                f"the exported program reads {missing[0]!r}, which is no parameter or buffer "
                "of the model (a tensor attribute?): register it as a buffer, or use "
                "weights: embed",
            )
        for fqn in runner.get_constant_names_to_original_fqns().values():
            t = tensors[fqn]
            self.info.constants[fqn] = TensorMeta(shape=list(t.shape), dtype=dtype_name(t))


def strip_debug(library: Path) -> bool:
    """Drop the library's debug sections (binutils ``strip``, where the bake machine has it):
    three quarters of a CPU package's bytes (1.6 MB to 0.42 MB for the tiny GPT), never read
    when serving. Only for packages without embedded weights: those are appended after the ELF
    image, and strip would cut them off. The bake's proof serves the stripped library."""
    tool = shutil.which("strip")
    if tool is None:
        return False
    done = subprocess.run(
        [tool, "--strip-debug", str(library)], capture_output=True, check=False, timeout=300
    )
    return done.returncode == 0


def _extract(package: Path, dest: Path) -> str:
    """The package's model folder into ``dest`` (sub-folders kept: kernel binaries are looked up
    beside the library); returns the library's file name."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    library = None
    with zipfile.ZipFile(package) as archive:
        for member in archive.infolist():
            parts = PurePosixPath(member.filename).parts
            if member.is_dir() or parts[1:4] != ("data", "aotinductor", "model") or len(parts) < 5:
                continue
            if parts[-1].endswith(_NOT_SHIPPED) or ".." in parts:
                continue
            target = dest.joinpath(*parts[4:])
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if len(parts) == 5 and target.suffix == ".so":
                library = target.name
                target.chmod(0o755)
    if library is None:
        raise RuntimeError(f"{package}: no shared library in the package's model folder")
    return library
