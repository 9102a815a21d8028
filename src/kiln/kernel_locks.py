"""Inductor's per-kernel lock files, as the serving user meets them. Torch-free.

Inductor takes a file lock for every C++ kernel it loads, hit or not, and for its CPU-ISA
probe, in ``CACHE/locks``, and leaves the file there, its first loader's, mode 0644. Restore
links that folder to the shared ``/tmp`` (:data:`kiln.layout.LOCKS_DIR` says why), so a lock
left by one user stops another's load: a root step in an image's build that served the
folder, then ``USER 1000``, and every CPU kernel load of the server fails with
``PermissionError`` (seen on the CPU, 2026-12-07: the ISA probe's lock alone, the same for
every model of one torch build, stopped every non-root server). kiln's own verify and replay
serve copies whose locks are their own (:func:`kiln.compiler.verify.private_copy`); these
functions find such files before a server does, for ``kiln check``, ``kiln verify`` and
``kiln.activate()``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kiln.factors import Factor
from kiln.layout import LOCKS_DIR, CacheLayout

FACTOR = "process.locks"


def foreign_locks(layout: CacheLayout) -> list[Path]:
    """The lock files of the layout's C++ kernels (``inductor/XX/KEY[.main].cpp``, locked as
    ``inductor/locks/KEY.lock``) that this process cannot open as Inductor does (read-write,
    not through a link), where they are (through restore's link: in ``/tmp``). Only the
    kernels' own folders are read, never the link's target."""
    if not layout.locks.is_dir():
        return []
    where = layout.locks.resolve()
    found = set()
    for folder in os.scandir(layout.inductor):
        if folder.name == LOCKS_DIR or not folder.is_dir(follow_symlinks=False):
            continue
        for source in os.scandir(folder.path):
            if not source.name.endswith(".cpp"):
                continue
            lock = where / f"{source.name.split('.', 1)[0]}.lock"
            try:
                st = lock.lstat()
            except OSError:
                continue  # none yet: the first load makes it, this user's
            usable = stat.S_ISREG(st.st_mode) and os.access(
                lock, os.R_OK | os.W_OK, effective_ids=os.access in os.supports_effective_ids
            )
            if not usable:
                found.add(lock)
    return sorted(found)


def _whose(found: list[Path]) -> str:
    """``N, e.g. PATH (uid U's)``: how many of ``found`` and the first one's owner."""
    try:
        owner = f"uid {found[0].stat().st_uid}'s"
    except OSError:
        owner = "another user's"
    return f"{len(found)}, e.g. {found[0]} ({owner})"


def describe(found: list[Path]) -> str:
    """One line on ``found`` (:func:`foreign_locks`, not empty): how many, whose, what to do."""
    return (
        f"{FACTOR}: Inductor's kernel lock files this user (uid {os.geteuid()}) cannot open: "
        f"{_whose(found)}; loading those C++ kernels fails with PermissionError: serve the "
        "folder as the user that left them, or have that user remove them"
    )


def locks_factor(layout: CacheLayout | None) -> Factor | None:
    """:func:`foreign_locks` as a factor that fails ``kiln check`` (None: none, or no folder)."""
    found = foreign_locks(layout) if layout is not None else []
    if not found:
        return None
    note = (
        "Inductor leaves each C++ kernel's lock file in /tmp as its first loader's; another "
        "user's cannot be opened, and the load fails: serve as that user, or have that user "
        "remove them"
    )
    return Factor(FACTOR, "this user's", f"another user's: {_whose(found)}", False, True, note)
