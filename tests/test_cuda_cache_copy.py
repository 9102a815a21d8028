"""The CUDA driver's JIT cache on a read-only restored folder (kiln.serving.CUDA_COPY_PREFIX).

The driver keeps its JIT cache only where it can write, so a read-only DEST serves it from a
private copy in ``$TMPDIR``. kiln.env (sourced by ``sh``) and ``activate()``'s
:func:`~kiln.serving.served_cuda_cache` follow one rule; here both run on a real read-only mount
and must agree: same copy, same bytes, made once, and never a folder this user does not own.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kiln.layout import CacheLayout
from kiln.serving import cuda_cache_copy, env_file_text, served_cuda_cache
from tests.first_process import digest_tree

ENTRY = b"\x7fELF a cubin the driver JIT-compiled at the bake"


def _restored(mount: Path, rank: int | None = None, files: int = 0) -> Path:
    """A folder as restore leaves one with a driver cache (the rest of it does not matter
    here; ``files`` more entries for a copy that takes a while), then the mount remounted
    read-only."""
    dest = mount / "cache"
    cache = CacheLayout(dest, rank).cuda_cache
    (cache / "sm90").mkdir(parents=True)
    (cache / "index").write_bytes(b"index")
    (cache / "sm90" / "entry").write_bytes(ENTRY)
    (cache / "sm90" / "entry").chmod(0o444)
    for i in range(files):
        (cache / "sm90" / f"more{i}").write_bytes(ENTRY * 8)
    world = None if rank is None else 2
    (dest / "kiln.env").write_text(env_file_text(dest, "m", {}, world))
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    return dest


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _sh(dest: Path, then: str = "") -> list[str]:
    """Source ``dest``'s kiln.env under ``set -eu`` as a server's start script does, then print
    ``CUDA_CACHE_PATH`` and run ``then``."""
    return ["/bin/sh", "-euc", f'. "{dest}/kiln.env"; printf %s "$CUDA_CACHE_PATH"{then}']


def _source(dest: Path, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _sh(dest),
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp), **env},
        capture_output=True,
        text=True,
        check=True,
    )


def test_a_read_only_folder_serves_the_driver_cache_from_one_private_copy(
    read_only_mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = _restored(read_only_mount)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    first = _source(dest, tmp)
    copy = Path(first.stdout)
    assert copy == cuda_cache_copy(dest, None, {"TMPDIR": str(tmp)})
    assert copy.name.startswith(f"kiln-cuda-cache-{os.geteuid()}-")
    assert "is read-only" in first.stderr and str(copy) in first.stderr
    assert digest_tree(copy) == digest_tree(dest / "cuda-cache")
    assert _names(tmp) == [copy.name]  # the part it was made in is gone
    assert copy.stat().st_mode & 0o777 == 0o700
    # The driver may rewrite what it keeps (mode bits: root's access() says yes to anything).
    assert (copy / "sm90" / "entry").stat().st_mode & 0o200
    # activate()'s side: the same copy, reused as it is (a second process copies nothing).
    (copy / "sm90" / "new").write_bytes(b"added by the driver in the first process")
    monkeypatch.setenv("TMPDIR", str(tmp))
    path, note = served_cuda_cache(dest, None)
    assert path == copy and note is not None and str(copy) in note
    assert (copy / "sm90" / "new").exists()
    assert Path(_source(dest, tmp).stdout) == copy


def test_activate_makes_the_copy_kiln_env_would(read_only_mount: Path, tmp_path: Path) -> None:
    dest = _restored(read_only_mount)
    path, note = served_cuda_cache(dest, None, {"TMPDIR": str(tmp_path)})
    assert path == cuda_cache_copy(dest, None, {"TMPDIR": str(tmp_path)}) and note is not None
    assert digest_tree(path) == digest_tree(dest / "cuda-cache")
    assert (path / "sm90" / "entry").stat().st_mode & 0o777 == 0o600
    assert Path(_source(dest, tmp_path).stdout) == path


def test_a_rank_copies_its_own_folder(read_only_mount: Path, tmp_path: Path) -> None:
    dest = _restored(read_only_mount, rank=1)
    copy = Path(_source(dest, tmp_path, LOCAL_RANK="1").stdout)
    assert copy.name.endswith("-r1")
    assert (copy / "sm90" / "entry").read_bytes() == ENTRY
    assert served_cuda_cache(dest, 1, {"TMPDIR": str(tmp_path)})[0] == copy


def test_processes_sourcing_at_once_each_see_a_whole_copy(
    read_only_mount: Path, tmp_path: Path
) -> None:
    """Four servers starting together: whichever copies, none serves half a copy (each copy is
    renamed into place whole) and one copy is left."""
    dest = _restored(read_only_mount, files=400)
    count = '; find "$CUDA_CACHE_PATH" -type f | wc -l'
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            _sh(dest, count),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    copy = cuda_cache_copy(dest, None, env)
    assert outs == [f"{copy}402\n"] * 4, outs
    assert _names(tmp_path) == sorted(["ro", copy.name])


def test_a_copy_at_the_path_that_is_not_ours_is_never_used(
    read_only_mount: Path, tmp_path: Path
) -> None:
    """Another user who guesses the name and plants a folder of kernels there, or a link to
    one, gets nothing loaded from it: the driver compiles without a cache instead, and both
    kiln.env and activate() say so."""
    dest = _restored(read_only_mount)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    planted = cuda_cache_copy(dest, None, {"TMPDIR": str(tmp_path)})
    for plant in ("link", "folder"):
        if plant == "link":
            planted.symlink_to(theirs)
        else:
            planted.unlink()
            planted.mkdir(mode=0o700)
            os.chown(planted, 65534, 65534)
        sourced = _source(dest, tmp_path)
        assert sourced.stdout == str(dest / "cuda-cache"), plant
        assert "no copy of it could be made" in sourced.stderr
        path, note = served_cuda_cache(dest, None, {"TMPDIR": str(tmp_path)})
        assert path == dest / "cuda-cache" and note is not None and "not this user's" in note
        assert list(theirs.iterdir()) == [] and list(planted.iterdir()) == []


def test_a_copy_that_fails_is_not_left_half_made(read_only_mount: Path, tmp_path: Path) -> None:
    """A TMPDIR too small for the cache: neither kiln.env nor activate() leaves a half copy to
    be served next time, and both say the driver goes without its cache."""
    dest = _restored(read_only_mount, files=64)  # ~25 KB, in a 16 KB TMPDIR
    tmp = tmp_path / "small"
    tmp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(tmp)], check=True)
    try:
        sourced = _source(dest, tmp)
        assert sourced.stdout == str(dest / "cuda-cache")
        assert "no copy of it could be made" in sourced.stderr
        assert _names(tmp) == []
        path, note = served_cuda_cache(dest, None, {"TMPDIR": str(tmp)})
        assert path == dest / "cuda-cache" and note is not None and "copying it failed" in note
        assert _names(tmp) == []
    finally:
        subprocess.run(["umount", "-l", str(tmp)], check=False)


def test_a_writable_folder_serves_its_own_cache(tmp_path: Path) -> None:
    dest = tmp_path / "cache"
    (dest / "cuda-cache").mkdir(parents=True)
    (dest / "kiln.env").write_text(env_file_text(dest, "m", {}))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    sourced = _source(dest, tmp)
    assert sourced.stdout == str(dest / "cuda-cache") and sourced.stderr == ""
    assert served_cuda_cache(dest, None, {"TMPDIR": str(tmp)}) == (dest / "cuda-cache", None)
    assert list(tmp.iterdir()) == []


def test_kiln_env_without_id_or_mktemp_still_serves(read_only_mount: Path, tmp_path: Path) -> None:
    """Sourced under ``set -eu`` in an image whose PATH lacks the tools the copy needs: the
    server still starts, on DEST's own (unused) cache, and is told why."""
    dest = _restored(read_only_mount)
    sourced = _source(dest, tmp_path, PATH="/nonexistent")
    assert sourced.stdout == str(dest / "cuda-cache")
    assert "no copy of it could be made" in sourced.stderr
