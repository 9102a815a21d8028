"""What a step compiled, counted: torch's counters as one dataclass, read before and after.

Shaped after vLLM's ``compilation/counter.py``: a flat dataclass of counts, snapshotted around a
step and subtracted, so "what did this bucket compile?" is one expression instead of a dozen
dictionary lookups. :class:`BucketCompiles` turns such a difference, plus the files the step
wrote into the cache root, into the compile fields of a
:class:`~kiln.artifact.manifest.BucketStats`. Needs torch only in :meth:`CompileCounters.read`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.compiler.capture import AUTOTUNE_SUFFIXES, NATIVE_SUFFIXES

NEW_FILES_SAMPLE = 12  # file names kept per bucket: enough to say which kernels were built
_COMPILED_SUFFIXES = (*NATIVE_SUFFIXES, *AUTOTUNE_SUFFIXES)

# torch's counter group and name for each field (torch._dynamo.utils.counters[group][name]).
_SOURCES: dict[str, tuple[str, str]] = {
    "fx_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_misses": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_misses": ("aot_autograd", "autograd_cache_miss"),
    # Kernels handed to AsyncCompile: in a fresh process that is every kernel *loaded*, hit or
    # not (torch bumps "async_compile_cache_miss" before looking anything up).
    "kernel_loads": ("inductor", "async_compile_cache_miss"),
    # Triton kernels re-emitted from FX cache entries: loads, not compiles.
    "bundled_kernels": ("inductor", "triton_bundler_read_and_emit_kernel"),
    "gemm_autotunes": ("inductor", "select_algorithm_autotune"),
    "coordesc_benchmarks": ("inductor", "coordesc_tuning_bench"),
    "unique_graphs": ("stats", "unique_graphs"),
}


@dataclass(frozen=True)
class CompileCounters:
    """Process-wide totals of torch's compile counters (:meth:`read`), or a difference of two."""

    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypass: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    kernel_loads: int = 0
    bundled_kernels: int = 0
    gemm_autotunes: int = 0
    coordesc_benchmarks: int = 0
    unique_graphs: int = 0
    graph_breaks: int = 0
    compile_s: float = 0.0  # Dynamo's compile_inner time: tracing plus everything below it

    @classmethod
    def read(cls) -> CompileCounters:
        """The totals now (torch must be importable)."""
        from torch._dynamo.utils import compilation_time_metrics, counters

        values: dict[str, Any] = {
            name: counters.get(group, {}).get(key, 0) for name, (group, key) in _SOURCES.items()
        }
        values["graph_breaks"] = sum(counters.get("graph_break", {}).values())
        values["compile_s"] = float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
        return cls(**values)

    def __sub__(self, other: CompileCounters) -> CompileCounters:
        return CompileCounters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in _fields(self)}
        )

    @property
    def graphs_compiled(self) -> int:
        """FX graphs compiled here rather than loaded (a bypass compiles too)."""
        return self.fx_misses + self.fx_bypass


@dataclass(frozen=True)
class BucketCompiles:
    """What one step of one bucket compiled, in :class:`~kiln.artifact.manifest.BucketStats`'
    terms; a bucket's first call and its warm calls add up (``+``)."""

    compile_s: float = 0.0
    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypass: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    kernel_loads: int = 0
    bundled_kernels: int = 0
    new_native: int = 0
    autotunes: int = 0
    unique_graphs: int = 0
    graph_breaks: int = 0
    precompile_misses: int = 0
    recompile_reasons: tuple[str, ...] = ()
    new_files: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        diff: CompileCounters,
        new_files: Collection[str],
        *,
        recompile_reasons: Sequence[str] = (),
        precompile_misses: int = 0,
    ) -> BucketCompiles:
        """From a counter difference and the names of the files the step added to the cache."""
        native = sum(1 for n in new_files if n.endswith(NATIVE_SUFFIXES))
        tuned = sum(1 for n in new_files if n.endswith(AUTOTUNE_SUFFIXES))
        return cls(
            compile_s=diff.compile_s,
            fx_hits=diff.fx_hits,
            fx_misses=diff.fx_misses,
            fx_bypass=diff.fx_bypass,
            aot_hits=diff.aot_hits,
            aot_misses=diff.aot_misses,
            kernel_loads=diff.kernel_loads,
            bundled_kernels=diff.bundled_kernels,
            # A bundled kernel is written out of an FX entry: a load, even though a file appears.
            new_native=max(0, native - diff.bundled_kernels),
            # An FX cache hit *replays* the inductor counters its compile recorded
            # (CompiledFxGraph.counter_deltas), GEMM autotuning included: count that one only
            # when a graph really compiled. Coordinate-descent benchmarks run at call time and
            # are never replayed.
            autotunes=(diff.gemm_autotunes if diff.graphs_compiled else 0)
            + diff.coordesc_benchmarks
            + tuned,
            unique_graphs=diff.unique_graphs,
            graph_breaks=diff.graph_breaks,
            precompile_misses=precompile_misses,
            recompile_reasons=tuple(recompile_reasons),
            new_files=tuple(sorted(n for n in new_files if n.endswith(_COMPILED_SUFFIXES)))[
                :NEW_FILES_SAMPLE
            ],
        )

    def __add__(self, other: BucketCompiles) -> BucketCompiles:
        summed: dict[str, Any] = {
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in _fields(self)
        }
        summed["new_files"] = summed["new_files"][:NEW_FILES_SAMPLE]
        return BucketCompiles(**summed)

    def fields(self) -> dict[str, Any]:
        """Keyword arguments for ``BucketStats`` (lists where it keeps lists)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in _fields(self)
        }


def _fields(obj: Any) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(obj)
