"""Whether this interpreter finds torch's Python compiled to bytecode, or compiles it each start.

A process that serves with ``torch.compile`` imports Dynamo and Inductor, about a thousand
modules an eager server never loads. Without cached bytecode (an image built with
``pip --no-compile``, ``__pycache__`` folders deleted to slim it, or a read-only install with
``PYTHONDONTWRITEBYTECODE=1``), every process compiles all of them from source first. Measured
on the 2-core CPU machine with torch 2.13: ``import torch, torch._inductor.compile_fx`` takes
15.5 s from source against 5.4 s with bytecode (medians of 3), and the H200 image kiln's GPU
figures come from ships torch that way (docs/benchmarks.md). No cache kiln restores can win
those seconds back; ``python -m compileall`` at image build does. Torch-free: it looks for
files, without importing torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# A module every torch.compile process imports: if its bytecode is cached, torch's is.
_PROBE = ("_inductor", "compile_fx.py")


def uncached_reason(package: str = "torch") -> str | None:
    """Why ``package``'s Inductor is compiled from source at each start here, or None when its
    bytecode is cached (or the package is not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    source = root.joinpath(*_PROBE)
    if not source.is_file() or Path(importlib.util.cache_from_source(str(source))).is_file():
        return None
    why = "; PYTHONDONTWRITEBYTECODE is set, so none is written" if sys.dont_write_bytecode else ""
    return (
        f"{package}'s Python bytecode is not cached here{why}: every process compiles Dynamo "
        f"and Inductor from source before its first compile (seconds); run "
        f"`python -m compileall -q {root}` when building the image"
    )
