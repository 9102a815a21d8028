"""Where this process's Inductor caches are, against the restored folder ``kiln check`` checks;
and a private folder for what checking itself compiles.

Two things ``kiln check DIR`` did not see, or did wrong:

- **Where the caches really are.** ``kiln.env`` records the absolute path DIR was restored at.
  Sourced after the folder was moved or copied, it points torch at the old path (or at nothing),
  every fingerprint factor still matches, and check said "compatible" while the server compiled
  everything. :func:`location_factor` compares ``TORCHINDUCTOR_CACHE_DIR`` as this process has it
  with DIR's own cache folder and names the difference as a miss.
- **Probes.** Fingerprinting asks Inductor which CPU vector ISAs work, and Inductor answers by
  compiling small probe libraries into its cache folder: ``$TMPDIR/torchinductor_$USER`` when
  none is set (left behind), DIR's own folder once ``kiln.env`` is sourced (written into the
  restored caches). :func:`probe_inductor_dir` gives them kiln's own per-user folder instead
  (``$XDG_CACHE_HOME/kiln/isa-probes``, default ``~/.cache/kiln/isa-probes``): torch keys each
  probe by its source and compile flags and still loads it every time, so a machine compiles
  them once, not ~7 s in every `kiln check` and `kiln env`. Where that folder cannot be
  written (a read-only home in a pod), a temporary folder that is removed, as before.

Needs torch only through the fingerprint it wraps.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from kiln.artifact.manifest import Manifest
from kiln.factors import Factor
from kiln.layout import CacheLayout
from kiln.serving import UNSET_ENV

CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
FACTOR = f"env.{CACHE_VAR}"
# The location factor compares no baked value: DIR's own cache folder, against the one this
# process's variable (from a kiln.env, perhaps another folder's) names.
SIDES = ("DIR's caches are in", "this process uses")


def served_layout(target: str | Path, manifest: Manifest, rank: int | None) -> CacheLayout | None:
    """The layout a server of the restored folder ``target`` (this rank's, of a K-rank
    artifact) uses; None for an artifact file, which is restored nowhere yet."""
    folder = Path(target)
    if not folder.is_dir():
        return None
    serving_rank = (rank or 0) if manifest.distributed is not None else None
    return CacheLayout(folder.absolute(), serving_rank)


def served_inductor(target: str | Path, manifest: Manifest, rank: int | None) -> Path | None:
    """The Inductor cache folder of :func:`served_layout`."""
    layout = served_layout(target, manifest, rank)
    return layout.inductor if layout is not None else None


def location_factor(
    target: str | Path,
    manifest: Manifest,
    rank: int | None,
    environ: Mapping[str, str] | None = None,
) -> Factor | None:
    """This process's ``TORCHINDUCTOR_CACHE_DIR`` against the restored folder ``target`` (None
    for an artifact file, which is restored nowhere yet). Unset is a note, not a miss: a server
    that calls ``kiln.activate(DIR)`` sets it itself. Set to anything but DIR's folder is a miss."""
    expected = served_inductor(target, manifest, rank)
    if expected is None:
        return None
    environ = os.environ if environ is None else environ
    here = environ.get(CACHE_VAR) or None
    if here is None:
        note = f"not set here: serve through kiln.activate(DIR), or source {target}/kiln.env"
        return Factor(FACTOR, str(expected), None, False, False, note, sides=SIDES)
    if os.path.realpath(here) == os.path.realpath(expected):
        note = "where this process's caches are"
        return Factor(FACTOR, str(expected), here, True, False, note, sides=SIDES)
    note = (
        "this process's caches are elsewhere, not in DIR: kiln.env records the path DIR was "
        "restored at (a moved or copied folder keeps the old one); restore at the path the "
        "server uses"
    )
    return Factor(FACTOR, str(expected), here, False, True, note, sides=SIDES)


def moved_cache_factors(environ: Mapping[str, str], inductor: Path | None) -> list[Factor]:
    """Each :data:`~kiln.serving.UNSET_ENV` variable this process has, unless it points into
    ``inductor`` (:func:`served_inductor`), where torch sets ``TRITON_CACHE_DIR`` itself at its
    first Triton kernel. A note, not a miss: kiln.env unsets it and activate() drops it (check
    judges the process as one of those will leave it), but a server that copies kiln.env's
    variables into its environment instead must not set it."""
    out = []
    for var in UNSET_ENV:
        here = environ.get(var)
        if not here:
            continue
        if inductor is not None and Path(os.path.realpath(here)).is_relative_to(
            os.path.realpath(inductor)
        ):
            continue
        note = (
            "kiln.env unsets it and kiln.activate() drops it; set in a server's own environment, "
            "Inductor keeps its Triton kernels there, not under DIR, and Triton builds their "
            "launchers again with gcc"
        )
        out.append(Factor(f"env.{var}", "unset", here, False, False, note))
    return out


PROBES_DIR = "isa-probes"


def probe_cache() -> Path | None:
    """kiln's per-user folder for Inductor's ISA probe libraries, made private (0700) on first
    use; None where it cannot be made or written."""
    base = os.environ.get("XDG_CACHE_HOME")
    folder = (Path(base) if base else Path("~/.cache").expanduser()) / "kiln" / PROBES_DIR
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK | os.X_OK) else None


@contextlib.contextmanager
def probe_inductor_dir() -> Iterator[Path]:
    """Point torch's Inductor cache at :func:`probe_cache` for the block (the fingerprint's ISA
    probes land there), or at a temporary folder removed after it when there is none; then put
    ``TORCHINDUCTOR_CACHE_DIR`` back as it was."""
    kept = probe_cache()
    if kept is not None:
        with environ_with({CACHE_VAR: str(kept)}):
            yield kept
        return
    with tempfile.TemporaryDirectory(prefix="kiln-check-") as tmp, environ_with({CACHE_VAR: tmp}):
        yield Path(tmp)


@contextlib.contextmanager
def environ_with(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``env`` on top for the block, then as it was."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
