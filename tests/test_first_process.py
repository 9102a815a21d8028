"""The first process after a restore compiles, tunes, builds and writes nothing, and kiln sees
everything it would (issue 25). Real CPU bakes, real restores, a server written like a user's
(tests/user_server.py: `. kiln.env`, plain torch.compile, no kiln import)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import kiln
from tests.conftest import bake_once, mlp_spec
from tests.first_process import digest_tree, serve_like_a_user

# What these processes build is the subject: Inductor's ISA probes are real here.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("real_isa_probes")]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A shared bake of the 3-bucket MLP with the ISA probes real (the session's ``baked`` trusts
    the CPU's flags, which is in Inductor's cache key): read only here (each test restores it into
    a folder of its own, so no test sees another's state)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
        spec, result = bake_once(tmp_path_factory, "baked-real-isa", mlp_spec())
    assert result.manifest.proof is not None and result.manifest.proof.compiles == 0
    return spec, result.artifact


def test_a_user_server_is_the_first_process_and_does_no_compile_work(artifact, tmp_path) -> None:
    """Three orders, each the first process on a fresh restore at a new path, with an empty
    HOME and TMPDIR: no miss, no tuning, nothing built, nothing written anywhere it looks."""
    spec, art = artifact
    for i, order in enumerate(("grid", "reverse", "shuffle")):
        dest = tmp_path / f"pod{i}" / "cache"
        kiln.restore(art, dest)
        served = serve_like_a_user(spec, dest, tmp_path / f"run{i}", order=order, seed=i)
        assert served.returncode == 0, served.stderr
        assert len(served.buckets) == 3
        assert served.work() == {}, (order, served.summary())
        assert not served.dest, (order, served.summary())
        assert served.home == [] and served.tmp == [], (order, served.summary())


def test_a_read_only_restored_folder_serves(artifact, read_only_mount, tmp_path) -> None:
    spec, art = artifact
    dest = read_only_mount / "cache"
    kiln.restore(art, dest)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    with pytest.raises(OSError):
        (dest / "probe").write_text("x")
    served = serve_like_a_user(spec, dest, tmp_path / "run", order="reverse")
    assert served.returncode == 0, served.stderr
    assert served.work() == {} and served.home == [] and served.tmp == [], served.summary()


def test_the_aot_route_serves_a_read_only_folder_without_dynamo_or_inductor(
    aoti_baked, read_only_mount, tmp_path
) -> None:
    """The AOT route (issue 26) served as the README serves it, ``kiln.activate(DIR)
    .compile(model)``, as the first process on a fresh restore in a read-only mount: every
    call served by a package, neither Dynamo nor Inductor imported, nothing written."""
    spec, restored, manifest = aoti_baked
    dest = read_only_mount / "cache"
    kiln.restore(restored.parent / f"{manifest.name}.kiln.tar.zst", dest)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    served = serve_like_a_user(spec, dest, tmp_path / "run", order="reverse")
    assert served.returncode == 0, served.stderr
    assert [b["key"] for b in served.buckets] == ["batch=3", "batch=2"]
    assert served.aoti_misses == 0 and served.work() == {}, served.summary()
    assert served.compiler_modules == [], served.summary()
    assert not served.dest and served.home == [] and served.tmp == [], served.summary()


def test_verify_names_a_kernel_the_folder_lost_and_leaves_the_folder_as_found(
    artifact, tmp_path, cli
) -> None:
    """A C++ kernel deleted after restore: both routes rebuild it (exit 6, named), verify
    writes nothing into the folder, and a second verify fails the same way."""
    spec, art = artifact
    dest = tmp_path / "cache"
    kiln.restore(art, dest)
    kernel = next(p for p in sorted((dest / "inductor").rglob("*.so")) if "triton" not in p.parts)
    kernel.unlink()
    found = digest_tree(dest)
    # Both routes, then one again (each rebuilds the kernel in a process of its own).
    for route, routes in (("both", ["plain", "activate"]), ("plain", ["plain"])):
        proc = cli("verify", spec, "--cache", dest, "--json", "--route", route)
        assert proc.returncode == 6, proc.stderr
        report = json.loads(proc.stdout)
        assert report["routes"] == routes
        assert any("kernel binar" in line for line in report["failing"]), report["failing"]
        assert any(
            f"-inductor/{kernel.relative_to(dest / 'inductor')}" in c
            for c in report["folder_changes"]
        )
        assert digest_tree(dest) == found


def test_a_lost_or_damaged_package_library_is_named_by_verify_and_by_the_server(
    aoti_baked, tmp_path, cli
) -> None:
    """The AOT route has no kernel to rebuild: a package library deleted or truncated after
    restore makes verify exit 6 naming it and the folder's drift (torch's dlopen traceback
    before; a SIGBUS of the worker for a truncated one, which dlopen maps past its end), and a
    damaged one stops the user's server (kiln.activate(DIR).compile) with one line naming it."""
    spec, restored, manifest = aoti_baked
    art = restored.parent / f"{manifest.name}.kiln.tar.zst"
    assert manifest.aoti is not None
    program = manifest.aoti.programs[0]
    where = f"{program.path}/{program.library}"
    dest = tmp_path / "lost" / "cache"
    kiln.restore(art, dest)
    (dest / where).unlink()
    found = digest_tree(dest)
    proc = cli("verify", spec, "--cache", dest, "--json")
    assert proc.returncode == 6, proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert f"-{where}" in error and f"AOTInductor package library {where} is missing" in error
    assert "Traceback" not in proc.stderr
    assert digest_tree(dest) == found

    dest = tmp_path / "truncated" / "cache"
    kiln.restore(art, dest)
    size = (dest / where).stat().st_size
    assert {f.path: f.size for f in manifest.files}[where] == size
    with open(dest / where, "r+b") as library:
        library.truncate(size // 2)
    proc = cli("verify", spec, "--cache", dest, "--json")
    assert proc.returncode == 6, proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert f"AOTInductor package library {where} is {size // 2} bytes, the bake's was {size}" in (
        error
    )
    assert f"~{where}" in error and "Traceback" not in proc.stderr

    dest = tmp_path / "damaged" / "cache"
    kiln.restore(art, dest)
    (dest / where).write_bytes(b"not an ELF file".ljust(size, b"\0"))  # the size it should be
    served = serve_like_a_user(spec, dest, tmp_path / "run")
    assert served.returncode != 0
    assert f"PackageLoadError: AOTInductor package library {where} does not load (" in (
        served.stderr
    ), served.stderr
    assert served.stderr.rstrip().endswith("restore the artifact again"), served.stderr


def test_verify_of_a_bucket_never_baked_fails_and_stays_failed(artifact, tmp_path, cli) -> None:
    """Issue 25 item 5: the bucket compiles in verify (exit 6), but into a private copy, so the
    next verify fails again and restore still finds the folder it installed."""
    from tests.conftest import mlp_spec

    _, art = artifact
    dest = tmp_path / "cache"
    kiln.restore(art, dest)
    wider = tmp_path / "wider.yaml"
    wider.write_text(mlp_spec(buckets="batch: [2, 3, 5, 7]"))
    found = digest_tree(dest)
    for _ in range(2):
        proc = cli("verify", wider, "--cache", dest, "--route", "plain", "--json")
        assert proc.returncode == 6, proc.stderr
        failing = json.loads(proc.stdout)["failing"]
        assert len(failing) == 1 and failing[0].startswith("batch=7"), failing
        assert digest_tree(dest) == found


def test_verify_names_a_folder_a_server_wrote_into(artifact, tmp_path, cli) -> None:
    spec, art = artifact
    dest = tmp_path / "cache"
    kiln.restore(art, dest)
    (dest / "inductor" / "zz").mkdir()
    (dest / "inductor" / "zz" / "stray.py").write_text("# written by a server")
    proc = cli("verify", spec, "--cache", dest, "--route", "plain", "--json")
    assert proc.returncode == 6
    report = json.loads(proc.stdout)
    assert report["folder_changes"] == ["+inductor/zz/stray.py"]
    assert "changed since it was restored" in report["failing"][0]


def test_restore_links_the_lock_folder_out_of_the_restored_tree(artifact, tmp_path) -> None:
    _, art = artifact
    dest = tmp_path / "cache"
    kiln.restore(art, dest)
    locks = dest / "inductor" / "locks"
    assert locks.is_symlink() and str(locks.readlink()) == "/tmp"
    shutil.rmtree(dest)
