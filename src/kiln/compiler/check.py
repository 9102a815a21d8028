"""Check: would a baked cache hit in *this* environment? Names every factor that differs.

This is the "why did my pod recompile?" answer: torch folds the torch build, Triton, CUDA, GPU,
device index, Inductor config and some environment into its cache keys and says nothing when
they differ. We compare the manifest's fingerprint with the live one, factor by factor.
Needs torch (it fingerprints the live process) but does no GPU work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.artifact.archive import read_manifest
from kiln.artifact.manifest import Manifest
from kiln.compiler.fingerprint import Factor, compare, misses
from kiln.errors import IncompatibleError


@dataclass
class CheckReport:
    name: str
    factors: list[Factor]
    baked: dict[str, Any] = field(repr=False)
    here: dict[str, Any] = field(repr=False)

    @property
    def differing(self) -> list[Factor]:
        return [f for f in self.factors if not f.matches]

    @property
    def misses(self) -> list[Factor]:
        return misses(self.factors)

    @property
    def ok(self) -> bool:
        return not self.misses

    def miss_message(self) -> str:
        """One line naming each factor that makes caches miss, baked value against this one.

        The one wording of an incompatibility: `kiln check` exits 5 with it and
        :func:`kiln.activate` raises or warns with it, so both point at the same fix.
        """
        names = ", ".join(f"{f.name} (baked {f.baked!r}, here {f.here!r})" for f in self.misses)
        return f"{self.name}: caches will miss: {names}"

    def error(self) -> IncompatibleError:
        """:meth:`miss_message` as the exit-5 error, with this report as its JSON detail."""
        return IncompatibleError(self.miss_message(), detail=self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "factors": [f.to_dict() for f in self.factors],
            "misses": [f.name for f in self.misses],
        }


def compare_manifest(manifest: Manifest, here: dict[str, Any]) -> CheckReport:
    factors = compare(manifest.fingerprint, here)
    if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0") not in ("", "0"):
        factors.append(
            Factor(
                "env.TORCHINDUCTOR_FORCE_DISABLE_CACHES",
                None,
                os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"],
                False,
                True,
                "disables every cache: nothing can hit",
            )
        )
    return CheckReport(manifest.name, factors, manifest.fingerprint, here)


def check(target: str | Path, *, device_index: int | None = None, keys: bool = True) -> CheckReport:
    """Compare the artifact (file) or restored folder at ``target`` with this process.

    ``device_index`` is the CUDA index this process will serve on (default: the baked one, 0).
    """
    from kiln.compiler.fingerprint import fingerprint

    manifest = read_manifest(target)
    baked = manifest.fingerprint
    device = baked.get("device.type", manifest.spec.get("model", {}).get("device", "cpu"))
    index = device_index if device_index is not None else (baked.get("device.index") or 0)
    here = fingerprint(device, device_index=index, keys=keys and "torch.key" in baked)
    return compare_manifest(manifest, here)
