"""Has an installed folder changed since restore wrote it? Torch-free.

A repeat restore of the installed digest is a no-op, which is only right while DEST still holds
what was installed: a file edited, added or deleted there (by hand, by a process that writes
into the cache) must be noticed and the artifact installed again. Checking must stay cheap,
because a no-op restore runs at every pod start: one ``lstat`` per file, and only files whose
size differs from the manifest's, or whose inode changed (``st_ctime``, which no user can set
back) after the install was stamped, are read and hashed; and ``kiln.env`` is compared with
what this kiln writes for DEST's path (:func:`env_drift`).
"""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.artifact.archive import sha256_file
from kiln.artifact.manifest import FileEntry, Manifest
from kiln.layout import ENV_NAME, LOCKS_TARGET, RESERVED_NAMES, CacheLayout, lock_links
from kiln.serving import CACHE_DIR_VAR, env_file_text


@dataclass(frozen=True)
class Changes:
    """What differs between DEST and the manifest it was installed from (posix paths)."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)

    def describe(self) -> str:
        """``3 files added, 1 changed, 0 removed``."""
        return (
            f"{len(self.added)} file{'s' if len(self.added) != 1 else ''} added, "
            f"{len(self.changed)} changed, {len(self.removed)} removed"
        )


def stamp(folder: Path, manifest: Manifest) -> int:
    """The newest inode change among the manifest's files in ``folder`` (ns): recorded at
    install, after which a file whose ``st_ctime`` is later has been touched since."""
    newest = 0
    for entry in manifest.entries():
        newest = max(newest, os.lstat(folder / entry.path).st_ctime_ns)
    return newest


def changes(
    dest: Path,
    manifest: Manifest,
    stamp_ns: int | None,
    relocated: Iterable[FileEntry] = (),
) -> Changes:
    """How ``dest`` differs from ``manifest``. Besides the manifest's files, DEST holds only
    restore's own (manifest, env file, state, the lock links to :data:`LOCKS_TARGET`); any
    other file is an addition. ``stamp_ns`` None (an install by an older kiln): sizes only.
    ``relocated``: the files restore rewrote for DEST (:mod:`kiln.artifact.relocate`), judged
    by what restore wrote rather than by the manifest."""
    expected = {entry.path: entry for entry in manifest.entries()}
    expected.update((entry.path, entry) for entry in relocated if entry.path in expected)
    own = RESERVED_NAMES
    links = set(lock_links(manifest.rank_world))
    added: list[str] = []
    changed: list[str] = []
    seen: set[str] = set()
    for root, dirs, files in os.walk(dest):
        for name in (*dirs, *files):
            full = Path(root, name)
            rel = full.relative_to(dest).as_posix()
            try:
                st = full.lstat()
            except FileNotFoundError:
                continue  # gone since the walk listed it: counted as removed below
            entry = expected.get(rel)
            if entry is None:
                lock_link = rel in links and stat.S_ISLNK(st.st_mode)
                if rel in own or stat.S_ISDIR(st.st_mode):
                    continue
                if not (lock_link and str(full.readlink()) == LOCKS_TARGET):
                    added.append(rel)
                continue
            seen.add(rel)
            touched = stamp_ns is not None and st.st_ctime_ns > stamp_ns
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_size != entry.size
                or (touched and sha256_file(full) != entry.sha256)
            ):
                changed.append(rel)
    removed = sorted(set(expected) - seen)
    env = env_drift(dest, manifest)
    if env is not None:
        (changed if env else removed).append(ENV_NAME)
    return Changes(sorted(added), sorted(changed), sorted(removed))


def kiln_env(dest: Path, manifest: Manifest) -> str:
    """The ``kiln.env`` restore writes for ``manifest`` installed at ``dest``; what
    :func:`env_drift` compares the folder's with, so both come from here."""
    keyed_by = manifest.workdir.path if manifest.workdir else None
    return env_file_text(
        Path(dest).absolute(), manifest.name, manifest.env, manifest.rank_world, keyed_by
    )


_ENV_LIMIT = 1 << 16  # bytes of a kiln.env read to find where it was written: a few lines


def env_folder(dest: Path, manifest: Manifest) -> str | None:
    """The other folder ``dest``'s ``kiln.env`` was written for, where it is exactly the file
    restore writes for ``manifest`` at that path: the folder moved, copied or mounted at
    another path, rather than the file edited. None otherwise (and for a file that is no
    regular one, or larger than restore's could be for that path)."""
    try:
        fd = os.open(CacheLayout(dest).env_file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = fh.read(_ENV_LIMIT + 1).decode(errors="replace")
    prefix = f"export {CACHE_DIR_VAR}="
    line = next((ln for ln in text.splitlines() if ln.startswith(prefix)), None)
    try:
        named = shlex.split(line.removeprefix(prefix))[0] if line else None
    except (ValueError, IndexError):
        return None
    if named is None or not named.isprintable() or not Path(named).is_absolute():
        return None
    if len(text) > _ENV_LIMIT or text != kiln_env(Path(named), manifest):
        return None
    try:
        if Path(named).samefile(dest):  # the same folder by another spelling or a link
            return None
    except OSError:
        pass  # gone where it was restored: moved
    return named


def env_drift(dest: Path, manifest: Manifest) -> bool | None:
    """Whether ``dest``'s ``kiln.env`` differs from what this kiln writes for it (True), is
    missing (False), or is as written (None). It names the absolute path DEST was restored at
    and what a served process must set and unset (:func:`kiln.serving.env_file_text`): a
    folder moved or copied elsewhere, a file edited, or one an older kiln wrote no longer
    serves as this kiln's would, and installing again writes it anew."""
    want = kiln_env(dest, manifest).encode()
    try:
        with open(CacheLayout(dest).env_file, "rb") as fh:
            have = fh.read(len(want) + 1)  # one byte more: a longer file differs
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return None if have == want else True
