"""Restore: install an artifact into a folder safely, atomically and idempotently. Torch-free.

A compile cache is code: torch unpickles it and dlopens the ``.so`` files in it. So restore
treats every archive as hostile, whoever made it: the manifest (first member) is the allow-list,
and only regular files and folders it names, with the sizes and sha256 it gives, are written —
by us, never by ``tarfile.extract`` (whose filters have had escapes). Everything lands in a
staging folder beside DIR and is swapped in with one atomic rename only when complete (checked
against the manifest right before), under a lock, so a killed or concurrent restore never leaves
DIR half-written. The digest pinned and recorded is that of the bytes actually unpacked.
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
import re
import secrets
import shutil
import signal
import stat
import tarfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import zstandard

from kiln.artifact.archive import (
    MAX_MANIFEST_BYTES,
    open_tar_stream,
    parse_manifest,
    read_manifest_member,
)
from kiln.artifact.attestation import AttestationCheck, verify_attestation
from kiln.artifact.manifest import MANIFEST_NAME, FileEntry, Manifest, path_problem
from kiln.artifact.storage import DEFAULT_TIMEOUT, check_timeout, fetch, is_remote, parse_digest
from kiln.errors import IntegrityError, KilnError, UsageError
from kiln.events import EventSink, Extracting, Fetched, Fetching, Recovered, ignore
from kiln.files import CHUNK, atomic_write
from kiln.serving import ENV_NAME, INDUCTOR_DIR, STATE_NAME, env_file_text

_QUEUE = 16  # chunks in flight between the decompressing and the writing thread
_HEADROOM = 1 << 20


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
    provenance: dict[str, Any] | None = None  # the verified attestation (restore --verify-key)

    def summary(self) -> dict[str, Any]:
        return {
            "provenance": self.provenance,
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


# --- names beside DEST -------------------------------------------------------------------------
# Everything restore keeps next to DEST is named `.{DEST name}{suffix}`, and leftovers are found by
# comparing whole names (never a glob: a DEST called `c*` or `cache[1]` would match its
# neighbours' folders and delete them).
_LOCK_SUFFIX = ".kiln.lock"
_STAGING_INFIX = ".kiln-staging-"
_STAGING_TOKEN = re.compile(r"[0-9a-f]{12}|[a-z0-9_]{8}")  # ours | tempfile.mkdtemp's (old kilns)
_OLD_SUFFIX = ".kiln-old"  # the previous tree during a two-rename swap (no RENAME_EXCHANGE)
_LEGACY_OLD = re.compile(r"-[0-9]+")  # `.kiln-old-PID`, what older kilns called it
_RESERVED = re.compile(r"\..+\.kiln(?:-staging-.*|-old(?:-[0-9]+)?|\.lock)")
MAX_DEST_NAME = 255 - len(".") - len(_STAGING_INFIX) - 12
# errno values that mean "this folder cannot be written": the parent is read-only.
_UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})

# Test hook, read only by _swap: KILN_TEST_SWAP=fallback takes the two-rename path that
# filesystems without RENAME_EXCHANGE get; "fallback,kill" also SIGKILLs this process between
# the two renames, the crash that path must survive (tests/test_restore_trust.py). Never set it
# outside tests.
TEST_SWAP_ENV = "KILN_TEST_SWAP"


def _sibling(dest: Path, suffix: str) -> Path:
    return dest.parent / f".{dest.name}{suffix}"


def _dest_path(dest: str | Path) -> Path:
    """DEST as an absolute path, refused (exit 2) when its name cannot work as a sibling prefix."""
    path = Path(dest).absolute()
    name = path.name
    if name in ("", ".."):
        raise UsageError(f"{dest}: DEST must name a folder (not / or ..)")
    if len(os.fsencode(name)) > MAX_DEST_NAME:
        raise UsageError(f"{dest}: folder name longer than {MAX_DEST_NAME} bytes")
    if _RESERVED.fullmatch(name):
        raise UsageError(f"{dest}: names one of kiln's own working folders; pick another name")
    return path


def installed_digest(dest: Path) -> str | None:
    installed = _installed(Path(dest))
    return installed[0] if installed else None


def _installed(dest: Path) -> tuple[str, Manifest] | None:
    """The digest and manifest installed in ``dest``, read without a lock and without writing.

    Both files are read through one descriptor of the folder: a concurrent swap exchanges whole
    trees, so they always come from the same restore. None when there is no complete install.
    """
    try:
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        state = json.loads(_read_at(dfd, STATE_NAME, 1 << 16))
        digest = state["artifact_sha256"]
        manifest = parse_manifest(_read_at(dfd, MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, KeyError, TypeError, KilnError):
        return None
    finally:
        os.close(dfd)
    return (digest, manifest) if isinstance(digest, str) else None


def _read_at(dfd: int, name: str, limit: int) -> bytes:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(name, flags, dir_fd=dfd)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{name} is too large")
    return data


class _Lock:
    """One restore per DIR at a time, across processes: ``flock`` on ``.DIR.kiln.lock``.

    The file is removed again on release, so no restore leaves it behind. Removing a lock file
    is racy unless done this way: unlink only while holding the lock, and after acquiring it,
    check that the path still names the inode that was locked (a waiter may have opened the
    file just before its holder unlinked it); if not, start over on the new file. ``flock``
    dies with its holder, so a killed restore leaves a file that the next one takes and removes.
    """

    def __init__(self, dest: Path) -> None:
        self.path = _sibling(dest, _LOCK_SUFFIX)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        while True:
            try:
                fd = os.open(self.path, flags, 0o600)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                    raise UsageError(
                        f"{self.path}: not a lock file kiln made (a link, folder or special "
                        "file); remove it"
                    ) from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise UsageError(f"{self.path}: not a lock file kiln made; remove it")
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    now = os.lstat(self.path)
                except FileNotFoundError:
                    now = None
            except BaseException:
                os.close(fd)
                raise
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self.fd = fd
                return
            os.close(fd)  # unlinked or replaced while we waited: lock the current one

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()  # still holding it: waiters see the inode change and retry
        os.close(self.fd)


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


def _siblings(dest: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """This DEST's leftovers beside it, by exact name: ("staging" | "old", entry)."""
    staging = f".{dest.name}{_STAGING_INFIX}"
    old = f".{dest.name}{_OLD_SUFFIX}"
    with os.scandir(dest.parent) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(staging) and _STAGING_TOKEN.fullmatch(name[len(staging) :]):
                yield "staging", entry
            elif name == old or (name.startswith(old) and _LEGACY_OLD.fullmatch(name[len(old) :])):
                yield "old", entry


