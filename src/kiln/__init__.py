"""kiln: bake torch.compile caches in CI, ship them as a verified artifact, prove they hit.

``import kiln`` never imports torch: every module keeps torch imports inside the functions that
need it, so the restore path runs in slim init containers without it.

The package is two worlds with one boundary: :mod:`kiln.artifact` (manifest, archive, storage,
restore) runs without torch; :mod:`kiln.compiler` (bake, worker, verify, bench, check, activate)
runs where the model runs. Shared, torch-free pieces sit at the top: the spec and its grid, the
serving environment, events and errors.

The public names below are loaded on first use (PEP 562 module ``__getattr__``): importing any
``kiln.*`` module imports this package first, and an eager import here would pull the whole
compiler side into ``import kiln.artifact.restore``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kiln._version import __version__

if TYPE_CHECKING:
    from kiln.artifact.archive import read_manifest
    from kiln.artifact.attestation import sign
    from kiln.artifact.merge import MergeResult, merge
    from kiln.artifact.publish import push
    from kiln.artifact.restore import RestoreResult, restore
    from kiln.compiler.activate import activate
    from kiln.compiler.bake import BakeResult, FollowerResult, bake
    from kiln.compiler.bench import bench
    from kiln.compiler.check import check
    from kiln.compiler.fingerprint import fingerprint
    from kiln.compiler.verify import verify
    from kiln.spec import load_spec

# Each public name and the module that defines it (``__all__`` lists the same names, spelled
# out for type checkers and linters; tests/test_imports.py holds the two together).
_HOMES = {
    "read_manifest": "kiln.artifact.archive",
    "sign": "kiln.artifact.attestation",
    "MergeResult": "kiln.artifact.merge",
    "merge": "kiln.artifact.merge",
    "RestoreResult": "kiln.artifact.restore",
    "restore": "kiln.artifact.restore",
    "push": "kiln.artifact.publish",
    "activate": "kiln.compiler.activate",
    "BakeResult": "kiln.compiler.bake",
    "bake": "kiln.compiler.bake",
    "FollowerResult": "kiln.compiler.bake",
    "bench": "kiln.compiler.bench",
    "check": "kiln.compiler.check",
    "fingerprint": "kiln.compiler.fingerprint",
    "verify": "kiln.compiler.verify",
    "load_spec": "kiln.spec",
}

__all__ = [
    "BakeResult",
    "FollowerResult",
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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
