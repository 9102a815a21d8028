"""Which GPU this machine has, found without torch: what picks a bundle's variant at restore.

An init container restores before the server starts and usually has no torch (and must not need
a GPU context to decide), so the GPU model and compute capability come from the driver's own
tools: ``nvidia-smi --query-gpu=name,compute_cap`` where it is on PATH, else the files the driver
keeps under ``/proc/driver/nvidia/gpus/*/information`` (a container sees them whether or not the
NVIDIA runtime put ``nvidia-smi`` in it; they name the model, not the capability). Whatever these
print is parsed defensively: read only as far as the parsers look (a tool that prints more is
stopped there), only printable names, a capability only when it looks like one. Torch-free,
and it imports nothing of kiln's but the name rules.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NVIDIA_SMI = "nvidia-smi"
SMI_ARGS = ("--query-gpu=name,compute_cap", "--format=csv,noheader")
SMI_TIMEOUT = 15.0  # seconds: a wedged driver can hang nvidia-smi; restore must still decide
MAX_OUTPUT = 64 << 10  # bytes of nvidia-smi output or of one information file that are read
MAX_GPUS = 64
MAX_GPU_NAME = 128  # characters; real names are ~30 ("NVIDIA H100 80GB HBM3")
PROC_GPUS = Path("driver/nvidia/gpus")  # under the /proc root
CAPABILITY = re.compile(r"[0-9]{1,2}\.[0-9]{1,2}")
# What nvidia-smi prints (exit 6) on a machine with the driver but no GPU: an answer, not a failure.
NO_DEVICES = "No devices were found"


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: str | None  # "9.0"; None where only /proc was readable


@dataclass(frozen=True)
class Machine:
    """This machine as bundle selection sees it: its GPUs (none: a CPU machine) and how they
    were found, so a choice, or a refusal, can say why."""

    gpus: tuple[Gpu, ...] = ()
    source: str = "none"  # "nvidia-smi" | "/proc" | "none"
    notes: tuple[str, ...] = field(default=())  # what was tried and failed, for messages

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def gpu(self) -> Gpu | None:
        """The GPU a server uses by default (cuda:0), which bakes compile for."""
        return self.gpus[0] if self.gpus else None

    def describe(self) -> str:
        """One phrase for messages: ``GPU 'NVIDIA H200' (capability 9.0, from nvidia-smi)``."""
        gpu = self.gpu
        if gpu is None:
            why = f" ({'; '.join(self.notes)})" if self.notes else ""
            return f"no GPU{why}"
        cap = f"capability {gpu.capability}" if gpu.capability else "capability unknown"
        more = f", {len(self.gpus)} GPUs" if len(self.gpus) > 1 else ""
        return f"GPU {gpu.name!r} ({cap}, from {self.source}{more})"

    def summary(self) -> dict[str, Any]:
        gpu = self.gpu
        return {
            "device": self.device,
            "gpu": gpu.name if gpu else None,
            "capability": gpu.capability if gpu else None,
            "gpus": len(self.gpus),
            "source": self.source,
            "notes": list(self.notes),
        }


def clean_name(text: str) -> str | None:
    """A GPU name as reported, or None when it is not one: printable, bounded, spaces folded."""
    name = " ".join(text.split())
    if not name or len(name) > MAX_GPU_NAME or not name.isprintable():
        return None
    return name


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """The GPUs in ``nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader`` output.

    One line per GPU, ``NAME, CAPABILITY``; the name may itself hold commas (none do today), so
    the capability is what follows the last one. Lines that do not parse are skipped; a
    capability that does not look like ``M.m`` (``[N/A]``, an old driver's error) is None.
    """
    gpus: list[Gpu] = []
    for line in text[:MAX_OUTPUT].splitlines():
        head, sep, tail = line.rpartition(",")
        name = clean_name(head if sep else tail)
        if name is None:
            continue
        cap = tail.strip() if sep else ""
        gpus.append(Gpu(name, cap if CAPABILITY.fullmatch(cap) else None))
        if len(gpus) >= MAX_GPUS:
            break
    return gpus


def parse_proc_information(text: str) -> Gpu | None:
    """The GPU in one ``/proc/driver/nvidia/gpus/BUS/information`` file (its ``Model:`` line)."""
    for line in text[:MAX_OUTPUT].splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Model":
            name = clean_name(value)
            return Gpu(name, None) if name else None
    return None


def _run_bounded(argv: list[str], timeout: float) -> tuple[int | None, bytes, bytes]:
    """Run ``argv``; (its exit status, stdout, stderr), each stream read up to
    :data:`MAX_OUTPUT` bytes (what the parsers look at) and no further: a tool that prints more
    is stopped there (status None), so whatever it prints costs 128 KiB of memory at most.
    :class:`subprocess.TimeoutExpired` past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LC_ALL": "C"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    got = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    stopped = False
    try:
        with selectors.DefaultSelector() as selector:
            for fd in got:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in selector.select(left):
                    fd = key.fd
                    chunk = os.read(fd, min(1 << 15, MAX_OUTPUT - len(got[fd])))
                    got[fd] += chunk
                    if chunk and len(got[fd]) < MAX_OUTPUT:
                        continue
                    selector.unregister(fd)
                    if chunk and not stopped:  # full: the rest is never read, nor waited for
                        stopped = True
                        proc.kill()
        status = proc.wait(max(deadline - time.monotonic(), 0.01))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    out, err = got.values()
    return (None if stopped else status), bytes(out), bytes(err)


def _from_smi(timeout: float) -> tuple[list[Gpu] | None, str | None]:
    """(GPUs, None) when nvidia-smi answered (an empty list: it found none), else (None, why)."""
    exe = shutil.which(NVIDIA_SMI)
    if exe is None:
        return None, f"{NVIDIA_SMI} not on PATH"
    try:
        status, stdout, stderr = _run_bounded([exe, *SMI_ARGS], timeout)
    except subprocess.TimeoutExpired:
        return None, f"{NVIDIA_SMI} did not answer within {timeout:g} s"
    except OSError as exc:
        return None, f"{NVIDIA_SMI}: {exc.strerror}"
    out = stdout.decode("utf-8", "replace")
    err = stderr.decode("utf-8", "replace")
    if NO_DEVICES in out or NO_DEVICES in err:
        return [], None
    # Stopped for printing more than the parser reads: what it printed first is its answer.
    gpus = parse_nvidia_smi(out) if status in (0, None) else []
    if gpus:
        return gpus, None
    first = (err.strip() or out.strip()).splitlines()[:1]
    said = f": {first[0][:120]!r}" if first else ""
    how = f"exit {status}" if status is not None else f"stopped after {MAX_OUTPUT} bytes"
    return None, f"{NVIDIA_SMI} failed ({how}){said}"


def _from_proc(proc_root: Path) -> tuple[list[Gpu], str | None]:
    folder = proc_root / PROC_GPUS
    try:
        # Sorted by PCI bus id, which is the order nvidia-smi and CUDA (by default) list them.
        entries = sorted(entry.name for entry in folder.iterdir())[:MAX_GPUS]
    except OSError:
        return [], f"no {folder}"
    gpus: list[Gpu] = []
    for entry in entries:
        try:
            with open(folder / entry / "information", "rb") as fh:
                text = fh.read(MAX_OUTPUT).decode("utf-8", "replace")
        except OSError:
            continue
        gpu = parse_proc_information(text)
        if gpu is not None:
            gpus.append(gpu)
    return gpus, (None if gpus else f"no GPU in {folder}")


def detect(*, proc_root: str | Path = "/proc", timeout: float = SMI_TIMEOUT) -> Machine:
    """This machine's GPUs: nvidia-smi first (it knows the capability), then ``/proc``.

    ``proc_root`` is where procfs is read (tests pass a folder shaped like it). nvidia-smi's
    "No devices were found" is taken at its word: a CPU machine.
    """
    gpus, smi_note = _from_smi(timeout)
    if gpus:
        return Machine(tuple(gpus), NVIDIA_SMI)
    if gpus is not None:  # the driver's own tool says there is none
        return Machine((), "none", (f"{NVIDIA_SMI}: {NO_DEVICES}",))
    found, proc_note = _from_proc(Path(proc_root))
    notes = tuple(n for n in (smi_note, proc_note) if n)
    return Machine(tuple(found), "/proc" if found else "none", notes)
