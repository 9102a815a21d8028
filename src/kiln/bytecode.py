"""Python's own compile cache: the bytecode of the modules a compiled server imports.

A process that serves with ``torch.compile`` imports Dynamo and Inductor, about a thousand
modules an eager server never loads. Without cached bytecode (an image built by ``uv``, which
does not compile bytecode unless asked, or with ``pip --no-compile``, ``__pycache__`` folders
deleted to slim it, or ``PYTHONDONTWRITEBYTECODE=1``), every process compiles all of them from
source first. Measured on the H200 image kiln's GPU figures come from, which ships torch that
way: ``import torch, torch._inductor.compile_fx`` takes 10.5–11.4 s from source against
3.4–5.0 s with bytecode; on the 2-core CPU, 12.4 s against 3.7 s (docs/benchmarks.md).

So a bake on such an image (``bytecode: auto``, the default, or ``always``) ships the bytecode of
every library module its passes imported (the AOT route: its server imported) under ``bytecode/``,
laid out as a ``sys.pycache_prefix`` tree. A served process (``kiln.activate()``, verify, bench, the
bake's proof) looks there when, and only when, torch's bytecode is missing where it would look
otherwise (:func:`use`): a prefix replaces ``__pycache__`` for every import, so on an image that has
its bytecode it would only cost. The files are checked-hash pycs: Python compares each with its
source's hash before using it, so a changed source (another torch build, a patched file) is compiled
from source as before, never served stale. Only library modules (under ``lib/pythonX.Y/``:
:func:`library_problem`), each listed in the manifest with its source path and hash; restore refuses
anything else (kiln.artifact.manifest, kiln.artifact.extract). They mirror absolute source paths, so
they serve an image with the bake's layout (the same base image); elsewhere they are unused.

Torch-free: restore and inspect run without torch, and this looks for files without importing it.
"""

from __future__ import annotations

import _imp
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

# A module every torch.compile process imports: if its bytecode is cached, torch's is.
_PROBE = ("_inductor", "compile_fx.py")
# How use() tells child interpreters what it set in this one (they read these at start).
_CHILD_ENV = ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")
# What use() replaced, by folder, for stop(): the prefix, the write flag, the child variables.
_REPLACED: dict[str, tuple[str | None, bool, dict[str, str | None]]] = {}


def _package_init(package: str = "torch") -> Path | None:
    """``package``'s ``__init__.py``, found without importing it: every served process
    imports it, whichever route (an AOT server imports no Inductor, so an AOT artifact's tree
    holds no bytecode of the probe module)."""
    spec = importlib.util.find_spec(package)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _probe_source(package: str = "torch") -> Path | None:
    """``package``'s copy of the probe module, found without importing the package."""
    init = _package_init(package)
    source = init.parent.joinpath(*_PROBE) if init else None
    return source if source and source.is_file() else None


def uncached_reason(package: str = "torch") -> str | None:
    """Why ``package``'s Inductor is compiled from source at each start here, or None when its
    bytecode is cached (or the package is not installed)."""
    source = _probe_source(package)
    if source is None or Path(importlib.util.cache_from_source(str(source))).is_file():
        return None
    why = "; PYTHONDONTWRITEBYTECODE is set, so none is written" if sys.dont_write_bytecode else ""
    return (
        f"{package}'s Python bytecode is not cached here{why}: every process compiles Dynamo "
        f"and Inductor from source before its first compile (seconds); run "
        f"`python -m compileall -q {source.parent.parent}` when building the image, or serve "
        f"an artifact baked here (it ships the bytecode)"
    )


def prefix_path(source: str) -> PurePosixPath | None:
    """Where ``source``'s bytecode lies in a ``sys.pycache_prefix`` tree, relative to the
    prefix (as :func:`importlib.util.cache_from_source` places it), or None for a path kiln
    will not mirror (relative, or with ``.``/``..`` parts an artifact may not hold)."""
    # Strings, not Paths: the tree must mirror the text Python joins, not a normalized path.
    head = source.rpartition("/")[0]
    if os.sep != "/" or not head.startswith("/") or os.path.normpath(head) != head:
        return None
    name = Path(importlib.util.cache_from_source(source, optimization="")).name
    return PurePosixPath(head.lstrip("/")) / name


