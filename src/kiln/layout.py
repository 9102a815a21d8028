"""The folder layout of an artifact, of a bake's work folder and of a restored folder.

One home for every name in it, and one way to build its paths (:class:`CacheLayout`), torch-free
and importing nothing of kiln's: the bake writes this layout, the archive ships it, restore
installs it, and verify, bench and ``kiln.activate()`` serve from it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

INDUCTOR_DIR = "inductor"  # DIR/inductor is TORCHINDUCTOR_CACHE_DIR
MEGACACHE_NAME = "megacache.bin"  # torch.compiler.save_cache_artifacts() blob
PRECOMPILED_NAME = "precompiled.bin"  # serialized AOT forwards (compile.precompile)
FRAMES_DIR = "dynamo"  # INDUCTOR_DIR/dynamo: Dynamo's saved frames (precompile), PGO profiles
BYTECODE_DIR = "bytecode"  # a sys.pycache_prefix tree of the imported modules (kiln.bytecode)
# TRITON_HOME of a bake and of a served process: Triton builds its native helpers (cuda_utils,
# kernel launchers) with gcc into TRITON_HOME/.triton/cache whenever Inductor has not yet set
# TRITON_CACHE_DIR (the driver starts before the first kernel loads). The bake's go into the
# artifact, so a served process finds them instead of running gcc in every new pod.
TRITON_HOME_DIR = "triton-home"
# CUDA_CACHE_PATH of a bake and of a served process: the CUDA driver's JIT cache. A kernel that a
# library ships as PTX only for this GPU is compiled by the driver when first loaded, into
# ~/.nv/ComputeCache by default (H200, cuDNN 9.19, the reference convnet: one entry at its first
# convolution, eager or compiled alike; none with cuDNN off). The bake's entries go into the
# artifact, so a served process loads them instead of JIT-compiling in every new pod; a process
# that hits the cache rewrites nothing in it (measured: every file byte-for-byte the same).
# cuDNN's runtime-compiled kernels are keyed by the working directory too (kiln.workdir).
CUDA_CACHE_DIR = "cuda-cache"
CUDA_CACHE_INDEX = "index"  # the driver's index of its entries, rewritten as it adds one
# Inductor takes a file lock under CACHE/locks for every C++ kernel it loads, hit or not; restore
# links that folder to LOCKS_TARGET so that a read-only DEST serves and a served process writes
# nothing into it (the locks are empty files, meaningful only between processes of one host).
LOCKS_DIR = "locks"
LOCKS_TARGET = "/tmp"
AOTI_DIR = "aoti"  # compile.route: aoti: one extracted AOTInductor package per folder (aoti/N/)
MANIFEST_NAME = "manifest.json"  # an artifact's first member; restore writes its own copy
# A real manifest is ~200-250 bytes per file plus ~25 KB of fingerprint: 8 MiB is ~35,000
# files, read and validated in ~1 s. Readers refuse a bigger manifest.json (from its tar header,
# before reading a byte of it).
MAX_MANIFEST_BYTES = 8 << 20
ENV_NAME = "kiln.env"  # written by restore, never shipped
STATE_NAME = ".kiln-installed.json"  # written by restore, never shipped
# A K-rank artifact keeps rank R's layout (inductor/, megacache.bin, precompiled.bin) under
# ranks/R/ instead of at the top; a serving rank reads its own folder (:attr:`CacheLayout.dir`).
RANKS_DIR = "ranks"
# Top-level names restore writes itself: a manifest listing a file or folder under one is refused.
RESERVED_NAMES = frozenset({MANIFEST_NAME, ENV_NAME, STATE_NAME})


def rank_of(path: str) -> int | None:
    """The rank whose folder holds ``path`` (``ranks/R/...``), None outside every rank folder."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == RANKS_DIR and parts[1].isdecimal():
        return int(parts[1]) if str(int(parts[1])) == parts[1] else None
    return None


def unserved_path(path: Path) -> str | None:
    """Why ``path`` is no folder to serve from (None when it is a folder): a missing path, or a
    file, which is most often the artifact itself. A server (``kiln.activate()``, ``kiln verify
    --cache``) serves a restored folder only: the message says how to make one."""
    if path.is_dir():
        return None
    if path.exists():
        return (
            f"{path}: a file, not a restored folder (an artifact is served once restored: "
            "kiln restore FILE --dest DIR, then serve DIR)"
        )
    return (
        f"{path}: no such folder (restore an artifact there first: kiln restore ARTIFACT "
        f"--dest {shlex.quote(str(path))})"
    )


