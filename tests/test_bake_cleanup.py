"""A bake stopped by SIGTERM (a CI job cancelled, a pod evicted) leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
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
        assert _pids_running(str(tmp)) == []  # the worker and anything it started are gone
        assert not (tmp_path / "o.kiln.tar.zst").exists()
    finally:
        for pid in [proc.pid, *workers]:  # only if the test failed: processes it started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
