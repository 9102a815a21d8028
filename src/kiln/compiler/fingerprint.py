"""The environment fingerprint: every factor that decides whether a baked cache can hit.

Torch's cache keys silently fold in the torch build, Triton, CUDA, the GPU, the device index, the
whole Inductor config and some environment variables. A pod that differs in any of them
recompiles without a word. We record each factor separately (not one opaque hash) so that
``kiln check`` can *name* what differs and say whether it causes misses — ccache's "explain
yourself" standard. :func:`fingerprint` needs torch; comparing two fingerprints is torch-free
and lives in :mod:`kiln.factors`, so ``kiln merge`` can judge shards without it.
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

from kiln.envrules import CACHE_LOCATION_VARS

# Environment that changes compiled code or cache keys. Cache *locations* are excluded on
# purpose: the restored cache lives at another path by design.
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_", "PYTORCH_")
_ENV_EXACT = ("CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST", "CUDA_LAUNCH_BLOCKING")
_ENV_IGNORED = CACHE_LOCATION_VARS | frozenset(
    {
        "TORCHINDUCTOR_COMPILE_THREADS",  # parallelism, not output
        "TORCHINDUCTOR_WORKER_START",
        "PYTORCH_CUDA_ALLOC_CONF",
        "TORCH_COMPILE_DEBUG_DIR",
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES",  # reported separately: it disables every hit
    }
)


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(env.items())
        if (k.startswith(_ENV_PREFIXES) or k in _ENV_EXACT)
        and k not in _ENV_IGNORED
        # Tool locations (torch sets TRITON_PTXAS_PATH itself when it first compiles).
        and not (k.startswith("TRITON_") and k.endswith("_PATH"))
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def fingerprint(
    device: str = "cpu", *, device_index: int = 0, keys: bool = True, lean: bool = False
) -> dict[str, Any]:
    """This process's fingerprint for ``device`` ("cpu" or "cuda").

    ``keys`` also computes torch's and Triton's source hashes (a few seconds: torch hashes its
    own source tree), which catch rebuilt wheels that keep their version string. ``lean``
    leaves out what needs Inductor or Triton (their configs, keys and the vector ISA Inductor
    picks by compiling test programs): the factors of ``compile.route: aoti``, whose served
    process imports neither (kiln.factors.AOTI_KEY_FACTORS).
    """
    import torch

    fp: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "torch.version": torch.__version__,
        "torch.git": torch.version.git_version,
        "torch.cuda": torch.version.cuda,
        "flags.deterministic": torch.are_deterministic_algorithms_enabled(),
        "flags.matmul_precision": torch.get_float32_matmul_precision(),
        "flags.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "device.type": device,
        "device.index": device_index if device == "cuda" else None,
        "cpu.model": _cpu_model(),
        # The widest vector ISA this CPU and torch build use (no compiler run): AOTInductor's
        # C++ kernels are built for the bake machine's.
        "cpu.capability": torch.backends.cpu.get_cpu_capability(),
    }
    if lean:
        fp.update(_gpu(torch, device, device_index))
        return json.loads(json.dumps(fp, default=repr))
    from torch._inductor import config as inductor_config

    try:
        import triton

        fp["triton.version"] = triton.__version__
    except ImportError:
        fp["triton.version"] = None
    if device == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        fp["cpu.isa"] = str(pick_vec_isa()) or "none"
        fp["cpp.paths"] = _cpp_paths()
    fp.update(_gpu(torch, device, device_index))
    if keys:
        from torch._inductor.codecache import torch_key

        fp["torch.key"] = torch_key().hex()
        if device == "cuda" and fp["triton.version"]:
            try:
                from torch._inductor.runtime.triton_compat import triton_key

                fp["triton.key"] = triton_key()
            except Exception:
                fp["triton.key"] = None
    fp["inductor"] = {
        k: _jsonable(v) for k, v in sorted(inductor_config.save_config_portable().items())
    }
    fp["env"] = relevant_env()
    # Through JSON once, so a live fingerprint compares equal to one read from a manifest
    # (tuples become lists, odd objects their repr).
    return json.loads(json.dumps(fp, default=repr))


def _cpp_paths() -> str | None:
    """The compiler and the folders (``-I``, ``-L``) of the command Inductor builds C++ kernels
    with, from torch's own builder: the command is in each kernel's key, and its folders are
    where this Python and torch are installed. A server in another virtualenv or Python install
    hits every FX graph yet builds every C++ kernel again (seen: a venv of the system's Python
    beside the bake's pyenv one)."""
    try:
        from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions

        command = CppBuilder(
            name="kiln", sources="kiln.cpp", BuildOption=CppTorchOptions(), output_dir="/"
        ).get_command_line()
    except Exception:  # no compiler here, or torch moved the builder: not recorded
        return None
    words = command.split()
    return " ".join(words[:1] + [w for w in words if w.startswith(("-I", "-L"))])


def _gpu(torch: Any, device: str, device_index: int) -> dict[str, Any]:
    """The GPU's factors (none for the CPU)."""
    if device != "cuda":
        return {}
    if torch.cuda.is_available() and device_index < torch.cuda.device_count():
        props = torch.cuda.get_device_properties(device_index)
        return {
            "gpu.name": props.name,
            "gpu.capability": f"{props.major}.{props.minor}",
            "gpu.count": torch.cuda.device_count(),
            "gpu.driver": _driver_version(),
        }
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"gpu.name": None, "gpu.capability": None, "gpu.count": count}


def _driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:
        pass
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            first = fh.readline()
        parts = [p for p in first.split() if p[:1].isdigit() and "." in p]
        return parts[0] if parts else None
    except OSError:
        return None
