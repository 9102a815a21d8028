"""Hand-made archives for restore tests: valid ones and hostile ones, built with raw tarfile.

``HOSTILE`` is the corpus of archives every reader must refuse with exit 3: one or more per class
of attack that has been found (injection through ``kiln.env``, unbounded paths and manifests,
entries restore cannot create, tar-level bombs). Add to it whenever a new class turns up.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from kiln.artifact.manifest import MAX_FILES, Bytecode, FileEntry, Manifest
from kiln.layout import MAX_MANIFEST_BYTES

FILES = {"inductor/fxgraph/a/entry": b"A" * 1000, "inductor/xy/k.py": b"print(1)\n"}


def manifest_for(files: dict[str, bytes], name: str = "demo", **fields: Any) -> Manifest:
    """A manifest listing ``files``, deliberately *not* validated: hostile archives need
    manifests that the reader must refuse, so only the reader may judge them."""
    values: dict[str, Any] = {
        "name": name,
        "created": "1970-01-01T00:00:00+00:00",
        "spec": {},
        "spec_sha256": "0" * 64,
        "fingerprint": {"device.type": "cpu"},
        "grid": [],
        "files": [
            FileEntry.model_construct(
                path=p, size=len(d), sha256=hashlib.sha256(d).hexdigest(), kind="other"
            )
            for p, d in sorted(files.items())
        ],
    }
    return Manifest.model_construct(**{**values, **fields})


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, type_: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    return info, b""


def write_archive(
    path: Path,
    manifest: Manifest | dict[str, Any] | bytes | None,
    members: list[tuple[tarfile.TarInfo, bytes]],
) -> Path:
    """An artifact whose first member is ``manifest`` (a model, a JSON-able dict, or raw bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if manifest is not None:
            if isinstance(manifest, Manifest):
                body = manifest.to_bytes()
            elif isinstance(manifest, dict):
                body = json.dumps(manifest).encode()
            else:
                body = manifest
            tar.addfile(reg("manifest.json", body)[0], io.BytesIO(body))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


def good_archive(path: Path, files: dict[str, bytes] | None = None) -> Path:
    files = files or FILES
    return write_archive(path, manifest_for(files), [reg(p, d) for p, d in sorted(files.items())])


# --- the hostile corpus ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    """One hostile archive: how to build it, and what the refusal (exit 3) must say."""

    id: str
    build: Callable[[Path], Path]
    match: str  # a regex the IntegrityError message matches
    manifest_level: bool = True  # refused by read_manifest (kiln inspect) too, not only restore


def _manifest_dict(files: dict[str, bytes] | None = None, **changes: Any) -> dict[str, Any]:
    data = manifest_for(FILES if files is None else files).model_dump(mode="json")
    data.update(changes)
    return data


def _with_manifest(
    files: dict[str, bytes] | None = None,
    *,
    members: dict[str, bytes] | None = None,
    edit: Callable[[dict[str, Any]], None] | None = None,
    **changes: Any,
) -> Callable[[Path], Path]:
    """A builder: the manifest for ``files`` (changed by ``changes``/``edit``) and ``members``
    (by default the files themselves) as regular members."""

    def build(path: Path) -> Path:
        data = _manifest_dict(files, **changes)
        if edit is not None:
            edit(data)
        contents = (FILES if files is None else files) if members is None else members
        return write_archive(path, data, [reg(p, d) for p, d in sorted(contents.items())])

    return build


def _duplicate(conflicting: bool) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        twin = dict(data["files"][0])
        if conflicting:
            twin["sha256"] = hashlib.sha256(b"other").hexdigest()
        data["files"].append(twin)

    return edit


def _huge_manifest_header(path: Path) -> Path:
    """A manifest member whose header claims more than MAX_MANIFEST_BYTES, and then nothing: a
    reader that looks at the bytes before the header's size says "truncated", not "too large"."""
    info = tarfile.TarInfo("manifest.json")
    info.size = MAX_MANIFEST_BYTES + 1
    path.write_bytes(zstandard.ZstdCompressor().compress(info.tobuf(tarfile.PAX_FORMAT)))
    return path


def _too_many_files(path: Path) -> Path:
    """MAX_FILES + 1 entries in compact JSON: well under the size cap, over the count."""
    entry = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest(), "kind": "other"}
    data = _manifest_dict()
    data["files"] = [{"path": f"inductor/{i}", **entry} for i in range(MAX_FILES + 1)]
    return write_archive(path, json.dumps(data, separators=(",", ":")).encode(), [])


