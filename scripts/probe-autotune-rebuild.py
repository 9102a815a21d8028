"""Why does a fresh process rebuild Triton kernels under max-autotune? (GPU diagnostic)

    python scripts/probe-autotune-rebuild.py [MODE]     # default: max-autotune-no-cudagraphs
    KILN_PROBE_OPTIONS='{"max_autotune": true, ...}' python scripts/probe-autotune-rebuild.py

Runs the same tiny GPT bucket in three fresh processes sharing one cache folder, then a fourth
in a copy of that folder at another path (as a restore would). For every `.cubin` a later
process added, prints how its Triton metadata (`.json`) differs from the earlier build of the
same kernel name: the options in which the cache keys must differ. `KILN_PROBE_OPTIONS` (JSON)
compiles with `options=` instead of `mode=`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(mode: str) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from models import tiny_gpt
    from torch._dynamo.utils import counters

    device = os.environ.get("KILN_PROBE_DEVICE", "cuda")  # cpu: exercise this script anywhere
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_gpt(vocab=512, dim=128, layers=2, heads=4).to(device, dtype).eval()
    options = os.environ.get("KILN_PROBE_OPTIONS")
    kwargs = {"options": json.loads(options)} if options else {"mode": mode}
    fn = torch.compile(model, dynamic=False, **kwargs)
    x = torch.randint(0, 512, (1, 64), device=device)
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
    print(json.dumps({k: dict(counters[k]) for k in ("inductor", "aot_autograd")}))


def _source(meta: Path) -> bytes:
    src = meta.with_suffix(".source")
    return src.read_bytes() if src.exists() else b""


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "max-autotune-no-cudagraphs"
    root = Path(tempfile.mkdtemp(prefix="kiln-probe-")) / "inductor"
    for i in range(4):
        if i == 3:  # the same cache, moved: what a restore into another path sees
            moved = root.parent / "moved" / "inductor"
            shutil.copytree(root, moved)
            root = moved
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root)}
        before = files(root) if root.exists() else set()
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True
        )
        new = sorted(files(root) - before)
        cubins = [n for n in new if n.endswith(".cubin")]
        configs = [n for n in new if n.endswith(".best_config")]
        print(
            f"process {i}{' (moved)' if i == 3 else ''}: rc {proc.returncode}, "
            f"{len(new)} new files, {len(cubins)} cubins, {len(configs)} best_configs"
        )
        last = (proc.stdout.strip().splitlines() or ["{}"])[-1]
        inductor = json.loads(last).get("inductor", {}) if last.startswith("{") else {}
        keys = ("fxgraph_cache_hit", "fxgraph_cache_miss", "coordesc_tuning_bench")
        keys += ("triton_bundler_load_static_autotuner", "select_algorithm_autotune")
        print("  counters", {k: inductor.get(k, 0) for k in keys})
        if proc.returncode:
            print(proc.stderr[-3000:])
            return
        for c in cubins[:2] if i else []:
            new_json = (root / c).with_suffix(".json")
            name = new_json.name
            new_meta = json.loads(new_json.read_text())
            for old in [p for p in root.rglob(name) if p != new_json][:2]:
                old_meta = json.loads(old.read_text())
                diff = {
                    k: (old_meta.get(k), new_meta.get(k))
                    for k in sorted(set(old_meta) | set(new_meta))
                    if old_meta.get(k) != new_meta.get(k) and k != "hash"
                }
                same_src = _source(old) == _source(new_json)
                print(
                    f"  {c}: vs {old.parent.name[:12]} same source {same_src} diff "
                    + json.dumps(diff, default=str)[:800]
                )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
