"""Restore's trust boundary beyond the archive itself: the pinned digest, the folders beside DEST,
the lock, a read-only parent, and a crash inside the two-rename swap.

Everything is real: files replaced or rewritten while a restore runs (at the fetch → unpack
boundary, through the progress callback), a second restore started from inside the first,
tmpfs mounts remounted read-only, and a subprocess that SIGKILLs itself between two renames.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.artifact import swap as swap_module
from kiln.artifact.restore import restore
from kiln.errors import IntegrityError, NotFoundError, UsageError
from kiln.events import Event
from kiln.layout import STATE_NAME
from tests.archives import good_archive, sha, tree

FILES = {"inductor/fxgraph/a/entry": os.urandom(5000), "inductor/xy/k.py": b"print(1)\n"}
EVIL = {"inductor/evil.py": b"import os\n"}
TEST_SWAP_ENV = swap_module.TEST_SWAP_ENV  # restore's documented test hook


def payload(d: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree(d).items() if k.startswith("inductor/")}


def kiln_names(parent: Path) -> list[str]:
    """What restore keeps beside DEST (lock, staging, old tree): nothing once it is done."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and "kiln" in p.name)


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    dest = tmp_path / "cache"
    restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/old": b"old"}), dest)
    return dest


def on(kind: str, when: Callable[[Event], bool], action: Callable[[], None]) -> Callable:
    """A progress sink that runs ``action`` once, at the first ``kind`` event ``when`` accepts."""
    fired: list[bool] = []

    def sink(event: Event) -> None:
        if not fired and event.event == kind and when(event):
            fired.append(True)
            action()

    return sink


def last_fetched(event: Event) -> bool:
    return event.bytes == event.total


# --- item 2: the pinned digest covers exactly the bytes unpacked ------------------------------


def test_file_replaced_after_the_check_installs_the_checked_bytes(
    tmp_path: Path, installed: Path
) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    evil = good_archive(tmp_path / "evil.kiln.tar.zst", EVIL)
    digest = sha(art)
    swap = on("fetched", last_fetched, lambda: os.replace(evil, art))
    result = restore(art, installed, sha256=digest, on_event=swap)
    assert payload(installed) == FILES  # the bytes that were checked, not the new file
    assert result.sha256 == digest
    assert json.loads((installed / STATE_NAME).read_text())["artifact_sha256"] == digest


def test_file_rewritten_in_place_after_the_check_is_refused(
    tmp_path: Path, installed: Path
) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    evil = good_archive(tmp_path / "evil.kiln.tar.zst", EVIL).read_bytes()
    assert len(evil) < art.stat().st_size  # the check's read sees EOF, the unpack sees EVIL

    def rewrite() -> None:
        with open(art, "r+b") as fh:  # same inode: an open descriptor sees the new bytes
            fh.truncate(0)
            fh.write(evil)

    before = tree(installed)
    sink = on("fetched", last_fetched, rewrite)
    with pytest.raises(IntegrityError, match="changed while it was being restored"):
        restore(art, installed, sha256=hashlib.sha256(art.read_bytes()).hexdigest(), on_event=sink)
    assert tree(installed) == before
    assert kiln_names(tmp_path) == []


@pytest.mark.parametrize(
    "digest",
    ["", "sha256:", "abc", "0" * 63, "0" * 65, "g" * 64, "sha512:" + "0" * 64, " " + "0" * 64],
    ids=["empty", "prefix-only", "short", "63", "65", "not-hex", "sha512", "space"],
)
def test_malformed_digest_is_a_usage_error(tmp_path: Path, installed: Path, digest: str) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    before = tree(installed)
    with pytest.raises(UsageError, match="64 hex digits"):
        restore(art, installed, sha256=digest)
    assert tree(installed) == before


def test_empty_digest_on_the_command_line_is_exit_2(tmp_path: Path, cli) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    proc = cli("restore", art, "--dest", tmp_path / "c", "--sha256", "", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert "64 hex digits" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()
    upper = "SHA256:" + sha(art).upper()
    assert restore(art, tmp_path / "c", sha256=upper).sha256 == sha(art)


def test_fifo_source_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "a.kiln.tar.zst"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not an artifact file"):
        restore(fifo, tmp_path / "c")
    with pytest.raises(UsageError, match="not an artifact file"):
        restore(tmp_path, tmp_path / "d")


# --- item 3: leftovers by exact name, and a staged tree checked before the swap --------------


def staging_of(parent: Path, name: str) -> Path:
    found = [p for p in parent.iterdir() if p.name.startswith(f".{name}.kiln-staging-")]
    assert len(found) == 1, found
    return found[0]


def wait_for(path: Path, size: int) -> None:
    deadline = time.monotonic() + 10
    while not (path.is_file() and path.stat().st_size == size):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.002)


