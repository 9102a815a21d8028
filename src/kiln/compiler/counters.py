"""What a step compiled, counted: torch's counters as one dataclass, read before and after.

Shaped after vLLM's ``compilation/counter.py``: a flat dataclass of counts, snapshotted around a
step and subtracted, so "what did this bucket compile?" is one expression instead of a dozen
dictionary lookups. :func:`compile_counts` turns such a difference, plus the files the step
wrote into the cache root, into the manifest's :class:`~kiln.artifact.manifest.CompileCounts`.
Needs torch only in :meth:`CompileCounters.read`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.artifact.manifest import MAX_FRAMES, MAX_TUNED, NEW_FILES_SAMPLE, CompileCounts
from kiln.compiler.writes import KERNEL, LAUNCHER, OTHER, TUNING, kind_of, tally

# Inductor's run-time tuning steps (``dynamo_timed`` names): each run is one kernel benchmarked
# in this process. Read from ``compilation_time_metrics``, which an FX cache hit never adds to,
# unlike the inductor counters (a hit replays the counts its compile recorded).
_TUNING_STEPS = (
    "CachingAutotuner.benchmark_all_configs",
    "CachingAutotuner.combo_sequential_autotune",
)

_TORCH = "torch"  # the field metadata key naming a field's counter in torch


def _counter(group: str, name: str) -> Any:
    """A field :meth:`CompileCounters.read` takes from ``torch._dynamo.utils.counters[group]
    [name]``: the field and the counter it reads are written once, side by side."""
    return field(default=0, metadata={_TORCH: (group, name)})


@dataclass(frozen=True)
class CompileCounters:
    """Process-wide totals of torch's compile counters (:meth:`read`), or a difference of two."""

    fx_hits: int = _counter("inductor", "fxgraph_cache_hit")
    fx_misses: int = _counter("inductor", "fxgraph_cache_miss")
    fx_bypass: int = _counter("inductor", "fxgraph_cache_bypass")
    aot_hits: int = _counter("aot_autograd", "autograd_cache_hit")
    aot_misses: int = _counter("aot_autograd", "autograd_cache_miss")
    aot_bypass: int = _counter("aot_autograd", "autograd_cache_bypass")
    # AOTAutograd's runs: started, finished, failed. One started that neither finished nor
    # failed was cut short by Dynamo restarting its trace (TensorifyScalarRestartAnalysis, the
    # only exception torch lets through uncounted): with ``dynamic=True`` a model's Python float
    # constants (a RoPE base, a ``pow(2.0)``) are traced symbolic first, then specialized and
    # traced again, in every process. The first run looked its graph up and missed, as it always
    # will (that graph is never finished, so never saved): not compile work a cache can ship.
    aot_runs: int = _counter("aot_autograd", "total")
    aot_finished: int = _counter("aot_autograd", "ok")
    aot_failed: int = _counter("aot_autograd", "not_ok")
    # Kernels handed to AsyncCompile: in a fresh process that is every kernel *loaded*, hit or
    # not (torch bumps "async_compile_cache_miss" before looking anything up).
    kernel_loads: int = _counter("inductor", "async_compile_cache_miss")
    # Triton kernels re-emitted from FX cache entries: loads, not compiles.
    bundled_kernels: int = _counter("inductor", "triton_bundler_read_and_emit_kernel")
    gemm_autotunes: int = _counter("inductor", "select_algorithm_autotune")
    coordesc_benchmarks: int = _counter("inductor", "coordesc_tuning_bench")
    unique_graphs: int = _counter("stats", "unique_graphs")
    # Read from elsewhere by read():
    kernel_tunings: int = 0  # runs of the _TUNING_STEPS
    graph_breaks: int = 0  # every graph_break counter, summed
    compile_s: float = 0.0  # Dynamo's compile_inner time: tracing plus everything below it

    @classmethod
    def read(cls) -> CompileCounters:
        """The totals now (torch must be importable). Zeros in a process that has not imported
        Dynamo (an eager pass): nothing compiled there, and importing it would cost seconds
        that an eager server never pays."""
        if "torch._dynamo" not in sys.modules:
            return cls()
        from torch._dynamo.utils import compilation_time_metrics, counters

        values: dict[str, Any] = {
            f.name: counters.get(group, {}).get(key, 0)
            for f in dataclasses.fields(cls)
            if f.metadata
            for group, key in [f.metadata[_TORCH]]
        }
        values["graph_breaks"] = sum(counters.get("graph_break", {}).values())
        values["compile_s"] = float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
        values["kernel_tunings"] = sum(
            len(compilation_time_metrics.get(k, [])) for k in _TUNING_STEPS
        )
        return cls(**values)

    def __sub__(self, other: CompileCounters) -> CompileCounters:
        return CompileCounters(
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    @property
    def aot_restarts(self) -> int:
        """AOTAutograd runs a Dynamo restart abandoned (see ``aot_runs``)."""
        return max(0, self.aot_runs - self.aot_finished - self.aot_failed)

    @property
    def aot_compiles(self) -> int:
        """AOT cache misses that AOTAutograd went on to compile: less the lookups of the runs a
        restart abandoned. An abandoned lookup may have ended as a bypass rather than a miss:
        so as never to hide another graph's real miss, bypasses in the step are taken to be
        abandoned lookups first."""
        abandoned_misses = max(0, self.aot_restarts - self.aot_bypass)
        return self.aot_misses - min(self.aot_misses, abandoned_misses)

    @property
    def graphs_compiled(self) -> int:
        """FX graphs compiled here rather than loaded (a bypass compiles too)."""
        return self.fx_misses + self.fx_bypass


def compile_counts(
    diff: CompileCounters,
    new_files: Collection[str],
    *,
    served: bool = False,
    recompile_reasons: Sequence[str] = (),
    precompile_misses: int = 0,
    frames: Sequence[str] = (),
    benchmarked: Sequence[str] = (),
) -> CompileCounts:
    """From a counter difference and the files the step wrote: new files in the cache root
    (a bake pass), or, ``served``, everything a served process wrote where it must not
    (:mod:`kiln.compiler.writes`), each of which is a miss, and the kernels it benchmarked by
    name (``benchmarked``; a bake pass tunes by design, and its manifest names none)."""
    kinds = tally(new_files)
    native, tuned = kinds[KERNEL], kinds[TUNING]
    return CompileCounts(
        **_shared(diff) | {"aot_misses": diff.aot_compiles, "aot_restarts": diff.aot_restarts},
        # A bundled kernel is written out of an FX entry: a load, even though a file appears.
        new_native=max(0, native - diff.bundled_kernels),
        # An FX cache hit *replays* the inductor counters its compile recorded
        # (CompiledFxGraph.counter_deltas), GEMM autotuning included: count that one only
        # when a graph really compiled. Coordinate-descent benchmarks run at call time and
        # are never replayed.
        autotunes=(diff.gemm_autotunes if diff.graphs_compiled else 0)
        + diff.coordesc_benchmarks
        + tuned,
        launchers=kinds[LAUNCHER],
        written=kinds[OTHER] if served else 0,
        precompile_misses=precompile_misses,
        recompile_reasons=list(recompile_reasons),
        frames=list(frames)[:MAX_FRAMES],
        tuned_kernels=list(benchmarked)[:MAX_TUNED] if served else [],
        new_files=sorted(n for n in new_files if served or kind_of(n) != OTHER)[:NEW_FILES_SAMPLE],
    )


def _shared(diff: CompileCounters) -> dict[str, Any]:
    """The counts both records name alike (fx_hits, compile_s, ...), taken as they are: a field
    added to both is carried without a third list of names to keep in step."""
    return {
        f.name: getattr(diff, f.name)
        for f in dataclasses.fields(diff)
        if f.name in CompileCounts.model_fields
    }
