"""Deployment pieces: the Dockerfile's targets and the docker, Kubernetes and CI examples, checked
structurally, with their commands run for real where they can be (the CLI). The `restore` target
is built and run for real in test_docker_build.py, its install script with the built wheel in
test_packaging.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

import kiln
from kiln.grid import expand
from tests.archives import good_archive
from tests.conftest import ROOT
from tests.keys import make_key


def dockerfile_stages(path: Path) -> dict[str, list[str]]:
    """Stage name → its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if m:
            current = m.group(1) or f"stage{len(stages)}"
            stages[current] = []
        elif current:
            stages[current].append(line)
    return stages


def test_dockerfile_has_restore_and_bake_targets() -> None:
    stages = dockerfile_stages(ROOT / "Dockerfile")
    assert {"restore", "bake"} <= set(stages)
    restore = " ".join(stages["restore"])
    assert "scripts/install-restore.sh" in restore
    assert 'ENTRYPOINT ["kiln"]' in restore
    assert "torch" not in restore.replace("torch,", "")  # nothing in the stage installs torch
    assert 'ENTRYPOINT ["kiln"]' in " ".join(stages["bake"])


def test_docker_example_restore_line_runs(tmp_path: Path, cli) -> None:
    stages = dockerfile_stages(ROOT / "examples/docker/Dockerfile")
    caches, serving = stages["caches"], list(stages.values())[-1]
    run = next(i for i in caches if "kiln restore" in i)
    args = shlex.split(run[run.index("kiln restore") :])
    dest = Path(args[args.index("--dest") + 1])
    env_line = next(i for i in serving if i.startswith("ENV "))
    assert f"TORCHINDUCTOR_CACHE_DIR={dest}/inductor" in env_line
    assert any("COPY --from=caches" in i and str(dest) in i for i in serving)
    # The build verifies the signature, with the public key from a build secret.
    key_path = args[args.index("--verify-key") + 1]
    secret = re.search(r"--mount=type=secret,id=([\w-]+)", run)
    assert secret and key_path == f"/run/secrets/{secret.group(1)}"
    # Run the same command line, with the build's paths mapped into a temp folder.
    art = good_archive(tmp_path / "tiny-gpt.kiln.tar.zst")
    digest = kiln.restore(art, tmp_path / "probe").sha256
    private, public = signing_key(tmp_path)
    mapping = {
        "${KILN_SOURCE}": str(art),
        "${KILN_SHA256}": digest,
        str(dest): str(tmp_path / "opt/kiln/cache"),
        key_path: str(public),
    }
    real = [mapping.get(a, a) for a in args[1:]]
    proc = cli(*real, no_torch=True)
    assert proc.returncode == 3, proc.stderr  # unsigned: refused
    assert "no attestation there" in proc.stderr
    kiln.sign(art, str(private))
    proc = cli(*real, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert "attestation verified" in proc.stderr
    env = (tmp_path / "opt/kiln/cache/kiln.env").read_text()
    assert f"TORCHINDUCTOR_CACHE_DIR={tmp_path}/opt/kiln/cache/inductor" in env


def signing_key(tmp_path: Path) -> tuple[Path, Path]:
    """An Ed25519 key pair as PEM files."""
    pytest.importorskip("securesystemslib", reason="needs the [sign] extra")
    pair = make_key(tmp_path, "kiln-sign")
    return pair.private, pair.public


def load_deployment() -> dict:
    return yaml.safe_load((ROOT / "examples/kubernetes/deployment.yaml").read_text())


def test_kubernetes_deployment_validates_against_the_schema() -> None:
    import kubernetes_validate

    kubernetes_validate.validate(load_deployment(), "1.33.0", strict=True)


def test_kubernetes_deployment_wiring() -> None:
    pod = load_deployment()["spec"]["template"]["spec"]
    (init,), (server,) = pod["initContainers"], pod["containers"]
    users = {pod["securityContext"]["runAsUser"]}
    users |= {c["securityContext"]["runAsUser"] for c in (init, server)}
    assert users == {1000}
    assert init["args"][0] == "restore"
    source = init["args"][1]
    assert source.startswith("oci://") and "@sha256:" in source
    assert "--sha256" in init["args"]
    dest = init["args"][init["args"].index("--dest") + 1]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    server_mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["kiln-cache"] == server_mounts["kiln-cache"]
    assert dest.startswith(mounts["kiln-cache"] + "/")  # a subfolder: the mount can't be swapped
    assert next(v for v in pod["volumes"] if v["name"] == "kiln-cache")["emptyDir"] is not None
    script = server["args"][0]
    assert f". {dest}/kiln.env" in script
    ready = re.search(r"--ready-file (\S+)", script).group(1)
    assert f"--cache {dest}" in script
    assert server["startupProbe"]["exec"]["command"] == ["test", "-f", ready]
    assert script.index("kiln verify") < script.index("exec python")


def test_ci_workflow_wiring() -> None:
    wf = yaml.safe_load((ROOT / "examples/ci/github-actions.yml").read_text())
    jobs = wf["jobs"]
    runs = [s.get("run", "") for s in jobs["bake"]["steps"]]
    order = [
        next(i for i, r in enumerate(runs) if word in r)
        for word in ("kiln bake", "kiln restore", "kiln verify", "kiln push")
    ]
    assert order == sorted(order)
    assert jobs["image"]["needs"] == "bake"
    build = " ".join(
        s.get("run", "")
        for s in jobs["image"]["steps"]
        if "examples/docker/Dockerfile" in s.get("run", "")
    )
    for output in jobs["bake"]["outputs"]:
        assert f"needs.bake.outputs.{output}" in build
    docker_args = set(re.findall(r"--build-arg (\w+)=", build))
    declared = set(re.findall(r"ARG (\w+)", (ROOT / "examples/docker/Dockerfile").read_text()))
    assert docker_args <= declared


def dockerfile_args(path: Path) -> dict[str, str | None]:
    """ARG name → its default (None when it has none), over every stage."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"^ARG (\w+)(?:=(\S+))?", path.read_text(), re.MULTILINE)
    }


def test_the_examples_tell_one_story() -> None:
    """Issue 17, item 2: CI bakes, signs and pushes the spec the image serves and the Kubernetes
    example runs (a GPU spec, on a GPU), and builds exactly the images they use."""
    from kiln.spec import load_spec

    wf = yaml.safe_load((ROOT / "examples/ci/github-actions.yml").read_text())
    env, jobs = wf["env"], wf["jobs"]
    bake_steps, image_steps = jobs["bake"]["steps"], jobs["image"]["steps"]
    bake_run = " ".join(s.get("run", "") for s in bake_steps)
    image_run = " ".join(s.get("run", "") for s in image_steps)
    docker_args = dockerfile_args(ROOT / "examples/docker/Dockerfile")
    pod = load_deployment()["spec"]["template"]["spec"]
    (init,), (server,) = pod["initContainers"], pod["containers"]

    # The spec: baked in CI = served by the image = served and verified in Kubernetes; on cuda.
    spec = env["KILN_SPEC"]
    assert 'kiln bake "$KILN_SPEC"' in bake_run and 'kiln verify "$KILN_SPEC"' in bake_run
    assert docker_args["KILN_SPEC"] == spec
    assert "--build-arg KILN_SPEC=${{ env.KILN_SPEC }}" in image_run
    script = server["args"][0]
    served = set(re.findall(r"/app/(configs/\S+\.yaml)", script))
    assert served == {spec}
    assert load_spec(ROOT / spec).model.device == "cuda"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The CPU variant: the same model and grid, on cpu, shipped in the image too.
    cpu = load_spec(ROOT / "configs/tiny-gpt.yaml")
    gpu = load_spec(ROOT / spec)
    assert cpu.model.device == "cpu"
    assert cpu.model.kwargs == gpu.model.kwargs and cpu.buckets == gpu.buckets
    assert re.search(
        r"COPY configs/tiny-gpt\.yaml configs/tiny-gpt-cuda\.yaml /app/configs/",
        (ROOT / "examples/docker/Dockerfile").read_text(),
    )

    # Signed in the bake step with a CI secret, verified by every consumer.
    bake_step = next(s for s in bake_steps if "kiln bake" in s.get("run", ""))
    assert "--sign-key env:KILN_SIGNING_KEY" in bake_step["run"]
    assert bake_step["env"]["KILN_SIGNING_KEY"] == "${{ secrets.KILN_SIGNING_KEY }}"
    assert "--verify-key" in next(
        s["run"] for s in bake_steps if "kiln restore" in s.get("run", "")
    )
    key_arg = init["args"][init["args"].index("--verify-key") + 1]
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    mount = next(path for path in mounts if key_arg.startswith(path + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[mount])
    assert "configMap" in volume or "secret" in volume
    assert re.search(r"--secret id=kiln-verify-key,src=", image_run)

    # The images: CI builds the Docker example's bases under its default names, from the root
    # Dockerfile's targets, and pushes the two Kubernetes runs.
    assert (
        f"--target restore --build-arg KILN_EXTRAS=oci,sign -t {docker_args['KILN_IMAGE']} ."
        in image_run
    )
    assert f"--target bake -t {docker_args['SERVING_IMAGE']} ." in image_run
    registry = env["REGISTRY"]
    expanded = image_run.replace("${{ env.REGISTRY }}", registry)
    tags = re.findall(r"-t (\S+)", expanded)
    pushed = re.findall(r"docker push (\S+)", expanded)
    assert (
        f"docker tag {docker_args['KILN_IMAGE']} ${{{{ env.REGISTRY }}}}/kiln:restore" in image_run
    )
    assert init["image"] == f"{registry}/kiln:restore" and init["image"] in pushed
    server_tag = next(t for t in tags if "tiny-gpt-server" in t)
    release = wf[True]["push"]["tags"][0]  # "v*": github.ref_name is such a tag
    expected = server_tag
    assert server["image"].rsplit(":", 1)[0] == expected.rsplit(":", 1)[0]
    assert re.fullmatch(release.replace("*", ".+"), server["image"].rsplit(":", 1)[1])
    assert expected in pushed
    # The artifact: pushed with its attestation to the repository the init container restores.
    push_run = next(s["run"] for s in bake_steps if "kiln push" in s.get("run", ""))
    repo = re.search(r'"oci://\$REGISTRY/([\w-]+):', push_run).group(1)
    assert init["args"][1].startswith(f"oci://{registry}/{repo}@sha256:")
    assert ".attestation" in push_run


@pytest.mark.slow
def test_example_server_is_ready_with_zero_compiles(baked, tmp_path: Path) -> None:
    spec_path, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    from tests.servers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples/serve.py"),
            str(spec_path),
            "--cache",
            str(dest),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    state = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("server never became ready")
        assert state == {"ready": True, "compiles": 0}
    finally:
        proc.kill()
        proc.wait()


# --- sharded bakes (issue 14): the Indexed Job and the CI matrix ------------------------------
SCHEMAS = ROOT / "tests" / "schemas"
WORKFLOW_SCHEMA_SHA256 = "d10c9f4656e1bd5bc6727e9b35080e017dc167154726fca93da33c7a6bd1c4f3"
WORKFLOWS = ("github-actions.yml", "github-actions-sharded.yml")


def load_workflow(name: str) -> dict:
    """A workflow as GitHub reads it: YAML 1.1 turns the key `on` into True, GitHub does not."""
    wf = yaml.safe_load((ROOT / "examples/ci" / name).read_text())
    if True in wf:
        wf["on"] = wf.pop(True)
    return wf


@pytest.mark.parametrize("name", WORKFLOWS)
def test_ci_workflows_validate_against_the_schemastore_schema(name: str) -> None:
    import hashlib

    import jsonschema

    raw = (SCHEMAS / "github-workflow.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == WORKFLOW_SCHEMA_SHA256  # the vendored file
    schema = json.loads(raw)
    jsonschema.validators.validator_for(schema)(schema).validate(load_workflow(name))
    # The schema is strict enough to notice a mistake (a misspelt key of a job).
    broken = load_workflow(name)
    broken["jobs"]["bake"]["need"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def load_bake_job() -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "examples/kubernetes/bake-job.yaml").read_text()))


def test_kubernetes_bake_job_validates_against_the_schema() -> None:
    import kubernetes_validate

    docs = load_bake_job()
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    assert [d["kind"] for d in docs].count("Job") == 2


def test_kubernetes_bake_job_wiring(tmp_path: Path, write_spec, cli) -> None:
    """An Indexed Job of N shards of the served spec on GPUs, pushing to the volume the merge Job
    reads, which waits for it, merges all N, signs and pushes to the repository deployment.yaml
    restores from. Each shard's `kiln bake` line is run here up to the compile (torch blocked)."""
    from kiln.spec import load_spec

    docs = {(d["kind"], d["metadata"]["name"]): d for d in load_bake_job()}
    bake, merge = docs[("Job", "tiny-gpt-bake")], docs[("Job", "tiny-gpt-merge")]
    spec = bake["spec"]
    assert spec["completionMode"] == "Indexed"
    count = spec["completions"]
    assert spec["parallelism"] == count
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["SHARDS"]) == count
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["securityContext"]["runAsUser"] == 1000 and env["TMPDIR"]
    script = container["args"][0]
    assert "--shard $(JOB_COMPLETION_INDEX)/$(SHARDS)" in script
    served = re.search(r"kiln bake (\S+)", script).group(1)
    pod_spec = load_deployment()["spec"]["template"]["spec"]
    assert served in pod_spec["containers"][0]["args"][0]  # the spec the Deployment serves
    local = ROOT / served.removeprefix("/app/")
    assert len(expand(load_spec(local))) >= count  # every shard gets a bucket
    # The shard lines as the kubelet expands them, run up to the compile: each is accepted.
    for index in (0, count - 1):
        line = script.replace("$(JOB_COMPLETION_INDEX)", str(index))
        line = line.replace("$(SHARDS)", str(count)).replace("$(RELEASE)", env["RELEASE"])
        assert f"--shard {index}/{count}" in line
    bad = cli("bake", local, "--shard", f"{count}/{count}", no_torch=True)
    assert bad.returncode == 2  # one past the last index: exit 2, nothing compiled
    push_to = re.search(r"kiln push \S+ (\S+)", script).group(1)
    shards_mount = next(m for m in container["volumeMounts"] if m["name"] == "shards")
    assert push_to.startswith(shards_mount["mountPath"] + "/")

    mpod = merge["spec"]["template"]["spec"]
    (wait,) = mpod["initContainers"]
    assert "job/tiny-gpt-bake" in wait["args"] and "--for=condition=complete" in wait["args"]
    role = docs[("Role", "tiny-gpt-merge")]
    assert role["rules"][0]["resourceNames"] == ["tiny-gpt-bake"]
    assert (
        docs[("RoleBinding", "tiny-gpt-merge")]["subjects"][0]["name"] == mpod["serviceAccountName"]
    )
    (mc,) = mpod["containers"]
    assert int({e["name"]: e["value"] for e in mc["env"]}["SHARDS"]) == count
    mscript = mc["args"][0]
    order = [mscript.index(w) for w in ("kiln merge", "kiln sign", "kiln push")]
    assert order == sorted(order)
    assert "--partial" not in mscript  # every shard or nothing
    volumes = {v["name"]: v for v in mpod["volumes"]}
    claim = volumes["shards"]["persistentVolumeClaim"]["claimName"]
    assert (
        claim
        == {v["name"]: v for v in pod["volumes"]}["shards"]["persistentVolumeClaim"]["claimName"]
    )
    assert docs[("PersistentVolumeClaim", claim)]["spec"]["accessModes"] == ["ReadWriteMany"]
    restored = pod_spec["initContainers"][0]["args"][1]  # oci://…/tiny-gpt-cache@sha256:…
    assert f"kiln push tiny-gpt.kiln.tar.zst {restored.split('@')[0]}:" in mscript
    assert mc["image"] == pod_spec["initContainers"][0]["image"]  # kiln:restore: no torch


