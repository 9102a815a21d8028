"""Restore: install an artifact into a folder safely, atomically and idempotently. Torch-free.

A compile cache is code: torch unpickles it and dlopens the ``.so`` files in it. So restore
treats every archive as hostile, whoever made it: the manifest (first member) is the allow-list,
and only regular files and folders it names, with the sizes and sha256 it gives, are written —
by us, never by ``tarfile.extract`` (whose filters have had escapes). Everything lands in a
staging folder beside DIR and is swapped in with one atomic rename only when complete (checked
against the manifest right before), under a lock, so a killed or concurrent restore never leaves
DIR half-written. The digest pinned and recorded is that of the bytes actually unpacked.

A bundle (:mod:`kiln.artifact.bundle`) goes through the same flow: the pin, the lock, the
staging folder and the swap are the bundle's, and what is unpacked is its chosen variant, so the
folder ends up exactly as restoring that variant alone would leave it (its digest in the state
file, which also names the bundle and variant so that a repeat restore is a no-op).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifact.archive import parse_manifest
from kiln.artifact.attestation import AttestationCheck, verify_attestation
from kiln.artifact.bundle import Candidate, Choice, Selector, check_variant, extract_chosen, key_of
from kiln.artifact.drift import Changes, changes, kiln_env, stamp
from kiln.artifact.extract import HashingReader, check_stage, extract, require_space
from kiln.artifact.install_state import BundleChoice, InstallState
from kiln.artifact.machine import Machine
from kiln.artifact.manifest import FileEntry, Manifest
from kiln.artifact.oci_layout import variant_select
from kiln.artifact.relocate import relocate_groups
from kiln.artifact.storage import DEFAULT_TIMEOUT, check_timeout, fetch, is_remote, parse_digest
from kiln.artifact.swap import (
    UNWRITABLE,
    Lock,
    clean_stale,
    dest_path,
    is_mount_point,
    make_staging,
    mount_point_error,
    recover,
    swap,
)
from kiln.errors import IntegrityError, KilnError, Param, UsageError, Worded
from kiln.events import DestChanged, EventSink, Fetched, Fetching, ignore
from kiln.files import CHUNK, atomic_write
from kiln.layout import (
    LOCKS_TARGET,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    STATE_NAME,
    CacheLayout,
    lock_links,
)


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
    choice: Choice | None = None  # the variant installed, when SOURCE is a bundle
    # Another artifact DEST held before, which this restore replaced: its name and digest.
    replaced: dict[str, str] | None = None

    def summary(self) -> dict[str, Any]:
        layout = CacheLayout(self.dest)
        return {
            "provenance": self.provenance,
            "variant": self.choice.summary() if self.choice is not None else None,
            "dest": str(self.dest),
            "sha256": self.sha256,
            "name": self.manifest.name,
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "noop": self.noop,
            "replaced": self.replaced,
            "env_file": str(self.env_file),
            "cache_dir": str(layout.inductor)
            if self.manifest.distributed is None
            else str(layout.ranks_dir),  # ranks/R/inductor: each rank's
            "ranks": self.manifest.world_size,
        }


@dataclass(frozen=True)
class Installed:
    """What DEST holds: the artifact's digest and manifest, and the bundle it came from."""

    dest: Path
    digest: str
    manifest: Manifest
    bundle_sha256: str | None = None
    variant: str | None = None
    stamp_ns: int | None = None  # the install's newest file change (kiln.artifact.drift)
    # Files restore rewrote for DEST (kiln.artifact.relocate), as they were installed.
    relocated: tuple[FileEntry, ...] = ()

    @functools.cached_property
    def changes(self) -> Changes:
        """How DEST differs from what was installed there (usually: not at all)."""
        return changes(self.dest, self.manifest, self.stamp_ns, self.relocated)

    def satisfies(self, digest: str, selector: Selector) -> tuple[bool, Choice | None]:
        """Whether restoring the artifact or bundle ``digest`` here changes nothing: the one
        place a no-op is decided. Also the variant choice to report then (None: not a bundle).
        A DEST changed since it was installed (:attr:`changes`) is never a no-op."""
        if self.digest == digest:
            # --variant with a plain artifact's digest: the full path says what is wrong.
            noop, choice = selector.variant is None, None
        else:
            choice = self.from_bundle(digest, selector)
            noop = choice is not None
        return noop and not self.changes, choice

    def from_bundle(self, bundle: str, selector: Selector) -> Choice | None:
        """The installed variant as this restore's choice, when it is ``bundle``'s and still
        what ``selector`` picks: a repeat restore of the bundle is then a no-op."""
        if self.bundle_sha256 != bundle or self.variant is None:
            return None
        try:
            candidate = Candidate(name=self.variant, **key_of(self.manifest).selection())
            if not selector.still_chosen(candidate.name, candidate):
                return None
        except KilnError:
            return None
        why = (
            Worded(Param("variant", candidate.name))
            if selector.variant is not None
            else Worded(
                "this machine (", selector.describe_here(), f") matches {candidate.describe()}"
            )
        )
        machine = selector.machine if selector.variant is None else None
        return Choice(
            candidate, Worded(why, " (installed already)"), machine, selector.torch_version, bundle
        )


