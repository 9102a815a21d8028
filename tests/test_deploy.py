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
    # Where the server activates the caches: where the build restored them. Not one of
    # kiln.env's variables alone (a plain torch.compile server would miss with it: kiln check).
    assert f"KILN_CACHE_DIR={dest} " in env_line and "TORCHINDUCTOR_CACHE_DIR" not in env_line
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
    """The server runs the image that holds the caches: verify gates the probes, then it serves."""
    pod = load_deployment()["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert "initContainers" not in pod and "volumes" not in pod  # the image holds the caches
    assert pod["securityContext"]["runAsUser"] == 1000
    script = server["args"][0]
    ready = re.search(r"--ready-file (\S+)", script).group(1)
    assert '--cache "$KILN_CACHE_DIR"' in script
    assert server["startupProbe"]["exec"]["command"] == ["test", "-f", ready]
    assert script.index("kiln verify") < script.index("exec python")
    # The image sets what the script reads, at the path its build restored to.
    serving = list(dockerfile_stages(ROOT / "examples/docker/Dockerfile").values())[-1]
    env_line = next(i for i in serving if i.startswith("ENV "))
    assert "KILN_CACHE_DIR=/opt/kiln/cache" in env_line and "KILN_SPEC=" in env_line


def test_ci_workflow_wiring() -> None:
    wf = yaml.safe_load((ROOT / "examples/ci/github-actions.yml").read_text())
    jobs = wf["jobs"]
    runs = [s.get("run", "") for s in jobs["bake"]["steps"]]
    order = [
        next(i for i, r in enumerate(runs) if word in r)
        for word in ("kiln bake", "kiln restore", "kiln verify", "kiln push")
    ]
    assert order == sorted(order)
    assert set(jobs["image"]["needs"]) == {"images", "bake"}
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
    """Issues 17 and 29, item 2: CI bakes, signs and pushes the spec the image serves and the
    Kubernetes example runs (a GPU spec, on a GPU), inside the image that serves it, and builds
    exactly the images they use."""
    from kiln.spec import load_spec

    wf = yaml.safe_load((ROOT / "examples/ci/github-actions.yml").read_text())
    env, jobs = wf["env"], wf["jobs"]
    bake_steps, image_steps = jobs["bake"]["steps"], jobs["image"]["steps"]
    bake_run = " ".join(s.get("run", "") for s in bake_steps)
    image_run = " ".join(s.get("run", "") for s in image_steps)
    docker_args = dockerfile_args(ROOT / "examples/docker/Dockerfile")
    pod = load_deployment()["spec"]["template"]["spec"]
    (server,) = pod["containers"]

    # The spec: baked in CI = served by the image = served and verified in Kubernetes; on cuda.
    spec = env["KILN_SPEC"]
    assert 'kiln bake "$KILN_SPEC"' in bake_run and 'kiln verify "$KILN_SPEC"' in bake_run
    assert docker_args["KILN_SPEC"] == spec
    assert "--build-arg KILN_SPEC=${{ env.KILN_SPEC }}" in image_run
    script = server["args"][0]
    assert '"$KILN_SPEC"' in script  # the image's KILN_SPEC, /app/ + its build argument
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
    assert re.search(r"--secret id=kiln-verify-key,src=", image_run)

    # The images: CI builds the Docker example's bases from the root Dockerfile's targets,
    # pushes them, and hands kiln:bake on by digest; the bake runs inside that very image and
    # the serving image is built on it: one torch build bakes and serves (issue 29, item 2).
    images = jobs["images"]
    images_run = " ".join(s.get("run", "") for s in images["steps"])
    registry = env["REGISTRY"]
    assert '--target restore --build-arg KILN_EXTRAS=oci,sign -t "$REGISTRY/kiln:restore" .' in (
        images_run
    )
    assert '--target bake -t "$REGISTRY/kiln:bake" .' in images_run
    pushed = re.findall(r'docker push "?([^"\s]+)', images_run)
    assert pushed == ["$REGISTRY/kiln:restore", "$REGISTRY/kiln:bake"]
    assert "RepoDigests" in images_run  # handed on by digest, not by a tag that can move
    assert jobs["bake"]["needs"] == "images"
    bake_image = "${{ needs.images.outputs.bake_image }}"
    assert jobs["bake"]["container"]["image"] == bake_image
    assert "--gpus" in jobs["bake"]["container"]["options"]
    assert f"--build-arg SERVING_IMAGE={bake_image}" in image_run
    restore_image = "${{ needs.images.outputs.restore_image }}"
    assert f"--build-arg KILN_IMAGE={restore_image}" in image_run
    assert {"KILN_IMAGE", "SERVING_IMAGE"} <= set(docker_args)
    # The bake Job on Kubernetes uses the images CI pushes (as the sharded workflow does).
    k8s_images = {
        c["image"]
        for d in load_bake_job()
        if d["kind"] == "Job"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert k8s_images == {f"{registry}/kiln:bake", f"{registry}/kiln:restore"}
    # The serving image: pushed under the tag the Deployment runs; it holds the caches, so the
    # Deployment pins nothing else (one digest, pinned once, by the image build).
    expanded = image_run.replace("${{ env.REGISTRY }}", registry)
    server_tag = next(t for t in re.findall(r"-t (\S+)", expanded) if "tiny-gpt-server" in t)
    assert server_tag in re.findall(r"docker push (\S+)", expanded)
    release = wf[True]["push"]["tags"][0]  # "v*": github.ref_name is such a tag
    assert server["image"].rsplit(":", 1)[0] == server_tag.rsplit(":", 1)[0]
    assert re.fullmatch(release.replace("*", ".+"), server["image"].rsplit(":", 1)[1])
    deployment_text = (ROOT / "examples/kubernetes/deployment.yaml").read_text()
    assert "sha256:" not in deployment_text and "REPLACE_WITH" not in deployment_text
    # The artifact: pushed with its attestation, pinned into the serving image's build.
    push_run = next(s["run"] for s in bake_steps if "kiln push" in s.get("run", ""))
    assert re.search(r'"oci://\$REGISTRY/tiny-gpt-cache:', push_run)
    assert 'push["attestation"]' in push_run
    assert "--build-arg KILN_SOURCE=${{ needs.bake.outputs.pinned }}" in image_run


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


def test_kubernetes_bake_job_wiring(cli) -> None:
    """An Indexed Job of N shards of the served spec on GPUs, pushing to the volume the merge Job
    reads, which waits for it, merges all N, signs and pushes to the repository the serving
    image is built from. The scripts themselves run in test_kubernetes_bake_job_runs."""
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
    assert '--shard "$JOB_COMPLETION_INDEX/$SHARDS"' in script
    served = re.search(r"kiln bake (\S+)", script).group(1)
    local = ROOT / served.removeprefix("/app/")
    wf = yaml.safe_load((ROOT / "examples/ci/github-actions.yml").read_text())
    assert served == f"/app/{wf['env']['KILN_SPEC']}"  # the spec the serving image serves
    assert len(expand(load_spec(local))) >= count  # every shard gets a bucket
    bad = cli("bake", local, "--shard", f"{count}/{count}", no_torch=True)
    assert bad.returncode == 2  # one past the last index: exit 2, nothing compiled
    shards_mount = next(m for m in container["volumeMounts"] if m["name"] == "shards")
    assert f'"{shards_mount["mountPath"]}/$RELEASE/"' in script

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
    # Pushed to the repository the CI's bake pushes to (the serving image's KILN_SOURCE).
    ci_push = next(s["run"] for s in wf["jobs"]["bake"]["steps"] if s.get("id") == "push")
    repo = re.search(r'"oci://\$REGISTRY/([\w-]+):', ci_push).group(1)
    assert f'"oci://{wf["env"]["REGISTRY"]}/{repo}:$RELEASE"' in mscript
    assert mc["image"] == f"{wf['env']['REGISTRY']}/kiln:restore"  # no torch


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
    assert bake_job["needs"] == ["images", "shard"]
    # Both GPU jobs run inside the image that serves, as the single-job workflow's bake does.
    assert shard_job["container"] == bake_job["container"] == main["jobs"]["bake"]["container"]
    assert sharded["jobs"]["images"] == main["jobs"]["images"]
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


# --- the examples' commands as they really run (issue 29, item 1) -----------------------------
def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """``text`` as the kubelet expands a container's command and args before anything runs
    (k8s.io/kubernetes third_party/forked/golang/expansion, ``Expand``): ``$(NAME)`` becomes
    NAME's value when the container defines NAME, ``$$`` becomes ``$``, and everything else, an
    unknown name included, stays as written. A name runs to the first ``)``, so
    ``$(ls /x/$(RELEASE)`` is one unknown name, left for the shell to run as a command."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":  # an escaped operator
            out.append("$")
            i += 2
        elif text[i + 1] == "(":
            close = text.find(")", i + 2)
            if close == -1:  # an incomplete reference: kept
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : close]
                out.append(env.get(name, f"$({name})"))
                i = close + 1
        else:  # `$x`: not a reference
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


@pytest.mark.parametrize(
    ("text", "expanded"),
    [  # kubernetes' own expand_test.go cases, and the one that broke the bake Job
        ("$(VAR_A)", "A"),
        ("___$(VAR_B)___", "___B___"),
        ("$(VAR_A)-$(VAR_A)", "A-A"),
        ("$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),
        ("$(VAR_DNE)", "$(VAR_DNE)"),
        ("$$$$$$(BIG_MONEY)", "$$$(BIG_MONEY)"),
        ("f000-$$VAR_A", "f000-$VAR_A"),
        ("$VAR_A", "$VAR_A"),
        ("foo$", "foo$"),
        ("$(VAR_A", "$(VAR_A"),
        ('test "$(ls /s/$(VAR_A) | wc -l)"', 'test "$(ls /s/$(VAR_A) | wc -l)"'),
    ],
)
def test_kubelet_expansion_rules(text: str, expanded: str) -> None:
    assert kubelet_expand(text, {"VAR_A": "A", "VAR_B": "B"}) == expanded


def kubernetes_scripts(index: int = 0) -> dict[str, tuple[str, dict[str, str]]]:
    """Every ``sh -c`` script in the Kubernetes examples, as the kubelet hands it to the shell:
    "file:object/container" → (script, the container's environment). An Indexed Job's pods also
    get JOB_COMPLETION_INDEX (here ``index``), as the Job controller sets it."""
    scripts = {}
    for name in ("bake-job.yaml", "deployment.yaml"):
        for doc in yaml.safe_load_all((ROOT / "examples/kubernetes" / name).read_text()):
            pod = doc.get("spec", {}).get("template", {}).get("spec")
            if pod is None:
                continue
            indexed = doc["spec"].get("completionMode") == "Indexed"
            for c in pod.get("initContainers", []) + pod["containers"]:
                if c.get("command", [])[:2] != ["sh", "-c"]:
                    continue
                env = {e["name"]: e["value"] for e in c.get("env", [])}
                if indexed:
                    env["JOB_COMPLETION_INDEX"] = str(index)
                (script,) = c["args"]
                where = f"{name}:{doc['metadata']['name']}/{c['name']}"
                scripts[where] = (kubelet_expand(script, env), env)
    return scripts


def workflow_scripts() -> dict[str, str]:
    """Every `run:` of the CI examples, GitHub's ``${{ … }}`` replaced by a word (as GitHub does
    before bash sees the script)."""
    out = {}
    for name in WORKFLOWS:
        for job_name, job in load_workflow(name)["jobs"].items():
            for n, step in enumerate(job["steps"]):
                if "run" in step:
                    run = re.sub(r"\$\{\{[^}]*\}\}", "EXPR", step["run"])
                    out[f"{name}:{job_name}[{n}]"] = run
    return out


def dockerfile_runs() -> dict[str, str]:
    """Every RUN of the two Dockerfiles as /bin/sh gets it (BuildKit's --mount flags removed)."""
    out = {}
    for path in (ROOT / "Dockerfile", ROOT / "examples/docker/Dockerfile"):
        for stage, lines in dockerfile_stages(path).items():
            for n, line in enumerate(lines):
                if line.startswith("RUN "):
                    out[f"{path.relative_to(ROOT)}:{stage}[{n}]"] = re.sub(
                        r"--mount=\S+\s+", "", line.removeprefix("RUN ")
                    )
    return out


def test_every_example_command_parses() -> None:
    """`sh -n` (bash -n for GitHub's `run:`) over every shell command the examples hold, and no
    `$(NAME)` meant for the kubelet that it cannot expand (it would reach the shell as a
    command: the bake Job once ran `RELEASE` and never published)."""
    k8s = kubernetes_scripts()
    assert len(k8s) == 3  # the bake pods, the merge pod, the server
    for where, (script, env) in k8s.items():
        left = {n for n in re.findall(r"\$\((\w+)\)", script) if n in env}
        assert not left, f"{where}: the kubelet leaves $({min(left)}) for the shell to run"
        proc = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"{where}: {proc.stderr}"
    runs = {**workflow_scripts(), **dockerfile_runs()}
    assert len(runs) >= 15
    for where, script in runs.items():
        shell = "bash" if where.endswith("]") and ".yml:" in where else "sh"
        proc = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"{where}: {proc.stderr}"


KILN_SHIM = """#!/bin/sh
# `kiln` in the example's pods: bake hands out a prepared shard (this machine has no GPU);
# every other command is the real, torch-free kiln.
echo "$*" >> "{log}"
if [ "$1" = bake ]; then
  shift; out=; shard=
  while [ $# -gt 0 ]; do
    case "$1" in -o) out=$2; shift;; --shard) shard=$2; shift;; esac; shift
  done
  cp "{shards}/shard-${{shard%%/*}}.kiln.tar.zst" "$out" && echo '{{}}'
  exit $?
fi
exec "{python}" -c 'import sys; sys.modules["torch"] = None; sys.modules["triton"] = None; \\
sys.argv[0] = "kiln"; from kiln.cli import main; main()' "$@"
"""


def run_pod_script(script: str, env: dict[str, str], cwd: Path, mapping: dict[str, str], path):
    """``script`` run by sh as the pod would, its absolute paths mapped into a temp folder."""
    pattern = re.compile("|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)))
    mapped = pattern.sub(lambda m: mapping[m.group(0)], script)
    cwd.mkdir(parents=True, exist_ok=True)
    full = {"PATH": f"{path}:/usr/bin:/bin", "HOME": str(cwd), **env}
    return subprocess.run(["sh", "-c", mapped], cwd=cwd, env=full, capture_output=True, text=True)


def test_kubernetes_bake_job_runs(tmp_path: Path) -> None:
    """The sharded bake Job's scripts, run for real as the kubelet and sh run them: each bake pod
    pushes its shard (the compile itself is stood in for: no GPU here), then the merge pod's
    script checks the count, merges, signs and publishes. With a shard missing it publishes
    nothing."""
    from tests.test_merge import shard_artifact

    spec = ROOT / "configs/tiny-gpt-cuda.yaml"
    count = int(kubernetes_scripts()["bake-job.yaml:tiny-gpt-bake/bake"][1]["SHARDS"])
    made = tmp_path / "made"
    made.mkdir()
    for i in range(count):
        shard_artifact(made, spec, i, count)
    bin_dir, log = tmp_path / "bin", tmp_path / "kiln.log"
    bin_dir.mkdir()
    shim = bin_dir / "kiln"
    shim.write_text(KILN_SHIM.format(log=log, shards=made, python=sys.executable))
    shim.chmod(0o755)
    key, _ = signing_key(tmp_path)
    mapping = {
        "/shards": str(tmp_path / "pvc"),
        "/etc/kiln/signing/kiln-sign.pem": str(key),
        "oci://registry.example.com/ml/": str(tmp_path / "registry") + "/",
    }
    (tmp_path / "registry").mkdir()

    for i in range(count):
        script, env = kubernetes_scripts(i)["bake-job.yaml:tiny-gpt-bake/bake"]
        env = {**env, "TMPDIR": str(tmp_path / f"scratch-{i}")}
        proc = run_pod_script(script, env, tmp_path / f"scratch-{i}", mapping, bin_dir)
        assert proc.returncode == 0, proc.stderr
    release = env["RELEASE"]
    pushed = sorted(p.name for p in (tmp_path / "pvc" / release).iterdir())
    assert pushed == [f"shard-{i}.kiln.tar.zst" for i in range(count)]
    bakes = [line for line in log.read_text().splitlines() if line.startswith("bake ")]
    assert [b.split("--shard ")[1].split()[0] for b in bakes] == [
        f"{i}/{count}" for i in range(count)
    ]

    script, env = kubernetes_scripts()["bake-job.yaml:tiny-gpt-merge/merge"]
    proc = run_pod_script(script, env, tmp_path / "work", mapping, bin_dir)
    assert proc.returncode == 0, proc.stderr
    published = tmp_path / "registry" / f"tiny-gpt-cache:{release}"
    assert published.is_file() and Path(f"{published}.intoto.jsonl").is_file()
    push = json.loads((tmp_path / "work" / "push.json").read_text())
    assert push["sha256"] == json.loads((tmp_path / "work" / "merge.json").read_text())["sha256"]
    assert kiln.read_manifest(published).shard.complete

    # One shard short: the count check stops the pod before anything is merged or published.
    (tmp_path / "pvc" / release / "shard-1.kiln.tar.zst").unlink()
    published.unlink()
    proc = run_pod_script(script, env, tmp_path / "work2", mapping, bin_dir)
    assert proc.returncode != 0
    assert not published.exists() and not (tmp_path / "work2" / "tiny-gpt.kiln.tar.zst").exists()


@pytest.mark.parametrize("name", WORKFLOWS)
def test_ci_push_step_hands_on_what_it_pushed(tmp_path: Path, name: str) -> None:
    """The bake job's push step, run by bash as GitHub runs it (`bash -e`), with `kiln push`
    standing in for a registry: it hands on the artifact's digest and pinned reference, and
    fails when the attestation did not go with the artifact."""
    step = next(s for s in load_workflow(name)["jobs"]["bake"]["steps"] if s.get("id") == "push")
    script = re.sub(r"\$\{\{[^}]*\}\}", "abc123", step["run"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kiln"
    shim.write_text('#!/bin/sh\ncat "$KILN_PUSH_JSON"\n')
    shim.chmod(0o755)
    pushed = {"sha256": "a" * 64, "pinned": "oci://r.example/ml/tiny-gpt-cache@sha256:" + "b" * 64}
    for attestation in ("oci://r.example/ml/tiny-gpt-cache@sha256:" + "c" * 64, None):
        (tmp_path / "push-in.json").write_text(json.dumps({**pushed, "attestation": attestation}))
        out = tmp_path / "github_output"
        out.write_text("")
        proc = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=tmp_path,
            env={
                "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
                "GITHUB_OUTPUT": str(out),
                "REGISTRY": "r.example/ml",
                "KILN_PUSH_JSON": str(tmp_path / "push-in.json"),
            },
            capture_output=True,
            text=True,
        )
        if attestation is None:
            assert proc.returncode != 0 and out.read_text() == ""
        else:
            assert proc.returncode == 0, proc.stderr
            assert out.read_text().splitlines() == [
                f"artifact_sha256={pushed['sha256']}",
                f"pinned={pushed['pinned']}",
            ]
