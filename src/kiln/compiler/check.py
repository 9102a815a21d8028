"""Check: would a baked cache hit in *this* environment? Names every factor that differs.

This is the "why did my pod recompile?" answer: torch folds the torch build, Triton, CUDA, GPU,
device index, Inductor config and some environment into its cache keys and says nothing when
they differ. We compare the manifest's fingerprint with the live one, factor by factor.
Needs torch (it fingerprints the live process) but does no GPU work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.artifact.archive import read_manifest
from kiln.artifact.manifest import Manifest
from kiln.compiler.location import (
    environ_with,
    location_factor,
    moved_cache_factors,
    probe_inductor_dir,
    served_layout,
)
from kiln.errors import IncompatibleError
from kiln.factors import Factor, compare, misses
from kiln.kernel_locks import locks_factor
from kiln.serving import SERVING_ENV, SERVING_NOTES
from kiln.workdir import logical_cwd, workdir_factor


@dataclass
class CheckReport:
    name: str
    factors: list[Factor]
    baked: dict[str, Any] = field(repr=False)
    here: dict[str, Any] = field(repr=False)
    route: str = "compile"  # the artifact's compile.route: what a miss stops

    @property
    def differing(self) -> list[Factor]:
        return [f for f in self.factors if not f.matches]

    @property
    def misses(self) -> list[Factor]:
        return misses(self.factors)

    @property
    def ok(self) -> bool:
        return not self.misses

    def miss_message(self) -> str:
        """One line naming each factor that makes caches miss, baked value against this one.

        The one wording of an incompatibility: `kiln check` exits 5 with it and
        :func:`kiln.activate` raises or warns with it, so both point at the same fix.
        """
        names = ", ".join(f.described() for f in self.misses)
        what = "caches will miss"
        if self.route == "aoti":
            what = "AOTInductor packages will not serve as baked"
        return f"{self.name}: {what}: {names}"

    def error(self) -> IncompatibleError:
        """:meth:`miss_message` as the exit-5 error, with this report as its JSON detail."""
        return IncompatibleError(self.miss_message(), detail=self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "factors": [f.to_dict() for f in self.factors],
            "misses": [f.name for f in self.misses],
        }


def compare_manifest(
    manifest: Manifest,
    here: dict[str, Any],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    workdir: str | None = None,
) -> CheckReport:
    """``here`` against what the manifest baked: for a K-rank artifact, rank ``rank``'s
    fingerprint (rank 0's when None), and the rank and world size as factors of their own;
    ``workdir``, the serving process's (:func:`kiln.workdir.logical_cwd`), against the one the
    shipped driver entries are keyed by."""
    baked = manifest.fingerprint
    if manifest.distributed is not None and rank is not None and rank < manifest.world_size:
        baked = manifest.distributed.ranks[rank].fingerprint
    route = manifest.route
    factors = compare(baked, here, route) + rank_factors(manifest, rank, world_size)
    keyed_by = manifest.workdir.path if manifest.workdir else None
    if workdir is not None and (where := workdir_factor(keyed_by, workdir)) is not None:
        factors.append(where)
    if manifest.precompiled_frames is not None:
        factors = [_frames_python(f) if f.name == "python" else f for f in factors]
    disabled = os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0") not in ("", "0")
    if disabled and route == "compile":  # the aoti route reads no cache
        factors.append(
            Factor(
                "env.TORCHINDUCTOR_FORCE_DISABLE_CACHES",
                None,
                os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"],
                False,
                True,
                "disables every cache: nothing can hit",
            )
        )
    return CheckReport(manifest.name, factors, baked, here, route)


def _frames_python(factor: Factor) -> Factor:
    """Saved frames are bytecode: torch refuses them under any other Python (patch level too)
    and traces instead, so for them a Python difference is a miss, not a note."""
    if factor.matches:
        return factor
    note = "saved frames are this Python's bytecode: torch traces again under another one"
    return Factor(factor.name, factor.baked, factor.here, False, True, note)


def rank_factors(manifest: Manifest, rank: int | None, world_size: int | None) -> list[Factor]:
    """The world size and rank this process serves as, against the artifact's ranks.

    ``None`` means unknown here (not in a launch): said, never guessed. A K-rank artifact's
    rank R has only its own shard's graphs, so a rank outside 0..K-1 or another world size
    misses everything; a 1-rank artifact served by K ranks is only noted (replicas of one model
    hit the same graphs, and cuda:N is judged as ``device.index``).
    """
    baked = manifest.world_size
    out: list[Factor] = []
    if manifest.distributed is None:
        if world_size is not None and world_size > 1:
            out.append(
                Factor(
                    "distributed.world_size",
                    1,
                    world_size,
                    False,
                    False,
                    "a 1-rank artifact: every rank serves rank 0's graphs (fine for replicas)",
                )
            )
        return out
    note = "each rank compiled its own shard: ranks and world size must be the baked ones"
    if world_size is None:
        out.append(Factor("distributed.world_size", baked, None, True, False, "not in a launch"))
    else:
        same = world_size == baked
        out.append(Factor("distributed.world_size", baked, world_size, same, not same, note))
    if rank is None:
        out.append(Factor("distributed.rank", f"0..{baked - 1}", None, True, False, "no rank set"))
    else:
        fits = 0 <= rank < baked
        out.append(Factor("distributed.rank", f"0..{baked - 1}", rank, fits, not fits, note))
    return out


def check(
    target: str | Path,
    *,
    device_index: int | None = None,
    keys: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    workdir: str | None = None,
) -> CheckReport:
    """Compare the artifact (file) or restored folder at ``target`` with this process.
    ``workdir``: the folder the server runs in (default: this process's, kiln.workdir).

    ``device_index`` is the CUDA index this process will serve on (default: the baked one, 0;
    for a K-rank artifact the rank's baked one). ``rank``/``world_size``: what this process
    serves as (default: ``RANK``/``LOCAL_RANK`` and ``WORLD_SIZE`` from the environment).

    A restored folder is judged with the artifact's variables on top of this environment (as
    kiln.env or activate() give the server them) while ``TORCHINDUCTOR_CACHE_DIR`` is unset
    here; set, this environment is taken as the server's own, and each variable of kiln.env
    it lacks or sets otherwise is a factor.
    """
    from kiln.compiler.fingerprint import fingerprint, relevant_env

    manifest = read_manifest(target)
    rank = rank if rank is not None else _env_int("RANK", "LOCAL_RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    baked = manifest.fingerprint
    if manifest.distributed is not None and rank is not None and rank < manifest.world_size:
        baked = manifest.distributed.ranks[rank].fingerprint
    device = baked.get("device.type", manifest.spec.get("model", {}).get("device", "cpu"))
    index = device_index if device_index is not None else (baked.get("device.index") or 0)
    where = location_factor(target, manifest, rank)  # read before the probes' folder is set
    # Judged as a served process has it: kiln.env exports the manifest's env and activate()
    # sets it, so a shell that has not sourced kiln.env is judged as the server that will.
    # (Torch reads Inductor's config at import: in a process that imported it before, the
    # config factors still say what this process would do.) A process whose environment
    # already says where DIR's caches are (TORCHINDUCTOR_CACHE_DIR: kiln.env sourced, or
    # variables copied into an image) is the server's own: each variable it lacks or has at
    # another value is named, once, as itself (its Inductor config is still judged with the
    # artifact's variables on top, or each would be named twice).
    own_env = manifest.aoti is None and where is not None and where.here is not None
    with environ_with(manifest.env):
        if manifest.aoti is not None:  # what a served process of that route can know (no probes)
            here = fingerprint(device, device_index=index, lean=True)
        else:
            with probe_inductor_dir():  # the ISA probes compile there, not into DIR or $TMPDIR
                here = fingerprint(device, device_index=index, keys=keys and "torch.key" in baked)
    if own_env:
        here["env"] = relevant_env()
    report = compare_manifest(
        manifest, here, rank=rank, world_size=world_size, workdir=workdir or logical_cwd()
    )
    if own_env:
        report.factors = exported_env_factors(report.factors, manifest.env, os.environ)
    # The aoti route reads no Inductor cache (so TORCHINDUCTOR_CACHE_DIR elsewhere is no miss)
    # and starts no Inductor, so has no pool to race.
    if manifest.aoti is None:
        if where is not None:
            report.factors.append(where)
        layout = served_layout(target, manifest, rank)
        report.factors.extend(serving_env_factors(os.environ, device, own_env=own_env))
        report.factors.extend(moved_cache_factors(os.environ, layout.inductor if layout else None))
        if (locks := locks_factor(layout)) is not None:
            report.factors.append(locks)
    return report


def exported_env_factors(
    factors: list[Factor], env: Mapping[str, str], environ: Mapping[str, str]
) -> list[Factor]:
    """``factors`` of a process whose environment is the server's own, with each variable of
    the manifest's ``env`` (which kiln.env exports) that ``environ`` lacks or sets otherwise
    said to be kiln.env's: the fingerprint's own factor where torch keys by it, else a note."""
    named = {f.name for f in factors}
    out = [_exported(f, env) for f in factors]
    for key, value in sorted(env.items()):
        if f"env.{key}" not in named and environ.get(key) != value:  # outside the fingerprint
            out.append(_exported(Factor(f"env.{key}", value, environ.get(key), False, False), env))
    return out


def _exported(factor: Factor, env: Mapping[str, str]) -> Factor:
    key = factor.name.removeprefix("env.")
    if factor.matches or not factor.name.startswith("env.") or key not in env:
        return factor
    keyed = ", in torch's cache keys" if factor.causes_miss else ""
    note = (
        f"kiln.env exports {key}={env[key]}{keyed}: a server that sets its own environment "
        "needs every variable of kiln.env, not only TORCHINDUCTOR_CACHE_DIR"
    )
    return replace(factor, note=note)


def serving_env_factors(
    environ: Mapping[str, str], device: str, *, own_env: bool = False
) -> list[Factor]:
    """Each :data:`~kiln.serving.SERVING_ENV` setting this process has at another value.

    Outside every cache key, so the fingerprint cannot see them, yet a server that overrides
    one does compile work (``TORCHINDUCTOR_COMPILE_THREADS`` above 1: kernels load in the pool
    and come back without their tuning state, benchmarked again). Unset is fine where the
    server will source ``kiln.env`` or call ``kiln.activate()``, which set them; not in a
    process whose environment is the server's own (``own_env``, :func:`check` says when). A
    miss on CUDA, where Triton kernels carry tuning state; a note on the CPU, whose C++
    kernels have none.
    """
    out = []
    for key, value in SERVING_ENV.items():
        here = environ.get(key)
        if (here is not None or own_env) and here != value:
            note = f"kiln serves with {key}={value} (kiln.env sets it): {SERVING_NOTES[key]}"
            out.append(Factor(f"env.{key}", value, here, False, device == "cuda", note))
    return out


def _env_int(*names: str) -> int | None:
    """The first of ``names`` set to a number in the environment (a launcher's), else None."""
    for name in names:
        text = os.environ.get(name, "")
        if text.isdecimal():
            return int(text)
    return None
