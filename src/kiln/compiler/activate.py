"""``kiln.activate(DIR)``: point this serving process at restored caches before it compiles.

The no-code route is ``kiln.env`` (source it, or set its variables in the pod spec). activate()
is for servers that prefer code: it sets the same environment, also pushes the values into torch's
config objects when torch was imported already (some are read only at import), raises Dynamo's
recompile limit to fit the baked grid (past the default of 8 shapes torch silently falls back to
eager), checks compatibility, and imports Inductor (:func:`prepare_inductor`). A served
process loads every kernel in-process (:data:`kiln.serving.SERVING_ENV` says why), so no
compile worker pool starts. The Mega-Cache blob is hot-loaded only when asked
(``megacache=True``): the restored folder already holds every entry it has, and loading it
rewrites them there (on a read-only mount, it fails).
``Activation.compile(model)`` then compiles with exactly the baked arguments, or, when the
artifact carries precompiled forwards, loads them so the process never traces with Dynamo.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln import bytecode
from kiln.errors import IncompatibleError, NotFoundError, UsageError
from kiln.factors import BUILD_FACTORS
from kiln.installs import torch_build
from kiln.kernel_locks import describe, foreign_locks
from kiln.layout import MAX_MANIFEST_BYTES, CacheLayout, unserved_path
from kiln.serving import (
    UNSET_ENV,
    OnMiss,
    cache_env,
    served_cuda_cache,
    served_torch_kwargs,
    serving_rank,
)
from kiln.workdir import logical_cwd

if TYPE_CHECKING:
    from kiln.artifact.manifest import Manifest
    from kiln.compiler.check import CheckReport

log = logging.getLogger("kiln")

Compat = Literal["fail", "warn", "ignore"]

# Env vars torch reads into config objects at import time: set them on the config too (a server
# that imported Dynamo before activate() would otherwise key its graphs with the old values).
_CONFIG_BACKED: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "TORCH_COMPILE_JOB_ID": ("torch.compiler.config", "job_id", str),
    "TORCH_COMPILE_CACHE_KEY_TAG": ("torch.compiler.config", "cache_key_tag", str),
    "TORCHINDUCTOR_COMPILE_THREADS": ("torch._inductor.config", "compile_threads", int),
    # kiln.serving.COMPILE_DEFAULTS: part of the FX key, read as `== "1"` by torch
    "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": (
        "torch._inductor.config",
        "cpp_cache_precompile_headers",
        lambda value: value == "1",
    ),
    # kiln.serving.GPU_COMPILE_DEFAULTS: in the FX key (each kernel's source), read the same way
    "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": (
        "torch._inductor.config",
        "dynamic_scale_rblock",
        lambda value: value == "1",
    ),
}


class CompatWarning(UserWarning):
    pass


class ActiveFolderError(UsageError):
    """activate() of a second compile-route folder in a process that serves one (exit 2).
    Inductor reads its cache folder (``TORCHINDUCTOR_CACHE_DIR``) and settings from the
    process, so the second activation would move the first model's caches: its buckets would
    miss, compile, and write their kernels into the second folder."""


# The folder (a rank's caches folder, resolved) whose compile-route activation set this
# process's environment: the only one it serves (ActiveFolderError); AOT packages load beside.
_SERVING: list[Path] = []


@dataclass
class Activation:
    cache_dir: Path
    env: dict[str, str]
    check: CheckReport | None
    megacache_loaded: bool | None
    recompile_limit: int | None
    manifest: Manifest
    warnings: list[str] = field(default_factory=list)
    layout: Path | None = None  # this rank's folder (ranks/R) of a K-rank artifact, else cache_dir
    device_index: int = 0  # the CUDA device this process serves on
    rank: int | None = None  # this process's rank of a K-rank artifact

    def compile(
        self, model: Any, *, on_miss: OnMiss | None = None, keep: Collection[str] = ()
    ) -> Any:
        """``model`` compiled as baked: ``torch.compile`` with the spec's exact arguments, or the
        precompiled forwards when the artifact has them (falling back to ``torch.compile``, with
        a warning, if this torch refuses them), or with Dynamo's saved frames loaded for a model
        with graph breaks. Pass the model already on its device and dtype, and call it under
        ``torch.inference_mode()``, as kiln bakes: precompiled guards expect that grad mode.

        When the spec declares ``pad`` values, each request is padded up to its baked bucket
        and the outputs sliced back (:mod:`kiln.compiler.padded`); without them (``dynamic:
        false``), a request must be a baked bucket exactly. ``on_miss`` (default: the spec's
        ``compile.on_miss``, else ``error``) decides a request no bucket holds
        (:func:`~kiln.compiler.padded.miss_policy`), and ``keep`` names outputs to return
        unsliced (a path no output has is a :class:`~kiln.errors.ParameterError` at the first
        call that returns outputs).

        A ``compile.route: aoti`` artifact is served from its packages instead
        (:class:`~kiln.compiler.aoti_serve.AotiModel`): picked by input shapes, with the model's
        own weights handed in (``weights: external``); nothing imports Dynamo or Inductor, and
        ``on_miss`` is ``error`` or ``eager`` (there is no compiler to call).
        """
        from kiln.compiler.padded import with_padding

        if self.manifest.aoti is not None:  # what the bake found of the outputs: no probe here
            served = self._packages(model, on_miss)
            carriers = served.info.carriers
            return with_padding(
                served, model, self.manifest, on_miss=on_miss, keep=keep, carriers=carriers
            )
        compiled = self._compiled(model)
        return with_padding(compiled, model, self.manifest, on_miss=on_miss, keep=keep)

    def _packages(self, model: Any, on_miss: OnMiss | None) -> Any:
        """The AOTInductor packages this process serves, loaded onto ``model``."""
        from kiln.compiler.aoti_serve import AotiModel, library_sizes, served_packages

        aoti = served_packages(self.manifest, self.rank)
        index = self.device_index if aoti.device == "cuda" else 0
        folder = self.layout or self.cache_dir
        return AotiModel(
            model,
            aoti,
            folder,
            device_index=index,
            on_miss=on_miss or "",
            sizes=library_sizes(self.manifest),
        )

    def _compiled(self, model: Any) -> Any:
        import torch

        kwargs = served_torch_kwargs(self.manifest)
        if self.manifest.precompiled:
            from kiln.compiler.model_import import factory_module
            from kiln.compiler.precompile import PrecompiledForward

            path = self.cache_dir / self.manifest.precompiled
            if self.manifest.distributed:  # the top-level one is rank 0's: each has its own
                path = CacheLayout(self.cache_dir, self.rank).precompiled
            blob = path.read_bytes()
            try:
                loaded = PrecompiledForward.load(model, kwargs, blob)
                loaded.baked_module = factory_module(self.manifest.spec["model"]["factory"])
                return loaded
            except Exception as exc:  # torch's checks raise assorted types; say which, go on
                note = f"precompiled forwards not usable here ({type(exc).__name__}: {exc})"
                log.warning("kiln: %s; compiling with torch.compile", note)
                self.warnings.append(note)
        elif self.manifest.precompiled_frames:
            from kiln.compiler import frames

            problem = frames.mismatch(model, self.manifest.precompiled_frames.module)
            if problem is None:
                frames.serve()
                try:
                    return frames.compile_model(model, kwargs)
                except Exception as exc:  # torch's install raises assorted types; say which
                    problem = f"{type(exc).__name__}: {exc}"
            note = f"saved frames not usable ({problem})"
            log.warning("kiln: %s; compiling with torch.compile", note)
            self.warnings.append(note)
        return torch.compile(model, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache_dir": str(self.cache_dir),
            "env": self.env,
            "compatible": self.check.ok if self.check else None,
            "misses": [f.name for f in self.check.misses] if self.check else [],
            "megacache_loaded": self.megacache_loaded,
            "recompile_limit": self.recompile_limit,
            "precompiled": self.manifest.precompiled is not None,
            "precompiled_frames": self.manifest.precompiled_frames is not None,
            "route": self.manifest.route,
            "warnings": self.warnings,
        }


def activate(
    cache: str | Path,
    *,
    compat: Compat = "warn",
    megacache: bool = False,
    device_index: int | None = None,
    rank: int | None = None,
) -> Activation:
    """Make this process use the caches restored at ``cache``. Call before the first compile.

    ``compat``: what to do when a factor in torch's cache keys differs, or this process runs
    elsewhere than the folder the shipped CUDA driver entries are keyed by (kiln.workdir) —
    "fail" raises :class:`~kiln.errors.IncompatibleError`, "warn" emits a
    :class:`CompatWarning`, "ignore" does neither. For a K-rank artifact, ``rank`` (default:
    ``RANK``, else ``LOCAL_RANK``, as torchrun sets them) picks the rank's caches; none set, or
    one outside the artifact's ranks, is a :class:`~kiln.errors.UsageError`. ``device_index``
    defaults to the baked one. Whatever ``compat``, kernel lock files this process cannot open
    (:mod:`kiln.kernel_locks`) raise :class:`~kiln.errors.IncompatibleError`. One compile-route
    folder serves a process (another: :class:`ActiveFolderError`; AOT packages load beside it).
    """
    cache = Path(cache).absolute()
    if (problem := unserved_path(cache)) is not None:  # an artifact file: restore it first
        raise NotFoundError(problem)
    notes: list[str] = []
    torch_loaded = "torch" in sys.modules
    # The artifact's bytecode serves `import torch` itself (seconds on an image without its
    # own) once torch/version.py names the baked build, and kiln's own imports below (pydantic
    # and the manifest's models: 0.4 s from source on the 2-core CPU); the full check below,
    # which needs torch, then keeps it or takes it back (another build's: none before it).
    early = None if torch_loaded else _bytecode_before_imports(cache, notes)
    try:
        from kiln.artifact.archive import read_manifest

        manifest = read_manifest(cache)
        rank = _rank(cache, manifest, rank)
        if device_index is None:
            device_index = _baked_device_index(manifest, rank)
        layout = CacheLayout(cache, rank)
        if manifest.aoti is None and (locked := foreign_locks(layout)):  # loads would fail
            raise IncompatibleError(f"{cache}: {describe(locked)}")
        owns = _owns_process(cache, layout, manifest)  # False: AOT packages beside a folder
        env = _set_env(cache, manifest, rank, notes) if owns else {}
        import torch

        activation = Activation(
            cache, env, None, None, None, manifest, notes, layout.dir, device_index, rank
        )
        if manifest.aoti is not None:
            return _activate_aoti(activation, compat, early, layout.bytecode if owns else None)
        if torch_loaded:
            _follow_env(env, notes)
        if compat != "ignore":
            activation.check = _compare(manifest, device_index, rank)
            _judge(
                activation.check,
                compat,
                notes,
                stacklevel=3,
                stop_bytecode=layout.bytecode if early else None,
            )
    except BaseException:  # the manifest, the import or the check failed: imports as they were
        if early:
            bytecode.stop(CacheLayout(cache).bytecode)
        raise
    # Not tried before torch (another build, or torch imported first): the artifact's bytecode
    # serves every import from here on (Dynamo, Inductor) only once the check passed.
    if manifest.bytecode and early is None and (activation.check is None or activation.check.ok):
        notes.extend(_use_bytecode(layout.bytecode))
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(manifest.grid) + 2)
    torch._dynamo.config.recompile_limit = activation.recompile_limit = limit
    if megacache:
        activation.megacache_loaded = _load_megacache(cache, manifest, rank, notes)
    prepare_inductor(served_torch_kwargs(manifest))
    slow_start = bytecode.uncached_reason()  # None once use() serves the artifact's
    if slow_start:
        notes.append(slow_start)
    for note in notes:
        log.warning("kiln: %s", note)
    _SERVING[:] = [layout.dir.resolve()]
    return activation


def _owns_process(cache: Path, layout: CacheLayout, manifest: Manifest) -> bool:
    """Whether this activation sets the process's environment (and imports): yes unless a
    compile-route activation of another folder did (:data:`_SERVING`), beside which only an
    AOTInductor artifact serves, from its packages by path; a compile-route one is refused."""
    if not _SERVING or _SERVING[0] == layout.dir.resolve():
        return True
    held = _SERVING[0]
    if manifest.aoti is not None:
        log.info("kiln: %s: packages served beside %s, whose environment stays", cache, held)
        return False
    raise ActiveFolderError(
        f"{cache}: this process serves {held} already: one compile-route folder serves a "
        "process, as Inductor's cache folder and settings are process-global (the first "
        "model's shapes would miss and compile into this folder); serve each model from its "
        "own process, or bake the others with compile.route: aoti, whose packages serve "
        "beside it (docs/serving.md)"
    )


def _set_env(cache: Path, manifest: Manifest, rank: int | None, notes: list[str]) -> dict[str, str]:
    """Set :func:`_serving_env` in this process's environment, and drop what would move a
    shipped cache out of ``cache`` (:data:`kiln.serving.UNSET_ENV`); returns what was set."""
    env = _serving_env(cache, manifest, rank, notes)
    os.environ.update(env)
    for var in UNSET_ENV:
        if (moved := os.environ.pop(var, None)) is not None:
            log.info("kiln: %s=%s unset: the artifact's caches are under %s", var, moved, cache)
    return env


def _serving_env(
    cache: Path, manifest: Manifest, rank: int | None, notes: list[str]
) -> dict[str, str]:
    """:func:`~kiln.serving.cache_env`, the driver's JIT cache on a private copy when ``cache``
    is read-only (:data:`kiln.serving.CUDA_COPY_PREFIX`): said at INFO, or in ``notes`` when
    no copy could be made."""
    env = cache_env(cache, manifest.env, rank)
    cuda_cache, cuda_note = served_cuda_cache(cache, rank)
    env["CUDA_CACHE_PATH"] = str(cuda_cache)
    if cuda_note is not None and cuda_cache == CacheLayout(cache, rank).cuda_cache:
        notes.append(cuda_note)
    elif cuda_note is not None:
        log.info("kiln: %s", cuda_note)
    return env


def _baked_device_index(manifest: Manifest, rank: int | None) -> int:
    """The CUDA device the bake (this rank's, of a K-rank artifact) compiled on."""
    baked = manifest.fingerprint
    if manifest.distributed is not None and rank is not None:
        baked = manifest.distributed.ranks[rank].fingerprint
    return baked.get("device.index") or 0


def _follow_env(env: dict[str, str], notes: list[str]) -> None:
    """For a torch imported before activate(): note frames it compiled already, and set the
    variables torch read at import on its config objects (:data:`_CONFIG_BACKED`)."""
    from torch._dynamo.utils import counters

    if counters["frames"]["total"]:
        notes.append("activate() ran after torch.compile had already compiled frames")
    # The CUDA driver reads CUDA_CACHE_PATH once, when CUDA starts: its shipped JIT cache
    # (kiln.layout.CUDA_CACHE_DIR) serves only a process that calls activate() before that.
    torch = sys.modules["torch"]
    if Path(env["CUDA_CACHE_PATH"]).is_dir() and torch.cuda.is_initialized():
        notes.append(
            "activate() ran after CUDA had started: the driver's JIT cache in the artifact is "
            "not used (call activate() before the first CUDA call)"
        )
    for var, (module, attr, kind) in _CONFIG_BACKED.items():
        if var in env and module in sys.modules:
            setattr(sys.modules[module], attr, kind(env[var]))


def _judge(
    report: CheckReport,
    compat: Compat,
    notes: list[str],
    *,
    stacklevel: int,
    stop_bytecode: Path | None = None,
) -> None:
    """Act on a compatibility check as ``compat`` says: raise on a miss for "fail", else warn
    (at ``stacklevel`` from here) and note it. Either way, imports stop coming from
    ``stop_bytecode`` (an artifact's bytecode, which activate() served before the check for the
    torch build its manifest names)."""
    if report.ok:
        return
    if stop_bytecode is not None:
        bytecode.stop(stop_bytecode)
    if compat == "fail":
        raise report.error()
    message = report.miss_message()
    warnings.warn(message, CompatWarning, stacklevel=stacklevel)
    notes.append(message)


def _load_megacache(
    cache: Path, manifest: Manifest, rank: int | None, notes: list[str]
) -> bool | None:
    """Load the Mega-Cache blob (this rank's) into torch's caches: whether torch took it, None
    when the artifact has none or this torch cannot load one."""
    import torch

    blob_path = manifest.megacache
    if manifest.distributed is not None and rank is not None:
        blob_path = manifest.distributed.ranks[rank].megacache
    if not blob_path or not hasattr(torch.compiler, "load_cache_artifacts"):
        return None
    loaded = torch.compiler.load_cache_artifacts((cache / blob_path).read_bytes()) is not None
    if not loaded:
        notes.append("torch refused the Mega-Cache blob (the folder caches still apply)")
    return loaded


def _activate_aoti(
    activation: Activation, compat: Compat, early: bool | None, shipped: Path | None
) -> Activation:
    """activate() for a ``compile.route: aoti`` artifact: the compatibility check on what a
    process without Inductor can know (kiln.factors.AOTI_KEY_FACTORS) and nothing else; no
    Dynamo settings, no Mega-Cache, no Inductor import or worker pool (the packages need none).
    ``early``: what :func:`_bytecode_before_imports` did with ``shipped``, the artifact's
    bytecode (None: the process serves another folder's, :func:`_owns_process`)."""
    manifest, rank = activation.manifest, activation.rank
    report = None
    if compat != "ignore":
        from kiln.compiler.check import compare_manifest
        from kiln.compiler.fingerprint import fingerprint

        device = manifest.fingerprint.get("device.type", "cpu")
        here = fingerprint(device, device_index=activation.device_index, lean=True)
        world = manifest.world_size if rank is not None else None
        report = compare_manifest(
            manifest, here, rank=rank, world_size=world, workdir=logical_cwd()
        )
        activation.check = report
        _judge(
            report,
            compat,
            activation.warnings,
            stacklevel=4,
            stop_bytecode=shipped if early else None,
        )
    if manifest.bytecode and shipped and early is None and (report is None or report.ok):
        activation.warnings.extend(_use_bytecode(shipped))  # as activate()
    for note in activation.warnings:
        log.warning("kiln: %s", note)
    return activation


def _bytecode_before_imports(cache: Path, notes: list[str]) -> bool | None:
    """Serve the artifact's bytecode from here on, before kiln's own imports and ``import
    torch``, when torch's own build (read from torch/version.py, :data:`kiln.factors
    .BUILD_FACTORS`) is the one the artifact baked: True when this call set it up, False when it
    tried and :func:`kiln.bytecode.use` declined (``notes`` says why), None when it did not try
    (no bytecode, another or an unknown build, no readable manifest: then only after the full
    check). The manifest is read as plain JSON here, since its models are among the imports to
    serve; restore checked it, and :func:`~kiln.artifact.archive.read_manifest` validates it
    right after. Each pyc is checked against its installed source's hash as it loads; what a
    pyc's code does beyond that is as trusted as the artifact (its signature or pin), as for
    the Inductor caches."""
    layout = CacheLayout(cache)
    try:
        with open(layout.manifest, "rb") as fh:
            raw = fh.read(MAX_MANIFEST_BYTES + 1)  # bounded as every manifest read is
        data = json.loads(raw) if len(raw) <= MAX_MANIFEST_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("bytecode"):
        return None
    baked = data.get("fingerprint")
    if not isinstance(baked, dict):
        return None
    here = torch_build()
    if here is None or any(baked.get(k, here[k]) != here[k] for k in BUILD_FACTORS):
        return None
    notes.extend(_use_bytecode(layout.bytecode))
    return bytecode.serving(layout.bytecode)


def _use_bytecode(folder: Path) -> list[str]:
    """Serve the artifact's Python bytecode when this image has none of its own (kiln.bytecode);
    returns a note for the caller's warnings when the artifact's does not fit this interpreter."""
    note = bytecode.use(folder)
    if note and sys.pycache_prefix == str(folder):
        log.info("kiln: %s", note)
        return []
    return [note] if note else []


def _compare(manifest: Manifest, device_index: int, rank: int | None) -> CheckReport:
    """This process's environment against the one the caches were baked in."""
    from kiln.compiler.check import compare_manifest
    from kiln.compiler.fingerprint import fingerprint

    device = manifest.fingerprint.get("device.type", "cpu")
    return compare_manifest(
        manifest,
        fingerprint(device, device_index=device_index, keys=False),
        rank=rank,
        world_size=manifest.world_size if rank is not None else None,
        workdir=logical_cwd(),
    )


def _rank(cache: Path, manifest: Manifest, rank: int | None) -> int | None:
    """The rank whose caches this process serves: None for a 1-rank artifact; else ``rank`` or
    the launcher's ``RANK``/``LOCAL_RANK``, which must be one of the artifact's."""
    if manifest.distributed is None:
        return None
    try:
        if rank is None:
            return serving_rank(manifest.world_size)
        return serving_rank(manifest.world_size, {"RANK": str(rank)})
    except ValueError as exc:
        raise UsageError(f"{cache}: {exc}") from None


def prepare_inductor(torch_kwargs: dict[str, Any]) -> None:
    """Import Inductor and start its compile worker pool now, before the model is built.

    torch does both inside the first compiled call, after the model is built; the pool's
    sidecar process then starts while the first bucket waits. Started here, it comes up while
    the model builds, and the import is a start-up phase of its own that ``kiln bench`` shows
    (kiln's worker calls this where activate() does, so bench measures what a server gets). No
    pool where torch would start none (no Triton) or the compile arguments ask for none
    (``compile_threads: 1``, as autotuning specs serve).
    """
    import torch._inductor.compile_fx  # noqa: F401  (the first compiled call's import)
    from torch._inductor import config
    from torch._inductor.async_compile import maybe_warm_pool

    threads = (torch_kwargs.get("options") or {}).get("compile_threads")
    if threads is not None and threads <= 1:
        return
    with config.patch(compile_threads=threads) if threads else contextlib.nullcontext():
        maybe_warm_pool()
