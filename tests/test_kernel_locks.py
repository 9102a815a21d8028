"""Inductor's kernel lock files, left by one user, stop another's server (kiln.kernel_locks).

The image pattern: a root step serves the restored folder once (a warm-up, a check), Inductor
leaves a lock file per C++ kernel it loaded, root's, mode 0644, and the image's non-root
server then fails every such load with ``PermissionError``. kiln must say so before serving.
Acting as another user needs root; the non-root side runs in a forked child (which needs no
interpreter it could not reach), on a folder outside pytest's private temporary root. Run
without root, the suite meets the same refusal through lock files this user cannot write.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln.errors import IncompatibleError
from kiln.kernel_locks import foreign_locks, locks_factor
from kiln.layout import CacheLayout
from tests.first_process import serve_like_a_user

pytestmark = pytest.mark.slow
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user: needs root")
not_root = pytest.mark.skipif(os.geteuid() == 0, reason="root opens any file: run as a user")
NOBODY = 65534


def as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as ``uid``: its JSON-able result, or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            os.setgid(uid)
            os.setuid(uid)
            out: Any = {"result": fn()}
        except BaseException as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        with os.fdopen(write, "w") as pipe:
            json.dump(out, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        got = json.load(pipe)
    os.waitpid(pid, 0)
    return got


@pytest.fixture
def shared(baked) -> Iterator[tuple[Path, Path, Path]]:
    """The baked MLP restored where another user can read it, its lock link pointing at a
    folder of the test's (standing in for /tmp, which the test leaves as it found it)."""
    base = Path(tempfile.mkdtemp(prefix="kiln-locks-", dir="/tmp"))
    try:
        base.chmod(0o755)
        spec, result = baked
        dest = base / "cache"
        kiln.restore(result.artifact, dest)
        locks = base / "locks"
        locks.mkdir(mode=0o755)
        (dest / "inductor" / "locks").unlink()
        (dest / "inductor" / "locks").symlink_to(locks, target_is_directory=True)
        yield spec, dest, locks
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def served_once(shared: tuple[Path, Path, Path], tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """The shared folder served once by this user, as a build step would: Inductor leaves a
    lock per kernel it loaded, this user's, which this user opens. (folder, locks, the locks)"""
    spec, dest, locks = shared
    served = serve_like_a_user(spec, dest, tmp_path / "first-run")
    assert served.returncode == 0, served.stderr
    left = sorted(locks.iterdir())
    kernels = {c.name.split(".")[0] + ".lock" for c in (dest / "inductor").glob("*/*.cpp")}
    assert left and {p.name for p in left} <= kernels
    assert foreign_locks(CacheLayout(dest)) == []
    return dest, locks, left


@as_root
def test_another_users_kernel_locks_are_named_before_serving(
    served_once: tuple[Path, Path, list[Path]],
) -> None:
    dest, locks, paths = served_once
    left = [p.name for p in paths]
    assert all(p.stat().st_uid == 0 for p in paths)  # a root step's: root's
    # Another program's files in the link's target (/tmp) are not the folder's kernels.
    for name in ("zz_unrelated.cpp", "zz_unrelated.lock"):
        (locks / name).write_text("")

    def as_server() -> dict[str, Any]:
        found = [p.name for p in foreign_locks(CacheLayout(dest))]
        factor = locks_factor(CacheLayout(dest))  # kiln check's row: a miss, exit 5
        row = None if factor is None else [factor.name, factor.causes_miss, factor.here]
        try:
            kiln.activate(dest, compat="ignore")
        except IncompatibleError as exc:
            return {"found": found, "check": row, "activate": str(exc)}
        return {"found": found, "check": row, "activate": None}

    got = as_user(NOBODY, as_server)
    assert "error" not in got, got
    assert got["result"]["found"] == left
    said = got["result"]["activate"]
    assert said is not None
    assert said.startswith(f"{dest}: process.locks: Inductor's kernel lock files this user")
    assert f"(uid {NOBODY}) cannot open: {len(left)}, e.g. {locks / left[0]} (uid 0's)" in said
    assert "serve the folder as the user that left them, or have that user remove them" in said
    assert got["result"]["check"] == [
        "process.locks",
        True,
        f"another user's: {len(left)}, e.g. {locks / left[0]} (uid 0's)",
    ]


@not_root
def test_kernel_locks_this_user_cannot_write_are_named_before_serving(
    served_once: tuple[Path, Path, list[Path]],
) -> None:
    dest, _, left = served_once
    for lock in left:  # what another user's 0644 file is to this one: not writable
        lock.chmod(0o444)
    assert foreign_locks(CacheLayout(dest)) == left
    factor = locks_factor(CacheLayout(dest))
    assert factor is not None and factor.causes_miss
    with pytest.raises(IncompatibleError, match=r"process\.locks: Inductor's kernel lock files"):
        kiln.activate(dest, compat="ignore")
    for lock in left:
        lock.chmod(0o644)
    assert foreign_locks(CacheLayout(dest)) == [] and locks_factor(CacheLayout(dest)) is None
