"""kiln.bytecode: a serving image that compiles torch's Python at every start is named, with the
command that fixes it (a real package on disk, compiled for real by compileall)."""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.bytecode import uncached_reason

CHECK = "import sys; from kiln.bytecode import uncached_reason; print(uncached_reason(sys.argv[1]))"


def _package(root: Path, name: str) -> Path:
    pkg = root / name
    (pkg / "_inductor").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_inductor" / "__init__.py").write_text("")
    (pkg / "_inductor" / "compile_fx.py").write_text("X = 1\n")
    return pkg


def _check(root: Path, name: str, *flags: str) -> str:
    """The check in a fresh interpreter (sys.path and the bytecode flag as a server has them)."""
    env = {"PYTHONPATH": f"{root}:{Path(__file__).parents[1] / 'src'}"}
    proc = subprocess.run(
        [sys.executable, *flags, "-c", CHECK, name], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_uncached_bytecode_is_named_with_the_fix(tmp_path: Path) -> None:
    pkg = _package(tmp_path, "fakepkg_uncached")
    said = _check(tmp_path, "fakepkg_uncached", "-B")
    assert "fakepkg_uncached's Python bytecode is not cached here" in said
    assert "PYTHONDONTWRITEBYTECODE is set" in said
    assert f"python -m compileall -q {pkg}" in said
    assert compileall.compile_dir(pkg, quiet=1)
    assert _check(tmp_path, "fakepkg_uncached", "-B") == "None"


def test_installed_torch_and_missing_packages() -> None:
    assert uncached_reason("no_such_package_kiln") is None
    # This venv's torch came from pip, which compiles bytecode at install.
    assert uncached_reason("torch") is None


# A server on an image without torch's bytecode, emulated for real: an empty pycache prefix is
# where this interpreter looks for every module's bytecode.
SERVE = """
import importlib._bootstrap_external as ext, importlib.util, os, sys
from pathlib import Path
from kiln import bytecode
folder, pkg = Path(sys.argv[1]), Path(sys.argv[2])
source = str(pkg / "mod.py")
if sys.argv[3] == "bake":
    import torch  # use() checks the tree holds torch's __init__, which every server imports
    assert bytecode.write([source, torch.__file__, "relative.py"], folder) == 2
    # Bytecode of other code than its source says: if Python uses it, the module says so.
    cached = folder / bytecode.prefix_path(source)
    data = ext._code_to_hash_pyc(
        compile("SERVED = 'from the prefix'", source, "exec"),
        importlib.util.source_hash(Path(source).read_bytes()),
        True,
    )
    cached.write_bytes(bytes(data))
    raise SystemExit
print(bytecode.uncached_reason() is not None, bytecode.use(folder))
sys.path.insert(0, str(pkg))
import mod
served = bytecode.served_modules(folder)
print(getattr(mod, "SERVED", "from source"), served, sys.dont_write_bytecode)
env = os.environ
print(env.get("PYTHONPYCACHEPREFIX") == str(folder), env.get("PYTHONDONTWRITEBYTECODE"))
"""


def _serve(folder: Path, pkg: Path, step: str, prefix: Path | None, *flags: str) -> list[str]:
    env = {"PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    if prefix is not None:  # no bytecode where Python looks; use() turns writing it off
        env["PYTHONPYCACHEPREFIX"] = str(prefix)
    if step == "bake":  # keeps the prefix free of torch's bytecode
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [sys.executable, *flags, "-c", SERVE, str(folder), str(pkg), step],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.slow  # seven fresh interpreters, the first importing Inductor from source
def test_shipped_bytecode_serves_an_image_without_its_own(tmp_path: Path) -> None:
    folder, pkg, empty = tmp_path / "bytecode", tmp_path / "pkg", tmp_path / "no-pyc"
    pkg.mkdir()
    empty.mkdir()
    (pkg / "mod.py").write_text("SERVED = 'from source'\n")
    _serve(folder, pkg, "bake", empty)
    uncached, note = _serve(folder, pkg, "serve", empty)[0].split(" ", 1)
    assert uncached == "True"
    assert note == f"importing Python bytecode from {folder} (torch's is not cached here)"
    # Child interpreters (Inductor's compile workers) import from it too, and write nothing.
    assert _serve(folder, pkg, "serve", empty)[1:] == ["from the prefix 1 True", "True 1"]
    assert len([p for p in folder.rglob("*") if p.is_file()]) == 2  # left as restored
    # Where torch's bytecode is cached (this venv), a prefix would only cost: not used; nor
    # under -O, where Python looks for .opt-1 files the artifact does not hold.
    assert _serve(folder, pkg, "serve", None)[:2] == ["False None", "from source 0 False"]
    assert _serve(folder, pkg, "serve", empty, "-O")[:2] == ["True None", "from source 0 False"]
    # Nor where Python would not compare a pyc with its source: it would run any code.
    never = _serve(folder, pkg, "serve", empty, "--check-hash-based-pycs", "never")
    assert never[0].startswith("True the artifact's Python bytecode is unused")
    assert never[1] == "from source 0 False"
    # A changed source is compiled from source, never served stale.
    (pkg / "mod.py").write_text("SERVED = 'changed'\n")
    assert _serve(folder, pkg, "serve", empty)[1] == "changed 0 True"


def test_bytecode_for_another_torch_is_named_and_unused(tmp_path: Path) -> None:
    folder, pkg, empty = tmp_path / "bytecode", tmp_path / "pkg", tmp_path / "no-pyc"
    for d in (folder / "elsewhere", pkg, empty):
        d.mkdir(parents=True)
    (pkg / "mod.py").write_text("X = 1\n")
    note = _serve(folder, pkg, "serve", empty)[0]
    assert note.startswith("True the artifact's Python bytecode does not cover this torch (")
    assert _serve(folder, pkg, "serve", empty)[1] == "from source 0 False"


def test_written_bytecode_is_the_same_whichever_process_writes_it(tmp_path: Path) -> None:
    """Shards must agree: a process that imported sympy (as Inductor does) once compiled some
    sources to other bytes (marshal's shared-reference flag); write() compiles in isolation."""
    import importlib.util

    origin = importlib.util.find_spec("torch").origin
    sources = sorted(str(p) for p in (Path(origin).parent / "profiler").glob("*.py"))
    code = (
        "import sys; from pathlib import Path; from kiln.bytecode import write; "
        "sys.argv[1] == 'busy' and __import__('sympy'); "
        "print(write(sys.argv[3:], Path(sys.argv[2])))"
    )
    trees = {}
    for how in ("fresh", "busy"):
        out = tmp_path / how
        subprocess.run(
            [sys.executable, "-c", code, how, str(out), *sources],
            check=True,
            env={"PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        )
        trees[how] = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.pyc")}
    assert len(trees["fresh"]) == len(sources) > 5
    assert trees["fresh"] == trees["busy"]


def test_prefix_paths_mirror_absolute_normalized_sources_only() -> None:
    from kiln.bytecode import prefix_path

    tag = sys.implementation.cache_tag
    assert str(prefix_path("/usr/lib/python3/os.py")) == f"usr/lib/python3/os.{tag}.pyc"
    for bad in ("os.py", "lib/os.py", "/usr/../etc/os.py", "/usr/./lib/os.py"):
        assert prefix_path(bad) is None, bad


@pytest.mark.slow  # every process imports torch from source
@pytest.mark.parametrize(
    ("route", "served", "unused"),
    [
        ("compile", "torch/_inductor/compile_fx", ()),
        # The AOT route's passes import Inductor to build the packages; its server does not.
        ("aoti", "torch/__init__", ("/torch/_inductor/", "/torch/_dynamo/", "/sympy/")),
    ],
)
def test_a_bake_on_an_image_without_bytecode_ships_what_its_server_imports(
    tmp_path: Path, cli, route: str, served: str, unused: tuple[str, ...]
) -> None:
    """The whole route on CPU, with the H200 image's condition emulated for real: no bytecode
    where this interpreter looks, none written. The bake ships the bytecode of the modules a
    server imports (the AOT route's: a fresh process serving the built packages); the served
    process uses it and writes nothing."""
    from kiln.artifact.archive import read_manifest
    from tests.conftest import aoti_spec, mlp_spec

    empty = tmp_path / "no-pyc"
    empty.mkdir()
    env = {"PYTHONPYCACHEPREFIX": str(empty), "PYTHONDONTWRITEBYTECODE": "1"}
    spec, art, dest = tmp_path / "spec.yaml", tmp_path / "a.kiln.tar.zst", tmp_path / "cache"
    # One bucket, unproven: the bytecode and verify serving it are the subject here, and every
    # process of this bake imports torch from source.
    spec.write_text(aoti_spec(buckets="[2]") if route == "aoti" else mlp_spec(buckets="batch: [2]"))
    proc = cli("bake", spec, "-o", art, "-q", "--no-prove", env=env)
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(art)
    shipped = [f.path for f in manifest.files if f.kind == "bytecode"]
    assert manifest.bytecode is not None and manifest.bytecode.modules == len(shipped)
    assert manifest.bytecode.python == sys.implementation.cache_tag
    probe = f"/{served}.{sys.implementation.cache_tag}.pyc"
    assert any(p.startswith("bytecode/") and p.endswith(probe) for p in shipped)
    assert not [p for p in shipped if any(u in p for u in unused)]
    assert not any("/examples/" in p for p in shipped)  # the user's code is not shipped
    assert manifest.warnings == []  # aoti: its serving-imports pass served every bucket
    assert cli("restore", art, "-d", dest, no_torch=True).returncode == 0
    proc = cli("verify", spec, "--cache", dest, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["compiles"] == 0
    assert report["bytecode_modules"] > len(shipped) // 2
    assert not any(empty.iterdir())  # nothing compiled and written by the served process


def test_the_spec_decides_whether_a_bake_ships_bytecode(write_spec) -> None:
    from kiln.compiler.bake import ships_bytecode
    from kiln.spec import load_spec
    from tests.conftest import mlp_spec

    def ships(extra: str) -> bool:
        return ships_bytecode(load_spec(write_spec(mlp_spec() + extra)))

    # This venv's torch has its bytecode cached (pip compiles it), so auto ships none.
    assert (ships(""), ships("bytecode: always\n"), ships("bytecode: never\n")) == (
        False,
        True,
        False,
    )
    tp = (Path(__file__).parents[1] / "configs" / "tp-mlp-cpu.yaml").read_text()
    tp = tp.replace("../examples/", f"{Path(__file__).parents[1]}/examples/")
    assert ships_bytecode(load_spec(write_spec(tp + "bytecode: always\n", "tp.yaml")))
    assert (
        load_spec(write_spec(mlp_spec())).sha256()
        == load_spec(write_spec(mlp_spec() + "bytecode: auto\n")).sha256()
    )  # the default leaves spec digests as they were


def _torch_pyc_artifact(tmp_path: Path, fingerprint: dict) -> Path:
    """An artifact whose bytecode holds checked pycs of torch's Inductor probe and of
    ``torch/__init__``, Dynamo's and pydantic's ``__init__``: each their real source's hash, the
    last three with code appended that names them in ``KILN_TEST_SERVED`` when they run.
    Restored."""
    import importlib._bootstrap_external as ext
    import importlib.util

    from kiln.artifact.restore import restore
    from tests.archives import manifest_for, reg, write_archive

    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    pydantic_dir = Path(importlib.util.find_spec("pydantic").origin).parent
    tag = sys.implementation.cache_tag
    files, fields = {}, {}
    for folder, rel, marker in (
        (torch_dir, "_inductor/compile_fx.py", ""),
        (torch_dir, "__init__.py", "torch"),
        (torch_dir, "_dynamo/__init__.py", "dynamo"),
        (pydantic_dir, "__init__.py", "pydantic"),  # kiln's own import, before torch's
    ):
        source = str(folder / rel)
        text = Path(source).read_bytes()
        said = (
            "\nimport os as _o\n_o.environ['KILN_TEST_SERVED'] = "
            f"_o.environ.get('KILN_TEST_SERVED', '') + {marker + ','!r}\n"
        )
        code = text + (said.encode() if marker else b"")
        digest = importlib.util.source_hash(text)
        path = f"bytecode/{source.lstrip('/')[:-3]}.{tag}.pyc"
        files[path] = bytes(ext._code_to_hash_pyc(compile(code, source, "exec"), digest, True))
        fields[path] = {"kind": "bytecode", "source": source, "source_hash": digest.hex()}
    data = manifest_for(files, fingerprint=fingerprint).model_dump(mode="json")
    data["bytecode"] = {"python": tag, "modules": len(files)}
    data["compile_kwargs"] = {"backend": "inductor", "options": {"compile_threads": 1}}
    for entry in data["files"]:
        entry.update(fields[entry["path"]])
    tmp_path.mkdir(parents=True, exist_ok=True)
    art = write_archive(
        tmp_path / "a.kiln.tar.zst", data, [reg(p, d) for p, d in sorted(files.items())]
    )
    restore(art, tmp_path / "cache")
    return tmp_path / "cache"


def _activate(script: str, dest: Path, empty: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(dest), str(empty)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


# A server that imported torch first (from this venv's own bytecode), then finds none where
# Python looks (an image without it) and none is written.
ACTIVATE = """
import os, sys
import torch
sys.pycache_prefix, sys.dont_write_bytecode = sys.argv[2], True
import kiln
from kiln.errors import IncompatibleError
try:
    kiln.activate(sys.argv[1], compat="fail")
except IncompatibleError as exc:
    print("refused:", exc.message.split(":")[0])
print(os.environ.get("KILN_TEST_SERVED"), sys.pycache_prefix == sys.argv[2])
"""


@pytest.mark.slow  # a fresh interpreter fingerprints with Inductor imported from source
def test_activate_serves_no_bytecode_before_the_compat_check_passes(tmp_path: Path) -> None:
    """Issue 27, item 1: a pyc in the artifact ran inside ``activate(compat="fail")`` before
    the check refused the environment. Here checked pycs (their real sources' hashes, code
    that says it was imported) ship with an artifact baked for another torch: activate must
    refuse without importing anything from it."""
    fingerprint = {"device.type": "cpu", "torch.version": "0.0.1", "python": "3.0.0"}
    dest, empty = _torch_pyc_artifact(tmp_path, fingerprint), tmp_path / "no-pyc"
    empty.mkdir()
    out = _activate(ACTIVATE, dest, empty)
    assert out[-1] == "None True", out  # nothing served; as it was
    assert out[0].startswith("refused"), out
    # Nor when activate() comes first: torch/version.py names another build.
    out = _activate(ACTIVATE_FIRST, dest, empty)
    assert out[0].startswith("refused") and out[1:] == ["None True", str(empty)], out


# A server that calls activate() before it imports torch, on an image without bytecode.
ACTIVATE_FIRST = """
import os, sys
import kiln
from kiln.errors import IncompatibleError
sys.pycache_prefix, sys.dont_write_bytecode = sys.argv[2], True
os.environ["PYTHONPYCACHEPREFIX"] = sys.argv[2]
try:
    kiln.activate(sys.argv[1], compat="fail")
    print("ok")
except IncompatibleError as exc:
    print("refused:", exc.message.split(":")[0])
print(os.environ.get("KILN_TEST_SERVED"), sys.pycache_prefix == sys.argv[2])
print(os.environ.get("PYTHONPYCACHEPREFIX"))
"""


@pytest.mark.slow  # fresh interpreters import torch from source
def test_activate_imports_torch_from_the_bytecode_of_its_own_build(tmp_path: Path) -> None:
    """Issue 26: ``import torch`` from source took activate() 4.2 s on the H100 image, while
    verify's served process imported it from the artifact's bytecode. torch/version.py names
    the build without importing it: the same build's checked pycs serve ``import torch``; when
    the full check (which needs torch) then refuses, later imports look where they did."""
    from kiln.installs import torch_build

    build = torch_build()
    assert build is not None and build["torch.version"] is not None
    # As this process's environment has it (conftest): part of what the check compares.
    env = {k: v for k, v in os.environ.items() if k == "TORCHINDUCTOR_VEC_ISA_OK"}
    baked = {"device.type": "cpu", **build, "env": env}
    empty = tmp_path / "no-pyc"
    empty.mkdir()
    same = _torch_pyc_artifact(tmp_path / "same", baked)
    out = _activate(ACTIVATE_FIRST, same, empty)
    assert out == ["ok", "pydantic,torch,dynamo, False", str(same / "bytecode")], out
    # The build matches but a factor only torch can tell (its deterministic flag) does not.
    flagged = {**baked, "flags.deterministic": True}
    other = _torch_pyc_artifact(tmp_path / "flag", flagged)
    out = _activate(ACTIVATE_FIRST, other, empty)
    assert out[0].startswith("refused"), out
    # Imported before the refusal, from this build's own checked pycs: kiln's pydantic, torch,
    # and Dynamo with the check's Inductor config; from then on, Python looks where it did.
    assert out[1:] == ["pydantic,torch,dynamo, True", str(empty)], out


# A server whose activate() fails after the artifact's bytecode was set up: on a manifest that
# names this torch build as JSON but is no manifest kiln reads.
ACTIVATE_BROKEN = """
import os, sys
import kiln
from kiln.errors import KilnError
sys.pycache_prefix, sys.dont_write_bytecode = sys.argv[2], True
try:
    kiln.activate(sys.argv[1])
except KilnError as exc:
    print("refused:", type(exc).__name__)
print(os.environ.get("KILN_TEST_SERVED"), sys.pycache_prefix == sys.argv[2])
"""


@pytest.mark.slow  # a fresh interpreter
def test_activate_takes_the_bytecode_back_when_the_manifest_is_refused(tmp_path: Path) -> None:
    """activate() serves the artifact's bytecode before it validates the manifest (its models
    are among the imports served); a manifest refused then leaves imports as they were."""
    from kiln.installs import torch_build

    same = _torch_pyc_artifact(tmp_path, {"device.type": "cpu", **(torch_build() or {})})
    data = json.loads((same / "manifest.json").read_text())
    data["format"] = 999
    (same / "manifest.json").write_text(json.dumps(data))
    empty = tmp_path / "no-pyc"
    empty.mkdir()
    out = _activate(ACTIVATE_BROKEN, same, empty)
    assert out == ["refused: UsageError", "pydantic, True"], out  # a newer format: upgrade


# Statements a torch/version.py could hold: (source, the name it binds, the constant it binds).
_NOT_CONSTANT = object()
_VERSION_LINES = (
    ("__version__ = '2.13.0+cpu'", "__version__", "2.13.0+cpu"),
    ("__version__ = base + '+cu130'", "__version__", _NOT_CONSTANT),
    ("git_version = 'cf30153c'", "git_version", "cf30153c"),
    ("def git_version(): pass", "git_version", _NOT_CONSTANT),
    ("cuda: Optional[str] = None", "cuda", None),
    ("cuda = '13.0'", "cuda", "13.0"),
    ("cuda += '.1'", "cuda", _NOT_CONSTANT),
    ("from elsewhere import cuda", "cuda", _NOT_CONSTANT),
    ("if hip:\n    cuda = '12.8'", "cuda", _NOT_CONSTANT),
    ("hip: Optional[str] = None", None, None),
    ("debug = False", None, None),
)


@given(st.lists(st.sampled_from(_VERSION_LINES), max_size=8))
def test_torch_version_file_names_a_build_only_when_each_name_is_one_constant(lines) -> None:
    """``kiln.installs.torch_build`` reads torch/version.py without running it, to decide
    whether an artifact's bytecode may serve ``import torch``: a name bound twice, computed,
    imported or bound conditionally is not a build it can vouch for."""
    import ast

    from kiln.installs import _version_constants

    got = _version_constants(ast.parse("\n".join(line for line, _, _ in lines)))
    names = {"__version__": "torch.version", "git_version": "torch.git", "cuda": "torch.cuda"}
    bound = {n: [v for _, name, v in lines if name == n] for n in names}
    readable = all(len(v) == 1 and v[0] is not _NOT_CONSTANT for v in bound.values())
    assert got == ({names[n]: v[0] for n, v in bound.items()} if readable else None)


def test_activate_tries_the_bytecode_first_only_for_the_baked_build(tmp_path: Path) -> None:
    """In this process (whose torch has its own bytecode, so use() declines): another or an
    unknown build, or a folder without a readable manifest, is not tried (None: the full check
    decides after import); the baked build is tried once, and a declined try is not repeated
    after the check."""
    from kiln.compiler.activate import _bytecode_before_imports
    from kiln.installs import torch_build
    from tests.archives import manifest_for

    build = torch_build()
    assert build is not None
    (tmp_path / "bytecode").mkdir()

    def tried(fingerprint: dict) -> bool | None:
        data = manifest_for({}, fingerprint=fingerprint).model_dump(mode="json")
        data["bytecode"] = {"python": sys.implementation.cache_tag, "modules": 1}
        (tmp_path / "manifest.json").write_text(json.dumps(data))
        return _bytecode_before_imports(tmp_path, [])

    assert tried({**build, "torch.git": "0" * 40}) is None
    assert tried({**build, "torch.version": "0.0.1"}) is None
    assert tried(build) is False  # tried: this venv's torch has its bytecode, use() declines
    assert sys.pycache_prefix != str(tmp_path / "bytecode")
    for broken in ("{", "[]", '{"bytecode": {"modules": 1}, "fingerprint": []}'):
        (tmp_path / "manifest.json").write_text(broken)
        assert _bytecode_before_imports(tmp_path, []) is None
    (tmp_path / "manifest.json").unlink()
    assert _bytecode_before_imports(tmp_path, []) is None