def _recover(dest: Path, emit: EventSink) -> None:
    """Finish what a restore killed inside a two-rename swap left (we hold the lock).

    DEST missing and an old tree beside it: the crash came between the renames, so the old tree
    goes back first, before anything could delete it. DEST present: the swap had finished and
    the old tree is garbage.
    """
    olds = sorted(
        (entry for kind, entry in _siblings(dest) if kind == "old"),
        key=lambda e: e.name != f".{dest.name}{_OLD_SUFFIX}",  # the current name first
    )
    for entry in olds:
        if not os.path.lexists(dest) and entry.is_dir(follow_symlinks=False):
            os.rename(entry.path, dest)
            emit(Recovered(dest=str(dest), source=entry.name))
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _clean_stale(dest: Path) -> None:
    """Remove staging folders of restores into this DEST that were killed (we hold its lock,
    so none of them is running)."""
    for kind, entry in list(_siblings(dest)):
        if kind == "staging" and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _make_staging(dest: Path) -> Path:
    while True:
        path = _sibling(dest, f"{_STAGING_INFIX}{secrets.token_hex(6)}")
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue


def restore(
    source: str | Path,
    dest: str | Path,
    *,
    sha256: str | None = None,
    env_file: str | Path | None = None,
    on_event: EventSink | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    verify_keys: str | Path | Sequence[str | Path] | None = None,
    attestation: str | None = None,
) -> RestoreResult:
    """Install the artifact at ``source`` (path or URL) into ``dest``.

    ``sha256`` pins the artifact (64 hex digits, ``sha256:`` prefix optional; anything else is
    a :class:`UsageError`). ``timeout`` bounds a download, in seconds. ``verify_keys`` (public
    key references, see :mod:`kiln.artifact.keys`) require a signed attestation
    (``attestation``, default ``SOURCE.intoto.jsonl``) whose subject is the bytes unpacked
    (:mod:`kiln.artifact.attestation`). Raises :class:`IntegrityError` (exit 3) for a wrong
    digest, a bad or missing attestation or an unsafe/corrupt archive, with ``dest`` untouched.
    """
    t0 = time.time()
    emit = on_event or ignore
    pin = parse_digest(sha256)
    check_timeout(timeout)
    source = str(source)
    dest = _dest_path(dest)
    # Signed provenance first: the signature before anything is fetched or locked, the subject
    # against the digest of the bytes about to be unpacked (here the pin, later what was hashed).
    trust = verify_attestation(source, verify_keys, attestation, timeout=timeout)
    if trust is not None and pin is not None:
        trust.check_subject(pin)
    if pin is not None:
        # The installed digest is checked before the lock: a no-op needs no write anywhere, so
        # it works in a read-only parent folder too.
        installed = _installed(dest)
        if installed is not None and installed[0] == pin:
            _check_dest(dest)
            return _attested(_noop(dest, installed, env_file, t0), trust)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = _Lock(dest)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        return _attested(_restore_unwritable(source, dest, pin, env_file, t0, exc, trust), trust)
    try:
        return _attested(
            _restore_locked(source, dest, pin, env_file, emit, timeout, t0, trust), trust
        )
    finally:
        lock.release()


