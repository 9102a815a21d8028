"""Bundles (issue 14, second half): `kiln bundle`, variant selection on `kiln restore`,
`kiln inspect` of a bundle. CPU variants plus synthetic GPU fingerprints (manifests whose
fingerprint says H200 or A100, as a GPU bake records it); the machine is either given
(:class:`Machine`) or detected through a stand-in ``nvidia-smi`` on PATH."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from kiln.artifact.archive import sha256_file
from kiln.artifact.bundle import read_head, write_bundle
from kiln.artifact.machine import Gpu, Machine
from kiln.artifact.restore import restore
from kiln.errors import IncompatibleError, IntegrityError, UsageError
from kiln.layout import STATE_NAME
from tests.archives import A100_FP, CPU_FP, H200_FP, tree, variant_archive
from tests.test_machine import fake_smi, printing

H200 = Machine((Gpu("NVIDIA H200", "9.0"),), "nvidia-smi")
A100 = Machine((Gpu("NVIDIA A100-SXM4-80GB", "8.0"),), "nvidia-smi")
CPU = Machine()
H200_OLD_TORCH = {**H200_FP, "torch.version": "2.10.0+cu128", "torch.cuda": "12.8"}


@pytest.fixture
def variants(tmp_path: Path) -> dict[str, Path]:
    return {
        "cpu": variant_archive(tmp_path / "cpu.kiln.tar.zst", CPU_FP),
        "h200": variant_archive(tmp_path / "h200.kiln.tar.zst", H200_FP),
        "a100": variant_archive(tmp_path / "a100.kiln.tar.zst", A100_FP),
    }


@pytest.fixture
def bundle(tmp_path: Path, variants: dict[str, Path]) -> Path:
    return write_bundle(list(variants.values()), tmp_path / "release.kiln.tar.zst").path


# --- item 1: kiln bundle --------------------------------------------------------------------


def test_bundle_is_deterministic_in_any_order(
    tmp_path: Path, variants: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    paths = list(variants.values())
    one = write_bundle(paths, tmp_path / "one.kiln.tar.zst")
    two = write_bundle(paths[::-1], tmp_path / "two.kiln.tar.zst")
    assert one.path.read_bytes() == two.path.read_bytes()
    assert one.sha256 == two.sha256 == sha256_file(one.path)
    names = [v.name for v in one.index.variants]
    assert names == ["a100-sxm4-80gb-sm80-torch2.11.0-cu130", "cpu-torch2.13.0-cpu",
                     "h200-sm90-torch2.11.0-cu130"]  # fmt: skip
    by_name = {v.name: v for v in one.index.variants}
    h200 = by_name["h200-sm90-torch2.11.0-cu130"]
    assert (h200.gpu, h200.capability, h200.torch, h200.cuda) == (
        "NVIDIA H200", "9.0", "2.11.0+cu130", "13.0",
    )  # fmt: skip
    assert h200.sha256 == sha256_file(variants["h200"])
    assert h200.size == variants["h200"].stat().st_size


def test_cli_bundle_identical_keys_is_exit_2(
    tmp_path: Path, variants: dict[str, Path], cli
) -> None:
    """Two variants restore could not tell apart: the same file twice, or two bakes on one GPU
    and torch build (other cache contents, same key)."""
    twin = variant_archive(tmp_path / "twin.kiln.tar.zst", H200_FP, {"inductor/other": b"x"})
    for inputs in ((variants["cpu"], variants["cpu"]), (variants["h200"], twin)):
        r = cli("bundle", *inputs, "-o", tmp_path / "out.kiln.tar.zst", no_torch=True)
        assert r.returncode == 2, r.stderr
        assert "same selection key" in r.stderr
        assert not (tmp_path / "out.kiln.tar.zst").exists()
    r = cli("bundle", *variants.values(), "-o", tmp_path / "ok.kiln.tar.zst", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sha256"] == sha256_file(tmp_path / "ok.kiln.tar.zst")
    assert len(out["variants"]) == 3


def test_bundle_of_a_bundle_is_refused(tmp_path: Path, bundle: Path) -> None:
    with pytest.raises(UsageError, match="is a bundle already"):
        write_bundle([bundle], tmp_path / "nested.kiln.tar.zst")


def test_bundle_is_a_plain_zstd_tar(bundle: Path) -> None:
    import tarfile

    import zstandard

    with (
        open(bundle, "rb") as fh,
        zstandard.ZstdDecompressor().stream_reader(fh) as zr,
        tarfile.open(fileobj=zr, mode="r|") as tar,
    ):
        names = [m.name for m in tar]
    assert names[0] == "bundle.json"
    assert all(n.startswith("variants/") and n.endswith(".kiln.tar.zst") for n in names[1:])


# --- item 2: restore picks the variant -------------------------------------------------------


def test_cpu_machine_restores_the_cpu_variant_exactly_as_alone(
    tmp_path: Path, bundle: Path, variants: dict[str, Path]
) -> None:
    """The folder is what restoring the cpu artifact alone gives: same files, same kiln.env,
    the variant's digest in the state file (which also names the bundle)."""
    dest = tmp_path / "cache"
    alone = restore(variants["cpu"], dest)
    expected = tree(dest)
    expected_state = json.loads(expected.pop(STATE_NAME))
    shutil.rmtree(dest)
    result = restore(bundle, dest, machine=CPU)
    got = tree(dest)
    state = json.loads(got.pop(STATE_NAME))
    assert got == expected
    assert state["artifact_sha256"] == expected_state["artifact_sha256"] == alone.sha256
    assert state["bundle"]["sha256"] == sha256_file(bundle)
    assert result.sha256 == alone.sha256 and not result.noop
    assert result.choice is not None and result.choice.variant.name == "cpu-torch2.13.0-cpu"
    assert "no GPU" in result.choice.reason
    # and the variant alone over it is a no-op: the same artifact is installed
    assert restore(variants["cpu"], dest).noop


