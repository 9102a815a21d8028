"""Print kiln's runtime requirements from pyproject.toml, optionally without some and with extras.

One source of truth for the torch-free install (Docker `restore` stage, slim init containers):
    pip install --no-deps . && pip install $(python scripts/deps.py --without torch --extras oci)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import tomllib


def requirements(pyproject: Path, without: set[str], extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r} (known: {', '.join(sorted(optional))})")
        reqs += optional[extra]
    name = re.compile(r"^[A-Za-z0-9_.-]+")
    out: list[str] = []
    for req in reqs:
        match = name.match(req)
        if match and match.group(0).lower() not in without and req not in out:
            out.append(req)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--without", default="", help="comma-separated package names to drop")
    parser.add_argument("--extras", default="", help="comma-separated extras to add")
    default = Path(__file__).resolve().parent.parent / "pyproject.toml"
    parser.add_argument("--pyproject", default=str(default))
    args = parser.parse_args()
    without = {w.strip().lower() for w in args.without.split(",") if w.strip()}
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    print("\n".join(requirements(Path(args.pyproject), without, extras)))


if __name__ == "__main__":
    main()
