"""What a compiling or serving process needs: its environment and its arguments.

One definition, shared by the bake (which compiles under it), restore (which writes ``kiln.env``),
``kiln.activate()``, verify and bench (which serve under it), so the no-code route and the proof
cannot drift apart:

- the environment: what a bake compiles under (:func:`compile_env`), what every kiln worker
  process starts with (:func:`worker_env`), what a serving process needs (:func:`cache_env`);
- the ``torch.compile`` arguments: what a spec compiles with (:func:`torch_kwargs`,
  :func:`cold_torch_kwargs`) and what a restored artifact must be served with
  (:func:`served_torch_kwargs`).

The folders those processes use are :mod:`kiln.layout`'s; which variables a spec or an artifact
may set is :mod:`kiln.envrules`'. Torch-free, and at run time it imports only those two of
kiln's: the spec and the manifest import it, not the reverse.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from kiln.envrules import ENV_KEY_PATTERN, is_cache_location
from kiln.layout import CacheLayout
from kiln.workdir import env_lines as workdir_lines


# What this module reads of the spec and the manifest, which both import it: structural types,
# so the lowest module is typed against the fields it uses, not against the models above it.
class CompileSection(Protocol):
    """A spec's ``compile`` section (:class:`kiln.spec.CompileSpec`)."""

    @property
    def backend(self) -> str: ...
    @property
    def mode(self) -> str | None: ...
    @property
    def dynamic(self) -> bool | None: ...
    @property
    def fullgraph(self) -> bool: ...
    @property
    def options(self) -> Mapping[str, Any]: ...
    @property
    def autotunes(self) -> bool: ...


class ModelSection(Protocol):
    """A spec's ``model`` section (:class:`kiln.spec.ModelSpec`), as far as the device goes."""

    @property
    def device(self) -> str: ...


