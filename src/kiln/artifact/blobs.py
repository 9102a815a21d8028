"""Merging the two blobs a bake may write beside its cache folder, without torch.

``kiln merge`` combines shards' artifacts; their folders merge file by file, but each shard also
carries one blob that bundles what *it* compiled:

- the **Mega-Cache blob** (``torch.compiler.save_cache_artifacts()``), torch's
  ``AppendingByteSerializer`` format (``torch/utils/_appending_byte_serializer.py``, unchanged
  from 2.7 to 2.13): a big-endian CRC-32 of the rest, a uint64 format version (1), then records
  of an artifact type (a length-prefixed base64 string), a uint64 count, and that many
  (key: base64 string, content: length-prefixed bytes). No pickle at this level, so it can be
  read, checked and rewritten here byte for byte. Torch loads it with ``dict(records)``: a type
  must appear once, holding every artifact of that type.
- the **precompiled forwards** (``AOTCompiledModel.serialize()``, ``compile.precompile``): a
  pickled ``list`` of ``bytes``, one opaque entry per baked graph. The outer list is read with
  an opcode allow-list (no globals, nothing callable: never an unpickler that could run code);
  the entries are only copied, never looked into.

Both merges are deterministic (sorted, deduplicated), so shards given in any order give the
same bytes. The Mega-Cache blob only serves bench's ``megacache`` mode and tools that hot-load
it: when shards' blobs cannot be merged (torch changed the format, two shards disagree on one
key) the merged artifact goes without one and says why. The precompiled forwards are what a
``precompile: true`` server loads, so failing to merge them is an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle
import pickletools
import struct
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kiln.errors import IntegrityError
from kiln.files import CHUNK

MEGACACHE_VERSION = 1  # torch's _ENCODING_VERSION
# Types whose artifacts torch stores under a file named by their content's hash, so that several
# contents for one key (two shards' entries for one graph, timings differ) live side by side.
# For any other type one key is one file: two contents for it are a disagreement.
MULTI_ENTRY_TYPES = frozenset({"inductor", "aot_autograd"})
_U64 = struct.Struct(">Q")
_MAX_TEXT = 1 << 16  # bytes of one base64 type name or key (real keys are ~60-200)


class BlobFormatError(ValueError):
    """A blob is not in the format this module knows: the caller decides what that costs."""


@dataclass(frozen=True)
class _Artifact:
    type: str
    key: str
    sha256: str
    offset: int  # of the content in its blob
    size: int
    source: Path


# --- the Mega-Cache blob ------------------------------------------------------------------------
def _read_exact(fh: BinaryIO, n: int, what: str) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise BlobFormatError(f"ends inside {what}")
    return data


def _length(fh: BinaryIO, left: int, what: str) -> int:
    (n,) = _U64.unpack(_read_exact(fh, 8, what))
    if n > left:
        raise BlobFormatError(f"{what} claims {n} bytes, {left} are left")
    return n


def _text(fh: BinaryIO, end: int, what: str) -> str:
    n = _length(fh, end - fh.tell() - 8, what)
    if n > _MAX_TEXT:
        raise BlobFormatError(f"{what} of {n} bytes")
    try:
        return base64.b64decode(_read_exact(fh, n, what), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise BlobFormatError(f"{what} is not base64 UTF-8") from None


def read_megacache(path: Path) -> list[_Artifact]:
    """The artifacts in a Mega-Cache blob, checked (CRC, version, every length) and located by
    offset: contents are hashed while reading and copied later, never held in memory."""
    size = path.stat().st_size
    out: list[_Artifact] = []
    with open(path, "rb") as fh:
        (crc,) = struct.unpack(">I", _read_exact(fh, 4, "the checksum"))
        actual = 0
        while chunk := fh.read(CHUNK):
            actual = zlib.crc32(chunk, actual)
        if actual != crc:
            raise BlobFormatError("its CRC-32 does not match its bytes")
        fh.seek(4)
        (version,) = _U64.unpack(_read_exact(fh, 8, "the version"))
        if version != MEGACACHE_VERSION:
            raise BlobFormatError(f"format version {version} (kiln knows {MEGACACHE_VERSION})")
        while fh.tell() < size:
            kind = _text(fh, size, "an artifact type")
            (count,) = _U64.unpack(_read_exact(fh, 8, "a count"))
            if count > size:
                raise BlobFormatError(f"{count} artifacts claimed")
            for _ in range(count):
                key = _text(fh, size, "a key")
                n = _length(fh, size - fh.tell() - 8, "a content")
                offset, h, left = fh.tell(), hashlib.sha256(), n
                while left:
                    chunk = _read_exact(fh, min(CHUNK, left), "a content")
                    h.update(chunk)
                    left -= len(chunk)
                out.append(_Artifact(kind, key, h.hexdigest(), offset, n, path))
    return out


def merge_megacache(blobs: list[tuple[str, Path]], out: Path) -> None:
    """Write one Mega-Cache blob holding every artifact of ``blobs`` ((artifact, blob) pairs:
    the artifact names the blob in messages), each once.

    Types are sorted, and artifacts within a type by (key, content digest): the bytes do not
    depend on the order of ``blobs``. Raises :class:`BlobFormatError` for a blob this cannot
    read, or two contents for one key of a type that keeps one file per key.
    """
    by_type: dict[str, dict[tuple[str, str], _Artifact]] = {}
    for label, blob in blobs:
        try:
            artifacts = read_megacache(blob)
        except BlobFormatError as exc:
            raise BlobFormatError(f"{label}: {blob.name}: {exc}") from None
        for a in artifacts:
            by_type.setdefault(a.type, {}).setdefault((a.key, a.sha256), a)
    for kind, found in by_type.items():
        if kind in MULTI_ENTRY_TYPES:
            continue
        twice = sorted(k for k, n in Counter(key for key, _ in found).items() if n > 1)
        if twice:
            raise BlobFormatError(f"two shards hold different {kind!r} artifacts for {twice[0]!r}")
    with open(out, "w+b") as fh:
        fh.write(b"\0\0\0\0")  # the CRC, written last
        fh.write(_U64.pack(MEGACACHE_VERSION))
        for kind in sorted(by_type):
            _write_text(fh, kind)
            fh.write(_U64.pack(len(by_type[kind])))
            for key_sha in sorted(by_type[kind]):
                a = by_type[kind][key_sha]
                _write_text(fh, a.key)
                fh.write(_U64.pack(a.size))
                _copy_range(a.source, a.offset, a.size, fh)
        fh.seek(4)
        crc = 0
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
        fh.seek(0)
        fh.write(struct.pack(">I", crc))


def _write_text(fh: BinaryIO, text: str) -> None:
    data = base64.b64encode(text.encode("utf-8"))
    fh.write(_U64.pack(len(data)))
    fh.write(data)


def _copy_range(src: Path, offset: int, size: int, dst: BinaryIO) -> None:
    with open(src, "rb") as fh:
        fh.seek(offset)
        left = size
        while left:
            chunk = fh.read(min(CHUNK, left))
            if not chunk:
                raise IntegrityError(f"{src.name} changed while merging")
            dst.write(chunk)
            left -= len(chunk)


# --- the precompiled forwards -------------------------------------------------------------------
# What pickle.dumps(list_of_bytes) uses, at any protocol from 2: a list, bytes, memo bookkeeping.
# Everything that could name a global or call one (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST,
# OBJ, NEWOBJ, EXT*, PERSID...) is absent, so reading the list can run nothing.
_PICKLE_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "EMPTY_LIST",
        "MARK",
        "APPEND",
        "APPENDS",
        "SHORT_BINBYTES",
        "BINBYTES",
        "BINBYTES8",
        "MEMOIZE",
        "BINPUT",
        "LONG_BINPUT",
        "BINGET",
        "LONG_BINGET",
        "STOP",
    }
)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:  # pragma: no cover - opcodes refused
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def read_precompiled(path: Path) -> list[bytes]:
    """The entries of a precompiled-forwards blob: a pickled list of bytes, nothing else."""
    data = path.read_bytes()
    try:
        for op, _arg, _pos in pickletools.genops(data):
            if op.name not in _PICKLE_OPCODES:
                raise BlobFormatError(f"holds a pickle {op.name} (kiln reads a list of bytes)")
        value = _NoGlobals(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError) as exc:
        if isinstance(exc, BlobFormatError):
            raise
        raise BlobFormatError(f"is not a pickled list: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, bytes) for v in value):
        raise BlobFormatError("is not a pickled list of bytes")
    return value


def merge_precompiled(blobs: list[tuple[str, Path]], out: Path) -> int:
    """Write the precompiled forwards of every blob (``(artifact, blob)`` pairs, in the given
    order, identical entries once) as one blob; returns the number of graphs. A server tries
    each graph's guards in turn, and static buckets' guards exclude each other, so the order
    decides nothing but the bytes."""
    entries: list[bytes] = []
    seen: set[bytes] = set()
    for label, blob in blobs:
        try:
            found = read_precompiled(blob)
        except BlobFormatError as exc:
            raise BlobFormatError(f"{label}: {blob.name} {exc}") from None
        for entry in found:
            digest = hashlib.sha256(entry).digest()
            if digest not in seen:
                seen.add(digest)
                entries.append(entry)
    out.write_bytes(pickle.dumps(entries, protocol=4))
    return len(entries)
