"""A model server written the way a user writes one: no kiln import, plain ``torch.compile``
(or, for an artifact of AOTInductor packages, ``kiln.activate(DIR).compile(model)``: the one
way the README serves that route).

    . DIR/kiln.env && python tests/user_server.py SPEC.yaml OUT.json [--order grid|reverse|shuffle]

What a user has: their model (the spec names its factory), the shapes they serve (the spec's
grid) and the compile arguments kiln printed for the artifact (``kiln inspect``; read here from
``DIR/manifest.json``, ``DIR`` being ``$KILN_CACHE_DIR`` that ``kiln.env`` exported). It raises
Dynamo's recompile limit to the grid, as the README tells servers with more than 8 static
shapes to, then serves every bucket ``calls`` times under ``torch.inference_mode()``.

Tests judge it from outside (the files it wrote) and from what it reports: torch's own counters
per bucket, read after each bucket's calls, which changes nothing the process does.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

COMPILER_MODULES = ("torch._dynamo", "torch._inductor")


def load_factory(spec_path: Path, factory: str):
    target, _, attr = factory.partition(":")
    path = (spec_path.parent / target).resolve()
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def grid(spec: dict) -> list[dict[str, int]]:
    axes = list(spec["buckets"])
    out = []
    for combo in itertools.product(*(spec["buckets"][a] for a in axes)):
        sizes = dict(zip(axes, combo, strict=True))
        excluded = any(all(sizes[a] == v for a, v in ex.items()) for ex in spec.get("exclude", []))
        if not excluded:
            out.append(sizes)
    return out


def make_inputs(torch, spec: dict, sizes: dict[str, int], device, seed: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for inp in spec["inputs"]:
        shape = [sizes[d] if isinstance(d, str) else d for d in inp["shape"]]
        dtype = getattr(torch, inp.get("dtype", "float32"))
        fill = inp.get("fill", "randn")
        if fill == "randint":
            t = torch.randint(inp.get("low", 0), inp["high"], shape, generator=gen, dtype=dtype)
        elif fill == "randn":
            t = torch.randn(shape, generator=gen).to(dtype)
        elif fill == "ones":
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.zeros(shape, dtype=dtype)
        out[inp["name"]] = t.to(device)
    return out


def counters_now() -> dict[str, Counter]:
    """torch's counters, plus how many times each timed compile step ran (never replayed from
    a cache entry, unlike the inductor counters an FX hit adds back); none in a process that
    has not imported Dynamo (the AOT route's), which reading them would import."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import compilation_time_metrics, counters

    now = {group: Counter(values) for group, values in counters.items()}
    now["timed"] = Counter({k: len(v) for k, v in compilation_time_metrics.items()})
    return now


def difference(after: dict[str, Counter], before: dict[str, Counter]) -> dict[str, dict]:
    out = {}
    for group, values in after.items():
        diff = {k: v - before.get(group, Counter()).get(k, 0) for k, v in values.items()}
        diff = {k: v for k, v in diff.items() if v}
        if diff:
            out[group] = diff
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--order", default="grid", choices=["grid", "reverse", "shuffle"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.time()
    spec = yaml.safe_load(args.spec.read_text())
    cache = Path(os.environ["KILN_CACHE_DIR"])
    manifest = json.loads((cache / "manifest.json").read_text())

    import torch

    model_spec = spec["model"]
    device = torch.device(model_spec.get("device", "cpu"))
    factory = load_factory(args.spec, model_spec["factory"])
    model = factory(**model_spec.get("kwargs", {}))
    model = model.to(device=device, dtype=getattr(torch, model_spec.get("dtype", "float32")))
    model = model.eval()
    buckets = grid(spec)
    if manifest.get("aoti"):
        import kiln

        compiled = kiln.activate(cache).compile(model)
    else:
        torch._dynamo.config.recompile_limit = max(8, 2 * len(buckets) + 2)
        compiled = torch.compile(model, **manifest["compile_kwargs"])
    order = {"grid": buckets, "reverse": buckets[::-1]}.get(args.order)
    if order is None:
        order = list(buckets)
        random.Random(args.seed).shuffle(order)
    calls = max(int(spec.get("warmup", {}).get("calls", 1)), 3)
    call_kwargs = model_spec.get("call_kwargs") or {}
    report = []
    with torch.inference_mode():
        for i, sizes in enumerate(order):
            before = counters_now()
            t0 = time.perf_counter()
            for call in range(calls):
                inputs = make_inputs(torch, spec, sizes, device, seed=1000 * i + call)
                compiled(**inputs, **call_kwargs)
                if call == 0:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    first = time.perf_counter() - t0
            key = ",".join(f"{a}={s}" for a, s in sizes.items())
            report.append(
                {"key": key, "first_call_s": first, "counters": difference(counters_now(), before)}
            )
    result = {
        "buckets": report,
        "compiler_modules": sorted(m for m in sys.modules if m in COMPILER_MODULES),
        "aoti_misses": getattr(compiled, "misses", None),
        "wall_s": time.time() - started,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
