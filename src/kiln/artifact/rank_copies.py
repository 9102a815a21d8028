"""Which files of a K-rank artifact are stored and which are copies (torch-free).

A bake (:mod:`kiln.compiler.bake`) and ``kiln merge`` (:mod:`kiln.artifact.merge`) both end
with every rank's files under ``ranks/R/`` and must decide the same way what the archive
stores once: merge runs in the torch-free restore image, so the rule lives here, in the
artifact world.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.artifact.manifest import CopyEntry, FileEntry
from kiln.artifact.payload import payload_lines
from kiln.layout import CacheLayout


@dataclass(frozen=True)
class Stored:
    """What a K-rank artifact stores: the files, the copies restore makes, and for each rank
    rank 0 when its folder is rank 0's whole cache (equal keys), else None."""

    files: list[FileEntry]
    copies: list[CopyEntry]
    same_as: list[int | None]


def store_once(files_by_rank: list[list[FileEntry]]) -> Stored:
    """Every rank's files (paths under ``ranks/R/``): which to store, which to copy.

    Two levels. A rank whose cache has exactly rank 0's keys (:func:`same_compile`: every FX and
    AOT key, every generated file's bytes) gets rank 0's whole folder as copies: its own entries
    differ only in torch's measured timings and the cache path compiled into native objects, and
    a lookup by key finds rank 0's entry just as well (on the CPU every rank compiles the same
    graphs; on CUDA the device index cuda:R is in the keys, so ranks differ). Otherwise each of
    its files whose bytes equal a file already stored is a copy of that one, and the rest are
    stored.
    """
    stored: list[FileEntry] = []
    copies: list[CopyEntry] = []
    same_as: list[int | None] = []
    first: dict[tuple[str, int], str] = {}
    for rank, files in enumerate(files_by_rank):
        if rank > 0 and same_compile(files_by_rank[0], files):
            prefix = CacheLayout(rank=rank).prefix
            for entry in files_by_rank[0]:
                path = prefix + entry.path.split("/", 2)[2]
                # Rank 0's file may itself be a copy (two of its files with equal bytes):
                # a copy's source is always a stored file, the first with those bytes.
                source = first[(entry.sha256, entry.size)]
                copies.append(CopyEntry(path=path, source=source))
            same_as.append(0)
            continue
        same_as.append(None)
        for entry in files:
            key = (entry.sha256, entry.size)
            if key in first:
                copies.append(CopyEntry(path=entry.path, source=first[key]))
            else:
                first[key] = entry.path
                stored.append(entry)
    return Stored(stored, copies, same_as)


def same_compile(a: list[FileEntry], b: list[FileEntry]) -> bool:
    """Whether two ranks' caches hold the same keys and generated code (their paths relative to
    the rank folder): :func:`kiln.artifact.payload.payload_lines`, with native objects compared
    by name only (their source is named by its hash and compiled by the same compiler; the
    bytes differ only by the cache path compiled in)."""
    return _compile_lines(a) == _compile_lines(b)


def _compile_lines(files: list[FileEntry]) -> list[str]:
    inside = [
        f.model_copy(update={"path": f.path.split("/", 2)[2]}) for f in files if f.kind != "native"
    ]
    natives = sorted(f"native {f.path.split('/', 2)[2]}" for f in files if f.kind == "native")
    return payload_lines(inside) + natives
