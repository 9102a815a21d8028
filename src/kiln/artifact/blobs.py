"""Merging the two blobs a bake may write beside its cache folder, without torch.

``kiln merge`` combines shards' artifacts; their folders merge file by file, but each shard also
carries one blob that bundles what *it* compiled:

- the **Mega-Cache blob** (``torch.compiler.save_cache_artifacts()``), torch's
  ``AppendingByteSerializer`` format (``torch/utils/_appending_byte_serializer.py``, unchanged
  from 2.7 to 2.13): a big-endian CRC-32 of the rest, a uint64 format version (1), then records
  of an artifact type (a length-prefixed base64 string), a uint64 count, and that many
  (key: base64 string, content: length-prefixed bytes). No pickle at this level, so it can be
  read, checked and rewritten here byte for byte. Torch loads it with ``dict(records)``: a type
  must appear once, holding every artifact of that type. At most
  :data:`MAX_MEGACACHE_ARTIFACTS` artifacts.
- the **precompiled forwards** (``AOTCompiledModel.serialize()``, ``compile.precompile``): a
  pickled ``list`` of ``bytes``, one opaque entry per baked graph. The outer list is read by
  kiln's own interpreter of an opcode allow-list (no globals, nothing callable: never an
  unpickler that could run code, or allocate what a memo index claims), one pass over the
  bytes, at most :data:`MAX_GRAPHS` graphs; the entries are only copied, never looked into.

A blob past those bounds is hostile: :class:`IntegrityError` (exit 3) naming the bound. Both
merges are deterministic (sorted, deduplicated), so shards given in any order give the
same bytes. The Mega-Cache blob only serves bench's ``megacache`` mode and tools that hot-load
it: when shards' blobs cannot be merged (torch changed the format, two shards disagree on one
key) the merged artifact goes without one and says why. The precompiled forwards are what a
``precompile: true`` server loads, so failing to merge them is an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
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
# The most artifacts one Mega-Cache blob may hold: a few per graph (FX, AOT, kernels, autotune
# and PGO entries) for a spec's 4,096 buckets. Past it a blob is hostile (each record costs a
# few hundred bytes of bookkeeping, and can take 16 bytes of blob), not a format kiln lacks.
MAX_MEGACACHE_ARTIFACTS = 1 << 17


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
            if len(out) + count > MAX_MEGACACHE_ARTIFACTS:
                raise IntegrityError(
                    f"{path.name} holds more than {MAX_MEGACACHE_ARTIFACTS} artifacts "
                    f"({len(out) + count} claimed): refused"
                )
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
        except IntegrityError as exc:  # hostile, not a format kiln lacks: the merge stops
            raise IntegrityError(f"{label}: {exc.message}") from None
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
# The most graphs one blob may hold: a spec has at most 4,096 buckets (kiln.spec), each one
# graph. Every other bound below follows from it, so the work a blob can ask for is bounded by
# its size (its bytes are read once, in chunks) and by this count, never by what it claims.
MAX_GRAPHS = 1 << 16
# What pickle.dumps(list_of_bytes) writes per graph (bytes, MEMOIZE or BINPUT, APPEND, a FRAME
# and an APPENDS every 1,000): a pickle with more opcodes than this is not one.
MAX_PICKLE_OPS = 4 * MAX_GRAPHS + 16
_U8, _U32, _U64LE = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
# Opcodes of pickle.dumps(list_of_bytes), protocols 2 to 5: (name, argument struct or None).
# Everything that could name a global or call one (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST,
# OBJ, NEWOBJ, EXT*, PERSID...) is absent, and only these are interpreted (by kiln, not by
# pickle's unpickler, whose memo is an array as long as the largest index a pickle names).
_PICKLE_OPS: dict[int, tuple[str, struct.Struct | None]] = {
    0x80: ("PROTO", _U8),
    0x95: ("FRAME", _U64LE),
    ord("]"): ("EMPTY_LIST", None),
    ord("("): ("MARK", None),
    ord("a"): ("APPEND", None),
    ord("e"): ("APPENDS", None),
    ord("C"): ("SHORT_BINBYTES", _U8),
    ord("B"): ("BINBYTES", _U32),
    0x8E: ("BINBYTES8", _U64LE),
    0x94: ("MEMOIZE", None),
    ord("q"): ("BINPUT", _U8),
    ord("r"): ("LONG_BINPUT", _U32),
    ord("h"): ("BINGET", _U8),
    ord("j"): ("LONG_BINGET", _U32),
    ord("."): ("STOP", None),
}


@dataclass(frozen=True)
class Graph:
    """One entry of a precompiled-forwards blob, located (never loaded): where its bytes are."""

    sha256: str
    offset: int
    size: int
    source: Path


class _List:
    """The one list a precompiled blob pickles (a stack item; its graphs are ``graphs``)."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self.seen: set[int] = set()  # ids of the Graphs appended: a reference appended again