# The state file lists each file restore rewrote (one entry per relocated Triton group, as the
# manifest lists it) besides a few fields: never more than the manifest's bound and a margin.
# A max-autotune cache (H100, tiny-gpt-cuda-tuned) had 594 groups: about 170 KiB of state.
MAX_STATE_BYTES = MAX_MANIFEST_BYTES + (1 << 16)


def read_installed(dest: Path) -> Installed | None:
    """What is installed in ``dest``, read without a lock and without writing.

    Both files are read through one descriptor of the folder: a concurrent swap exchanges whole
    trees, so they always come from the same restore. None when there is no complete install.
    """
    try:
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        state = InstallState.model_validate_json(_read_at(dfd, STATE_NAME, MAX_STATE_BYTES))
        manifest = parse_manifest(_read_at(dfd, MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError, KilnError):
        return None  # no state file restore wrote, or no manifest: no complete install
    finally:
        os.close(dfd)
    bundle = state.bundle
    return Installed(
        dest,
        state.artifact_sha256,
        manifest,
        bundle.sha256 if bundle is not None else None,
        bundle.variant if bundle is not None else None,
        state.stamp_ns,
        tuple(state.relocated),
    )


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
        if is_mount_point(dest):
            raise mount_point_error(dest)
        if any(dest.iterdir()) and not CacheLayout(dest).state_file.exists():
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
    variant: str | None = None,
    torch_version: str | None = None,
    machine: Machine | None = None,
) -> RestoreResult:
    """Install the artifact at ``source`` (path or URL) into ``dest``.

    ``sha256`` pins the artifact (64 hex digits, ``sha256:`` prefix optional; anything else is
    a :class:`UsageError`). ``timeout`` bounds a download, in seconds. ``verify_keys`` (public
    key references, see :mod:`kiln.artifact.keys`) require a signed attestation
    (``attestation``, default ``SOURCE.intoto.jsonl``) whose subject is the bytes unpacked
    (:mod:`kiln.artifact.attestation`). Raises :class:`IntegrityError` (exit 3) for a wrong
    digest, a bad or missing attestation or an unsafe/corrupt archive, with ``dest`` untouched.

    When ``source`` is a bundle (:mod:`kiln.artifact.bundle`; for ``oci://`` an image index),
    ``sha256`` pins the bundle and only the variant chosen by :class:`~kiln.artifact.bundle.
    Selector` is installed: ``variant`` by name, else the one matching ``machine`` (default:
    detected, :func:`kiln.artifact.machine.detect`) and ``torch_version`` (the serving torch).
    ``RestoreResult.choice`` says which and why.
    """
    t0 = time.time()
    emit = on_event or ignore
    pin = parse_digest(sha256)
    check_timeout(timeout)
    selector = Selector(variant=variant, torch_version=torch_version, machine=machine)
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
        installed = read_installed(dest)
        if installed is not None:
            noop, choice = installed.satisfies(pin, selector)
            if noop:
                _check_dest(dest)
                return _attested(_noop(dest, installed, env_file, t0, choice), trust)
    try:
        _make_parents(dest)
        lock = Lock(dest)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        result = _restore_unwritable(source, dest, pin, env_file, t0, exc, selector, trust)
        return _attested(result, trust)
    try:
        return _attested(
            _restore_locked(source, dest, pin, env_file, emit, timeout, t0, selector, trust),
            trust,
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
    selector: Selector,
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
            installed = read_installed(dest)
            if installed is not None:
                noop, choice = installed.satisfies(fetched.sha256, selector)
                if noop:
                    _check_dest(dest)
                    return _noop(dest, installed, env_file, t0, choice)
    installed = read_installed(dest)
    if installed is not None and installed.changes:
        raise UsageError(
            f"{dest}: changed since it was installed ({installed.changes.describe()}), and "
            f"{dest.parent} is not writable ({exc.strerror}): restore needs a lock file and a "
            f"staging folder beside {dest.name} to install it again"
        )
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
    selector: Selector,
    trust: AttestationCheck | None = None,
) -> RestoreResult:
    recover(dest, emit)
    _check_dest(dest)
    clean_stale(dest)
    before = read_installed(dest)
    installed = _unless_changed(before, emit)
    if pin is not None and installed is not None:
        noop, choice = installed.satisfies(pin, selector)
        if noop:
            return _noop(dest, installed, env_file, t0, choice)
    staging = make_staging(dest)
    try:
        got = _fetch_and_unpack(source, staging, pin, installed, emit, timeout, selector, trust)
        if got.manifest is None:  # what DEST holds already
            assert installed is not None
            return _noop(dest, installed, env_file, t0, got.choice)
        # What is installed is the artifact (a bundle's variant): its digest, as restoring it
        # alone would record; the bundle is named beside it, for the no-op of a repeat restore.
        bundle = (
            BundleChoice(sha256=got.bundle_sha256, variant=got.choice.variant.name)
            if got.choice is not None
            else None
        )
        state = InstallState(
            artifact_sha256=got.digest, source=str(source), restored=time.time(), bundle=bundle
        )
        _complete(got.tree, dest, got.manifest, state)
        swap(got.tree, dest)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise KilnError(
                f"{dest.parent}: disk full while restoring; nothing was changed"
            ) from None
        if exc.errno == errno.EBUSY and str(dest) in (exc.filename, exc.filename2):
            raise mount_point_error(dest) from None  # one is_mount_point cannot see
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = _result(dest, got.digest, got.manifest, env_file, t0, noop=False, choice=got.choice)
    if before is not None and before.digest != got.digest:  # said, not silently swapped
        result.replaced = {"name": before.manifest.name, "sha256": before.digest}
    return result


