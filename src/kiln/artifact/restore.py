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

import errno
import json
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifact.archive import (
    MAX_MANIFEST_BYTES,
    parse_manifest,
)
from kiln.artifact.attestation import AttestationCheck, verify_attestation
from kiln.artifact.extract import HashingReader, check_stage, extract, require_space
from kiln.artifact.manifest import MANIFEST_NAME, Manifest
from kiln.artifact.storage import DEFAULT_TIMEOUT, check_timeout, fetch, is_remote, parse_digest
from kiln.artifact.swap import UNWRITABLE, Lock, clean_stale, dest_path, make_staging, recover, swap
from kiln.errors import IntegrityError, KilnError, UsageError
from kiln.events import EventSink, Fetched, Fetching, ignore
from kiln.files import CHUNK, atomic_write
from kiln.serving import ENV_NAME, INDUCTOR_DIR, RANKS_DIR, STATE_NAME, env_file_text


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
            "cache_dir": str(self.dest / INDUCTOR_DIR)
            if self.manifest.distributed is None
            else str(self.dest / RANKS_DIR),  # ranks/R/inductor: each rank's
            "ranks": self.manifest.world_size,
        }


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
    dest = dest_path(dest)
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
        lock = Lock(dest)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
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
    recover(dest, emit)
    _check_dest(dest)
    clean_stale(dest)
    installed = _installed(dest)
    if installed is not None and installed[0] == pin:
        return _noop(dest, installed, env_file, t0)
    staging = make_staging(dest)
    try:
        if is_remote(source):
            require_space(dest.parent, 0, "download")
        emit(Fetching(source=source))
        with fetch(
            source,
            staging,
            expected_sha256=pin,
            on_bytes=lambda n, total: emit(Fetched(bytes=n, total=total)),
            timeout=timeout,
        ) as fetched:
            if trust is not None:  # before a byte is unpacked; extract() re-hashes what it reads
                trust.check_subject(fetched.sha256)
            if installed is not None and installed[0] == fetched.sha256:
                return _noop(dest, installed, env_file, t0)
            tree = staging / "tree"
            tree.mkdir()
            # Unpack from the very file descriptor that was hashed, hashing again as it is
            # read: the digest recorded (and compared with the pin) is that of the bytes
            # unpacked, even if the file is rewritten in place meanwhile.
            reader = HashingReader(fetched.file)
            manifest = extract(reader, tree, emit)
            unpacked = reader.finish()
        if unpacked != fetched.sha256:
            raise IntegrityError(
                f"{source}: changed while it was being restored (sha256 {fetched.sha256} when "
                f"checked, {unpacked} when unpacked); nothing was changed"
            )
        if fetched.downloaded:
            fetched.path.unlink()
        (tree / MANIFEST_NAME).write_bytes(manifest.to_bytes())
        (tree / ENV_NAME).write_text(
            env_file_text(dest, manifest.name, manifest.env, manifest.world_size)
        )
        state = {"artifact_sha256": unpacked, "source": source, "restored": time.time()}
        (tree / STATE_NAME).write_text(json.dumps(state))
        check_stage(tree, dest, manifest)
        swap(tree, dest)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise KilnError(
                f"{dest.parent}: disk full while restoring; nothing was changed"
            ) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _result(dest, unpacked, manifest, env_file, t0, noop=False)


def _noop(
    dest: Path, installed: tuple[str, Manifest], env_file: str | Path | None, t0: float
) -> RestoreResult:
    digest, manifest = installed
    return _result(dest, digest, manifest, env_file, t0, noop=True)


def _result(
    dest: Path,
    digest: str,
    manifest: Manifest,
    env_file: str | Path | None,
    t0: float,
    *,
    noop: bool,
) -> RestoreResult:
    return RestoreResult(
        dest=dest,
        sha256=digest,
        files=len(manifest.entries()),
        bytes=manifest.total_bytes,
        seconds=time.time() - t0,
        noop=noop,
        env_file=_write_env_copy(dest, env_file),
        manifest=manifest,
    )


def _write_env_copy(dest: Path, env_file: str | Path | None) -> Path:
    if env_file is None:
        return dest / ENV_NAME
    target = Path(env_file).absolute()
    with open(dest / ENV_NAME, "rb") as src, atomic_write(target) as out:
        shutil.copyfileobj(src, out, CHUNK)
    return target