def _attested(result: RestoreResult, trust: AttestationCheck | None) -> RestoreResult:
    result.provenance = trust.summary if trust is not None else None
    return result


def _restore_unwritable(
    source: str,
    dest: Path,
    pin: str | None,
    env_file: str | Path | None,
    t0: float,
    exc: OSError,
    trust: AttestationCheck | None = None,
) -> RestoreResult:
    """DEST's parent cannot be written (no lock, no staging): only a no-op can succeed.

    A local artifact is hashed to find out; a remote one would have to be downloaded somewhere,
    so without a matching ``--sha256`` that is a usage error.
    """
    if pin is None and not is_remote(source):
        with fetch(source, dest.parent) as fetched:
            if trust is not None:
                trust.check_subject(fetched.sha256)
            installed = _installed(dest)
            if installed is not None and installed[0] == fetched.sha256:
                _check_dest(dest)
                return _noop(dest, installed, env_file, t0)
    raise UsageError(
        f"{dest.parent}: not writable ({exc.strerror}); restore needs a lock file and a "
        f"staging folder beside {dest.name} (only restoring the installed digest works here)"
    )


def _restore_locked(
    source: str,
    dest: Path,
    pin: str | None,
    env_file: str | Path | None,
    emit: EventSink,
    timeout: float,
    t0: float,
    trust: AttestationCheck | None = None,
) -> RestoreResult:
    _recover(dest, emit)
    _check_dest(dest)
    _clean_stale(dest)
    installed = _installed(dest)
    if installed is not None and installed[0] == pin:
        return _noop(dest, installed, env_file, t0)
    staging = _make_staging(dest)
    try:
        if is_remote(source):
            _require_space(dest.parent, 0, "download")
        emit(Fetching(source=source))
        with fetch(
            source,
            staging,
            expected_sha256=pin,
            on_bytes=lambda n, total: emit(Fetched(bytes=n, total=total)),
            timeout=timeout,
        ) as fetched:
            if trust is not None:  # before a byte is unpacked; _extract re-hashes what it reads
                trust.check_subject(fetched.sha256)
            if installed is not None and installed[0] == fetched.sha256:
                return _noop(dest, installed, env_file, t0)
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
                f"{source}: changed while it was being restored (sha256 {fetched.sha256} when "
                f"checked, {unpacked} when unpacked); nothing was changed"
            )
        if fetched.downloaded:
            fetched.path.unlink()
        (tree / MANIFEST_NAME).write_bytes(manifest.to_bytes())
        (tree / ENV_NAME).write_text(env_file_text(dest, manifest.name, manifest.env))
        state = {"artifact_sha256": unpacked, "source": source, "restored": time.time()}
        (tree / STATE_NAME).write_text(json.dumps(state))
        _verify_stage(tree, dest, manifest)
        _swap(tree, dest)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise KilnError(
                f"{dest.parent}: disk full while restoring; nothing was changed"
            ) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return RestoreResult(
        dest=dest,
        sha256=unpacked,
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        seconds=time.time() - t0,
        noop=False,
        env_file=_write_env_copy(dest, env_file),
        manifest=manifest,
    )