class CompiledSpec(Protocol):
    """A spec (:class:`kiln.spec.Spec`), as far as its compile environment goes."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> ModelSection: ...
    @property
    def compile(self) -> CompileSection: ...
    def compile_env(self) -> dict[str, str]: ...


class Recorded(Protocol):
    """A manifest (:class:`kiln.artifact.manifest.Manifest`), as far as its compile arguments go."""

    @property
    def compile_kwargs(self) -> Mapping[str, Any] | None: ...
    @property
    def spec(self) -> Mapping[str, Any]: ...


# --- names, ranks and routes ------------------------------------------------------------------
MAX_WORLD_SIZE = 64  # ranks of one launch: a spec's distributed.world_size, a manifest's ranks
# Where a serving process learns its rank: torchrun sets both (RANK is global, LOCAL_RANK the
# machine's); the first one set wins.
RANK_VARS = ("RANK", "LOCAL_RANK")

# Where compile.route: aoti's packages get their weights: handed in from the serving model's
# own parameters (``external``, the default: small artifacts, one per architecture) or built
# into each package (``embed``: self-contained, the model's weights at bake time).
AotiWeights = Literal["external", "embed"]

NAME_PATTERN = r"^[a-z0-9._-]+$"  # artifact names: safe in file names, comments and URLs
MAX_NAME_LENGTH = 128

# --- what a served callable does with a request outside the baked grid -------------------------
# One policy for every serving route that knows the grid (padding to buckets, kiln.padding; an
# ahead-of-time route): ``error`` raises, ``eager`` runs the uncompiled model, ``compile`` lets
# torch compile the new shape in the serving process (what plain torch.compile does). Each is
# counted and logged once per shape. A spec sets it as ``compile.on_miss``; a server may pass
# its own to ``Activation.compile``.
OnMiss = Literal["error", "eager", "compile"]
ON_MISS: tuple[OnMiss, ...] = ("error", "eager", "compile")
DEFAULT_ON_MISS: OnMiss = "error"

# --- the environment of compiling and serving processes ----------------------------------------
# Inductor settings every bake compiles with unless the spec sets them itself (they are part of
# Inductor's cache key, so the manifest's ``env`` carries them to the served process):
COMPILE_DEFAULTS = {
    # A precompiled C++ header lives in torch's default temp folder, outside the cache root, and
    # torch runs g++ over torch's headers to key it in every new process, even when every kernel
    # hits: a pod paid seconds of g++ on its first request (2.13 CPU: 6.8 s against 0.3 s).
    "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
}
# And on a GPU:
GPU_COMPILE_DEFAULTS = {
    # A reduction kernel whose configs use many registers gets a config with a smaller R0_BLOCK
    # added as it loads (`_dynamic_scale_rblock`), in every process, and then benchmarks its
    # configs; torch 2.11 reads a `.best_config` back only when it names a config of the
    # kernel's compiled list (2.13 rebuilds others: `_reconstruct_triton_config`), so such a
    # kernel benchmarked again in every process, the bake's proof and every pod's first request
    # included (H100, llm-default at batch 16 x seq 2048: the RMSNorm after the embedding, two
    # configs at 0.093 and 0.094 ms). Without the added config a restored process reads each
    # kernel's tuning result back.
    "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": "0",
}
# What every served process runs with, outside Inductor's cache key (kiln.env, activate(),
# verify, bench and the proof alike):
SERVING_ENV = {
    # Loading kernels in Inductor's compile worker pool is a race with the pool's start-up:
    # a kernel loaded there comes back pickled without its tuning state and is benchmarked
    # again (H200: 38 kernels re-tuned, 188 benchmarks, in one first process of three, default
    # mode). A served process compiles nothing, so it loads every kernel in-process.
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}
# What goes wrong when a server overrides one (kiln check names it).
SERVING_NOTES = {
    "TORCHINDUCTOR_COMPILE_THREADS": "a compile pool loads kernels without their tuning state "
    "and benchmarks them again",
}


def compile_env(spec: CompiledSpec) -> dict[str, str]:
    """Environment the bake compiles under and every serving process must share.

    :data:`COMPILE_DEFAULTS` (and :data:`GPU_COMPILE_DEFAULTS` on a GPU), the spec's ``env``
    (its keys passed :func:`~kiln.envrules.env_key_problem` when it parsed) over them, and for
    automatic or dynamic shapes a pinned ``TORCH_COMPILE_JOB_ID``: the PGO profile torch
    writes during the bake is keyed by job id, so a pod reads back the one the bake wrote,
    unless the spec chose an id itself. The manifest records the result as its ``env``.
    """
    defaults = COMPILE_DEFAULTS | (GPU_COMPILE_DEFAULTS if spec.model.device == "cuda" else {})
    env = defaults | spec.compile_env()
    if spec.compile.dynamic is not False:
        env.setdefault("TORCH_COMPILE_JOB_ID", f"kiln-{spec.name}")
    return env


def worker_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a ``kiln.compiler.worker`` process, ``extra`` on top.

    Inherited environment is the enemy of reproducible caches: a user's
    ``TORCHINDUCTOR_CACHE_DIR`` would leak entries into a bake, a remote-cache switch would make a
    verify hit over the network. So the child gets this process's environment minus every
    :func:`~kiln.envrules.is_cache_location` variable, with the folder that holds this ``kiln``
    package first on ``PYTHONPATH`` (the worker runs the same kiln as its parent, installed or
    not).
    """
    env = {k: v for k, v in os.environ.items() if not is_cache_location(k)}
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def serving_rank(world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """This process's rank among ``world_size``, from ``RANK`` or else ``LOCAL_RANK``.

    Raises ValueError, naming the variable, when neither is set or the value is no rank of this
    artifact: serving rank 1 from rank 0's caches would compile everything, silently.
    """
    environ = os.environ if environ is None else environ
    for var in RANK_VARS:
        text = environ.get(var)
        if text is None or text == "":
            continue
        if not (text.isdecimal() and str(int(text)) == text and int(text) < world_size):
            raise ValueError(f"{var}={text!r} is not a rank of this {world_size}-rank artifact")
        return int(text)
    raise ValueError(
        f"a {world_size}-rank artifact needs RANK or LOCAL_RANK to pick its rank's caches "
        "(set in each rank's process, as torchrun does)"
    )


def location_env(layout: CacheLayout) -> dict[str, str]:
    """Where a process keeps the caches kiln ships, as the variables that put them there: the
    one list of them for a bake's workers, a served process and ``kiln.env`` (each is a
    :data:`~kiln.envrules.CACHE_LOCATION_VARS` entry, kiln's to set). A relative ``layout`` gives
    each folder's name."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(layout.inductor),
        # Triton's native helpers (kiln.layout.TRITON_HOME_DIR says why they ship).
        "TRITON_HOME": str(layout.triton_home),
        # The CUDA driver's JIT cache (kiln.layout.CUDA_CACHE_DIR).
        "CUDA_CACHE_PATH": str(layout.cuda_cache),
    }


# What a served process must not have set: each would move a cache kiln ships out of DEST. With
# TRITON_CACHE_DIR set, Inductor keeps its Triton kernels there instead of in its own cache
# folder's triton/<device> (torch._inductor.runtime.cache_dir_utils.triton_cache_dir), so the
# kernels and launchers the artifact ships are never looked for: Triton compiles the kernels and
# builds their launchers again in every new pod (measured: docs/first-process.md). kiln.env
# unsets them, activate() drops them from the process's environment, ``kiln check`` names one
# that is set; bake and verify workers never inherit them (:func:`worker_env`).
UNSET_ENV = ("TRITON_CACHE_DIR",)
# The restored folder, as kiln.env and activate() export it (for a K-rank artifact, the top).
CACHE_DIR_VAR = "KILN_CACHE_DIR"


def cache_env(dest: Path, env: Mapping[str, str], rank: int | None = None) -> dict[str, str]:
    """The environment a serving process needs to hit the caches restored at ``dest``.

    ``env`` is the manifest's, already checked by :func:`~kiln.envrules.env_key_problem`; then
    :data:`SERVING_ENV`; kiln's own locations come last so nothing can override them. ``rank``:
    this process's rank in a K-rank artifact (its caches are in its :class:`CacheLayout`);
    :data:`CACHE_DIR_VAR` stays the restored folder.
    """
    return {
        **env,
        **SERVING_ENV,
        **location_env(CacheLayout(dest, rank)),
        CACHE_DIR_VAR: str(dest),
    }


# --- the CUDA driver's JIT cache on a read-only folder -----------------------------------------
# The driver uses its JIT cache only in a folder it can write: on a read-only mount of DEST
# (a Kubernetes volume mounted read-only in the serving container, an image layer) it compiles
# every PTX-only kernel again, as with CUDA_CACHE_DISABLE=1 (H100, the 8-layer LLM on the AOT
# route: each bucket's first call 0.47-0.76 s read-only against 0.05-0.18 s writable, and
# 0.07-0.24 s from a writable copy; docs/benchmarks.md). So a process serving a read-only DEST
# points CUDA_CACHE_PATH at a private copy, ``$TMPDIR/kiln-cuda-cache-EUID-DIGEST[-rR]`` (``/tmp``
# when TMPDIR is unset or relative). The copy is made in a fresh 0700 folder beside it and
# renamed into place whole, so no process ever sees half a copy, and a published copy is never
# removed (its path must not come free for another user of a shared /tmp to take); it is used
# only while it is a real folder owned by this user and closed to others. kiln.env
# (:func:`_cuda_copy_lines`) and activate() (:func:`served_cuda_cache`) follow this one rule;
# the driver keys entries by content, so a copy left from an earlier restore at the same path is
# a cache that misses, not a wrong kernel. (busybox's ``test -w`` does not see a read-only
# mount, so a kiln.env sourced by busybox sh does not copy: the driver goes without its cache.)
CUDA_COPY_PREFIX = "kiln-cuda-cache"
_NO_CACHE = "the CUDA driver compiles without its JIT cache"


def _cuda_copy_digest(dest: Path) -> str:
    return hashlib.sha256(str(dest).encode()).hexdigest()[:16]


def cuda_cache_copy(dest: Path, rank: int | None, environ: Mapping[str, str]) -> Path:
    """Where a process serving a read-only ``dest`` keeps its copy of the driver's JIT cache."""
    suffix = "" if rank is None else f"-r{rank}"
    name = f"{CUDA_COPY_PREFIX}-{os.geteuid()}-{_cuda_copy_digest(dest)}{suffix}"
    tmp = environ.get("TMPDIR") or ""
    return Path(tmp if tmp.startswith("/") else "/tmp", name)


def served_cuda_cache(
    dest: Path, rank: int | None, environ: Mapping[str, str] | None = None
) -> tuple[Path, str | None]:
    """The ``CUDA_CACHE_PATH`` a process serving ``dest`` uses, and a note when it is not
    DEST's own (a read-only DEST, :data:`CUDA_COPY_PREFIX` says why)."""
    cache = CacheLayout(dest, rank).cuda_cache
    if not cache.is_dir() or os.access(cache, os.W_OK):
        return cache, None
    copy = cuda_cache_copy(dest, rank, os.environ if environ is None else environ)
    if not os.path.lexists(copy):
        try:
            part = Path(tempfile.mkdtemp(prefix=f"{copy.name}.", dir=copy.parent))
        except OSError as exc:
            return cache, f"{cache} is read-only and no copy could be made ({exc}): {_NO_CACHE}"
        try:
            _copy_writable(cache, part)
            part.rename(copy)  # fails when another process published its copy first
        except OSError as exc:
            shutil.rmtree(part, ignore_errors=True)
            if not os.path.lexists(copy):
                return cache, f"{cache} is read-only and copying it failed ({exc}): {_NO_CACHE}"
    if not _own_closed_folder(copy):
        return cache, f"{cache} is read-only and {copy} is not this user's own folder: {_NO_CACHE}"
    return copy, f"{cache} is read-only: the CUDA driver's JIT cache is served from {copy}"


def _own_closed_folder(path: Path) -> bool:
    """Whether ``path`` is a real folder (not a link) of this user's that no one else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _copy_writable(source: Path, target: Path) -> None:
    """Copy the tree ``source`` into the existing folder ``target``, every file and folder
    writable by its owner only (the driver rewrites its index; no mode of DEST's comes along)."""
    for root, dirs, files in os.walk(source):
        here = target / Path(root).relative_to(source)
        for name in dirs:
            (here / name).mkdir(mode=0o700, exist_ok=True)
        for name in files:
            shutil.copyfile(Path(root, name), here / name)
            (here / name).chmod(0o600)


def _cuda_copy_lines(dest: Path, rank_var: str | None) -> list[str]:
    """POSIX sh for :func:`served_cuda_cache`, run after ``CUDA_CACHE_PATH`` is exported:
    ``rank_var`` names the shell variable holding a checked rank (a K-rank artifact). Safe under
    ``set -eu``: every command that may fail is tested; without ``id``, ``mktemp`` or an ``mv``
    with ``-T`` (GNU, busybox) it copies nothing and says so."""
    name = f"{CUDA_COPY_PREFIX}-$kiln_uid-{_cuda_copy_digest(dest)}"
    if rank_var is not None:
        name += f'-r"${rank_var}"'
    return [
        'if [ -d "$CUDA_CACHE_PATH" ] && [ ! -w "$CUDA_CACHE_PATH" ]; then',
        '  kiln_tmp="${TMPDIR:-/tmp}"',
        '  case "$kiln_tmp" in /*) ;; *) kiln_tmp=/tmp ;; esac',
        "  kiln_uid=$(id -u 2>/dev/null) || kiln_uid=",
        f'  kiln_copy="$kiln_tmp"/{name}',
        '  if [ -n "$kiln_uid" ] && [ ! -e "$kiln_copy" ] && [ ! -L "$kiln_copy" ]; then',
        '    if kiln_part=$(mktemp -d "$kiln_copy.XXXXXX" 2>/dev/null); then',
        '      if cp -R "$CUDA_CACHE_PATH"/. "$kiln_part"/ 2>/dev/null &&'
        ' chmod -R u+w "$kiln_part"; then',
        "        # -T: never into a copy another process published first (rename(2) fails)",
        '        mv -T "$kiln_part" "$kiln_copy" 2>/dev/null || :',
        "      fi",
        '      rm -rf "$kiln_part"  # what is left of ours: a failed copy, or one that lost',
        "    fi",
        "  fi",
        '  if [ -n "$kiln_uid" ] && [ -d "$kiln_copy" ] && [ ! -L "$kiln_copy" ] &&'
        ' [ -O "$kiln_copy" ]; then',
        "    printf '%s\\n' \"kiln.env: $CUDA_CACHE_PATH is read-only: the CUDA driver's JIT"
        ' cache is served from $kiln_copy" >&2',
        '    export CUDA_CACHE_PATH="$kiln_copy"',
        "  else",
        "    printf '%s\\n' \"kiln.env: $CUDA_CACHE_PATH is read-only and no copy of it could be"
        f' made: {_NO_CACHE}" >&2',
        "  fi",
        "  unset kiln_tmp kiln_uid kiln_copy kiln_part",
        "fi",
    ]


def env_file_text(
    dest: Path,
    name: str,
    env: Mapping[str, str],
    world: int | None = None,
    workdir: str | None = None,
) -> str:
    """``kiln.env``: :func:`cache_env` as shell ``export`` lines, every value quoted, then an
    ``unset`` of :data:`UNSET_ENV`; with ``workdir`` (the folder the shipped driver entries are
    keyed by, kiln.workdir), a line on stderr when the sourcing shell runs elsewhere.

    Keys are re-checked here even though the manifest reader checked them: this text is run by
    a shell, so it must be safe whatever the caller passed. For a K-rank artifact (``world``
    K, as in :meth:`CacheLayout.ranks`: None for an artifact without ``distributed``) the cache
    folder depends on the rank of the process that sources the file, so that one line is shell
    code (:func:`_rank_lines`): the restored path stays single-quoted, the rank is checked to be
    a number below K before it is used, and nothing else is expanded.
    """
    source = _comment(str(CacheLayout(dest).env_file))
    lines = [f"# written by kiln restore for {_comment(name)}: `. {source}` to serve"]
    if world is not None:
        lines.append(f"# {world} ranks: source it in each rank's process (RANK or LOCAL_RANK)")
    for key, value in cache_env(dest, env).items():
        if not ENV_KEY_PATTERN.fullmatch(key):
            raise ValueError(f"refusing to write environment key {key!r}")
        if key in _RANK_PATHS and world is not None:
            if key == "TORCHINDUCTOR_CACHE_DIR":
                lines.extend(_rank_lines(dest, world))
            continue
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(f"unset {' '.join(UNSET_ENV)}")
    if world is None:
        lines.extend(_cuda_copy_lines(dest, None))
    if workdir is not None:
        lines.extend(workdir_lines(workdir))
    return "\n".join(lines) + "\n"


_RANK_PATHS = location_env(CacheLayout())  # each variable's folder name in a rank's folder


def _rank_lines(dest: Path, world_size: int) -> list[str]:
    """POSIX sh that exports each of :data:`_RANK_PATHS` for the sourcing process's rank.

    ``$RANK`` (else ``$LOCAL_RANK``) must be a plain decimal number (no sign, no leading zero)
    below ``world_size``; otherwise the variable is unset and one line on stderr says why, so
    the server runs without a cache folder rather than with another rank's (``kiln verify`` then
    fails on the compiles). The rank is only used, double-quoted, after that check; the path
    around it is single-quoted like every other value.
    """
    base = shlex.quote(str(CacheLayout(dest).ranks_dir))
    exports = [
        f'  export {key}={base}/"$kiln_rank"/{shlex.quote(name)}'
        for key, name in _RANK_PATHS.items()
    ]
    copy = [f"  {line}" for line in _cuda_copy_lines(dest, "kiln_rank")]
    return [
        'kiln_rank="${RANK:-${LOCAL_RANK:-}}"',
        "kiln_rank_ok=0",
        'case "$kiln_rank" in',
        f'  0|[1-9]|[1-9][0-9]) [ "$kiln_rank" -lt {world_size} ] && kiln_rank_ok=1 ;;',
        "esac",
        'if [ "$kiln_rank_ok" = 1 ]; then',
        *exports,
        *copy,
        "else",
        f"  unset {' '.join(_RANK_PATHS)}",
        f"  printf '%s\\n' \"kiln.env: RANK/LOCAL_RANK='$kiln_rank' is not a rank of this"
        f' {world_size}-rank artifact: no cache folder set" >&2',
        "fi",
        "unset kiln_rank kiln_rank_ok",
    ]


def _comment(text: str) -> str:
    """Text safe inside a one-line shell comment: no line breaks, printable only."""
    return "".join(c if c.isprintable() else "?" for c in text)


# --- torch.compile arguments -----------------------------------------------------------------
# torch._inductor.list_mode_options(), restated so that parsing a spec stays torch-free
# (tests/test_spec.py holds it to torch's table).
MODE_OPTIONS: dict[str, dict[str, bool]] = {
    "default": {},
    "reduce-overhead": {"triton.cudagraphs": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune": {
        "max_autotune": True,
        "triton.cudagraphs": True,
        "coordinate_descent_tuning": True,
    },
}
_TUNING_OPTIONS = ("max_autotune", "coordinate_descent_tuning")

# What an autotuning spec adds to its Inductor options (part of Inductor's cache key, so the
# manifest's compile_kwargs carries it to the server), and why:
AUTOTUNE_LOADING: dict[str, Any] = {
    # On an FX hit, statically launchable kernels come back as autotuners pickled at compile
    # time, holding the bake's absolute source path and (torch <= 2.11) without their
    # coordinate-descent flag (pytorch#172819), so they tune again; kernels loaded from source
    # read the `.best_config` beside the restored source. (Other specs keep the static launcher:
    # the bake tunes before it compiles what ships, kiln.compiler.bake.)
    "use_static_cuda_launcher": False,
    # A kernel loaded in the compile worker pool returns to the parent pickled, and
    # triton.Config.__setstate__ (3.6) keeps only its own fields, so `found_by_coordesc` is
    # dropped and the first call tunes again. Whether the pool is ready yet is a race, so
    # restored runs re-tuned only sometimes (H200: 134 benchmarks and 71 new cubins through a
    # ready pool, 0 and 0 with this setting; docs/benchmarks.md, Findings).
    "compile_threads": 1,
}


def inductor_options(mode: str | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """The Inductor settings a compile section means, whether spelled as ``mode`` or ``options``."""
    return dict(options) if options else dict(MODE_OPTIONS[mode or "default"])


def autotunes(options: Mapping[str, Any]) -> bool:
    """Whether these Inductor settings tune kernels, whose results a fresh process must re-read."""
    return any(bool(options.get(k)) for k in _TUNING_OPTIONS)


def torch_kwargs(compile: CompileSection) -> dict[str, Any]:
    """Keyword arguments for ``torch.compile`` exactly as a serving process must pass them.

    Autotuning specs get the settings in :data:`AUTOTUNE_LOADING`, which make a warm process use
    the tuning results it is given instead of benchmarking again; a key the spec sets itself
    stands. ``use_static_cuda_launcher`` is part of Inductor's cache key, so a server must compile
    with these arguments (the manifest records them as ``compile_kwargs``).
    """
    return _compile_kwargs(
        compile.backend,
        compile.mode,
        compile.dynamic,
        compile.fullgraph,
        compile.options,
    )


def _compile_kwargs(
    backend: str,
    mode: str | None,
    dynamic: bool | None,
    fullgraph: bool,
    options: Mapping,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
    settings = inductor_options(mode, options)
    if autotunes(settings):
        kwargs["options"] = settings | {
            k: v for k, v in AUTOTUNE_LOADING.items() if k not in settings
        }
    elif options:
        kwargs["options"] = dict(options)
    else:
        kwargs["mode"] = mode or "default"
    return kwargs


def cold_torch_kwargs(compile: CompileSection) -> dict[str, Any]:
    """:func:`torch_kwargs` for a compile that starts from an empty cache (a bake's first pass).

    Only a warm process must load kernels in-process; a cold one compiles hundreds of kernels,
    which Inductor's worker pool does in parallel. ``compile_threads`` is outside the cache key,
    so what this compiles, a process with :func:`torch_kwargs` finds.
    """
    kwargs = torch_kwargs(compile)
    if compile.autotunes and "compile_threads" not in compile.options:
        return with_compile_threads(kwargs, None)
    return kwargs


def with_compile_threads(kwargs: Mapping[str, Any], threads: int | None) -> dict[str, Any]:
    """``kwargs`` with Inductor's compile thread count set (``None``: torch's default).

    A ``mode`` becomes its options, since torch.compile takes one or the other. The count is
    outside Inductor's cache key, so the result hits what ``kwargs`` compiled.
    """
    out = dict(kwargs)
    options = out.pop("options", None)
    if options is None:
        options = MODE_OPTIONS[out.pop("mode", None) or "default"]
    options = {k: v for k, v in options.items() if k != "compile_threads"}
    if threads is not None:
        options["compile_threads"] = threads
    return out | {"options": options}


def served_torch_kwargs(manifest: Recorded) -> dict[str, Any]:
    """The ``torch.compile`` arguments a serving process must pass to hit ``manifest``'s caches.

    What the bake recorded (``compile_kwargs``), never what this kiln would derive from the spec
    today; only an artifact baked before kiln recorded them falls back to its spec's ``compile``
    section, read as that kiln wrote it.
    """
    if manifest.compile_kwargs is not None:
        return dict(manifest.compile_kwargs)
    section = manifest.spec["compile"]
    return _compile_kwargs(
        section["backend"],
        section.get("mode"),
        section["dynamic"],
        section["fullgraph"],
        section.get("options") or {},
    )
