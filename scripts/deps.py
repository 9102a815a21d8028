"""Print kiln's runtime requirements, optionally without some and with extras.

One source of truth for the torch-free install (Docker `restore` target, slim init containers):
pip cannot install a package without one of its dependencies, so scripts/install-restore.sh runs
`pip install --no-deps` and then installs what this prints. Two sources:

    python scripts/deps.py --without torch --extras oci             # this checkout's pyproject.toml
    python scripts/deps.py --installed torch-kiln --without torch   # an installed distribution

`--installed` reads the metadata of what pip just installed (a wheel, an sdist, a release from an
index), so the list always matches the installed version, not whatever checkout is at hand.
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9_.-]+")
# Requires-Dist markers as setuptools writes them for an extra: `; extra == "s3"`.
EXTRA_MARKER = re.compile(r"""^extra\s*==\s*["']([A-Za-z0-9_.-]+)["']$""")


def from_pyproject(pyproject: Path) -> tuple[list[str], dict[str, list[str]]]:
    """(dependencies, {extra: its requirements}) from a pyproject.toml."""
    import tomllib  # Python 3.11+; the --installed mode also runs on 3.10

    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project["dependencies"]), dict(project.get("optional-dependencies", {}))


def from_installed(dist: str) -> tuple[list[str], dict[str, list[str]]]:
    """(dependencies, {extra: its requirements}) from an installed distribution's metadata.

    Markers other than a bare `extra == "x"` stay on the requirement (pip evaluates them); a marker
    that mixes an extra with other conditions is refused rather than guessed at.
    """
    meta = metadata.metadata(dist)
    base: list[str] = []
    extras: dict[str, list[str]] = {e: [] for e in meta.get_all("Provides-Extra") or []}
    for line in meta.get_all("Requires-Dist") or []:
        req, _, marker = (part.strip() for part in line.partition(";"))
        if "extra" not in marker:
            base.append(line.strip())
            continue
        match = EXTRA_MARKER.match(marker)
        if not match:
            raise SystemExit(f"unsupported marker in {dist}'s Requires-Dist: {line!r}")
        extras.setdefault(match.group(1), []).append(req)
    return base, extras


def requirements(
    base: list[str], optional: dict[str, list[str]], without: set[str], extras: list[str]
) -> list[str]:
    reqs = list(base)
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r} (known: {', '.join(sorted(optional))})")
        reqs += optional[extra]
    out: list[str] = []
    for req in reqs:
        match = NAME.match(req)
        if match and match.group(0).lower() not in without and req not in out:
            out.append(req)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--without", default="", help="comma-separated package names to drop")
    parser.add_argument("--extras", default="", help="comma-separated extras to add")
    source = parser.add_mutually_exclusive_group()
    default = Path(__file__).resolve().parent.parent / "pyproject.toml"
    source.add_argument("--pyproject", default=str(default))
    source.add_argument("--installed", metavar="DIST", help="an installed distribution's name")
    args = parser.parse_args()
    without = {w.strip().lower() for w in args.without.split(",") if w.strip()}
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    base, optional = (
        from_installed(args.installed) if args.installed else from_pyproject(Path(args.pyproject))
    )
    print("\n".join(requirements(base, optional, without, extras)))


if __name__ == "__main__":
    main()