@dataclass(frozen=True)
class CacheLayout:
    """Where one process's caches live under ``root``, and the artifact's own files beside them.

    ``rank`` None: a 1-rank artifact, whose caches are at ``root`` itself; rank R of a K-rank
    artifact keeps the same layout under ``root/ranks/R`` (:attr:`dir`), so a rank's process
    reads its own folder and nothing else changes. One rule for a bake's work folder, the
    artifact's members and a restored folder: a path built here is the same in all three.

    Without a ``root`` every path is relative (``CacheLayout(rank=1).megacache`` is
    ``ranks/1/megacache.bin``), and :meth:`member` gives the archive member name of any of them
    (archives name members with POSIX relative paths).
    """

    root: Path = field(default_factory=Path)
    rank: int | None = None

    @classmethod
    def ranks(cls, root: Path, world: int | None) -> list[CacheLayout]:
        """Every rank's layout under ``root``: ``world`` None is a 1-rank artifact (one layout,
        at the top), else ranks ``0..world-1`` each in its own folder."""
        if world is None:
            return [cls(root)]
        return [cls(root, rank) for rank in range(world)]

    @classmethod
    def of_dir(cls, folder: Path) -> CacheLayout:
        """The layout whose :attr:`dir` is ``folder``: a rank's when it is ``ROOT/ranks/R``."""
        if folder.parent.name == RANKS_DIR and rank_of(f"{RANKS_DIR}/{folder.name}/") is not None:
            return cls(folder.parent.parent, int(folder.name))
        return cls(folder)

    # --- the rank's own caches, under dir -----------------------------------------------------
    @property
    def dir(self) -> Path:
        """The folder that holds this rank's caches (``root`` for a 1-rank artifact)."""
        return self.root if self.rank is None else self.root / RANKS_DIR / str(self.rank)

    @property
    def inductor(self) -> Path:
        """Inductor's cache root: ``TORCHINDUCTOR_CACHE_DIR``."""
        return self.dir / INDUCTOR_DIR

    @property
    def triton_home(self) -> Path:
        """``TRITON_HOME`` (:data:`TRITON_HOME_DIR` says why it ships)."""
        return self.dir / TRITON_HOME_DIR

    @property
    def cuda_cache(self) -> Path:
        """``CUDA_CACHE_PATH`` (:data:`CUDA_CACHE_DIR` says why it ships)."""
        return self.dir / CUDA_CACHE_DIR

    @property
    def megacache(self) -> Path:
        return self.dir / MEGACACHE_NAME

    @property
    def precompiled(self) -> Path:
        return self.dir / PRECOMPILED_NAME

    @property
    def frames(self) -> Path:
        """Dynamo's saved frames and PGO profiles, inside Inductor's cache root."""
        return self.inductor / FRAMES_DIR

    @property
    def locks(self) -> Path:
        """Inductor's lock folder, a link to :data:`LOCKS_TARGET` in a restored folder."""
        return self.inductor / LOCKS_DIR

    @property
    def aoti(self) -> Path:
        """``compile.route: aoti``'s packages, one folder each."""
        return self.dir / AOTI_DIR

    # --- the artifact's own files, one per artifact, under root ---------------------------------
    @property
    def ranks_dir(self) -> Path:
        """The folder of a K-rank artifact's rank folders."""
        return self.root / RANKS_DIR

    @property
    def bytecode(self) -> Path:
        """The imported modules' bytecode: one tree at the root, which every rank imports."""
        return self.root / BYTECODE_DIR

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def env_file(self) -> Path:
        """``kiln.env``, written by restore."""
        return self.root / ENV_NAME

    @property
    def state_file(self) -> Path:
        """What restore installed (its digest, its stamp), written by restore."""
        return self.root / STATE_NAME

    # --- archive member names -------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """The member-name prefix of :attr:`dir`: ``""``, or ``ranks/R/`` for rank R."""
        return "" if self.rank is None else f"{RANKS_DIR}/{self.rank}/"

    def member(self, path: Path) -> str:
        """``path`` (one of this layout's) as an archive member name: POSIX, relative to root."""
        return path.relative_to(self.root).as_posix()


def lock_links(world: int | None) -> list[str]:
    """Every rank layout's lock folder (:attr:`CacheLayout.locks`) as a member name: restore
    makes each a link to :data:`LOCKS_TARGET` (:data:`LOCKS_DIR` says why). ``world`` as in
    :meth:`CacheLayout.ranks` (a 1-rank ``distributed`` artifact has its one rank's folder)."""
    layouts = CacheLayout.ranks(Path(), world)
    return [layout.member(layout.locks) for layout in layouts]
