"""What a served process wrote: every file added or rewritten in the folders it must not touch.

A restored folder is served as found: a process that hits everything writes nothing into it (a
read-only mount must serve), nor builds helpers into ``$HOME`` or ``$TMPDIR`` that a new pod
would build again. So verify, bench and the bake's proof watch the served folder, the served
process's ``HOME`` and its ``TMPDIR`` (both private and empty, as in a new pod), and every file
that appears or changes there is compile work, named by what it is (:func:`kind_of`).

Files are compared by status first (size, mtime, inode) and, where that changed for a file the
manifest lists, by content against the manifest's sha256: a blob rewritten with the same bytes
is no change. Torch-free.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kiln.artifact.archive import sha256_file
from kiln.layout import CUDA_CACHE_DIR, CUDA_CACHE_INDEX

Stat = tuple[int, int, int]  # size, mtime_ns, inode

# Kinds of written file, and how a bucket's line words them (one, many).
LAUNCHER = "launcher"  # a native helper Triton or Inductor builds with gcc at run time
KERNEL = "kernel"  # a compiled kernel binary (C++ .so, Triton .cubin)
TUNING = "tuning"  # a kernel's tuning result (.best_config)
OTHER = "other"  # anything else: generated code, cache entries, locks
_LAUNCHER_MARKS = ("__triton_launcher", "cuda_utils", "hip_utils")


def in_driver_cache(name: str) -> bool:
    """Whether a written file is in a CUDA driver JIT cache kiln ships (``cuda-cache/``, a
    rank's included)."""
    return CUDA_CACHE_DIR in PurePosixPath(name).parts[:-1]


def driver_entry(name: str) -> bool:
    """Whether ``name`` is one of the CUDA driver's JIT cache entries (its ``index`` aside)."""
    return in_driver_cache(name) and PurePosixPath(name).name != CUDA_CACHE_INDEX


def driver_jit(written: Sequence[str]) -> int:
    """How many of ``written`` are the CUDA driver's JIT cache entries: PTX the driver compiled
    for this GPU because the shipped cache had no binary for it. cuDNN's runtime-compiled
    kernels (attention, fused convolutions) are the usual ones, keyed by the working directory
    too (kiln.workdir), so the line names the driver rather than a file hash a reader cannot
    place."""
    return sum(1 for n in written if driver_entry(n))


def kind_of(name: str) -> str:
    """What a written file is, from its name."""
    base = PurePosixPath(name).name
    if base.endswith(".gch") or (base.endswith(".so") and base.startswith(_LAUNCHER_MARKS)):
        return LAUNCHER
    if base.endswith((".so", ".cubin", ".hsaco")):
        return KERNEL
    if base.endswith(".best_config"):
        return TUNING
    return OTHER


@dataclass(frozen=True)
class Snapshot:
    """Every file under some labelled folders, by ``label/relative name``, with its status."""

    files: Mapping[str, Stat]

    @classmethod
    def of(cls, folders: Mapping[str, Path]) -> Snapshot:
        """Walked with ``os.scandir`` and plain strings: a served process takes one of these per
        bucket of a restored folder of thousands of files (2.5x faster than ``os.walk`` with a
        ``Path`` per file). A link is an entry of its own, never followed (a link to a folder
        too, which ``os.walk`` left out: a served process that makes one has written it)."""
        out: dict[str, Stat] = {}

        def walk(top: str, prefix: str) -> None:
            try:  # a folder removed while walking, or never there, holds nothing
                with os.scandir(top) as entries:
                    for entry in entries:
                        name = prefix + entry.name
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                walk(entry.path, name + "/")
                                continue
                            st = entry.stat(follow_symlinks=False)
                        except OSError:  # removed while walking
                            continue
                        out[name] = (st.st_size, st.st_mtime_ns, st.st_ino)
            except OSError:
                return

        for label, root in folders.items():
            walk(os.fspath(root), f"{label}/")
        return cls(out)


@dataclass(frozen=True)
class Watch:
    """The folders a served process must leave alone, and what the served one shipped.

    ``folders`` maps a label to a folder; ``shipped`` maps ``label/name`` to the sha256 the
    manifest lists for it (files restore installed), so a rewrite is judged by content.
    """

    folders: Mapping[str, Path]
    shipped: Mapping[str, str]

    def snapshot(self) -> Snapshot:
        return Snapshot.of(self.folders)

    def written(self, before: Snapshot, after: Snapshot) -> list[str]:
        """Files added, or changed in content, between two snapshots (sorted)."""
        out = []
        for name, stat in after.files.items():
            old = before.files.get(name)
            if old == stat:
                continue
            if old is not None and name in self.shipped and self._same(name, self.shipped[name]):
                continue
            out.append(name)
        return sorted(out)

    def _same(self, name: str, sha256: str) -> bool:
        label, _, rel = name.partition("/")
        try:
            return sha256_file(self.folders[label] / rel) == sha256
        except OSError:
            return False


def tally(written: Sequence[str]) -> Counter[str]:
    """How many written files of each kind (:func:`kind_of`); a kind none was is 0."""
    return Counter(map(kind_of, written))
