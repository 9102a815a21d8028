"""Restore: hostile archives refused with DIR untouched; atomic, idempotent, locked, streamed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.artifact.restore import restore
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError
from kiln.events import DestChanged
from kiln.layout import ENV_NAME
from tests.archives import good_archive, manifest_for, reg, special, tree, write_archive
from tests.servers import serve_folder

FILES = {"inductor/fxgraph/a/entry": b"A" * 1000, "inductor/xy/k.py": b"print(1)\n"}


def attack(tmp_path: Path, installed: Path, members, manifest_files=None, match: str = "") -> None:
    before = tree(installed)
    art = write_archive(
        tmp_path / "evil.kiln.tar.zst", manifest_for(manifest_files or FILES), members
    )
    with pytest.raises(IntegrityError, match=match):
        restore(art, installed)
    assert tree(installed) == before
    leftovers = [p.name for p in installed.parent.iterdir() if ".kiln-" in p.name]
    assert leftovers == []


def test_restore_layout_and_env(tmp_path: Path) -> None:
    dest = tmp_path / "cache"
    result = restore(
        good_archive(tmp_path / "a.kiln.tar.zst", FILES), dest, env_file=tmp_path / "e"
    )
    assert (dest / "inductor/fxgraph/a/entry").read_bytes() == FILES["inductor/fxgraph/a/entry"]
    assert json.loads((dest / "manifest.json").read_text())["name"] == "demo"
    env = (dest / ENV_NAME).read_text()
    assert f"export TORCHINDUCTOR_CACHE_DIR={dest / 'inductor'}" in env
    assert (tmp_path / "e").read_text() == env
    assert result.files == 2 and not result.noop
    out = subprocess.run(
        ["bash", "-c", f". {dest / ENV_NAME} && echo $TORCHINDUCTOR_CACHE_DIR"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(dest / "inductor")


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([reg("/etc/evil", b"x")], "absolute path"),
        ([reg("inductor/../../evil", b"x")], "path traversal"),
        ([reg("inductor/./x", b"x")], "path traversal"),
        ([special("inductor/fxgraph/a/entry", tarfile.SYMTYPE, "/etc/passwd")], "symlink"),
        ([special("inductor/fxgraph/a/entry", tarfile.LNKTYPE, "manifest.json")], "hardlink"),
        ([special("inductor/dev", tarfile.CHRTYPE)], "device"),
        ([special("inductor/fifo", tarfile.FIFOTYPE)], "fifo"),
        ([reg("inductor/unlisted", b"x")], "not in the manifest"),
        (
            [reg("inductor/xy/k.py", FILES["inductor/xy/k.py"])] * 2,
            "appears twice",
        ),
        ([reg("inductor/xy/k.py", b"print(1)\n" * 100)], "manifest says"),
        ([reg("inductor/xy/k.py", b"print(2)\n")], "sha256 differs"),
        ([reg("inductor/xy/k.py", FILES["inductor/xy/k.py"])], "missing 1 file"),
    ],
    ids=[
        "absolute",
        "dotdot",
        "dot",
        "symlink",
        "hardlink",
        "device",
        "fifo",
        "unlisted",
        "duplicate",
        "oversize",
        "digest",
        "missing",
    ],
)
def test_hostile_archives_refused(tmp_path: Path, installed: Path, members, match: str) -> None:
    attack(tmp_path, installed, members, match=match)


def test_hostile_manifest_paths_refused(tmp_path: Path, installed: Path) -> None:
    evil = {"../outside": b"x"}
    attack(tmp_path, installed, [reg("../outside", b"x")], evil, match="path traversal")


def test_manifest_not_first_refused(tmp_path: Path, installed: Path) -> None:
    before = tree(installed)
    art = write_archive(tmp_path / "x.kiln.tar.zst", None, [reg("inductor/x", b"x")])
    with pytest.raises(IntegrityError, match=r"manifest\.json is not the first member"):
        restore(art, installed)
    assert tree(installed) == before


def test_truncated_and_bitflipped_refused(tmp_path: Path, installed: Path) -> None:
    files = {f"inductor/f{i}": os.urandom(50_000) for i in range(8)}
    art = good_archive(tmp_path / "big.kiln.tar.zst", files)
    data = art.read_bytes()
    before = tree(installed)
    truncated = tmp_path / "trunc.kiln.tar.zst"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(IntegrityError):
        restore(truncated, installed)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    bad = tmp_path / "flip.kiln.tar.zst"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(IntegrityError):
        restore(bad, installed)
    assert tree(installed) == before


def test_pinned_digest_checked_before_unpacking(tmp_path: Path, installed: Path) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    before = tree(installed)
    with pytest.raises(IntegrityError, match="does not match the pinned"):
        restore(art, installed, sha256="0" * 64)
    assert tree(installed) == before
    digest = hashlib.sha256(art.read_bytes()).hexdigest()
    assert restore(art, installed, sha256=f"sha256:{digest}").sha256 == digest


def test_idempotent_noop(tmp_path: Path) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = tmp_path / "cache"
    first = restore(art, dest)
    marker = dest / "inductor/fxgraph/a/entry"
    mtime = marker.stat().st_mtime_ns
    again = restore(art, dest)
    pinned = restore(art, dest, sha256=first.sha256)
    assert again.noop and pinned.noop and not first.noop
    assert marker.stat().st_mtime_ns == mtime


# --- a repeat restore notices a DEST changed since it was installed (issue 25 item 5) --------


def _edit_same_size(path: Path) -> None:
    """New bytes, same size, and the old mtime put back: only the content (and the inode change
    time, which no user can set) says it changed."""
    st = path.stat()
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _drop_line(path: Path, prefix: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if not line.startswith(prefix)))


@pytest.mark.parametrize(
    ("change", "counts"),
    [
        (lambda d: _edit_same_size(d / "inductor/fxgraph/a/entry"), (0, 1, 0)),
        (lambda d: (d / "inductor/fxgraph/a/entry").write_bytes(b"short"), (0, 1, 0)),
        (lambda d: (d / "inductor/xy/new.py").write_text("x = 1\n"), (1, 0, 0)),
        (lambda d: (d / "inductor/xy/k.py").unlink(), (0, 0, 1)),
        (lambda d: (d / "inductor/xy/k.py").chmod(0o755), None),  # metadata only: still a no-op
        # kiln.env as an older kiln wrote it (no `unset` line), or gone: written anew.
        (lambda d: _drop_line(d / "kiln.env", "unset "), (0, 1, 0)),
        (lambda d: (d / "kiln.env").unlink(), (0, 0, 1)),
    ],
    ids=["edited", "truncated", "added", "removed", "chmod", "old-env", "no-env"],
)
def test_repeat_restore_reinstalls_a_changed_dest(
    tmp_path: Path, change, counts: tuple[int, int, int] | None
) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = tmp_path / "cache"
    first = restore(art, dest)
    change(dest)
    for pin in (None, first.sha256):  # pinned: decided before the lock; unpinned: after hashing
        events: list = []
        again = restore(art, dest, sha256=pin, on_event=events.append)
        said = [e for e in events if isinstance(e, DestChanged)]
        if counts is None:
            assert again.noop and not said
            continue
        assert not again.noop and again.sha256 == first.sha256
        assert [(e.added, e.changed, e.removed) for e in said] == [counts]
        assert said[0].message.startswith(f"{dest} changed since it was installed (")
        assert said[0].message.endswith("): re-installing")
        assert {k: v for k, v in tree(dest).items() if k.startswith("inductor/")} == FILES
        assert restore(art, dest, sha256=pin).noop  # installed again: a no-op once more
        change(dest)


def test_a_copied_folder_restored_at_its_new_path_gets_its_own_kiln_env(tmp_path: Path) -> None:
    """kiln.env names the path DEST was restored at: a copy restored where it now lies is not
    a no-op (the copy's kiln.env points at the old folder), and after it serves its own path."""
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    first = tmp_path / "first"
    restore(art, first)
    moved = tmp_path / "moved"
    shutil.copytree(first, moved, symlinks=True)
    events: list = []
    again = restore(art, moved, on_event=events.append)
    assert not again.noop
    assert [(e.added, e.changed, e.removed) for e in events if isinstance(e, DestChanged)] == [
        (0, 1, 0)
    ]
    text = (moved / "kiln.env").read_text()
    assert str(moved / "inductor") in text and str(first) not in text
    assert restore(art, moved).noop and restore(art, first).noop


def test_cli_says_dest_changed_and_reinstalls(tmp_path: Path, cli) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = tmp_path / "cache"
    assert cli("restore", art, "--dest", dest, no_torch=True).returncode == 0
    (dest / "inductor/xy/extra.so").write_bytes(b"\x7fELF")
    _edit_same_size(dest / "inductor/fxgraph/a/entry")
    proc = cli("restore", art, "--dest", dest, "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["noop"] is False
    assert (
        f"warning: {dest} changed since it was installed (1 file added, 1 changed, 0 removed): "
        "re-installing"
    ) in " ".join(proc.stderr.split())
    assert not (dest / "inductor/xy/extra.so").exists()
    proc = cli("restore", art, "--dest", dest, "--json", no_torch=True)
    assert json.loads(proc.stdout)["noop"] is True and "changed" not in proc.stderr


def test_cli_says_which_artifact_a_restore_replaced(tmp_path: Path, cli) -> None:
    """DEST held another artifact: restore installs the new one (a release rolls forward) and
    says what it replaced, by name and digest, rather than swapping it silently."""
    first = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    other = {**FILES, "inductor/fxgraph/b/entry": b"another graph"}
    second = write_archive(
        tmp_path / "b.kiln.tar.zst",
        manifest_for(other, name="other"),
        [reg(p, d) for p, d in sorted(other.items())],
    )
    dest = tmp_path / "cache"
    installed = restore(first, dest)
    assert installed.replaced is None
    proc = cli("restore", second, "--dest", dest, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stdout.split())
    assert f"replaced demo (sha256 {installed.sha256[:12]}…)" in said, proc.stdout
    proc = cli("restore", first, "--dest", dest, "--json", no_torch=True)
    assert json.loads(proc.stdout)["replaced"] == {
        "name": "other",
        "sha256": hashlib.sha256(second.read_bytes()).hexdigest(),
    }
    again = cli("restore", first, "--dest", dest, "--json", no_torch=True)
    assert json.loads(again.stdout)["replaced"] is None  # a no-op replaces nothing


def test_a_restore_under_a_strict_umask_is_readable_by_the_server(tmp_path: Path) -> None:
    """A root init container with umask 077 restores for the image's non-root server: files
    and folders get the archive's modes (0644, 0755), whatever the restoring umask; the lock
    links stay links, /tmp untouched."""
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = tmp_path / "opt" / "kiln" / "cache"  # the folders above, restore's to make
    old = os.umask(0o077)
    try:
        restore(art, dest, env_file=tmp_path / "kiln.env")
    finally:
        os.umask(old)
    assert [(p.stat().st_mode & 0o777) for p in (dest.parent, dest.parent.parent)] == [0o755] * 2
    assert (tmp_path / "kiln.env").stat().st_mode & 0o777 == 0o644
    modes = {
        p.relative_to(dest).as_posix(): p.stat().st_mode & 0o777
        for p in [dest, *dest.rglob("*")]
        if not p.is_symlink()
    }
    assert set(modes.values()) == {0o644, 0o755}, modes
    assert all(mode == 0o755 for rel, mode in modes.items() if (dest / rel).is_dir())
    assert modes["kiln.env"] == 0o644 and modes["manifest.json"] == 0o644
    assert (dest / "inductor" / "locks").is_symlink()
    assert restore(art, dest).noop  # the modes are the install's, not a change


def test_refuses_to_replace_foreign_folder(tmp_path: Path) -> None:
    dest = tmp_path / "home"
    dest.mkdir()
    (dest / "precious.txt").write_text("user data")
    with pytest.raises(UsageError, match="not a kiln folder"):
        restore(good_archive(tmp_path / "a.kiln.tar.zst"), dest)
    assert (dest / "precious.txt").read_text() == "user data"


def test_missing_source_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        restore(tmp_path / "nope.kiln.tar.zst", tmp_path / "cache")


def _restore_cmd(art: Path, dest: Path) -> list[str]:
    code = f"from kiln.artifact.restore import restore; restore({str(art)!r}, {str(dest)!r})"
    return [sys.executable, "-c", code]


def test_killed_restore_leaves_previous_contents(tmp_path: Path, installed: Path) -> None:
    files = {f"inductor/blob{i}": os.urandom(8 << 20) for i in range(12)}
    art = good_archive(tmp_path / "big.kiln.tar.zst", files)
    before = tree(installed)
    proc = subprocess.Popen(_restore_cmd(art, installed))
    deadline = time.time() + 60
    while time.time() < deadline:
        staging = list(installed.parent.glob(".cache.kiln-staging-*/tree/inductor/*"))
        if staging:
            break
        time.sleep(0.005)
    else:
        proc.kill()
        pytest.fail("restore never started unpacking")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tree(installed) == before
    result = restore(art, installed)  # the rerun cleans up and completes
    assert not result.noop and tree(installed)["inductor/blob3"] == files["inductor/blob3"]
    assert [p.name for p in installed.parent.iterdir() if "staging" in p.name] == []


def test_concurrent_restores_do_not_corrupt(tmp_path: Path) -> None:
    a = {f"inductor/a{i}": os.urandom(1 << 20) for i in range(10)}
    b = {f"inductor/b{i}": os.urandom(1 << 20) for i in range(10)}
    art_a = good_archive(tmp_path / "a.kiln.tar.zst", a)
    art_b = good_archive(tmp_path / "b.kiln.tar.zst", b)
    dest = tmp_path / "cache"
    procs = [subprocess.Popen(_restore_cmd(art, dest)) for art in (art_a, art_b, art_a, art_b)]
    assert [p.wait() for p in procs] == [0, 0, 0, 0]
    got = {k: v for k, v in tree(dest).items() if k.startswith("inductor/")}
    assert got in (a, b)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert {f["path"] for f in manifest["files"]} == set(got)


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[str]:
    root = tmp_path / "www"
    root.mkdir()
    with serve_folder(root) as url:
        yield url


def test_restore_over_http(tmp_path: Path, http_server: str) -> None:
    art = good_archive(tmp_path / "www" / "a.kiln.tar.zst", FILES)
    digest = hashlib.sha256(art.read_bytes()).hexdigest()
    events: list[dict] = []
    result = restore(
        f"{http_server}/a.kiln.tar.zst", tmp_path / "cache", sha256=digest, on_event=events.append
    )
    assert result.sha256 == digest
    assert any(e.event == "fetched" and e.total == art.stat().st_size for e in events)
    with pytest.raises(NotFoundError, match="404"):
        restore(f"{http_server}/missing.kiln.tar.zst", tmp_path / "cache2")
    with pytest.raises(IntegrityError):
        restore(f"{http_server}/a.kiln.tar.zst", tmp_path / "cache3", sha256="1" * 64)
    assert not (tmp_path / "cache3").exists()


def test_cli_restore_json_and_exit_codes(tmp_path: Path, cli, http_server: str) -> None:
    art = good_archive(tmp_path / "www" / "a.kiln.tar.zst", FILES)
    proc = cli(
        "restore",
        f"{http_server}/a.kiln.tar.zst",
        "--dest",
        tmp_path / "c",
        "--json",
        no_torch=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files"] == 2
    proc = cli("restore", art, "--dest", tmp_path / "d", "--sha256", "0" * 64, no_torch=True)
    assert proc.returncode == 3
    assert "does not match the pinned" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = cli("restore", tmp_path / "none.kiln.tar.zst", "--dest", tmp_path / "e", no_torch=True)
    assert proc.returncode == 4


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_is_clear_and_leaves_nothing(tmp_path: Path, tiny_fs: Path) -> None:
    files = {f"inductor/f{i}": os.urandom(1 << 20) for i in range(6)}
    art = good_archive(tmp_path / "big.kiln.tar.zst", files)
    dest = tiny_fs / "cache"
    restore(good_archive(tmp_path / "small.kiln.tar.zst", {"inductor/s": b"s"}), dest)
    before = tree(dest)
    with pytest.raises(KilnError, match="not enough free space"):
        restore(art, dest)
    assert tree(dest) == before
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["cache"]


@pytest.mark.parametrize("mountinfo", ["read", "absent"])
def test_a_bind_mount_of_the_same_filesystem_is_refused_as_a_mount_point(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch, mountinfo: str
) -> None:
    """os.path.ismount cannot see `mount --bind d d` (same device): restore staged the artifact,
    then its rename failed with EBUSY, an internal error (exit 1). Now /proc/self/mountinfo
    finds it; without one, the rename's EBUSY is the same refusal (exit 2), DEST as it was."""
    from kiln.artifact import swap

    dest = tmp_path / "my cache"
    restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/old": b"old"}), dest)
    before = tree(dest)
    bind = subprocess.run(["mount", "--bind", str(dest), str(dest)], capture_output=True)
    if bind.returncode:
        pytest.skip(f"cannot bind-mount here: {bind.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(dest)], check=True)
        art = good_archive(tmp_path / "new.kiln.tar.zst", {"inductor/new": b"new"})
        refusal = f"{dest}: is a mount point and cannot be swapped atomically"
        if mountinfo == "read":
            assert not os.path.ismount(dest) and swap.is_mount_point(dest)
            proc = cli("restore", art, "--dest", dest, no_torch=True)
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.startswith(f"kiln: error: {refusal}"), proc.stderr
        else:  # a system without /proc: the swap itself meets the mount
            monkeypatch.setattr(swap, "MOUNTINFO", tmp_path / "no-proc" / "mountinfo")
            assert not swap.is_mount_point(dest)
            with pytest.raises(UsageError, match=refusal):
                restore(art, dest)
        assert tree(dest) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["my cache", "old.kiln.tar.zst", "new.kiln.tar.zst"]
        )
    finally:
        subprocess.run(["umount", str(dest)], check=False)


# --- the library names parameters, the CLI names flags (issue 28 step 6) ----------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "flag_args", "flag"),
    [
        ({"sha256": "abc"}, "sha256", ("--sha256", "abc"), "--sha256 'abc'"),
        ({"timeout": -1.0}, "timeout", ("--timeout", "-1"), "--timeout -1.0"),
        ({"torch_version": " "}, "torch_version", ("--torch-version", ""), "--torch-version ''"),
    ],
)
def test_a_bad_argument_names_the_parameter_and_the_cli_the_flag(
    tmp_path: Path, cli, kwargs: dict, param: str, flag_args: tuple[str, str], flag: str
) -> None:
    from kiln.errors import ParameterError

    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    with pytest.raises(ParameterError) as caught:
        restore(art, tmp_path / "cache", **kwargs)
    assert caught.value.param == param and caught.value.message.startswith(f"{param}=")
    assert "--" not in caught.value.message
    proc = cli("restore", art, "--dest", tmp_path / "cache", *flag_args, no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"kiln: error: {flag}: expected "), proc.stderr
    assert not (tmp_path / "cache").exists()


def test_a_deeply_nested_install_record_reads_as_no_install(installed: Path) -> None:
    """The state file is restore's own, but DEST is writable by others: JSON nested past
    Python's recursion limit reads as no install, not a crash."""
    from kiln.artifact.restore import read_installed
    from kiln.layout import STATE_NAME

    (installed / STATE_NAME).write_text("[" * 100_000 + "]" * 100_000)
    assert read_installed(installed) is None


def test_any_install_record_reads_as_an_install_or_none(installed: Path) -> None:
    """Hypothesis: whatever the state file holds (restore's own record with fields replaced by
    any JSON, its digest dropped), reading it gives a well-typed install or none (a restore then
    installs again), never a crash, an odd digest or a negative stamp taken on trust."""
    import re

    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    from kiln.artifact.manifest import FileEntry
    from kiln.artifact.restore import read_installed
    from kiln.layout import STATE_NAME
    from kiln.serving import NAME_PATTERN

    state_file = installed / STATE_NAME
    good = json.loads(state_file.read_text())
    original = read_installed(installed)
    assert original is not None and original.digest == good["artifact_sha256"]
    entry = original.manifest.files[0].model_dump(mode="json")  # a file restore could rewrite
    sha = st.sampled_from(["a" * 64, "A" * 64, "sha256:" + "a" * 64, "", "x"])
    scalars = sha | st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    bundle = st.fixed_dictionaries({"sha256": sha, "variant": st.text(max_size=4)})
    values = (
        scalars
        | bundle
        | st.lists(scalars | bundle | st.just(entry), max_size=3)
        | st.dictionaries(st.text(max_size=8), scalars, max_size=3)
    )
    fields = st.sampled_from(sorted({*good, "bundle", "relocated", "stamp_ns", "other"}))

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(st.dictionaries(fields, values, max_size=4), st.booleans())
    @example({"artifact_sha256": "x"}, False)
    @example({"stamp_ns": -5, "bundle": {"sha256": "y", "variant": "a100"}}, False)
    def check(changes: dict, drop_digest: bool) -> None:
        record = {**good, **changes}
        if drop_digest:
            record.pop("artifact_sha256")
        state_file.write_text(json.dumps(record))
        got = read_installed(installed)
        if got is None:
            return
        assert re.fullmatch("[0-9a-f]{64}", got.digest), got.digest
        assert got.bundle_sha256 is None or re.fullmatch("[0-9a-f]{64}", got.bundle_sha256)
        assert got.stamp_ns is None or (type(got.stamp_ns) is int and got.stamp_ns >= 0)
        assert got.variant is None or re.fullmatch(NAME_PATTERN, got.variant), got.variant
        assert all(isinstance(e, FileEntry) for e in got.relocated)

    check()
