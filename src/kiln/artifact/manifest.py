"""The artifact manifest: the contract between the baking world and the serving world.

Everything restore, check and verify decide is in here, so no step has to guess from file names.
Torch-free: restore and inspect read it in slim images. ``FORMAT_VERSION`` changes only when an
older kiln could misread a newer manifest; readers refuse versions they do not know.

A manifest usually comes from elsewhere, so the model itself is the trust check: every rule an
archive must pass (safe, bounded paths; no file that is also a folder; no name restore writes
itself; the environment allow-list; the artifact name) is a validator here. Whoever parses a
manifest (restore, inspect, check, a restored folder's no-op) gets the same answer, and the
limits below are the only place they are stated.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from kiln._version import __version__
from kiln.bytecode import library_problem, pyc_path
from kiln.envrules import env_key_problem, env_value_problem
from kiln.layout import BYTECODE_DIR, RANKS_DIR, RESERVED_NAMES, CacheLayout, rank_of
from kiln.serving import MAX_NAME_LENGTH, MAX_WORLD_SIZE, NAME_PATTERN
from kiln.workdir import MAX_WORKDIR_LENGTH, workdir_problem

FORMAT_VERSION = 2  # the newest format this kiln reads
# Format 2 adds ``distributed`` and ``copies``: a kiln that reads only format 1 would ignore
# them and install half of a K-rank artifact, so only manifests that use them are written as 2
# (a 1-rank artifact stays format 1, readable by older kilns).
RANKS_FORMAT = 2

# --- bounds on what an archive may ask of a reader ------------------------------------------
# MAX_MANIFEST_BYTES (kiln.layout, beside the file's name: activate() reads it before this
# module is imported) bounds manifest.json itself.
MAX_FILES = 50_000
MAX_PATH_BYTES = 1024  # UTF-8 bytes of a whole relative path (Linux PATH_MAX is 4096 absolute)
MAX_COMPONENT_BYTES = 255  # NAME_MAX of every common Linux filesystem
MAX_PATH_DEPTH = 32  # Inductor's deepest paths are 5 levels
MAX_TOTAL_BYTES = 1 << 40  # 1 TiB unpacked: far beyond any compile cache
_SHOWN = 120  # characters of a hostile path quoted in a one-line message


def _shown(path: str) -> str:
    """``path`` quoted for a one-line message, shortened so a 5,000-character name stays short."""
    return repr(path if len(path) <= _SHOWN else path[:_SHOWN] + "…")


def path_problem(path: str) -> str | None:
    """Why ``path`` may not name a file in an artifact, or None when it may.

    One rule for manifest entries and tar member names: relative, no ``.``/``..``/empty parts,
    printable UTF-8 without backslashes, and short enough to create on any Linux filesystem
    (so writing it can never fail with "File name too long" halfway through a restore).
    """
    if not path:
        return "empty path in archive"
    # Not printable: control characters, and lone surrogates (JSON allows them, UTF-8 does not).
    if any(not c.isprintable() for c in path) or "\\" in path:
        return f"unsafe member name {_shown(path)}"
    size = len(path.encode("utf-8"))
    if path.startswith("/"):
        return f"absolute path in archive: {_shown(path)}"
    parts = path.split("/")
    if any(part in ("..", ".", "") for part in parts):
        return f"path traversal in archive: {_shown(path)}"
    if size > MAX_PATH_BYTES:
        return f"path of {size} bytes in archive (at most {MAX_PATH_BYTES}): {_shown(path)}"
    longest = max(len(part.encode("utf-8")) for part in parts)
    if longest > MAX_COMPONENT_BYTES:
        return (
            f"path with a {longest}-byte name in archive (at most {MAX_COMPONENT_BYTES}): "
            f"{_shown(path)}"
        )
    if len(parts) > MAX_PATH_DEPTH:
        depth = len(parts)
        return f"path {depth} levels deep in archive (at most {MAX_PATH_DEPTH}): {_shown(path)}"
    return None


def first_problem(exc: ValidationError) -> str:
    """One line for a model's first problem, naming where it is (``files.3.path: …``): how
    every reader of untrusted JSON (manifests, bundle indexes, registry annotations) says it."""
    error = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in error["loc"])
    msg = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _checked_path(path: str) -> str:
    problem = path_problem(path)
    if problem:
        raise ValueError(problem)
    return path


# A path inside an artifact, checked by :func:`path_problem` wherever a model names one.
SafePath = Annotated[str, AfterValidator(_checked_path)]
# A sha256 as kiln writes one everywhere: 64 lower-case hex digits, no "sha256:" prefix.
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def folders_of(paths: list[str]) -> set[str]:
    """Every folder the given file paths need (``a/b/c`` needs ``a`` and ``a/b``)."""
    out: set[str] = set()
    for path in paths:
        parts = path.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return out


class _Model(BaseModel):
    # Forward compatible within a format version: newer kilns may add fields.
    model_config = ConfigDict(extra="allow")


class FileEntry(_Model):
    path: SafePath  # posix, relative to the artifact root, e.g. "inductor/fxgraph/..."
    size: int = Field(ge=0, le=MAX_TOTAL_BYTES)
    sha256: Sha256
    kind: str = Field(max_length=64)
    # A pyc under bytecode/ (kind "bytecode") only: the library module it is the bytecode of,
    # and that source's hash as its checked-hash header holds it (Manifest._bytecode_files).
    source: str | None = Field(None, max_length=MAX_PATH_BYTES)
    source_hash: str | None = Field(None, pattern=r"^[0-9a-f]{16}$")

    @property
    def is_bytecode(self) -> bool:
        """A pyc of the artifact's one bytecode tree: its kind and its place both say so."""
        return self.kind == "bytecode" and self.path.startswith(f"{BYTECODE_DIR}/")

    @model_serializer(mode="wrap")
    def _without_unset_source(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Every other file has neither: left out, not written as null in each of them.
        data: dict[str, Any] = handler(self)
        for key in ("source", "source_hash"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


NEW_FILES_SAMPLE = 12  # file names kept per bucket: enough to say which kernels were built
MAX_FRAMES = 64  # Dynamo frames named per bucket
MAX_TUNED = 16  # kernels named per bucket whose launch configs a served process benchmarked
MAX_GRAPH_BREAKS = 256  # distinct graph breaks a manifest lists
_MAX_TEXT = 500  # characters of a reason or a location


class GraphBreak(_Model):
    """One place Dynamo split the model, said the way torch said it.

    Each break is a seam: the code after it is a separate frame that Dynamo compiles on its own
    when execution reaches it. A break that depends on tensor *data* (a branch on a value,
    ``.item()``, an output shape that depends on values) is a seam the bake can only cover for
    the data it saw: serving data may reach a frame the bake never compiled.
    """

    where: str = Field(max_length=_MAX_TEXT, description="file:line in the model's code")
    reason: str = Field(max_length=_MAX_TEXT)
    gb_id: str | None = Field(None, pattern=r"^GB\d{4}$", description="torch's registry id")
    data_dependent: bool = False
    buckets: list[str] = Field(
        default_factory=list, max_length=64, description="buckets that traced it (a sample)"
    )

    @property
    def line(self) -> tuple[str, int] | None:
        """(file name, line number) of :attr:`where`, or None if it does not end in one."""
        path, _, line = self.where.rpartition(":")
        return (path.rsplit("/", 1)[-1], int(line)) if line.isdigit() else None


class PrecompiledFrames(_Model):
    """Dynamo's saved frames (``compile.precompile`` on a model with graph breaks), under
    ``inductor/dynamo``: ``kiln.activate().compile()`` serves them when the model's forward
    comes from the module they were baked for (kiln.compiler.frames explains the route)."""

    module: str = Field(max_length=256, description="module of the forward the frames trace")


class TensorMeta(_Model):
    """A tensor's shape and dtype (torch's name, ``float32``), as a package was built for."""

    shape: list[int] = Field(max_length=32)
    dtype: str = Field(max_length=32)


class AotiInput(_Model):
    """One input of the served call: its name and shape (axis names or fixed sizes)."""

    name: str = Field(max_length=256)
    shape: list[str | int] = Field(max_length=32)
    dtype: str = Field(max_length=32)


class AotiProgram(_Model):
    """One AOTInductor package, shipped extracted: ``path`` holds its shared library (and, on
    CUDA, its kernel binaries); it serves the ``buckets`` named, or with ``ranges`` every size
    from low to high (both included) along each named axis."""

    path: SafePath = Field(description="the package's folder, e.g. aoti/0")
    library: str = Field(max_length=255, pattern=r"^[^/\\]+\.so$")
    buckets: list[str] = Field(max_length=4096)
    ranges: dict[str, list[int]] | None = Field(None, description="axis: [low, high]")


class PadOutput(_Model):
    """One output of a bucket's call (``path``: its place in the output, e.g. ``["logits"]``)
    and the dims of it that move one for one with a padded axis: sliced back to a request's
    size. ``sliceable`` false: the output moves with the axis otherwise (``2 * seq``, a strided
    convolution), so it is returned padded, with a warning."""

    path: list[str] = Field(max_length=64)
    dims: list[NonNegativeInt] = Field(max_length=64)
    sliceable: bool = True


class PadCarriers(_Model):
    """Which outputs of ``bucket``'s call carry ``axis`` (kiln.compiler.padded): found by the
    bake on fake tensors, so a padded server of the AOT route, which imports no Dynamo, has no
    fake-tensor probe to run. ``by_size``: the probe failed (the model reads data): a dim whose
    size is the padded size carries it."""

    bucket: str = Field(max_length=1024)
    axis: str = Field(max_length=256)
    outputs: list[PadOutput] = Field(default_factory=list, max_length=4096)
    by_size: bool = False


class Aoti(_Model):
    """``compile.route: aoti``: what each package serves and how a server calls it
    (kiln.compiler.aoti_serve). The manifest is the whole contract: a served process reads
    no spec and imports neither Dynamo nor Inductor."""

    device: str = Field(max_length=16, description="cpu or cuda")
    weights: str = Field(pattern=r"^(external|embed)$")
    on_miss: str = Field(pattern=r"^(error|eager)$")
    inputs: list[AotiInput] = Field(max_length=256)
    call_kwargs: dict[str, Any] = Field(default_factory=dict)
    programs: list[AotiProgram] = Field(max_length=4096)
    # external weights: each constant a package reads from the model, by its name there
    constants: dict[str, TensorMeta] = Field(default_factory=dict)
    # a spec that pads: each bucket's outputs that carry each padded axis
    carriers: list[PadCarriers] = Field(default_factory=list, max_length=MAX_FILES)


class Bytecode(_Model):
    """The Python bytecode of the modules a server imports, under ``bytecode/`` as a
    ``sys.pycache_prefix`` tree (kiln.bytecode): shipped when the bake's image had none cached,
    served when the serving process finds none either."""

    python: str = Field(max_length=64, description="sys.implementation.cache_tag it is for")
    modules: int = Field(ge=0, le=MAX_FILES)


class Workdir(_Model):
    """The working directory the bake's processes ran in, recorded when driver JIT cache
    entries the artifact ships carry it (kiln.workdir says why): a server that runs anywhere
    else JIT-compiles those kernels again."""

    path: str = Field(max_length=MAX_WORKDIR_LENGTH)
    keyed: int = Field(ge=1, le=MAX_FILES, description="shipped driver entries that carry it")

    @field_validator("path")
    @classmethod
    def _recordable(cls, value: str) -> str:
        problem = workdir_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class ProofStats(_Model):
    """The bake's own proof: a fresh process served the packed artifact, restored elsewhere."""

    order: list[str]
    compiles: int = Field(ge=0)
    wall_s: float
    rebakes: int = Field(0, ge=0, description="extra passes that filled what a proof missed")


# The counts that are compile work (each adds to CompileCounts.compiles), in the order kiln bench
# shows them, each with the word its table names it by: one list, so a new kind of work is
# counted and shown, or neither.
WORK_KINDS = {
    "fx_misses": "FX",
    "fx_bypass": "FX bypass",
    "aot_misses": "AOT",
    "precompile_misses": "precompiled miss",
    "new_native": "kernel bin",
    "launchers": "gcc",
    "autotunes": "autotune",
    "kernel_tunings": "tuned",
    "written": "written",
}


class CompileCounts(_Model):
    """What compiled (or only loaded) during some calls: the counts a bucket is judged by.

    The worker measures one per step (a bucket's first call, its warm calls) and adds them up;
    :class:`BucketStats` is a bucket's total plus its timings.
    """

    compile_s: float = 0.0
    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypass: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    # AOTAutograd runs cut short by Dynamo restarting its trace (``dynamic: true`` specializing
    # a float constant): no compile, but the first call traced twice, which is where its time
    # went (kiln.compiler.counters).
    aot_restarts: int = 0
    # Kernels handed to AsyncCompile: in a fresh process that is every kernel *loaded*, cache hit
    # or not (torch bumps its "async_compile_cache_miss" counter before looking anything up).
    kernel_loads: int = 0
    bundled_kernels: int = 0  # Triton kernels re-emitted from FX cache entries (not compiles)
    new_native: int = 0  # new C++ .so / Triton .cubin files not explained by bundling: compiles
    # GEMM autotunes of graphs compiled here + coordinate-descent benchmarks + new .best_config
    # files: re-benchmarking
    autotunes: int = 0
    # Kernels whose launch configs were benchmarked at run time (Inductor's autotuner): a served
    # process should read the bake's choice instead.
    kernel_tunings: int = 0
    # Those kernels by name, in a served process ("NAME (N configs)"): which one to look at.
    tuned_kernels: list[str] = Field(default_factory=list, max_length=MAX_TUNED)
    launchers: int = 0  # native helpers built with gcc at run time (Triton launchers, headers)
    written: int = 0  # other files a served process added or rewrote where it must not
    precompile_misses: int = 0  # calls no precompiled graph accepted (torch.compile fell back)
    new_files: list[str] = Field(default_factory=list)  # a sample of what compiles wrote: why
    unique_graphs: int = 0
    graph_breaks: int = 0
    recompile_reasons: list[str] = Field(default_factory=list)
    # Code objects Dynamo traced here ("name file:line"): a miss in a resume function names the
    # graph break whose other side serving reached (kiln.compiler.verify.explain).
    frames: list[str] = Field(default_factory=list, max_length=MAX_FRAMES)

    @property
    def compiles(self) -> int:
        """Everything that compiled: zero is the definition of a warm cache."""
        return sum(getattr(self, kind) for kind in WORK_KINDS)

    def counts(self) -> dict[str, Any]:
        """Only the :class:`CompileCounts` fields (a :class:`BucketStats` has more)."""
        return {name: getattr(self, name) for name in CompileCounts.model_fields}

    def __add__(self, other: CompileCounts) -> CompileCounts:
        names = CompileCounts.model_fields
        summed = {name: getattr(self, name) + getattr(other, name) for name in names}
        summed["new_files"] = summed["new_files"][:NEW_FILES_SAMPLE]
        summed["frames"] = list(dict.fromkeys(summed["frames"]))[:MAX_FRAMES]
        summed["tuned_kernels"] = summed["tuned_kernels"][:MAX_TUNED]
        return CompileCounts(**summed)


class BucketStats(CompileCounts):
    """One bucket of a grid pass: its compile counts and how long its calls took."""

    key: str
    sizes: dict[str, int]
    first_call_s: float
    steady_s: float
    first_request_s: float | None = None


class PassStats(_Model):
    order: list[str]
    compiles: int
    wall_s: float


MAX_SHARDS = 4096  # a shard holds at least one bucket, and a spec at most 4,096 (kiln.spec)


class ShardInfo(_Model):
    """Which slices of its spec's grid an artifact holds (``kiln bake --shard I/N``, merge).

    A shard's bake records its one index; a merge the union of its inputs'. ``complete`` says
    that every index of ``count`` is there, i.e. the whole grid (``kiln.grid.assign_shards``
    deals every bucket to exactly one index). Stored rather than derived so a reader of the
    JSON sees it, and checked here so it never disagrees with the indexes.
    """

    count: int = Field(ge=1, le=MAX_SHARDS)
    indexes: list[int] = Field(min_length=1, max_length=MAX_SHARDS)
    complete: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> ShardInfo:
        if self.indexes != sorted(set(self.indexes)):
            raise ValueError("shard indexes must be sorted and unique")
        if self.indexes[0] < 0 or self.indexes[-1] >= self.count:
            raise ValueError(f"shard indexes must be between 0 and {self.count - 1}")
        if self.complete != (len(self.indexes) == self.count):
            raise ValueError("shard.complete disagrees with the indexes")
        return self

    @classmethod
    def of(cls, count: int, indexes: list[int]) -> ShardInfo:
        unique = sorted(set(indexes))
        return cls(count=count, indexes=unique, complete=len(unique) == count)

    @property
    def label(self) -> str:
        """``1/3``, ``0,2/3`` or ``0-2/3 (complete)``: how inspect and errors name it."""
        if self.complete and self.count > 1:
            return f"0-{self.count - 1}/{self.count} (complete)"
        return f"{','.join(map(str, self.indexes))}/{self.count}"


class CopyEntry(_Model):
    """A file restore writes as a copy of a stored file: bytes identical across ranks are stored
    once. ``source`` must be a stored file (a ``files`` entry), never another copy, so a copy
    carries that entry's size and sha256 and is checked against them when it is written."""

    path: SafePath
    source: SafePath


class RankCaches(_Model):
    """One rank of a K-rank artifact: what it compiled and in which environment.

    Its files are those under ``ranks/RANK/`` (stored or copies); a serving rank's
    ``TORCHINDUCTOR_CACHE_DIR`` is ``ranks/RANK/inductor`` (:class:`kiln.layout.CacheLayout`).
    """

    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    fingerprint: dict[str, Any] = Field(description="this rank's process, device index included")
    grid: list[BucketStats] = Field(default_factory=list, description="this rank's bake pass")
    passes: list[PassStats] = Field(default_factory=list)
    megacache: str | None = None
    precompiled: str | None = None
    aoti: Aoti | None = Field(None, description="this rank's packages, under ranks/RANK/")
    same_as: int | None = Field(
        None, ge=0, description="rank 0 when this rank's folder holds rank 0's caches (same keys)"
    )


class Distributed(_Model):
    """The per-rank layout of a K-rank artifact (``spec.distributed``): explicit, so merging
    shards or bundling artifacts can pair up ranks without guessing from paths."""

    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)
    backend: str = Field(max_length=32)
    ranks: list[RankCaches]

    @model_validator(mode="after")
    def _every_rank_once(self) -> Distributed:
        found = [r.rank for r in self.ranks]
        if found != list(range(self.world_size)):
            raise ValueError(
                f"distributed.ranks must be ranks 0..{self.world_size - 1} in order, got {found}"
            )
        for r in self.ranks:
            if r.same_as not in (None, 0):
                raise ValueError(
                    f"rank {r.rank}: same_as {r.same_as}: only 0 (rank 0's caches) or null "
                    "(its own)"
                )
        return self


class Manifest(_Model):
    format: int = Field(default=1, ge=1)
    kiln_version: str = __version__
    name: str
    created: str  # ISO 8601, from SOURCE_DATE_EPOCH when set (reproducible builds)
    spec: dict[str, Any]
    spec_sha256: str
    model_source_sha256: str | None = None
    fingerprint: dict[str, Any]
    env: dict[str, str] = Field(
        default_factory=dict, description="environment the serving process must share"
    )
    grid: list[BucketStats]
    passes: list[PassStats] = Field(default_factory=list)
    totals: dict[str, float] = Field(default_factory=dict)
    files: list[FileEntry] = Field(max_length=MAX_FILES)
    megacache: str | None = None  # path of the Mega-Cache blob in the artifact, if captured
    precompiled: str | None = None  # path of the AOT-compiled forwards (compile.precompile)
    precompiled_frames: PrecompiledFrames | None = None  # Dynamo's frames (precompile, breaks)
    bytecode: Bytecode | None = None  # imported modules' bytecode, for images without it
    aoti: Aoti | None = None  # compile.route: aoti's packages (None: the torch.compile route)
    workdir: Workdir | None = None  # where shipped driver entries were JIT-compiled, if keyed
    # Digest of what a reproducible bake must reproduce: cache keys and code, not torch's
    # measured entries or timings (kiln.artifact.payload.payload_sha256). None: older kilns.
    payload_sha256: str | None = None
    # torch.compile(**compile_kwargs) exactly as the bake called it (None: baked before kiln
    # recorded it). Serving passes these (kiln.serving.served_torch_kwargs), not whatever this
    # kiln would derive from the spec.
    compile_kwargs: dict[str, Any] | None = None
    warnings: list[str] = Field(default_factory=list)  # what the bake could not settle
    graph_breaks: list[GraphBreak] = Field(default_factory=list, max_length=MAX_GRAPH_BREAKS)
    proof: ProofStats | None = None  # None: the bake was not proven (--no-prove, older kilns)
    # The slices of the grid this artifact holds (None: the whole grid, baked in one process).
    shard: ShardInfo | None = None
    # A K-rank artifact (format 2): each rank's fingerprint, grid and blobs; the top-level
    # fingerprint, grid, passes, megacache and precompiled are rank 0's.
    distributed: Distributed | None = None
    # Files restore writes as copies of stored ones (format 2; see CopyEntry).
    copies: list[CopyEntry] = Field(default_factory=list, max_length=MAX_FILES)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        # The name goes into kiln.env's comment, file names and URLs.
        if len(name) > MAX_NAME_LENGTH or not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(
                f"{_shown(name)} is not an artifact name "
                f"({NAME_PATTERN}, at most {MAX_NAME_LENGTH} characters)"
            )
        return name

    @field_validator("env")
    @classmethod
    def _allowed_env(cls, env: dict[str, str]) -> dict[str, str]:
        # restore writes these into kiln.env, which a shell in the pod sources.
        for key, value in env.items():
            problem = env_key_problem(key) or env_value_problem(key, value)
            if problem:
                raise ValueError(problem)
        return env

    @model_validator(mode="after")
    def _consistent_files(self) -> Manifest:
        """Rules across entries: each is one distinct file restore can create and own."""
        stored = {entry.path: entry for entry in self.files}
        paths: set[str] = set()
        for path in [entry.path for entry in self.files] + [c.path for c in self.copies]:
            if path in paths:
                raise ValueError(f"{_shown(path)} is listed twice")
            paths.add(path)
            top = path.split("/", 1)[0]
            if top in RESERVED_NAMES:
                raise ValueError(f"{_shown(path)}: restore writes {top} itself")
        clash = paths & folders_of(list(paths))
        if clash:
            raise ValueError(f"{_shown(min(clash))} is listed as a file and as a folder")
        if len(paths) > MAX_FILES:
            raise ValueError(f"{len(paths)} files and copies (at most {MAX_FILES})")
        for copy in self.copies:
            if copy.source not in stored:
                raise ValueError(f"copy {_shown(copy.path)}: its source is not a stored file")
            if stored[copy.source].kind == "bytecode":  # a pyc lies only where Python looks
                raise ValueError(f"copy {_shown(copy.path)}: its source is bytecode")
        total = self.total_bytes
        if total > MAX_TOTAL_BYTES:
            raise ValueError(f"files add up to {total} bytes (at most {MAX_TOTAL_BYTES})")
        blobs = [("megacache", self.megacache), ("precompiled", self.precompiled)]
        if self.distributed is not None:
            for r in self.distributed.ranks:
                blobs += [(f"rank {r.rank} megacache", r.megacache)]
                blobs += [(f"rank {r.rank} precompiled", r.precompiled)]
        for prefix, aoti in self._aoti_by_folder():
            blobs += [("aoti library", f"{prefix}{p.path}/{p.library}") for p in aoti.programs]
        for field, value in blobs:
            # Serving reads these paths under the restored folder: only a listed file will do.
            if value is not None and value not in paths:
                raise ValueError(f"{field} {_shown(value)} is not a listed file")
        self._check_ranks(paths)
        self._bytecode_files()
        return self

    def _bytecode_files(self) -> None:
        """Python bytecode (kiln.bytecode) as restore installs it, and a server imports it: under
        ``bytecode/`` only, each file a pyc of a library module it names by source path and
        source hash, at the path Python looks for that source's bytecode (the extractor then
        checks each header: a checked-hash pyc of that hash). Nothing else under ``bytecode/``:
        a server's pycache prefix serves every module it imports, its own code included."""
        tag = self.bytecode.python if self.bytecode is not None else None
        for entry in self.files:
            inside = entry.path.startswith(BYTECODE_DIR + "/")
            if not inside:
                if entry.kind == "bytecode":
                    raise ValueError(f"{_shown(entry.path)} is bytecode outside {BYTECODE_DIR}/")
                continue
            if tag is None:
                raise ValueError(
                    f"{_shown(entry.path)} is under {BYTECODE_DIR}/, and the manifest has no "
                    "bytecode section"
                )
            if entry.kind != "bytecode":
                raise ValueError(
                    f"{_shown(entry.path)} of kind {entry.kind!r} under {BYTECODE_DIR}/ (only "
                    "bytecode is)"
                )
            if entry.source is None or entry.source_hash is None:
                raise ValueError(
                    f"bytecode {_shown(entry.path)} names no source (source and source_hash)"
                )
            problem = library_problem(entry.source)
            if problem:
                raise ValueError(f"bytecode {_shown(entry.path)}: {problem}")
            where = f"{BYTECODE_DIR}/{pyc_path(entry.source, tag)}"
            if entry.path != where:
                raise ValueError(
                    f"bytecode {_shown(entry.path)} is not where Python looks for "
                    f"{_shown(entry.source)}'s ({_shown(where)})"
                )

    def _aoti_by_folder(self) -> list[tuple[str, Aoti]]:
        """Each set of AOTInductor packages with the folder its paths are relative to: the
        artifact's root, or for a K-rank artifact each rank's folder (the top-level ``aoti``
        is rank 0's)."""
        if self.distributed is None:
            return [("", self.aoti)] if self.aoti is not None else []
        return [(CacheLayout(rank=r.rank).prefix, r.aoti) for r in self.distributed.ranks if r.aoti]

    def _check_ranks(self, paths: set[str]) -> None:
        """A K-rank manifest is format 2 and keeps every file in one of its rank folders, but
        the Python bytecode: one tree of stored files under ``bytecode/`` that every rank
        imports from (checked by :meth:`_bytecode_files`; a copy is never bytecode)."""
        if (self.distributed is not None or self.copies) and self.format < RANKS_FORMAT:
            raise ValueError(f"distributed and copies need format {RANKS_FORMAT}")
        if self.distributed is None:
            if self.copies:
                raise ValueError("copies are only for the ranks of a distributed artifact")
            return
        world = self.distributed.world_size
        shared = {e.path for e in self.files if e.is_bytecode}
        for path in sorted(paths - shared):
            rank = rank_of(path)
            if rank is None or rank >= world:
                raise ValueError(
                    f"{_shown(path)} is in no rank folder ({RANKS_DIR}/0..{world - 1}/)"
                )
        first = self.distributed.ranks[0] if self.distributed.ranks else None
        if first and (self.megacache, self.precompiled) != (first.megacache, first.precompiled):
            raise ValueError("megacache and precompiled of a distributed artifact are rank 0's")
        for r in self.distributed.ranks:
            for field, value in (("megacache", r.megacache), ("precompiled", r.precompiled)):
                if value is not None and rank_of(value) != r.rank:
                    raise ValueError(f"rank {r.rank} {field} {_shown(value)} is another rank's")

    def entries(self) -> list[FileEntry]:
        """Every file a restore installs: the stored ones, then each copy as its source's entry
        at the copy's path (same size, sha256 and kind)."""
        stored = {entry.path: entry for entry in self.files}
        copied = [stored[c.source].model_copy(update={"path": c.path}) for c in self.copies]
        return [*self.files, *copied]

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        """Bytes installed, copies included (what restore needs on disk)."""
        return sum(f.size for f in self.entries())

    @property
    def stored_bytes(self) -> int:
        """Bytes in the archive: each file identical across ranks once."""
        return sum(f.size for f in self.files)

    @property
    def world_size(self) -> int:
        return self.distributed.world_size if self.distributed else 1

    @property
    def route(self) -> str:
        """``aoti`` where the artifact serves from AOTInductor packages (compile.route: aoti),
        else ``compile``: which factors matter and how a miss is worded."""
        return "aoti" if self.aoti is not None else "compile"

    @property
    def rank_world(self) -> int | None:
        """K for an artifact with per-rank folders (``distributed``, even of 1 rank), None for
        one without: the ``world`` of :meth:`kiln.layout.CacheLayout.ranks`."""
        return self.distributed.world_size if self.distributed else None

    def bytes_by_kind(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for f in self.entries():
            n, b = out.get(f.kind, (0, 0))
            out[f.kind] = (n + 1, b + f.size)
        return dict(sorted(out.items()))
