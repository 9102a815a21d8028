"""Property-based fuzzing of the manifest and archive reader (``kiln inspect``, ``kiln restore``).

Whatever bytes an archive holds, reading it either succeeds or raises one of kiln's documented
errors: never another exception (exit 1, a traceback), never a hang, and a failed restore leaves
DEST as it was. A manifest that parses must also render as ``kiln inspect`` shows it.
Derandomized and bounded, so the file runs the same cases in well under 30 s; for a deeper,
random search run it with ``KILN_FUZZ_EXAMPLES=5000``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

import kiln
from kiln.artifact.archive import parse_manifest
from kiln.artifact.manifest import Manifest
from kiln.cli.render import manifest_view
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError
from tests.archives import FILES, good_archive, manifest_for, reg, tree, write_archive
from tests.conftest import hard_limit

EXPECTED = (IntegrityError, UsageError, NotFoundError)
_DEEP = os.environ.get("KILN_FUZZ_EXAMPLES")
FUZZ = settings(
    max_examples=int(_DEEP or 120),
    deadline=None,  # wall time is bounded by _no_hang instead: a loaded 2-core box is slow
    derandomize=not _DEEP,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _acceptable(exc: BaseException) -> bool:
    if isinstance(exc, EXPECTED):
        return True
    # Sizes up to the 1 TiB bound are plausible; more than the test disk holds is the documented
    # "not enough free space; nothing was changed" (exit 1, like any full disk), not a crash.
    return type(exc) is KilnError and "not enough free space" in exc.message


def _render(manifest: Manifest) -> None:
    """What ``kiln inspect`` prints: must not fail on anything the model accepted."""
    manifest_view(Console(file=io.StringIO(), width=120, emoji=False), manifest)


def check_parse(data: bytes) -> None:
    try:
        with hard_limit(10):
            manifest = parse_manifest(data)
    except Exception as exc:  # the property: which exceptions escape
        assert isinstance(exc, (IntegrityError, UsageError)), repr(exc)
        return
    _render(manifest)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One installed DEST per module (function-scoped fixtures do not mix with @given)."""
    root = tmp_path_factory.mktemp("fuzz")
    kiln.restore(good_archive(root / "old.kiln.tar.zst", {"inductor/old": b"old"}), root / "dest")
    return root


def check_archive(art: Path, dest: Path) -> None:
    """read_manifest and restore of ``art``: success or a documented error, DEST intact."""
    try:
        with hard_limit(10):
            manifest = kiln.read_manifest(art)
    except Exception as exc:
        assert _acceptable(exc), repr(exc)
    else:
        _render(manifest)
    before = tree(dest)
    try:
        with hard_limit(10):
            kiln.restore(art, dest)
    except Exception as exc:
        assert _acceptable(exc), repr(exc)
        assert tree(dest) == before
    assert [p.name for p in dest.parent.iterdir() if ".kiln-" in p.name] == []


# --- manifest.json alone ------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_as_manifest(data: bytes) -> None:
    check_parse(data)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(st.characters(exclude_categories=()), max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=24,
)


@FUZZ
@given(json_values)
def test_arbitrary_json_as_manifest(value: Any) -> None:
    check_parse(json.dumps(value).encode())


# --- mutated valid manifests, in an archive, through read_manifest and restore ------------------

odd_text = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=40),  # any code point, surrogates too
    st.sampled_from(
        [
            "..",
            ".",
            "",
            "/",
            "/etc/passwd",
            "inductor/../../x",
            "inductor/a\x00b",
            "inductor/\x1b[2J",
            "inductor\\x",
            "inductor/[/bold]",
            "kiln.env",
            "manifest.json",
            ".kiln-installed.json",
            "inductor",
            "inductor/fxgraph",
            "inductor/fxgraph/a/entry/deeper",
            "a" * 5000,
            "inductor/" + "b" * 300,
            "/".join(["d"] * 40),
            "inductor/\u202eevil",
            "inductor/e\u0301",
            "A=1; touch pwned",
            "LD_PRELOAD",
            "TORCHINDUCTOR_CACHE_DIR",
        ]
    ),
)
odd_ints = st.one_of(
    st.integers(),
    st.sampled_from([-1, -(2**63), 2**31, 2**40, 2**41, 2**63, 2**64, 10**100]),
)
odd_values = st.one_of(odd_text, odd_ints, json_values)
# Absolute paths a shell would act on if kiln.env ever ran one as code.
shell_paths = st.sampled_from(
    ["/app$(touch pwned)", "/app`touch pwned`", "/a'; touch pwned; '", '/a"$(id)"', "/%s%n"]
) | st.text(max_size=30).map(lambda t: "/" + t)
FILE_KEYS = ["path", "size", "sha256", "kind"]
TOP_KEYS = [
    "format",
    "name",
    "env",
    "files",
    "megacache",
    "precompiled",
    "fingerprint",
    "grid",
    "spec",
    "created",
    "kiln_version",
]


