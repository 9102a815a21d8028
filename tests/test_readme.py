"""The README as a newcomer reads it (issue 29, item 8): the order people need things in, lines a
terminal and a diff can show, links that lead somewhere, and numbers that come from a measurement
kept in docs/bench. The quick start is run as written, in a slow test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
MAX_LINE = 100
FIRST = 60  # the quick start: enough to bake, restore and verify the demo


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of ``path`` outside fenced code blocks and tables."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|"):
            out.append((n, line))
    return out


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```\w*\n(.*?)```", text, re.DOTALL)


# The README and the pages its internals moved to (docs/benchmarks.md keeps its report tables).
MOVED = ("bake", "bundles", "development", "multi-rank", "restore", "serving", "sharding")
MOVED += ("signing", "spec", "storage")


@pytest.mark.parametrize("path", [README, *(ROOT / f"docs/{m}.md" for m in MOVED)], ids=str)
def test_no_prose_line_is_over_100_characters(path: Path) -> None:
    """`grep -c '.\\{101\\}'` over the prose is 0: code blocks and tables may run longer."""
    long = [(n, len(line)) for n, line in prose_lines(path) if len(line) > MAX_LINE]
    assert long == [], f"{path.name}: lines over {MAX_LINE} characters (line, length): {long}"


def test_the_first_60_lines_bake_restore_and_verify_the_demo() -> None:
    head = "\n".join(README.read_text().splitlines()[:FIRST])
    assert head.index("## Prerequisites") < head.index("## Quick start")
    for needed in ("C++ compiler", "Python 3.10", "root"):
        assert needed in head.split("## Quick start")[0], needed
    commands = "\n".join(code_blocks(head))
    for step in ("make demo", "make test", "kiln bake ", "kiln restore ", "kiln verify "):
        assert step in commands, step
    assert "scripts/install-restore.sh" in head  # the torch-free install


def test_serving_comes_right_after_the_quick_start() -> None:
    headings = re.findall(r"^## (.+)$", README.read_text(), re.MULTILINE)
    assert headings[:3] == ["Prerequisites", "Quick start", "Serving"]
    for word in ("kiln.env", "kiln.activate", "kiln check", "kiln verify"):
        section = README.read_text().split("## Serving", 1)[1].split("\n## ", 1)[0]
        assert word in section, word


def test_internals_live_in_docs_with_a_link_each() -> None:
    """The hostile-archive rules, the env allow-list, manifest internals, reproducibility,
    bytecode, OCI referrer details, the multi-rank layout and the GPU machine are in docs/, each
    linked from the README; every relative link in the README and docs/ leads to a file."""
    text = README.read_text()
    moved = {
        "docs/restore.md": "*A compile cache is code*",
        "docs/bake.md": "**Reproducible bakes.**",
        "docs/signing.md": "OCI 1.1 referrer",
        "docs/multi-rank.md": "ranks/R/",
        "docs/development.md": "scripts/gpu-run.sh",
    }
    for doc, marker in moved.items():
        assert f"]({doc})" in text, f"the README links {doc}"
        assert marker in (ROOT / doc).read_text(), f"{marker} lives in {doc}"
        assert marker not in text, f"{marker} is out of the README"
    for path in [README, *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links {target}: missing"


def bench_numbers() -> set[str]:
    """Every measurement kept in docs/bench and docs/benchmarks.md, as it may be printed: each
    float of the JSON reports rounded to 1 and 2 decimals, every number in the text files."""
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, float | int) and not isinstance(value, bool):
            found.update({f"{value:.1f}", f"{value:.2f}", str(value)})

    for path in (ROOT / "docs/bench").iterdir():
        if path.suffix == ".json":
            walk(json.loads(path.read_text()))
        else:
            found.update(re.findall(r"\d+(?:\.\d+)?", path.read_text()))
    found.update(re.findall(r"\d+(?:\.\d+)?", (ROOT / "docs/benchmarks.md").read_text()))
    return found


def test_every_measured_number_in_the_readme_is_kept_in_docs_bench() -> None:
    """A time in the README (``8.13 s``, ``7.33–9.04``) is one kiln measured and kept: in a
    docs/bench report or docs/benchmarks.md. (The cold 80.2 s and 33.9 s once were not.)"""
    kept = bench_numbers()
    measured = []
    for n, line in enumerate(README.read_text().splitlines(), 1):
        for m in re.finditer(r"(\d+\.\d+)(?:–(\d+\.\d+))? s\b", line):
            measured += [(n, v) for v in m.groups() if v]
    assert len(measured) >= 20
    missing = [(n, v) for n, v in measured if v not in kept]
    assert missing == [], f"README numbers not in docs/bench (line, value): {missing}"
    for name in re.findall(r"`([\w.-]+\.json)`", README.read_text()):
        assert (ROOT / "docs/bench" / name).is_file(), name


@pytest.mark.slow
def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The README's by-hand block, run line by line in a copy of the configs and examples, with
    this venv's bin first on PATH (what `. .venv/bin/activate` does)."""
    block = next(b for b in code_blocks(README.read_text()) if "kiln bake " in b)
    for folder in ("configs", "examples"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    script = "\n".join(
        line for line in block.splitlines() if not line.startswith(". .venv/bin/activate")
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verified: zero compiles over the grid" in proc.stdout
    assert "compatible" in proc.stdout
