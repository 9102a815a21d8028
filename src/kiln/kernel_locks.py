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
from pathlib import Path

from kiln.factors import Factor
from kiln.layout import LOCKS_DIR

FACTOR = "process.locks"


def foreign_locks(inductor: Path) -> list[Path]:
    """The lock files of ``inductor``'s C++ kernels (``XX/KEY[.main].cpp``, locked as
    ``locks/KEY.lock``) that this process cannot open for writing, as Inductor opens them;
    where they are (through restore's link: in ``/tmp``), to remove them by."""
    locks = inductor / LOCKS_DIR
    if not locks.is_dir():
        return []
    found = set()
    for source in inductor.glob("*/*.cpp"):
        lock = locks / f"{source.name.split('.', 1)[0]}.lock"
        if lock.is_file() and not os.access(lock, os.R_OK | os.W_OK):
            found.add(lock.resolve())
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
        f"Inductor's kernel lock files this user (uid {os.geteuid()}) cannot open: "
        f"{_whose(found)}; loading those C++ kernels fails with PermissionError: serve the "
        "folder as the user that left them, or remove them"
    )


def locks_factor(inductor: Path | None) -> Factor | None:
    """:func:`foreign_locks` as a factor that fails ``kiln check`` (None: none, or no folder)."""
    found = foreign_locks(inductor) if inductor is not None else []
    if not found:
        return None
    note = (
        "Inductor leaves each C++ kernel's lock file in /tmp as its first loader's; another "
        "user's cannot be opened, and the load fails: serve as that user, or remove them"
    )
    return Factor(FACTOR, "this user's", f"another user's: {_whose(found)}", False, True, note)
