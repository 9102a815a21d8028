# syntax=docker/dockerfile:1
# kiln images. Targets:
#   restore  slim, no torch: init containers, Docker build stages (`COPY --from`), `kiln restore/inspect/push`
#   bake     kiln on a CUDA PyTorch image: GPU CI runners (`kiln bake/verify/bench`)
# Build:  docker build --target restore -t kiln:restore .
#         docker build --target bake -t kiln:bake .
ARG PYTHON_IMAGE=python:3.12-slim
ARG TORCH_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel

FROM ${PYTHON_IMAGE} AS restore
# Storage clients to include (s3, gcs, oci); plain files and http(s) need none.
ARG KILN_EXTRAS=s3,gcs,oci
WORKDIR /opt/kiln-src
COPY pyproject.toml README.md ./
COPY src ./src
COPY scripts/deps.py scripts/install-restore.sh ./scripts/
RUN KILN_EXTRAS="${KILN_EXTRAS}" sh scripts/install-restore.sh python3 . \
    && rm -rf /opt/kiln-src
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
RUN python -m pip install --no-cache-dir ".[gpu,s3,gcs,oci]" \
    && python -c "import kiln, torch; print('kiln', kiln.__version__, 'torch', torch.__version__)"
WORKDIR /work
ENTRYPOINT ["kiln"]
CMD ["--help"]