def _tar_bytes(*blocks: bytes) -> bytes:
    return b"".join(blocks) + b"\0" * 1024


def _header(name: str, size: int, type_: bytes = tarfile.REGTYPE, **pax: str) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.pax_headers = size, type_, pax
    return info.tobuf(tarfile.PAX_FORMAT)


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def _raw(path: Path, tar: bytes) -> Path:
    path.write_bytes(zstandard.ZstdCompressor().compress(tar))
    return path


def _manifest_blocks() -> bytes:
    body = manifest_for(FILES).to_bytes()
    return _header("manifest.json", len(body)) + _padded(body)


def _pax_bomb(path: Path) -> Path:
    """A 16 MiB PAX comment on the first header: tarfile would buffer all of it."""
    body = manifest_for(FILES).to_bytes()
    head = _header("manifest.json", len(body), comment="x" * (16 << 20))
    return _raw(path, _tar_bytes(head, _padded(body)))


def _pax_chain(path: Path) -> Path:
    """5,000 PAX headers in a row: tarfile follows them by recursion (RecursionError)."""
    record = b"18 comment=abcdef\n"
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, len(record)
    link = pax.tobuf(tarfile.USTAR_FORMAT) + _padded(record)
    return _raw(path, _tar_bytes(link * 5000, _manifest_blocks()))


def _folder_flood(path: Path) -> Path:
    """The manifest, then 10,000 entries for one listed folder (compresses to almost nothing;
    tarfile keeps every member it reads in memory)."""
    folder = _header("inductor", 0, tarfile.DIRTYPE)
    files = [_header(p, len(d)) + _padded(d) for p, d in sorted(FILES.items())]
    return _raw(path, _tar_bytes(_manifest_blocks(), folder * 10_000, *files))


# --- Python bytecode as a bake ships it (kiln.bytecode) ----------------------------------------

PYC_TAG = "cpython-312"


def pyc(source: str, text: bytes = b"X = 1\n", *, checked: bool = True) -> tuple[str, bytes, dict]:
    """(path in the artifact, bytes, FileEntry fields) of the bytecode of ``source`` (an absolute
    path) as holding ``text``: a hash-based pyc, checked or not, as ``py_compile`` writes it."""
    import importlib._bootstrap_external as ext  # the writer py_compile itself uses
    import importlib.util

    head, _, name = source.rpartition("/")
    path = f"bytecode{head}/{name.removesuffix('.py')}.{PYC_TAG}.pyc"
    source_hash = importlib.util.source_hash(text)
    data = bytes(ext._code_to_hash_pyc(compile(text, source, "exec"), source_hash, checked))
    fields = {"kind": "bytecode", "source": source, "source_hash": source_hash.hex()}
    return path, data, fields


def _bytecode(
    source: str = "/usr/lib/python3.12/json/decoder.py",
    *,
    checked: bool = True,
    fields: dict[str, Any] | None = None,
    path: str | None = None,
    header_text: bytes | None = None,
) -> Callable[[Path], Path]:
    """A builder: FILES plus one pyc of ``source`` (its entry's fields changed by ``fields``,
    stored at ``path``; its header's source hash that of ``header_text`` if given)."""

    def build(out: Path) -> Path:
        at, data, listed = pyc(source, checked=checked)
        if header_text is not None:
            data = pyc(source, header_text, checked=checked)[1]
        at = path or at
        files = {**FILES, at: data}
        manifest = manifest_for(files, bytecode=Bytecode(python=PYC_TAG, modules=1))
        body = manifest.model_dump(mode="json")
        for entry in body["files"]:
            if entry["path"] == at:
                entry.update({**listed, **(fields or {})})
        return write_archive(out, body, [reg(p, d) for p, d in sorted(files.items())])

    return build


LONG = "inductor/" + "a" * 4991  # 5,000 characters
MARKUP = "inductor/[/bold]x"  # rich markup: crashed the error printer

