"""Comparing two environment fingerprints factor by factor, and naming what differs. Torch-free.

A fingerprint (:func:`kiln.compiler.fingerprint.fingerprint`, which needs torch) records every
factor torch folds into its cache keys, separately, so that a difference can be *named*. The
judgement of two of them lives here, apart from the collecting, because the torch-free world
needs it too: ``kiln check`` compares a manifest with this process, ``kiln merge`` compares
shards' manifests with each other, with the same words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Factors torch folds into its cache keys: a difference means misses.
KEY_FACTORS = (
    "torch.version",
    "torch.git",
    "torch.key",
    "torch.cuda",
    "triton.version",
    "triton.key",
    "gpu.name",
    "gpu.capability",
    "device.index",
    "cpu.isa",
    "cpp.paths",
    "flags.deterministic",
    "flags.matmul_precision",
    "flags.allow_tf32",
)
# The torch build, which torch/version.py names without importing torch
# (:func:`kiln.installs.torch_build`): what a served process checks before it imports torch
# from an artifact's bytecode (kiln.bytecode).
BUILD_FACTORS = ("torch.version", "torch.git", "torch.cuda")
# Factors that do not enter the keys but explain other trouble.
INFO_FACTORS = ("python", "platform", "gpu.driver", "cpu.model", "gpu.count")
# compile.route: aoti serves compiled libraries, with no cache keys and no compiler: what must
# match is what the library was built against and for. The rest (Triton, Inductor's config,
# the compile-time environment, the float32 flags, already folded into the kernels) is noted.
AOTI_KEY_FACTORS = (
    "torch.version",
    "torch.git",
    "torch.cuda",
    "gpu.capability",
    "cpu.capability",
    "platform",
)
AOTI_INFO_FACTORS = (
    "python",
    "gpu.name",
    "gpu.driver",
    "cpu.model",
    "gpu.count",
    "device.index",
    "triton.version",
    "flags.deterministic",
    "flags.matmul_precision",
    "flags.allow_tf32",
)


BAKED_HERE = ("baked", "here")


@dataclass(frozen=True)
class Factor:
    name: str
    baked: Any
    here: Any
    matches: bool
    causes_miss: bool
    note: str = ""
    # What ``baked`` and ``here`` are, as a message names them: the artifact's value and this
    # process's, unless the factor compares other things (where DIR's caches are, against where
    # this process looks: kiln.compiler.location).
    sides: tuple[str, str] = BAKED_HERE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def described(self) -> str:
        """The factor and both its values, as one part of a message: ``name (baked 'x', here
        'y')``."""
        return f"{self.name} ({self.sides[0]} {self.baked!r}, {self.sides[1]} {self.here!r})"


_NOTES = {
    "torch.version": "torch version is in every cache key",
    "torch.git": "a different torch build: every key changes",
    "torch.key": "torch's source hash differs (rebuilt or patched torch): every key changes",
    "torch.cuda": "CUDA runtime of the torch build is in the FX graph key",
    "triton.version": "Triton version is in the kernel and FX graph keys",
    "triton.key": "Triton's source hash differs: kernels recompile",
    "gpu.name": "the GPU model is in the FX graph key: bake on the serving GPU",
    "gpu.capability": "kernels are compiled for one compute capability",
    "device.index": "the device index (cuda:N) is in the input metadata of the FX key: "
    "bake on cuda:0 and serve with one visible GPU per process",
    "cpu.isa": "C++ kernels are built for the picked vector ISA",
    "cpp.paths": "C++ kernels are keyed by their build command, which names where Python and "
    "torch are installed: serve from the same install paths as the bake (same image or venv), "
    "and check with the server's interpreter (python -m kiln check)",
    "flags.deterministic": "deterministic-algorithms flag is in the FX key",
    "flags.matmul_precision": "float32 matmul precision is in the FX key",
    "flags.allow_tf32": "TF32 setting is in the FX key",
    "python": "harmless if the torch build matches (a new Python usually means a new wheel)",
    "gpu.driver": "not in torch's keys; newer drivers load older cubins",
    "cpu.capability": "AOTInductor's C++ kernels are built for the bake CPU's vector ISA",
}
_AOTI_NOTES = {
    "torch.version": "the packages' libraries are built against this torch's C++ ABI",
    "torch.git": "a different torch build: the packages' libraries may not load",
    "torch.cuda": "the packages' kernels are built for this CUDA runtime",
    "gpu.capability": "the packages' kernels are compiled for one compute capability",
    "platform": "the packages are native libraries for one OS and architecture",
}


def compare(baked: dict[str, Any], here: dict[str, Any], route: str = "compile") -> list[Factor]:
    """Factor-by-factor comparison; only factors present in both sides are judged. ``route``
    is the artifact's ``compile.route``: ``aoti`` judges :data:`AOTI_KEY_FACTORS` only."""
    if route == "aoti":
        return _compare_aoti(baked, here)
    factors = _judge(baked, here, KEY_FACTORS, INFO_FACTORS, lambda name: _NOTES.get(name, ""))
    b_ind, h_ind = baked.get("inductor", {}), here.get("inductor", {})
    for key in sorted(set(b_ind) | set(h_ind)):
        if b_ind.get(key) != h_ind.get(key) and key in b_ind and key in h_ind:
            factors.append(
                Factor(
                    f"inductor.{key}",
                    b_ind.get(key),
                    h_ind.get(key),
                    False,
                    True,
                    "the whole Inductor config is in the FX graph key",
                )
            )
    b_env, h_env = baked.get("env", {}), here.get("env", {})
    for key in sorted(set(b_env) | set(h_env)):
        if b_env.get(key) != h_env.get(key):
            # Env vars act through Inductor/Dynamo config or cache tags: assume they matter.
            factors.append(
                Factor(
                    f"env.{key}",
                    b_env.get(key),
                    h_env.get(key),
                    False,
                    _env_causes_miss(key),
                    "compile-time environment differs",
                )
            )
    return factors


def _compare_aoti(baked: dict[str, Any], here: dict[str, Any]) -> list[Factor]:
    return _judge(
        baked,
        here,
        AOTI_KEY_FACTORS,
        AOTI_INFO_FACTORS,
        lambda name: (
            (_AOTI_NOTES.get(name) or _NOTES.get(name, "")) if name in AOTI_KEY_FACTORS else ""
        ),
    )


def _judge(
    baked: dict[str, Any],
    here: dict[str, Any],
    keys: Sequence[str],
    infos: Sequence[str],
    note: Callable[[str], str],
) -> list[Factor]:
    """The named factors present on either side: a difference in one of ``keys`` misses."""
    factors: list[Factor] = []
    for name in (*keys, *infos):
        if name not in baked and name not in here:
            continue
        b, h = baked.get(name), here.get(name)
        if name not in baked or name not in here:
            # One side did not record it (e.g. keys=False): say so, never guess a match.
            factors.append(Factor(name, b, h, True, False, "not recorded on one side"))
            continue
        same = b == h
        factors.append(Factor(name, b, h, same, (not same) and name in keys, note(name)))
    return factors


def _env_causes_miss(key: str) -> bool:
    # CUDA_VISIBLE_DEVICES only renumbers GPUs; what counts is the index, judged as device.index.
    return key.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_"))


def misses(factors: list[Factor]) -> list[Factor]:
    return [f for f in factors if f.causes_miss]
