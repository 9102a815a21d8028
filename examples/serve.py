"""A minimal model server that uses kiln's restored caches (the pattern, not a product).

    python examples/serve.py configs/tiny-gpt.yaml --cache out/cache --port 8000

It activates the caches before compiling, compiles with exactly the baked arguments (or loads the
precompiled forwards when the artifact has them, skipping Dynamo, or the AOTInductor packages of a
``compile.route: aoti`` artifact, skipping Dynamo and Inductor), warms every bucket (3 calls:
enough for CUDA graphs to record), and only then answers /ready with 200 and the number of
compiles the warmup caused (0 when the caches hit).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kiln.compiler import ignore_numpy_warning

ignore_numpy_warning()  # before torch's import: its CPU wheel warns when numpy is absent

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln.compiler.model_import import make_inputs, resolve_factory  # noqa: E402
from kiln.grid import expand  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    activation = kiln.activate(args.cache, compat="fail")  # before the first torch.compile
    spec = kiln.load_spec(args.spec)
    device = torch.device(spec.model.device)
    model = resolve_factory(spec)(**spec.model.kwargs)
    model = model.to(device=device, dtype=getattr(torch, spec.model.dtype)).eval()
    compiled = activation.compile(model)
    state: dict[str, object] = {"ready": False}

    def warm() -> None:
        with torch.inference_mode():
            for i, bucket in enumerate(expand(spec)):
                inputs = make_inputs(spec, bucket, device, seed=i)
                for _ in range(3):
                    compiled(**inputs, **spec.model.call_kwargs)
        state["compiles"] = getattr(compiled, "misses", 0)
        if "torch._dynamo" in sys.modules:  # compile.route: aoti never imports it
            from torch._dynamo.utils import counters

            state["compiles"] += counters["inductor"]["fxgraph_cache_miss"]
        state["ready"] = True

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/healthz" or (self.path == "/ready" and state["ready"])
            body = json.dumps(state).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    threading.Thread(target=warm, daemon=True).start()
    ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
