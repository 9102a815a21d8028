"""Real torch.compile on CPU: bake, restore elsewhere, then verify, check and activate."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln.artifact.manifest import BucketStats
from kiln.compiler.verify import ROUTES, explain, private_copy
from kiln.errors import KilnError
from kiln.serving import cache_env, served_torch_kwargs, torch_kwargs
from tests.conftest import MODELS, mlp_spec
from tests.first_process import serve_like_a_user

pytestmark = pytest.mark.slow


def test_bake_manifest_lists_every_file_with_its_digest(baked, tmp_path: Path) -> None:
    _, result = baked
    out = tmp_path / "plain"
    out.mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(result.artifact), "-C", str(out)], check=True)
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {
        "manifest.json"
    }
    listed = {f.path: f for f in result.manifest.files}
    assert on_disk == set(listed)
    for path, entry in listed.items():
        data = (out / path).read_bytes()
        assert len(data) == entry.size
        assert hashlib.sha256(data).hexdigest() == entry.sha256
    kinds = result.manifest.bytes_by_kind()
    assert {"fxgraph", "native", "megacache"} <= set(kinds)
    assert not any("/locks/" in p for p in listed)
    assert hashlib.sha256(result.artifact.read_bytes()).hexdigest() == result.sha256


def test_bake_records_stats_and_fingerprint(baked) -> None:
    _, result = baked
    m = result.manifest
    assert [b.key for b in m.grid] == ["batch=2", "batch=3", "batch=5"]
    for b in m.grid:
        # The first call holds the compile; torch times compile_inner with its own clock calls,
        # which a loaded machine has seen end 60 ms after the call did (13.88 s in 13.82 s).
        assert b.fx_misses >= 1 and b.compile_s > 0 and b.first_call_s >= 0.9 * b.compile_s
        assert 0 < b.steady_s < b.first_call_s
    fp = m.fingerprint
    assert fp["torch.version"].startswith("2.") and fp["cpu.isa"] and len(fp["torch.key"]) == 64
    assert "fallback_random" in fp["inductor"]


def test_roundtrip_zero_compiles_in_any_order(baked, tmp_path: Path, cli) -> None:
    spec_path, result = baked
    dest = tmp_path / "elsewhere" / "cache"
    kiln.restore(result.artifact, dest)
    # Both routes in one order, the plain one in the other (kiln.activate() adds only
    # environment and imports to a folder of caches: kiln.compiler.verify.proof_routes).
    for order, seed, routes in (("shuffle", 1, ROUTES), ("reverse", 0, ("plain",))):
        report = kiln.verify(spec_path, dest, order=order, seed=seed, routes=routes)
        assert report.ok, report.reasons()
        assert report.routes == list(routes)
        for route in report.routes:
            served = report.on_route(route)
            assert sum(b.fx_hits for b in served) >= 3
            assert {b.key for b in served} == {b.key for b in result.manifest.grid}
        assert report.spec_matches and report.check is not None and report.check.ok
        cold = {b.key: b.first_call_s for b in result.manifest.grid}
        # Reported, not asserted (timing lives in benchmarks):
        print(
            order,
            {
                b.key: (round(b.first_call_s, 3), round(cold[b.key], 3))
                for b in report.on_route("plain")
            },
        )
    ready = tmp_path / "ready.json"
    # The CLI's readiness file and JSON: one route is enough (both were served above).
    args = ("--ready-file", ready, "--json", "--route", "plain")
    proc = cli("verify", spec_path, "--cache", dest, *args)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["ok"] and body["compiles"] == 0
    assert json.loads(ready.read_text())["ok"]


def test_verify_serves_a_copy_whose_kernel_locks_are_its_own(baked, tmp_path: Path) -> None:
    """Inductor takes a lock per C++ kernel it loads, in the restored folder's link target (the
    shared /tmp), and leaves the file there, its loader's. verify's copy (and replay's) links
    its locks into its own temporary folder: a root verify in an image's build leaves nothing
    that stops the image's non-root server from loading those kernels."""
    spec_path, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    served, _, _ = private_copy(dest, result.manifest, tmp_path / "verify")
    assert (dest / "inductor" / "locks").readlink() == Path("/tmp")  # the restored folder's
    # Served as verify serves it: the copy's own variables (its kiln.env names the original).
    env = cache_env(served, result.manifest.env)
    served_as_user = serve_like_a_user(spec_path, served, tmp_path / "run", exports=env)
    assert served_as_user.returncode == 0, served_as_user.stderr
    kernels = {c.name.split(".")[0] for c in served.rglob("*.main.cpp")}
    own = {lock.stem for lock in (tmp_path / "verify" / "locks").iterdir()}
    assert kernels and kernels <= own


def test_verify_fails_with_exit_6_on_a_cold_cache(baked, tmp_path: Path, cli) -> None:
    spec_path, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    shutil.rmtree(dest / "inductor")
    (dest / "inductor").mkdir()
    ready = tmp_path / "ready"
    ready.write_text("stale")
    # One route: from an empty folder every graph compiles again, on either route alike.
    options = ("--order", "grid", "--ready-file", ready, "--route", "plain")
    proc = cli("verify", spec_path, "--cache", dest, *options)
    assert proc.returncode == 6, proc.stderr
    assert "batch=2: " in proc.stderr and "compile(s): 1 FX graph, 1 AOT graph" in proc.stderr
    assert not ready.exists()


def test_serving_passes_the_kwargs_the_bake_recorded(baked) -> None:
    spec_path, result = baked
    m = result.manifest
    assert m.compile_kwargs == torch_kwargs(kiln.load_spec(spec_path).compile)
    recorded = m.model_copy(update={"compile_kwargs": {**m.compile_kwargs, "fullgraph": True}})
    assert served_torch_kwargs(recorded)["fullgraph"] is True  # what was baked, not re-derived
    older = m.model_copy(update={"compile_kwargs": None})  # an artifact from before the field
    assert served_torch_kwargs(older) == m.compile_kwargs


def test_explain_tells_a_key_miss_from_kernel_rebuilds() -> None:
    base = {"key": "batch=1", "sizes": {"batch": 1}, "first_call_s": 1, "compile_s": 0}
    retuned = BucketStats(
        **base,
        steady_s=0.001,
        fx_hits=1,
        aot_hits=1,
        new_native=11,
        autotunes=14,
        new_files=[
            f"triton/0/{h}/triton_per_fused_mean_{i}.cubin"
            for h, i in (("A", 1), ("B", 1), ("C", 2))
        ],
        recompile_reasons=["0/0: tensor 'x' size mismatch at index 0. expected 4, actual 1"],
    )
    assert explain(retuned) == (
        "batch=1: 25 compile(s): 11 kernel binaries, 14 autotune runs (every graph hit; the "
        "process built, tuned or wrote: triton_per_fused_mean_1.cubin, "
        "triton_per_fused_mean_2.cubin)"
    )
    # A served process that benchmarked a kernel's launch configs names the kernel.
    benchmarked = BucketStats(
        **base,
        steady_s=0.001,
        fx_hits=1,
        kernel_tunings=1,
        tuned_kernels=["triton_red_fused_mean_6 (2 configs)"],
    )
    assert explain(benchmarked) == (
        "batch=1: 1 compile(s): 1 kernel's configs benchmarked (every graph hit; the process "
        "built, tuned or wrote: benchmarked triton_red_fused_mean_6 (2 configs))"
    )
    # The CUDA driver JIT-compiling into the served folder's driver cache (an H100's verify of
    # an AOT artifact, 2026-12-07): named as the driver's work, not by its entries' hashes.
    jitted = BucketStats(
        **base,
        steady_s=0.001,
        written=3,
        new_files=[
            "DIR/cuda-cache/4/4/4aa7b38cbac7a7",
            "DIR/ranks/1/cuda-cache/f/c/58a3c2d1163aec",  # a rank's own driver cache
            "DIR/cuda-cache/index",
        ],
    )
    assert explain(jitted) == (
        "batch=1: 3 compile(s): 3 files written (every graph hit; the process built, tuned or "
        "wrote: the CUDA driver JIT-compiled 2 kernel(s) into cuda-cache/ that the shipped "
        "driver cache lacks)"
    )
    # ... and where the served process ran elsewhere than the bake (kiln.workdir), that too.
    assert explain(jitted, driver_factors="process.workdir").endswith(
        "lacks (environment differs: process.workdir))"
    )
    missed = BucketStats(
        **base, steady_s=0.001, fx_misses=1, recompile_reasons=retuned.recompile_reasons
    )
    assert explain(missed) == (
        "batch=1: 1 compile(s): 1 FX graph (no cached entry matched; Dynamo traced it because "
        "0/0: tensor 'x' size mismatch at index 0. expected 4, actual 1)"
    )
    assert explain(missed, "torch.version").endswith("(environment differs: torch.version)")


def test_check_names_the_differing_factor(baked, cli) -> None:
    _, result = baked
    ok = cli("check", result.artifact, "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    bad = cli(
        "check",
        result.artifact,
        "--json",
        env={"TORCH_COMPILE_CACHE_KEY_TAG": "other", "TORCHINDUCTOR_MAX_AUTOTUNE": "1"},
    )
    assert bad.returncode == 5
    report = json.loads(bad.stdout)
    assert {"env.TORCH_COMPILE_CACHE_KEY_TAG", "inductor.max_autotune"} <= set(report["misses"])
    assert "inductor.max_autotune" in bad.stderr


def test_verify_names_environment_factor_on_miss(baked, tmp_path: Path, cli) -> None:
    spec_path, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    proc = cli(
        "verify",
        spec_path,
        "--cache",
        dest,
        "--json",
        env={"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"},
    )
    assert proc.returncode == 6
    assert "inductor.max_autotune_pointwise" in json.loads(proc.stdout)["failing"][0]


def test_torch_installed_elsewhere_is_named_for_its_cpp_kernels(baked, tmp_path: Path) -> None:
    """A server whose torch sits at another path (another venv or image layout) hits every FX
    graph but builds every C++ kernel again: their build command, in their key, names where
    Python and torch are installed. check says it will miss (exit 5), verify names the factor.
    Torch imported through a symlinked folder is that, without a second install."""
    spec_path, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    elsewhere = tmp_path / "site"
    elsewhere.mkdir()
    (elsewhere / "torch").symlink_to(Path(torch.__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(elsewhere), *sys.path[1:]])}
    kiln_cli = [sys.executable, "-m", "kiln"]
    check = subprocess.run(
        [*kiln_cli, "check", str(dest), "--json"], env=env, capture_output=True, text=True
    )
    assert check.returncode == 5, check.stderr
    assert json.loads(check.stdout)["misses"] == ["cpp.paths"]
    assert f"{elsewhere}/torch/include" in check.stdout
    verify = subprocess.run(
        [*kiln_cli, "verify", str(spec_path), "--cache", str(dest), "--json", "--route", "plain"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 6, verify.stderr
    failing = json.loads(verify.stdout)["failing"]
    assert failing and all("(environment differs: cpp.paths)" in line for line in failing)


def test_activate_route_hits_in_a_server_process(baked, tmp_path: Path) -> None:
    _, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    server = f"""
import sys, json, torch
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent / "examples")!r})
import kiln
act = kiln.activate({str(dest)!r}, compat="fail")
from models import tiny_mlp
m = torch.compile(tiny_mlp(16, 32), dynamic=False)
from torch._dynamo.utils import counters
with torch.inference_mode():
    for b in (5, 2, 3):
        m(torch.randn(b, 16), scale=2.0)
import os
moved = os.environ.get("TRITON_CACHE_DIR")
print(json.dumps({{"act": act.to_dict(), "inductor": dict(counters["inductor"]), "moved": moved}}))
"""
    # The image sets TRITON_CACHE_DIR (it would move Inductor's Triton kernels out of DIR):
    # activate() drops it.
    moved = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "elsewhere")}
    proc = subprocess.run(
        [sys.executable, "-c", server], capture_output=True, text=True, timeout=300, env=moved
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["moved"] is None
    assert out["act"]["compatible"] is True
    assert out["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert out["inductor"]["fxgraph_cache_hit"] == 3


def test_automatic_dynamic_is_order_independent(write_spec, tmp_path: Path) -> None:
    spec_path = write_spec(mlp_spec("dyn-mlp", dynamic="null", buckets="batch: [2, 3, 5, 8]"))
    # No proof: the two verifies below are this test's proof (one process fewer).
    result = kiln.bake(spec_path, tmp_path / "dyn.kiln.tar.zst", prove=False)
    assert result.manifest.env["TORCH_COMPILE_JOB_ID"] == "kiln-dyn-mlp"
    assert len(result.manifest.passes) >= 2
    assert result.manifest.passes[-1].compiles == 0
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    # Two orders (seed 3's shuffle was seed 1's again): both routes in one, the plain route in
    # the other (kiln.activate() adds only environment and imports to a folder of caches, as
    # kiln.compiler.verify.proof_routes says).
    for seed, routes in ((1, ROUTES), (2, ("plain",))):
        report = kiln.verify(spec_path, dest, order="shuffle", seed=seed, routes=routes)
        assert report.ok, (report.order, report.reasons())


def test_dynamic_true_serves_with_zero_compiles(write_spec, tmp_path: Path) -> None:
    """``dynamic: true`` traces the tiny GPT's Python float constants (its rotary base, a
    ``pow(2.0)``) symbolic first, then specializes them and traces again, in every process: the
    first trace's AOT lookup always misses and compiles nothing. A served process that hit
    everything else compiled nothing, and verify and a user's own server say so (they counted
    that lookup as a compile, and failed every such spec)."""
    spec_path = write_spec(
        f"name: sym-gpt\nmodel:\n  factory: {MODELS}:tiny_gpt\n"
        "  kwargs: {vocab: 64, dim: 16, layers: 1, heads: 2}\n"
        "compile:\n  dynamic: true\ninputs:\n"
        "  - {name: input_ids, shape: [batch, seq], dtype: int64, fill: randint, high: 64}\n"
        "buckets:\n  batch: [2, 3]\n  seq: [8]\nwarmup: {calls: 2}\n"
    )
    result = kiln.bake(spec_path, tmp_path / "sym.kiln.tar.zst", prove=False)  # verify proves
    assert result.manifest.compile_kwargs["dynamic"] is True
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    report = kiln.verify(spec_path, dest, order="reverse", routes=("plain",))
    assert report.ok, report.reasons()
    assert report.buckets[0].aot_restarts == 1 and report.buckets[0].compiles == 0
    # The user's server in the run's environment: the bake's Inductor trusted the CPU's ISA
    # flags (tests/conftest.py), a setting in Inductor's cache key that a fresh pod would share.
    shared = {k: v for k, v in os.environ.items() if k == "TORCHINDUCTOR_VEC_ISA_OK"}
    served = serve_like_a_user(spec_path, dest, tmp_path / "user", order="reverse", env=shared)
    assert served.returncode == 0, served.stderr
    assert served.work() == {} and not served.dest, served.summary()
    # What was discounted is really there: torch counted the lookup as a miss.
    first = served.buckets[0]["counters"]["aot_autograd"]
    assert first.get("autograd_cache_miss") == 1 and first.get("autograd_cache_hit") == 1, first


def test_autotuning_spec_round_trip(write_spec, tmp_path: Path) -> None:
    """The options kiln adds for autotuning specs are real torch options, recorded, and served.

    Coordinate-descent tuning only touches Triton kernels, so on CPU this checks the plumbing:
    torch accepts the settings, the bake runs its settling passes, and a restored process
    compiled with the recorded arguments hits. The first pass compiles with the worker pool and
    the second without (``compile_threads: 1``), so its zero compiles also show that the thread
    count stays out of the cache key.
    """
    text = mlp_spec("tuned-mlp", buckets="batch: [2]").replace(  # the plumbing: one graph
        "  dynamic: false", "  dynamic: false\n  options: {coordinate_descent_tuning: true}"
    )
    spec_path = write_spec(text)
    result = kiln.bake(spec_path, tmp_path / "tuned.kiln.tar.zst", prove=False)  # verify proves
    assert result.manifest.compile_kwargs["options"] == {
        "coordinate_descent_tuning": True,
        "use_static_cuda_launcher": False,
        "compile_threads": 1,
    }
    assert len(result.manifest.passes) == 2 and result.manifest.passes[-1].compiles == 0
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    report = kiln.verify(spec_path, dest, order="reverse")
    assert report.ok, report.reasons()


def module_spec(
    write_spec,
    tmp_path: Path,
    name: str,
    forward: str,
    header: str = "",
    buckets: str = "",
    passes: int = 2,
) -> Path:
    """A spec for a one-module model file next to it, on the MLP spec's grid (or ``buckets``),
    baked in ``passes`` fresh-process passes."""
    (tmp_path / f"{name}.py").write_text(
        f"import random, torch\n{header}"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        + "".join(f"        {line}\n" for line in forward.splitlines())
        + "def make():\n    return M()\n"
    )
    text = mlp_spec(name, buckets=buckets).replace(f"{MODELS}:tiny_mlp", f"{name}.py:make")
    text = text.replace("  kwargs: {dim: 16, hidden: 32}\n  call_kwargs: {scale: 2.0}\n", "")
    return write_spec(text.replace("warmup: {calls: 2}", f"warmup: {{calls: 2, passes: {passes}}}"))


def test_failed_bake_leaves_no_artifact(write_spec, tmp_path: Path, cli) -> None:
    forward = "if x.shape[0] == 3:\n    raise RuntimeError('boom on batch 3')\nreturn x * 2"
    # The bake fails before it compiled anything: the eager call of each bucket before the
    # first compile finds it.
    spec_path = module_spec(write_spec, tmp_path, "flaky", forward, buckets="batch: [3, 5]")
    out = tmp_path / "out" / "flaky.kiln.tar.zst"
    with pytest.raises(KilnError, match="boom on batch 3"):
        kiln.bake(spec_path, out)
    assert not out.exists()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    proc = cli("bake", spec_path, "-o", out)
    assert proc.returncode == 2  # the model refused the spec's inputs (its eager call, first)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and "boom on batch 3" in errors[0]
    assert not out.exists()


def test_factory_error_is_a_spec_error(write_spec, tmp_path: Path, cli) -> None:
    text = mlp_spec().replace(":tiny_mlp", ":no_such_factory")
    proc = cli("bake", write_spec(text), "-o", tmp_path / "x.kiln.tar.zst")
    assert proc.returncode == 2
    assert ":3:3: model.factory: " in proc.stderr and "no_such_factory" in proc.stderr
    misspelt = write_spec(mlp_spec().replace(":tiny_mlp", ":tiny_mpl"))
    typo = cli("bake", misspelt, "-o", tmp_path / "y.kiln.tar.zst")
    assert typo.returncode == 2
    assert "has no attribute 'tiny_mpl' (did you mean 'tiny_mlp'?)" in typo.stderr, typo.stderr


def test_bake_says_when_a_fresh_process_still_compiles(write_spec, tmp_path: Path, cli) -> None:
    """A model that closes over a per-process value can never hit: the bake's proof compiles,
    a re-bake cannot fix it (the next proof misses the same), so the bake stops re-baking and
    says so instead of shipping silently."""
    header = "SCALE = random.random()  # a different constant in every process\n"
    # One bucket and one pass are enough to never hit: the pass, the two proofs and the re-bake
    # between them each compile once (3 buckets or 2 passes would only add compiles).
    forward = "return torch.relu(x) * SCALE"
    spec_path = module_spec(
        write_spec, tmp_path, "perprocess", forward, header, "batch: [2]", passes=1
    )
    proc = cli("bake", spec_path, "-o", tmp_path / "pp.kiln.tar.zst", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert len(summary["warnings"]) == 1 and "the bake's proof" in summary["warnings"][0]
    assert "warning:" in proc.stderr and "kiln verify` will fail" in proc.stderr
    manifest = kiln.read_manifest(tmp_path / "pp.kiln.tar.zst")
    assert manifest.warnings == summary["warnings"]
    assert manifest.proof is not None and manifest.proof.compiles > 0
    assert manifest.proof.rebakes == 1 and summary["proof"]["rebakes"] == 1
    assert "the last changed nothing it missed" in summary["warnings"][0]
    assert len(manifest.passes) == 1 + 1  # the spec's one pass, then the one re-bake
    assert manifest.passes[-1].compiles > 0


def test_precompiled_forwards_skip_dynamo_and_fall_back_off_grid(
    write_spec, tmp_path: Path, cli
) -> None:
    """compile.precompile: the restored process runs the grid without tracing a single frame."""
    text = mlp_spec("pre-mlp").replace("  dynamic: false", "  dynamic: false\n  fullgraph: true")
    text = text.replace("fullgraph: true", "fullgraph: true\n  precompile: true")
    spec_path = write_spec(text)
    # No proof: the verify below serves both routes as the proof would (two processes fewer).
    result = kiln.bake(spec_path, tmp_path / "pre.kiln.tar.zst", prove=False)
    # Two automatic passes: the first saves the forwards, the second the plain route's entries;
    # so both routes below hit (one pass would leave the plain route to a re-bake).
    assert len(result.manifest.passes) == 2
    assert result.manifest.precompiled == "precompiled.bin"
    assert result.manifest.bytes_by_kind()["precompile"][0] == 1
    dest = tmp_path / "else" / "cache"
    kiln.restore(result.artifact, dest)
    report = kiln.verify(spec_path, dest, order="reverse")
    assert report.ok, report.reasons()
    served = report.on_route("activate")  # the route the forwards are made for
    assert sum(b.unique_graphs for b in served) == 0  # Dynamo traced nothing
    assert sum(b.fx_hits + b.fx_misses for b in served) == 0
    assert report.to_dict()["precompile_load_s"] > 0
    plain = report.on_route("plain")  # torch.compile after kiln.env traces, and hits
    assert sum(b.unique_graphs for b in plain) > 0 and sum(b.fx_hits for b in plain) > 0

    server = f"""
import sys, json, torch
sys.path.insert(0, {str(MODELS.parent)!r})
import kiln
act = kiln.activate({str(dest)!r}, compat="fail")
from models import tiny_mlp
model = tiny_mlp(16, 32).eval()
m = act.compile(model, on_miss="compile")  # the shape off the grid goes to the forwards' fallback
from torch._dynamo.utils import counters
out = {{}}
with torch.inference_mode():
    for b in (5, 2, 3, 7):
        x = torch.randn(b, 16)
        out[b] = torch.allclose(m(x, scale=2.0), model(x, scale=2.0), atol=1e-5)
        out[f"misses after {{b}}"] = m.misses
m(torch.randn(2, 16), scale=2.0)  # a grid shape outside inference mode: missed, and why
out["why"] = m.miss_reason
# The model's class from a second copy of its module (a server that loads the file itself):
# another class object, which the graphs' guard on it refuses; the miss says why.
import importlib.util
loaded = importlib.util.spec_from_file_location("models", {str(MODELS)!r})
copy = importlib.util.module_from_spec(loaded)
loaded.loader.exec_module(copy)
other = act.compile(copy.tiny_mlp(16, 32).eval())
with torch.inference_mode():
    other(torch.randn(2, 16), scale=2.0)
out["class_why"] = other.miss_reason
print(json.dumps({{"act": act.to_dict(), "out": out, "frames": dict(counters["frames"])}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", server], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["act"]["precompiled"] is True
    assert got["out"] == {
        "5": True,
        "misses after 5": 0,
        "2": True,
        "misses after 2": 0,
        "3": True,
        "misses after 3": 0,
        "7": True,  # off the grid: compiled by the fallback, still correct
        "misses after 7": 1,
        "why": "GLOBAL_STATE changed: grad_mode",  # the factor, as torch's guard names it
        "class_why": got["out"]["class_why"],
    }
    assert "___check_type_id" in got["out"]["class_why"]
    assert got["out"]["class_why"].endswith(
        ": this model's class models.TinyMLP is not the object the bake traced (a second copy "
        "of module 'models': loaded from its file, or imported twice): `import models` as the "
        "bake did (docs/serving.md)"
    )
    assert "match no precompiled bucket (no baked bucket has this shape" in proc.stderr

    # Forwards damaged after restore: the folder changed, verify fails (exit 6) and says to
    # restore again; the activate route fell back to compiling, which it counts.
    fresh = tmp_path / "fresh"
    kiln.restore(result.artifact, fresh)
    (fresh / "precompiled.bin").write_bytes(b"not a pickle")
    # The route that loads the forwards (the folder's change fails either route alike).
    bad = cli("verify", spec_path, "--cache", fresh, "--json", "--route", "activate")
    assert bad.returncode == 6, bad.stderr[-2000:]
    body = json.loads(bad.stdout)
    assert body["folder_changes"] == ["~precompiled.bin"], body["folder_changes"]
    assert "restore it again" in bad.stderr


def test_kiln_processes_hide_torchs_numpy_warning(baked, cli) -> None:
    """torch's CPU wheel warns "Failed to initialize NumPy" at import when numpy is absent:
    noise on every command that imports torch. PYTHONWARNINGS=default makes sure no filter
    inherited from pytest or the shell hides it: only kiln's own, by message, may."""
    _, result = baked
    shown = {"PYTHONWARNINGS": "default"}
    for args in (("env", "--json"), ("check", result.artifact, "--json")):
        proc = cli(*args, env=shown)
        assert proc.returncode == 0, proc.stderr
        assert "NumPy" not in proc.stderr, (args, proc.stderr)
    example = Path(__file__).resolve().parent.parent / "examples" / "serve.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **shown},
    )
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr
    # The grid worker's log (shown with a failure) carries none either.
    assert result.runs and all("NumPy" not in run.log for run in result.runs)


# Two models in one server, each from its own restored folder (a user's report: the second
# activate() moved Inductor's cache folder, so the first model's buckets missed, compiled 15 s
# each and wrote their kernels into the second folder).
TWO_FOLDERS = """
import json, os, sys, torch
sys.path.insert(0, {models!r})
import kiln
from kiln.compiler.activate import ActiveFolderError
from models import tiny_mlp
first, second, packages = sys.argv[1:4]
model = tiny_mlp(16, 32).eval()
served = kiln.activate(first, compat="fail").compile(model)
out = {{}}
try:
    kiln.activate(second)
except ActiveFolderError as exc:
    out["refused"] = str(exc)
kiln.activate(first + "/", compat="fail")  # the same folder again: fine
aot = kiln.activate(packages, compat="fail")  # AOT packages: beside it, no environment of theirs
out["aot_env"] = aot.env
out["inductor_dir"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
beside = aot.compile(model)
from torch._dynamo.utils import counters
with torch.inference_mode():
    x = torch.randn(2, 16)
    out["aot_same"] = torch.allclose(beside(x=x, scale=2.0), model(x, scale=2.0), atol=1e-5)
    for b in (5, 2, 3):
        served(torch.randn(b, 16), scale=2.0)
out["inductor"] = dict(counters["inductor"])
print(json.dumps(out))
"""


def test_a_second_compile_route_folder_in_one_process_is_refused(
    baked, aoti_baked, tmp_path: Path
) -> None:
    _, result = baked
    first, second = tmp_path / "first", tmp_path / "second"
    kiln.restore(result.artifact, first)
    kiln.restore(result.artifact, second)
    before = sorted(p.relative_to(second) for p in second.rglob("*"))
    script = TWO_FOLDERS.format(models=str(MODELS.parent))
    argv = [sys.executable, "-c", script, str(first), str(second), str(aoti_baked[1])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["refused"] == (
        f"{second}: this process serves {first} already: one compile-route folder serves a "
        "process, as Inductor's cache folder and settings are process-global (the first "
        "model's shapes would miss and compile into this folder); serve each model from its "
        "own process, or bake the others with compile.route: aoti, whose packages serve "
        "beside it (docs/serving.md)"
    )
    assert out["aot_env"] == {} and out["inductor_dir"] == str(first / "inductor")
    assert out["aot_same"] is True
    assert out["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert out["inductor"]["fxgraph_cache_hit"] == 3
    assert sorted(p.relative_to(second) for p in second.rglob("*")) == before


ON_MISS_SERVER = """
import json, sys, torch
sys.path.insert(0, {models!r})
import kiln
from kiln.errors import ParameterError
from kiln.padding import OffGridError
from models import tiny_mlp
act = kiln.activate(sys.argv[1], compat="fail")
model = tiny_mlp(16, 32).eval()
out = {{}}
try:
    act.compile(model, on_miss="bogus")
except ParameterError as exc:
    out["bogus"] = str(exc)
served, eager = act.compile(model), act.compile(model, on_miss="eager")
from torch._dynamo.utils import counters
with torch.inference_mode():
    for b in (5, 2, 3):
        served(torch.randn(b, 16), scale=2.0)
    x = torch.randn(4, 16)
    try:
        served(x, scale=2.0)
    except OffGridError as exc:
        out["refused"] = str(exc)
    out["eager"] = torch.equal(eager(x, scale=2.0), model(x, scale=2.0))
out["inductor"] = dict(counters["inductor"])
print(json.dumps(out))
"""


def test_a_spec_without_pad_serves_its_grid_exactly_and_verify_says_what_off_grid_did(
    baked, cli, tmp_path: Path
) -> None:
    """A user's report: without `pad`, on_miss was ignored (batch=3 compiled in the server,
    8.8 s, under on_miss error), and verify --traffic printed only the in-grid verdict."""
    spec, result = baked  # batch [2, 3, 5], no pad values: on_miss's default, error, applies
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    script = ON_MISS_SERVER.format(models=str(MODELS.parent))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(dest)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bogus"] == "on_miss='bogus': one of error, eager, compile"
    refused = (
        "batch=4 is off the grid: batch is not padded (no input declares `pad`) and 4 is not a "
        "baked size (2, 3, 5) (on_miss: error)"
    )
    assert out["refused"] == refused and out["eager"] is True
    assert out["inductor"]["fxgraph_cache_hit"] == 3
    assert out["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before  # nothing compiled

    log = tmp_path / "t.jsonl"
    log.write_text('{"batch": 2}\n{"batch": 4}\n{"batch": 5}\n')
    ok = cli("verify", spec, "--cache", dest, "--traffic", log)
    assert ok.returncode == 0, ok.stderr[-2000:]
    text = " ".join(ok.stdout.split())  # rich wraps long lines
    assert "in grid 2, off grid 1 (on_miss: error); the spec pads no axis" in text
    assert (
        f"off the grid: 1 request(s) of 1 shape(s): 1 refused with OffGridError: {refused}" in text
    )
    assert "verified: zero compiles over 2 in-grid requests" in text
    compiled = cli("verify", spec, "--cache", dest, "--traffic", log, "--on-miss", "compile")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    text = " ".join(compiled.stdout.split())
    assert "off grid 1 (on_miss: compile)" in text
    served = text.split("off the grid: 1 request(s) of 1 shape(s): 1 served by compiling in the ")
    assert len(served) == 2 and served[1].startswith("server ("), text
    assert not served[1].startswith("server (0 compile(s)"), text  # batch=4 compiled there