_MARK = object()


def read_precompiled(path: Path) -> list[Graph]:
    """The graphs of a precompiled-forwards blob (a pickled list of bytes, nothing else), each
    located and hashed as it is read, never held in memory.

    The pickle is interpreted here, opcode by opcode, from an allow-list: nothing callable can
    run, and a hostile blob costs at most one pass over its bytes. Exit 3
    (:class:`IntegrityError`) naming the bound for one that asks for more: more than
    :data:`MAX_GRAPHS` graphs or :data:`MAX_PICKLE_OPS` opcodes, a memo index past the opcodes
    before it. A graph appended twice (one memoized bytes object referenced again) is one.
    """
    size = path.stat().st_size
    stack: list[object] = []
    memo: dict[int, object] = {}
    result: _List | None = None
    with open(path, "rb") as fh:
        for count in range(MAX_PICKLE_OPS + 1):
            if count == MAX_PICKLE_OPS:
                raise IntegrityError(
                    f"{path.name} holds more than {MAX_PICKLE_OPS} pickle opcodes "
                    f"(kiln merges at most {MAX_GRAPHS} graphs)"
                )
            at = fh.tell()
            code = fh.read(1)
            if not code:
                raise BlobFormatError("ends before the pickle's STOP")
            op = _PICKLE_OPS.get(code[0])
            if op is None:
                known = pickletools.code2op.get(code.decode("latin-1"))
                raise BlobFormatError(
                    f"holds a pickle {known.name if known else code!r} at byte {at} "
                    "(kiln reads a list of bytes)"
                )
            name, arg_format = op
            arg = 0
            if arg_format is not None:
                (arg,) = arg_format.unpack(_read_exact(fh, arg_format.size, name))
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                result = _stopped(stack)
                break
            _step(name, arg, fh, size, path, stack, memo, count)
        if fh.read(1):
            raise BlobFormatError("holds bytes after the pickle's STOP")
    assert result is not None
    if not result.graphs:
        raise BlobFormatError("holds no graphs (a shard with buckets has at least one)")
    return result.graphs


def _stopped(stack: list[object]) -> _List:
    if any(item is _MARK for item in stack):
        raise BlobFormatError("leaves a pickle MARK open at its STOP")
    if len(stack) != 1 or not isinstance(stack[0], _List):
        raise BlobFormatError("is not a pickled list of bytes")
    return stack[0]


