"""Restore: install an artifact into a folder safely, atomically and idempotently. Torch-free.

A compile cache is code: torch unpickles it and dlopens the ``.so`` files in it. So restore
treats every archive as hostile, whoever made it: the manifest (first member) is the allow-list,
and only regular files and folders it names, with the sizes and sha256 it gives, are written —
by us, never by ``tarfile.extract`` (whose filters have had escapes). Everything lands in a
staging folder beside DIR and is swapped in with one atomic rename only when complete, under a
lock, so a killed or concurrent restore never leaves DIR half-written.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import os
import queue
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import zstandard

from kiln.artifact import open_tar_stream, parse_manifest, read_manifest_member
from kiln.errors import IntegrityError, KilnError, UsageError
from kiln.manifest import MANIFEST_NAME, FileEntry, Manifest
from kiln.serving import ENV_NAME, INDUCTOR_DIR, STATE_NAME, env_file_text
from kiln.storage import DEFAULT_TIMEOUT, check_timeout, fetch, is_remote, parse_digest

_CHUNK = 1 << 20
_QUEUE = 16  # chunks in flight between the decompressing and the writing thread
_HEADROOM = 1 << 20

Sink = Callable[[dict[str, Any]], None]


@dataclass
class RestoreResult:
    dest: Path
    sha256: str
    files: int
    bytes: int
    seconds: float
    noop: bool
    env_file: Path
    manifest: Manifest

    def summary(self) -> dict[str, Any]:
        return {
            "dest": str(self.dest),
            "sha256": self.sha256,
            "name": self.manifest.name,
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "noop": self.noop,
            "env_file": str(self.env_file),
            "cache_dir": str(self.dest / INDUCTOR_DIR),
        }


def installed_digest(dest: Path) -> str | None:
    try:
        return json.loads((dest / STATE_NAME).read_text())["artifact_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """One restore per DIR at a time, across processes (flock dies with its holder)."""
    lock = dest.parent / f".{dest.name}.kiln.lock"
    with open(lock, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _check_dest(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise UsageError(f"{dest}: exists and is not a folder")
    if dest.is_dir():
        if os.path.ismount(dest):
            raise UsageError(
                f"{dest}: is a mount point and cannot be swapped atomically; "
                f"restore into a subfolder (e.g. {dest / 'kiln'})"
            )
        if any(dest.iterdir()) and not (dest / STATE_NAME).exists():
            raise UsageError(f"{dest}: not empty and not a kiln folder; refusing to replace it")


def _clean_stale(dest: Path) -> None:
    """Remove leftovers of restores that were killed (we hold the lock, so none is running)."""
    for p in dest.parent.glob(f".{dest.name}.kiln-*"):
        if p.is_dir() and not p.name.endswith(".lock"):
            shutil.rmtree(p, ignore_errors=True)


def restore(
    source: str | Path,
    dest: str | Path,
    *,
    sha256: str | None = None,
    env_file: str | Path | None = None,
    on_event: Sink | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> RestoreResult:
    """Install the artifact at ``source`` (path or URL) into ``dest``.

    ``sha256`` pins the artifact (64 hex digits, ``sha256:`` prefix optional; anything else is
    a :class:`UsageError`). ``timeout`` bounds a download, in seconds. Raises
    :class:`IntegrityError` (exit 3) for a wrong digest or an unsafe/corrupt archive, with
    ``dest`` untouched.
    """
    t0 = time.time()
    emit = on_event or (lambda _e: None)
    pin = parse_digest(sha256)
    check_timeout(timeout)
    source = str(source)
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest):
        _check_dest(dest)
        _clean_stale(dest)
        if pin is not None and installed_digest(dest) == pin:
            return _noop(dest, env_file, t0)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.kiln-staging-", dir=dest.parent))
        try:
            if is_remote(source):
                _require_space(dest.parent, 0, "download")
            emit({"event": "fetch", "source": source})
            with fetch(
                source,
                staging,
                expected_sha256=pin,
                on_bytes=lambda n, total: emit({"event": "fetched", "bytes": n, "total": total}),
                timeout=timeout,
            ) as fetched:
                if installed_digest(dest) == fetched.sha256:
                    shutil.rmtree(staging, ignore_errors=True)
                    return _noop(dest, env_file, t0)
                tree = staging / "tree"
                tree.mkdir()
                # Unpack from the very file descriptor that was hashed, hashing again as it is
                # read: the digest recorded (and compared with the pin) is that of the bytes
                # unpacked, even if the file is rewritten in place meanwhile.
                reader = _HashingReader(fetched.file)
                manifest = _extract(reader, tree, emit)
                unpacked = reader.finish()
            if unpacked != fetched.sha256:
                raise IntegrityError(
                    f"{source}: changed while it was being restored (sha256 {fetched.sha256} "
                    f"when checked, {unpacked} when unpacked); nothing was changed"
                )
            if fetched.downloaded:
                fetched.path.unlink()
            (tree / MANIFEST_NAME).write_bytes(manifest.to_bytes())
            (tree / ENV_NAME).write_text(env_file_text(dest, manifest.name, manifest.env))
            state = {"artifact_sha256": unpacked, "source": source, "restored": time.time()}
            (tree / STATE_NAME).write_text(json.dumps(state))
            _swap(tree, dest)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if exc.errno == errno.ENOSPC:
                raise KilnError(
                    f"{dest.parent}: disk full while restoring; nothing was changed"
                ) from None
            raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)
    written_env = _write_env_copy(dest, env_file)
    return RestoreResult(
        dest=dest,
        sha256=unpacked,
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        seconds=time.time() - t0,
        noop=False,
        env_file=written_env,
        manifest=manifest,
    )


def _noop(dest: Path, env_file: str | Path | None, t0: float) -> RestoreResult:
    manifest = parse_manifest((dest / MANIFEST_NAME).read_bytes())
    return RestoreResult(
        dest=dest,
        sha256=installed_digest(dest) or "",
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        seconds=time.time() - t0,
        noop=True,
        env_file=_write_env_copy(dest, env_file),
        manifest=manifest,
    )


class _HashingReader:
    """Hashes every byte the decompressor reads from ``fh``, then the rest of the file.

    :meth:`finish` is thus the digest of exactly the bytes that were unpacked (plus any trailing
    bytes the archive reader never needed), however the file changed on disk meanwhile.
    """

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._h = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self._h.update(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self._fh.readinto(buf)
        self._h.update(memoryview(buf)[:n])
        return n

    def finish(self) -> str:
        while chunk := self._fh.read(_CHUNK):
            self._h.update(chunk)
        return self._h.hexdigest()


def _write_env_copy(dest: Path, env_file: str | Path | None) -> Path:
    if env_file is None:
        return dest / ENV_NAME
    target = Path(env_file).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(dest / ENV_NAME, tmp)
    tmp.replace(target)
    return target


def _require_space(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need + _HEADROOM:
        shown = next((p for p in where.parents if ".kiln-staging-" not in p.name), where)
        raise KilnError(
            f"{shown}: not enough free space for {what}: need {_mib(need + _HEADROOM)}, "
            f"have {_mib(free)}; nothing was changed"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def safe_member_name(name: str) -> str:
    """The member name if it is a plain relative path, else raise :class:`IntegrityError`."""
    if not name or "\x00" in name or "\\" in name:
        raise IntegrityError(f"unsafe member name {name!r}")
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("/"):
        raise IntegrityError(f"absolute path in archive: {name!r}")
    if any(part in ("..", ".", "") for part in name.rstrip("/").split("/")):
        raise IntegrityError(f"path traversal in archive: {name!r}")
    return name.rstrip("/")


def _member_kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return "symlink"
    if m.islnk():
        return "hardlink"
    if m.ischr() or m.isblk():
        return "device"
    if m.isfifo():
        return "fifo"
    return f"type {m.type!r}"


class _FileWriter:
    """Hashes and writes extracted files on a second thread.

    Decompression (zstd), hashing (hashlib) and writes all release the GIL, so the reader thread
    can inflate the next chunk while this one hashes and writes the last: the restore runs at the
    slower of the two instead of their sum. The queue is bounded (memory stays ~_QUEUE chunks),
    and the first error is raised in the reader on its next call.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=_QUEUE)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-restore-writer", daemon=True)
        self._thread.start()

    def begin(self, target: Path, entry: FileEntry) -> None:
        self._put(("begin", (target, entry)))

    def write(self, chunk: bytes) -> None:
        self._put(("data", chunk))

    def end(self) -> None:
        self._put(("end", None))

    def close(self) -> None:
        """Wait for every queued byte; raise what the writer hit."""
        self.close_quietly()
        self._check()

    def close_quietly(self) -> None:
        """Stop the thread (idempotent); on the error path the caller's exception wins."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _put(self, item: tuple[str, Any]) -> None:
        self._check()
        self._queue.put(item)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        out: BinaryIO | None = None
        h = hashlib.sha256()
        entry: FileEntry | None = None
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain, so a reader blocked on a full queue can go on and see it
            kind, payload = item
            try:
                if kind == "begin":
                    target, entry = payload
                    target.parent.mkdir(parents=True, exist_ok=True)
                    # Open across queue items, closed on "end" or on the way out.
                    out, h = open(target, "xb"), hashlib.sha256()  # noqa: SIM115
                elif kind == "data":
                    assert out is not None
                    h.update(payload)
                    out.write(payload)
                else:
                    assert out is not None and entry is not None
                    out.close()
                    out = None
                    if h.hexdigest() != entry.sha256:
                        raise IntegrityError(f"{entry.path!r}: sha256 differs from the manifest")
            except BaseException as exc:
                self._error = exc
                if out is not None:
                    out.close()
                    out = None
        if out is not None:
            out.close()


def _extract(fh: Any, tree: Path, emit: Sink) -> Manifest:
    writer = _FileWriter()
    try:
        with open_tar_stream(fh) as tar:
            manifest = read_manifest_member(tar)
            allowed = {f.path: f for f in manifest.files}
            dirs = {str(parent) for f in manifest.files for parent in PurePosixPath(f.path).parents}
            for f in allowed:
                safe_member_name(f)
            _require_space(tree, manifest.total_bytes, f"{len(allowed)} files")
            total = manifest.total_bytes
            emit({"event": "extract", "bytes": 0, "total": total})
            seen: set[str] = set()
            done = 0
            for index, member in enumerate(tar):
                if index == 0:
                    continue  # manifest.json, already read (a streaming TarFile yields it again)
                name = safe_member_name(member.name)
                if member.isdir():
                    if name not in dirs:
                        raise IntegrityError(f"folder {name!r} is not in the manifest")
                    continue
                if not member.isreg():
                    raise IntegrityError(f"{name!r} is a {_member_kind(member)}: refused")
                entry = allowed.get(name)
                if entry is None:
                    raise IntegrityError(f"{name!r} is not in the manifest")
                if name in seen:
                    raise IntegrityError(f"{name!r} appears twice in the archive")
                seen.add(name)
                if member.size != entry.size:
                    raise IntegrityError(
                        f"{name!r} is {member.size} bytes, the manifest says {entry.size}"
                    )
                src = tar.extractfile(member)
                assert src is not None
                writer.begin(tree / name, entry)
                while chunk := src.read(_CHUNK):
                    writer.write(chunk)
                writer.end()
                done += entry.size
                emit({"event": "extract", "bytes": done, "total": total})
            writer.close()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"artifact is corrupt or truncated: {exc}") from None
    finally:
        writer.close_quietly()
    missing = sorted(set(allowed) - seen)
    if missing:
        raise IntegrityError(f"artifact is missing {len(missing)} file(s), e.g. {missing[0]!r}")
    return manifest


# --- atomic swap ----------------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux >= 3.15). False when unsupported here."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap(tree: Path, dest: Path) -> None:
    """Put ``tree`` at ``dest`` in one step; the old contents end up at ``tree`` (then removed)."""
    if not dest.exists():
        os.rename(tree, dest)
        return
    if _renameat2_exchange(tree, dest):
        shutil.rmtree(tree, ignore_errors=True)
        return
    # No atomic exchange on this filesystem: two renames; a crash between them leaves the old
    # contents in a `.kiln-old` sibling that the next restore cleans up.
    old = dest.parent / f".{dest.name}.kiln-old-{os.getpid()}"
    os.rename(dest, old)
    os.rename(tree, dest)
    shutil.rmtree(old, ignore_errors=True)