HOSTILE: list[Hostile] = [
    # kiln.env injection through the manifest's env and name
    Hostile("env-key-injection", _with_manifest(env={"A=1; touch pwned; B": "1"}), "shell var"),
    Hostile("env-key-newline", _with_manifest(env={"TORCH_X\n": "1"}), "shell variable"),
    Hostile("env-ld-preload", _with_manifest(env={"LD_PRELOAD": "/tmp/x.so"}), "LD_PRELOAD"),
    Hostile("env-path", _with_manifest(env={"PATH": "/tmp"}), "PATH"),
    Hostile("env-pythonpath", _with_manifest(env={"PYTHONPATH": "/tmp"}), "PYTHONPATH"),
    Hostile(
        "env-cache-dir",
        _with_manifest(env={"TORCHINDUCTOR_CACHE_DIR": "/tmp/elsewhere"}),
        "TORCHINDUCTOR_CACHE_DIR",
    ),
    Hostile("env-triton-home", _with_manifest(env={"TRITON_HOME": "/tmp"}), "TRITON_HOME"),
    # kiln.env quotes the manifest's workdir into shell code and messages (kiln.workdir)
    Hostile(
        "workdir-newline",
        _with_manifest(workdir={"path": "/app\n$(touch pwned)", "keyed": 1}),
        "printable",
    ),
    Hostile("workdir-relative", _with_manifest(workdir={"path": "app", "keyed": 1}), "absolute"),
    Hostile("workdir-long", _with_manifest(workdir={"path": "/" + "a" * 2000, "keyed": 1}), "1024"),
    Hostile("workdir-dotdot", _with_manifest(workdir={"path": "/a/../b", "keyed": 1}), "shell"),
    Hostile("workdir-unkeyed", _with_manifest(workdir={"path": "/app", "keyed": 0}), "keyed"),
    Hostile("env-cuda-cache", _with_manifest(env={"CUDA_CACHE_PATH": "/tmp"}), "CUDA_CACHE_PATH"),
    Hostile("env-nul-value", _with_manifest(env={"TORCH_LOGS": "a\x00b"}), "NUL"),
    Hostile("name-newline", _with_manifest(name="demo\ntouch pwned"), "not an artifact name"),
    Hostile("name-too-long", _with_manifest(name="a" * 129), "not an artifact name"),
    # paths restore could not create, or that are not what they seem
    Hostile("path-5000", _with_manifest({LONG: b"x"}), "5000 bytes"),
    Hostile(
        "member-5000",
        _with_manifest(members={**FILES, LONG: b"x"}),
        "5000 bytes",
        manifest_level=False,
    ),
    Hostile("path-long-name", _with_manifest({"inductor/" + "b" * 256: b"x"}), "256-byte name"),
    Hostile("path-deep", _with_manifest({"/".join(["d"] * 40): b"x"}), "40 levels"),
    Hostile("path-control", _with_manifest({"inductor/\x1b[2Jx": b"x"}), "unsafe member name"),
    Hostile("path-backslash", _with_manifest({"inductor\\..\\x": b"x"}), "unsafe member name"),
    Hostile("file-and-folder", _with_manifest({"a": b"x", "a/b": b"y"}), "file and as a folder"),
    Hostile("reserved-env", _with_manifest({"kiln.env": b"x"}), "writes kiln.env"),
    Hostile("reserved-state", _with_manifest({".kiln-installed.json": b"{}"}), "installed"),
    Hostile("reserved-manifest", _with_manifest({"manifest.json": b"{}"}), "writes manifest"),
    Hostile("reserved-folder", _with_manifest({"kiln.env/x": b"x"}), "writes kiln.env"),
    Hostile("duplicate-conflicting", _with_manifest(edit=_duplicate(True)), "listed twice"),
    Hostile("duplicate-identical", _with_manifest(edit=_duplicate(False)), "listed twice"),
    Hostile(
        "megacache-outside",
        _with_manifest(megacache="../../etc/passwd"),
        "megacache '../../etc/passwd' is not a listed file",
    ),
    Hostile(
        "markup-name",
        _with_manifest({MARKUP: b"x"}, members={MARKUP: b"y"}),
        "sha256",
        manifest_level=False,
    ),
    # sizes and counts
    Hostile("manifest-9mib", _huge_manifest_header, "more than kiln reads"),
    Hostile("too-many-files", _too_many_files, "at most 50000"),
    Hostile(
        "size-huge",
        _with_manifest(edit=lambda d: d["files"][0].update(size=2**41)),
        "less than or equal",
    ),
    Hostile(
        "size-negative",
        _with_manifest(edit=lambda d: d["files"][0].update(size=-1)),
        "greater than or equal",
    ),
    Hostile(
        "total-huge",
        _with_manifest(
            edit=lambda d: [f.update(size=2**40) for f in d["files"]],
        ),
        "add up to",
    ),
    Hostile("format-zero", _with_manifest(format=0), "format"),
    # Python bytecode (issue 27, item 1): only checked-hash pycs of the library modules the
    # manifest lists, by source path and source hash, each where Python would look for it
    Hostile("bytecode-app-module", _bytecode("/app/server.py"), "not a library module"),
    Hostile(
        "bytecode-relative",
        _bytecode("usr/lib/python3.12/a.py", path="bytecode/usr/lib/python3.12/a.cpython-312.pyc"),
        "not an absolute, normalized path",
    ),
    Hostile(
        "bytecode-no-source",
        _bytecode(fields={"source": None}),
        "bytecode 'bytecode/usr/.*' names no source",
    ),
    Hostile("bytecode-bad-hash", _bytecode(fields={"source_hash": "xyz"}), "source_hash"),
    Hostile(
        "bytecode-elsewhere",
        _bytecode(path="bytecode/usr/lib/python3.12/json/encoder.cpython-312.pyc"),
        "is not where Python looks for",
    ),
    Hostile(
        "bytecode-kind-outside",
        _bytecode(path="inductor/xy/decoder.cpython-312.pyc"),
        "bytecode outside bytecode/",
    ),
    Hostile("bytecode-other-kind", _bytecode(fields={"kind": "other"}), "kind 'other' under"),
    Hostile(
        "bytecode-no-python",
        _with_manifest({"bytecode/x.pyc": b"x"}, edit=lambda d: d.update(bytecode=None)),
        "no bytecode section",
    ),
    Hostile(
        "bytecode-unchecked",
        _bytecode(checked=False),
        "not a checked-hash pyc",
        manifest_level=False,
    ),
    Hostile(
        "bytecode-other-source",
        _bytecode(header_text=b"import os; os.system('touch pwned')\n"),
        "source hash",
        manifest_level=False,
    ),
    # tar-level bombs
    Hostile("pax-bomb", _pax_bomb, "header"),
    Hostile("pax-chain", _pax_chain, "header"),
    Hostile("folder-flood", _folder_flood, "more than the", manifest_level=False),
]


