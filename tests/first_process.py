"""The first process after a restore, served as a user serves: what it compiled, tuned, wrote.

``serve_like_a_user`` restores nothing itself: it runs ``tests/user_server.py`` (plain
``torch.compile`` after ``. DIR/kiln.env``, no kiln import) in a fresh interpreter with an
empty ``HOME`` and ``TMPDIR`` (a new pod has both), and compares ``DIR``, ``HOME`` and
``TMPDIR`` by content before and after. Shared by the CPU and GPU tests of issue 25.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
USER_SERVER = ROOT / "tests" / "user_server.py"
# Runtime tuning steps (compilation_time_metrics keys): each run is a kernel tuned in this process.
TUNING_STEPS = (
    "CachingAutotuner.benchmark_all_configs",
    "CachingAutotuner.coordinate_descent_tuning",
    "CachingAutotuner.combo_sequential_autotune",
)


def digest_tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative name -> sha256 (a symlink by its target)."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = "link:" + str(path.readlink())
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@dataclass
class Changes:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    @classmethod
    def between(cls, before: dict[str, str], after: dict[str, str]) -> Changes:
        return cls(
            added=sorted(set(after) - set(before)),
            removed=sorted(set(before) - set(after)),
            changed=sorted(k for k in set(before) & set(after) if before[k] != after[k]),
        )

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass
class Served:
    """What one user process did: per-bucket counters, and what it wrote where."""

    returncode: int
    stderr: str
    buckets: list[dict]
    dest: Changes
    home: list[str]
    tmp: list[str]
    compiler_modules: list[str] = field(default_factory=list)  # Dynamo, Inductor: imported?
    aoti_misses: int | None = None  # calls the AOT route served off its packages

    def work(self) -> dict[str, dict[str, int]]:
        """Per bucket, every kind of compile work that is not zero (on the AOT route, the
        calls its packages did not serve, under the key ``aoti``)."""
        out: dict[str, dict[str, int]] = (
            {"aoti": {"misses": self.aoti_misses}} if self.aoti_misses else {}
        )
        for b in self.buckets:
            c = b["counters"]
            inductor, timed = c.get("inductor", {}), c.get("timed", {})
            kinds = {
                "fx_misses": inductor.get("fxgraph_cache_miss", 0)
                + inductor.get("fxgraph_cache_bypass", 0),
                "aot_misses": aot_compiles(c.get("aot_autograd", {})),
                "kernel_tunings": sum(timed.get(k, 0) for k in TUNING_STEPS),
                "coordesc_benchmarks": inductor.get("coordesc_tuning_bench", 0),
            }
            kinds = {k: v for k, v in kinds.items() if v}
            if kinds:
                out[b["key"]] = kinds
        return out

    def benchmarks(self) -> int:
        """Benchmark calls (inductor counters; on an FX hit these include what the bake's
        compile recorded, so only a compile-time-benchmark-free mode expects 0)."""
        return sum(
            v
            for b in self.buckets
            for k, v in b["counters"].get("inductor", {}).items()
            if k.startswith("benchmarking.")
        )

    def summary(self) -> dict:
        return {
            "rc": self.returncode,
            "work": self.work(),
            "benchmarks": self.benchmarks(),
            "dest": vars(self.dest),
            "home": self.home,
            "tmp": self.tmp,
            "compiler_modules": self.compiler_modules,
            "first_calls_s": {b["key"]: round(b["first_call_s"], 3) for b in self.buckets},
        }


def aot_compiles(aot: dict[str, int]) -> int:
    """AOT cache misses AOTAutograd went on to compile. A run that neither finished ("ok") nor
    failed ("not_ok") was abandoned by Dynamo restarting its trace, which ``dynamic=True``
    does once per graph in every process: that run's lookup always misses and compiles nothing
    (kiln.compiler.counters says the same)."""
    misses = aot.get("autograd_cache_miss", 0)
    restarted = aot.get("total", 0) - aot.get("ok", 0) - aot.get("not_ok", 0)
    abandoned = max(0, restarted - aot.get("autograd_cache_bypass", 0))  # a bypass first
    return misses - min(misses, abandoned)


def user_env(home: Path, tmp: Path) -> dict[str, str]:
    """This environment as a fresh pod's: no cache locations of ours, an empty HOME and TMPDIR."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "KILN_", "TORCH_COMPILE"))
        and k not in {"PYTHONPYCACHEPREFIX"}
    }
    return env | {"HOME": str(home), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}


def serve_like_a_user(
    spec: Path,
    dest: Path,
    work: Path,
    *,
    order: str = "grid",
    seed: int = 0,
    server: Path = USER_SERVER,
    env: dict[str, str] | None = None,
    exports: dict[str, str] | None = None,
    timeout: float = 900,
    cwd: Path | None = None,
) -> Served:
    """Run ``server`` as the next process on ``dest`` (``. dest/kiln.env`` first), started in
    ``cwd`` (the image's WORKDIR; this process's by default). ``env`` is the image's
    environment, which ``kiln.env`` may change; ``exports`` are set after it."""
    home, tmp = work / "home", work / "tmp"
    home.mkdir(parents=True)
    tmp.mkdir(parents=True)
    out = work / "served.json"
    before = digest_tree(dest)
    after = "".join(f"export {k}={shlex.quote(v)} && " for k, v in (exports or {}).items())
    script = f'. "$1/kiln.env" && {after}shift && exec "$@"'
    argv = [sys.executable, str(server), str(spec), str(out), "--order", order]
    argv += ["--seed", str(seed)]
    proc = subprocess.run(
        ["sh", "-c", script, "sh", str(dest), *argv],
        env=user_env(home, tmp) | ({"PWD": str(cwd)} if cwd else {}) | (env or {}),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return Served(
        returncode=proc.returncode,
        stderr=proc.stderr[-4000:],
        buckets=report.get("buckets", []),
        compiler_modules=report.get("compiler_modules", []),
        aoti_misses=report.get("aoti_misses"),
        dest=Changes.between(before, digest_tree(dest)),
        home=sorted(digest_tree(home)),
        tmp=sorted(digest_tree(tmp)),
    )
