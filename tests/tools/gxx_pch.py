#!/usr/bin/env python3
"""``g++`` for the test run: Inductor's CPU kernels compile against a precompiled header.

Each C++ kernel Inductor builds on the CPU starts with ``#include
<torch/csrc/inductor/cpp_prefix.h>``, and parsing that header (torch's vector classes) is
almost all of the build: 1.85 s of a kernel's 1.9 s on the 2-core CI machine, against 0.54 s
with the header precompiled (the header itself, once: 4.4 s). The suite builds about 200 such
kernels, so they held more than half of its test time. ``tests/conftest.py`` puts this file's
folder (where ``g++`` runs this file) first on ``PATH`` for the run; kiln keeps torch's own
precompiled headers off in what it bakes (``kiln.serving.COMPILE_DEFAULTS`` says why), so the
run precompiles outside torch instead, and nothing torch or kiln sees changes: the command line
Inductor keys its cache on, the compiler it runs (started as ``g++`` with this folder off
``PATH``, so even ``g++ -v``, part of Inductor's ISA-probe keys, prints the same), its outputs'
paths and the kernels' code are the same.

A kernel build gets ``-I DIR`` first, where ``DIR/torch/csrc/inductor/cpp_prefix.h.gch`` was
built once with the kernel's own compile options. The folder is keyed by them, by the real
compiler, and by the header's and torch's install record's size and time: GCC checks a
precompiled header's options, not whether the headers it read changed, so another torch install
must never meet a stale one. GCC ignores a precompiled header whose options do not match, and
anything unexpected here (a command of another shape, a failed or failing header build) runs
the build as it was.
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
HERE = Path(__file__).resolve().parent
_LINK_ONLY = ("-l", "-L", "-Wl,")  # options of the link step a header build has no use for
_TAKES_VALUE = {"-D", "-U", "-I", "-isystem", "-iquote", "-idirafter"}
# Options that change what the header means or what g++ does with it: left to the plain build.
_OTHER_SHAPES = ("-include", "-imacros", "-x", "-E", "-M", "@")


def real_env() -> dict[str, str]:
    """This environment without this folder on ``PATH``: the real ``g++`` and what it starts
    see what they would see without the test run's stand-in."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    kept = [f for f in folders if Path(f or ".").resolve() != HERE]
    return {**os.environ, "PATH": os.pathsep.join(kept)}


def real_compiler(env: dict[str, str]) -> str:
    """The ``g++`` this one stands in front of: the first on ``env``'s ``PATH``."""
    for folder in env["PATH"].split(os.pathsep):
        candidate = Path(folder or ".", "g++")
        if os.access(candidate, os.X_OK) and candidate.resolve().name != Path(__file__).name:
            return str(candidate)
    raise SystemExit("g++ (tests/tools): no real g++ on PATH")


def kernel_build(args: list[str]) -> tuple[list[str], Path] | None:
    """For a kernel build (one source whose first line of code includes the prefix header):
    its compile options and the folder holding that header; else None."""
    if not args or not args[0].endswith(".cpp"):
        return None
    try:
        with open(args[0], encoding="utf-8", errors="replace") as source:
            first = next((line.strip() for line in source if line.strip()), "")
    except OSError:
        return None
    if first != INCLUDE:
        return None
    options: list[str] = []
    rest = iter(args[1:])
    for arg in rest:
        if arg == "-o":
            next(rest, None)
        elif arg.startswith(_OTHER_SHAPES) or not arg.startswith("-"):
            return None  # another input, or an option that changes the header's meaning
        elif arg in _TAKES_VALUE:
            options += [arg, next(rest, "")]
        elif arg != "-shared" and not arg.startswith(_LINK_ONLY):
            options.append(arg)
    roots = [a[2:] for a in options if a.startswith("-I") and Path(a[2:], PREFIX).is_file()]
    return (options, Path(roots[0])) if roots else None


def _key(gxx: str, options: list[str], root: Path) -> str:
    compiler, header = Path(gxx).resolve(), root / PREFIX
    # root is .../site-packages/torch/include: torch's install record lies beside the package.
    record = sorted(root.parent.parent.glob("torch-*.dist-info/RECORD"))
    stats = [compiler.stat(), header.stat(), *(r.stat() for r in record)]
    parts = [str(compiler), str(header), *(f"{s.st_mtime_ns}:{s.st_size}" for s in stats)]
    return hashlib.sha256("\0".join([*parts, *options]).encode()).hexdigest()[:32]


def precompiled(gxx: str, env: dict[str, str], options: list[str], root: Path) -> Path | None:
    """The include folder whose ``cpp_prefix.h.gch`` matches ``options``, built under a lock
    the first time (shared by every process of the run); None if it cannot be built (and then
    never tried again for these options)."""
    header = root / PREFIX
    cache = Path(os.environ["KILN_TEST_PCH_DIR"])
    key = _key(gxx, options, root)
    folder, failed = cache / key, cache / f"{key}.failed"
    gch = folder / f"{PREFIX}.gch"
    if gch.is_file():
        return folder
    gch.parent.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{key}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if failed.exists():
            return None
        if not gch.is_file():
            partial = gch.with_suffix(f".gch.{os.getpid()}")
            built = subprocess.run(
                ["g++", "-x", "c++-header", *options, str(header), "-o", str(partial)],
                executable=gxx,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if built.returncode != 0:
                partial.unlink(missing_ok=True)
                failed.touch()
                return None
            partial.rename(gch)
    return folder


def main() -> None:
    env = real_env()
    gxx, args = real_compiler(env), sys.argv[1:]
    try:
        build = kernel_build(args) if os.environ.get("KILN_TEST_PCH_DIR") else None
        folder = precompiled(gxx, env, *build) if build else None
    except Exception:  # anything unexpected: the build as it was
        folder = None
    if folder is not None:
        args = [args[0], f"-I{folder}", *args[1:]]
    os.execve(gxx, ["g++", *args], env)


if __name__ == "__main__":
    main()
