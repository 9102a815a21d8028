"""GPU detection without torch (kiln.artifact.machine): a real ``nvidia-smi`` stand-in on PATH,
a folder shaped like ``/proc``, and the outputs an H200 machine really printed (2026-12, driver
580.159.04): what ``kiln restore`` of a bundle decides by."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from kiln.artifact.machine import Gpu, Machine, detect, parse_nvidia_smi, parse_proc_information

# Captured on the H200 machine: `nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader`
# and /proc/driver/nvidia/gpus/0000:00:06.0/information (tabs as the driver writes them).
H200_SMI = "NVIDIA H200, 9.0\n"
H200_PROC = (
    "Model: \t\t NVIDIA H200\nIRQ:   \t\t 41\n"
    "GPU UUID: \t GPU-fb0b1295-3c28-78ca-7a43-a875a1f6b5f8\n"
    "Video BIOS: \t 96.00.a5.00.1a\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
    "DMA Mask: \t 0xfffffffffffff\nBus Location: \t 0000:00:06.0\nDevice Minor: \t 0\n"
    "GPU Firmware: \t 580.159.04\nGPU Excluded:\t No\n"
)


def fake_smi(bindir: Path, script: str) -> Path:
    """An executable ``nvidia-smi`` in ``bindir`` running ``script`` (sh)."""
    bindir.mkdir(parents=True, exist_ok=True)
    exe = bindir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + script + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bindir


def printing(text: str, code: int = 0) -> str:
    return f"/bin/cat <<'EOF'\n{text}EOF\nexit {code}"


def fake_proc(root: Path, *gpus: str) -> Path:
    for i, info in enumerate(gpus):
        folder = root / "driver/nvidia/gpus" / f"0000:00:0{6 + i}.0"
        folder.mkdir(parents=True)
        (folder / "information").write_text(info)
    return root


@pytest.fixture
def path_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH holds only a folder of our own: no real nvidia-smi can answer instead of ours."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    return bindir


def test_nvidia_smi_output_from_an_h200(path_only: Path, tmp_path: Path) -> None:
    fake_smi(path_only, printing(H200_SMI))
    machine = detect(proc_root=fake_proc(tmp_path / "proc", H200_PROC.replace("H200", "X")))
    assert machine == Machine((Gpu("NVIDIA H200", "9.0"),), "nvidia-smi")
    assert machine.device == "cuda"
    assert "capability 9.0, from nvidia-smi" in machine.describe()


def test_proc_when_nvidia_smi_is_missing(path_only: Path, tmp_path: Path) -> None:
    """An init container without the NVIDIA runtime's tools still sees the driver's /proc files:
    the model, not the capability."""
    machine = detect(proc_root=fake_proc(tmp_path / "proc", H200_PROC, H200_PROC))
    assert machine.gpus == (Gpu("NVIDIA H200", None), Gpu("NVIDIA H200", None))
    assert machine.source == "/proc"
    assert "nvidia-smi not on PATH" in machine.notes
    assert "capability unknown" in machine.describe() and "2 GPUs" in machine.describe()


def test_proc_when_nvidia_smi_fails(path_only: Path, tmp_path: Path) -> None:
    fake_smi(
        path_only,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\n'
        "exit 9",
    )
    machine = detect(proc_root=fake_proc(tmp_path / "proc", H200_PROC))
    assert machine.gpus == (Gpu("NVIDIA H200", None),) and machine.source == "/proc"
    assert any("exit 9" in note and "communicate" in note for note in machine.notes)


def test_no_devices_is_a_cpu_machine(path_only: Path, tmp_path: Path) -> None:
    """nvidia-smi's own "No devices were found" (exit 6) is an answer: /proc is not asked."""
    fake_smi(path_only, printing("No devices were found\n", 6))
    machine = detect(proc_root=fake_proc(tmp_path / "proc", H200_PROC))
    assert machine.device == "cpu" and machine.gpus == ()


def test_nothing_at_all_is_a_cpu_machine(path_only: Path, tmp_path: Path) -> None:
    machine = detect(proc_root=tmp_path / "empty")
    assert machine.device == "cpu" and machine.source == "none"
    assert machine.describe().startswith("no GPU (nvidia-smi not on PATH; no ")


def test_a_hung_nvidia_smi_is_cut_off(path_only: Path, tmp_path: Path) -> None:
    """A wedged driver can hang nvidia-smi: restore falls back instead of waiting forever."""
    fake_smi(path_only, "exec /bin/sleep 30")
    t0 = time.monotonic()
    machine = detect(proc_root=fake_proc(tmp_path / "proc", H200_PROC), timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert machine.gpus == (Gpu("NVIDIA H200", None),)
    assert any("did not answer" in note for note in machine.notes)


def test_parsers_on_odd_output() -> None:
    assert parse_nvidia_smi("NVIDIA H100 80GB HBM3, 9.0\nNVIDIA A100-SXM4-80GB, 8.0\n") == [
        Gpu("NVIDIA H100 80GB HBM3", "9.0"),
        Gpu("NVIDIA A100-SXM4-80GB", "8.0"),
    ]
    assert parse_nvidia_smi("Tesla K80, [N/A]\n") == [Gpu("Tesla K80", None)]
    assert parse_nvidia_smi("A, weird name, 12.0\n") == [Gpu("A, weird name", "12.0")]
    assert parse_nvidia_smi("\x1b[2J, 9.0\n, 9.0\n" + "x" * 500 + ", 9.0\n") == []
    assert parse_proc_information("IRQ: 41\n") is None
    assert parse_proc_information("Model:  \tNVIDIA  L4 \n") == Gpu("NVIDIA L4", None)


def test_detect_is_torch_free() -> None:
    """The module is imported by restore in slim images: nothing of torch's."""
    import subprocess
    import sys

    from tests.conftest import NO_TORCH

    code = NO_TORCH + "import kiln.artifact.machine as m; print(m.detect(proc_root='/nope').device)"
    env = {**os.environ, "PATH": "/nonexistent"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu"


@pytest.mark.parametrize(
    "script",
    [
        "exec /bin/cat /dev/zero",  # stdout without end
        "exec /bin/cat /dev/zero >&2",  # stderr without end
        "printf 'NVIDIA H200, 9.0\\n'; exec /bin/cat /dev/zero",  # an answer, then no end
    ],
)
def test_an_endless_nvidia_smi_is_read_only_as_far_as_the_parser_reads(
    tmp_path: Path, script: str
) -> None:
    """Issue 27, item 4: an nvidia-smi writing /dev/zero drove restore to 10 GB of memory. Run
    in a child limited to 256 MiB of address space: detection must end, within its timeout."""
    import resource
    import subprocess
    import sys

    bindir = fake_smi(tmp_path / "bin", script)
    code = (
        "from kiln.artifact.machine import detect; "
        f"print(detect(proc_root={str(tmp_path / 'proc')!r}, timeout=10).describe())"
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (256 << 20, 256 << 20))

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PATH": str(bindir)},
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 10  # it stops reading; it does not wait for the timeout
    said = proc.stdout.strip()
    if "H200" in script:
        assert said == "GPU 'NVIDIA H200' (capability 9.0, from nvidia-smi)"
    else:
        assert said.startswith("no GPU (nvidia-smi failed"), said
