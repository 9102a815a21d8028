"""Probe (issue 25, GPU): why a read-only restored folder's first calls are slower on the GPU.

On the H100 (2026-12-06) the AOT route's user server on a read-only mount took 0.38-0.52 s for
every bucket's first call against 0.04-0.14 s on a writable folder, with 0 work counted and
nothing written. The suspect is the CUDA driver's JIT cache (``DIR/cuda-cache``, where cuDNN's
runtime-compiled kernels are kept), which the driver may not use in a folder it cannot write.
This serves one restored artifact four ways as the first process after the restore, as
``tests/user_server.py`` does, and prints each bucket's first call:

  writable            DIR on a writable tmpfs
  read-only           DIR on a tmpfs remounted read-only
  read-only+cache     the same, CUDA_CACHE_PATH on a writable copy of DIR/cuda-cache
  read-only, no cache the same, CUDA_CACHE_DISABLE=1 (what a driver without its cache does)

Usage (root, on the GPU machine): python3 scripts/probe_read_only.py SPEC.yaml ARTIFACT
Remove once its conclusion is in the code or docs/first-process.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.artifact.restore import restore  # noqa: E402
from tests.first_process import USER_SERVER, serve_like_a_user  # noqa: E402

# kiln.env exports CUDA_CACHE_PATH after the caller's environment is set: the override is made
# in the server's process, before torch is imported, from PROBE_-prefixed variables.
# On the AOT route the server calls kiln.activate(), which exports CUDA_CACHE_PATH again, but
# only after tests/user_server.py has moved the model to the GPU: the driver has read it then.
WRAPPER = f"""import os, runpy, sys
for key in ("CUDA_CACHE_PATH", "CUDA_CACHE_DISABLE"):
    if os.environ.get("PROBE_" + key):
        os.environ[key] = os.environ["PROBE_" + key]
sys.argv[0] = {str(USER_SERVER)!r}
runpy.run_path({str(USER_SERVER)!r}, run_name="__main__")
"""


def main() -> None:
    spec, artifact = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    base = Path(tempfile.mkdtemp(prefix="kiln-ro-probe-"))
    server = base / "server.py"
    server.write_text(WRAPPER)
    ways: list[tuple[str, bool, str]] = [
        ("warm-up (writable)", False, ""),  # pays the GPU's cold start for the rows below
        ("writable", False, ""),
        ("read-only", True, ""),
        ("read-only+cache", True, "copy"),
        ("read-only, no cache", True, "disable"),
    ]
    try:
        for i, way in enumerate(ways):
            serve_one(spec, artifact, base, server, i, *way)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def serve_one(
    spec: Path,
    artifact: Path,
    base: Path,
    server: Path,
    i: int,
    label: str,
    read_only: bool,
    cache: str,
) -> None:
    """One way: restore into a fresh tmpfs, remount it read-only if asked, serve once."""
    mnt = base / f"mnt{i}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(mnt)], check=True)
    try:
        dest = mnt / "cache"
        restore(artifact, dest)
        env: dict[str, str] = {}
        if cache == "copy":
            writable = base / f"cuda-cache{i}"
            if (dest / "cuda-cache").is_dir():
                shutil.copytree(dest / "cuda-cache", writable)
            env["PROBE_CUDA_CACHE_PATH"] = str(writable)
        elif cache == "disable":
            env["PROBE_CUDA_CACHE_DISABLE"] = "1"
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        work = base / f"work{i}"
        served = serve_like_a_user(spec, dest, work, order="grid", env=env, server=server)
        firsts = " ".join(f"{b['first_call_s']:.3f}" for b in served.buckets)
        print(f"{label:20} rc={served.returncode} work={served.work()} first calls: {firsts}")
        if served.returncode:
            print(served.stderr[-2000:])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


if __name__ == "__main__":
    main()