@pytest.mark.parametrize("name", ["c*", "cache[1]", "c?che", "[a-c]ache"])
def test_glob_named_dest_spares_its_neighbours_staging(tmp_path: Path, name: str) -> None:
    neighbour = tmp_path / ".cache.kiln-staging-0123456789ab"  # a running restore's folder
    (neighbour / "tree").mkdir(parents=True)
    (tmp_path / ".cache1.kiln-staging-abcdefgh").mkdir()  # cache1's, mkdtemp-style
    restore(good_archive(tmp_path / "a.kiln.tar.zst", FILES), tmp_path / name)
    assert neighbour.is_dir() and (tmp_path / ".cache1.kiln-staging-abcdefgh").is_dir()
    assert payload(tmp_path / name) == FILES


def test_restore_into_c_star_beside_a_running_restore_into_cache(tmp_path: Path) -> None:
    a = {f"inductor/a{i}": os.urandom(200_000) for i in range(4)}
    art_a = good_archive(tmp_path / "a.kiln.tar.zst", a)
    art_b = good_archive(tmp_path / "b.kiln.tar.zst", FILES)
    first = min(a)

    def beside() -> None:
        wait_for(staging_of(tmp_path, "cache") / "tree" / first, len(a[first]))
        restore(art_b, tmp_path / "c*")

    sink = on("extract", lambda e: e.bytes > 0, beside)
    result = restore(art_a, tmp_path / "cache", on_event=sink)
    assert not result.noop
    assert payload(tmp_path / "cache") == a
    assert payload(tmp_path / "c*") == FILES
    assert kiln_names(tmp_path) == []


def _unlink(p: Path) -> None:
    p.unlink()


def _truncate(p: Path) -> None:
    os.truncate(p, 1)


def _extra(p: Path) -> None:
    (p.parent / "planted.so").write_bytes(b"\x7fELF")


def _symlink(p: Path) -> None:
    p.unlink()
    p.symlink_to("/etc/passwd")


@pytest.mark.parametrize(
    "mutate", [_unlink, _truncate, _extra, _symlink], ids=["missing", "truncated", "extra", "link"]
)
def test_partial_stage_is_never_swapped_in(tmp_path: Path, installed: Path, mutate) -> None:
    files = {f"inductor/f{i}": os.urandom(100_000) for i in range(3)}
    art = good_archive(tmp_path / "a.kiln.tar.zst", files)
    first = min(files)
    before = tree(installed)

    def interfere() -> None:
        staged = staging_of(tmp_path, "cache") / "tree" / first
        wait_for(staged, len(files[first]))
        mutate(staged)

    total = sum(map(len, files.values()))
    sink = on("extract", lambda e: e.bytes == total, interfere)
    with pytest.raises(IntegrityError, match="staged tree does not match the manifest"):
        restore(art, installed, on_event=sink)
    assert tree(installed) == before
    assert kiln_names(tmp_path) == []


@pytest.mark.parametrize(
    "name",
    ["..", "/", "x" * 240, ".cache.kiln-staging-0123456789ab", ".cache.kiln-old", ".c.kiln.lock"],
    ids=["dotdot", "root", "too-long", "staging-name", "old-name", "lock-name"],
)
def test_dest_names_that_cannot_work_are_usage_errors(tmp_path: Path, name: str) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = Path(name) if name == "/" else tmp_path / "sub" / name
    with pytest.raises(UsageError):
        restore(art, dest)


# --- item 8: a read-only parent folder -------------------------------------------------------


