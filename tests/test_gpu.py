"""GPU path on a CUDA machine: Triton, autotune and CUDA-graph caches hit after restore.

Skipped without CUDA (conftest); run on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kiln
from tests.conftest import gpt_spec

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def breakdown(report) -> dict:
    fields = (
        "fx_hits",
        "fx_misses",
        "fx_bypass",
        "aot_hits",
        "aot_misses",
        "new_native",
        "autotunes",
        "kernel_loads",
        "bundled_kernels",
        "precompile_misses",
        "unique_graphs",
        "new_files",
    )
    return {b.key: {f: getattr(b, f) for f in fields} for b in report.buckets}


@pytest.fixture(
    scope="module",
    params=[
        "default",
        "reduce-overhead",
        "max-autotune-no-cudagraphs",
        "default+precompile",
        "reduce-overhead+precompile",
        "reduce-overhead+frames",
    ],
)
def gpu_baked(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gpu-{request.param}")
    spec = d / "spec.yaml"
    mode, _, extra = request.param.partition("+")
    name = f"gpt-{request.param.replace('+', '-')}"
    spec.write_text(gpt_spec(name, mode, precompile=extra))
    result = kiln.bake(spec, d / "a.kiln.tar.zst")
    return request.param, spec, result


def test_bake_compiled_triton_kernels(gpu_baked) -> None:
    """The counters must see the cold compile, or a zero in verify would prove nothing."""
    mode, _, result = gpu_baked
    m = result.manifest
    assert sum(b.new_native for b in m.grid) > 0
    if mode.startswith("max-autotune"):
        assert sum(b.autotunes for b in m.grid) > 0
        # Autotuned bakes run fresh-process passes until one compiles nothing: the first
        # fresh process still builds a few coordinate-descent winners the tuning run did not
        # leave in the Triton cache.
        print(mode, "bake passes compiled", [p.compiles for p in m.passes])
        assert len(m.passes) >= 2
        assert m.passes[-1].compiles == 0, m.warnings
    assert m.fingerprint["gpu.name"] and m.fingerprint["gpu.capability"]
    assert "triton" in m.bytes_by_kind()


def test_restored_cache_compiles_nothing_anywhere_in_any_order(gpu_baked, tmp_path: Path) -> None:
    """Two unrelated paths, two request orders: no FX/AOT miss, no Triton compile, no autotune.

    The second path also answers whether Triton's cache survives relocation.
    """
    mode, spec, result = gpu_baked
    for where, order, seed in (("a/cache", "shuffle", 1), ("some/where/else/cache", "reverse", 0)):
        dest = tmp_path / where
        kiln.restore(result.artifact, dest)
        report = kiln.verify(spec, dest, order=order, seed=seed)
        detail = json.dumps(breakdown(report))
        print(mode, where, "ok" if report.ok else "FAILED", detail)  # whole, for diagnosis
        # Every FX/AOT entry hits first: a re-tuning failure below is about Triton, not keys.
        assert all(b.fx_misses == b.aot_misses == b.fx_bypass == 0 for b in report.buckets), detail
        assert report.ok, (mode, where, report.reasons())
        if mode.endswith(("precompile", "frames")):
            assert sum(b.unique_graphs for b in report.buckets) == 0, detail  # no Dynamo trace
        print(mode, where, order, {b.key: round(b.first_call_s, 3) for b in report.buckets})


def test_other_device_index_is_named(gpu_baked, cli) -> None:
    _, _, result = gpu_baked
    proc = cli("check", result.artifact, "--device-index", "1", "--json")
    assert proc.returncode == 5
    assert "device.index" in json.loads(proc.stdout)["misses"]
    assert "device.index" in proc.stderr