@pytest.mark.parametrize(("machine", "want"), [(H200, "h200"), (A100, "a100-sxm4")])
def test_gpu_machine_restores_its_variant(
    tmp_path: Path, bundle: Path, variants: dict[str, Path], machine: Machine, want: str
) -> None:
    result = restore(bundle, tmp_path / "cache", machine=machine)
    assert result.choice is not None and result.choice.variant.name.startswith(want)
    fp = json.loads((tmp_path / "cache/manifest.json").read_text())["fingerprint"]
    assert fp["gpu.name"] == machine.gpus[0].name
    summary = result.summary()["variant"]
    assert summary["machine"]["gpu"] == machine.gpus[0].name
    assert summary["bundle_sha256"] == sha256_file(bundle)


def test_no_match_is_exit_5_listing_variants_and_machine(tmp_path: Path, variants) -> None:
    only_gpus = write_bundle([variants["h200"], variants["a100"]], tmp_path / "g.kiln.tar.zst")
    l4 = Machine((Gpu("NVIDIA L4", "8.9"),), "nvidia-smi")
    for machine, said in ((l4, "'NVIDIA L4' (capability 8.9"), (CPU, "no GPU")):
        with pytest.raises(IncompatibleError, match="no variant matches") as err:
            restore(only_gpus.path, tmp_path / "cache", machine=machine)
        assert said in err.value.message
        assert "h200-sm90-torch2.11.0-cu130 (NVIDIA H200 9.0" in err.value.message
        assert "a100-sxm4-80gb-sm80" in err.value.message
        assert not (tmp_path / "cache").exists()


def test_capability_must_match_when_known(tmp_path: Path, bundle: Path) -> None:
    odd = Machine((Gpu("NVIDIA H200", "9.1"),), "nvidia-smi")
    with pytest.raises(IncompatibleError):
        restore(bundle, tmp_path / "c1", machine=odd)
    from_proc = Machine((Gpu("nvidia  h200", None),), "/proc")  # case and spacing aside
    result = restore(bundle, tmp_path / "c2", machine=from_proc)
    assert result.choice is not None and result.choice.variant.name.startswith("h200")
    assert "capability unknown, from /proc" in result.choice.reason


def test_torch_version_picks_between_builds(tmp_path: Path, variants) -> None:
    old = variant_archive(tmp_path / "old.kiln.tar.zst", H200_OLD_TORCH)
    two = write_bundle([variants["h200"], old], tmp_path / "two.kiln.tar.zst").path
    with pytest.raises(
        UsageError, match=r"2 variants match .*; say which with torch_version or variant$"
    ):
        restore(two, tmp_path / "c", machine=H200)
    for given, want in (("2.11.0+cu130", "cu130"), ("2.11.0", "cu130"), ("2.10.0", "cu128")):
        result = restore(two, tmp_path / given, machine=H200, torch_version=given)
        assert result.choice is not None and result.choice.variant.name.endswith(want)
        assert f"torch {given} (torch_version)" in result.choice.reason
    with pytest.raises(IncompatibleError, match=re.escape("torch 2.11.0+cu128 (torch_version)")):
        restore(two, tmp_path / "c", machine=H200, torch_version="2.11.0+cu128")


def test_variant_flag_overrides_and_unknown_is_exit_2(tmp_path: Path, bundle: Path, variants):
    result = restore(bundle, tmp_path / "c", machine=CPU, variant="h200-sm90-torch2.11.0-cu130")
    assert (
        result.choice is not None and result.choice.reason == "variant=h200-sm90-torch2.11.0-cu130"
    )
    with pytest.raises(UsageError, match="no variant 'nope'"):
        restore(bundle, tmp_path / "d", machine=CPU, variant="nope")
    with pytest.raises(UsageError, match="not a bundle"):
        restore(variants["cpu"], tmp_path / "e", variant="cpu-torch2.13.0-cpu")
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()


def test_pinned_repeat_is_a_no_op_without_the_bundle(tmp_path: Path, bundle: Path) -> None:
    """Idempotent as an artifact: pinned to the bundle, a repeat restore neither fetches (the
    file is gone) nor writes (the parent is read-only)."""
    digest = sha256_file(bundle)
    dest = tmp_path / "ro" / "cache"
    first = restore(bundle, dest, sha256=digest, machine=H200)
    assert not first.noop
    before = tree(dest)
    bundle.unlink()
    dest.parent.chmod(0o555)
    try:
        again = restore(bundle, dest, sha256=digest, machine=H200)
    finally:
        dest.parent.chmod(0o755)
    assert again.noop and tree(dest) == before
    assert again.choice is not None and again.choice.variant.name == first.choice.variant.name


