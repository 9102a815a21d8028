"""The Dockerfile's `restore` target, built for real with podman and run: `kiln restore` and
`kiln inspect` inside the image, torch absent, files owned by the image's uid 1000.

No base image can be pulled here, so the base is made from Debian's own packages: a debootstrap
minbase rootfs with python3 + python3-venv + ca-certificates, `podman import`ed as a local image
and passed as the Dockerfile's PYTHON_IMAGE. The rootfs is cached under /var/tmp, keyed by its
recipe, so only a machine's first run pays for debootstrap; the Dockerfile itself is built without
any cache every time. Needs root (rootful podman, debootstrap); `.ci/run` installs the tools.

Two settings make podman run in this sandbox, neither about kiln:
- runc, not crun: crun refuses cgroups in hybrid mode ("cgroups in hybrid mode not supported").
- explicit ulimits: podman's defaults (nofile 1048576, a large nproc) are above what the runtime may
  set without CAP_SYS_RESOURCE ("setrlimit RLIMIT_NOFILE: Operation not permitted").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kiln
from tests.archives import good_archive
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# The base image's recipe: what debootstrap installs. Changing any of it changes the cache key.
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
MIRROR = os.environ.get("KILN_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
RECIPE = {"suite": SUITE, "packages": PACKAGES, "mirror": MIRROR, "variant": "minbase", "v": 1}
CACHE = Path("/var/tmp/kiln-test-base")
IN_BUILD_CA = "/run/kiln-build/pip-ca.crt"
# What the fixtures measured, printed by the test (fixture output is captured).
REPORT: list[str] = []


def missing_tools() -> str | None:
    """Why this machine cannot build the image, or None."""
    if sys.platform != "linux":
        return "needs Linux (podman, debootstrap)"
    if os.geteuid() != 0:
        return "needs root: rootful podman, and debootstrap to make the base image"
    absent = [t for t in ("podman", "debootstrap") if shutil.which(t) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (.ci/run installs them)"
    return None


if reason := missing_tools():
    pytest.skip(reason, allow_module_level=True)


def podman_global() -> list[str]:
    return ["podman", *(["--runtime", "runc"] if shutil.which("runc") else [])]


def ulimits() -> list[str]:
    """Limits every sandbox grants: 4096, or the host's hard limit if lower."""
    out = []
    for name, kind in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(kind)[1]
        n = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
        out += ["--ulimit", f"{name}={n}:{n}"]
    return out


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*podman_global(), *args], capture_output=True, text=True, timeout=timeout
    )


def pip_settings() -> tuple[list[str], list[str]]:
    """(build args, volumes) that give pip in the build this machine's pip index and CA bundle.

    Read from `pip config list` (config files and PIP_* variables alike), so a CI machine behind a
    mirror or a TLS-intercepting proxy builds as its own pip installs. A file:// index is mounted
    at the same path (with the files its pages link to); a CA bundle at a fixed path."""
    rank = {"global": 1, "install": 2, ":env:": 3}
    found: dict[str, tuple[int, str]] = {}
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for line in listing.splitlines():
        m = re.match(r"^(:env:|global|install)\.([a-z-]+)='(.*)'$", line)
        if m and m.group(2) in ("index-url", "extra-index-url", "trusted-host", "cert"):
            variant, key, value = m.groups()
            if rank[variant] >= found.get(key, (0, ""))[0]:
                found[key] = (rank[variant], value)
    args, volumes = [], []
    for key, (_, value) in sorted(found.items()):
        var = "PIP_" + key.upper().replace("-", "_")
        if key == "cert":
            volumes += ["-v", f"{value}:{IN_BUILD_CA}:ro"]
            value = IN_BUILD_CA
        for url in value.split() if key.endswith("index-url") else []:
            if url.startswith("file://"):
                # The folder that holds simple/ and the files its pages link to (../../files/…).
                index = Path(url.removeprefix("file://").rstrip("/"))
                root = index.parent if index.name == "simple" else index
                volumes += ["-v", f"{root}:{root}:ro"]
        args += ["--build-arg", f"{var}={value}"]
    return args, volumes


