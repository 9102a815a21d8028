"""Hand-made archives for restore tests: valid ones and hostile ones, built with raw tarfile."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import zstandard

from kiln.manifest import FileEntry, Manifest


def manifest_for(files: dict[str, bytes], name: str = "demo") -> Manifest:
    return Manifest(
        name=name,
        created="1970-01-01T00:00:00+00:00",
        spec={},
        spec_sha256="0" * 64,
        fingerprint={"device.type": "cpu"},
        grid=[],
        files=[
            FileEntry(path=p, size=len(d), sha256=hashlib.sha256(d).hexdigest(), kind="other")
            for p, d in sorted(files.items())
        ],
    )


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
    manifest: Manifest | None,
    members: list[tuple[tarfile.TarInfo, bytes]],
) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if manifest is not None:
            body = manifest.to_bytes()
            tar.addfile(reg("manifest.json", body)[0], io.BytesIO(body))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


def good_archive(path: Path, files: dict[str, bytes] | None = None) -> Path:
    files = files or {"inductor/fxgraph/a/entry": b"A" * 1000, "inductor/xy/k.py": b"print(1)\n"}
    return write_archive(path, manifest_for(files), [reg(p, d) for p, d in sorted(files.items())])
