"""Push and restore through real servers on loopback: S3 (moto), GCS (gcp-storage-emulator),
an OCI registry, HTTP.

Push by digest and restore by digest must round-trip byte-identically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kiln
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError
from kiln.events import Event
from tests.archives import good_archive, sha
from tests.conftest import ROOT
from tests.keys import make_key
from tests.servers import gcs_server, oci_registry, s3_server, scripted_http

FILES = {"inductor/fxgraph/a/entry": b"A" * 5000, "inductor/xy/k.py": b"print(1)\n"}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with oci_registry(tmp_path_factory.mktemp("registry")) as host:
        yield host


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with s3_server(tmp_path_factory.mktemp("s3")) as endpoint:
        yield endpoint


@pytest.fixture
def aws_env(s3: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials the AWS way (environment), pointed at the loopback server."""
    env = {
        "AWS_ACCESS_KEY_ID": "kiln-test",
        "AWS_SECRET_ACCESS_KEY": "kiln-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import boto3

    client = boto3.client("s3", endpoint_url=s3)
    if "kiln" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket="kiln")
    return env


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gcs_server(tmp_path_factory.mktemp("gcs"), bucket="kiln") as endpoint:
        yield endpoint


@pytest.fixture
def gcs_env(gcs: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Google's clients go to an emulator named by STORAGE_EMULATOR_HOST, anonymously."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs)
    return {"STORAGE_EMULATOR_HOST": gcs}


@pytest.mark.parametrize(("scheme", "env_fixture"), [("s3", "aws_env"), ("gs", "gcs_env")])
def test_object_store_push_and_restore_round_trip(
    tmp_path: Path, scheme: str, env_fixture: str, request: pytest.FixtureRequest, cli
) -> None:
    env = request.getfixturevalue(env_fixture)
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    pushed = kiln.push(art, f"{scheme}://kiln/artifacts/")
    assert pushed.dest == f"{scheme}://kiln/artifacts/a.kiln.tar.zst"
    assert pushed.sha256 == sha(art)
    result = kiln.restore(pushed.dest, tmp_path / "cache", sha256=pushed.sha256)
    assert result.sha256 == sha(art)
    assert (tmp_path / "cache/inductor/xy/k.py").read_bytes() == FILES["inductor/xy/k.py"]
    with pytest.raises(NotFoundError):
        kiln.restore(f"{scheme}://kiln/artifacts/missing.kiln.tar.zst", tmp_path / "c2")
    url = f"{scheme}://kiln/cli/x.kiln.tar.zst"
    proc = cli("push", art, url, "--json", no_torch=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sha256"] == sha(art)
    proc = cli("restore", url, "--dest", tmp_path / "c3", no_torch=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c3/inductor/xy/k.py").read_bytes() == FILES["inductor/xy/k.py"]


def test_push_to_a_folder_keeps_the_file_name(tmp_path: Path, cli) -> None:
    """A destination ending in / is a folder, created if missing (issue 17, item 7b: it used to
    become a file named `newdir`); so is an existing folder; anything else is the file name."""
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    cases = {
        "newdir/": tmp_path / "newdir/a.kiln.tar.zst",
        "deep/er/": tmp_path / "deep/er/a.kiln.tar.zst",
        f"file://{tmp_path}/viaurl/": tmp_path / "viaurl/a.kiln.tar.zst",
        "newdir": tmp_path / "newdir/a.kiln.tar.zst",  # exists now: a folder without the /
        "renamed.kiln.tar.zst": tmp_path / "renamed.kiln.tar.zst",
    }
    for dest, expected in cases.items():
        proc = cli("push", art, dest, "--json", no_torch=True)
        assert proc.returncode == 0, proc.stderr
        pushed = json.loads(proc.stdout)
        assert set(pushed) == {"dest", "sha256", "size", "attestation"}
        assert pushed["attestation"] is None  # not signed: nothing beside it to upload
        assert tmp_path / pushed["dest"] == expected  # the CLI ran in tmp_path
        assert pushed["sha256"] == sha(expected) == sha(art)
        assert expected.is_file()
    assert sorted(p.name for p in (tmp_path / "newdir").iterdir()) == ["a.kiln.tar.zst"]


def test_oci_push_by_tag_restore_by_digest(tmp_path: Path, registry: str, cli) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    proc = cli("push", art, f"oci://{registry}/kiln/demo:v1", "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)
    assert pushed["sha256"] == sha(art)
    assert pushed["manifest_digest"].startswith("sha256:")
    assert pushed["pinned"] == f"oci://{registry}/kiln/demo@{pushed['manifest_digest']}"
    for source in (f"oci://{registry}/kiln/demo:v1", pushed["pinned"]):
        dest = tmp_path / source.rsplit("/", 1)[1].replace(":", "_").replace("@", "_")
        result = kiln.restore(source, dest, sha256=pushed["sha256"])
        assert result.sha256 == sha(art)
        assert json.loads((dest / "manifest.json").read_text())["name"] == "demo"


def test_oci_pushes_the_same_bytes_and_digest_twice(tmp_path: Path, registry: str) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    first = kiln.push(art, f"oci://{registry}/kiln/twice:a")
    second = kiln.push(art, f"oci://{registry}/kiln/twice:b")
    assert first.manifest_digest == second.manifest_digest
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    from kiln.artifact.storage import fetch

    with fetch(first.pinned, fetched) as got:
        assert got.path.read_bytes() == art.read_bytes()
        assert got.file.read() == art.read_bytes()


def test_oci_errors(tmp_path: Path, registry: str) -> None:
    with pytest.raises(NotFoundError):
        kiln.restore(f"oci://{registry}/kiln/nothing:v1", tmp_path / "c")
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    pushed = kiln.push(art, f"oci://{registry}/kiln/pin:v1")
    wrong = "sha256:" + "0" * 64
    with pytest.raises((IntegrityError, NotFoundError)):
        kiln.restore(f"oci://{registry}/kiln/pin@{wrong}", tmp_path / "d")
    with pytest.raises(IntegrityError):
        kiln.restore(pushed.pinned, tmp_path / "e", sha256="1" * 64)
    assert not (tmp_path / "e").exists()
    with pytest.raises(UsageError):
        kiln.restore(f"oci://{registry}", tmp_path / "f")


def test_unknown_scheme_is_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unsupported source scheme"):
        kiln.restore("ftp://example/a.kiln.tar.zst", tmp_path / "c")
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    with pytest.raises(UsageError, match="cannot push"):
        kiln.push(art, "ftp://example/a")


@pytest.mark.parametrize(
    ("scheme", "env_fixture"), [("s3", "aws_env"), ("gs", "gcs_env"), ("oci", "registry")]
)
def test_remote_fetches_keep_the_deadline(
    tmp_path: Path, scheme: str, env_fixture: str, request: pytest.FixtureRequest
) -> None:
    """The --timeout budget is checked in every client's copy loop (here a consumer that stalls
    past it after the first chunk), not only by the clients' own per-request timeouts."""
    value = request.getfixturevalue(env_fixture)
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    url = f"oci://{value}/kiln/deadline:v1" if scheme == "oci" else f"{scheme}://kiln/deadline/"
    pushed = kiln.push(art, url)
    source = pushed.pinned if scheme == "oci" else pushed.dest

    def stall(event: Event) -> None:
        if event.event == "fetched":
            time.sleep(1.1)

    with pytest.raises(KilnError, match=r"did not finish within timeout=1s"):
        kiln.restore(source, tmp_path / "c", timeout=1, on_event=stall)
    assert not (tmp_path / "c").exists()


# --- backends: one Store each, imported only when their scheme is used -----------------------

# What a slim init container that restores from plain files or http(s) does not have.
EXTRAS = ("fsspec", "s3fs", "gcsfs", "boto3", "botocore", "oras", "requests", "urllib3")


def run_without_extras(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where torch and every storage extra is unimportable."""
    blocked = ("torch", "triton", *EXTRAS)
    prelude = f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "NO_COLOR": "1", "PATH": "/usr/bin:/bin"},
    )


LOADED = "print(sorted(m for m in sys.modules if m.startswith('kiln.artifact.storage.')))"


def test_every_scheme_resolves_to_a_store_without_its_extra() -> None:
    """The static table names real Store classes, and no backend module imports its client (or
    another backend) at import time: the table can be resolved in a slim image."""
    code = (
        "from kiln.artifact.storage import BACKENDS, Store, backend\n"
        "for scheme in BACKENDS:\n"
        "    assert isinstance(backend(scheme), Store), scheme\n"
        "assert backend('ftp') is None\n" + LOADED
    )
    proc = run_without_extras(code)
    assert proc.returncode == 0, proc.stderr
    modules = ["base", "cloud", "file", "http", "oci"]
    assert proc.stdout.strip() == str([f"kiln.artifact.storage.{m}" for m in modules])


def test_restore_imports_only_the_backend_of_its_scheme(tmp_path: Path) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    restore = "from kiln.artifact.restore import restore\nrestore({!r}, {!r})\n"
    proc = run_without_extras(restore.format(str(art), str(tmp_path / "c1")) + LOADED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(["kiln.artifact.storage.base", "kiln.artifact.storage.file"])
    with scripted_http(lambda x: x.body(art.read_bytes())) as url:
        code = restore.format(f"{url}/a.kiln.tar.zst", str(tmp_path / "c2")) + LOADED
        proc = run_without_extras(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(["kiln.artifact.storage.base", "kiln.artifact.storage.http"])
    assert (tmp_path / "c2/inductor/xy/k.py").read_bytes() == FILES["inductor/xy/k.py"]


@pytest.mark.parametrize(
    ("source", "extra"),
    [("s3://kiln/a.kiln.tar.zst", "s3"), ("gs://kiln/a", "gcs"), ("oci://r.io/kiln/a:v1", "oci")],
)
def test_a_missing_extra_is_one_line_and_exit_2(tmp_path: Path, source: str, extra: str) -> None:
    code = f"sys.argv = ['kiln', 'restore', {source!r}, '--dest', {str(tmp_path / 'c')!r}]\n"
    proc = run_without_extras(code + "from kiln.cli import main\nmain()")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (  # torch is blocked too: the torch-free installer's advice
        f"kiln: error: this source needs the {extra!r} extra: KILN_EXTRAS={extra} "
        f"scripts/install-restore.sh PYTHON torch-kiln (pip install 'torch-kiln[{extra}]' "
        "would pull in torch)"
    )
    assert not (tmp_path / "c").exists()


# --- signed artifacts: the attestation travels with the artifact (issue 12) -----------------


def signed(tmp_path: Path, name: str = "a") -> tuple[Path, Path, Path]:
    """A signed artifact (ARTIFACT.intoto.jsonl beside it), its public key and another key's."""
    pytest.importorskip("securesystemslib", reason="needs the [sign] extra")
    from kiln.artifact.attestation import sign

    key, other = make_key(tmp_path, "key"), make_key(tmp_path, "other")
    art = good_archive(tmp_path / f"{name}.kiln.tar.zst", FILES)
    sign(art, str(key.private))
    return art, key.public, other.public


def verified_round_trip(cli, source: str, tmp_path: Path, good: Path, bad: Path, **kw) -> None:
    """Restore ``source`` with the right key (0), then with a wrong one into a DEST that holds
    another artifact (3, DEST byte-identical)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = cli("restore", source, "--dest", tmp_path / "ok", "--verify-key", good, **kw)
    assert proc.returncode == 0, proc.stderr
    assert "attestation verified" in proc.stderr
    assert (tmp_path / "ok/inductor/xy/k.py").read_bytes() == FILES["inductor/xy/k.py"]
    dest = tmp_path / "untouched"
    kiln.restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/old": b"old"}), dest)
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    proc = cli("restore", source, "--dest", dest, "--verify-key", bad, **kw)
    assert proc.returncode == 3, proc.stderr
    assert "does not verify" in proc.stderr
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".untouched")) == []


def test_signed_push_to_a_path_puts_the_attestation_beside(tmp_path: Path, cli) -> None:
    art, good, bad = signed(tmp_path)
    proc = cli("push", art, "out/", "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)
    beside = tmp_path / "out/a.kiln.tar.zst.intoto.jsonl"
    assert tmp_path / pushed["attestation"] == beside
    assert beside.read_bytes() == art.with_name(art.name + ".intoto.jsonl").read_bytes()
    assert "attestation" in cli("push", art, "out/", no_torch=True).stdout
    verified_round_trip(cli, str(tmp_path / "out/a.kiln.tar.zst"), tmp_path, good, bad)


@pytest.mark.parametrize(("scheme", "env_fixture"), [("s3", "aws_env"), ("gs", "gcs_env")])
def test_signed_push_to_an_object_store_round_trips(
    tmp_path: Path, scheme: str, env_fixture: str, request: pytest.FixtureRequest, cli
) -> None:
    env = request.getfixturevalue(env_fixture)
    art, good, bad = signed(tmp_path)
    url = f"{scheme}://kiln/signed/x.kiln.tar.zst"
    proc = cli("push", art, url, "--json", no_torch=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["attestation"] == url + ".intoto.jsonl"
    verified_round_trip(cli, url, tmp_path, good, bad, env=env)


def test_signed_push_to_oci_attaches_a_referrer(tmp_path: Path, registry: str, cli) -> None:
    """The attestation is an OCI 1.1 referrer of the artifact's manifest; this registry (CNCF
    distribution 2.8) has no referrers API, so it is found through the `sha256-<hex>` tag."""
    art, good, bad = signed(tmp_path)
    ref = f"oci://{registry}/kiln/signed:v1"
    proc = cli("push", art, ref, "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)
    assert pushed["attestation"].startswith(f"oci://{registry}/kiln/signed@sha256:")
    assert pushed["sha256"] == sha(art)
    for source in (ref, pushed["pinned"]):
        verified_round_trip(cli, source, tmp_path / source[-6:], good, bad)
    referrer = pushed["attestation"].rsplit("@", 1)[1]
    tag = pushed["manifest_digest"].replace(":", "-")
    index = _registry_json(registry, f"kiln/signed/manifests/{tag}")
    entries = [m for m in index["manifests"] if m["digest"] == referrer]
    assert entries and entries[0]["artifactType"] == "application/vnd.dsse.envelope.v1+json"
    manifest = _registry_json(registry, f"kiln/signed/manifests/{referrer}")
    assert manifest["subject"]["digest"] == pushed["manifest_digest"]


def test_oci_rotation_and_unsigned(tmp_path: Path, registry: str, cli) -> None:
    """A second signature pushed later joins the first (both keys verify); an unsigned artifact
    restored with --verify-key is refused (3): the registry has no attestation for it."""
    art, good, other = signed(tmp_path)
    ref = f"oci://{registry}/kiln/rotated:v1"
    assert cli("push", art, ref, no_torch=True).returncode == 0
    from kiln.artifact.attestation import sign

    sign(art, str(tmp_path / "other.pem"))
    assert cli("push", art, ref, no_torch=True).returncode == 0
    for i, key in enumerate((good, other)):
        proc = cli("restore", ref, "--dest", tmp_path / f"c{i}", "--verify-key", key)
        assert proc.returncode == 0, proc.stderr
    plain = good_archive(tmp_path / "p.kiln.tar.zst", {"inductor/p": b"p" * 100})
    assert cli("push", plain, f"oci://{registry}/kiln/plain:v1", no_torch=True).returncode == 0
    proc = cli(
        "restore", f"oci://{registry}/kiln/plain:v1", "--dest", tmp_path / "p", "--verify-key", good
    )
    assert proc.returncode == 3, proc.stderr
    assert "no attestation attached" in proc.stderr
    assert not (tmp_path / "p").exists()


def test_a_stale_attestation_is_not_pushed(tmp_path: Path, cli) -> None:
    """ARTIFACT.intoto.jsonl for other bytes (a re-bake without re-signing): exit 3, nothing
    pushed, rather than an artifact every verifying restore refuses."""
    art, _, _ = signed(tmp_path)
    good_archive(art, {"inductor/other": b"x" * 100})
    proc = cli("push", art, "out/", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "attests another artifact" in proc.stderr
    assert not (tmp_path / "out").exists()


def _registry_json(registry: str, path: str) -> dict:
    import urllib.request

    accept = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json"
    req = urllib.request.Request(f"http://{registry}/v2/{path}", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_oci_bundle_is_an_image_index_and_restores_the_machines_variant(
    tmp_path: Path, registry: str, cli
) -> None:
    """Issue 14: a bundle pushed to a registry is an OCI image index, one manifest per variant,
    each annotated with its GPU and torch build (and OCI platform), so registries list them;
    restore picks from the index as from a bundle file, pinned by the index digest."""
    from kiln.artifact.bundle import write_bundle
    from kiln.artifact.machine import Gpu, Machine
    from tests.archives import CPU_FP, H200_FP, variant_archive
    from tests.test_machine import fake_smi, printing

    cpu = variant_archive(tmp_path / "cpu.kiln.tar.zst", CPU_FP)
    h200 = variant_archive(tmp_path / "h200.kiln.tar.zst", H200_FP)
    bundle = write_bundle([cpu, h200], tmp_path / "release.kiln.tar.zst").path
    proc = cli("push", bundle, f"oci://{registry}/kiln/release:v1", "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)
    index = _registry_json(registry, "kiln/release/manifests/v1")
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert "sha256:" + pushed["sha256"] == pushed["manifest_digest"]
    entries = {e["annotations"]["dev.kiln.variant"]: e for e in index["manifests"]}
    gpu = entries["h200-sm90-torch2.11.0-cu130"]
    assert gpu["annotations"]["dev.kiln.gpu"] == "NVIDIA H200"
    assert gpu["annotations"]["dev.kiln.capability"] == "9.0"
    assert gpu["annotations"]["dev.kiln.torch"] == "2.11.0+cu130"
    assert gpu["platform"] == {"architecture": "amd64", "os": "linux"}
    assert entries["cpu-torch2.13.0-cpu"]["annotations"]["dev.kiln.torch"] == "2.13.0+cpu"
    child = _registry_json(registry, f"kiln/release/manifests/{gpu['digest']}")
    assert child["layers"][0]["digest"] == "sha256:" + sha(h200)  # the variant, unchanged
    # restore: a CPU machine gets the cpu variant, pinned by the index digest
    result = kiln.restore(
        f"oci://{registry}/kiln/release:v1", tmp_path / "c", sha256=pushed["sha256"],
        machine=Machine(),
    )  # fmt: skip
    assert result.sha256 == sha(cpu) and result.choice is not None
    assert result.choice.variant.name == "cpu-torch2.13.0-cpu"
    assert result.choice.bundle_sha256 == pushed["sha256"]
    again = kiln.restore(pushed["pinned"], tmp_path / "c", sha256=pushed["sha256"])
    assert again.noop  # pinned to the index: nothing fetched
    with pytest.raises(IntegrityError, match="does not match the pinned"):
        kiln.restore(pushed["pinned"], tmp_path / "x", sha256=sha(cpu), machine=Machine())
    h200_machine = Machine((Gpu("NVIDIA H200", "9.0"),), "nvidia-smi")
    result = kiln.restore(pushed["pinned"], tmp_path / "g", machine=h200_machine)
    assert result.sha256 == sha(h200)
    # the CLI, detecting the GPU through nvidia-smi; an unknown GPU is exit 5
    bindir = fake_smi(tmp_path / "bin", printing("NVIDIA B200, 10.0\n"))
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    proc = cli("restore", pushed["pinned"], "--dest", tmp_path / "b", no_torch=True, env=env)
    assert proc.returncode == 5, proc.stderr
    assert "NVIDIA B200" in proc.stderr and "h200-sm90-torch2.11.0-cu130" in proc.stderr
    assert not (tmp_path / "b").exists()
