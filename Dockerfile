# syntax=docker/dockerfile:1
# kiln images. Targets:
#   restore  slim, no torch: init containers, Docker build stages (`COPY --from`), `kiln restore/inspect/push`
#   bake     kiln on a CUDA PyTorch image: GPU CI runners (`kiln bake/verify/bench`)
# Build:  docker build --target restore -t kiln:restore .
#         docker build --target bake -t kiln:bake .
# The bases are build arguments: PYTHON_IMAGE may be any image with python3 (3.10+) and its venv
# module, e.g. python:3.12-slim or a Debian one with python3 + python3-venv (the test suite,
# tests/test_docker_build.py, builds `restore` on a base made with debootstrap).
ARG PYTHON_IMAGE=python:3.12-slim
ARG TORCH_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel

FROM ${PYTHON_IMAGE} AS restore
# Storage clients to include (s3, gcs, oci); plain files and http(s) need none.
ARG KILN_EXTRAS=s3,gcs,oci
# The package index for pip, where pypi.org is not the one to use (a mirror); unset, pip's own
# defaults apply. Build arguments are recorded in the image's history: no credentials in them.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
WORKDIR /opt/kiln-src
COPY pyproject.toml README.md ./
COPY src ./src
COPY scripts/deps.py scripts/install-restore.sh ./scripts/
# kiln lives in a virtualenv, /opt/kiln, not in the base's Python: Debian's python3 refuses
# `pip install` into the system (PEP 668), and a venv works the same on every base.
RUN python3 -m venv /opt/kiln \
    && KILN_EXTRAS="${KILN_EXTRAS}" sh scripts/install-restore.sh /opt/kiln/bin/python . \
    && rm -rf /opt/kiln-src /root/.cache
ENV PATH=/opt/kiln/bin:${PATH}
WORKDIR /
# Same non-root uid as the serving container in examples/kubernetes (restored files keep it).
USER 1000:1000
ENTRYPOINT ["kiln"]
CMD ["--help"]

FROM ${TORCH_IMAGE} AS bake
WORKDIR /opt/kiln-src
COPY pyproject.toml README.md ./
COPY src ./src
# The base image's torch satisfies kiln's `torch>=` requirement: pip keeps it.
# Bytecode for torch's Python: a serving process imports Dynamo and Inductor, and where the base
# ships no __pycache__ every start compiles them from source first (kiln.bytecode measures it).
RUN python -m pip install --no-cache-dir ".[gpu,s3,gcs,oci]" \
    && python -m compileall -q "$(python -c 'import os, torch; print(os.path.dirname(torch.__file__))')" \
    && python -c "import kiln, torch; print('kiln', kiln.__version__, 'torch', torch.__version__)"
WORKDIR /work
ENTRYPOINT ["kiln"]
CMD ["--help"]
