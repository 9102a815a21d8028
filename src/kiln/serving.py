"""What a serving process needs from a restored folder: where things are and which environment.

One definition, shared by the bake (which compiles under it), restore (which writes ``kiln.env``),
``kiln.activate()``, verify and bench (which serve under it), so the no-code route and the proof
cannot drift apart. It is also kiln's trust rule for environment variables: an artifact comes
from elsewhere, and ``kiln.env`` is sourced by a shell in the pod, so the environment a manifest
may set is an allow-list of variables that change *compiled code*, never ones that move cache
locations, point at programs or libraries, or reach a remote cache. Torch-free.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

# --- the layout of an artifact and of a restored folder --------------------------------------
INDUCTOR_DIR = "inductor"  # DIR/inductor is TORCHINDUCTOR_CACHE_DIR
MEGACACHE_NAME = "megacache.bin"  # torch.compiler.save_cache_artifacts() blob
PRECOMPILED_NAME = "precompiled.bin"  # serialized AOT forwards (compile.precompile)
MANIFEST_NAME = "manifest.json"  # an artifact's first member; restore writes its own copy
ENV_NAME = "kiln.env"  # written by restore, never shipped
STATE_NAME = ".kiln-installed.json"  # written by restore, never shipped
# Top-level names restore writes itself: a manifest listing a file or folder under one is refused.
RESERVED_NAMES = frozenset({MANIFEST_NAME, ENV_NAME, STATE_NAME})

NAME_PATTERN = r"^[a-z0-9._-]+$"  # artifact names: safe in file names, comments and URLs
MAX_NAME_LENGTH = 128
ENV_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# --- environment rules -----------------------------------------------------------------------
# Variables that change what torch compiles or how it keys it: the only ones a spec or manifest
# may set. Everything else (LD_PRELOAD, PATH, PYTHONPATH, HOME, ...) is refused outright.
ENV_ALLOWED_PREFIXES = (
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "TORCH_",
    "TRITON_",
    "PYTORCH_",
    "CUDA_",
)
# Where caches live: kiln owns these. A worker never inherits them, a fingerprint ignores them
# (a restored cache lives at another path by design), and no spec or manifest may set them.
CACHE_LOCATION_VARS = frozenset(
    {
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "TRITON_HOME",
        "TRITON_DUMP_DIR",
        "TRITON_OVERRIDE_DIR",
        "TORCH_COMPILE_DEBUG_DIR",
        "TORCHINDUCTOR_REDIS_HOST",
        "TORCHINDUCTOR_REDIS_PORT",
    }
)
# Parts of a name that mark a remote cache or a pluggable cache backend (both reach outside the
# restored folder, and a backend names a Python class to import).
REMOTE_CACHE_MARKERS = ("REMOTE_CACHE", "_REDIS_", "CACHE_MANAGER", "CACHE_BACKEND")
# Endings that mark a location or a program/library to run (TRITON_PTXAS_PATH, CUDA_HOME, ...).
_LOCATION_SUFFIXES = ("_DIR", "_HOME", "_PATH", "_FILE", "_OUT", "_ROOT")
_REFUSED_EXACT = frozenset(
    {
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES",  # nothing could hit
        "TORCH_TRACE",  # a folder to write traces into
        "TORCH_LOGS_OUT",
    }
)


def is_cache_location(key: str) -> bool:
    """Whether ``key`` points torch at a cache (local or remote): never inherited by a worker."""
    return key in CACHE_LOCATION_VARS or any(m in key for m in REMOTE_CACHE_MARKERS)


def env_key_problem(key: str) -> str | None:
    """Why ``key`` may not be set by a spec or a manifest, or None when it may."""
    # fullmatch, not match: ``$`` also matches before a trailing newline, and "TORCH_X\n" would
    # split its ``export`` line in two.
    if not ENV_KEY_PATTERN.fullmatch(key):
        return f"{key!r} is not a shell variable name"
    if not key.startswith(ENV_ALLOWED_PREFIXES):
        prefixes = ", ".join(f"{p}*" for p in ENV_ALLOWED_PREFIXES)
        return f"{key} does not affect compilation (allowed: {prefixes})"
    if is_cache_location(key) or key in _REFUSED_EXACT or key.endswith(_LOCATION_SUFFIXES):
        return f"{key} moves a cache or names a file or program: kiln owns those"
    return None


def env_value_problem(key: str, value: str) -> str | None:
    """Why ``value`` cannot be exported as ``key``, or None when it can.

    Quoting makes any text safe for the shell, but a process environment cannot hold a NUL, and a
    lone surrogate (valid in JSON, not in UTF-8) cannot be encoded: ``kiln.activate()`` would
    crash on either instead of refusing the artifact.
    """
    if "\x00" in value:
        return f"the value of {key} holds a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"the value of {key} is not valid UTF-8"
    return None


def cache_env(dest: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The environment a serving process needs to hit the caches restored at ``dest``.

    ``env`` is the manifest's, already checked by :func:`env_key_problem`; kiln's own locations
    come last so nothing can override them.
    """
    return {
        **env,
        "TORCHINDUCTOR_CACHE_DIR": str(dest / INDUCTOR_DIR),
        "KILN_CACHE_DIR": str(dest),
    }


def env_file_text(dest: Path, name: str, env: Mapping[str, str]) -> str:
    """``kiln.env``: :func:`cache_env` as shell ``export`` lines, every value quoted.

    Keys are re-checked here even though the manifest reader checked them: this text is run by
    a shell, so it must be safe whatever the caller passed.
    """
    source = _comment(str(dest / ENV_NAME))
    lines = [f"# written by kiln restore for {_comment(name)}: `. {source}` to serve"]
    for key, value in cache_env(dest, env).items():
        if not ENV_KEY_PATTERN.fullmatch(key):
            raise ValueError(f"refusing to write environment key {key!r}")
        lines.append(f"export {key}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def _comment(text: str) -> str:
    """Text safe inside a one-line shell comment: no line breaks, printable only."""
    return "".join(c if c.isprintable() else "?" for c in text)
