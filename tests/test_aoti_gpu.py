"""``compile.route: aoti`` on a CUDA machine: packages with Triton kernels served by the runner
built directly, in a process that imports neither Dynamo nor Inductor.

Skipped without CUDA (conftest); on the GPU machine:
``python3 -m pytest -q -m gpu -s tests/test_aoti_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from tests.conftest import MODELS, Cli, gpt_spec
from tests.first_process import digest_tree

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
act = kiln.activate(sys.argv[1], compat=sys.argv[3])
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


def serve(restored: Path, cwd: Path | None = None, compat: str = "fail") -> dict:
    """SERVE as a process started in ``cwd`` (a shell's ``PWD`` with it)."""
    run = subprocess.run(
        [sys.executable, "-c", SERVE, str(restored), str(MODELS.parent), compat],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "PWD": str(cwd)} if cwd else None,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print("\naoti serve:", out)
    return out | {"stderr": run.stderr}


@pytest.fixture(scope="module")
def aoti_gpu(tmp_path_factory: pytest.TempPathFactory):
    """Baked for a server in its own folder (``serve.workdir``), not the test run's."""
    d = tmp_path_factory.mktemp("aoti-gpu")
    (d / "app").mkdir()
    spec = d / "spec.yaml"
    spec.write_text(gpt_aoti_spec("gpt-aoti-gpu") + f"serve: {{workdir: {d / 'app'}}}\n")
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
    spec, restored, _ = aoti_gpu
    out = serve(restored, cwd=spec.parent / "app")  # where it was baked for (compat="fail")
    assert out["close"] == [True, True, True, True]
    assert out["misses"] == 0
    assert out["compiler"] == []
    print("triton imported:", out["triton"])  # the kernels are cubins: Triton is not needed


def test_verify_passes_on_the_gpu(aoti_gpu, cli) -> None:
    spec, restored, _ = aoti_gpu
    # Run from another folder than the server's: verify serves in serve.workdir.
    run = cli("verify", spec, "--cache", restored, "--json")
    report = json.loads(run.stdout)
    # Where each written file is (DIR/, HOME/ or TMPDIR/ and its whole path), on a failure.
    written = {b["key"]: b["new_files"] for b in report["buckets"] if b["new_files"]}
    assert run.returncode == 0, f"{run.stderr[-2000:]}\n{written}"
    assert report["route"] == "aoti" and report["compiles"] == 0
    assert report["compiler_modules"] == []


def test_a_server_in_another_folder_is_told_what_it_costs(aoti_gpu, tmp_path: Path) -> None:
    """cuDNN's runtime-compiled attention kernels are keyed by the working directory
    (kiln.workdir): served in ``serve.workdir`` the shipped driver entries hit and nothing is
    written; served elsewhere the driver JIT-compiles them again, activate() says why, and
    ``kiln check`` there exits 5 naming the folder."""
    spec, restored, result = aoti_gpu
    app = spec.parent / "app"
    workdir = result.manifest.workdir
    assert workdir is not None and workdir.path == str(app), result.manifest.workdir
    print("\ndriver entries keyed by the workdir:", workdir.keyed)
    written = {}
    for where in (app, tmp_path):
        dest = tmp_path / f"dest-{where.name}"
        kiln.restore(result.artifact, dest)
        before = digest_tree(dest / "cuda-cache")
        out = serve(dest, cwd=where, compat="warn")
        assert out["close"] == [True, True, True, True] and out["misses"] == 0
        after = digest_tree(dest / "cuda-cache")
        written[where] = sorted(k for k in after if before.get(k) != after[k]), out["stderr"]
    assert written[app] == ([], written[app][1])
    assert "process.workdir" not in written[app][1]
    jitted, said = written[tmp_path]
    print("written in another folder:", jitted)
    assert len(jitted) > 1 and "process.workdir" in said, (jitted, said[-2000:])
    run = Cli(tmp_path)("check", restored, "--json", env={"PWD": str(tmp_path)})
    assert run.returncode == 5 and "process.workdir" in run.stderr, run.stderr[-2000:]


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
