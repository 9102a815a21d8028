"""Multi-rank (tensor-parallel) models: K grid workers under torch's own launcher, one per rank.

A spec with ``distributed: {world_size: K, backend: …}`` compiles in K processes that build
their shard of the model and talk through collectives in forward, so every rank compiles its own
graphs and needs its own cache. kiln does not manage those processes: it starts
``python -m torch.distributed.run --standalone --nproc-per-node K -m kiln.compiler.worker …``
(torchrun: a free port, the rendezvous, the exit codes, SIGTERM forwarded to every rank), and
each rank's worker reads ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` as torchrun sets them.

The layout rule that makes this a few lines in bake, verify and bench: what a 1-rank pass keeps
at ``FOLDER/NAME`` (``inductor``, ``megacache.bin``, ``precompiled.bin``, ``triton-home``),
rank R keeps at ``FOLDER/ranks/R/NAME`` (:class:`kiln.layout.CacheLayout`), in the work folder, in
the artifact and in a restored folder alike. :func:`rank_requests` rewrites a 1-rank request
into K such requests; the per-rank environment (its ``TORCHINDUCTOR_CACHE_DIR``) travels in the
request, since torchrun gives every rank the same environment.

This module is torch-free at import; the worker-side helpers import torch when called.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.compiler.protocol import WorkerRequest
from kiln.layout import CacheLayout
from kiln.serving import location_env
from kiln.spec import RANK_KWARGS, Spec

RANK_PLACEHOLDER = "{rank}"  # in the worker's argv: each rank reads its own request file
# Request fields and environment variables that name a place in a pass's folder layout.
_PATH_FIELDS = (
    "cache_root",
    "megacache_save",
    "megacache_load",
    "precompile_save",
    "precompile_load",
)
_PATH_VARS = tuple(location_env(CacheLayout()))
# What torch's launchers set in their workers. kiln's own launch sets them afresh; inherited
# ones (kiln run inside someone else's launch) would point a rank at the outer rendezvous.
LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


# --- the parent's side (torch-free) ------------------------------------------------------
def in_rank_folder(path: str | Path, rank: int) -> str:
    """``FOLDER/NAME`` as rank ``rank`` keeps it: ``FOLDER/ranks/RANK/NAME``."""
    p = Path(path)
    return str(CacheLayout(p.parent, rank).dir / p.name)


def rank_requests(
    request: WorkerRequest, env: Mapping[str, str], world_size: int
) -> list[WorkerRequest]:
    """One request per rank: its paths in its rank folder, its device ``cuda:RANK``, and its
    environment (the cache variables moved the same way) to set before torch is imported."""
    out: list[WorkerRequest] = []
    for rank in range(world_size):
        moved: dict[str, Any] = {
            name: in_rank_folder(getattr(request, name), rank)
            for name in _PATH_FIELDS
            if getattr(request, name)
        }
        if request.aoti_build is not None:  # each rank builds its own shard's packages
            folder = in_rank_folder(request.aoti_build.folder, rank)
            moved["aoti_build"] = request.aoti_build.model_copy(update={"folder": folder})
        rank_env = {k: in_rank_folder(v, rank) for k, v in env.items() if k in _PATH_VARS}
        for value in rank_env.values():
            Path(value).mkdir(parents=True, exist_ok=True)
        # One machine (--standalone): the local rank is the rank, and cuda:LOCAL_RANK its GPU.
        out.append(request.replace(**moved, env=rank_env, device_index=rank))
    return out


def launch_command(world_size: int, worker_args: list[str]) -> list[str]:
    """torchrun starting ``world_size`` grid workers on this machine, on a free port.

    ``--standalone`` picks the port and a fresh rendezvous id; ``--max-restarts 0`` because a
    compile that failed once fails again; ``--monitor-interval`` short so a failed rank stops
    the others within a fraction of a second.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.2",
        "-m",
        "kiln.compiler.worker",
        *worker_args,
    ]


def launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without an outer launch's rank variables: kiln's torchrun sets its own."""
    return {k: v for k, v in env.items() if k not in LAUNCH_VARS}


# --- a rank's own side (in the worker; torch imported when called) ------------------------
@dataclass(frozen=True)
class Rank:
    """This process's place in a launch, as the launcher's environment says."""

    rank: int
    local_rank: int
    world_size: int


def current(environ: Mapping[str, str] | None = None) -> Rank | None:
    """The rank torchrun gave this process; None outside a launch (a 1-rank worker)."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    rank = int(environ["RANK"])
    local = int(environ.get("LOCAL_RANK", rank))
    return Rank(rank=rank, local_rank=local, world_size=int(environ["WORLD_SIZE"]))


def worker_args(args: list[str], rank: Rank | None) -> list[str]:
    """The worker's argv with ``{rank}`` replaced: each rank reads and writes its own files."""
    value = str(rank.rank if rank else 0)
    return [a.replace(RANK_PLACEHOLDER, value) for a in args]


def relays_events(rank: Rank | None) -> bool:
    """Whether this process writes progress events: all ranks run the same grid in the same
    order, so rank 0's are everyone's (K copies of each line would only be noise)."""
    return rank is None or rank.rank == 0


def join(spec: Spec, rank: Rank | None, device: Any) -> bool:
    """Join the launch's process group before the factory runs (it may build its shard with
    collectives); True when this process joined one. A spec without ``distributed`` never
    joins, whatever the environment."""
    if spec.distributed is None or rank is None:
        return False
    import torch.distributed as dist

    if spec.distributed.world_size != rank.world_size:
        raise ValueError(
            f"the launch has WORLD_SIZE={rank.world_size}, the spec "
            f"distributed.world_size={spec.distributed.world_size}"
        )
    device_id = device if device.type == "cuda" else None
    prefix = os.environ.get("KILN_LAUNCH_PREFIX")  # kiln.compiler.user_launch: a user's launch
    if prefix is None:
        dist.init_process_group(spec.distributed.backend, device_id=device_id)
        return True
    # The launch's store outlives this worker: every pass of a bake forms its group under a
    # prefix of its own, or it would read the addresses an earlier pass's ranks left there.
    # Hosted as torch's env:// does: by the launcher's agent, else by rank 0.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        rank.world_size,
        is_master=rank.rank == 0 and not agent,
        multi_tenant=True,
    )
    dist.init_process_group(
        spec.distributed.backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank.rank,
        world_size=rank.world_size,
        device_id=device_id,
    )
    return True


def leave(joined: bool) -> None:
    """Wait for every rank, then leave the group: no rank tears down while another still
    talks to it (gloo would report the peer gone)."""
    if not joined:
        return
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def factory_kwargs(spec: Spec, factory: Any, rank: Rank | None) -> tuple[dict[str, Any], str]:
    """The keyword arguments a distributed spec's factory gets on top of ``model.kwargs``
    (``rank=``, ``world_size=``), or why it cannot take them. 1-rank specs: none."""
    if spec.distributed is None:
        return {}, ""
    extra = {"rank": rank.rank if rank else 0, "world_size": spec.distributed.world_size}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return extra, ""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return extra, ""
    lacking = [k for k in RANK_KWARGS if k not in params]
    if lacking:
        names = " and ".join(f"{k}=" for k in lacking)
        return extra, (
            f"a distributed spec's factory takes rank= and world_size= (to build its shard); "
            f"{spec.model.factory} has no {names}"
        )
    return extra, ""
