"""kiln: bake torch.compile caches in CI, ship them as a verified artifact, prove they hit.

``import kiln`` never imports torch: every module keeps torch imports inside the functions that
need it, so the restore path runs in slim init containers without it.

The package is two worlds with one boundary: :mod:`kiln.artifact` (manifest, archive, storage,
restore) runs without torch; :mod:`kiln.compiler` (bake, worker, verify, bench, check, activate)
runs where the model runs. Shared, torch-free pieces sit at the top: the spec and its grid, the
serving environment, events and errors.
"""

from __future__ import annotations

from kiln._version import __version__
from kiln.artifact.archive import read_manifest
from kiln.artifact.attestation import sign
from kiln.artifact.merge import MergeResult, merge
from kiln.artifact.restore import RestoreResult, restore
from kiln.artifact.storage import push
from kiln.compiler.activate import activate
from kiln.compiler.bake import BakeResult, bake
from kiln.compiler.bench import bench
from kiln.compiler.check import check
from kiln.compiler.fingerprint import fingerprint
from kiln.compiler.verify import verify
from kiln.spec import load_spec

__all__ = [
    "BakeResult",
    "MergeResult",
    "RestoreResult",
    "__version__",
    "activate",
    "bake",
    "bench",
    "check",
    "fingerprint",
    "load_spec",
    "merge",
    "push",
    "read_manifest",
    "restore",
    "sign",
    "verify",
]
