"""The working directory of a served process, which the CUDA driver's JIT cache keys cuDNN's
runtime-compiled kernels by. Torch-free.

cuDNN builds some kernels at run time (its attention and fused engines that report
``CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION``): NVRTC compiles generated source to PTX, and the
driver compiles that PTX for the GPU and keeps the binary in its JIT cache, keyed by the PTX.
NVRTC writes the process's working directory into it (the source's compile-unit directory, as
``get_current_dir_name()`` gives it: ``$PWD`` when that names the working directory, else the
resolved path), so one kernel built in another folder is another cache entry. Measured (H100,
torch 2.11, cuDNN 9.19, the tiny GPT's SDPA, docs/first-process.md): the same 4 attention
kernels had other entry names in each of 4 folders, a symlink to one of them included, the same
names again in the same folder, and the same names whatever the order, ``TMPDIR`` or ``HOME``;
each entry holds the folder's path next to its kernel's ``.cu`` name. A shipped driver cache
therefore serves only a process that runs where the bake's processes ran. So the bake runs
them in ``serve.workdir`` (the server's own, e.g. the image's ``WORKDIR``), the manifest
records it when shipped entries carry it (:class:`~kiln.artifact.manifest.Workdir`), verify
serves there, and ``kiln check``, ``kiln.activate()`` and ``kiln.env`` name a server that
runs elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from kiln.factors import Factor

FACTOR = "process.workdir"
MAX_WORKDIR_LENGTH = 1024  # characters of serve.workdir, and of a manifest's workdir
# What an entry keyed by a folder holds: its kernel's source name, then the folder's path.
_SOURCE_SUFFIX = b".cu"


def workdir_problem(path: str) -> str | None:
    """What is wrong with ``path`` as a recorded working directory (a spec's ``serve.workdir``,
    a manifest's, which ``kiln.env`` quotes into shell code), or None."""
    if not path.startswith("/"):
        return "must be an absolute path"
    if len(path) > MAX_WORKDIR_LENGTH or not path.isprintable():
        return f"must be at most {MAX_WORKDIR_LENGTH} printable characters"
    if os.path.normpath(path) != path:  # `..`, `.`, `//` or a trailing `/`: not a shell's $PWD
        return f"must be written as a shell names it ({os.path.normpath(path)})"
    return None


def logical_cwd(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's working directory as NVRTC names it (glibc's ``get_current_dir_name``):
    ``$PWD`` when it is absolute and names the working directory, else the resolved path;
    None when it has been removed."""
    environ = os.environ if environ is None else environ
    pwd = environ.get("PWD", "")
    if pwd.startswith("/"):
        with contextlib.suppress(OSError):
            if Path(pwd).samefile("."):
                return pwd
    try:
        return str(Path.cwd())
    except OSError:
        return None


def process_env(workdir: Path) -> dict[str, str]:
    """The variables a process started in ``workdir`` needs to name it as a shell started
    there would (``PWD``: a symlinked path stays the path given)."""
    return {"PWD": str(workdir)}


def served_in(declared: str | None) -> Path | None:
    """Where verify, bench and the bake's proof serve: the spec's ``serve.workdir`` where it
    exists here, so that they prove what a server started there does; else None, their own
    folder, and the served process's check names a difference from the manifest's. Never the
    manifest's own: an artifact is untrusted input, and ``python -m`` imports from the folder
    it starts in first."""
    return Path(declared) if declared is not None and Path(declared).is_dir() else None


def keyed_entries(files: Iterable[Path], workdir: str) -> int:
    """How many of the driver cache entries ``files`` carry ``workdir`` (JIT-compiled there)."""
    mark = _SOURCE_SUFFIX + os.fsencode(workdir)
    return sum(1 for f in files if mark in f.read_bytes())


def workdir_factor(baked: str | None, here: str) -> Factor | None:
    """``here`` against the folder the shipped driver entries were JIT-compiled in; None when
    the artifact ships none keyed by a folder."""
    if baked is None:
        return None
    same = baked == here
    note = (
        "the CUDA driver's JIT cache keys cuDNN's runtime-compiled kernels by the working "
        "directory: start the server there (or bake with serve.workdir set to the server's)"
    )
    return Factor(FACTOR, baked, here, same, not same, "" if same else note)


def env_lines(baked: str) -> list[str]:
    """POSIX sh for ``kiln.env``: one line on stderr when the shell that sources it runs
    elsewhere than ``baked`` (its server will JIT-compile those kernels again)."""
    path = shlex.quote(baked)
    return [
        f'if [ "${{PWD:-}}" != {path} ]; then',
        "  printf 'kiln.env: this process runs in %s; the CUDA driver kernels in the artifact"
        " were JIT-compiled in %s and are keyed by it: cuDNN compiles them again here at each"
        ' new shape (start the server there, or bake with serve.workdir)\\n\' "${PWD:-}" '
        f"{path} >&2",
        "fi",
    ]
