"""kiln's trust rule for environment variables.

An artifact comes from elsewhere, and ``kiln.env`` is sourced by a shell in the pod, so the
environment a spec or a manifest may set is an allow-list of variables that change *compiled
code*, never ones that move cache locations, point at programs or libraries, or reach a remote
cache. Torch-free, and it imports nothing of kiln's: the spec, the manifest and the environment
kiln builds for its workers all check against it.
"""

from __future__ import annotations

import re

ENV_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

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
        "CUDA_CACHE_PATH",
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
        # Prefix-allowed, but not about compiled code: each changes what the serving process
        # trusts or sees (a review found them), so an artifact may not set them.
        "TORCH_FORCE_WEIGHTS_ONLY_LOAD",
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",  # would turn off torch.load's safe default
        "CUDA_VISIBLE_DEVICES",  # could hide or swap the serving GPU
        "TORCH_NVCC_FLAGS",  # compiler flags for extensions
        "TRITON_KERNEL_OVERRIDE",  # swaps kernels for files named elsewhere
        "TRITON_KERNEL_DUMP",
        "TORCH_COMPILE_DEBUG",  # writes debug trees beside the process
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
