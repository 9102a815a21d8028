"""The payload digest: what two bakes that compiled the same thing share, timings aside.

Torch-free, beside the manifest it summarizes: bake records it, ``kiln merge`` recomputes it for
the union of its shards' files, and the reproducibility check compares it (and, with
:func:`manifest_diff`, every other field two bakes of one spec must share).
"""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath

from kiln.artifact.manifest import FileEntry, Manifest
from kiln.layout import MEGACACHE_NAME

# Two bakes of one spec on one machine write the same cache keys and byte-identical generated
# code (.py/.cpp, and .so: the compiler is deterministic), but torch pickles measurements into its
# FX and AOTAutograd entries (compile time in ns, a function's memory address in a debug line,
# a tensor pointer in the repro script), and each entry's file name is a hash of those bytes.
# The Mega-Cache blob bundles the same entries. So the artifact digest differs per bake; the
# payload digest below leaves out exactly those bytes and keeps everything else.
MEASURED_KINDS = frozenset({"fxgraph", "aotautograd"})  # compared by cache key, not by bytes
BUNDLED_KINDS = frozenset({"megacache"})  # re-packs the measured entries: left out
# Everything else counts by path and bytes, Python's bytecode of the installed libraries
# (kiln.bytecode) included: it is code the server runs, compiled to the same bytes in every bake
# (an isolated interpreter), so a digest that left it out would not say what a server imports.


def payload_lines(files: list[FileEntry]) -> list[str]:
    """What a reproducible bake must reproduce, one sorted line per file.

    A measured entry contributes its cache key (its folder: the hash of graph, inputs, config
    and environment) and not its file name or bytes; every other file its path and digest.
    """
    lines: set[str] = set()
    for entry in files:
        # A kind is the manifest's claim: it takes bytes out only where the path agrees.
        parts = entry.path.split("/")
        if entry.kind in BUNDLED_KINDS and parts[-1] == MEGACACHE_NAME:
            continue
        if entry.kind in MEASURED_KINDS and entry.kind in parts[:-1]:
            lines.add(f"{entry.kind} key {PurePosixPath(entry.path).parent.as_posix()}")
        else:
            lines.add(f"{entry.kind} {entry.path} {entry.sha256}")
    return sorted(lines)


def payload_sha256(files: list[FileEntry]) -> str:
    """One digest of :func:`payload_lines`: equal for two bakes that compiled the same thing
    (the same cache keys and byte-identical code), whatever their timings were."""
    text = "".join(line + "\n" for line in payload_lines(files))
    return hashlib.sha256(text.encode()).hexdigest()


def payload_diff(a: list[FileEntry], b: list[FileEntry]) -> list[str]:
    """What differs between two artifacts' payloads, one line per file: ``-`` only in the
    first, ``+`` only in the second (a changed file shows as both). Empty: reproduced."""
    left, right = set(payload_lines(a)), set(payload_lines(b))
    return [f"- {line}" for line in sorted(left - right)] + [
        f"+ {line}" for line in sorted(right - left)
    ]


# What a second bake must reproduce besides the payload: every manifest field but the
# measurements (created, grid timings, pass wall times, totals) and the file list (compared by
# payload_diff).
_COMPARED_FIELDS = (
    "kiln_version",
    "name",
    "spec_sha256",
    "model_source_sha256",
    "fingerprint",
    "env",
    "compile_kwargs",
    "megacache",
    "precompiled",
    "warnings",
)


def manifest_diff(a: Manifest, b: Manifest) -> list[str]:
    """What differs between two bakes' manifests, one line each, timings aside: empty means the
    second bake reproduced the first (same inputs, same environment, same cache keys and code)."""
    out = [f"{name} differs" for name in _COMPARED_FIELDS if getattr(a, name) != getattr(b, name)]
    grid_a = [(s.key, s.compiles) for s in a.grid]
    grid_b = [(s.key, s.compiles) for s in b.grid]
    if grid_a != grid_b:
        out.append(f"grid (bucket, compiles) differs: {grid_a} vs {grid_b}")
    passes_a = [(p.order, p.compiles) for p in a.passes]
    passes_b = [(p.order, p.compiles) for p in b.passes]
    if passes_a != passes_b:
        out.append(f"passes (order, compiles) differ: {passes_a} vs {passes_b}")
    return out + payload_diff(a.files, b.files)