def debootstrap_rootfs(tarball: Path) -> None:
    """Make the base rootfs as a tarball (apt's lists and caches dropped, as Debian's images do)."""
    work = Path(str(tarball) + f".tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    rootfs = work / "rootfs"
    proc = subprocess.run(
        [
            "debootstrap",
            f"--variant={RECIPE['variant']}",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(rootfs),
            MIRROR,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"debootstrap failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb"):
        for p in rootfs.glob(pattern):
            if p.is_file():
                p.unlink()
    tmp = work / "rootfs.tar"
    subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tmp), "."], check=True)
    tmp.rename(tarball)
    shutil.rmtree(work)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One maker of the base at a time, across test sessions on this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def debian_base() -> str:
    key = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]
    tag = f"localhost/kiln-test-base:{key}"
    started = time.monotonic()
    with locked(CACHE / "lock"):
        if podman("image", "exists", tag).returncode != 0:
            tarball = CACHE / f"{key}.tar"
            if not tarball.exists():
                debootstrap_rootfs(tarball)
            change = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            imported = podman("import", "--change", change, str(tarball), tag, timeout=300)
            assert imported.returncode == 0, imported.stderr
    REPORT.append(f"base image {tag}: ready in {time.monotonic() - started:.0f} s")
    return tag


def image_size(tag: str) -> int:
    proc = podman("image", "inspect", "--format", "{{.Size}}", tag)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip())


@pytest.fixture(scope="session")
def restore_image(debian_base: str) -> Iterator[str]:
    tag = f"localhost/kiln-restore-test:{os.getpid()}"
    pip_args, pip_volumes = pip_settings()
    started = time.monotonic()
    proc = podman(
        "build",
        *ulimits(),
        "--no-cache",
        "--layers=false",  # nothing committed per step: a failed build leaves no image behind
        "--pull=never",
        "--network=host",  # pip reaches the index this machine uses
        "--target=restore",
        f"--build-arg=PYTHON_IMAGE={debian_base}",
        *pip_args,
        *pip_volumes,
        "-t",
        tag,
        "-f",
        str(ROOT / "Dockerfile"),
        str(ROOT),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    built = time.monotonic() - started
    size, base = image_size(tag), image_size(debian_base)
    REPORT.append(
        f"restore image built in {built:.0f} s: {size / 1e6:.0f} MB "
        f"(base {base / 1e6:.0f} MB + kiln and its deps {(size - base) / 1e6:.0f} MB)"
    )
    yield tag
    podman("rmi", "-f", tag)


def test_restore_target_builds_and_runs_torch_free(
    restore_image: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)  # the image runs as uid 1000
    good_archive(data / "a.kiln.tar.zst")

    def run(*args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
        flags = ["--rm", "--network=none", *ulimits(), "-v", f"{data}:/data"]
        if entrypoint:
            flags.append(f"--entrypoint={entrypoint}")
        return podman("run", *flags, restore_image, *args)

    version = run("--version")
    assert version.returncode == 0 and kiln.__version__ in version.stdout, version.stderr
    inspected = run("inspect", "/data/a.kiln.tar.zst", "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["name"] == "demo"
    restored = run("restore", "/data/a.kiln.tar.zst", "--dest", "/data/cache", "--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["files"] == 2
    assert "TORCHINDUCTOR_CACHE_DIR=/data/cache/inductor" in (data / "cache/kiln.env").read_text()
    assert (data / "cache/kiln.env").stat().st_uid == 1000  # the serving container's uid
    again = run("inspect", "/data/cache", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["name"] == "demo", again.stderr

    probe = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('triton'))"
    no_torch = run("-c", probe, entrypoint="python3")
    assert no_torch.returncode == 0, no_torch.stderr
    assert no_torch.stdout.split() == ["None", "None"], no_torch.stdout
    with capsys.disabled():
        print("\n" + "\n".join(REPORT))
