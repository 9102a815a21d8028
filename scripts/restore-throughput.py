"""Restore throughput: `kiln restore` against `zstd -d | tar x` on the same artifact.

    python scripts/restore-throughput.py [ARTIFACT] [--synthetic-mib N]

Without ARTIFACT it packs a synthetic cache of N MiB (files of 4 KiB-8 MiB, half random, half
repetitive, like .so/.cubin plus pickled graphs) with kiln's own writer. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kiln.artifact.archive import write_artifact
from kiln.artifact.manifest import Manifest
from kiln.artifact.restore import restore
from kiln.compiler.capture import capture


def synthetic(root: Path, mib: int) -> Path:
    rng = random.Random(0)
    cache = root / "inductor"
    total = 0
    i = 0
    while total < mib << 20:
        size = rng.choice([4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20])
        half = size // 2
        data = os.urandom(half) + (b"inductor-cache-entry " * (half // 21 + 1))[: size - half]
        p = cache / f"{i % 256:02x}" / f"entry{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        total += size
        i += 1
    manifest = Manifest(
        name="synthetic",
        created="1970-01-01T00:00:00+00:00",
        spec={},
        spec_sha256="0" * 64,
        fingerprint={},
        grid=[],
        files=capture(cache),
    )
    out = root / "synthetic.kiln.tar.zst"
    write_artifact(out, manifest, root)
    shutil.rmtree(cache)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact", nargs="?")
    parser.add_argument("--synthetic-mib", type=int, default=1024)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-throughput-"))
    try:
        art = Path(args.artifact) if args.artifact else synthetic(work, args.synthetic_mib)
        t0 = time.perf_counter()
        result = restore(art, work / "kiln")
        kiln_s = time.perf_counter() - t0
        plain = work / "plain"
        plain.mkdir()
        t0 = time.perf_counter()
        subprocess.run(f"zstd -dc '{art}' | tar -x -C '{plain}'", shell=True, check=True)
        plain_s = time.perf_counter() - t0
        mib = result.bytes / (1 << 20)
        print(
            f"artifact {art.name}: {art.stat().st_size / (1 << 20):.1f} MiB packed, "
            f"{mib:.1f} MiB in {result.files} files"
        )
        print(f"kiln restore        {kiln_s:7.2f} s  {mib / kiln_s:7.1f} MiB/s (checked, atomic)")
        print(f"zstd -d | tar x     {plain_s:7.2f} s  {mib / plain_s:7.1f} MiB/s")
        print(f"ratio kiln/plain    {kiln_s / plain_s:7.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
