#!/usr/bin/env python3
"""``g++`` for the test run: Inductor's CPU kernels compile against a precompiled header.

Each C++ kernel Inductor builds on the CPU starts with ``#include
<torch/csrc/inductor/cpp_prefix.h>``, and parsing that header (torch's vector classes) is
almost all of the build: 1.85 s of a kernel's 1.9 s on the 2-core CI machine, against 0.54 s
with the header precompiled (the header itself, once: 4.4 s). The suite builds about 200 such
kernels, so they held more than half of its test time. ``tests/conftest.py`` puts this file's
folder (where ``g++`` links here) first on ``PATH`` for the run; kiln keeps torch's own
precompiled headers off in what it bakes (``kiln.serving.COMPILE_DEFAULTS`` says why), so the
run precompiles outside torch instead, and nothing torch or kiln sees changes: the command line
Inductor keys its cache on, its outputs' paths and the kernels' code are the same.

A kernel build gets ``-I DIR`` first, where ``DIR/torch/csrc/inductor/cpp_prefix.h.gch`` was
built once with the kernel's own compile options (the folder is keyed by them, by the real
compiler, and by the header's size and time, so another torch install never meets a stale
one). GCC uses a precompiled header only where its options match and ignores it otherwise, so
the worst case is the build as it was. Every other command goes to the real ``g++`` unchanged.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

PREFIX = "torch/csrc/inductor/cpp_prefix.h"
INCLUDE = f"#include <{PREFIX}>"
_LINK_ONLY = ("-l", "-L", "-Wl,")  # options of the link step a header build has no use for


def real_compiler() -> str:
    """The ``g++`` this one stands in front of: the next one on ``PATH``."""
    here = Path(__file__).resolve().parent
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder or ".", "g++")
        if candidate.resolve().parent == here or not os.access(candidate, os.X_OK):
            continue
        return str(candidate)
    raise SystemExit("g++ (tests/tools): no real g++ on PATH")


def kernel_build(args: list[str]) -> tuple[list[str], Path] | None:
    """For a kernel build (one source whose first line of code includes the prefix header):
    its compile options and the folder holding that header; else None."""
    if not args or not args[0].endswith(".cpp") or any(a.endswith(".cpp") for a in args[1:]):
        return None
    try:
        with open(args[0], encoding="utf-8", errors="replace") as source:
            first = next((line.strip() for line in source if line.strip()), "")
    except OSError:
        return None
    if first != INCLUDE:
        return None
    options, skip = [], False
    for arg in args[1:]:
        if skip:
            skip = False
        elif arg == "-o":
            skip = True
        elif arg != "-shared" and not arg.startswith(_LINK_ONLY):
            options.append(arg)
    roots = [a[2:] for a in options if a.startswith("-I") and Path(a[2:], PREFIX).is_file()]
    return (options, Path(roots[0])) if roots else None


def precompiled(gxx: str, options: list[str], root: Path) -> Path | None:
    """The include folder whose ``cpp_prefix.h.gch`` matches ``options``, built under a lock
    the first time (shared by every process of the run); None if it cannot be built."""
    header, compiler = root / PREFIX, Path(gxx).resolve()
    stats = (compiler.stat().st_mtime_ns, header.stat().st_mtime_ns, header.stat().st_size)
    parts = [str(compiler), str(header), *map(str, stats), *options]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    cache = Path(os.environ["KILN_TEST_PCH_DIR"])
    folder = cache / key
    gch = folder / f"{PREFIX}.gch"
    if gch.is_file():
        return folder
    try:
        gch.parent.mkdir(parents=True, exist_ok=True)
        with open(cache / f"{key}.lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if not gch.is_file():
                partial = gch.with_suffix(f".gch.{os.getpid()}")
                built = subprocess.run(
                    [gxx, "-x", "c++-header", *options, str(header), "-o", str(partial)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if built.returncode != 0:
                    partial.unlink(missing_ok=True)
                    return None
                partial.rename(gch)
    except OSError:
        return None
    return folder


def main() -> None:
    gxx, args = real_compiler(), sys.argv[1:]
    build = kernel_build(args) if os.environ.get("KILN_TEST_PCH_DIR") else None
    folder = precompiled(gxx, *build) if build else None
    if folder is not None:
        args = [args[0], f"-I{folder}", *args[1:]]
    os.execv(gxx, [gxx, *args])


if __name__ == "__main__":
    main()