def _noop(
    dest: Path, installed: tuple[str, Manifest], env_file: str | Path | None, t0: float
) -> RestoreResult:
    digest, manifest = installed
    return RestoreResult(
        dest=dest,
        sha256=digest,
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
        while chunk := self._fh.read(CHUNK):
            self._h.update(chunk)
        return self._h.hexdigest()


def _verify_stage(tree: Path, dest: Path, manifest: Manifest) -> None:
    """The staged tree must be exactly what the manifest lists, right before it is swapped in.

    The extractor wrote and checked every file, but the staging folder sits beside DEST where
    other processes can reach it; a tree missing files (or with others added) is never swapped.
    """
    expected = {f.path: f.size for f in manifest.files}
    own = {MANIFEST_NAME, ENV_NAME, STATE_NAME}
    found: dict[str, int] = {}
    odd: list[str] = []
    for root, dirs, files in os.walk(tree):
        for name in (*dirs, *files):
            full = Path(root, name)
            st = full.lstat()
            rel = full.relative_to(tree).as_posix()
            if stat.S_ISREG(st.st_mode):
                found[rel] = st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                odd.append(rel)
    missing = sorted((set(expected) | own) - set(found))
    wrong = sorted(p for p, size in expected.items() if p in found and found[p] != size)
    extra = sorted(set(found) - set(expected) - own) + odd
    if missing or wrong or extra:
        problems = [
            f"{len(items)} file(s) {what}, e.g. {items[0]!r}"
            for items, what in (
                (missing, "missing"),
                (wrong, "of the wrong size"),
                (extra, "unlisted"),
            )
            if items
        ]
        raise IntegrityError(
            f"{dest}: the staged tree does not match the manifest ({'; '.join(problems)}): "
            "another process changed it; nothing was changed"
        )


def _write_env_copy(dest: Path, env_file: str | Path | None) -> Path:
    if env_file is None:
        return dest / ENV_NAME
    target = Path(env_file).absolute()
    with open(dest / ENV_NAME, "rb") as src, atomic_write(target) as out:
        shutil.copyfileobj(src, out, CHUNK)
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
    problem = path_problem(name.rstrip("/") or name)  # the manifest's rule, bounds included
    if problem:
        raise IntegrityError(problem)
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


def _extract(fh: Any, tree: Path, emit: EventSink) -> Manifest:
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
            emit(Extracting(bytes=0, total=total))
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
                while chunk := src.read(CHUNK):
                    writer.write(chunk)
                writer.end()
                done += entry.size
                emit(Extracting(bytes=done, total=total))
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
    if not os.path.lexists(dest):
        os.rename(tree, dest)
        return
    hooks = set(os.environ.get(TEST_SWAP_ENV, "").split(","))
    if "fallback" not in hooks and _renameat2_exchange(tree, dest):
        shutil.rmtree(tree, ignore_errors=True)
        return
    # No atomic exchange on this filesystem: two renames. The old tree goes to a well-known
    # name, so a crash between them leaves it recoverable: the next restore (under the lock)
    # puts it back before anything else (_recover).
    old = _sibling(dest, _OLD_SUFFIX)
    if os.path.lexists(old):
        shutil.rmtree(old)  # a finished swap's garbage: _recover saw DEST present
    os.rename(dest, old)
    if "kill" in hooks:
        os.kill(os.getpid(), signal.SIGKILL)
    os.rename(tree, dest)
    shutil.rmtree(old, ignore_errors=True)
