"""The artifact format: deterministic, manifest first, readable by plain tar, and torch-free."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.artifact.archive import read_manifest, write_artifact
from kiln.compiler.capture import cache_kind, capture, capture_aoti
from kiln.errors import IntegrityError, NotFoundError


def make_cache(root: Path) -> Path:
    cache = root / "inductor"
    for rel, data in {
        "fxgraph/ab/entry": b"fx" * 500,
        "aotautograd/cd/entry": b"aot",
        "xy/kernel.so": b"\x7fELF" + b"\0" * 300,
        "xy/kernel.cpp": b"int main(){}",
        "locks/xy.lock": b"",
        "xy/out.py.tmp.123": b"partial",
    }.items():
        p = cache / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "megacache.bin").write_bytes(b"blob")
    return cache


def test_capture_skips_locks_and_temp_and_classifies(tmp_path: Path) -> None:
    make_cache(tmp_path)
    home = tmp_path / "triton-home" / ".triton" / "cache" / "K"
    home.mkdir(parents=True)
    (home / "cuda_utils.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    entries = capture(tmp_path)
    paths = [e.path for e in entries]
    assert "megacache.bin" in paths
    # Triton's helpers built outside the root ship too (a pod would build them with gcc).
    helper = "triton-home/.triton/cache/K/cuda_utils.cpython-312-x86_64-linux-gnu.so"
    assert {e.path: e.kind for e in entries}[helper] == "triton"
    # So does the CUDA driver's JIT cache (a PTX-only library kernel, compiled at first load).
    jit = tmp_path / "cuda-cache" / "a" / "2"
    jit.mkdir(parents=True)
    (jit / "daf144f9da5951").write_bytes(b"sass")
    (tmp_path / "cuda-cache" / "index").write_bytes(b"index")
    kinds = {e.path: e.kind for e in capture(tmp_path)}
    assert kinds["cuda-cache/a/2/daf144f9da5951"] == kinds["cuda-cache/index"] == "driver"
    assert paths == sorted(paths)
    assert "inductor/locks/xy.lock" not in paths
    assert not any(".tmp" in p for p in paths)
    assert {e.path: e.kind for e in entries}["inductor/xy/kernel.so"] == "native"
    assert cache_kind("megacache.bin") == "megacache"
    assert cache_kind("inductor/fxgraph/x") == "fxgraph"


def test_an_aoti_capture_is_the_packages_and_the_drivers_jit_cache(tmp_path: Path) -> None:
    make_cache(tmp_path)  # an Inductor cache and a Mega-Cache blob: not the route's payload
    package = tmp_path / "aoti" / "batch1"
    package.mkdir(parents=True)
    (package / "model.so").write_bytes(b"\x7fELF")
    jit = tmp_path / "cuda-cache" / "5" / "2"
    jit.mkdir(parents=True)
    (jit / "52f4d0cc2b6e19").write_bytes(b"sass")
    kinds = {e.path: e.kind for e in capture_aoti(tmp_path)}
    assert kinds == {"aoti/batch1/model.so": "aoti", "cuda-cache/5/2/52f4d0cc2b6e19": "driver"}


def pack(tmp_path: Path, out: Path) -> tuple[str, int]:
    from tests.archives import manifest_for

    make_cache(tmp_path)
    entries = capture(tmp_path)
    manifest = manifest_for({})
    manifest.files = entries
    return write_artifact(out, manifest, tmp_path)


def test_packing_is_deterministic(tmp_path: Path) -> None:
    a = pack(tmp_path / "a", tmp_path / "a.kiln.tar.zst")
    b = pack(tmp_path / "b", tmp_path / "b.kiln.tar.zst")
    assert a == b
    assert (tmp_path / "a.kiln.tar.zst").read_bytes() == (tmp_path / "b.kiln.tar.zst").read_bytes()


@pytest.mark.skipif(shutil.which("zstd") is None, reason="plain tar needs the zstd program")
def test_plain_tar_reads_it_manifest_first(tmp_path: Path) -> None:
    out = tmp_path / "x.kiln.tar.zst"
    pack(tmp_path / "src", out)
    names = subprocess.run(
        ["tar", "--zstd", "-tvf", str(out)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert names[0].split()[-1] == "manifest.json"
    assert all(" root/root " in n or " 0/0 " in n for n in names), names[:2]


def test_read_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        read_manifest(tmp_path / "missing.kiln.tar.zst")
    junk = tmp_path / "junk.kiln.tar.zst"
    junk.write_bytes(b"not zstd at all")
    with pytest.raises(IntegrityError):
        read_manifest(junk)


def test_failed_pack_leaves_nothing(tmp_path: Path) -> None:
    from tests.archives import manifest_for

    cache = make_cache(tmp_path)
    manifest = manifest_for({})
    manifest.files = capture(tmp_path)
    (cache / "fxgraph/ab/entry").write_bytes(b"changed after capture")
    out = tmp_path / "out.kiln.tar.zst"
    out.write_bytes(b"previous artifact")
    with pytest.raises(IntegrityError, match="changed while packing"):
        write_artifact(out, manifest, tmp_path)
    assert out.read_bytes() == b"previous artifact"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
