"""Restore's trust boundary beyond the archive itself: the pinned digest, the folders beside DEST,
the lock, a read-only parent, and a crash inside the two-rename swap.

Everything is real: files replaced or rewritten while a restore runs (at the fetch → unpack
boundary, through the progress callback), a second restore started from inside the first,
tmpfs mounts remounted read-only, and a subprocess that SIGKILLs itself between two renames.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.errors import IntegrityError, UsageError
from kiln.restore import restore
from kiln.serving import STATE_NAME
from tests.archives import good_archive

FILES = {"inductor/fxgraph/a/entry": os.urandom(5000), "inductor/xy/k.py": b"print(1)\n"}
EVIL = {"inductor/evil.py": b"import os\n"}
restore_module = importlib.import_module("kiln.restore")  # `kiln.restore` is the function
TEST_SWAP_ENV = "KILN_TEST_SWAP"  # restore's documented test hook (kiln.restore.TEST_SWAP_ENV)


def tree(d: Path) -> dict[str, bytes]:
    return {
        p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
    }


def payload(d: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree(d).items() if k.startswith("inductor/")}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kiln_names(parent: Path) -> list[str]:
    """What restore keeps beside DEST (lock, staging, old tree): nothing once it is done."""
    names = (p.name for p in parent.iterdir() if p.name.startswith(".") and "kiln" in p.name)
    return sorted(n for n in names if not n.endswith(".kiln.lock"))  # the lock stays, for now


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    dest = tmp_path / "cache"
    restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/old": b"old"}), dest)
    return dest


def on(kind: str, when: Callable[[dict], bool], action: Callable[[], None]) -> Callable:
    """A progress sink that runs ``action`` once, at the first ``kind`` event ``when`` accepts."""
    fired: list[bool] = []

    def sink(event: dict) -> None:
        if not fired and event["event"] == kind and when(event):
            fired.append(True)
            action()

    return sink


def last_fetched(event: dict) -> bool:
    return event["bytes"] == event["total"]


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
