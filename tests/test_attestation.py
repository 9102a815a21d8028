"""Signed provenance (issue 12): `kiln sign`, `kiln restore --verify-key`, `kiln inspect`,
`kiln bake --sign-key`.

Everything is real: keys generated here with `cryptography` (and with `openssl genpkey`, the
documented command), archives from tests/archives.py, the CLI in a subprocess, an HTTP server on
loopback. The interop test re-verifies an envelope without securesystemslib, from the DSSE spec's
PAE and raw `cryptography`, so kiln's files verify wherever DSSE is spoken.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("securesystemslib", reason="needs the [sign] extra")

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from kiln.artifact.attestation import (
    BUILD_TYPE,
    PAYLOAD_TYPE,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    ci_builder,
    default_location,
)
from kiln.artifact.restore import restore
from kiln.errors import IntegrityError, UsageError
from tests.archives import good_archive, sha
from tests.conftest import mlp_spec
from tests.keys import KeyPair, make_key
from tests.servers import serve_folder

FILES = {"inductor/fxgraph/a/entry": b"A" * 1000, "inductor/xy/k.py": b"print(1)\n"}
OTHER = {"inductor/fxgraph/b/entry": b"B" * 1000}
GITHUB = {
    "GITHUB_ACTIONS": "true",
    "GITHUB_SERVER_URL": "https://github.com",
    "GITHUB_REPOSITORY": "acme/llm",
    "GITHUB_WORKFLOW_REF": "acme/llm/.github/workflows/bake.yml@refs/heads/main",
    "GITHUB_RUN_ID": "42",
    "GITHUB_RUN_ATTEMPT": "2",
    "GITHUB_SHA": "a" * 40,
    "GITHUB_REF": "refs/heads/main",
    "RUNNER_ENVIRONMENT": "self-hosted",
}


@pytest.fixture
def key(tmp_path: Path) -> KeyPair:
    return make_key(tmp_path, "signing")


@pytest.fixture
def art(tmp_path: Path) -> Path:
    return good_archive(tmp_path / "a.kiln.tar.zst", FILES)


def envelope_of(path: Path) -> dict:
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def statement_of(path: Path) -> dict:
    return json.loads(base64.b64decode(envelope_of(path)["payload"]))


def rewrite(path: Path, edit: Callable[[dict], None]) -> None:
    env = envelope_of(path)
    edit(env)
    path.write_text(json.dumps(env) + "\n")


def snapshot(dest: Path) -> dict[str, bytes]:
    """DEST's files and the names beside it: what an untouched DEST must keep exactly."""
    files = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    beside = {  # restore's lock, staging and old trees: none may be left
        f"../{p.name}": b"" for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}")
    }
    return {**files, **beside}


def one_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr
    return lines[0]


