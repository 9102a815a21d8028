"""How a restored tree replaces DEST: the lock, the staging folder, the swap, crash recovery.

Everything restore keeps beside DEST is named ``.{DEST name}{suffix}``; leftovers are found by
comparing whole names. The swap is one ``renameat2(RENAME_EXCHANGE)`` where the filesystem has
it, else two renames through a well-known ``.DEST.kiln-old`` name that the next restore puts back
if a crash came in between. Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import UsageError
from kiln.events import EventSink, Recovered

# --- names beside DEST -------------------------------------------------------------------------
# Everything restore keeps next to DEST is named `.{DEST name}{suffix}`, and leftovers are found by
# comparing whole names (never a glob: a DEST called `c*` or `cache[1]` would match its
# neighbours' folders and delete them).
_LOCK_SUFFIX = ".kiln.lock"
STAGING_INFIX = ".kiln-staging-"
_STAGING_TOKEN = re.compile(r"[0-9a-f]{12}|[a-z0-9_]{8}")  # ours | tempfile.mkdtemp's (old kilns)
_OLD_SUFFIX = ".kiln-old"  # the previous tree during a two-rename swap (no RENAME_EXCHANGE)
_LEGACY_OLD = re.compile(r"-[0-9]+")  # `.kiln-old-PID`, what older kilns called it
_RESERVED = re.compile(r"\..+\.kiln(?:-staging-.*|-old(?:-[0-9]+)?|\.lock)")
MAX_DEST_NAME = 255 - len(".") - len(STAGING_INFIX) - 12
# errno values that mean "this folder cannot be written": the parent is read-only.
UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})

# Test hook, read only by _swap: KILN_TEST_SWAP=fallback takes the two-rename path that
# filesystems without RENAME_EXCHANGE get; "fallback,kill" also SIGKILLs this process between
# the two renames, the crash that path must survive (tests/test_restore_trust.py). Never set it
# outside tests.
TEST_SWAP_ENV = "KILN_TEST_SWAP"


def sibling(dest: Path, suffix: str) -> Path:
    return dest.parent / f".{dest.name}{suffix}"


def dest_path(dest: str | Path) -> Path:
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


class Lock:
    """One restore per DIR at a time, across processes: ``flock`` on ``.DIR.kiln.lock``.

    The file is removed again on release, so no restore leaves it behind. Removing a lock file
    is racy unless done this way: unlink only while holding the lock, and after acquiring it,
    check that the path still names the inode that was locked (a waiter may have opened the
    file just before its holder unlinked it); if not, start over on the new file. ``flock``
    dies with its holder, so a killed restore leaves a file that the next one takes and removes.
    """

    def __init__(self, dest: Path) -> None:
        self.path = sibling(dest, _LOCK_SUFFIX)
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


def leftovers(dest: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """This DEST's leftovers beside it, by exact name: ("staging" | "old", entry)."""
    staging = f".{dest.name}{STAGING_INFIX}"
    old = f".{dest.name}{_OLD_SUFFIX}"
    with os.scandir(dest.parent) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(staging) and _STAGING_TOKEN.fullmatch(name[len(staging) :]):
                yield "staging", entry
            elif name == old or (name.startswith(old) and _LEGACY_OLD.fullmatch(name[len(old) :])):
                yield "old", entry


def recover(dest: Path, emit: EventSink) -> None:
    """Finish what a restore killed inside a two-rename swap left (we hold the lock).

    DEST missing and an old tree beside it: the crash came between the renames, so the old tree
    goes back first, before anything could delete it. DEST present: the swap had finished and
    the old tree is garbage.
    """
    olds = sorted(
        (entry for kind, entry in leftovers(dest) if kind == "old"),
        key=lambda e: e.name != f".{dest.name}{_OLD_SUFFIX}",  # the current name first
    )
    for entry in olds:
        if not os.path.lexists(dest) and entry.is_dir(follow_symlinks=False):
            os.rename(entry.path, dest)
            emit(Recovered(dest=str(dest), source=entry.name))
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def clean_stale(dest: Path) -> None:
    """Remove staging folders of restores into this DEST that were killed (we hold its lock,
    so none of them is running)."""
    for kind, entry in list(leftovers(dest)):
        if kind == "staging" and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def make_staging(dest: Path) -> Path:
    while True:
        path = sibling(dest, f"{STAGING_INFIX}{secrets.token_hex(6)}")
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue


# --- mount points -------------------------------------------------------------------------
# Linux's list of this process's mounts: a mount point is field 5, with a space, tab, newline
# and backslash written as octal escapes (proc(5)).
MOUNTINFO = Path("/proc/self/mountinfo")
_MOUNT_ESCAPE = re.compile(rb"\\([0-7]{3})")


def is_mount_point(path: Path) -> bool:
    """Whether a filesystem is mounted at ``path``: no rename can move it (EBUSY).

    ``os.path.ismount`` compares ``path``'s device with its parent's, so it cannot see a bind
    mount of a folder of the same filesystem (``mount --bind d d``, a container's volume from
    the host's disk); ``/proc/self/mountinfo``, where there is one, lists every mount point.
    """
    if os.path.ismount(path):
        return True
    try:
        table = MOUNTINFO.read_bytes()
    except OSError:
        return False
    real = os.fsencode(os.path.realpath(path))
    for line in table.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4 and _unescape(fields[4]) == real:
            return True
    return False


def _unescape(field: bytes) -> bytes:
    return _MOUNT_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field)


def mount_point_error(dest: Path) -> UsageError:
    """Restore's refusal of a DEST that is a mount point (exit 2), the one wording of it."""
    return UsageError(
        f"{dest}: is a mount point and cannot be swapped atomically; "
        f"restore into a subfolder (e.g. {dest / 'kiln'})"
    )


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


def swap(tree: Path, dest: Path) -> None:
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
    # puts it back before anything else (recover).
    old = sibling(dest, _OLD_SUFFIX)
    if os.path.lexists(old):
        shutil.rmtree(old)  # a finished swap's garbage: recover() saw DEST present
    os.rename(dest, old)
    if "kill" in hooks:
        os.kill(os.getpid(), signal.SIGKILL)
    os.rename(tree, dest)
    shutil.rmtree(old, ignore_errors=True)