# The folders of an interpreter's own modules on a POSIX system: its standard library and its
# site-packages live under ``…/lib/pythonX.Y/`` (``lib64``, ``python3`` for Debian's
# dist-packages, ``pypyX.Y``). An artifact may ship bytecode only for sources there.
_LIB = frozenset({"lib", "lib64", "lib32"})
_PYTHON_DIR = re.compile(r"(python|pypy)[0-9]+(\.[0-9]+)?t?")
# PEP 552 flags of a checked-hash pyc: hash-based (bit 0) and checked against its source (bit 1).
CHECKED_HASH = 0b11


def library_problem(source: str) -> str | None:
    """Why an artifact may not ship bytecode for ``source``, or None: it must be an absolute,
    normalized ``.py`` path in a library folder (``…/lib/pythonX.Y/…``, stdlib or
    site-packages), the only modules kiln ships (:func:`imported_sources`). What restore
    enforces of a manifest, without knowing the serving image."""
    head, _, name = source.rpartition("/")
    parts = head.split("/")[1:]
    if not source.startswith("/") or os.path.normpath(head or "/") != (head or "/"):
        return f"{source[:200]!r} is not an absolute, normalized path"
    if not name.endswith(".py") or name == ".py":
        return f"{source[:200]!r} is not a .py source"
    library = any(a in _LIB and _PYTHON_DIR.fullmatch(b) for a, b in itertools.pairwise(parts))
    if not library:
        return f"{source[:200]!r} is not a library module (under lib/pythonX.Y/)"
    return None


def pyc_path(source: str, tag: str) -> str:
    """Where the bytecode of ``source`` (checked by :func:`library_problem`) for the interpreter
    ``tag`` (``cpython-312``) lies in a ``sys.pycache_prefix`` tree: what :func:`prefix_path`
    gives in that interpreter, computed here for any (restore may run another Python)."""
    head, _, name = source.rpartition("/")
    return f"{head.lstrip('/')}/{name.removesuffix('.py')}.{tag}.pyc"


def header_problem(header: bytes, source_hash: str) -> str | None:
    """Why a pyc's first 16 bytes are not those of a checked-hash pyc of a source whose hash
    (:func:`importlib.util.source_hash`, hex) is ``source_hash``, or None."""
    if len(header) < 16:
        return "shorter than a pyc header"
    flags = int.from_bytes(header[4:8], "little")
    if flags != CHECKED_HASH:
        return f"not a checked-hash pyc (flags {flags:#x}): Python would not compare its source"
    if header[8:16].hex() != source_hash:
        return f"its source hash {header[8:16].hex()} is not the manifest's {source_hash}"
    return None


def _library_roots() -> tuple[str, ...]:
    """The interpreter's own folders: the standard library and site-packages. Modules elsewhere
    (the user's code, Inductor's generated modules in the cache folder) are not shipped."""
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(sorted({paths[k].rstrip("/") + "/" for k in keys if paths.get(k)}))


def imported_sources() -> list[str]:
    """The source files of the library modules this process imported, sorted."""
    roots = _library_roots()
    found = set()
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if (
            isinstance(source, str)
            and source.startswith(roots)
            and library_problem(source) is None  # what restore accepts
        ):
            found.add(source)
    return sorted(found)


# Compiles each (source, pyc) pair of stdin (NUL-separated: no path holds one); prints how many
# it wrote. Run in a fresh, isolated interpreter: marshal marks a constant shared by reference
# when the compiling process holds other references to it, so the same source compiles to other
# bytes in a process that has imported torch or sympy (equal code, unequal files), and shards
# would disagree.
_COMPILE = """
import py_compile, sys
paths = sys.stdin.read().split("\\0")
count = 0
for source, cfile in zip(paths[::2], paths[1::2]):
    try:
        py_compile.compile(source, cfile=cfile, doraise=True, optimize=0,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    except (py_compile.PyCompileError, OSError, ValueError):
        continue
    count += 1
print(count)
"""


