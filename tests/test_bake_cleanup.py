"""kiln leaves nothing in TMPDIR: a bake stopped by SIGTERM (a CI job cancelled, a pod evicted),
a finished bake (Inductor's precompiled headers went to $TMPDIR/torchinductor_$USER), and
`kiln check` (its CPU-ISA probes went there, or into the restored folder). A second bake of the
same name says whose lock it waits for."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import mlp_spec


def _pids_running(needle: str) -> list[int]:
    """Processes whose command line mentions ``needle`` (a path only this test uses)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
    return found


def left_in(tmp: Path) -> list[str]:
    """Every file and folder under ``tmp`` but kiln's bake lock folder, as relative paths."""
    return sorted(
        str(p.relative_to(tmp))
        for p in tmp.rglob("*")
        if p.is_file() or p.name != f"kiln-bake-{os.getuid()}"
    )


@pytest.mark.slow  # a real bake in a fresh process, stopped while it compiles
def test_sigterm_during_a_bake_kills_the_worker_and_removes_its_folders(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"  # the bake's temporary root, so that leftovers are this test's own
    tmp.mkdir()
    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec("sigterm-mlp"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "bake", str(spec), "-o", str(tmp_path / "o.kiln.tar.zst")],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp), "NO_COLOR": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not workers:  # the worker is running: its request sits in a kiln-worker-* folder
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the worker never started"
            workers = _pids_running(str(tmp / "kiln-worker-"))
            time.sleep(0.05)
        assert (tmp / f"kiln-bake-{os.getuid()}" / "sigterm-mlp").is_dir()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "Traceback" not in err
        assert list(tmp.glob("kiln-worker-*")) == []
        assert not (tmp / f"kiln-bake-{os.getuid()}" / "sigterm-mlp").exists()
        assert left_in(tmp) == [f"kiln-bake-{os.getuid()}/sigterm-mlp.lock"]  # no gcc temps
        assert _pids_running(str(tmp)) == []  # the worker and anything it started are gone
        assert not (tmp_path / "o.kiln.tar.zst").exists()
    finally:
        for pid in [proc.pid, *workers]:  # only if the test failed: processes it started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_finished_bake_leaves_nothing_in_tmpdir(tmp_path: Path) -> None:
    """Issue 29, item 6: the bake's workers get a TMPDIR of their own, removed with them; before,
    Inductor's precompiled headers (155 MB on the H200 image) stayed in
    $TMPDIR/torchinductor_$USER."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec("tidy-mlp", buckets="batch: [2]"))  # every worker, one graph
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "bake", str(spec), "-o", str(tmp_path / "o.kiln.tar.zst")],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp), "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    assert left_in(tmp) == [f"kiln-bake-{os.getuid()}/tidy-mlp.lock"]


@pytest.mark.slow  # the probes compile: ~10 s a run on 2 cores where none are kept
@pytest.mark.usefixtures("real_isa_probes")  # where they go is the subject
def test_check_leaves_nothing_in_tmpdir_or_the_restored_folder(tmp_path: Path) -> None:
    """`kiln check` fingerprints this machine, and Inductor compiles CPU-ISA probes to do it:
    into $TMPDIR/torchinductor_$USER when no cache folder is set, into DIR/inductor once
    kiln.env is sourced. Now into kiln's own per-user folder (kept: the next check loads them
    instead of compiling again), or, where that cannot be made, a folder of its own, removed."""
    from kiln.artifact.restore import restore
    from tests.archives import good_archive, tree

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dest = tmp_path / "cache"
    restore(good_archive(tmp_path / "a.kiln.tar.zst"), dest)
    before = tree(dest)
    home_cache = tmp_path / "home-cache"
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("a file where the cache home should be")
    kept = home_cache / "kiln" / "isa-probes"
    runs = [
        {"XDG_CACHE_HOME": str(home_cache)},
        {"XDG_CACHE_HOME": str(home_cache), "TORCHINDUCTOR_CACHE_DIR": str(dest / "inductor")},
        {"XDG_CACHE_HOME": str(not_a_folder)},  # no per-user folder: a temporary one
    ]
    for env in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "kiln", "check", str(dest)],
            env={**os.environ, "TMPDIR": str(tmp), "NO_COLOR": "1", **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert left_in(tmp) == []
        assert tree(dest) == before
        assert any(kept.rglob("*.so")), "the probes are kept for the next check"
    assert not_a_folder.read_text() == "a file where the cache home should be"


def test_a_second_bake_says_whose_lock_it_waits_for(tmp_path: Path) -> None:
    """Two bakes of one name take turns on its work folder (the cache root is part of the
    bytes); the second one said nothing for a minute. Now it names the holder and waits."""
    tmp = tmp_path / "tmp"
    base = tmp / f"kiln-bake-{os.getuid()}"
    base.mkdir(parents=True)
    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec("locked-mlp"))
    with open(base / "locked-mlp.lock", "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        held.write(b"pid 4242, started 12:00:00")
        held.flush()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kiln",
                "bake",
                str(spec),
                "-o",
                str(tmp_path / "o.kiln.tar.zst"),
            ],
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp), "NO_COLOR": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            # The first thing it says, before it waits (a silent bake would block readline).
            ready, _, _ = select.select([proc.stderr], [], [], 120)
            assert ready, "the waiting bake said nothing in 120 s"
            line = proc.stderr.readline()
            assert line.strip() == (
                f"waiting: another bake of locked-mlp (pid 4242, started 12:00:00) holds "
                f"{base / 'locked-mlp.lock'}"
            )
            assert proc.poll() is None  # and it does wait
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not (tmp_path / "o.kiln.tar.zst").exists()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_finished_gpu_bake_leaves_nothing_in_tmpdir(tmp_path: Path) -> None:
    """The same on CUDA (issue 29 measured 155 MB of precompiled headers left by a GPU bake)."""
    import shutil

    from tests.conftest import ROOT

    for folder in ("configs", "examples"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    bake = ["bake", "configs/tiny-gpt-cuda.yaml", "-o", "o.kiln.tar.zst"]
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", *bake],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp), "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert left_in(tmp) == [f"kiln-bake-{os.getuid()}/tiny-gpt-cuda.lock"]
