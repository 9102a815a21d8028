"""Property-based fuzzing of bundles and of GPU detection's parsers (issue 14).

As for artifacts (tests/test_manifest_fuzz.py): whatever a bundle file holds, reading its index
(``kiln inspect``) or restoring it either succeeds or raises one of kiln's documented errors,
never another exception or a hang, and a failed restore leaves DEST as it was. Whatever
``nvidia-smi`` or the driver's ``/proc`` files print, the parsers return only printable, bounded
names and well-formed capabilities. Derandomized and bounded like the manifest fuzzer.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.artifact.bundle import parse_index, read_head
from kiln.artifact.machine import (
    CAPABILITY,
    MAX_GPU_NAME,
    Machine,
    parse_nvidia_smi,
    parse_proc_information,
)
from kiln.artifact.restore import restore
from kiln.errors import IncompatibleError, IntegrityError, UsageError
from tests.archives import (
    CPU_FP,
    CPU_KEY,
    GPU_KEY,
    H200_FP,
    bundle_index_for,
    good_archive,
    reg,
    tree,
    variant_archive,
    write_bundle_raw,
)
from tests.conftest import hard_limit, import_scratch, limited_cli
from tests.test_manifest_fuzz import (
    _DEEP,
    FUZZ,
    _acceptable,
    json_values,
    mutated_bytes,
    odd_values,
)

# Choosing can also fail as documented: no variant for this machine (5), several or an unknown
# --variant (2).
EXPECTED = (IntegrityError, UsageError, IncompatibleError)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundle-fuzz")
    kiln.restore(good_archive(root / "old.kiln.tar.zst", {"inductor/old": b"old"}), root / "dest")
    return root


def _variants(root: Path) -> dict[str, tuple[bytes, dict[str, Any]]]:
    cpu = variant_archive(root / "cpu.kiln.tar.zst", CPU_FP).read_bytes()
    gpu = variant_archive(root / "gpu.kiln.tar.zst", H200_FP, {"inductor/g": b"gpu"}).read_bytes()
    return {"cpu": (cpu, CPU_KEY), "h200": (gpu, GPU_KEY)}


VARIANTS = _variants(import_scratch("kiln-fuzz-"))
MEMBERS = [reg(f"variants/{n}.kiln.tar.zst", d) for n, (d, _) in sorted(VARIANTS.items())]


def check_bundle(art: Path, dest: Path) -> None:
    try:
        with hard_limit(10):
            read_head(art)
    except Exception as exc:
        assert _acceptable(exc) or isinstance(exc, EXPECTED), repr(exc)
    before = tree(dest)
    try:
        with hard_limit(10):
            restore(art, dest, machine=Machine())
    except Exception as exc:
        assert _acceptable(exc) or isinstance(exc, EXPECTED), repr(exc)
        assert tree(dest) == before
    assert [p.name for p in dest.parent.iterdir() if ".kiln-" in p.name] == []


@FUZZ
@given(st.binary(max_size=4096) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_index(data: bytes) -> None:
    try:
        with hard_limit(10):
            parse_index(data)
    except Exception as exc:
        assert isinstance(exc, (IntegrityError, UsageError)), repr(exc)


VARIANT_KEYS = ["name", "path", "sha256", "size", "artifact", "device", "gpu", "capability",
                "torch", "cuda"]  # fmt: skip


@st.composite
def mutated_indexes(draw: st.DrawFn) -> dict[str, Any]:
    data = bundle_index_for(VARIANTS)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["variant", "top", "append", "drop"]))
        entries = data.get("variants")
        listed = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        if where == "variant" and listed:
            entry = listed[draw(st.integers(0, len(listed) - 1))]
            entry[draw(st.sampled_from(VARIANT_KEYS))] = draw(odd_values)
        elif where == "top":
            data[draw(st.sampled_from(["format", "kind", "variants"]))] = draw(odd_values)
        elif where == "append" and listed:
            twin = dict(listed[0])
            twin[draw(st.sampled_from(VARIANT_KEYS))] = draw(odd_values)
            entries.append(twin)
        elif where == "drop" and listed:
            listed[0].pop(draw(st.sampled_from(VARIANT_KEYS)), None)
    return data


@FUZZ
@given(mutated_indexes())
def test_mutated_index(workdir: Path, data: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        art = write_bundle_raw(Path(tmp) / "b.kiln.tar.zst", json.dumps(data).encode(), MEMBERS)
        check_bundle(art, workdir / "dest")


def _valid_bundle_tar() -> bytes:
    tmp = import_scratch("kiln-fuzz-")
    art = write_bundle_raw(tmp / "b.kiln.tar.zst", bundle_index_for(VARIANTS), MEMBERS)
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(art.read_bytes())).read()


VALID_TAR = _valid_bundle_tar()


@FUZZ
@given(mutated_bytes(VALID_TAR))
def test_mutated_bundle_bytes(workdir: Path, data: bytes) -> None:
    """Mutate the outer tar under its compression: headers, the index, the variants' bytes."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        art = Path(tmp) / "m.kiln.tar.zst"
        art.write_bytes(zstandard.ZstdCompressor().compress(data))
        check_bundle(art, workdir / "dest")