@pytest.fixture
def ro_parent(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs that the test fills and then remounts read-only (root ignores mode bits, not a
    read-only mount). Skipped where mounting is not permitted."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def remount_ro(mnt: Path) -> None:
    proc = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot remount read-only: {proc.stderr.decode().strip()}")


def test_read_only_parent_noop_succeeds_and_changes_are_exit_2(
    tmp_path: Path, ro_parent: Path, cli
) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    other = good_archive(tmp_path / "b.kiln.tar.zst", EVIL)
    dest = ro_parent / "cache"
    restore(art, dest)
    remount_ro(ro_parent)
    assert restore(art, dest, sha256=sha(art)).noop
    assert restore(art, dest).noop  # unpinned local: hashed, found installed
    proc = cli("restore", art, "--dest", dest, "--sha256", sha(art), "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["noop"] is True
    for source, where, pin in (
        (other, dest, None),
        (other, dest, sha(other)),
        ("http://127.0.0.1:1/a.kiln.tar.zst", dest, None),
        (art, ro_parent / "new" / "cache", None),
    ):
        with pytest.raises(UsageError, match="not writable"):
            restore(source, where, sha256=pin)
    proc = cli("restore", other, "--dest", dest, no_torch=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not writable" in lines[0], proc.stderr
    assert payload(dest) == FILES


# --- item 9: a crash between the two renames of the fallback swap ----------------------------


def test_fallback_swap_replaces_dest_and_leaves_nothing(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TEST_SWAP_ENV, "fallback")
    restore(good_archive(tmp_path / "a.kiln.tar.zst", FILES), installed)
    assert payload(installed) == FILES
    assert kiln_names(tmp_path) == []


def kill_between_renames(art: Path, dest: Path) -> None:
    code = f"from kiln.artifact.restore import restore; restore({str(art)!r}, {str(dest)!r})"
    env = {**os.environ, TEST_SWAP_ENV: "fallback,kill"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == -9  # SIGKILL, between `DEST -> .DEST.kiln-old` and `tree -> DEST`
    assert not dest.exists()
    assert (dest.parent / f".{dest.name}.kiln-old").is_dir()


@pytest.mark.parametrize("then", ["corrupt", "pinned-noop", "other"])
def test_kill_between_renames_keeps_the_old_tree(
    tmp_path: Path, installed: Path, then: str
) -> None:
    old_digest = sha(tmp_path / "old.kiln.tar.zst")
    before = tree(installed)
    kill_between_renames(good_archive(tmp_path / "a.kiln.tar.zst", FILES), installed)
    if then == "corrupt":
        bad = tmp_path / "bad.kiln.tar.zst"
        bad.write_bytes(b"not an artifact")
        with pytest.raises(IntegrityError):
            restore(bad, installed)
        assert tree(installed) == before  # put back before anything else happened
    elif then == "pinned-noop":
        assert restore(tmp_path / "old.kiln.tar.zst", installed, sha256=old_digest).noop
        assert tree(installed) == before
    else:
        restore(good_archive(tmp_path / "b.kiln.tar.zst", EVIL), installed)
        assert payload(installed) == EVIL
    assert kiln_names(tmp_path) == []


def test_old_tree_named_by_an_older_kiln_is_recovered(tmp_path: Path, installed: Path) -> None:
    before = tree(installed)
    installed.rename(tmp_path / ".cache.kiln-old-4242")  # what kiln called it before
    with pytest.raises(NotFoundError):
        restore(tmp_path / "missing.kiln.tar.zst", installed)
    assert tree(installed) == before


# --- item 11: the lock file goes away, safely ------------------------------------------------


def test_no_lock_file_is_left_behind(tmp_path: Path) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = tmp_path / "cache"
    restore(art, dest)
    assert kiln_names(tmp_path) == []
    restore(art, dest)  # no-op
    assert kiln_names(tmp_path) == []
    bad = tmp_path / "bad.kiln.tar.zst"
    bad.write_bytes(b"garbage")
    with pytest.raises(IntegrityError):
        restore(bad, dest)
    assert kiln_names(tmp_path) == []
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "mine").write_text("x")
    with pytest.raises(UsageError):
        restore(art, tmp_path / "home")
    assert kiln_names(tmp_path) == []


def test_lock_stays_exclusive_while_holders_remove_it(tmp_path: Path) -> None:
    """Holders unlink the file on release; waiters that opened the old inode must notice."""
    dest = tmp_path / "cache"
    inside = 0
    overlaps: list[int] = []
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside
        for _ in range(40):
            lock = swap_module.Lock(dest)
            try:
                with guard:
                    inside += 1
                    if inside > 1:
                        overlaps.append(inside)
                time.sleep(0.0005)
                with guard:
                    inside -= 1
            finally:
                lock.release()

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlaps == []
    assert kiln_names(tmp_path) == []


def test_planted_lock_symlink_is_refused(tmp_path: Path, cli) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / ".cache.kiln.lock").symlink_to(target)
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    proc = cli("restore", art, "--dest", tmp_path / "cache", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert "not a lock file kiln made" in proc.stderr
    assert not target.exists() and not (tmp_path / "cache").exists()
