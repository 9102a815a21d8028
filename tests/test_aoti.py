"""``compile.route: aoti``: AOTInductor packages baked per bucket (or one ranged program), shipped
extracted, and served by ``kiln.activate().compile()`` without Dynamo or Inductor.

The bakes are real (torch.export + AOTInductor on the CPU, in fresh processes: slow); the spec,
manifest and factor rules are checked without torch.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

import kiln
from kiln.artifact.manifest import Manifest
from kiln.errors import SpecError, UsageError
from kiln.factors import compare, misses
from kiln.spec import parse_spec
from tests.conftest import MODELS, aoti_spec, mlp_spec, shared_dir


# --- the spec ---------------------------------------------------------------------------------
def test_route_defaults_keep_every_existing_digest() -> None:
    plain = parse_spec(mlp_spec())
    assert plain.compile.route == "compile"
    assert "route" not in plain.canonical()["compile"]
    assert "weights" not in plain.canonical()["compile"]
    aoti = parse_spec(aoti_spec())
    assert aoti.canonical()["compile"]["route"] == "aoti"
    assert aoti.sha256() != plain.sha256()


@pytest.mark.parametrize(
    ("extra", "where", "message"),
    [
        ("precompile: true", ":9:3: compile.precompile:", "precompile is the torch.compile"),
        ("backend: eager", ":9:3: compile.backend:", "route: aoti compiles with inductor"),
    ],
)
def test_route_aoti_refuses_what_it_cannot_serve(extra: str, where: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(aoti_spec(compile_extra=extra), file="s.yaml")
    assert where in str(err.value) and message in str(err.value)


def test_weights_is_refused_on_the_compile_route() -> None:
    text = mlp_spec().replace("compile:\n", "compile:\n  weights: embed\n", 1)
    with pytest.raises(SpecError, match="weights is for route: aoti"):
        parse_spec(text, file="s.yaml")


def test_route_aoti_has_no_compiler_for_misses() -> None:
    """on_miss is the padding route's policy too (kiln.serving.OnMiss); aoti refuses compile."""
    assert parse_spec(aoti_spec(compile_extra="on_miss: eager")).compile.on_miss == "eager"
    with pytest.raises(SpecError, match="serves without a compiler: on_miss is error or eager"):
        parse_spec(aoti_spec(compile_extra="on_miss: compile"), file="s.yaml")


def tp_aoti_spec(name: str = "tp-aoti") -> str:
    """The 2-rank tensor-parallel MLP (an all_reduce in forward) on the AOT route, gloo."""
    text = aoti_spec(name, buckets="[1, 4]").replace("tiny_mlp", "tp_mlp")
    text = text.replace("  kwargs: {dim: 16, hidden: 32}\n  call_kwargs: {scale: 2.0}\n", "")
    return (
        text.replace("[batch, 16]", "[batch, 64]") + "distributed: {world_size: 2, backend: gloo}\n"
    )


