"""Triton's cache groups name their files by absolute path: restore points them at DEST. Torch-free.

Triton files a compiled kernel as a group: ``__grp__<name>.json`` beside the kernel's files,
holding ``{"child_paths": {file name: absolute path}}``, and a lookup counts a file only where
that path exists (``FileCacheManager.get_group``). The paths are the bake's folder, which a pod
never has, so every group of a restored folder misses and Triton compiles the kernel again,
writing into DEST. Inductor's static launcher loads kernels without this lookup; processes that
compile through Triton's own launcher (specs that autotune: :data:`kiln.serving.AUTOTUNE_LOADING`)
meet it on every kernel (H200, static launcher off: 322 files written by the first process).

A restore knows where the folder will live, so it rewrites each group to name the files beside
it at their final place. The rewritten files then differ from the manifest's digests: their own
digests go into the install's state, and :mod:`kiln.artifact.drift` judges them by those.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from kiln.artifact.archive import sha256_file
from kiln.artifact.manifest import FileEntry

GROUP_PREFIX = "__grp__"  # Triton's name for a group file
MAX_GROUP_BYTES = 1 << 20  # a group lists a kernel's handful of files: far below this


def is_group(path: str) -> bool:
    """Whether the artifact file at ``path`` (posix, relative) is a Triton cache group."""
    name = PurePosixPath(path).name
    return name.startswith(GROUP_PREFIX) and name.endswith(".json")


def relocate_groups(tree: Path, dest: Path, entries: Iterable[FileEntry]) -> list[FileEntry]:
    """Rewrite the Triton groups among ``entries``, unpacked under ``tree``, so that each names
    its files as they will be once ``tree`` is DEST (``dest``, absolute); return the rewritten
    files with their new sizes and digests.

    A group is rewritten only where each path it names is a file of the same group folder (by
    file name); anything else (not JSON, not Triton's shape, a file from elsewhere) is left as
    the bake wrote it: Triton then compiles that kernel, and verify counts it.
    """
    moved: list[FileEntry] = []
    for entry in entries:
        if not is_group(entry.path):
            continue
        where = tree / entry.path
        rewritten = _rewritten(where, dest / PurePosixPath(entry.path).parent)
        if rewritten is None:
            continue
        tmp = where.with_name(where.name + ".kiln-tmp")
        tmp.write_bytes(rewritten)
        os.replace(tmp, where)
        size, digest = where.stat().st_size, sha256_file(where)
        moved.append(entry.model_copy(update={"size": size, "sha256": digest}))
    return moved


def _rewritten(group: Path, final: Path) -> bytes | None:
    """``group``'s new bytes with its children under ``final``, or None to leave it."""
    if group.stat().st_size > MAX_GROUP_BYTES:
        return None
    try:
        data = json.loads(group.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return None
    children = data.get("child_paths") if isinstance(data, dict) else None
    if not isinstance(children, dict) or not children:
        return None
    placed: dict[str, str] = {}
    for child, path in children.items():
        name = PurePosixPath(path).name if isinstance(path, str) else ""
        if not name or name in (".", "..") or not (group.parent / name).is_file():
            return None
        placed[child] = str(final / name)
    if placed == children:
        return None
    return json.dumps({**data, "child_paths": placed}).encode()