def write(sources: Iterable[str], dest: Path) -> int:
    """Compile ``sources`` into ``dest`` as a ``sys.pycache_prefix`` tree of checked-hash
    pycs; returns how many were written. A source that no longer compiles is left out (Python
    compiles it at import, as it would without kiln). Deterministic: no timestamps, and the
    same bytes whichever process asks (:data:`_COMPILE`)."""
    jobs = []
    for source in sources:
        rel = prefix_path(source)
        if rel is not None and "\0" not in source and Path(source).is_file():
            jobs += [source, str(dest / rel)]
    if not jobs:
        return 0
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _COMPILE],
        input="\0".join(jobs),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def plain_env(folder: Path) -> dict[str, str]:
    """What a server on plain ``kiln.env`` sets itself to import from ``folder`` (the README's
    line), on an image without its own bytecode; nothing on one that has it."""
    if not folder.is_dir() or uncached_reason() is None:
        return {}
    return dict(zip(_CHILD_ENV, (str(folder), "1"), strict=True))


def use(folder: Path) -> str | None:
    """Import from ``folder`` (a restored artifact's ``bytecode/``) from now on, when torch's
    bytecode is not cached where this interpreter looks; returns what was done, or None.

    Call it before the imports it should serve: kiln's worker and ``kiln.activate()`` do
    before ``import torch`` (activate() once the torch build is the artifact's,
    :func:`kiln.installs.torch_build`, and :func:`stop` when the full check then refuses).
    Nothing when this interpreter does not check hash-based pycs (``--check-hash-based-pycs
    never``). Writing bytecode is turned off for the process, so the restored folder stays
    exactly as restored.
    """
    # Under -O Python looks for .opt-1 pycs, which the artifact does not hold.
    if not folder.is_dir() or sys.flags.optimize or uncached_reason() is None:
        return None
    if _imp.check_hash_based_pycs == "never":  # it would run them without comparing sources
        return (
            "the artifact's Python bytecode is unused: this interpreter does not check "
            "hash-based pycs against their sources (--check-hash-based-pycs never)"
        )
    init = _package_init()
    rel = prefix_path(str(init)) if init else None
    if rel is None or not (folder / rel).is_file():
        where = init.parent if init else "?"
        return (
            f"the artifact's Python bytecode does not cover this torch "
            f"({sys.implementation.cache_tag}, at {where}): modules compile from source"
        )
    before = {k: os.environ.get(k) for k in _CHILD_ENV}
    _REPLACED.setdefault(str(folder), (sys.pycache_prefix, sys.dont_write_bytecode, before))
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = True
    # Child interpreters of this image (Inductor's compile workers) lack it too.
    os.environ.update(dict(zip(_CHILD_ENV, (str(folder), "1"), strict=True)))
    return f"importing Python bytecode from {folder} (torch's is not cached here)"


def serving(folder: Path) -> bool:
    """Whether :func:`use` of ``folder`` set this process's imports to it, and they still are
    (not a prefix the interpreter started with, which :func:`stop` leaves alone)."""
    return str(folder) in _REPLACED and sys.pycache_prefix == str(folder)


def stop(folder: Path) -> bool:
    """Undo :func:`use` of ``folder``: later imports look where they did before (modules
    imported meanwhile stay imported). Whether there was anything to undo."""
    replaced = _REPLACED.pop(str(folder), None)
    if replaced is None or sys.pycache_prefix != str(folder):
        return False
    sys.pycache_prefix, sys.dont_write_bytecode, env = replaced
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return True


def served_modules(folder: Path) -> int:
    """How many of this process's modules were imported from ``folder``'s bytecode: their
    cached file is there and matches their source's hash, as Python checked before using it."""
    if sys.pycache_prefix != str(folder):
        return 0
    count = 0
    for module in list(sys.modules.values()):
        cached, source = getattr(module, "__cached__", None), getattr(module, "__file__", None)
        if not (isinstance(cached, str) and isinstance(source, str)):
            continue
        if cached.startswith(str(folder)) and _matches(Path(cached), Path(source)):
            count += 1
    return count


def _matches(cached: Path, source: Path) -> bool:
    """Whether ``cached`` is a hash-based pyc of ``source`` as it is now (PEP 552 header:
    magic, flags, then the source's hash)."""
    try:
        with cached.open("rb") as f:
            header = f.read(16)
        return (
            len(header) == 16
            and header[:4] == importlib.util.MAGIC_NUMBER
            and int.from_bytes(header[4:8], "little") & 0b1 == 1
            and header[8:16] == importlib.util.source_hash(source.read_bytes())
        )
    except OSError:
        return False
