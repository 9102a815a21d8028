"""kiln.files: the one atomic write behind artifacts, pushed copies, --env-file and --ready-file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.artifact.restore import restore
from kiln.files import atomic_write
from tests.archives import good_archive


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_atomic_write_replaces_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "er" / "ready.json"
    with atomic_write(target) as fh:
        fh.write(b"one")
    assert target.read_bytes() == b"one"
    with pytest.raises(RuntimeError), atomic_write(target) as fh:
        fh.write(b"half of tw")
        raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"one"
    assert temps(target.parent) == []


def test_atomic_write_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "a") as fh:
            fh.write(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o640


def test_atomic_write_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """A link planted where an older kiln put its fixed-name temp file (``.NAME.tmp``) is neither
    followed nor moved into place: the temp name is random and opened with O_EXCL."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    env_file = tmp_path / "out" / "kiln.env"
    env_file.parent.mkdir()
    (env_file.parent / ".kiln.env.tmp").symlink_to(victim)
    art = good_archive(tmp_path / "a.kiln.tar.zst")
    restore(art, tmp_path / "cache", env_file=env_file)
    assert victim.read_bytes() == b"precious"
    assert not env_file.is_symlink()
    assert env_file.read_text() == (tmp_path / "cache" / "kiln.env").read_text()
