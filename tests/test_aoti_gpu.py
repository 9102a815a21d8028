"""``compile.route: aoti`` on a CUDA machine: packages with Triton kernels served by the runner
built directly, in a process that imports neither Dynamo nor Inductor.

Skipped without CUDA (conftest); on the GPU machine:
``python3 -m pytest -q -m gpu -s tests/test_aoti_gpu.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from tests.conftest import MODELS, gpt_spec

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def gpt_aoti_spec(name: str, mode: str = "default") -> str:
    return gpt_spec(name, mode, compile_lines=("route: aoti", "fullgraph: true"), seqs="[64, 256]")


# A server: activate, build the model on the GPU, compile, call every bucket; prints how long
# each step took, whether outputs match eager, and which compiler modules got imported.
SERVE = """\
import json, sys, time
t0 = time.time()
import torch
import kiln
t1 = time.time()
act = kiln.activate(sys.argv[1], compat="fail")
sys.path.insert(0, sys.argv[2])
from models import tiny_gpt
model = tiny_gpt(512, 128, 2, 4).to("cuda", torch.bfloat16).eval()
torch.cuda.synchronize()
t2 = time.time()
served = act.compile(model)
t3 = time.time()
close = []
with torch.inference_mode():
    for b, s in [(4, 256), (1, 64), (1, 256), (4, 64)]:
        ids = torch.randint(0, 512, (b, s), device="cuda")
        close.append(torch.allclose(served(input_ids=ids).float(), model(ids).float(),
                                    atol=5e-2, rtol=5e-2))
    torch.cuda.synchronize()
t4 = time.time()
compiler = ("torch._dynamo", "torch._inductor")
print(json.dumps({"close": close, "misses": served.misses,
                  "compiler": sorted(m for m in sys.modules if m.startswith(compiler)),
                  "triton": "triton" in sys.modules,
                  "import_s": t1 - t0, "model_s": t2 - t1, "load_s": t3 - t2,
                  "calls_s": t4 - t3}))
"""


def serve(restored: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", SERVE, str(restored), str(MODELS.parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print("\naoti serve:", out)
    return out


@pytest.fixture(scope="module")
def aoti_gpu(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("aoti-gpu")
    spec = d / "spec.yaml"
    spec.write_text(gpt_aoti_spec("gpt-aoti-gpu"))
    result = kiln.bake(spec, d / "a.kiln.tar.zst")
    assert result is not None
    kiln.restore(result.artifact, d / "restored")
    return spec, d / "restored", result


def test_bake_packages_cuda_kernels_without_weights(aoti_gpu) -> None:
    _, _, result = aoti_gpu
    m = result.manifest
    assert m.aoti is not None and m.aoti.device == "cuda" and len(m.aoti.programs) == 4
    assert m.proof is not None and m.proof.compiles == 0
    # The packages, the driver's JIT cache of what the runner's calls JIT-compiled, and the
    # Python bytecode an image without it lacks (the H100/H200 images have none).
    kinds = {f.kind for f in m.files}
    assert "aoti" in kinds and kinds <= {"aoti", "driver", "bytecode"}
    assert m.aoti.constants["head.weight"].dtype == "bfloat16"
    print("\naoti artifact bytes:", result.size, "files:", len(m.files))


def test_served_on_the_gpu_without_dynamo_inductor_or_triton(aoti_gpu) -> None:
    _, restored, _ = aoti_gpu
    out = serve(restored)
    assert out["close"] == [True, True, True, True]
    assert out["misses"] == 0
    assert out["compiler"] == []
    print("triton imported:", out["triton"])  # the kernels are cubins: Triton is not needed


def test_verify_passes_on_the_gpu(aoti_gpu, cli) -> None:
    spec, restored, _ = aoti_gpu
    run = cli("verify", spec, "--cache", restored, "--json")
    report = json.loads(run.stdout)
    # Where each written file is (DIR/, HOME/ or TMPDIR/ and its whole path), on a failure.
    written = {b["key"]: b["new_files"] for b in report["buckets"] if b["new_files"]}
    assert run.returncode == 0, f"{run.stderr[-2000:]}\n{written}"
    assert report["route"] == "aoti" and report["compiles"] == 0
    assert report["compiler_modules"] == []


def test_reduce_overhead_is_said_to_serve_without_cuda_graphs(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(gpt_aoti_spec("gpt-aoti-ro", "reduce-overhead"))
    result = kiln.bake(spec, tmp_path / "ro.kiln.tar.zst")
    assert result is not None
    assert any("serves without CUDA graphs" in w for w in result.manifest.warnings)
    kiln.restore(result.artifact, tmp_path / "restored")
    assert serve(tmp_path / "restored")["close"] == [True, True, True, True]


def test_max_autotune_packages_serve(tmp_path: Path) -> None:
    """The spec's Inductor options reach the packages (max-autotune tunes at bake time only)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(gpt_aoti_spec("gpt-aoti-mat", "max-autotune-no-cudagraphs"))
    result = kiln.bake(spec, tmp_path / "mat.kiln.tar.zst")
    assert result is not None and result.manifest.proof is not None
    assert result.manifest.proof.compiles == 0
    kiln.restore(result.artifact, tmp_path / "restored")
    out = serve(tmp_path / "restored")
    assert out["close"] == [True, True, True, True] and out["compiler"] == []
