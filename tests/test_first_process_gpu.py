"""On a GPU: the first process after a restore, served as a user serves, does no compile work
(issue 25), on a writable and on a read-only folder, and verify agrees with it.

Each reference spec (``KILN_GPU_SPECS``, comma-separated, overrides the list) is baked once;
then three fresh restores at new paths, each served first by tests/user_server.py (`. kiln.env`,
plain torch.compile, no kiln import; an AOT-route spec through kiln.activate) in another
order, the second one from a read-only bind mount; then ``kiln.verify`` on a fourth restore.
``KILN_GPU_OUT`` (a folder) collects what each process did, for docs/benchmarks.md, and each
artifact baked (``SPEC.kiln.tar.zst``). ``KILN_GPU_ARTIFACTS`` (a folder) holding
``SPEC.kiln.tar.zst`` skips that spec's bake: a spec whose bake and tests do not fit one device
call bakes in one call (``scripts/gpu-run.sh bake configs/SPEC.yaml``, outside pytest: the real
ISA probes) and is tested in the next, its artifact carried over.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import kiln
from kiln.errors import VerificationError
from kiln.serving import cuda_cache_copy
from kiln.spec import Spec
from tests.conftest import ROOT
from tests.first_process import digest_tree, serve_like_a_user

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("real_isa_probes")]

# tiny-gpt-cuda-tuned autotunes: its kernels load through Triton's cache groups (relocated by
# restore), the others' through Inductor's static launcher.
SPECS = os.environ.get(
    "KILN_GPU_SPECS",
    "configs/tiny-gpt-cuda.yaml,configs/tiny-gpt-cuda-tuned.yaml,configs/encoder-graph-break.yaml",
).split(",")
ORDERS = (("grid", False), ("reverse", True), ("shuffle", False))  # (order, read-only)


def record(name: str, data: dict) -> None:
    out = os.environ.get("KILN_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with (Path(out) / "first-process.jsonl").open("a") as f:
            f.write(json.dumps({"spec": name, **data}) + "\n")


@pytest.fixture(scope="module", params=SPECS)
def baked(request, tmp_path_factory) -> tuple[Path, Path]:
    """The spec and its artifact: carried in (``KILN_GPU_ARTIFACTS``) or baked here, for a
    server that runs in a folder of its own (``serve.workdir``, :func:`server_folder`), not in
    the folder pytest runs in."""
    spec = ROOT / request.param
    carried_in = os.environ.get("KILN_GPU_ARTIFACTS", "/nonexistent")
    carried = Path(carried_in, f"{spec.stem}.kiln.tar.zst")
    if carried.is_file():
        record(spec.stem, {"carried": str(carried)})
        return spec, carried
    d = tmp_path_factory.mktemp(spec.stem)
    app = d / "app"
    app.mkdir()
    served = served_spec(spec, app)
    # The bake proves CPU ISAs as the user's server does (tests/conftest.py trusts the flags for
    # the rest of the run; the setting is in Inductor's cache key, and the server's environment
    # is a fresh pod's): with it, every bucket of the user's first process missed its FX entry.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
        result = kiln.bake(served, d / "a.kiln.tar.zst")
    record(
        spec.stem,
        {
            "bake_passes": [p.compiles for p in result.manifest.passes],
            "proof": result.manifest.proof.model_dump() if result.manifest.proof else None,
            "workdir": result.manifest.workdir.model_dump() if result.manifest.workdir else None,
        },
    )
    out = os.environ.get("KILN_GPU_OUT")
    if out:  # for the next call to carry (KILN_GPU_ARTIFACTS)
        shutil.copyfile(result.artifact, Path(out) / f"{spec.stem}.kiln.tar.zst")
    return spec, result.artifact


def served_spec(spec: Path, folder: Path) -> Spec:
    """``spec`` for a server that runs in ``folder`` (``serve.workdir``)."""
    loaded = kiln.load_spec(spec)
    return loaded.model_copy(
        update={"serve": loaded.serve.model_copy(update={"workdir": str(folder)})}
    )


def server_folder(artifact: Path, tmp_path: Path) -> Path:
    """Where the user's server runs: where the bake ran its processes, when the artifact's
    driver entries are keyed by it (kiln.workdir), else a folder of its own."""
    keyed = kiln.read_manifest(artifact).workdir
    folder = Path(keyed.path) if keyed else tmp_path / "app"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def read_only(folder: Path) -> None:
    """A read-only bind mount of ``folder`` over itself (root ignores file modes)."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)


def test_first_user_process_does_no_compile_work(baked, tmp_path: Path) -> None:
    spec, artifact = baked
    cwd = server_folder(artifact, tmp_path)
    for i, (order, ro) in enumerate(ORDERS):
        dest = tmp_path / f"pod{i}" / "opt" / "kiln"
        kiln.restore(artifact, dest)
        if ro:
            read_only(dest)
        try:
            served = serve_like_a_user(
                spec, dest, tmp_path / f"run{i}", order=order, seed=i, cwd=cwd
            )
        finally:
            if ro:
                subprocess.run(["umount", "-l", str(dest)], check=False)
        record(spec.stem, {"order": order, "read_only": ro, **served.summary()})
        assert served.returncode == 0, served.stderr
        assert served.work() == {}, (order, ro, served.summary())
        assert served.benchmarks() == 0, (order, ro, served.summary())
        assert not served.dest and served.home == [], served.summary()
        # Read-only, the driver's JIT cache serves from a copy in TMPDIR (kiln.serving
        # .CUDA_COPY_PREFIX), which a process that hits it leaves as copied.
        shipped = digest_tree(dest / "cuda-cache") if ro else {}
        copy = cuda_cache_copy(dest, None, {"TMPDIR": str(tmp_path / f"run{i}" / "tmp")})
        assert served.tmp == sorted(f"{copy.name}/{name}" for name in shipped), served.summary()
        assert digest_tree(copy) == shipped, served.summary()
        if kiln.read_manifest(artifact).aoti is not None:  # kiln.activate's packages alone
            assert served.compiler_modules == [], served.summary()


