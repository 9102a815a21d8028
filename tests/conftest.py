"""Shared fixtures: real specs, one real CPU bake per session, and the CLI as users run it."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import cli_forks

if TYPE_CHECKING:
    from kiln.artifact.manifest import Manifest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"

# Blocks torch for the child: proves a command never imports it.
NO_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None; "

# One OpenMP thread for this run's torch and every process it starts (unless the caller chose):
# the xdist workers already keep every core busy, each with bakes whose workers run g++ and
# OpenMP kernels of as many threads as cores. Measured on the 2-core CI machine, tiny-gpt bakes
# (--no-prove): alone 57.4 -> 54.3 s, two at once 89.3 -> 83.1 s and 126.8 -> 115.8 s (another
# run beside them), 3-6% less CPU. The kernels Inductor generates for one thread differ, but
# every bake, verify and server of a run shares the setting, as a real deployment does.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Inductor proves each CPU vector ISA it may use by building a probe with g++ and loading it in
# a child interpreter: 10 builds and 10 interpreters in every process that compiles into a new
# cache root (every bake's first pass, every cold run), ~8 s of a 27.6 s MLP bake on 2 cores
# (18.1 s with the setting below). The run trusts the CPU's flags for each ISA's base probe (one
# machine, the same answer; the AVX-512 and AMX variants still build their extra probes, 6 builds
# left in a bake), and every process of it shares the setting, which is in Inductor's cache key.
# The tests whose subject is what a process builds or writes (tests/test_first_process.py, `kiln
# check`'s kept probes) serve with the probes real: ``real_isa_probes`` below.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


# Parsing torch's vector headers is almost all of each C++ kernel build on the CPU (1.85 s of
# 1.9 s here) and the suite builds ~200: the run's g++ (tests/tools/gxx_pch.py, first on PATH)
# compiles them against a precompiled copy of the header, built once per set of options into
# the test venv (`make clean` removes it; outside a venv the run compiles as torch does), and
# copies a library it built before for the same build in another cache root. It runs on this
# run's interpreter (KILN_TEST_PYTHON): `python3` on PATH may be a version manager's shim,
# 95 ms a start against 35 ms here, and the run starts its g++ ~1,200 times. KILN_TEST_PCH=0
# turns it off. Inductor's command lines, cache keys and kernel code stay as they are.
# docs/development.md has the figures.
def _use_the_runs_gxx() -> None:
    in_venv = sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK)
    if os.environ.get("KILN_TEST_PCH", "1") == "0" or not in_venv:
        return
    os.environ.setdefault("KILN_TEST_PCH_DIR", str(Path(sys.prefix) / "kiln-test-pch"))
    os.environ.setdefault("KILN_TEST_PYTHON", sys.executable)
    tools = str(ROOT / "tests" / "tools")
    if tools not in os.environ["PATH"].split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([tools, os.environ["PATH"]])


_use_the_runs_gxx()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slow tests first (a stable sort: file order otherwise): spread over xdist workers, the
    # minutes-long bakes start at once and the quick tests fill in behind them, instead of one
    # long bake starting last while the other workers sit idle. (Dealing the bakes out evenly,
    # longest first, was measured: two bakes at once on 2 cores made each ~30% slower, and the
    # run no shorter.)
    items.sort(key=lambda item: "slow" not in item.keywords)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Torch's Inductor sets TORCHINDUCTOR_CACHE_DIR in os.environ the first time this process asks
# for its cache folder (torch._inductor.runtime.cache_dir_utils.cache_dir); every child a later
# test starts would then inherit it (`kiln check` called that a moved cache: exit 5). Each test
# starts with the variable as the run had it.
RUN_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(autouse=True)
def inductor_cache_dir_as_the_run_had_it() -> Iterator[None]:
    yield
    if RUN_CACHE_DIR is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = RUN_CACHE_DIR


def gpt_spec(
    name: str,
    mode: str,
    precompile: str = "",
    *,
    compile_lines: tuple[str, ...] = (),
    seqs: str | None = None,
) -> str:
    """The GPU tests' tiny GPT on cuda. ``precompile``: "" (folder caches), "precompile" (AOT
    forwards, fullgraph) or "frames" (Dynamo's saved frames, the route for models with graph
    breaks); ``compile_lines``: more of the compile section (``route: aoti``)."""
    # max-autotune benchmarks every GEMM at bake time: a smaller grid keeps the run short.
    if seqs is None:
        seqs = "[64]" if mode.startswith("max-autotune") else "[64, 256]"
    aot = {
        "precompile": ["  fullgraph: true", "  precompile: true"],
        "frames": ["  precompile: true"],
    }.get(precompile, [])
    return "\n".join(
        [
            f"name: {name}",
            "model:",
            f"  factory: {MODELS}:tiny_gpt",
            "  kwargs: {vocab: 512, dim: 128, layers: 2, heads: 4}",
            "  dtype: bfloat16",
            "  device: cuda",
            "compile:",
            f"  mode: {mode}",
            "  dynamic: false",
            *aot,
            *(f"  {line}" for line in compile_lines),
            "inputs:",
            "  - {name: input_ids, shape: [batch, seq], dtype: int64, fill: randint,",
            "     low: 0, high: 512}",
            "buckets:",
            "  batch: [1, 4]",
            f"  seq: {seqs}",
            "warmup: {calls: 3}",
            "",
        ]
    )


def mlp_spec(name: str = "tiny-mlp", *, dynamic: str = "false", buckets: str = "") -> str:
    """A 12-line spec for the tiny MLP (tests count on its line numbers)."""
    lines = [
        f"name: {name}",
        "model:",
        f"  factory: {MODELS}:tiny_mlp",
        "  kwargs: {dim: 16, hidden: 32}",
        "  call_kwargs: {scale: 2.0}",
        "compile:",
        f"  dynamic: {dynamic}",
        "inputs:",
        "  - {name: x, shape: [batch, 16], dtype: float32, fill: randn}",
        "buckets:",
        *(f"  {b}" for b in (buckets or "batch: [2, 3, 5]").split("\n")),
        "warmup: {calls: 2}",
    ]
    return "\n".join(lines) + "\n"


def import_scratch(prefix: str) -> Path:
    """A folder for what a test module builds at import, before any fixture can run (the
    examples hypothesis draws from), removed when this test process exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@pytest.fixture
