"""The artifact manifest: the contract between the baking world and the serving world.

Everything restore, check and verify decide is in here, so no step has to guess from file names.
Torch-free: restore and inspect read it in slim images. ``FORMAT_VERSION`` changes only when an
older kiln could misread a newer manifest; readers refuse versions they do not know.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln import __version__

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class _Model(BaseModel):
    # Forward compatible within a format version: newer kilns may add fields.
    model_config = ConfigDict(extra="allow")


class FileEntry(_Model):
    path: str  # posix, relative to the artifact root, e.g. "inductor/fxgraph/..."
    size: int = Field(ge=0)
    sha256: str
    kind: str


class BucketStats(_Model):
    key: str
    sizes: dict[str, int]
    first_call_s: float
    compile_s: float
    steady_s: float
    first_request_s: float | None = None
    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypass: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    # Kernels handed to AsyncCompile: in a fresh process that is every kernel *loaded*, cache hit
    # or not (torch bumps its "async_compile_cache_miss" counter before looking anything up).
    kernel_loads: int = 0
    bundled_kernels: int = 0  # Triton kernels re-emitted from FX cache entries (not compiles)
    new_native: int = 0  # new C++ .so / Triton .cubin files not explained by bundling: compiles
    # GEMM autotunes of graphs compiled here + coordinate-descent benchmarks + new .best_config
    # files: re-benchmarking
    autotunes: int = 0
    precompile_misses: int = 0  # calls no precompiled graph accepted (torch.compile fell back)
    new_files: list[str] = Field(default_factory=list)  # a sample of what compiles wrote: why
    unique_graphs: int = 0
    graph_breaks: int = 0
    recompile_reasons: list[str] = Field(default_factory=list)

    @property
    def compiles(self) -> int:
        """Everything that compiled in this bucket: zero is the definition of a warm cache."""
        return (
            self.fx_misses
            + self.fx_bypass
            + self.aot_misses
            + self.new_native
            + self.autotunes
            + self.precompile_misses
        )


class PassStats(_Model):
    order: list[str]
    compiles: int
    wall_s: float


class Manifest(_Model):
    format: int = FORMAT_VERSION
    kiln_version: str = __version__
    name: str
    created: str  # ISO 8601, from SOURCE_DATE_EPOCH when set (reproducible builds)
    spec: dict[str, Any]
    spec_sha256: str
    model_source_sha256: str | None = None
    fingerprint: dict[str, Any]
    env: dict[str, str] = Field(
        default_factory=dict, description="environment the serving process must share"
    )
    grid: list[BucketStats]
    passes: list[PassStats] = Field(default_factory=list)
    totals: dict[str, float] = Field(default_factory=dict)
    files: list[FileEntry]
    megacache: str | None = None  # path of the Mega-Cache blob in the artifact, if captured
    precompiled: str | None = None  # path of the AOT-compiled forwards (compile.precompile)
    # torch.compile(**compile_kwargs) exactly as the bake called it (None: baked before kiln
    # recorded it). Serving passes these, not whatever this kiln would derive from the spec.
    compile_kwargs: dict[str, Any] | None = None
    warnings: list[str] = Field(default_factory=list)  # what the bake could not settle

    def torch_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` arguments a serving process must pass to hit these caches."""
        if self.compile_kwargs is not None:
            return dict(self.compile_kwargs)
        from kiln.spec import CompileSpec

        return CompileSpec.model_validate(self.spec["compile"]).torch_kwargs()

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def bytes_by_kind(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for f in self.files:
            n, b = out.get(f.kind, (0, 0))
            out[f.kind] = (n + 1, b + f.size)
        return dict(sorted(out.items()))