def test_unpinned_repeat_is_a_no_op_and_another_machine_swaps(tmp_path: Path, bundle) -> None:
    dest = tmp_path / "cache"
    restore(bundle, dest, machine=H200)
    state = (dest / STATE_NAME).read_bytes()
    assert restore(bundle, dest, machine=H200).noop
    assert (dest / STATE_NAME).read_bytes() == state  # nothing rewritten
    moved = restore(bundle, dest, machine=A100)  # the volume moved to another node
    assert (
        not moved.noop
        and "a100" in json.loads((dest / STATE_NAME).read_text())["bundle"]["variant"]
    )


def test_wrong_pin_is_exit_3_and_dest_untouched(tmp_path: Path, bundle: Path, installed: Path):
    before = tree(installed)
    with pytest.raises(IntegrityError, match="does not match the pinned"):
        restore(bundle, installed, sha256="0" * 64, machine=CPU)
    assert tree(installed) == before


# --- the command line: detection through a stand-in nvidia-smi, --json, inspect ---------------


def test_cli_restore_detects_the_gpu_and_says_why(tmp_path: Path, bundle: Path, cli) -> None:
    bindir = fake_smi(tmp_path / "bin", printing("NVIDIA H200, 9.0\n"))
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    r = cli("restore", bundle, "--dest", tmp_path / "c", "--json", no_torch=True, env=env)
    assert r.returncode == 0, r.stderr
    variant = json.loads(r.stdout)["variant"]
    assert variant["name"] == "h200-sm90-torch2.11.0-cu130"
    assert variant["machine"]["source"] == "nvidia-smi"
    assert "bundle: variant h200-sm90-torch2.11.0-cu130: this machine (GPU 'NVIDIA H200'" in (
        " ".join(r.stderr.split())
    )
    bindir = fake_smi(tmp_path / "bin2", printing("NVIDIA H100 80GB HBM3, 9.0\n"))
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    r = cli("restore", bundle, "--dest", tmp_path / "d", "--json", no_torch=True, env=env)
    assert r.returncode == 5, r.stderr
    error = json.loads(r.stdout)
    assert error["detail"]["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert {v["name"] for v in error["detail"]["variants"]} >= {"cpu-torch2.13.0-cpu"}
    r = cli("restore", bundle, "--dest", tmp_path / "e", "--torch-version", "2.11.0",
            "--json", no_torch=True, env={"PATH": f"{bindir}:{os.environ['PATH']}",
                                           "KILN_TORCH_VERSION": ""})  # fmt: skip
    assert r.returncode == 5  # the flag is read; the GPU still differs


def test_cli_inspect_lists_the_variants(bundle: Path, cli) -> None:
    r = cli("inspect", bundle, no_torch=True)
    assert r.returncode == 0, r.stderr
    for word in ("3 variants", "h200-sm90-torch2.11.0-cu130", "NVIDIA H200", "9.0", "2.11.0+cu130",
                 "cpu-torch2.13.0-cpu", "NVIDIA A100-SXM4-80GB"):  # fmt: skip
        assert word in r.stdout
    r = cli("inspect", bundle, "--json", no_torch=True)
    data = json.loads(r.stdout)
    assert data["bundle"] is True
    assert [v["name"] for v in data["variants"]] == [v.name for v in read_head(bundle).variants]
    assert {v["gpu"] for v in data["variants"]} == {None, "NVIDIA H200", "NVIDIA A100-SXM4-80GB"}


def test_an_index_that_names_another_machine_than_the_manifest_is_exit_3(
    tmp_path: Path, variants: dict[str, Path], installed: Path, cli
) -> None:
    """Issue 27, item 3: an index that called the CPU artifact "H100" installed it on an H100
    with exit 0 ("matches NVIDIA H100 … 9.0"). The key must be what the variant's manifest
    says, whichever way the variant is chosen."""
    from tests.archives import bundle_index_for, reg, write_bundle_raw

    data = variants["cpu"].read_bytes()
    h100 = {"device": "cuda", "gpu": "NVIDIA H100", "capability": "9.0", "torch": "2.13.0+cpu"}
    index = bundle_index_for({"h100": (data, h100)})
    lie = write_bundle_raw(
        tmp_path / "lie.kiln.tar.zst", index, [reg("variants/h100.kiln.tar.zst", data)]
    )
    before = tree(installed)
    on_h100 = Machine((Gpu("NVIDIA H100", "9.0"),), "nvidia-smi")
    for how in ({"machine": on_h100}, {"variant": "h100"}):
        with pytest.raises(IntegrityError, match=r"the bundle index says NVIDIA H100 9\.0"):
            restore(lie, installed, **how)
        assert tree(installed) == before
    proc = cli("restore", lie, "--dest", installed, "--variant", "h100", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "its manifest cpu · torch 2.13.0+cpu" in proc.stderr
