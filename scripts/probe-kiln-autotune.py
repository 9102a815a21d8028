"""Why does a restored max-autotune cache sometimes re-tune? (GPU diagnostic)

    python scripts/probe-kiln-autotune.py [RESTORES]      # default 4

Bakes the GPU tests' max-autotune spec keeping the bake folder, then restores it RESTORES times
at new paths and verifies each (shuffled with several seeds, and reversed), printing one line per
verify: how often re-tuning happens. At the first failing verify it prints what verify added and
rewrote, and asks torch, in a fresh process with the serving environment, whether each re-tuned
kernel's tuning-cache lookup hits (`autotune_cache_info`, the `.best_config` beside the source).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kiln  # noqa: E402
from kiln.artifact import read_manifest  # noqa: E402
from kiln.serving import cache_env  # noqa: E402
from tests.test_gpu import gpt_spec  # noqa: E402

# Imports each kernel module that defines one of the named kernels, as an FX hit would, and
# prints what Inductor's tuning-cache lookup found for it.
LOOKUP = r"""
import importlib.util, json, sys
from pathlib import Path
root, names = Path(sys.argv[1]), set(sys.argv[2:])
for py in sorted(root.rglob("*.py")):
    text = py.read_text(errors="ignore")
    hit = sorted(n for n in names if f"def {n}(" in text)
    if not hit or "triton_heuristics" not in text:
        continue
    spec = importlib.util.spec_from_file_location(py.stem, py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k = getattr(mod, hit[0])
    configs = getattr(k, "configs", [])
    print(json.dumps({
        "kernel": hit[0], "file": py.relative_to(root).as_posix(),
        "info": getattr(k, "autotune_cache_info", None), "configs": len(configs),
        "found_by_coordesc": [getattr(c, "found_by_coordesc", None) for c in configs][:3],
        "best_configs_beside": [p.name[:12] for p in py.parent.glob("*.best_config")],
    }, default=str))
"""


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "locks" not in p.parts
    }


def explain_failure(result, spec: Path, dest: Path, report, restored: dict[str, bytes]) -> None:
    after = tree(dest / "inductor")
    new = sorted(set(after) - set(restored))
    print("  verify added", dict(collections.Counter(Path(n).suffix for n in new)))
    rewritten = [n for n in restored if n in after and after[n] != restored[n]]
    print("  verify rewrote", dict(collections.Counter(Path(n).suffix for n in rewritten)))
    for n in rewritten:
        if n.endswith(".best_config"):
            old, cur = json.loads(restored[n]), json.loads(after[n])
            diff = {k: (old.get(k), cur.get(k)) for k in cur if old.get(k) != cur.get(k)}
            print("   ", n, diff)
    names = sorted({Path(f).stem for b in report.buckets for f in b.new_files})
    print("  re-tuned kernels", names)
    baked = result.workdir / "inductor"
    for label, where in (("restored", dest), ("bake folder", baked.parent)):
        root = where / "inductor"
        env = {**os.environ, **cache_env(where, read_manifest(dest).env)}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root)
        proc = subprocess.run(
            [sys.executable, "-c", LOOKUP, str(root), *names],
            env=env,
            capture_output=True,
            text=True,
        )
        print(f"  lookups in the {label}:")
        for line in proc.stdout.splitlines():
            print("   ", line[:400])
        if proc.returncode:
            print(proc.stderr[-1500:])


def main() -> None:
    restores = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    work = Path(tempfile.mkdtemp(prefix="kiln-probe-kiln-"))
    spec = work / "spec.yaml"
    text = gpt_spec("gpt-mat", "max-autotune-no-cudagraphs")
    if os.environ.get("KILN_PROBE_DEVICE") == "cpu":  # exercise this script anywhere
        text = text.replace("max-autotune-no-cudagraphs", "default").replace("cuda", "cpu")
    spec.write_text(text)
    result = kiln.bake(spec, work / "a.kiln.tar.zst", keep_workdir=True)
    print("passes", [(p.order, p.compiles) for p in result.manifest.passes])
    explained = False
    runs = [("reverse", 0)] + [("shuffle", seed) for seed in range(1, restores)]
    for i, (order, seed) in enumerate(runs[:restores]):
        dest = work / f"restore-{i}" / "cache"
        kiln.restore(result.artifact, dest)
        restored = tree(dest / "inductor")
        report = kiln.verify(spec, dest, order=order, seed=seed)
        print(f"verify {i} ({order}, seed {seed}): {'ok' if report.ok else 'FAILED'}", end=" ")
        print(report.order, report.reasons())
        if not report.ok and not explained:
            explain_failure(result, spec, dest, report, restored)
            explained = True


if __name__ == "__main__":
    main()
