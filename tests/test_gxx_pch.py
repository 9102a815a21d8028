"""The run's g++ (tests/tools/gxx_pch.py): which builds it precompiles the prefix header for,
and which it copies from an identical build kept before."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch.utils.cpp_extension

from tests.conftest import ROOT
from tests.tools.gxx_pch import INCLUDE, kernel_build

TORCH_INCLUDE = torch.utils.cpp_extension.include_paths()[0]
TOOLS = ROOT / "tests" / "tools"


def _command(source: Path) -> list[str]:
    """An Inductor CPU kernel build as torch 2.13 words it (one call compiles and links)."""
    return [
        str(source),
        "-D",
        "CPU_CAPABILITY_AVX2",
        "-O3",
        "-shared",
        "-fPIC",
        f"-I{TORCH_INCLUDE}",
        "-mavx2",
        "-o",
        str(source.with_suffix(".so")),
        "-ltorch",
        "-L/opt/lib",
        "-Wl,-rpath,/opt/lib",
    ]


def test_a_kernel_build_gets_its_compile_options_and_the_headers_root(tmp_path: Path) -> None:
    kernel = tmp_path / "ck.main.cpp"
    kernel.write_text(f'\n{INCLUDE}\nextern "C" void kernel() {{}}\n')
    options, root = kernel_build(_command(kernel)) or ([], None)
    assert options == ["-D", "CPU_CAPABILITY_AVX2", "-O3", "-fPIC", f"-I{TORCH_INCLUDE}", "-mavx2"]
    assert root == Path(TORCH_INCLUDE)


def test_other_commands_go_to_g_plus_plus_as_they_are(tmp_path: Path) -> None:
    probe = tmp_path / "probe.cpp"  # an ISA probe: another first include
    probe.write_text("#include <immintrin.h>\n" + INCLUDE + "\n")
    assert kernel_build(_command(probe)) is None
    assert kernel_build(["--version"]) is None
    assert kernel_build([]) is None
    kernel = tmp_path / "ck.main.cpp"
    kernel.write_text(INCLUDE + "\n")
    assert kernel_build([*_command(kernel), str(tmp_path / "other.cpp")]) is None  # two sources
    assert kernel_build([*_command(kernel), "-include", "pre.h"]) is None  # another prefix
    no_torch = [a for a in _command(kernel) if not a.startswith("-I")]
    assert kernel_build(no_torch) is None  # the header is nowhere on the include path


def test_the_real_compiler_says_the_same_of_itself(tmp_path: Path) -> None:
    """``g++ -v`` is part of Inductor's ISA-probe keys: through the stand-in it prints what the
    real compiler prints (started as ``g++``, the stand-in's folder off ``PATH``)."""
    env = {k: v for k, v in os.environ.items() if k != "KILN_TEST_PCH_DIR"}
    plain = [p for p in env["PATH"].split(os.pathsep) if Path(p or ".").resolve() != TOOLS]
    real = {**env, "PATH": os.pathsep.join(plain)}
    shim = {**env, "PATH": os.pathsep.join([str(TOOLS), *plain])}
    said = [
        subprocess.run(["g++", "-v"], env=e, capture_output=True, text=True, check=True).stderr
        for e in (real, shim)
    ]
    assert said[0] == said[1] and "COLLECT_GCC=g++" in said[0]


def test_an_identical_library_build_is_copied_from_the_kept_output(tmp_path: Path) -> None:
    """A build of one source into one library is kept by what it was built from; the same
    build again (another folder: a new cache root) copies it, anything else compiles."""
    env = {**os.environ, "KILN_TEST_PCH_DIR": str(tmp_path / "kept")}
    env["PATH"] = os.pathsep.join([str(TOOLS), env["PATH"]])

    def build(folder: str, code: str) -> tuple[int, Path]:
        source = tmp_path / folder / "probe.cpp"
        source.parent.mkdir(exist_ok=True)
        source.write_text(code)
        out = source.with_suffix(".so")
        command = ["g++", str(source), "-O2", "-shared", "-fPIC", "-o", str(out)]
        return subprocess.run(command, env=env, capture_output=True).returncode, out

    code = 'extern "C" int answer() { return 42; }\n'
    rc, first = build("a", code)
    (kept,) = (tmp_path / "kept" / "built").iterdir()
    assert rc == 0 and kept.read_bytes() == first.read_bytes()
    kept.write_bytes(b"kept")  # so that a copy shows
    rc, again = build("b", code)
    assert rc == 0 and again.read_bytes() == b"kept"
    rc, other = build("c", code.replace("42", "43"))  # other bytes: compiled
    assert rc == 0 and other.read_bytes()[:4] == b"\x7fELF"
    rc, failed = build("d", "not C++\n")  # a failing build: its exit code, nothing kept
    assert rc != 0 and not failed.exists()
    assert len(list((tmp_path / "kept" / "built").iterdir())) == 2


def test_aot_objects_and_headers_are_kept_by_code_not_by_folder(tmp_path: Path) -> None:
    """AOTInductor's shapes: a precompiled header, and an object compiled ``-include``-ing it
    from a source that ends with its build command (naming the bake's temporary folder) as a
    comment. The same code and header bytes in another folder copy the kept output; other
    code, or an included header with other bytes, compiles."""
    env = {**os.environ, "KILN_TEST_PCH_DIR": str(tmp_path / "kept")}
    env["PATH"] = os.pathsep.join([str(TOOLS), env["PATH"]])

    def build(folder: str, code: str, header: str = "#define ANSWER 42\n") -> tuple[int, Path]:
        where = tmp_path / folder
        where.mkdir(exist_ok=True)
        (where / "pre.h").write_text(header)
        subprocess.run(
            ["g++", "-x", "c++-header", str(where / "pre.h"), "-o", str(where / "pre.h.gch")],
            env=env,
            check=True,
        )
        source = where / "w.wrapper.cpp"
        source.write_text(f"{code}// g++ {source} -c -o {where}/w.wrapper.o\n")
        out = where / "w.wrapper.o"
        command = [
            "g++",
            str(source),
            "-include",
            str(where / "pre.h"),
            "-O1",
            "-c",
            "-o",
            str(out),
        ]
        return subprocess.run(command, env=env, capture_output=True).returncode, out

    code = 'extern "C" int answer() { return ANSWER; }\n'
    rc, first = build("a", code)
    assert first.read_bytes()[:4] == b"\x7fELF"
    kept = sorted((tmp_path / "kept" / "built").iterdir())
    assert rc == 0 and len(kept) == 2  # the header and the object
    for k in kept:
        k.write_bytes(b"kept")  # so that a copy shows
    rc, again = build("b", code)
    assert rc == 0 and again.read_bytes() == b"kept"
    assert (tmp_path / "b" / "pre.h.gch").read_bytes() == b"kept"
    rc, other = build("c", code.replace("answer", "other"))  # other code: compiled
    assert rc == 0 and other.read_bytes()[:4] == b"\x7fELF"
    rc, header = build("d", code, "#define ANSWER 43\n")  # the same code, another header
    assert rc == 0 and header.read_bytes()[:4] == b"\x7fELF"
