"""Does request order decide whether a restored max-autotune process re-tunes? (GPU diagnostic)

    python scripts/probe-autotune-order.py

Four fresh processes share one cache folder and run two tiny-GPT buckets (batch 1 and 4,
seq 64) in the orders 1,4 / 4,1 / 4,1 / 1,4. Each prints its coordinate-descent benchmarks per
bucket, and which `.best_config` files it created or rewrote (and how their content changed):
a file that two kernels fight over shows up as rewritten in every process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True}
OPTIONS["use_static_cuda_launcher"] = False


def child(order: list[int]) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from models import tiny_gpt
    from torch._dynamo.utils import counters

    device = os.environ.get("KILN_PROBE_DEVICE", "cuda")  # cpu: exercise this script anywhere
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_gpt(vocab=512, dim=128, layers=2, heads=4).to(device, dtype).eval()
    fn = torch.compile(model, dynamic=False, options=OPTIONS)
    per_bucket = {}
    with torch.inference_mode():
        for batch in order:
            before = counters["inductor"]["coordesc_tuning_bench"]
            x = torch.randint(0, 512, (batch, 64), device=device)
            for _ in range(3):
                fn(x)
            per_bucket[batch] = counters["inductor"]["coordesc_tuning_bench"] - before
    print(json.dumps(per_bucket))


def snapshot(root: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in root.rglob("*.best_config")}


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="kiln-probe-order-")) / "inductor"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root)}
    for i, order in enumerate(([1, 4], [4, 1], [4, 1], [1, 4])):
        before = snapshot(root) if root.exists() else {}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", ",".join(map(str, order))],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            print(proc.stderr[-3000:])
            return
        after = snapshot(root)
        new = [n for n in after if n not in before]
        changed = [n for n in after if n in before and after[n] != before[n]]
        benches = proc.stdout.strip().splitlines()[-1]
        print(f"process {i} order {order}: coordesc benches per batch {benches}")
        print(f"  best_configs: {len(after)} total, {len(new)} new, {len(changed)} rewritten")
        for name in changed[:4]:
            old, cur = json.loads(before[name]), json.loads(after[name])
            diff = {k: (old.get(k), cur.get(k)) for k in cur if old.get(k) != cur.get(k)}
            print(f"  {name[:16]} {json.dumps(diff)[:300]}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child([int(b) for b in sys.argv[2].split(",")])
    else:
        main()
