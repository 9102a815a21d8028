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


def _restored(mount: Path, rank: int | None = None) -> Path:
    """A folder as restore leaves one with a driver cache (the rest of it does not matter
    here), then the mount remounted read-only."""
    dest = mount / "cache"
    cache = CacheLayout(dest, rank).cuda_cache
    (cache / "sm90").mkdir(parents=True)
    (cache / "index").write_bytes(b"index")
    (cache / "sm90" / "entry").write_bytes(ENTRY)
    (cache / "sm90" / "entry").chmod(0o444)
    world = None if rank is None else 2
    (dest / "kiln.env").write_text(env_file_text(dest, "m", {}, world))
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    return dest


def _source(dest: Path, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-euc", f'. "{dest}/kiln.env"; printf %s "$CUDA_CACHE_PATH"'],
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
    assert copy.name.startswith(f"kiln-cuda-cache-{os.getuid()}-")
    assert "is read-only" in first.stderr and str(copy) in first.stderr
    assert digest_tree(copy) == digest_tree(dest / "cuda-cache")
    assert copy.stat().st_mode & 0o777 == 0o700
    assert os.access(copy / "sm90" / "entry", os.W_OK)  # the driver may rewrite what it keeps
    # activate()'s side: the same copy, reused as it is (a second process copies nothing).
    (copy / "sm90" / "new").write_bytes(b"added by the driver in the first process")
    monkeypatch.setenv("TMPDIR", str(tmp))
    path, note = served_cuda_cache(dest, None)
    assert path == copy and note is not None and str(copy) in note
    assert (copy / "sm90" / "new").exists()
    assert Path(_source(dest, tmp).stdout) == copy


def test_a_rank_copies_its_own_folder(read_only_mount: Path, tmp_path: Path) -> None:
    dest = _restored(read_only_mount, rank=1)
    copy = Path(_source(dest, tmp_path, RANK="1").stdout)
    assert copy.name.endswith("-r1")
    assert (copy / "sm90" / "entry").read_bytes() == ENTRY
    assert served_cuda_cache(dest, 1, {"TMPDIR": str(tmp_path)})[0] == copy


def test_a_planted_link_at_the_copy_is_never_used(read_only_mount: Path, tmp_path: Path) -> None:
    """Another user who guesses the name and plants a link to their own folder of kernels
    gets nothing loaded from it: the driver compiles without a cache instead, and both say so."""
    dest = _restored(read_only_mount)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    cuda_cache_copy(dest, None, {"TMPDIR": str(tmp_path)}).symlink_to(theirs)
    sourced = _source(dest, tmp_path)
    assert sourced.stdout == str(dest / "cuda-cache")
    assert "no copy of it could be made" in sourced.stderr
    path, note = served_cuda_cache(dest, None, {"TMPDIR": str(tmp_path)})
    assert path == dest / "cuda-cache" and note is not None and "not this user's" in note
    assert list(theirs.iterdir()) == []


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


def test_a_copy_that_fails_is_removed_and_said(read_only_mount: Path, tmp_path: Path) -> None:
    """activate()'s copy stops at a file it cannot copy (a named pipe): no half copy is left
    to be served next time, and the note says why the driver goes without its cache."""
    cache = read_only_mount / "cache" / "cuda-cache"
    cache.mkdir(parents=True)
    os.mkfifo(cache / "pipe")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    path, note = served_cuda_cache(cache.parent, None, {"TMPDIR": str(tmp)})
    assert path == cache and note is not None and "copying it failed" in note
    assert list(tmp.iterdir()) == []
