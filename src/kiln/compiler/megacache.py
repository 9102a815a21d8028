"""torch's Mega-Cache in a worker pass: a blob hot-loaded before anything compiles (bench), and
what the pass was asked to keep written at its end (the Mega-Cache blob, precompiled forwards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.compiler.measure import Forward
from kiln.compiler.protocol import MegacacheInfo, WorkerRequest


def load_megacache(path: str | None) -> MegacacheInfo:
    """Hot-load a Mega-Cache blob before anything compiles (bench's ``megacache`` modes)."""
    if not path:
        return MegacacheInfo()
    import torch

    info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
    return MegacacheInfo(loaded=info is not None, entries=_cache_info_counts(info))


def save_caches(request: WorkerRequest, forward: Forward) -> MegacacheInfo:
    """Write what this pass was asked to keep: the precompiled forwards it built, and torch's
    Mega-Cache blob of everything compiled or loaded in this process."""
    if forward.building and request.precompile_save:
        assert forward.precompiled is not None
        Path(request.precompile_save).write_bytes(forward.precompiled.to_bytes())
    if not request.megacache_save and request.frames != "record":
        return MegacacheInfo()
    import torch

    saved = torch.compiler.save_cache_artifacts()  # also writes recorded frames to the root
    if not request.megacache_save:
        return MegacacheInfo()
    if saved is None:
        return MegacacheInfo(saved=False)
    Path(request.megacache_save).write_bytes(saved[0])
    return MegacacheInfo(saved=True, entries=_cache_info_counts(saved[1]))


def _cache_info_counts(info: Any) -> dict[str, int]:
    if info is None:
        return {}
    artifacts = getattr(info, "artifacts", None)
    if isinstance(artifacts, dict):
        return {k: len(v) for k, v in artifacts.items()}
    return {k: len(v) for k, v in vars(info).items() if isinstance(v, list)}


def both(loaded: MegacacheInfo, saved: MegacacheInfo) -> MegacacheInfo:
    """The pass's record: whether a blob was loaded and saved, and the saved blob's entries
    (else the loaded one's)."""
    return MegacacheInfo(
        loaded=loaded.loaded,
        saved=saved.saved,
        entries=saved.entries if saved.saved else loaded.entries,
    )