@dataclass
class _Unpacked:
    """What :func:`_fetch_and_unpack` left in ``tree``: the artifact's manifest (None: DEST
    holds it already, nothing unpacked), its digest, and for a bundle the variant chosen."""

    tree: Path
    manifest: Manifest | None
    digest: str
    choice: Choice | None
    bundle_sha256: str


def _fetch_and_unpack(
    source: str,
    staging: Path,
    pin: str | None,
    installed: Installed | None,
    emit: EventSink,
    timeout: float,
    selector: Selector,
    trust: AttestationCheck | None,
) -> _Unpacked:
    """Fetch ``source`` into ``staging``, check its digest and attestation, and unpack the
    artifact (a bundle's chosen variant) into ``staging/tree``."""
    if is_remote(source):
        require_space(staging.parent, 0, "download")
    emit(Fetching(source=source))
    tree = staging / "tree"
    with fetch(
        source,
        staging,
        expected_sha256=pin,
        on_bytes=lambda n, total: emit(Fetched(bytes=n, total=total)),
        timeout=timeout,
        select=variant_select(selector.choose),
    ) as fetched:
        if trust is not None:  # before a byte is unpacked; extract() re-hashes what it reads
            trust.check_subject(fetched.sha256)
        bundle_sha = fetched.release_sha256 or fetched.sha256
        choice = fetched.choice  # an OCI index: chosen from the registry
        if choice is not None:
            choice = dataclasses.replace(choice, bundle_sha256=bundle_sha)
        same = installed is not None and installed.digest == fetched.sha256
        if same and (choice is not None or selector.variant is None):
            assert installed is not None
            return _Unpacked(tree, None, installed.digest, choice, bundle_sha)
        tree.mkdir()
        # Unpack from the very file descriptor that was hashed, hashing again as it is read:
        # the digest recorded (and compared with the pin) is that of the bytes unpacked, even
        # if the file is rewritten in place meanwhile.
        reader = HashingReader(fetched.file)
        variant_sha: str | None = None
        if choice is not None:
            manifest = extract(reader, tree, emit)
            check_variant(choice.variant, manifest)  # the annotations chose it
        else:
            have = installed.digest if installed is not None else None
            out = extract_chosen(reader, tree, emit, selector, source, have)
            if out.choice is not None:
                choice = dataclasses.replace(out.choice, bundle_sha256=bundle_sha)
            if out.manifest is None:  # the bundle's chosen variant is installed already
                assert installed is not None
                return _Unpacked(tree, None, installed.digest, choice, bundle_sha)
            manifest, variant_sha = out.manifest, out.variant_sha256
        unpacked = reader.finish()
    if unpacked != fetched.sha256:
        raise IntegrityError(
            f"{source}: changed while it was being restored (sha256 {fetched.sha256} when "
            f"checked, {unpacked} when unpacked); nothing was changed"
        )
    if fetched.downloaded:
        fetched.path.unlink()
    return _Unpacked(tree, manifest, variant_sha or unpacked, choice, bundle_sha)