def _step(
    name: str,
    arg: int,
    fh: BinaryIO,
    size: int,
    path: Path,
    stack: list[object],
    memo: dict[int, object],
    count: int,
) -> None:
    """One opcode of :func:`read_precompiled` applied to ``stack`` and ``memo``."""
    if name == "EMPTY_LIST":
        if any(isinstance(item, _List) for item in (*stack, *memo.values())):
            raise BlobFormatError("holds a second list (kiln reads one list of bytes)")
        stack.append(_List())
    elif name == "MARK":
        stack.append(_MARK)
    elif name.endswith("BINBYTES") or name == "BINBYTES8":
        if arg > size - fh.tell():
            raise BlobFormatError(f"claims a {arg}-byte graph, {size - fh.tell()} bytes are left")
        offset, h, left = fh.tell(), hashlib.sha256(), arg
        while left:
            chunk = _read_exact(fh, min(CHUNK, left), "a graph")
            h.update(chunk)
            left -= len(chunk)
        stack.append(Graph(h.hexdigest(), offset, arg, path))
    elif name in ("MEMOIZE", "BINPUT", "LONG_BINPUT"):
        index = len(memo) if name == "MEMOIZE" else arg
        if index > count:  # pickle.dumps numbers them 0, 1, 2...: one per opcode at most
            raise IntegrityError(
                f"{path.name}: pickle memo index {index} at opcode {count} (a list of bytes "
                "memoizes each object once, in order)"
            )
        if not stack or stack[-1] is _MARK:
            raise BlobFormatError(f"{name} with nothing to memoize")
        memo[index] = stack[-1]
    elif name in ("BINGET", "LONG_BINGET"):
        if arg not in memo:
            raise BlobFormatError(f"{name} {arg} of nothing memoized")
        stack.append(memo[arg])
    elif name == "APPEND":
        _append(stack, [stack.pop()] if stack else [], path)
    else:  # APPENDS: what follows the topmost MARK
        if _MARK not in stack:
            raise BlobFormatError("APPENDS without a MARK")
        at = len(stack) - 1 - stack[::-1].index(_MARK)
        items = stack[at + 1 :]
        del stack[at:]
        _append(stack, items, path)


def _append(stack: list[object], items: list[object], path: Path) -> None:
    if not items or not stack or not isinstance(stack[-1], _List):
        raise BlobFormatError("appends to something that is not the list")
    target = stack[-1]
    for item in items:
        if not isinstance(item, Graph):
            raise BlobFormatError("is not a pickled list of bytes")
        if id(item) in target.seen:
            continue  # one memoized object referenced again: the same graph
        if len(target.graphs) >= MAX_GRAPHS:
            raise IntegrityError(
                f"{path.name} holds more than {MAX_GRAPHS} graphs (a spec bakes at most 4096 "
                "buckets)"
            )
        target.seen.add(id(item))
        target.graphs.append(item)


def merge_precompiled(blobs: list[tuple[str, Path]], out: Path) -> int:
    """Write the precompiled forwards of every blob (``(artifact, blob)`` pairs, in the given
    order, identical entries once) as one blob; returns the number of graphs. A server tries
    each graph's guards in turn, and static buckets' guards exclude each other, so the order
    decides nothing but the bytes. The graphs are copied from the inputs by range, in chunks:
    memory does not grow with their size."""
    graphs: list[Graph] = []
    seen: set[str] = set()
    for label, blob in blobs:
        try:
            found = read_precompiled(blob)
        except BlobFormatError as exc:
            raise BlobFormatError(f"{label}: {blob.name} {exc}") from None
        except IntegrityError as exc:
            raise IntegrityError(f"{label}: {exc.message}") from None
        for graph in found:
            if graph.sha256 not in seen:
                seen.add(graph.sha256)
                graphs.append(graph)
    if len(graphs) > MAX_GRAPHS:
        raise IntegrityError(f"the shards hold more than {MAX_GRAPHS} graphs together")
    with open(out, "wb") as fh:
        # What pickle.loads reads as a list of bytes (protocol 4, unframed, nothing memoized).
        fh.write(b"\x80\x04]")
        for graph in graphs:
            fh.write(b"\x8e" + _U64LE.pack(graph.size))
            _copy_range(graph.source, graph.offset, graph.size, fh)
            fh.write(b"a")
        fh.write(b".")
    return len(graphs)