def write_spec(tmp_path: Path):
    def write(text: str, name: str = "spec.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write


class Cli:
    """Runs ``kiln ARGS`` in a process of its own: real argv, environment, exit code, stdout and
    stderr; forked from a server that has imported kiln already (tests/cli_forks.py says why and
    what that changes), or started from scratch where calls overlap."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd

    def __call__(
        self,
        *args: str,
        no_torch: bool = False,
        env: dict[str, str] | None = None,
        timeout: float = 900,
    ) -> subprocess.CompletedProcess[str]:
        prelude = NO_TORCH if no_torch else "import sys; "
        return run_kiln(self.cwd, args, prelude=prelude, env=env, timeout=timeout)


def run_kiln(
    cwd: Path,
    args: tuple[object, ...],
    *,
    prelude: str,
    env: dict[str, str] | None,
    timeout: float,
    limits: tuple[int, int] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``kiln ARGS`` after ``prelude``, forked from a warm server (tests/cli_forks.py), or
    started plain where a fork cannot stand in; ``limits`` (bytes of address space, CPU
    seconds) as ``setrlimit`` sets them."""
    import resource

    argv = ["kiln", *map(str, args)]
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
    forked = cli_forks.run_cli(argv, cwd, full_env, prelude=prelude, timeout=timeout, limits=limits)
    if forked is not None:
        return forked

    def limit() -> None:
        if limits:
            resource.setrlimit(resource.RLIMIT_AS, (limits[0], limits[0]))
            resource.setrlimit(resource.RLIMIT_CPU, (limits[1], limits[1]))

    code = f"{prelude}sys.argv = {argv!r}; from kiln.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit if limits else None,
    )


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


