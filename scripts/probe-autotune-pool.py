"""Does a warm max-autotune process re-tune the kernels it loads in Inductor's worker pool?

    python scripts/probe-autotune-pool.py          # GPU diagnostic, about 4 minutes on the H200

The hypothesis it tests: on an FX hit, a Triton kernel loaded in the compile worker pool comes
back to the parent pickled, and ``triton.Config.__setstate__`` keeps only its own fields, so the
``found_by_coordesc`` flag that Inductor set from the ``.best_config`` file is gone and the first
call runs coordinate descent again. Kernels loaded in-process keep the flag. Whether the pool is
ready when a graph loads is a race, which would explain re-tuning in only some restored runs and
only in a later graph. kiln's autotuning specs therefore serve with ``compile_threads: 1``.

Steps: three processes share one folder (the first cold, with the pool; the next two warm, with
``compile_threads: 1``, as kiln's bake passes do), then each variant runs in its own copy of the
folder at a new path, with the pool made ready *before* compiling so that the race always goes
the same way:

- ``pool``: the serving options without ``compile_threads`` (kernels load in the pool);
- ``kiln``: the serving options kiln records (``compile_threads: 1``).

Prints the pickling check, then one row per process: FX hits, coordinate-descent benchmarks and
new cubins. ``KILN_PROBE_DEVICE=cpu`` exercises the script anywhere (no Triton kernels there).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = {
    "max_autotune": True,
    "coordinate_descent_tuning": True,
    "use_static_cuda_launcher": False,
}


def child(options_json: str, wait_pool: bool) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from models import tiny_gpt
    from torch._dynamo.utils import counters

    if wait_pool:  # with the default thread count, outside compile's option patch
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.wait_pool_ready()
    device = os.environ.get("KILN_PROBE_DEVICE", "cuda")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_gpt(vocab=512, dim=128, layers=2, heads=4).to(device, dtype).eval()
    fn = torch.compile(model, dynamic=False, options=json.loads(options_json))
    with torch.inference_mode():
        for batch in (4, 1):  # the GPU tests' grid, in the order that re-tuned
            x = torch.randint(0, 512, (batch, 64), device=device)
            for _ in range(3):
                fn(x)
    print(json.dumps({k: dict(counters[k]) for k in ("inductor", "aot_autograd")}))


def run(root: Path, options: dict, wait_pool: bool) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root), "PYTHONUNBUFFERED": "1"}
    env["TRITON_CACHE_DIR"] = str(root / "triton")  # travels with the copy
    before = cubins(root)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(options), str(int(wait_pool))],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(f"child failed:\n{proc.stderr[-3000:]}")
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    inductor = counts["inductor"]
    return {
        "fx_hits": inductor.get("fxgraph_cache_hit", 0),
        "coordesc_benches": inductor.get("coordesc_tuning_bench", 0),
        "new_cubins": len(cubins(root) - before),
    }


def cubins(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*.cubin")}


def pickling_check() -> str:
    try:
        import triton
    except ImportError:
        return "triton not installed"
    config = triton.Config({"XBLOCK": 64}, num_warps=4)
    config.found_by_coordesc = True
    back = pickle.loads(pickle.dumps(config))
    return (
        f"triton {triton.__version__}: found_by_coordesc after a pickle round trip = "
        f"{getattr(back, 'found_by_coordesc', None)!r} (before: True)"
    )


def main() -> None:
    print(pickling_check())
    work = Path(tempfile.mkdtemp(prefix="kiln-probe-pool-"))
    shared = work / "shared" / "inductor"
    serving = {**BASE, "compile_threads": 1}
    rows = [
        ("1 cold, pool", run(shared, BASE, wait_pool=False)),
        ("2 warm, compile_threads 1", run(shared, serving, wait_pool=False)),
        ("3 warm, compile_threads 1", run(shared, serving, wait_pool=False)),
    ]
    for name, options in (("pool", BASE), ("kiln", serving)):
        copy = work / name / "moved" / "inductor"
        shutil.copytree(shared, copy, symlinks=True)
        rows.append((f"copy, {name}, pool ready first", run(copy, options, wait_pool=True)))
    print(f"{'process':<34} {'FX hits':>8} {'coordesc benches':>17} {'new cubins':>11}")
    for name, row in rows:
        print(
            f"{name:<34} {row['fx_hits']:>8} {row['coordesc_benches']:>17} {row['new_cubins']:>11}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3] == "1")
    else:
        main()
