"""The folder layout of an artifact, of a bake's work folder and of a restored folder.

One home for every name in it, torch-free and importing nothing of kiln's: the bake writes this
layout, the archive ships it, restore installs it, and verify, bench and ``kiln.activate()``
serve from it.
"""

from __future__ import annotations

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
# Inductor takes a file lock under CACHE/locks for every C++ kernel it loads, hit or not; restore
# links that folder to LOCKS_TARGET so that a read-only DEST serves and a served process writes
# nothing into it (the locks are empty files, meaningful only between processes of one host).
LOCKS_DIR = "locks"
LOCKS_TARGET = "/tmp"
AOTI_DIR = "aoti"  # compile.route: aoti: one extracted AOTInductor package per folder (aoti/N/)
MANIFEST_NAME = "manifest.json"  # an artifact's first member; restore writes its own copy
ENV_NAME = "kiln.env"  # written by restore, never shipped
STATE_NAME = ".kiln-installed.json"  # written by restore, never shipped
# A K-rank artifact keeps rank R's layout (inductor/, megacache.bin, precompiled.bin) under
# ranks/R/ instead of at the top; a serving rank reads its own folder
# (:func:`kiln.serving.rank_dir`).
RANKS_DIR = "ranks"
# Top-level names restore writes itself: a manifest listing a file or folder under one is refused.
RESERVED_NAMES = frozenset({MANIFEST_NAME, ENV_NAME, STATE_NAME})