def test_verify_agrees_with_the_user_server(baked, tmp_path: Path) -> None:
    spec, artifact = baked
    dest = tmp_path / "verify" / "cache"
    kiln.restore(artifact, dest)
    where = server_folder(artifact, tmp_path)
    report = kiln.verify(served_spec(spec, where), dest, order="shuffle", seed=3)
    record(spec.stem, {"verify": report.to_dict()})
    aoti = kiln.read_manifest(artifact).aoti is not None  # served by kiln.activate() alone
    assert report.routes == (["activate"] if aoti else ["plain", "activate"])
    assert report.ok, report.reasons()


def test_verify_names_a_lost_tuning_result_and_a_lost_helper(baked, tmp_path: Path) -> None:
    """Delete what the first process would otherwise redo: a kernel's .best_config and
    Triton's cuda_utils; verify (plain route) fails naming both. Measured on the H200
    (2026-12-05): a default-mode kernel does not re-benchmark without its .best_config (its FX
    entry holds the config the tuning pre-pass chose), so the lost file is named as the folder's
    drift, the rebuilt helper as a gcc build."""
    spec, artifact = baked
    dest = tmp_path / "lost" / "cache"
    kiln.restore(artifact, dest)
    if kiln.read_manifest(artifact).aoti is not None:
        pytest.skip(f"{spec.stem}: the AOT route (test_verify_names_a_lost_package_library)")
    tuned = sorted((dest / "inductor").rglob("*.best_config"))
    helpers = sorted((dest / "triton-home").rglob("cuda_utils*.so"))
    if not tuned or not helpers:
        pytest.skip(f"{spec.stem}: no .best_config ({len(tuned)}) or cuda_utils ({len(helpers)})")
    tuned[0].unlink()
    helpers[0].unlink()
    report = kiln.verify(
        served_spec(spec, server_folder(artifact, tmp_path)), dest, routes=("plain",)
    )
    lines = " ".join(report.reasons())
    record(spec.stem, {"lost": lines})
    assert not report.ok
    assert "native helper built with gcc" in lines, lines
    assert tuned[0].name in lines or "configs benchmarked" in lines, lines


def test_verify_names_a_lost_package_library(baked, tmp_path: Path) -> None:
    """The AOT route's counterpart (it has no kernel to re-tune or rebuild): a package library
    deleted after restore fails verify (exit 6), naming the library and the folder's drift."""
    spec, artifact = baked
    aoti = kiln.read_manifest(artifact).aoti
    if aoti is None:
        pytest.skip(f"{spec.stem}: the compile route (the test above)")
    dest = tmp_path / "lost" / "cache"
    kiln.restore(artifact, dest)
    where = f"{aoti.programs[0].path}/{aoti.programs[0].library}"
    (dest / where).unlink()
    with pytest.raises(VerificationError) as failed:
        kiln.verify(served_spec(spec, server_folder(artifact, tmp_path)), dest)
    record(spec.stem, {"lost": str(failed.value)})
    assert f"-{where}" in str(failed.value), failed.value
    assert f"AOTInductor package library {where} is missing" in str(failed.value), failed.value


def test_an_image_triton_cache_dir_moves_nothing(baked, tmp_path: Path) -> None:
    """``TRITON_CACHE_DIR`` set in the serving image (a common Dockerfile line): torch's
    ``triton_cache_dir`` prefers it to Inductor's own folder, so Triton's kernels, and the
    launchers Triton builds for them, would be looked up and built there. ``kiln.env`` unsets it:
    the user's first process does no work and writes nowhere. The control sets it again after
    ``kiln.env`` and records what the process then did (docs/first-process.md)."""
    spec, artifact = baked
    if kiln.read_manifest(artifact).aoti is not None:
        pytest.skip(f"{spec.stem}: the AOT route loads no Triton kernel through Triton")
    runs = {}
    for i, exported in enumerate((False, True)):
        dest = tmp_path / f"pod{i}" / "opt" / "kiln"
        kiln.restore(artifact, dest)
        moved = tmp_path / f"image-triton-cache{i}"
        setting = {"TRITON_CACHE_DIR": str(moved)}
        served = serve_like_a_user(
            spec,
            dest,
            tmp_path / f"run{i}",
            env=None if exported else setting,
            exports=setting if exported else None,
            cwd=server_folder(artifact, tmp_path),
        )
        runs[exported] = served, sorted(digest_tree(moved))
        record(
            spec.stem,
            {
                "triton_cache_dir": "after kiln.env" if exported else "image",
                **served.summary(),
                "moved": runs[exported][1],
            },
        )
        assert served.returncode == 0, served.stderr
    served, written = runs[False]
    assert served.work() == {} and served.benchmarks() == 0, served.summary()
    assert not served.dest and served.home == [] and written == [], served.summary()