@pytest.fixture(scope="session", autouse=True)
def own_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This test process's own ``TMPDIR``: a bake works in ``$TMPDIR/kiln-bake-UID/NAME`` under a
    lock per spec name, so without it the xdist workers (and any other test run on the machine)
    would bake their ``tiny-mlp`` one after the other."""
    tmp = tmp_path_factory.mktemp("tmpdir", numbered=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp))
        mp.setattr(tempfile, "tempdir", None)  # re-read from TMPDIR on next use
        yield tmp


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every xdist worker of this run sees (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/popen-gwK -> pytest-N, shared by the workers
    folder = base / name
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def once(folder: Path) -> Iterator[bool]:
    """Hold ``folder``'s lock; yields whether its work is still to do. Leaving the block without
    an error marks it done, so the first process does the work and the others wait and reuse it."""
    with open(folder / ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        done = folder / ".done"
        todo = not done.exists()
        yield todo
        if todo:
            done.touch()


# The bakes shared by the tests that only read what a bake made (restore it into their own
# folder, verify, inspect, compare): each is made once per test run, by whichever xdist worker
# first needs it, while the other waits on its lock and reuses it. A test that changes an
# artifact or a restored folder works on its own copy. Every bake runs under one fixed
# SOURCE_DATE_EPOCH, so a second bake of the same spec can be compared with it byte for byte.
SHARED_EPOCH = "1700000000"


def bake_once(
    tmp_path_factory: pytest.TempPathFactory,
    folder: str,
    spec_text: str,
    files: dict[str, str] | None = None,
    *,
    restore: bool = False,
    exact_builds: bool = False,
    **bake_kwargs: object,
) -> tuple[Path, Any]:
    """``kiln.bake`` of ``spec_text`` (beside ``files``, e.g. the model module it names) in the
    run's shared folder ``folder``, made once per run; returns the spec's path and the result.
    ``restore``: also restore it, once, into the folder's ``restored/`` (read only: a test that
    changes a restored folder restores or copies its own). ``exact_builds``: g++ builds every
    library at this path, none copied from a build elsewhere, whose debug information names
    another folder (for a test that compares libraries byte for byte)."""
    d = shared_dir(tmp_path_factory, folder)
    spec_path = d / "spec.yaml"
    saved = d / "result.pickle"
    with once(d) as todo:
        if todo:
            import kiln

            for name, text in (files or {}).items():
                (d / name).write_text(text)
            spec_path.write_text(spec_text)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SOURCE_DATE_EPOCH", SHARED_EPOCH)
                # Its own TMPDIR: the bake's work folder (whose path torch writes into what it
                # compiles) is then the same whichever worker bakes, and a second bake of the
                # spec can compile at the same path (tests/test_reproducible.py).
                mp.setenv("TMPDIR", str(bake_tmpdir(spec_path)))
                mp.setattr(tempfile, "tempdir", None)
                if exact_builds:  # every library built here (tests/tools/gxx_pch.py)
                    mp.setenv("KILN_TEST_GXX_KEEP", "0")
                name = kiln.load_spec(spec_path).name
                result = kiln.bake(spec_path, d / f"{name}.kiln.tar.zst", **bake_kwargs)
            if restore:
                kiln.restore(result.artifact, d / "restored")
            saved.write_bytes(pickle.dumps(result))
    return spec_path, pickle.loads(saved.read_bytes())


def bake_tmpdir(spec_path: Path) -> Path:
    """The ``TMPDIR`` the shared bake of ``spec_path`` compiled under."""
    tmp = spec_path.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


@pytest.fixture(scope="session")
def baked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One real CPU bake of the 3-bucket MLP (``mlp_spec()``), shared by the tests that read
    artifacts (test_roundtrip, test_cli_render, test_deploy, test_reproducible)."""
    return bake_once(tmp_path_factory, "baked", mlp_spec(), exact_builds=True)


def aoti_spec(
    name: str = "aoti-mlp", compile_extra: str = "", buckets: str = "[2, 3]", dynamic: str = "false"
) -> str:
    """The tiny MLP (call_kwargs scale: 2.0) on the AOT route; compile's keys from line 7."""
    text = mlp_spec(name, buckets=f"batch: {buckets}", dynamic=dynamic)
    extra = "".join(f"\n  {line}" for line in compile_extra.splitlines() if line)
    return text.replace("compile:\n", f"compile:\n  route: aoti\n  fullgraph: true{extra}\n", 1)


@pytest.fixture(scope="session")
def aoti_baked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Manifest]:
    """One real bake of the MLP on the AOT route (2 buckets), restored: made once per run."""
    spec, result = bake_once(tmp_path_factory, "aoti", aoti_spec(), restore=True)
    assert result is not None
    return spec, spec.parent / "restored", result.manifest


@pytest.fixture
def real_isa_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test and its processes prove CPU ISAs with g++ as torch does by default."""
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs, for the test to remount read-only (``remount,ro``) once it has written what it
    needs: root ignores file modes, not a read-only mount."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)])
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """A DEST that already holds a restored artifact: every attack must leave it as it was."""
    from kiln.artifact.restore import restore
    from tests.archives import good_archive

    dest = tmp_path / "cache"
    restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/old": b"old"}), dest)
    return dest


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: hypothesis' deadline only judges an example once it returns."""

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# What a hostile input may cost `kiln merge`/`kiln restore` in the fuzz and hostile-input
# tests: address space and CPU seconds, enforced by the kernel in the child (resource.setrlimit),
# so a bomb ends the child (MemoryError, SIGXCPU) instead of the test machine.
LIMIT_MEMORY = 1 << 30
LIMIT_CPU_S = 30


def limited_cli(
    cwd: Path,
    *args: object,
    memory: int = LIMIT_MEMORY,
    cpu_s: int = LIMIT_CPU_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``kiln ARGS`` without torch in a child limited to ``memory`` bytes of address space and
    ``cpu_s`` CPU seconds (and four times that in wall time)."""
    return run_kiln(cwd, args, prelude=NO_TORCH, env=env, timeout=4 * cpu_s, limits=(memory, cpu_s))
