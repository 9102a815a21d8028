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

A build of one source into one library (a kernel, an ISA probe) is also kept, by what it was
built from, and a later identical build copies it instead of compiling (ccache's job, which
ccache does not do for a command that compiles and links at once): the suite bakes the same
models in many fresh cache roots, so ~70% of its builds are repeats. A copy is the library g++
built from the same source in another folder: the same code, but its debug information names
that folder (the source's path, the build's working folder), so its bytes differ from a build
here. ``KILN_TEST_GXX_KEEP=0`` compiles every build (for a test that compares two bakes'
libraries byte for byte). AOTInductor's builds are kept the same way: the header it
precompiles for its wrapper (in the bake's temporary folder, so every bake built it again: 5 s)
and each wrapper and kernel object, their sources read without the build commands they end
with as comments (which name that folder); the suite's AOT tests took 88 s instead of 121 s.

A kernel build gets ``-I DIR`` first, where ``DIR/torch/csrc/inductor/cpp_prefix.h.gch`` was
built once with the kernel's own compile options. The folder is keyed by them, by the real
compiler, and by the header's and torch's install record's size and time: GCC checks a
precompiled header's options, not whether the headers it read changed, so another torch install
must never meet a stale one. GCC ignores a precompiled header whose options do not match, and
anything unexpected here (a command of another shape, a failed or failing header build) runs
the build as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
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


def _parse(args: list[str]) -> tuple[list[str], list[str], str | None] | None:
    """A command's inputs, its other arguments less ``-o`` and its value, and that value (None
    without ``-o``); None for a command whose meaning this does not follow (preprocessing
    only, dependency output, ``-imacros``, a response file)."""
    inputs: list[str] = []
    options: list[str] = []
    output = None
    rest = iter(args)
    for arg in rest:
        if arg == "-o":
            output = next(rest, None)
        elif arg.startswith(("-imacros", "-E", "-M", "@")):
            return None
        elif arg in _TAKES_VALUE or arg in ("-x", "-include"):
            options += [arg, next(rest, "")]
        elif arg.startswith("-"):
            options.append(arg)
        else:
            inputs.append(arg)
    return inputs, options, output


def one_source(args: list[str]) -> tuple[list[str], str | None] | None:
    """For a build of one ``.cpp`` source (the first argument): its other arguments, less
    ``-o`` and its value, and that value (None without ``-o``); None for any other shape (more
    inputs, or an option that changes what the source means)."""
    parsed = _parse(args)
    if parsed is None or not args or parsed[0] != args[:1] or not args[0].endswith(".cpp"):
        return None
    _, options, output = parsed
    if any(o.startswith(_OTHER_SHAPES) for o in options):
        return None
    return options, output


def kernel_build(args: list[str]) -> tuple[list[str], Path] | None:
    """For a kernel build (one source whose first line of code includes the prefix header):
    its compile options and the folder holding that header; else None."""
    build = one_source(args)
    if build is None:
        return None
    try:
        with open(args[0], encoding="utf-8", errors="replace") as source:
            first = next((line.strip() for line in source if line.strip()), "")
    except OSError:
        return None
    if first != INCLUDE:
        return None
    options = [a for a in build[0] if a != "-shared" and not a.startswith(_LINK_ONLY)]
    roots = [a[2:] for a in options if a.startswith("-I") and Path(a[2:], PREFIX).is_file()]
    return (options, Path(roots[0])) if roots else None


def _installs(gxx: str, options: list[str]) -> list[str]:
    """What the headers a build reads come with: the real compiler, and the install record of
    every package whose include folder is on the include path (torch's, beside
    ``.../site-packages/torch/include``), each by path, size and time."""
    files = [Path(gxx).resolve()]
    for option in options:
        if option.startswith("-I"):
            files += sorted(Path(option[2:]).parent.parent.glob("torch-*.dist-info/RECORD"))
    stats = {f: f.stat() for f in files}
    return [f"{f}:{s.st_mtime_ns}:{s.st_size}" for f, s in stats.items()]


def _key(gxx: str, options: list[str], root: Path) -> str:
    header = root / PREFIX
    stat = header.stat()
    parts = [*_installs(gxx, options), f"{header}:{stat.st_mtime_ns}:{stat.st_size}"]
    return hashlib.sha256("\0".join([*parts, *options]).encode()).hexdigest()[:32]


def _one_output(args: list[str]) -> tuple[Path, list[str], str] | None:
    """For a build of one file into one output (a library; an object, as AOTInductor compiles
    its wrappers and kernels; a precompiled header): the input, the other arguments (an
    ``-include``d file named by its bytes, not its folder, which is a fresh temporary one in
    every AOT bake) and the output; None for any other shape."""
    parsed = _parse(args)
    if parsed is None:
        return None
    inputs, options, output = parsed
    header = "-x" in options and options[options.index("-x") + 1] == "c++-header"
    if len(inputs) != 1 or output is None or not ({"-shared", "-c"} & set(options) or header):
        return None
    keyed = list(options)
    for i, option in enumerate(options[:-1]):
        if option == "-include":
            included = Path(options[i + 1])
            keyed[i + 1] = f"{included.name}:{hashlib.sha256(included.read_bytes()).hexdigest()}"
    return Path(inputs[0]), keyed, output


def built(gxx: str, args: list[str]) -> tuple[Path, Path] | None:
    """For a build of one source into one library, object or precompiled header: where its
    output is kept, keyed by the source's name and bytes, every other argument, the output's
    name and the installs the headers come from (:func:`_installs`); and the output's path.
    None for any other build. A system header changed in place (not by a compiler or torch
    install) is not seen: the folder lives in the test venv, which ``make clean`` removes."""
    build = _one_output(args)
    if build is None:
        return None
    source, options, output = build
    # AOTInductor's sources end with their own build commands, as comments, which name the
    # bake's temporary folders: the code before them is what g++ compiles.
    code = source.read_bytes()
    code = b"\n".join(ln for ln in code.split(b"\n") if not ln.startswith(b"// g++ "))
    digest = hashlib.sha256(code)
    parts = [source.name, Path(output).name, *_installs(gxx, options), *options]
    digest.update("\0".join(parts).encode())
    return Path(os.environ["KILN_TEST_PCH_DIR"], "built", digest.hexdigest()[:40]), Path(output)


def _put(source: Path, target: Path) -> None:
    """``source``'s bytes and mode at ``target``, whole or not at all."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    shutil.copy(source, partial)
    os.replace(partial, target)


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
    folder = kept = None
    on = bool(os.environ.get("KILN_TEST_PCH_DIR"))
    if on and os.environ.get("KILN_TEST_GXX_KEEP", "1") != "0":
        try:
            kept = built(gxx, args)
        except Exception:  # anything unexpected: the build as it was
            kept = None
    if kept is not None and kept[0].is_file():
        with contextlib.suppress(OSError):  # a copy that fails: the build as it was
            _put(*kept)
            sys.exit(0)
    if on:  # compiling after all: against the precompiled header, which a copy never needs
        try:
            build = kernel_build(args)
            folder = precompiled(gxx, env, *build) if build else None
        except Exception:
            folder = None
    if folder is not None:
        args = [args[0], f"-I{folder}", *args[1:]]
    if kept is None:
        os.execve(gxx, ["g++", *args], env)
    code = subprocess.run(["g++", *args], executable=gxx, env=env).returncode
    if code == 0 and kept[1].is_file():
        with contextlib.suppress(OSError):  # kept for the next build, or not: this one is done
            kept[0].parent.mkdir(parents=True, exist_ok=True)
            _put(kept[1], kept[0])
    sys.exit(code)


if __name__ == "__main__":
    main()