# --- what nvidia-smi and /proc print ----------------------------------------------------------

lines = st.lists(
    st.text(st.characters(exclude_categories=()), max_size=60)
    | st.sampled_from(["NVIDIA H200, 9.0", "Tesla K80, [N/A]", ", 9.0", "x, 99.99", "a,,b, 1.2",
                       "No devices were found", "Model: NVIDIA L4", "Model:", "Model: \x1b[2J"]),
    max_size=8,
).map("\n".join)  # fmt: skip


@FUZZ
@given(lines)
def test_gpu_parsers_on_any_output(text: str) -> None:
    for gpu in [*parse_nvidia_smi(text), parse_proc_information(text)]:
        if gpu is None:
            continue
        assert gpu.name and gpu.name.isprintable() and len(gpu.name) <= MAX_GPU_NAME
        assert gpu.name == " ".join(gpu.name.split())
        assert gpu.capability is None or CAPABILITY.fullmatch(gpu.capability)


# --- under hard limits, as users run it (issue 27) ----------------------------------------------

LIMITED = settings(FUZZ, max_examples=int(_DEEP or 15))  # a process per example


INSTALLED = import_scratch("kiln-fuzz-") / "installed"
kiln.restore(good_archive(INSTALLED.with_suffix(".zst"), {"inductor/old": b"old"}), INSTALLED)


def check_limited(work: Path, art: Path, *args: str) -> None:
    """``kiln restore BUNDLE`` in a child held to 1 GiB and 30 CPU seconds
    (:func:`tests.conftest.limited_cli`): a documented exit (0, 2, 3 or 5) within them, nothing
    written outside ``--dest`` (TMPDIR included), and DEST as it was unless it succeeded."""
    dest = work / "dest"
    shutil.copytree(INSTALLED, dest, symlinks=True)  # inductor/locks links to /tmp
    (work / "tmp").mkdir()
    before = {p.relative_to(work).as_posix() for p in work.rglob("*")}
    old = tree(dest)
    proc = limited_cli(
        work, "restore", art, "--dest", dest, *args, env={"TMPDIR": str(work / "tmp")}
    )
    assert proc.returncode in (0, 2, 3, 5), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    after = {p.relative_to(work).as_posix() for p in work.rglob("*")}
    outside = {p for p in after ^ before if p != "dest" and not p.startswith("dest/")}
    assert outside == set(), outside
    if proc.returncode != 0:
        assert tree(dest) == old


@LIMITED
@given(mutated_indexes(), st.sampled_from([(), ("--variant", "cpu"), ("--variant", "h200")]))
def test_any_index_restores_within_limits(data: dict[str, Any], args: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        art = write_bundle_raw(work / "b.kiln.tar.zst", json.dumps(data).encode(), MEMBERS)
        check_limited(work, art, *args)


@LIMITED
@given(mutated_bytes(VALID_TAR))
def test_any_bundle_bytes_restore_within_limits(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        art = work / "m.kiln.tar.zst"
        art.write_bytes(zstandard.ZstdCompressor().compress(data))
        check_limited(work, art)