@st.composite
def mutated_manifests(draw: st.DrawFn) -> dict[str, Any]:
    data = manifest_for(FILES).model_dump(mode="json")
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["file", "top", "env", "drop", "append", "workdir"]))
        files = data.get("files")
        entries = [e for e in files if isinstance(e, dict)] if isinstance(files, list) else []
        if where == "file" and entries:
            entry = entries[draw(st.integers(0, len(entries) - 1))]
            entry[draw(st.sampled_from(FILE_KEYS))] = draw(odd_values)
        elif where == "top":
            data[draw(st.sampled_from(TOP_KEYS))] = draw(odd_values)
        elif where == "env":
            data["env"] = {draw(odd_text): draw(odd_text)}
        elif where == "workdir":  # quoted into kiln.env's shell code (kiln.workdir)
            data["workdir"] = {"path": draw(odd_text | shell_paths), "keyed": draw(odd_ints)}
        elif where == "drop":
            data.pop(draw(st.sampled_from(TOP_KEYS)), None)
        elif where == "append" and entries:
            twin = dict(entries[0])
            twin[draw(st.sampled_from(FILE_KEYS))] = draw(odd_values)
            files.append(twin)
    return data


@FUZZ
@given(mutated_manifests())
def test_mutated_manifest(workdir: Path, data: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        art = write_archive(
            Path(tmp) / "m.kiln.tar.zst",
            json.dumps(data).encode(),
            [reg(p, d) for p, d in sorted(FILES.items())],
        )
        check_archive(art, workdir / "dest")


@FUZZ
@given(odd_text | shell_paths)
def test_a_recorded_workdir_never_runs_as_shell_code(workdir: Path, path: str) -> None:
    """Whatever path a manifest records as its workdir, restore refuses it or writes a
    kiln.env that only quotes it: sourced with ``sh -eu`` elsewhere, it prints and runs nothing."""
    data = manifest_for(FILES).model_dump(mode="json") | {"workdir": {"path": path, "keyed": 1}}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        art = write_archive(
            Path(tmp) / "w.kiln.tar.zst",
            json.dumps(data).encode(),
            [reg(p, d) for p, d in sorted(FILES.items())],
        )
        dest = Path(tmp) / "dest"
        check_archive(art, dest)
        if not (dest / "kiln.env").exists():
            return
        here = Path(tmp) / "here"
        here.mkdir()
        run = subprocess.run(
            ["sh", "-eu", "-c", '. "$1"', "sh", str(dest / "kiln.env")],
            cwd=here,
            env={"PATH": os.environ["PATH"], "PWD": str(here)},
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0 and list(here.iterdir()) == [], run.stderr
        assert run.stderr.startswith("kiln.env: this process runs in"), run.stderr


# --- byte-level mutations of a small valid artifact ---------------------------------------------


def _valid_tar() -> bytes:
    buf = io.BytesIO()
    body = manifest_for(FILES).to_bytes()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(reg("manifest.json", body)[0], io.BytesIO(body))
        for name, content in sorted(FILES.items()):
            info, _ = reg(name, content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


VALID_TAR = _valid_tar()
VALID_ZST = zstandard.ZstdCompressor(write_checksum=True).compress(VALID_TAR)


@st.composite
def mutated_bytes(draw: st.DrawFn, original: bytes) -> bytes:
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["set", "flip", "insert", "delete", "truncate"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "set":
            data[at] = draw(st.integers(0, 255))
        elif op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        else:
            del data[at:]
    return bytes(data)


@FUZZ
@given(mutated_bytes(VALID_ZST))
def test_mutated_artifact_bytes(workdir: Path, data: bytes) -> None:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        art = Path(tmp) / "b.kiln.tar.zst"
        art.write_bytes(data)
        check_archive(art, workdir / "dest")


@FUZZ
@given(mutated_bytes(VALID_TAR))
def test_mutated_tar_bytes(workdir: Path, data: bytes) -> None:
    """Mutate the tar under the compression, so the bytes reach tarfile's header parser."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        art = Path(tmp) / "t.kiln.tar.zst"
        art.write_bytes(zstandard.ZstdCompressor().compress(data))
        check_archive(art, workdir / "dest")