def test_a_multi_rank_aoti_spec_is_not_sharded(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(tp_aoti_spec())
    assert parse_spec(spec.read_text()).compile.route == "aoti"
    with pytest.raises(UsageError, match="multi-rank spec in one piece"):
        kiln.bake(spec, tmp_path / "s.kiln.tar.zst", shard="0/2")


@pytest.mark.slow
def test_two_ranks_serve_their_packages_with_collectives(tmp_path: Path, cli) -> None:
    """Each rank exports its shard (the all_reduce becomes a functional collective) and ships
    its packages under ranks/R/aoti; verify serves both ranks through kiln.activate()."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(tp_aoti_spec() + "bytecode: always\n")
    # No proof: the verify below serves both ranks as the proof would (one torchrun fewer).
    result = kiln.bake(spec, tmp_path / "tp.kiln.tar.zst", prove=False)
    assert result is not None
    m = result.manifest
    assert m.distributed is not None and m.aoti is not None
    ranks = [r.aoti for r in m.distributed.ranks]
    assert all(a is not None and len(a.programs) == 2 for a in ranks)
    assert {f.kind for f in m.files} == {"aoti", "bytecode"}
    packages = [f.path for f in m.files if f.kind == "aoti"]
    assert all(p.startswith(("ranks/0/aoti/", "ranks/1/aoti/")) for p in packages)
    # The bytecode the ranks' servers import (torch.distributed's included), not the build's.
    shipped = [f.path for f in m.files if f.kind == "bytecode"]
    assert any("/torch/distributed/distributed_c10d." in p for p in shipped)
    assert not [p for p in shipped if "/torch/_inductor/" in p or "/torch/_dynamo/" in p]
    kiln.restore(result.artifact, tmp_path / "restored")
    run = cli("verify", spec, "--cache", tmp_path / "restored", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["route"] == "aoti" and report["compiles"] == 0
    assert report["compiler_modules"] == [] and report["ranks"] == 2
    # Rank 1's package library lost: verify names it by its path in DIR, as the drift does.
    program = ranks[1].programs[0]
    where = f"ranks/1/{program.path}/{program.library}"
    (tmp_path / "restored" / where).unlink()
    run = cli("verify", spec, "--cache", tmp_path / "restored", "--json")
    assert run.returncode == 6, run.stderr[-3000:]
    error = json.loads(run.stdout)["error"]
    assert f"-{where}" in error and f"AOTInductor package library {where} is missing" in error


# --- what a served process checks ------------------------------------------------------------
def test_aoti_factors_judge_the_library_not_the_compiler() -> None:
    baked = {"torch.version": "2.13", "cpu.capability": "AVX512", "triton.version": "3.6"}
    here = {"torch.version": "2.13", "cpu.capability": "AVX512", "triton.version": "3.7"}
    assert misses(compare(baked, here, "aoti")) == []
    assert [f.name for f in misses(compare(baked, here))] == ["triton.version"]
    here["cpu.capability"] = "AVX2"
    (miss,) = misses(compare(baked, here, "aoti"))
    assert miss.name == "cpu.capability" and "vector ISA" in miss.note


def test_a_package_library_must_be_a_listed_file() -> None:
    aoti = {
        "device": "cpu",
        "weights": "external",
        "on_miss": "error",
        "inputs": [{"name": "x", "shape": ["batch", 16], "dtype": "float32"}],
        "programs": [{"path": "aoti/0", "library": "m.so", "buckets": ["batch=2"]}],
    }
    base = {
        "name": "m",
        "created": "2026-01-01T00:00:00+00:00",
        "spec": {},
        "spec_sha256": "0" * 64,
        "fingerprint": {},
        "grid": [],
        "aoti": aoti,
    }
    entry = {"path": "aoti/0/m.so", "size": 1, "sha256": "0" * 64, "kind": "aoti"}
    Manifest.model_validate({**base, "files": [entry]})
    with pytest.raises(ValidationError, match=r"aoti library 'aoti/0/m\.so' is not a listed file"):
        Manifest.model_validate({**base, "files": []})
    aoti["programs"][0]["library"] = "../evil.so"
    with pytest.raises(ValidationError):
        Manifest.model_validate({**base, "files": [entry]})


# --- real bakes -------------------------------------------------------------------------------
# A server as a user writes it: kiln.activate, build, compile, call under inference mode.
SERVE = """\
import json, sys
import torch
import kiln

act = kiln.activate(sys.argv[1], compat="fail")
sys.path.insert(0, sys.argv[2])
from models import tiny_mlp
model = tiny_mlp(16, 32).eval()
torch.manual_seed(1)
other = tiny_mlp(16, 32).eval()  # another checkpoint of the architecture
torch.nn.init.normal_(other.fc1.weight)
out = {}
with torch.inference_mode():
    served = act.compile(model)
    x = torch.randn(3, 16)
    out["same"] = [torch.equal(served(x=x), model(x, scale=2.0)),
                   torch.equal(served(x, scale=2.0), model(x, scale=2.0))]
    out["other"] = torch.allclose(act.compile(other)(x=x), other(x, scale=2.0), atol=1e-6)
    for name, call in [("off_grid", lambda: served(x=torch.randn(4, 16))),
                       ("dtype", lambda: served(x=x.double())),
                       ("kwarg", lambda: served(x=x, scale=3.0))]:
        try:
            call()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    eager = act.compile(model, on_miss="eager")
    out["eager"] = torch.equal(eager(x=torch.ones(4, 16)), model(torch.ones(4, 16)))
    out["misses"] = [served.misses, eager.misses]
    try:
        act.compile(model.half())
    except Exception as exc:
        out["half"] = f"{type(exc).__name__}: {exc}"
compiler = ("torch._dynamo", "torch._inductor")
out["compiler"] = sorted(m for m in sys.modules if m.startswith(compiler))
import ctypes  # libstdc++ global before a package opens (kiln.compiler.aoti_serve.share_libstdcxx)
out["libstdcxx_global"] = hasattr(ctypes.CDLL(None), "_ZNSt6locale7classicEv")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_bake_ships_extracted_packages_without_weights(aoti_baked) -> None:
    _, restored, manifest = aoti_baked
    assert manifest.aoti is not None and manifest.aoti.weights == "external"
    assert [p.buckets for p in manifest.aoti.programs] == [["batch=2"], ["batch=3"]]
    assert set(manifest.aoti.constants) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert manifest.aoti.constants["fc1.weight"].shape == [32, 16]
    assert manifest.aoti.call_kwargs == {"scale": 2.0}
    kinds = {f.kind for f in manifest.files}
    assert kinds == {"aoti"}  # no inductor cache, no Mega-Cache: the packages are the payload
    names = [f.path for f in manifest.files]
    assert not [n for n in names if n.endswith((".cpp", ".pt2", ".zip"))]
    assert manifest.proof is not None and manifest.proof.compiles == 0
    for program in manifest.aoti.programs:
        assert (restored / program.path / program.library).is_file()
    assert manifest.passes and len(manifest.passes) == 1
    # The export and package build is the route's compile time (the bake table's column), within
    # each bucket's first call: Dynamo's compile timer, which never sees it, said 0.
    for bucket in manifest.grid:
        assert 0.0 < bucket.compile_s <= bucket.first_call_s, bucket
    assert manifest.totals["compile_s"] > 0


@pytest.mark.slow
def test_served_process_imports_neither_dynamo_nor_inductor(aoti_baked) -> None:
    _, restored, _ = aoti_baked
    run = subprocess.run(
        [sys.executable, "-c", SERVE, str(restored), str(MODELS.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["compiler"] == []
    assert out["libstdcxx_global"] is True  # torch alone leaves it local (see share_libstdcxx)
    assert out["same"] == [True, True]
    assert out["other"] is True  # external weights: the model's own are served
    assert out["off_grid"].startswith("OffGridError: no baked AOTInductor package takes these")
    assert "x [4, 16]" in out["off_grid"] and "on_miss: eager" in out["off_grid"]
    assert out["dtype"].startswith("OffGridError") and "float64" in out["dtype"]
    assert "scale=3.0 was not baked" in out["kwarg"]
    assert out["eager"] is True
    assert out["misses"] == [3, 1]
    assert out["half"].startswith("WeightsMismatchError: ")
    assert "float16" in out["half"] and "float32" in out["half"]


@pytest.mark.slow
def test_verify_and_check_serve_the_route(aoti_baked, cli) -> None:
    spec, restored, _ = aoti_baked
    run = cli("verify", spec, "--cache", restored, "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["ok"] and report["route"] == "aoti" and report["compiler_modules"] == []
    assert report["compiles"] == 0
    check = cli("check", restored, "--json")
    assert check.returncode == 0, check.stderr[-2000:]
    names = {f["name"] for f in json.loads(check.stdout)["factors"]}
    assert "cpu.capability" in names and not any(n.startswith("inductor.") for n in names)


@pytest.mark.slow
def test_restore_and_check_name_the_one_route_that_serves_packages(
    aoti_baked, cli, tmp_path: Path
) -> None:
    """A plain torch.compile compiles every bucket of an AOT artifact (its packages are no
    Inductor cache): restore said `. DIR/kiln.env` and check said "will hit here"."""
    spec, _, manifest = aoti_baked
    artifact = spec.parent / f"{manifest.name}.kiln.tar.zst"
    dest = tmp_path / "aot cache"
    restored = cli("restore", artifact, "--dest", dest, no_torch=True)
    assert restored.returncode == 0, restored.stderr
    (line,) = [x for x in restored.stdout.splitlines() if x.startswith("serve with: ")]
    assert line.startswith(f"serve with: kiln.activate({str(dest)!r}).compile(model) ("), line
    assert "kiln.env" not in line
    check = cli("check", dest)
    assert check.returncode == 0, check.stderr[-2000:]
    verdict = " ".join(check.stdout.split())
    assert (
        f"will serve here only through kiln.activate({str(dest)!r}).compile(model) (a plain "
        "torch.compile of the model compiles every bucket)"
    ) in verdict, verdict
    assert "will hit here" not in verdict


@pytest.mark.slow
def test_verify_names_another_model_and_an_unbaked_bucket_in_the_routes_words(
    aoti_baked, tmp_path: Path, cli
) -> None:
    """A spec whose model has other weight shapes is the spec's problem (exit 2, at model:),
    not a crash; a bucket no package serves is a call no package took (exit 6)."""
    _, restored, _ = aoti_baked
    wider = tmp_path / "wider.yaml"
    wider.write_text(aoti_spec().replace("hidden: 32", "hidden: 64"))
    run = cli("verify", wider, "--cache", restored)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"kiln: error: {wider}:2:1: model: fc1.bias: the model's is [64] float32, the packages "
            "were built for [32] float32"
        )
    ), run.stderr
    more = tmp_path / "more.yaml"
    more.write_text(aoti_spec(buckets="[2, 3, 4]"))
    run = cli("verify", more, "--cache", restored, "--json")
    assert run.returncode == 6, run.stderr[-2000:]
    (line,) = json.loads(run.stdout)["failing"]
    assert line.startswith("batch=4: ") and "calls no package took" in line, line
    assert "the bake never compiled it" in line and "precompiled" not in line


@pytest.mark.slow
def test_inspect_says_how_the_route_serves(aoti_baked, cli) -> None:
    _, restored, _ = aoti_baked
    run = cli("inspect", restored, no_torch=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "route: aoti: 2 package(s) on cpu, weights from the model (4 tensors), off-grid "
        "inputs: error; served by kiln.activate().compile() without Dynamo or Inductor"
    ) in run.stdout
    assert "serve with torch.compile(" not in run.stdout


BRANCHY = """\
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        if self.a(x).sum() > 0:  # line 11: a branch on data, no full graph
            return x * 2
        return x


def make():
    return Branchy()
"""


@pytest.mark.slow
def test_export_failure_is_one_located_line_exit_2(tmp_path: Path, cli) -> None:
    (tmp_path / "branchy.py").write_text(BRANCHY)
    text = aoti_spec("branchy").replace(f"{MODELS}:tiny_mlp", "branchy.py:make")
    text = text.replace("  kwargs: {dim: 16, hidden: 32}\n  call_kwargs: {scale: 2.0}\n", "")
    (tmp_path / "spec.yaml").write_text(text)
    run = cli("bake", "spec.yaml", "-o", "out.kiln.tar.zst")
    assert run.returncode == 2, run.stderr[-2000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("kiln: error: "), line
    assert "spec.yaml:5:3: compile.route: torch.export failed at branchy.py:11: " in line
    assert "route: compile serves graph breaks" in line
    assert not (tmp_path / "out.kiln.tar.zst").exists()


@pytest.mark.slow
def test_one_ranged_program_with_embedded_weights(tmp_path: Path) -> None:
    """dynamic: true: one program over batch 2..5 serves a size between the buckets too;
    weights: embed serves the bake's weights whatever the model holds."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(aoti_spec("ranged", "weights: embed", "[2, 5]", dynamic="true"))
    result = kiln.bake(spec, tmp_path / "r.kiln.tar.zst")
    assert result is not None and result.manifest.aoti is not None
    (program,) = result.manifest.aoti.programs
    assert program.ranges == {"batch": [2, 5]} and program.buckets == ["batch=2", "batch=5"]
    assert result.manifest.aoti.constants == {}
    kiln.restore(result.artifact, tmp_path / "restored")
    code = (
        "import sys, torch, kiln\n"
        f"sys.path.insert(0, {str(MODELS.parent)!r})\n"
        "from models import tiny_mlp\n"
        f"act = kiln.activate({str(tmp_path / 'restored')!r})\n"
        "baked = tiny_mlp(16, 32).eval()\n"
        "other = tiny_mlp(16, 32).eval(); torch.nn.init.zeros_(other.fc2.weight)\n"
        "served = act.compile(other)\n"
        "with torch.inference_mode():\n"
        "    x = torch.randn(4, 16)\n"
        "    print(torch.allclose(served(x=x), baked(x, scale=2.0), atol=1e-6), served.misses)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "0"]


POINTWISE = """\
import torch
from torch import nn


class Pointwise(nn.Module):
    \"\"\"Elementwise from its first op: a fused kernel reads its input as the layout it was
    exported with (an extern matmul first would read any strides).\"\"\"

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 16))

    def forward(self, x):
        return torch.cumsum(torch.sin(x) * self.w + 1, dim=-1)


def make():
    return Pointwise()
"""

SERVE_POINTWISE = """\
import json, logging, sys
import torch
import kiln

sys.path.insert(0, sys.argv[2])
from pointwise import make
logging.basicConfig(format="%(message)s")
act = kiln.activate(sys.argv[1], compat="fail")
model = make().eval()
out = {}
with torch.inference_mode():
    served = act.compile(model)
    wide = torch.randn(3, 4, 32)
    inputs = {"contiguous": wide[:, :, :16].contiguous(), "sliced": wide[:, :, :16],
              "transposed": torch.randn(3, 16, 4).transpose(1, 2)}
    out["diff"] = {k: float((served(x=x) - model(x)).abs().max()) for k, x in inputs.items()}
    out["between"] = float((served(x=wide[:2, :, :16]) - model(wide[:2, :, :16])).abs().max())
    for name, call in [("seq", lambda: served(x=torch.randn(3, 5, 16))),
                       ("twice", lambda: served(wide, x=wide)),
                       ("policy", lambda: act.compile(model, on_miss="bogus"))]:
        try:
            call()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    strided = make().eval()
    strided.w = torch.nn.Parameter(torch.linspace(0.5, 2.0, 32)[::2])  # not contiguous
    x = inputs["contiguous"]
    out["strided"] = float((act.compile(strided)(x=x) - strided(x)).abs().max())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_served_inputs_of_any_layout_and_an_axis_of_one_size(tmp_path: Path, cli) -> None:
    """A fused kernel reads its input as exported (dense): a slice or a transpose is served as
    a dense copy, not read as garbage. ``dynamic: true`` with an axis of one size keeps that
    axis static (export has no ``Dim`` of one size). Calls eager refuses are refused; weights
    the packages read as copies are named. ``kiln check`` judges no Inductor cache location on
    a route that reads none."""
    (tmp_path / "pointwise.py").write_text(POINTWISE)
    text = aoti_spec("pointwise", buckets="[1, 3]", dynamic="true")
    text = text.replace(f"{MODELS}:tiny_mlp", "pointwise.py:make")
    text = text.replace("  kwargs: {dim: 16, hidden: 32}\n  call_kwargs: {scale: 2.0}\n", "")
    text = text.replace("[batch, 16]", "[batch, seq, 16]").replace(
        "  batch: [1, 3]", "  batch: [1, 3]\n  seq: [4]"
    )
    (tmp_path / "spec.yaml").write_text(text)
    bake = cli("bake", "spec.yaml", "-o", "p.kiln.tar.zst")
    assert bake.returncode == 0, bake.stderr[-2000:]
    assert cli("restore", "p.kiln.tar.zst", "--dest", "restored").returncode == 0
    manifest = Manifest.model_validate_json((tmp_path / "restored/manifest.json").read_text())
    assert manifest.aoti is not None
    (program,) = manifest.aoti.programs
    assert program.ranges == {"batch": [1, 3], "seq": [4, 4]}
    run = subprocess.run(
        [sys.executable, "-c", SERVE_POINTWISE, str(tmp_path / "restored"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(d < 1e-4 for d in out["diff"].values()), out["diff"]  # garbage differs by ~10
    assert out["between"] < 1e-4
    assert out["seq"].startswith("OffGridError: ") and "seq 4..4" in out["seq"]
    assert out["twice"] == "TypeError: got multiple values for argument 'x'"
    assert out["policy"].startswith("UsageError: on_miss='bogus'")
    assert out["strided"] < 1e-4
    assert "1 weight(s) are not contiguous (e.g. w): the packages read dense copies" in run.stderr
    check = cli("check", "restored", "--json", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert check.returncode == 0, check.stdout + check.stderr[-2000:]


SERVE_PADDED = """\
import json, sys
import torch
import kiln

sys.path.insert(0, sys.argv[2])
from models import tiny_mlp
model = tiny_mlp(16, 32).eval()
served = kiln.activate(sys.argv[1], compat="fail").compile(model)
with torch.inference_mode():
    x = torch.randn(3, 16)
    y = served(x=x)
    out = {"shape": list(y.shape), "same": torch.allclose(y, model(x, scale=2.0), atol=1e-6),
           "stats": served.stats.to_dict()}
compiler = ("torch._dynamo", "torch._inductor")
out["compiler"] = sorted(m for m in sys.modules if m.startswith(compiler))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_padded_request_imports_no_compiler(tmp_path: Path) -> None:
    """Padding on the AOT route: which outputs carry the padded axis is the bake's finding (on
    fake tensors, which import Dynamo), recorded per bucket; the server pads, calls the
    package and slices without a probe of its own, so it imports neither Dynamo nor Inductor."""
    spec = tmp_path / "spec.yaml"
    # Bucket 16 is also the feature size: slicing by size would cut both dims of its output.
    text = aoti_spec("padded", buckets="[2, 16]").replace("fill: randn}", "fill: randn, pad: 0}")
    spec.write_text(text)
    result = kiln.bake(spec, tmp_path / "p.kiln.tar.zst")
    assert result is not None and result.manifest.aoti is not None
    recorded = [c.model_dump() for c in result.manifest.aoti.carriers]
    assert recorded == [
        {"bucket": f"batch={b}", "axis": "batch", "by_size": False,
         "outputs": [{"path": [], "dims": [0], "sliceable": True}]}
        for b in (2, 16)
    ]  # fmt: skip
    kiln.restore(result.artifact, tmp_path / "restored")
    run = subprocess.run(
        [sys.executable, "-c", SERVE_PADDED, str(tmp_path / "restored"), str(MODELS.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["shape"] == [3, 16] and out["same"] is True
    assert out["stats"]["padded"] == 1 and out["stats"]["probes"] == 0
    assert out["compiler"] == []


def test_a_ranged_program_is_not_sharded(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(aoti_spec("ranged", dynamic="true"))
    with pytest.raises(UsageError, match="one program for the whole grid"):
        kiln.bake(spec, tmp_path / "s.kiln.tar.zst", shard="0/2")


@pytest.mark.slow
def test_shards_merge_into_one_set_of_packages(tmp_path: Path, cli) -> None:
    spec = tmp_path / "spec.yaml"
    # Padded: each shard records its buckets' output carriers, the merge keeps them all.
    spec.write_text(aoti_spec("sharded").replace("fill: randn}", "fill: randn, pad: 0}"))
    for i in range(2):  # unproven: the merged artifact is what this test proves, verified
        out = tmp_path / f"s{i}.kiln.tar.zst"
        assert kiln.bake(spec, out, shard=f"{i}/2", prove=False) is not None
    shards = [tmp_path / "s1.kiln.tar.zst", tmp_path / "s0.kiln.tar.zst"]
    merged = kiln.merge(shards, tmp_path / "m.kiln.tar.zst")
    aoti = merged.manifest.aoti
    assert aoti is not None
    assert [(p.path, p.buckets) for p in aoti.programs] == [
        ("aoti/batch2", ["batch=2"]),
        ("aoti/batch3", ["batch=3"]),
    ]
    assert len(aoti.constants) == 4
    assert [(c.bucket, c.axis) for c in aoti.carriers] == [(f"batch={b}", "batch") for b in (2, 3)]
    kiln.restore(merged.artifact, tmp_path / "restored")
    run = cli("verify", spec, "--cache", tmp_path / "restored", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["compiles"] == 0


@pytest.fixture
def bench_work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A spec on the AOT route and a bench work folder shared by this module's two benches, one
    at a time: the second reuses the AOT route's bake the first left there (``--workdir``)."""
    folder = shared_dir(tmp_path_factory, "bench-aoti")
    with open(folder / ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        spec = folder / "spec.yaml"
        spec.write_text(aoti_spec("bench-aoti", buckets="[2]"))
        yield spec, folder / "work"


@pytest.mark.slow
def test_bench_serves_the_aot_route_beside_the_compile_route(bench_work) -> None:
    """``--modes kiln,aoti`` on a spec written for the AOT route: kiln serves its
    torch.compile counterpart, aoti the packages; both artifacts' sizes are reported."""
    spec, work = bench_work
    report = kiln.bench(spec, modes=("kiln", "aoti"), workdir=work).to_dict()
    modes = report["modes"]
    assert list(modes) == ["kiln", "aoti"]
    assert modes["aoti"]["compiles"] == 0 and modes["kiln"]["compiles"] == 0
    phases = {p["phase"] for p in modes["aoti"]["startup_phases"]}
    assert "AOTInductor packages load" in phases
    assert "Inductor import + worker pool start" not in phases
    assert report["aoti_artifact_bytes"] > 0 and report["artifact_bytes"] > 0
    assert report["ratios"]["aoti/kiln"] > 0
    assert report["spec"]["compile"].get("route", "compile") == "compile"  # the kiln row's


@pytest.mark.slow
def test_bench_eager_and_aoti_alone_bakes_once(bench_work, cli) -> None:
    spec, work = bench_work
    run = cli("bench", spec, "--modes", "eager,aoti", "--json", "--workdir", work)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert set(report["modes"]) == {"eager", "aoti"}
    assert report["compile_route_baked"] is False
    assert report["artifact_bytes"] == report["aoti_artifact_bytes"]
    # Only the AOT route's bake ran (or was reused, when the other bench left it here).
    assert "bench: bake aoti" in run.stderr and "bench: bake\n" not in run.stderr
