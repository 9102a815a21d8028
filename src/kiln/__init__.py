"""kiln: bake torch.compile caches in CI, ship them as a verified artifact, prove they hit.

``import kiln`` never imports torch: every module keeps torch imports inside the functions that
need it, so the restore path runs in slim init containers without it.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Bound eagerly on purpose: a lazily imported submodule `kiln.bake` would replace the function
# `kiln.bake` on the package the moment it is imported.
from kiln.artifact import read_manifest
from kiln.bake import BakeResult, bake
from kiln.bench import bench
from kiln.check import check
from kiln.fingerprint import fingerprint
from kiln.restore import RestoreResult, restore
from kiln.runtime import activate
from kiln.spec import load_spec
from kiln.storage import push
from kiln.verify import verify

__all__ = [
    "BakeResult",
    "RestoreResult",
    "__version__",
    "activate",
    "bake",
    "bench",
    "check",
    "fingerprint",
    "load_spec",
    "push",
    "read_manifest",
    "restore",
    "verify",
]
