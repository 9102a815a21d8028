"""Why does a restored max-autotune cache re-tune when the bake folder itself does not? (GPU)

    python scripts/probe-kiln-autotune.py

Bakes the GPU tests' max-autotune spec keeping the bake folder, restores it elsewhere, verifies
in the order 4,1 and prints: files the bake folder has that the restore lacks, what verify
added (by suffix), `.best_config` files it rewrote, and whether each new kernel source exists
in the bake folder under the same name.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kiln  # noqa: E402
from tests.test_gpu import gpt_spec  # noqa: E402


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "locks" not in p.parts
    }


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kiln-probe-kiln-"))
    spec = work / "spec.yaml"
    text = gpt_spec("gpt-mat", "max-autotune-no-cudagraphs")
    if os.environ.get("KILN_PROBE_DEVICE") == "cpu":  # exercise this script anywhere
        text = text.replace("max-autotune-no-cudagraphs", "default").replace("cuda", "cpu")
    spec.write_text(text)
    result = kiln.bake(spec, work / "a.kiln.tar.zst", keep_workdir=True)
    print("passes", [(p.order, p.compiles) for p in result.manifest.passes])
    baked = tree(result.workdir / "inductor")
    home = result.workdir / "triton-home"
    print("triton-home files", sum(1 for p in home.rglob("*") if p.is_file()))
    dest = work / "x" / "cache"
    kiln.restore(result.artifact, dest)
    restored = tree(dest / "inductor")
    print("in bake folder, not restored:", sorted(set(baked) - set(restored))[:10])
    report = kiln.verify(spec, dest, order="reverse")
    print("verify ok", report.ok, [(b.key, b.new_native, b.autotunes) for b in report.buckets])
    after = tree(dest / "inductor")
    new = sorted(set(after) - set(restored))
    print("verify added", collections.Counter(Path(n).suffix for n in new))
    rewritten = [n for n in restored if n in after and after[n] != restored[n]]
    print("verify rewrote", rewritten[:10])
    for n in rewritten:
        if n.endswith(".best_config"):
            old, cur = json.loads(restored[n]), json.loads(after[n])
            print("  ", n, {k: (old.get(k), cur.get(k)) for k in cur if old.get(k) != cur.get(k)})
    for n in [n for n in new if n.endswith(".py")][:5]:
        print("  new source", n, "in bake folder:", n in baked)
    names = {Path(n).name for n in baked}
    for n in [n for n in new if n.endswith(".best_config")][:5]:
        print("  new best_config", n, "same name in bake folder:", Path(n).name in names)


if __name__ == "__main__":
    main()
