"""What of a bake's cache root goes into the artifact, and what kind of cache each file is.

The bake compiles into a private root, so everything in it belongs to this model; we still leave
out what is never read on a hit (locks, half-written temp files) so artifacts stay small and
deterministic. Kinds make ``inspect`` explain an artifact the way ccache's stats do.
Torch-free.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path, PurePosixPath

from kiln.artifact.archive import sha256_file
from kiln.artifact.manifest import FileEntry
from kiln.bytecode import header_problem, library_problem, pyc_path
from kiln.layout import (
    AOTI_DIR,
    BYTECODE_DIR,
    CUDA_CACHE_DIR,
    FRAMES_DIR,
    INDUCTOR_DIR,
    LOCKS_DIR,
    MEGACACHE_NAME,
    PRECOMPILED_NAME,
    TRITON_HOME_DIR,
    CacheLayout,
)

_SKIP_DIRS = frozenset({LOCKS_DIR, "__pycache__"})
_TOP_KINDS = {
    "fxgraph": "fxgraph",
    "aotautograd": "aotautograd",
    "triton": "triton",
    "cache": "autotune",
    FRAMES_DIR: "dynamo",  # PGO profiles and saved frames
}
_SUFFIX_KINDS = {
    ".py": "code",
    ".so": "native",
    ".cpp": "source",
    ".h": "source",
    ".best_config": "autotune",
    ".json": "meta",
    ".cubin": "triton",
    ".ptx": "triton",
}


def _skipped(name: str) -> bool:
    return name.endswith((".lock", ".tmp")) or ".tmp." in name or name.startswith(".tmp")


def cache_kind(rel: str) -> str:
    """The kind of cache a file stored at ``rel`` in the artifact is (``FileEntry.kind``)."""
    parts = PurePosixPath(rel).parts
    if rel == MEGACACHE_NAME:
        return "megacache"
    if rel == PRECOMPILED_NAME:
        return "precompile"
    if parts[0] == BYTECODE_DIR:
        return "bytecode"
    if parts[0] == TRITON_HOME_DIR:
        return "triton"
    if parts[0] == CUDA_CACHE_DIR:
        return "driver"
    if parts[0] == AOTI_DIR:
        return "aoti"
    if len(parts) >= 2 and parts[0] == INDUCTOR_DIR:
        top = parts[1]
        if top in _TOP_KINDS:
            return _TOP_KINDS[top]
        return _SUFFIX_KINDS.get(PurePosixPath(rel).suffix, "other")
    return "other"


def capture(folder: Path) -> list[FileEntry]:
    """File entries for one compiling process's layout at ``folder``: its cache root
    (``inductor/``), the native helpers Triton built outside it (``triton-home/``, see
    :data:`~kiln.layout.TRITON_HOME_DIR`), the CUDA driver's JIT cache (``cuda-cache/``, see
    :data:`~kiln.layout.CUDA_CACHE_DIR`), and the blobs that exist (the Mega-Cache blob, the
    precompiled forwards), stored at the artifact root by name."""
    layout = CacheLayout(folder)
    entries = _tree(layout.inductor, INDUCTOR_DIR)
    entries += capture_tree(layout.triton_home, TRITON_HOME_DIR)
    entries += capture_tree(layout.cuda_cache, CUDA_CACHE_DIR)
    blobs = (layout.megacache, layout.precompiled)
    entries.extend(_entry(blob, blob.name) for blob in blobs if blob.is_file())
    return sorted(entries, key=lambda e: e.path)


def capture_aoti(folder: Path) -> list[FileEntry]:
    """File entries for ``compile.route: aoti`` at ``folder``: the extracted packages and the
    CUDA driver's JIT cache, no Inductor cache (a served process never compiles). The runner's
    calls still reach library kernels that ship as PTX for this GPU (H100, the tiny GPT of
    tests/test_aoti_gpu.py: two driver JIT entries at the first call of each sequence length),
    which every new pod would JIT-compile again (:data:`~kiln.layout.CUDA_CACHE_DIR`)."""
    layout = CacheLayout(folder)
    return capture_tree(layout.aoti, AOTI_DIR) + capture_tree(layout.cuda_cache, CUDA_CACHE_DIR)


def capture_tree(folder: Path, stored_as: str) -> list[FileEntry]:
    """File entries for ``folder`` (when it exists), stored under ``stored_as/``."""
    return _tree(folder, stored_as) if folder.is_dir() else []


def capture_bytecode(folder: Path, tag: str | None = None) -> list[FileEntry]:
    """File entries for a bake's bytecode tree (kiln.bytecode), stored under ``bytecode/``:
    each names its source (the path the tree mirrors) and that source's hash (from the pyc's
    header), which restore holds the file to (kiln.artifact.manifest, kiln.artifact.extract).
    A file that is not the checked-hash pyc of a library module is left out: restore would
    refuse the artifact."""
    if not folder.is_dir():
        return []
    tag = tag or sys.implementation.cache_tag
    out = []
    for entry in _tree(folder, BYTECODE_DIR):
        rel = entry.path.removeprefix(BYTECODE_DIR + "/")
        head, _, name = rel.rpartition("/")
        source = f"/{head}/{name.removesuffix(f'.{tag}.pyc')}.py"
        if not name.endswith(f".{tag}.pyc") or library_problem(source):
            continue
        with open(folder / rel, "rb") as fh:
            header = fh.read(16)
        source_hash = header[8:16].hex()
        if header_problem(header, source_hash) or pyc_path(source, tag) != rel:
            continue
        out.append(entry.model_copy(update={"source": source, "source_hash": source_hash}))
    return out


def _tree(root: Path, stored_as: str) -> list[FileEntry]:
    entries: list[FileEntry] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if _skipped(name) or path.is_symlink() or not path.is_file():
                continue
            entries.append(_entry(path, f"{stored_as}/{path.relative_to(root).as_posix()}"))
    return entries


def _entry(path: Path, rel: str) -> FileEntry:
    return FileEntry(
        path=rel, size=path.stat().st_size, sha256=sha256_file(path), kind=cache_kind(rel)
    )


def snapshot(cache_root: Path) -> set[str]:
    """Relative names of files under a cache root: diffed to find what a process compiled."""
    out: set[str] = set()
    if not cache_root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(cache_root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if not _skipped(name):
                out.add((Path(dirpath) / name).relative_to(cache_root).as_posix())
    return out