def test_ci_matrix_tells_the_same_story() -> None:
    """The sharded workflow: a matrix over every shard index, a merge job that needs it and
    hands on the outputs the single-job workflow's bake hands on, and the same image job."""
    main, sharded = load_workflow(WORKFLOWS[0]), load_workflow(WORKFLOWS[1])
    assert {k: v for k, v in sharded["env"].items() if k != "SHARDS"} == main["env"]
    assert sharded["on"] == main["on"]
    shard_job, bake_job = sharded["jobs"]["shard"], sharded["jobs"]["bake"]
    count = int(sharded["env"]["SHARDS"])
    assert shard_job["strategy"]["matrix"]["shard"] == list(range(count))
    assert shard_job["runs-on"] == bake_job["runs-on"] == main["jobs"]["bake"]["runs-on"]
    bake_line = next(s["run"] for s in shard_job["steps"] if "kiln bake" in s.get("run", ""))
    assert '--shard "${{ matrix.shard }}/$SHARDS"' in bake_line
    upload = next(s for s in shard_job["steps"] if "upload-artifact" in s.get("uses", ""))
    assert upload["with"]["path"] in bake_line
    assert bake_job["needs"] == "shard"
    runs = [s.get("run", "") for s in bake_job["steps"]]
    order = [
        next(i for i, r in enumerate(runs) if w in r)
        for w in ("kiln merge", "kiln sign", "kiln restore", "kiln verify", "kiln push")
    ]
    assert order == sorted(order)
    assert "--partial" not in " ".join(runs)
    assert bake_job["outputs"] == main["jobs"]["bake"]["outputs"]
    assert sharded["jobs"]["image"] == main["jobs"]["image"]
    main_push = next(s for s in main["jobs"]["bake"]["steps"] if s.get("id") == "push")
    assert next(s for s in bake_job["steps"] if s.get("id") == "push") == main_push