def _unless_changed(installed: Installed | None, emit: EventSink) -> Installed | None:
    """``installed``, or None when DEST changed since (said with a :class:`DestChanged`): what
    DEST holds is then no longer what was installed, and restoring it again is never a no-op."""
    if installed is None or not installed.changes:
        return installed
    found = installed.changes
    emit(
        DestChanged(
            dest=str(installed.dest),
            added=len(found.added),
            changed=len(found.changed),
            removed=len(found.removed),
        )
    )
    return None


def _complete(tree: Path, dest: Path, manifest: Manifest, state: InstallState) -> None:
    """Add restore's own files to the unpacked ``tree`` (manifest, ``kiln.env``, the state
    file, the lock links) and check it is exactly what the manifest lists, ready to swap."""
    staged = CacheLayout(tree)
    staged.manifest.write_bytes(manifest.to_bytes())
    staged.env_file.write_text(kiln_env(dest, manifest))
    staged.state_file.write_text(state.model_dump_json())
    for link in lock_links(manifest.rank_world):
        (tree / link).parent.mkdir(parents=True, exist_ok=True)
        (tree / link).symlink_to(LOCKS_TARGET)
    check_stage(tree, dest, manifest)
    moved = relocate_groups(tree, dest, manifest.entries())
    _share(tree)
    # Stamped last: a later repeat restore hashes only the files changed after this.
    stamped = state.model_copy(update={"stamp_ns": stamp(tree, manifest), "relocated": moved})
    staged.state_file.write_text(stamped.model_dump_json())


def _make_parents(dest: Path) -> None:
    """The folders above ``dest`` that do not exist yet, 0755 as :func:`_share` leaves DEST:
    the server must reach DEST through them, whatever the restoring umask."""
    missing = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    for folder in missing:
        folder.chmod(0o755)


def _share(tree: Path) -> None:
    """The modes the archive records (files 0644, folders 0755), whatever this process's umask:
    a restored folder is served by the server's user, often not the restoring one (a root init
    container with umask 077 left 0600 files that the ``USER 1000`` server could not read).
    Links are left alone, and not followed: the lock links point at the shared ``/tmp``."""
    for root, _dirs, files in os.walk(tree):  # Path.walk is Python 3.12's
        folder = Path(root)
        folder.chmod(0o755)
        for name in files:
            if not (folder / name).is_symlink():
                (folder / name).chmod(0o644)


def _noop(
    dest: Path,
    installed: Installed,
    env_file: str | Path | None,
    t0: float,
    choice: Choice | None = None,
) -> RestoreResult:
    return _result(
        dest, installed.digest, installed.manifest, env_file, t0, noop=True, choice=choice
    )


def _result(
    dest: Path,
    digest: str,
    manifest: Manifest,
    env_file: str | Path | None,
    t0: float,
    *,
    noop: bool,
    choice: Choice | None = None,
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
        choice=choice,
    )


def _write_env_copy(dest: Path, env_file: str | Path | None) -> Path:
    written = CacheLayout(dest).env_file
    if env_file is None:
        return written
    target = Path(env_file).absolute()
    with open(written, "rb") as src, atomic_write(target) as out:
        shutil.copyfileobj(src, out, CHUNK)
        os.fchmod(out.fileno(), 0o644)  # the server's to read, as DIR's own copy (_share)
    return target