def sha(path: Path) -> str:
    """The hex sha256 of a file, computed here rather than by the code under test."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes ({} when ``d`` is missing): DEST before and after."""
    if not d.exists():
        return {}
    return {
        p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
    }


# --- bundles: variants with synthetic fingerprints, and hostile bundles -------------------------

CPU_FP = {"device.type": "cpu", "torch.version": "2.13.0+cpu", "torch.cuda": None}
H200_FP = {
    "device.type": "cuda",
    "gpu.name": "NVIDIA H200",
    "gpu.capability": "9.0",
    "torch.version": "2.11.0+cu130",
    "torch.cuda": "13.0",
    "platform": "Linux-x86_64",
}
A100_FP = {**H200_FP, "gpu.name": "NVIDIA A100-SXM4-80GB", "gpu.capability": "8.0"}


def variant_archive(
    path: Path, fingerprint: dict[str, Any], files: dict[str, bytes] | None = None
) -> Path:
    """A valid artifact baked (so its manifest says) on ``fingerprint``'s machine: what real
    GPU bakes record, edited into a CPU-made manifest (tests/archives.py builds no GPU bake)."""
    files = files or {"inductor/fxgraph/a/entry": json.dumps(fingerprint).encode()}
    manifest = manifest_for(files, fingerprint=fingerprint)
    return write_archive(path, manifest, [reg(p, d) for p, d in sorted(files.items())])


def bundle_index_for(variants: dict[str, tuple[bytes, dict[str, Any]]]) -> dict[str, Any]:
    """``bundle.json`` for ``{name: (artifact bytes, selection fields)}``, unvalidated."""
    return {
        "format": 1,
        "kind": "kiln-bundle",
        "variants": [
            {
                "name": name,
                "path": f"variants/{name}.kiln.tar.zst",
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "artifact": "demo",
                **key,
            }
            for name, (data, key) in sorted(variants.items())
        ],
    }


