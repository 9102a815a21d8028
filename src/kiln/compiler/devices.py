"""A worker's device: the spec's, made current, its process group joined for a distributed
spec, and what makes a timed call wait for it. A device this process cannot use is the spec's
problem at its key (:class:`~kiln.compiler.failures.SpecProblem`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kiln.compiler import ranks
from kiln.compiler.failures import SpecProblem
from kiln.compiler.ranks import Rank
from kiln.spec import Spec


def setup_device(spec: Spec, index: int) -> Any:
    """The spec's device (``cuda`` means ``cuda:INDEX``), made current; a GPU torch cannot see
    is the spec's problem at ``model.device``, said with what torch was built with."""
    import torch

    device = torch.device(spec.model.device, index if spec.model.device == "cuda" else None)
    if device.type != "cuda":
        return device
    if spec.distributed and torch.cuda.is_available() and index >= torch.cuda.device_count():
        raise SpecProblem(
            "distributed.world_size",
            f"rank {index} needs cuda:{index}, but torch sees {torch.cuda.device_count()} GPU(s)",
        )
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"
        raise SpecProblem(
            "model.device",
            f"device: cuda, but torch sees no CUDA device here (torch {torch.__version__} "
            f"with {build}{hidden})",
        )
    torch.cuda.set_device(device)
    return device


def join_group(spec: Spec, device: Any, launched: Rank | None) -> bool:
    """Join the launch's process group (distributed specs); a world size the launch does not
    have is the spec's problem."""
    try:
        return ranks.join(spec, launched, device)
    except ValueError as exc:
        raise SpecProblem("distributed.world_size", str(exc)) from exc


def synchronizer(device: Any) -> Callable[[], None]:
    """What makes a timed call end when the device is done, not when the launch returns."""
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