def sign_ok(cli, artifact: Path, key_ref: str, *extra: str, env: dict | None = None) -> dict:
    proc = cli("sign", artifact, "--key", key_ref, *extra, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- sign → restore -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ed25519", "p256"])
def test_sign_then_restore_with_the_right_key(tmp_path: Path, art: Path, cli, kind: str) -> None:
    pair = make_key(tmp_path, kind, kind)
    signed = sign_ok(cli, art, str(pair.private))
    assert signed["attestation"] == f"{art}.intoto.jsonl"
    assert signed["sha256"] == sha(art) and signed["keyid"].startswith("SHA256:")

    proc = cli("restore", art, "--dest", tmp_path / "cache", "--verify-key", pair.public)
    assert proc.returncode == 0, proc.stderr
    # Who and what built it, on stderr; the restore report on stdout as before.
    assert "attestation verified: signed by" in proc.stderr and signed["keyid"] in proc.stderr
    assert "restored demo" in proc.stdout

    proc = cli("restore", art, "--dest", tmp_path / "c2", "--verify-key", pair.public, "--json")
    assert proc.returncode == 0, proc.stderr
    prov = json.loads(proc.stdout)["provenance"]
    assert prov["verified"] is True and prov["keyid"] == signed["keyid"]
    assert prov["sha256"] == sha(art) and prov["subject"] == art.name
    assert prov["key"] == str(pair.public) and prov["builder"].startswith("urn:torch-kiln:local:")
    assert prov["predicate_type"] == PREDICATE_TYPE


def test_restore_without_a_key_reports_no_provenance(tmp_path: Path, art: Path, cli) -> None:
    proc = cli("restore", art, "--dest", tmp_path / "cache", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["provenance"] is None


def test_library_sign_and_restore(tmp_path: Path, art: Path, key: KeyPair) -> None:
    import kiln

    assert kiln.sign(art, str(key.private)).attestation == Path(f"{art}.intoto.jsonl")
    result = restore(art, tmp_path / "cache", verify_keys=[key.public])
    assert result.provenance is not None and result.provenance["sha256"] == sha(art)
    assert restore(art, tmp_path / "cache", verify_keys=str(key.public)).noop
    other = make_key(tmp_path, "other")
    with pytest.raises(IntegrityError, match="does not verify"):
        restore(art, tmp_path / "c2", verify_keys=[other.public])
    assert not (tmp_path / "c2").exists()


# --- refusals: exit 3, DEST untouched -------------------------------------------------------


def _wrong_key(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    return ["--verify-key", str(make_key(tmp, "stranger").public)]


def _flip_payload(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    def edit(env: dict) -> None:
        body = bytearray(base64.b64decode(env["payload"]))
        at = body.index(b"urn:torch-kiln:local:") + 4
        body[at] ^= 0x01  # one bit of the builder id
        env["payload"] = base64.b64encode(bytes(body)).decode()

    rewrite(Path(f"{art}.intoto.jsonl"), edit)
    return ["--verify-key", str(key.public)]


def _flip_signature(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    def edit(env: dict) -> None:
        sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
        sig[10] ^= 0x80
        env["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()

    rewrite(Path(f"{art}.intoto.jsonl"), edit)
    return ["--verify-key", str(key.public)]


def _payload_type(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    rewrite(Path(f"{art}.intoto.jsonl"), lambda env: env.update(payloadType="text/plain"))
    return ["--verify-key", str(key.public)]


def _missing(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    Path(f"{art}.intoto.jsonl").unlink()
    return ["--verify-key", str(key.public)]


def _not_json(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    Path(f"{art}.intoto.jsonl").write_bytes(b"\x00garbage\n")
    return ["--verify-key", str(key.public)]


def _another_artifact(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    """A valid attestation, signed by the trusted key, for other bytes: moved beside `art`."""
    other = good_archive(tmp / "other.kiln.tar.zst", OTHER)
    _sign(other, key)
    shutil.copy(f"{other}.intoto.jsonl", f"{art}.intoto.jsonl")
    return ["--verify-key", str(key.public)]


def _another_artifact_pinned(tmp: Path, art: Path, key: KeyPair) -> list[str]:
    return [*_another_artifact(tmp, art, key), "--sha256", sha(art)]


def _sign(artifact: Path, key: KeyPair) -> None:
    from kiln.artifact.attestation import sign

    sign(artifact, str(key.private))


REFUSALS = {
    "wrong-key": (_wrong_key, "does not verify with any --verify-key"),
    "payload-byte-flipped": (_flip_payload, "does not verify"),
    "signature-flipped": (_flip_signature, "does not verify"),
    "payload-type": (_payload_type, "payloadType 'text/plain'"),
    "missing": (_missing, "no attestation there"),
    "not-json": (_not_json, "not"),
    "another-artifact": (_another_artifact, "an attestation for another artifact"),
    "another-artifact-pinned": (_another_artifact_pinned, "an attestation for another artifact"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_attestations_exit_3_and_leave_dest_untouched(
    tmp_path: Path, art: Path, key: KeyPair, cli, case: str
) -> None:
    dest = tmp_path / "cache"
    restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/old": b"old"}), dest)
    before = snapshot(dest)
    _sign(art, key)
    make, message = REFUSALS[case]
    args = make(tmp_path, art, key)
    proc = cli("restore", art, "--dest", dest, *args)
    assert proc.returncode == 3, proc.stderr
    assert message in one_error(proc.stderr)
    assert snapshot(dest) == before
    if case == "wrong-key":  # the JSON form says the same, with the exit code
        proc = cli("restore", art, "--dest", dest, *args, "--json")
        assert proc.returncode == 3 and json.loads(proc.stdout)["exit_code"] == 3


def test_no_op_restore_still_verifies(tmp_path: Path, art: Path, key: KeyPair, cli) -> None:
    """Restoring the installed digest again is a no-op, but never one that skips the check."""
    dest = tmp_path / "cache"
    _sign(art, key)
    assert cli("restore", art, "--dest", dest, "--verify-key", key.public).returncode == 0
    before = snapshot(dest)
    _another_artifact(tmp_path, art, key)
    for pin in ([], ["--sha256", sha(art)]):
        proc = cli("restore", art, "--dest", dest, "--verify-key", key.public, *pin)
        assert proc.returncode == 3, proc.stderr
        assert "another artifact" in one_error(proc.stderr)
    assert snapshot(dest) == before


def test_a_swapped_artifact_is_refused(tmp_path: Path, art: Path, key: KeyPair, cli) -> None:
    """The attestation stays; the artifact beside it is replaced by other (valid) bytes."""
    _sign(art, key)
    good_archive(art, OTHER)
    proc = cli("restore", art, "--dest", tmp_path / "cache", "--verify-key", key.public)
    assert proc.returncode == 3 and "another artifact" in one_error(proc.stderr)
    assert not (tmp_path / "cache").exists()


# --- keys: rotation, kinds, sources ---------------------------------------------------------


def test_key_rotation_accepts_old_and_new_keys(tmp_path: Path, cli) -> None:
    old, new = make_key(tmp_path, "old", "p256"), make_key(tmp_path, "new", "ed25519")
    a = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    b = good_archive(tmp_path / "b.kiln.tar.zst", OTHER)
    _sign(a, old)
    _sign(b, new)
    both = ["--verify-key", str(old.public), "--verify-key", str(new.public)]
    for artifact in (a, b):
        proc = cli("restore", artifact, "--dest", tmp_path / artifact.name[0], *both, "--json")
        assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["provenance"]["key"] == str(new.public)
    # Retired: only the new key trusted, so what the old key signed is refused.
    proc = cli("restore", a, "--dest", tmp_path / "x", "--verify-key", new.public)
    assert proc.returncode == 3 and not (tmp_path / "x").exists()
    # The same rotation through KILN_VERIFY_KEY (comma- or newline-separated).
    env = {"KILN_VERIFY_KEY": f"{old.public},\n{new.public}"}
    proc = cli("restore", a, "--dest", tmp_path / "e", env=env)
    assert proc.returncode == 0 and "attestation verified" in proc.stderr, proc.stderr


def test_keys_from_environment_and_file_descriptor(tmp_path: Path, art: Path, cli) -> None:
    pair = make_key(tmp_path, "ci", "p256")
    env = {"SIGN_SECRET": pair.private_pem(), "TRUSTED": pair.public.read_text()}
    signed = sign_ok(cli, art, "env:SIGN_SECRET", env=env)
    proc = cli("restore", art, "--dest", tmp_path / "cache", "--verify-key", "env:TRUSTED", env=env)
    assert proc.returncode == 0, proc.stderr
    assert signed["keyid"] in proc.stderr and "env:TRUSTED" in proc.stderr
    # fd:N: the key arrives on a pipe (as `3< key.pem` or a secret mount hands it over).
    read, write = os.pipe()
    os.write(write, pair.private.read_bytes())
    os.close(write)
    out = tmp_path / "fd.intoto.jsonl"
    argv = ["sign", str(art), "--key", f"fd:{read}", "-o", str(out)]
    code = f"import sys; sys.argv = ['kiln', *{argv!r}]; from kiln.cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code], pass_fds=(read,), capture_output=True, text=True
    )
    os.close(read)
    assert proc.returncode == 0, proc.stderr
    proc = cli(
        "restore", art, "--dest", tmp_path / "c2", "--verify-key", pair.public,
        "--attestation", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_openssl_made_keys_work(tmp_path: Path, art: Path, cli) -> None:
    """The README's commands: `openssl genpkey` for Ed25519 and P-256, `openssl pkey -pubout`."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    for name, args in (
        ("ed", ["-algorithm", "ed25519"]),
        ("ec", ["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"]),
    ):
        priv, pub = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub"
        subprocess.run(["openssl", "genpkey", *args, "-out", priv], check=True)
        subprocess.run(["openssl", "pkey", "-in", priv, "-pubout", "-out", pub], check=True)
        sign_ok(cli, art, str(priv))
        assert restore(art, tmp_path / name, verify_keys=[pub]).provenance is not None


def _encrypted(tmp: Path, _key: KeyPair) -> Path:
    p = tmp / "enc.pem"
    p.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    return p


def _rsa(tmp: Path, _key: KeyPair) -> Path:
    p = tmp / "rsa.pem"
    p.write_bytes(
        rsa.generate_private_key(65537, 2048).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return p


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t, k: k.public, "not a private key"),
        (_encrypted, "encrypted"),
        (_rsa, "Ed25519 or ECDSA P-256"),
        (lambda t, k: t / "nope.pem", "no such file"),
        (lambda t, k: "env:KILN_TEST_UNSET_KEY", "is not set"),
        (lambda t, k: "fd:x", "fd:N"),
    ],
    ids=["public-key", "encrypted", "rsa", "missing", "unset-env", "bad-fd"],
)
def test_unusable_signing_keys_are_usage_errors(
    tmp_path: Path, art: Path, key: KeyPair, cli, make, message: str
) -> None:
    proc = cli("sign", art, "--key", make(tmp_path, key))
    assert proc.returncode == 2 and message in one_error(proc.stderr)
    assert not Path(f"{art}.intoto.jsonl").exists()


def test_unusable_verify_arguments_are_usage_errors(
    tmp_path: Path, art: Path, key: KeyPair, cli
) -> None:
    _sign(art, key)
    dest = tmp_path / "cache"
    with pytest.raises(UsageError, match="holds a private key"):
        restore(art, dest, verify_keys=[key.private])
    with pytest.raises(UsageError, match="empty key reference"):
        restore(art, dest, verify_keys="")
    cases = [
        ([], {"KILN_VERIFY_KEY": " , "}, "KILN_VERIFY_KEY is set but names no key"),
        (["--attestation", f"{art}.intoto.jsonl"], {}, "--attestation needs --verify-key"),
    ]
    for args, env, message in cases:
        proc = cli("restore", art, "--dest", dest, *args, env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in one_error(proc.stderr)
    assert not dest.exists()


# --- the statement, and DSSE without securesystemslib ---------------------------------------


def _pae(payload_type: str, body: bytes) -> bytes:
    """The DSSE spec's pre-authentication encoding, written out here independently."""
    t = payload_type.encode()
    return (
        b"DSSEv1 " + str(len(t)).encode() + b" " + t + b" " + str(len(body)).encode() + b" " + body
    )


@pytest.mark.parametrize("kind", ["ed25519", "p256"])
def test_envelope_follows_the_dsse_spec(tmp_path: Path, art: Path, cli, kind: str) -> None:
    pair = make_key(tmp_path, kind, kind)
    signed = sign_ok(cli, art, str(pair.private))
    text = Path(signed["attestation"]).read_text()
    assert text.endswith("\n") and text.count("\n") == 1  # one JSON line: .intoto.jsonl
    env = json.loads(text)
    assert set(env) == {"payload", "payloadType", "signatures"}
    assert env["payloadType"] == PAYLOAD_TYPE == "application/vnd.in-toto+json"
    body = base64.b64decode(env["payload"], validate=True)
    [signature] = env["signatures"]
    public = serialization.load_pem_public_key(pair.public.read_bytes())
    sig = base64.b64decode(signature["sig"], validate=True)
    if kind == "ed25519":
        public.verify(sig, _pae(env["payloadType"], body))  # raises InvalidSignature otherwise
    else:
        public.verify(sig, _pae(env["payloadType"], body), ec.ECDSA(hashes.SHA256()))  # DER
    # keyid: the OpenSSH fingerprint, as `ssh-keygen -l` (and cosign's Go verifier) compute it.
    if kind == "p256" and shutil.which("ssh-keygen"):
        ssh = subprocess.run(
            ["ssh-keygen", "-i", "-m", "PKCS8", "-f", pair.public],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        listed = subprocess.run(
            ["ssh-keygen", "-l", "-f", "-"],
            input=ssh.stdout, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert signature["keyid"] == listed.stdout.split()[1]
    assert signature["keyid"] == signed["keyid"]

    statement = json.loads(body)
    assert statement["_type"] == STATEMENT_TYPE == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": art.name, "digest": {"sha256": sha(art)}}]
    assert statement["predicateType"] == PREDICATE_TYPE == "https://slsa.dev/provenance/v1"
    build = statement["predicate"]["buildDefinition"]
    assert build["buildType"] == BUILD_TYPE
    assert build["externalParameters"]["spec_sha256"] == "0" * 64
    assert set(build["internalParameters"]) >= {"grid", "coverage", "env", "compile_kwargs"}
    names = [d["name"] for d in build["resolvedDependencies"]]
    assert "fingerprint" in names
    for dep in build["resolvedDependencies"]:  # SLSA: each names a uri or a digest
        assert dep.get("uri") or dep.get("digest")
    run = statement["predicate"]["runDetails"]
    assert run["builder"]["version"] == {"torch-kiln": "0.1.0"}
    assert run["metadata"]["finishedOn"] == "1970-01-01T00:00:00+00:00"


def test_verification_ignores_the_unauthenticated_keyid(
    tmp_path: Path, art: Path, key: KeyPair, cli
) -> None:
    """DSSE's keyid is a hint: an envelope whose keyid is empty (cosign writes none) or wrong
    still verifies with the right key, and a right keyid never makes a bad signature pass."""
    _sign(art, key)
    att = Path(f"{art}.intoto.jsonl")
    for keyid in ("", "SHA256:not-this-one"):
        rewrite(att, lambda env, k=keyid: env["signatures"][0].update(keyid=k))
        proc = cli(
            "restore", art, "--dest", tmp_path / f"c{len(keyid)}", "--verify-key", key.public
        )
        assert proc.returncode == 0, proc.stderr


def test_github_actions_builder(tmp_path: Path, art: Path, key: KeyPair, cli) -> None:
    built = ci_builder(GITHUB)
    assert built.id == "https://github.com/acme/llm/.github/workflows/bake.yml@refs/heads/main"
    assert built.invocation == "https://github.com/acme/llm/actions/runs/42/attempts/2"
    signed = sign_ok(cli, art, str(key.private), env=GITHUB)
    assert signed["builder"] == built.id and signed["source_commit"] == "a" * 40
    statement = statement_of(Path(signed["attestation"]))
    deps = statement["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert deps[0] == {
        "name": "source",
        "uri": "git+https://github.com/acme/llm@refs/heads/main",
        "digest": {"gitCommit": "a" * 40},
    }
    assert statement["predicate"]["buildDefinition"]["internalParameters"]["ci_runner"] == (
        "self-hosted"
    )
    proc = cli("restore", art, "--dest", tmp_path / "cache", "--verify-key", key.public)
    assert proc.returncode == 0 and built.id in proc.stderr and built.invocation in proc.stderr


def test_default_attestation_location() -> None:
    assert default_location("/a/x.kiln.tar.zst") == "/a/x.kiln.tar.zst.intoto.jsonl"
    assert default_location("s3://b/k/x.kiln.tar.zst") == "s3://b/k/x.kiln.tar.zst.intoto.jsonl"
    assert (
        default_location("https://h/x.kiln.tar.zst?sig=1")
        == "https://h/x.kiln.tar.zst.intoto.jsonl?sig=1"
    )
    # an oci:// reference names a manifest: its attestations are its OCI referrers (kiln push
    # attaches them; tests/test_storage.py round-trips them through a real registry)
    assert default_location("oci://r:5000/k/x:v1") == "oci://r:5000/k/x:v1"


# --- over HTTP, without torch, without the extra, in inspect ---------------------------------


def test_attestation_fetched_beside_an_http_source(
    tmp_path: Path, art: Path, key: KeyPair, cli
) -> None:
    _sign(art, key)
    with serve_folder(art.parent) as url:
        proc = cli(
            "restore", f"{url}/{art.name}", "--dest", tmp_path / "cache",
            "--verify-key", key.public, "--json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["provenance"]["attestation"].startswith(url)
        Path(f"{art}.intoto.jsonl").unlink()  # the server now answers 404 for it
        proc = cli(
            "restore", f"{url}/{art.name}", "--dest", tmp_path / "c2", "--verify-key", key.public
        )
        assert proc.returncode == 3 and "no attestation there" in one_error(proc.stderr)
    assert not (tmp_path / "c2").exists()


def test_verify_without_torch(tmp_path: Path, art: Path, key: KeyPair, cli) -> None:
    _sign(art, key)
    proc = cli(
        "restore", art, "--dest", tmp_path / "cache", "--verify-key", key.public, no_torch=True
    )
    assert proc.returncode == 0 and "attestation verified" in proc.stderr, proc.stderr
    proc = cli("sign", art, "--key", key.private, "-o", tmp_path / "x.jsonl", no_torch=True)
    assert proc.returncode == 0, proc.stderr


NO_SIGN = "import sys; sys.modules['securesystemslib'] = None; sys.modules['cryptography'] = None; "


def kiln_without_extra(cwd: Path, *args: object) -> subprocess.CompletedProcess[str]:
    argv = ["kiln", *map(str, args)]
    code = f"{NO_SIGN}sys.argv = {argv!r}; from kiln.cli import main; main()"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_without_the_sign_extra(tmp_path: Path, art: Path, key: KeyPair, write_spec) -> None:
    """Restore and bake work without [sign]; asking for a signature or a check says what to
    install (exit 2), and bake says it before compiling anything."""
    hint = "pip install 'torch-kiln[sign]'"
    proc = kiln_without_extra(tmp_path, "sign", art, "--key", key.private)
    assert proc.returncode == 2 and hint in one_error(proc.stderr)
    proc = kiln_without_extra(
        tmp_path, "restore", art, "--dest", tmp_path / "c", "--verify-key", key.public
    )
    assert proc.returncode == 2 and hint in one_error(proc.stderr)
    assert not (tmp_path / "c").exists()
    proc = kiln_without_extra(tmp_path, "restore", art, "--dest", tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    spec = write_spec(mlp_spec())
    proc = kiln_without_extra(
        tmp_path, "bake", spec, "-o", tmp_path / "m.kiln.tar.zst", "--sign-key", key.private
    )
    assert proc.returncode == 2 and hint in one_error(proc.stderr)
    assert not (tmp_path / "m.kiln.tar.zst").exists()
    _sign(art, key)
    proc = kiln_without_extra(tmp_path, "inspect", art)  # showing needs no crypto
    assert proc.returncode == 0 and "subject matches this artifact: yes" in proc.stdout


def test_inspect_shows_the_attestation_unverified(
    tmp_path: Path, art: Path, key: KeyPair, cli
) -> None:
    proc = cli("inspect", art, "--json")
    assert proc.returncode == 0 and "attestation" not in json.loads(proc.stdout)
    signed = sign_ok(cli, art, str(key.private), env=GITHUB)
    proc = cli("inspect", art, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    for text in (
        f"signer key ids: {signed['keyid']}",
        "subject matches this artifact: yes",
        f"builder: {signed['builder']}",
        "not verified",
    ):
        assert text in proc.stdout
    seen = json.loads(cli("inspect", art, "--json").stdout)["attestation"]
    assert seen["verified"] is False and seen["sha256"] == sha(art)
    assert seen["envelopes"][0]["subject_match"] is True
    _another_artifact(tmp_path, art, key)
    proc = cli("inspect", art)
    assert proc.returncode == 0 and "NO (an attestation for another artifact)" in proc.stdout


# --- bake --sign-key ------------------------------------------------------------------------


@pytest.mark.slow  # one real CPU bake of the tiny MLP (~20-30 s)
def test_bake_sign_key_then_restore_verified(tmp_path: Path, key: KeyPair, write_spec, cli) -> None:
    spec = write_spec(mlp_spec())
    out = tmp_path / "m.kiln.tar.zst"
    proc = cli(
        "bake",
        spec,
        "-o",
        out,
        "--sign-key",
        "env:KEY",
        "--json",
        "--no-prove",  # the signing is the subject: the proof adds a process and nothing here
        env={"KEY": key.private_pem()},
    )
    assert proc.returncode == 0, proc.stderr
    baked = json.loads(proc.stdout)
    assert baked["attestation"] == f"{out}.intoto.jsonl"
    proc = cli("restore", out, "--dest", tmp_path / "cache", "--verify-key", key.public, "--json")
    assert proc.returncode == 0, proc.stderr
    prov = json.loads(proc.stdout)["provenance"]
    manifest = json.loads(cli("inspect", out, "--json").stdout)
    assert prov["sha256"] == baked["sha256"]
    assert prov["spec_sha256"] == manifest["spec_sha256"]
    assert prov["model_source_sha256"] == manifest["model_source_sha256"] is not None
    assert prov["torch"] == manifest["fingerprint"]["torch.version"]
    statement = statement_of(Path(baked["attestation"]))
    build = statement["predicate"]["buildDefinition"]
    assert build["externalParameters"]["spec"] == manifest["spec"]
    assert build["internalParameters"]["grid"] == ["batch=2", "batch=3", "batch=5"]
    assert build["internalParameters"]["coverage"]["buckets"] == 3
    meta = statement["predicate"]["runDetails"]["metadata"]
    assert meta["startedOn"] <= meta["finishedOn"]


def test_hostile_attestation_text_and_empty_key_lists_are_not_internal_errors(
    tmp_path: Path, art: Path, key: KeyPair, cli
) -> None:
    """A deeply nested JSON line is exit 3 (was a RecursionError, exit 1); an empty key list in
    the library is a usage error, never "verification off"."""
    (art.parent / f"{art.name}.intoto.jsonl").write_text("[" * 100_000 + "\n")
    r = cli("restore", art, "--dest", tmp_path / "d", "--verify-key", key.public, no_torch=True)
    assert r.returncode == 3, r.stderr
    assert not (tmp_path / "d").exists()
    with pytest.raises(UsageError, match="empty"):
        restore(art, tmp_path / "d", verify_keys=[])


def test_an_absurd_timeout_is_a_usage_error(tmp_path: Path, art: Path, cli) -> None:
    r = cli("restore", art, "--dest", tmp_path / "d", "--timeout", "1e300", no_torch=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def test_an_endless_attestation_is_refused_as_it_arrives(
    tmp_path: Path, art: Path, key, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review found attestations downloaded whole to a temp folder before their size was
    checked: a server could fill the pod's disk, and with no writable temp folder (a read-only
    root filesystem) the restore failed with exit 1. Now they are read into memory, capped."""
    import tempfile

    from tests.servers import Exchange, scripted_http

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-temp-folder"))
    data = art.read_bytes()

    def script(x: Exchange) -> None:
        if x.path.endswith(".intoto.jsonl"):
            x.head(Content_Type="application/octet-stream")  # no length, never-ending
            block = b"x" * (1 << 20)
            for _ in range(64):
                x.send(block)
        else:
            x.body(data)

    with scripted_http(script) as url, pytest.raises(IntegrityError, match="more than"):
        restore(f"{url}/{art.name}", tmp_path / "c", verify_keys=[str(key.public)])
    assert not (tmp_path / "c").exists()


def _signed_payload(path: Path, key: KeyPair, payload: bytes) -> None:
    """An envelope over ``payload`` that ``key`` really signed (no statement kiln would write)."""
    from securesystemslib.dsse import Envelope

    from kiln.artifact.keys import load_signing_key

    envelope = Envelope(payload, PAYLOAD_TYPE, {})
    envelope.sign(load_signing_key(str(key.private)).signer)
    path.write_text(json.dumps(envelope.to_dict()) + "\n")


def test_a_signed_but_deeply_nested_statement_is_exit_3(
    tmp_path: Path, art: Path, key: KeyPair, cli
) -> None:
    """Issue 27, item 6: a payload of 100k nested arrays, validly signed, was a RecursionError."""
    _signed_payload(Path(f"{art}.intoto.jsonl"), key, b"[" * 100_000 + b"]" * 100_000)
    proc = cli("restore", art, "--dest", tmp_path / "d", "--verify-key", key.public, no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "not JSON" in one_error(proc.stderr)
    assert not (tmp_path / "d").exists()


def _answer(status: str):
    def script(x) -> None:
        if status == "loop":
            x.redirect(x.path)  # to itself, for ever
        else:
            x.head(status, Content_Length=0)

    return script


@pytest.mark.parametrize("status", ["403 Forbidden", "500 Internal Server Error", "loop"])
def test_an_attestation_url_that_fails_is_exit_3(
    tmp_path: Path, art: Path, key: KeyPair, cli, status: str
) -> None:
    """Issue 27, item 6: "a missing or unreadable attestation: exit 3" (these were exit 1)."""
    from tests.servers import scripted_http

    with scripted_http(_answer(status)) as url:
        proc = cli(
            "restore", art, "--dest", tmp_path / "d", "--verify-key", key.public,
            "--attestation", f"{url}/a.intoto.jsonl", "--timeout", "20", no_torch=True,
        )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "cannot read the attestation" in one_error(proc.stderr)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("which", ["fifo", "/dev/zero", "folder"])
def test_an_attestation_that_is_not_a_file_is_exit_3(
    tmp_path: Path, art: Path, key: KeyPair, cli, which: str
) -> None:
    """Issue 27, item 6: was exit 2 worded "not an artifact file"."""
    where = tmp_path / "att"
    if which == "fifo":
        os.mkfifo(where)
    elif which == "folder":
        where.mkdir()
    else:
        where = Path(which)
    proc = cli(
        "restore", art, "--dest", tmp_path / "d", "--verify-key", key.public,
        "--attestation", where, no_torch=True,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert f"{where}: not an attestation file" in one_error(proc.stderr)
    assert not (tmp_path / "d").exists()