def write_bundle_raw(
    path: Path, index: dict[str, Any] | bytes | None, members: list[tuple[tarfile.TarInfo, bytes]]
) -> Path:
    """A bundle file: ``bundle.json`` (a dict or raw bytes; None: none) then ``members``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if index is not None:
            body = index if isinstance(index, bytes) else json.dumps(index).encode()
            tar.addfile(reg("bundle.json", body)[0], io.BytesIO(body))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


CPU_KEY = {"device": "cpu", "torch": "2.13.0+cpu"}
GPU_KEY = {
    "device": "cuda",
    "gpu": "NVIDIA H200",
    "capability": "9.0",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
}


def _artifact_bytes(tmp: Path, files: dict[str, bytes] | None = None) -> bytes:
    return good_archive(tmp, files).read_bytes()


def _bundle(
    *,
    edit: Callable[[dict[str, Any]], None] | None = None,
    members: Callable[[dict[str, bytes]], list[tuple[tarfile.TarInfo, bytes]]] | None = None,
    cpu_artifact: Callable[[Path], bytes] | None = None,
) -> Callable[[Path], Path]:
    """A builder: a cpu and a gpu variant (the cpu one is what a CPU machine restores), the
    index changed by ``edit``, the members by ``members`` (default: each variant, in order)."""

    def build(path: Path) -> Path:
        cpu = (cpu_artifact or _cpu_variant)(path.with_suffix(".cpu"))
        gpu = variant_archive(path.with_suffix(".gpu"), H200_FP, {"inductor/g": b"gpu"})
        gpu_bytes = gpu.read_bytes()
        variants = {"cpu": (cpu, CPU_KEY), "h200": (gpu_bytes, GPU_KEY)}
        index = bundle_index_for(variants)
        if edit is not None:
            edit(index)
        blobs = {f"variants/{n}.kiln.tar.zst": d for n, (d, _) in variants.items()}
        listed = members(blobs) if members else [reg(p, d) for p, d in sorted(blobs.items())]
        return write_bundle_raw(path, index, listed)

    return build


def _cpu_variant(path: Path) -> bytes:
    """The cpu variant: its manifest's fingerprint selects it as CPU_KEY does."""
    return variant_archive(path, CPU_FP, FILES).read_bytes()


def _hostile_variant(path: Path) -> bytes:
    return BY_ID_HOSTILE["env-ld-preload"].build(path).read_bytes()


def _nested_bundle(path: Path) -> bytes:
    return _bundle()(path).read_bytes()


def _index_first_missing(path: Path) -> Path:
    data = _artifact_bytes(path.with_suffix(".cpu"))
    index = bundle_index_for({"cpu": (data, CPU_KEY)})
    return write_bundle_raw(
        path,
        None,
        [reg("variants/cpu.kiln.tar.zst", data), reg("bundle.json", json.dumps(index).encode())],
    )


def _index_huge_header(path: Path) -> Path:
    info = tarfile.TarInfo("bundle.json")
    info.size = (1 << 20) + 1
    return _raw(path, info.tobuf(tarfile.PAX_FORMAT))


def _index_pax_bomb(path: Path) -> Path:
    body = b"{}"
    head = _header("bundle.json", len(body), comment="x" * (16 << 20))
    return _raw(path, _tar_bytes(head, _padded(body)))


def _too_many_variants(path: Path) -> Path:
    variants = {
        f"v{i}": (b"x", {"device": "cuda", "gpu": f"GPU {i}", "torch": "2.11.0"}) for i in range(65)
    }
    return write_bundle_raw(path, bundle_index_for(variants), [])


def _set_cpu(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(index: dict[str, Any]) -> None:
        index["variants"][0].update(fields)

    return edit


def _twice(key_only: bool) -> Callable[[dict[str, Any]], None]:
    def edit(index: dict[str, Any]) -> None:
        twin = dict(index["variants"][0])
        if key_only:
            twin.update(name="cpu2", path="variants/cpu2.kiln.tar.zst")
        index["variants"].append(twin)

    return edit


def _symlink_member(blobs: dict[str, bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [special("variants/cpu.kiln.tar.zst", tarfile.SYMTYPE, "/etc/passwd")]


def _unlisted_first(blobs: dict[str, bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [reg("variants/evil.kiln.tar.zst", b"x"), *[reg(p, d) for p, d in sorted(blobs.items())]]


def _traversal_member(blobs: dict[str, bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [reg("../../etc/cron.d/x", b"x"), *[reg(p, d) for p, d in sorted(blobs.items())]]


def _gpu_only(blobs: dict[str, bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [reg(p, d) for p, d in sorted(blobs.items()) if "h200" in p]


def _gpu_twice(blobs: dict[str, bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    gpu = [reg(p, d) for p, d in sorted(blobs.items()) if "h200" in p]
    # the gpu variant first, twice, then the cpu one (the index order is not what is checked)
    return [*gpu, *gpu, *[reg(p, d) for p, d in sorted(blobs.items()) if "cpu" in p]]


def _short_member(blobs: dict[str, bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [reg(p, d[:-1] if "cpu" in p else d) for p, d in sorted(blobs.items())]


BY_ID_HOSTILE = {h.id: h for h in HOSTILE}

# Bundles every reader must refuse with exit 3 (restored on a CPU machine: the cpu variant is
# the one chosen). ``manifest_level``: refused from the index alone (kiln inspect too).
HOSTILE_BUNDLES: list[Hostile] = [
    Hostile("bundle-index-not-first", _index_first_missing, "manifest.json is not the first"),
    Hostile("bundle-index-9mib", _index_huge_header, "more than kiln reads"),
    Hostile("bundle-index-pax-bomb", _index_pax_bomb, "header"),
    Hostile("bundle-index-not-json", lambda p: write_bundle_raw(p, b"{nope", []), "refused"),
    Hostile("bundle-too-many", _too_many_variants, "at most 64"),
    Hostile(
        "bundle-name-traversal", _bundle(edit=_set_cpu(name="../x")), "name: String should match"
    ),
    Hostile(
        "bundle-path-elsewhere",
        _bundle(edit=_set_cpu(path="../../etc/passwd")),
        "is not 'variants/cpu.kiln.tar.zst'",
    ),
    Hostile("bundle-gpu-control", _bundle(edit=_set_cpu(gpu="\x1b[2J")), "control characters"),
    Hostile("bundle-size-negative", _bundle(edit=_set_cpu(size=-1)), "greater than or equal"),
    Hostile("bundle-name-twice", _bundle(edit=_twice(False)), "listed twice"),
    Hostile("bundle-key-twice", _bundle(edit=_twice(True)), "same selection key"),
    Hostile("bundle-format-zero", _bundle(edit=lambda i: i.update(format=0)), "format"),
    Hostile("bundle-kind", _bundle(edit=lambda i: i.update(kind="tar")), "kind"),
    Hostile(
        "bundle-member-symlink",
        _bundle(members=_symlink_member),
        "not a regular file",
        manifest_level=False,
    ),
    Hostile(
        "bundle-member-unlisted",
        _bundle(members=_unlisted_first),
        "not in bundle.json",
        manifest_level=False,
    ),
    Hostile(
        "bundle-member-traversal",
        _bundle(members=_traversal_member),
        "path traversal",
        manifest_level=False,
    ),
    Hostile(
        "bundle-member-missing", _bundle(members=_gpu_only), "missing variant", manifest_level=False
    ),
    Hostile(
        "bundle-member-twice", _bundle(members=_gpu_twice), "appears twice", manifest_level=False
    ),
    Hostile(
        "bundle-member-size",
        _bundle(members=_short_member),
        "bundle.json says",
        manifest_level=False,
    ),
    Hostile(
        "bundle-sha-mismatch",
        _bundle(edit=_set_cpu(sha256="0" * 64)),
        "differs from the bundle index",
        manifest_level=False,
    ),
    Hostile(
        "bundle-variant-hostile",
        _bundle(cpu_artifact=_hostile_variant),
        "LD_PRELOAD",
        manifest_level=False,
    ),
    # the index calls the variant what its manifest is not (the CPU artifact an H100 one, here
    # another torch build): installed on a machine the manifest never matched
    Hostile(
        "bundle-key-lies",
        _bundle(edit=_set_cpu(torch="2.99.0+cpu")),
        r"the bundle index says cpu · torch 2\.99\.0\+cpu, its manifest cpu · torch 2\.13\.0",
        manifest_level=False,
    ),
    Hostile(
        "bundle-nested",
        _bundle(cpu_artifact=_nested_bundle),
        "manifest.json is not the first",
        manifest_level=False,
    ),
]
